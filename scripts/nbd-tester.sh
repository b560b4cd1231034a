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
server=""
stop_server() {
  if [ -n "$server" ]; then
    kill "$server" 2>/dev/null || true
    wait "$server" 2>/dev/null || true
    server=""
  fi
}
cleanup() {
  stop_server
  rm -rf "$tmp"
}
trap cleanup EXIT

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

passed=0
failed=0
failures=()

# report NAME STATUS: one line per mode; on failure, both sides' output.
report() {
  local name=$1 status=$2
  if [ "$status" -eq 0 ]; then
    echo "nbd-tester $name: ok ($((SECONDS - started))s)"
    passed=$((passed + 1))
  else
    echo "nbd-tester $name: FAILED (tester exit status $status)"
    echo "--- tester output (last lines)"
    # Without the progress counters, which hide the message.
    tr '\r' '\n' <"$tmp/$name.tester" | grep -Ev 'Requests: [0-9]+|Seq [0-9a-f]+ Queued' | tail -20 || true
    if [ -f "$tmp/$name.server" ]; then
      echo "--- server output"
      tail -20 "$tmp/$name.server"
    fi
    failed=$((failed + 1))
    failures+=("$name")
  fi
}

# mode NAME SERVER-ARGS... -- TESTER-ARGS...: serves, in the foreground, with
# the server's arguments; runs the tester with its own, in which @PORT@ stands
# for the server's TCP port; stops the server.
mode() {
  local name=$1
  shift
  local sargs=()
  while [ "$1" != "--" ]; do
    sargs+=("$1")
    shift
  done
  shift
  local port
  port=$(free_port)
  local targs=("${@//@PORT@/$port}")
  started=$SECONDS
  rm -f "$tmp/pid" "$tmp/sock"
  truncate -s 0 "$tmp/disk"
  truncate -s 4M "$tmp/disk"
  "$diskit" serve -f -P "$tmp/pid" "${sargs[@]//@PORT@/$port}" >"$tmp/$name.server" 2>&1 &
  server=$!
  local i
  for i in $(seq 100); do
    [ -s "$tmp/pid" ] && break
    kill -0 "$server" 2>/dev/null || break
    sleep 0.1
  done
  local status=0
  if [ ! -s "$tmp/pid" ]; then
    echo "server did not start" >"$tmp/$name.tester"
    status=1
  else
    (cd "$src" && timeout 120 "$tester" "${targs[@]}") >"$tmp/$name.tester" 2>&1 || status=$?
  fi
  stop_server
  report "$name" "$status"
}

tcp=(-i 127.0.0.1 -p @PORT@)
# nbd-server verifies client certificates against cacertfile: --tls-verify-peer.
tls=(--tls=require --tls-certificates="$src/certs" --tls-verify-peer)
client_cert=(-C certs/client-cert.pem -K certs/client-key.pem -A certs/ca-cert.pem)

echo "== nbd-tester: $tester against $diskit"
mode cfg1 "${tcp[@]}" -e export file "$tmp/disk" -- -N export 127.0.0.1 @PORT@
mode cfgsize "${tcp[@]}" -e export file "$tmp/disk" -- -o -N export 127.0.0.1 @PORT@
mode write "${tcp[@]}" -e export1 file "$tmp/disk" -- -N export1 -w 127.0.0.1 @PORT@
mode flush "${tcp[@]}" -e export1 file "$tmp/disk" -- -N export1 -w -f 127.0.0.1 @PORT@
mode integrity "${tcp[@]}" -e export1 memory 50M -- -N export1 -i -t integrity-test.tr 127.0.0.1 @PORT@
mode integrityhuge "${tcp[@]}" -e export1 memory 50M -- -N export1 -i -t integrityhuge-test.tr 127.0.0.1 @PORT@
mode list "${tcp[@]}" -r -e export1 file "$tmp/disk" -- -N export1 127.0.0.1 @PORT@
# -F: the writes must fail.
mode rowrite "${tcp[@]}" -r -e export1 file "$tmp/disk" -- -N export1 -w -F 127.0.0.1 @PORT@
mode unix -U "$tmp/sock" -e export1 file "$tmp/disk" -- -N export1 -u "$tmp/sock"
mode handshake "${tcp[@]}" -e export1 file "$tmp/disk" -- -h -N export1 127.0.0.1 @PORT@
# The server's certificate names localhost, which the tester checks.
mode tls "${tcp[@]}" "${tls[@]}" -e export1 memory 50M -- \
  -N export1 -i -t integrity-test.tr "${client_cert[@]}" localhost @PORT@
mode tlshuge "${tcp[@]}" "${tls[@]}" -e export1 memory 50M -- \
  -N export1 -i -t integrityhuge-test.tr "${client_cert[@]}" -H localhost 127.0.0.1 @PORT@
# A client certificate the CA did not sign: the handshake must fail (-F).
mode tlswrongcert "${tcp[@]}" "${tls[@]}" -e export1 memory 50M -- \
  -N export1 -t integrity-test.tr -C certs/selfsigned-cert.pem -K certs/selfsigned-key.pem -F 127.0.0.1 @PORT@

# inetd: the tester runs the server itself, the connection on its stdin only
# (nbd-server's inetd mode talks both ways on fd 0); diskit's -s reads stdin
# and writes stdout, so stdout is pointed at the same socket.
truncate -s 4M "$tmp/disk"
started=$SECONDS
status=0
(cd "$src" && timeout 120 "$tester" -N export1 -I -- \
  sh -c 'exec "$0" serve -s -e export1 file "$1" >&0 2>"$2"' "$diskit" "$tmp/disk" "$tmp/inetd.server") \
  >"$tmp/inetd.tester" 2>&1 || status=$?
report inetd "$status"

echo "nbd-tester: $passed passed, $failed failed"
if [ "$failed" -gt 0 ]; then
  echo "nbd-tester: FAILED modes: ${failures[*]}"
  exit 1
fi
