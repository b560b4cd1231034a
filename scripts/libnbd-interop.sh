#!/usr/bin/env bash
# Runs libnbd's own interoperability tests (vendored unmodified in
# third_party/libnbd-interop) against `diskit serve`, built as upstream's
# interop/Makefile.am builds them for nbdkit: each program compiled once per
# server command line, with SERVER set to diskit. Covered: the `file` and
# `memory` plugins over stdin/stdout (-s --exit-with-parent) and by socket
# activation, TLS with certificates and with PSK (required, allowed, and
# allowed with a server that has TLS off), and the export list.
#
# Installs the build dependencies when missing (gcc, pkg-config, libnbd-dev,
# gnutls-bin for certtool and psktool, libssl3, which `diskit serve --tls-psk`
# loads at run time), builds the programs once (cached under
# target/libnbd-interop/, rebuilt when their sources change) and diskit (cargo
# build, unless $DISKIT names one), then runs each. Exits non-zero with the
# program's output if any fails or skips itself (exit status 77). Prints
# "libnbd-interop: N passed, N failed" last.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/packages.sh
c_build_setup libnbd-interop
need_pkg libnbd libnbd-dev
command -v certtool >/dev/null || need+=(gnutls-bin)
command -v psktool >/dev/null || need+=(gnutls-bin)
# PSK: diskit loads OpenSSL 3 when asked for it (nothing links it).
grep -q 'libssl\.so\.3 ' < <(/sbin/ldconfig -p 2>/dev/null) || need+=(libssl3)
install_missing libnbd-interop "${need[@]}"

# DISKIT: a diskit already built (scripts/test passes the one its test run
# built).
if [ -n "${DISKIT:-}" ]; then
  diskit=$DISKIT
else
  cargo build -p diskit --quiet
  diskit=$target/debug/diskit
fi

# The variants: NAME SOURCE CPP-FLAGS... (SERVER_PARAMS as upstream writes
# them, C string literals; TMPFILE and tmpfile are the programs' own
# temporary files of 1 MiB, and memory exports have the same size).
variants=()
variant() { variants+=("$(printf '%q ' "$@")"); }
file_s='"serve", "-s", "--exit-with-parent", "file", TMPFILE'
memory_s='"serve", "-s", "--exit-with-parent", "memory", "1048576"'
certs='"--tls-certificates=../tests/pki"'
psk='"--tls-psk=../tests/keys.psk"'
variant interop-file interop.c -DNEEDS_TMPFILE=1 "-DSERVER_PARAMS=$file_s"
variant interop-memory interop.c "-DSERVER_PARAMS=$memory_s"
for plugin in file memory; do
  if [ $plugin = file ]; then
    tail='"-s", "--exit-with-parent", "file", TMPFILE'
    tmpflag=-DNEEDS_TMPFILE=1
  else
    tail='"-s", "--exit-with-parent", "memory", "1048576"'
    tmpflag=
  fi
  # Each kind of key (X.509 certificates, PSK): TLS required, allowed and
  # taken, allowed and refused by the server (the client falls back).
  for kind in certs psk; do
    if [ $kind = certs ]; then keyflag=-DCERTS=1 keys=$certs; else keyflag=-DPSK=1 keys=$psk; fi
    variant "interop-$plugin-tls-$kind" interop.c $tmpflag $keyflag -DTLS_MODE=LIBNBD_TLS_REQUIRE \
      "-DSERVER_PARAMS=\"serve\", \"--tls=require\", $keys, $tail"
    variant "interop-$plugin-tls-$kind-allow-enabled" interop.c $tmpflag $keyflag -DTLS_MODE=LIBNBD_TLS_ALLOW \
      "-DSERVER_PARAMS=\"serve\", \"--tls=require\", $keys, $tail"
    variant "interop-$plugin-tls-$kind-allow-fallback" interop.c $tmpflag $keyflag -DTLS_MODE=LIBNBD_TLS_ALLOW \
      -DTLS_FALLBACK=1 "-DSERVER_PARAMS=\"serve\", \"--tls=off\", $tail"
  done
done
variant socket-activation-file socket-activation.c '-DSERVER_PARAMS="serve", "file", tmpfile'
variant socket-activation-memory socket-activation.c '-DSERVER_PARAMS="serve", "memory", "1048576"'
variant interop-file-socket-activation interop.c -DNEEDS_TMPFILE=1 -DSOCKET_ACTIVATION=1 \
  '-DSERVER_PARAMS="serve", "file", TMPFILE'
