#!/usr/bin/env bash
# Runs the NBD reference implementation's protocol tester, nbd-tester-client
# (vendored in third_party/nbd-tester), against `diskit serve`, in each mode of
# upstream's tests/run/simple_test that a one-export server can take: cfg1,
# cfgsize, write, flush, integrity, integrityhuge, list, rowrite, unix, inetd,
# handshake, tls, tlshuge, tlswrongcert.
#
# Installs the tester's build dependencies when missing, builds the tester
# once (cached under target/nbd-tester/, rebuilt when its sources change) and
# diskit (cargo build), then runs every mode, stopping each server it started.
# Exits non-zero, with the tester's and the server's output, if any mode fails.
# Prints "nbd-tester: N passed, N failed" last.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/packages.sh
c_build_setup nbd-tester
need_pkg glib-2.0 libglib2.0-dev
need_pkg gnutls libgnutls28-dev
command -v python3 >/dev/null || need+=(python3)
install_missing nbd-tester "${need[@]}"

# The tester, built once per version of its sources. ISSERVER enables its
# inetd mode (-I); it only adds syslog calls otherwise.
cache=$target/nbd-tester
stamp=$(cat "$src"/*.c "$src"/*.h "$0" | sha256sum | cut -c1-16)
tester=$cache/nbd-tester-client-$stamp
if [ ! -x "$tester" ]; then
  echo "== nbd-tester: building nbd-tester-client"
  mkdir -p "$cache"
  rm -f "$cache"/nbd-tester-client-*
  # shellcheck disable=SC2046
  cc -O2 -std=gnu11 -DISSERVER -I"$src" -include "$src/config.h" \
    $(pkg-config --cflags glib-2.0 gnutls) -o "$tester.tmp" \
    "$src/nbd-tester-client.c" "$src/cliserv.c" "$src/buffer.c" "$src/crypto-gnutls.c" \
    $(pkg-config --libs glib-2.0 gnutls)
  mv "$tester.tmp" "$tester"
fi

cargo build -p diskit --quiet
diskit=$target/debug/diskit

tmp=$(mktemp -d "${TMPDIR:-/tmp}/diskit-nbd-tester.XXXXXX")
cleanup() {
  # Servers a failed run left behind.
  jobs -p | xargs -r kill 2>/dev/null || true
  rm -rf "$tmp"
}
trap cleanup EXIT

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

passed=0
failed=0
failures=()
# report NAME: prints how mode NAME went (its status file: the tester's
# exit status and the seconds it took) and counts it.
report() {
  local name=$1 dir=$tmp/$1 status secs
  read -r status secs <"$dir/status"
  if [ "$status" -eq 0 ]; then
    echo "nbd-tester $name: ok (${secs}s)"
    passed=$((passed + 1))
  else
    echo "nbd-tester $name: FAILED (tester exit status $status)"
    echo "--- tester output (last lines)"
    # Without the progress counters, which hide the message.
    tr '\r' '\n' <"$dir/tester" | grep -Ev 'Requests: [0-9]+|Seq [0-9a-f]+ Queued' | tail -20 || true
    if [ -f "$dir/server" ]; then
      echo "--- server output"
      tail -20 "$dir/server"
    fi
    failed=$((failed + 1))
    failures+=("$name")
  fi
}

# mode NAME SERVER-ARGS... -- TESTER-ARGS...: one run of the tester
# against `diskit serve SERVER-ARGS`, in its own directory ($tmp/NAME:
# @DISK@ is a 4 MiB file there, @SOCK@ a socket, @PORT@ the TCP port,
# $PORT if set, else a free one), its outcome in $tmp/NAME/status. Modes
# may run side by side.
mode() {
  local name=$1 dir=$tmp/$1
  shift
  mkdir -p "$dir"
  local port=${PORT:-$(free_port)}
  local sargs=() targs=() a
  while [ "$1" != "--" ]; do
    a=${1//@PORT@/$port}
    a=${a//@DISK@/$dir/disk}
    sargs+=("${a//@SOCK@/$dir/sock}")
    shift
  done
  shift
  for a in "$@"; do
    a=${a//@PORT@/$port}
    targs+=("${a//@SOCK@/$dir/sock}")
  done
  local started=$SECONDS
  truncate -s 4M "$dir/disk"
  "$diskit" serve -f -P "$dir/pid" "${sargs[@]}" >"$dir/server" 2>&1 &
  local server=$!
  local i
  for i in $(seq 100); do
    [ -s "$dir/pid" ] && break
    kill -0 "$server" 2>/dev/null || break
    sleep 0.1
  done
  local status=0
  if [ ! -s "$dir/pid" ]; then
    echo "server did not start" >"$dir/tester"
    status=1
  else
    (cd "$src" && timeout 120 "$tester" "${targs[@]}") >"$dir/tester" 2>&1 || status=$?
  fi
  kill "$server" 2>/dev/null || true
  wait "$server" 2>/dev/null || true
  echo "$status $((SECONDS - started))" >"$dir/status"
}

tcp=(-i 127.0.0.1 -p @PORT@)
tls=(--tls=require --tls-certificates="$src/certs" --tls-verify-peer)
client_cert=(-C certs/client-cert.pem -K certs/client-key.pem -A certs/ca-cert.pem)
echo "== nbd-tester: $tester against $diskit"
mode cfg1 "${tcp[@]}" -e export file @DISK@ -- -N export 127.0.0.1 @PORT@
mode cfgsize "${tcp[@]}" -e export file @DISK@ -- -o -N export 127.0.0.1 @PORT@
mode write "${tcp[@]}" -e export1 file @DISK@ -- -N export1 -w 127.0.0.1 @PORT@
mode flush "${tcp[@]}" -e export1 file @DISK@ -- -N export1 -w -f 127.0.0.1 @PORT@
mode integrity "${tcp[@]}" -e export1 memory 50M -- -N export1 -i -t integrity-test.tr 127.0.0.1 @PORT@
mode list "${tcp[@]}" -r -e export1 file @DISK@ -- -N export1 127.0.0.1 @PORT@
mode rowrite "${tcp[@]}" -r -e export1 file @DISK@ -- -N export1 -w -F 127.0.0.1 @PORT@
mode unix -U @SOCK@ -e export1 file @DISK@ -- -N export1 -u @SOCK@
mode handshake "${tcp[@]}" -e export1 file @DISK@ -- -h -N export1 127.0.0.1 @PORT@
mode tls "${tcp[@]}" "${tls[@]}" -e export1 memory 50M -- \
  -N export1 -i -t integrity-test.tr "${client_cert[@]}" localhost @PORT@
mode tlswrongcert "${tcp[@]}" "${tls[@]}" -e export1 memory 50M -- \
  -N export1 -t integrity-test.tr -C certs/selfsigned-cert.pem -K certs/selfsigned-key.pem -F 127.0.0.1 @PORT@
# The two long traces (about 35 s each) side by side, on two ports taken
# now (nothing else of this script listens meanwhile).
port1=$(free_port)
port2=$(free_port)
while [ "$port2" = "$port1" ]; do port2=$(free_port); done
PORT=$port1 mode integrityhuge "${tcp[@]}" -e export1 memory 50M -- \
  -N export1 -i -t integrityhuge-test.tr 127.0.0.1 @PORT@ &
huge1=$!
PORT=$port2 mode tlshuge "${tcp[@]}" "${tls[@]}" -e export1 memory 50M -- \
  -N export1 -i -t integrityhuge-test.tr "${client_cert[@]}" -H localhost 127.0.0.1 @PORT@ &
huge2=$!
mkdir -p "$tmp/inetd"
truncate -s 4M "$tmp/inetd/disk"
started=$SECONDS
status=0
(cd "$src" && timeout 120 "$tester" -N export1 -I -- \
  sh -c 'exec "$0" serve -s -e export1 file "$1" >&0 2>"$2"' "$diskit" "$tmp/inetd/disk" "$tmp/inetd/server") \
  >"$tmp/inetd/tester" 2>&1 || status=$?
echo "$status $((SECONDS - started))" >"$tmp/inetd/status"
wait "$huge1" "$huge2" || true
for name in cfg1 cfgsize write flush integrity integrityhuge list rowrite unix handshake \
  tls tlshuge tlswrongcert inetd; do
  report "$name"
done

echo "nbd-tester: $passed passed, $failed failed"
if [ "$failed" -gt 0 ]; then
  echo "nbd-tester: FAILED modes: ${failures[*]}"
  exit 1
fi
