#!/bin/sh
# A RAM-disk-like plugin for nbdkit's sh-plugin protocol, in a file under
# $tmpdir: every method, with per-connection handles checked, extents
# from the file's holes, and errors by errno name. Used by
# interop_script_plugins.rs under nbdkit and under diskit serve.
f=$tmpdir/disk
case "$1" in
    config)
        case "$2" in
            size) truncate -s "$3" "$f" ;;
            *) echo "EINVAL unknown parameter $2" >&2; exit 1 ;;
        esac ;;
    config_complete) [ -f "$f" ] || { echo "size parameter missing" >&2; exit 1; } ;;
    thread_model) echo serialize_requests ;;
    open) d=$(mktemp -d "$tmpdir/h-XXXXXX") && echo "$d" ;;
    close) rm -rf "$2" ;;
    get_size) [ -d "$2" ] || { echo "EINVAL bad handle $2" >&2; exit 1; }; stat -L -c %s "$f" ;;
    pread) dd if="$f" iflag=skip_bytes,count_bytes skip="$4" count="$3" status=none ;;
    pwrite)
        if [ "$4" -ge 1048576 ]; then cat >/dev/null; echo "ENOSPC past the first megabyte" >&2; exit 1; fi
        dd of="$f" oflag=seek_bytes conv=notrunc seek="$4" status=none ;;
    zero) fallocate -z -o "$4" -l "$3" "$f" ;;
    trim) fallocate -p -o "$4" -l "$3" "$f" ;;
    flush) sync "$f" ;;
    extents)
        # Data and holes of the file, as nbdkit's extents lines.
        python3 - "$f" "$4" "$3" <<'PY'
import os, sys
fd = os.open(sys.argv[1], os.O_RDONLY)
at, end = int(sys.argv[2]), int(sys.argv[2]) + int(sys.argv[3])
while at < end:
    try:
        data = os.lseek(fd, at, os.SEEK_DATA)
    except OSError:
        data = end
    if data > at:
        n = min(data, end) - at
        print(at, n, "hole,zero")
        at += n
        continue
    hole = min(os.lseek(fd, at, os.SEEK_HOLE), end)
    print(at, hole - at)
    at = hole
PY
        ;;
    can_write|can_flush|can_trim|can_zero|can_extents) exit 0 ;;
    can_fua) echo emulate ;;
    can_multi_conn) exit 3 ;;
    *) exit 2 ;;
esac
