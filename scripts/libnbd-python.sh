#!/usr/bin/env bash
# Runs libnbd's own Python tests (vendored unmodified in
# third_party/libnbd-python) against diskit's Python client, diskit's own
# Python tests (python/tests), and nbdsh's command lines: the extension
# (python/, a cdylib of its own workspace) is built with cargo into the
# tree's target directory and put beside its Python sources as
# diskit/_diskit.abi3.so (maturin builds the same crate into a wheel:
# `cd python && maturin build`), then each test runs with python/compat
# first on PYTHONPATH, so that `import nbd` is diskit's. Each test runs
# under libnbd's own module first, as the control, then under diskit's,
# against nbdkit and then against diskit's server as `nbdkit`. Prints
# "libnbd-python: N passed, N failed" last; exits non-zero if any failed.
set -euo pipefail
cd "$(dirname "$0")/.."
# libnbd's nbdsh and module are the system Python's.
export PATH=/usr/bin:$PATH
. scripts/packages.sh
need=()
/usr/bin/python3 -c 'import nbd' 2>/dev/null || need+=(python3-libnbd)
command -v nbdkit >/dev/null || need+=(nbdkit)
command -v qemu-img >/dev/null || need+=(qemu-utils)
install_missing libnbd-python "${need[@]}"

target=${CARGO_TARGET_DIR:-$PWD/target}
(cd python && CARGO_TARGET_DIR=$target cargo build --quiet)
cp "$target/debug/lib_diskit.so" python/diskit/_diskit.abi3.so

root=$PWD
passed=0
failed=0
# The server the tests run as `nbdkit`: nbdkit itself, then diskit under
# nbdkit's name (a directory first on PATH with the link).
diskit=${DISKIT:-}
if [ -z "$diskit" ]; then
  cargo build -p diskit --quiet
  diskit=$target/debug/diskit
fi
as_nbdkit=$(mktemp -d "${TMPDIR:-/tmp}/libnbd-python-bin.XXXXXX")
ln -s "$diskit" "$as_nbdkit/nbdkit"
for server in nbdkit diskit; do
  for t in third_party/libnbd-python/t/*.py; do
    name=$(basename "$t")
    # 460 checks nbdkit's own extents beyond the request (the last one
    # whole, which NBD allows); diskit's server cuts them at its end.
    if [ "$server" = diskit ] && [ "$name" = 460-block-status.py ]; then
      continue
    fi
    for module in libnbd diskit; do
      dir=$(mktemp -d "${TMPDIR:-/tmp}/libnbd-python.XXXXXX")
      # The tests find their helper scripts as $srcdir/../tests/...
      if [ "$module" = diskit ]; then
        path=$root/python/compat:$root/python
      else
        path=
      fi
      bin=$PATH
      [ "$server" = diskit ] && bin=$as_nbdkit:$PATH
      # LIBNBD_DEBUG=1 as libnbd runs them (debug callbacks get messages).
      if (cd "$dir" && srcdir=$root/third_party/libnbd-python/t LIBNBD_DEBUG=1 \
            PATH=$bin PYTHONPATH=$path timeout 300 /usr/bin/python3 "$root/$t") \
            >"$dir.log" 2>&1; then
        # libnbd's module against nbdkit is the control; every other pair
        # is a check of diskit's.
        [ "$module/$server" != libnbd/nbdkit ] && passed=$((passed + 1))
      else
        echo "== $name under $module's nbd module, $server as the server, failed:"
        tail -40 "$dir.log"
        failed=$((failed + 1))
      fi
      rm -rf "$dir" "$dir.log"
    done
  done
done
rm -rf "$as_nbdkit"
# diskit's own Python tests (python/tests), each in a scratch directory.
for t in python/tests/*.py; do
  dir=$(mktemp -d "${TMPDIR:-/tmp}/diskit-python.XXXXXX")
  if (cd "$dir" && PYTHONPATH=$root/python timeout 300 /usr/bin/python3 "$root/$t") \
       >"$dir.log" 2>&1; then
    passed=$((passed + 1))
  else
    echo "== $t failed:"
    cat "$dir.log"
    failed=$((failed + 1))
  fi
  rm -rf "$dir" "$dir.log"
done

# nbdsh's command lines under libnbd's nbdsh and under `diskit nbdsh`,
# against one nbdkit memory disk: the same output and exit status.
sock_dir=$(mktemp -d "${TMPDIR:-/tmp}/libnbd-python-sh.XXXXXX")
nbdkit -U "$sock_dir/sock" -P "$sock_dir/pid" --exit-with-parent memory 1M &
for _ in $(seq 100); do [ -S "$sock_dir/sock" ] && break; sleep 0.05; done
uri="nbd+unix:///?socket=$sock_dir/sock"
# Each case's words, separated by '|'.
nbdsh_cases=(
  "--base-allocation|-u|$uri|-c|h.pwrite(b'nbdsh' * 100, 4096)|-c|print(h.get_size(), h.pread(5, 4096), h.can_trim(), h.is_read_only())"
  "-u|$uri|--base-allocation|-c|print(1)"
  "-u|nbd+unix:///?socket=$sock_dir/none|-c|print(1)"
  "-n|-c|print(nbd.NBD().get_size())"
  "-n|-u|$uri"
  "--base-allocation|-u|$uri|-c|h.block_status(65536, 0, lambda c, o, e, err: print(c, o, e))"
  "-c|import sys; print(sys.argv[0] != '')"
)
for case in "${nbdsh_cases[@]}"; do
  IFS='|' read -r -a words <<<"$case"
  want=$(/usr/bin/nbdsh "${words[@]}" 2>&1; echo "rc=$?")
  got=$(PYTHONPATH=$root/python "$diskit" nbdsh "${words[@]}" 2>&1; echo "rc=$?")
  # Messages keep their first words (libnbd's call and its state names
  # differ after them).
  if [ "$(sed 's/\(failed: [a-z_]*\).*/\1/' <<<"$want")" = \
       "$(sed 's/\(failed: [a-z_]*\).*/\1/' <<<"$got")" ]; then
    passed=$((passed + 1))
  else
    echo "== nbdsh ${words[*]}:"
    echo "-- libnbd's nbdsh:"; echo "$want"
    echo "-- diskit nbdsh:"; echo "$got"
    failed=$((failed + 1))
  fi
done
kill "$(cat "$sock_dir/pid")" 2>/dev/null || true
rm -rf "$sock_dir"

echo "libnbd-python: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