# The export list, as upstream checks qemu-nbd's (-x NAME -D DESCRIPTION),
# under diskit's qemu-nbd, and under serve as nbdkit names and describes
# exports (the exportname filter).
variant list-exports-qemu-nbd list-exports.c -DNEEDS_TMPFILE=1 -DSOCKET_ACTIVATION=1 \
  '-DEXPORTS="testing"' '-DDESCRIPTIONS="data"' \
  '-DSERVER_PARAMS="qemu-nbd", "-f", "raw", "-x", "testing", "-D", "data", TMPFILE'
named='"exportname-list=explicit", "exportname=testing", "exportdesc=fixed:data"'
variant list-exports-file list-exports.c -DNEEDS_TMPFILE=1 '-DEXPORTS="testing"' '-DDESCRIPTIONS="data"' \
  "-DSERVER_PARAMS=\"serve\", \"-s\", \"--exit-with-parent\", \"--filter=exportname\", \"file\", TMPFILE, $named"
variant list-exports-memory list-exports.c '-DEXPORTS="testing"' '-DDESCRIPTIONS="data"' \
  "-DSERVER_PARAMS=\"serve\", \"-s\", \"--exit-with-parent\", \"--filter=exportname\", \"memory\", \"1M\", $named"
variant list-exports-socket-activation list-exports.c -DSOCKET_ACTIVATION=1 '-DEXPORTS="testing"' \
  '-DDESCRIPTIONS="data"' "-DSERVER_PARAMS=\"serve\", \"--filter=exportname\", \"memory\", \"1M\", $named"

# Build every variant once per version of the sources, this script and the
# path of diskit (compiled into the programs).
cache=$target/libnbd-interop
stamp=$( (cat "$src"/interop/*.c "$src"/tests/*.[ch] "$src"/common/include/*.h "$0"; echo "$diskit") |
  sha256sum | cut -c1-16)
bin=$cache/$stamp
if [ ! -f "$bin/.built" ]; then
  echo "== libnbd-interop: building ${#variants[@]} programs"
  rm -rf "$cache"
  mkdir -p "$bin"
  for v in "${variants[@]}"; do
    eval "set -- $v"
    name=$1 source=$2
    shift 2
    # shellcheck disable=SC2046
    cc -O1 -std=gnu11 -I"$src" -I"$src/tests" -I"$src/common/include" \
      "-DSERVER=\"$diskit\"" "$@" $(pkg-config --cflags libnbd) \
      -o "$bin/$name" "$src/interop/$source" "$src/tests/requires.c" $(pkg-config --libs libnbd)
  done
  touch "$bin/.built"
fi

tmp=$(mktemp -d "${TMPDIR:-/tmp}/diskit-libnbd-interop.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
# The programs name ../tests/pki and ../tests/keys.psk, and so do the server
# command lines: both run in $tmp/interop.
mkdir -p "$tmp/interop" "$tmp/tests"
touch "$tmp/tests/connect-tls.c" # make-pki.sh checks that it runs from libnbd's tests/
(cd "$tmp/tests" && SRCDIR=. CERTTOOL=certtool bash "$src/tests/make-pki.sh" pki) >"$tmp/make-pki.log" 2>&1 ||
  { cat "$tmp/make-pki.log"; exit 1; }
psktool -u alice -p "$tmp/tests/keys.psk" >/dev/null

echo "== libnbd-interop: libnbd $(pkg-config --modversion libnbd) against $diskit"
passed=0
failed=0
failures=()
for v in "${variants[@]}"; do
  eval "set -- $v"
  name=$1
  status=0
  (cd "$tmp/interop" && timeout 60 "$bin/$name") >"$tmp/$name.out" 2>&1 || status=$?
  if [ "$status" -eq 0 ]; then
    echo "libnbd-interop $name: ok"
    passed=$((passed + 1))
  else
    why="exit status $status"
    [ "$status" -ne 77 ] || why="skipped itself: a prerequisite is missing"
    echo "libnbd-interop $name: FAILED ($why)"
    tail -20 "$tmp/$name.out"
    failed=$((failed + 1))
    failures+=("$name")
  fi
done

echo "libnbd-interop: $passed passed, $failed failed"
if [ "$failed" -gt 0 ]; then
  echo "libnbd-interop: FAILED: ${failures[*]}"
  exit 1
fi
