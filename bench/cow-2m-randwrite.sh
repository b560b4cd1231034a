#!/usr/bin/env bash
# Benchmark: issue 15's copy-on-write cell. 4 KiB random writes (fio's nbd
# engine, queue depth 16, one job) into an empty qcow2 overlay with 2 MiB
# clusters and no subclusters over a fully written 4 GiB raw backing file,
# served by `diskit serve image OVERLAY cache=MODE` and by
# `qemu-nbd -t -f qcow2 --cache=MODE --aio=threads OVERLAY`, for MODE none
# (O_DIRECT) and writeback (the page cache).
#
# An untimed warm-up run per mode comes first. Every run starts from a
# fresh overlay; before a writeback run the backing
# file is read once so that it is in the page cache for both servers (it
# otherwise is for whichever ran after another). The servers alternate,
# the first changing from round to round. Reported per run: fio's IOPS over
# the whole run, and the steady state (the mean of the per-second IOPS over
# the second half, when every cluster of the overlay has been allocated);
# tables give medians over ROUNDS rounds and diskit/qemu-nbd ratios.
#
# Environment: BENCH_DIR (default bench/.work; a disk, for O_DIRECT),
# ROUNDS (3), RUNTIME (12 seconds), MODES (none,writeback).
# Output: the table on stdout and bench/results/cow-2m-randwrite-<date>.json.
set -euo pipefail
BENCH_NAME=cow-2m-randwrite
HERE=$(cd "$(dirname "$0")" && pwd)
. "$HERE/lib.sh"

DIR=${BENCH_DIR:-$HERE/.work}
ROUNDS=${ROUNDS:-3}
RUNTIME=${RUNTIME:-12}
MODES=${MODES:-none,writeback}
DISKIT=$HERE/../target/release/diskit
for t in fio qemu-nbd qemu-img; do command -v $t >/dev/null || die "$t not found"; done
(cd "$HERE/.." && cargo build --release -q) || die "build failed"

mkdir -p "$DIR"
WORK=$(mktemp -d "$DIR/cow-2m.XXXXXX")
SERVER=
cleanup() {
    [[ -n $SERVER ]] && kill "$SERVER" 2>/dev/null && wait "$SERVER" 2>/dev/null
    rm -rf "$WORK"
    quiet_vm_restore
}
trap cleanup EXIT
quiet_vm

BACK=$WORK/back.raw
OV=$WORK/overlay.qcow2
SOCK=$WORK/nbd.sock
log "writing the 4 GiB backing file"
head -c 4G /dev/urandom >"$BACK"
sync

# run_one TOOL MODE: prints "total steady" IOPS.
run_one() {
    local tool=$1 mode=$2
    rm -f "$OV" "$SOCK"
    qemu-img create -q -f qcow2 -o cluster_size=2M,backing_file="$BACK",backing_fmt=raw "$OV"
    [[ $mode == writeback ]] && cat "$BACK" >/dev/null
    sync
    if [[ $tool == diskit ]]; then
        "$DISKIT" serve -f -U "$SOCK" image "$OV" cache="$mode" &
    else
        qemu-nbd -t -k "$SOCK" -f qcow2 --cache="$mode" --aio=threads "$OV" &
    fi
    SERVER=$!
    for _ in $(seq 100); do [[ -S $SOCK ]] && break; sleep 0.05; done
    fio --name=w --ioengine=nbd --uri="nbd+unix:///?socket=$SOCK" --rw=randwrite --bs=4k \
        --iodepth=16 --runtime="$RUNTIME" --time_based --output-format=json \
        --output="$WORK/fio.json" --write_iops_log="$WORK/iops" --log_avg_msec=1000 >/dev/null
    kill "$SERVER"; wait "$SERVER" 2>/dev/null || true; SERVER=
    python3 - "$WORK/fio.json" "$WORK/iops_iops.1.log" <<'EOF'
import json, sys
total = json.load(open(sys.argv[1]))["jobs"][0]["write"]["iops"]
per_s = [int(l.split(",")[1]) for l in open(sys.argv[2]) if l.strip()]
half = per_s[len(per_s) // 2:] or per_s
print(f"{total:.0f} {sum(half) / len(half):.0f}")
EOF
    rm -f "$WORK"/iops_iops.*.log
}

declare -A TOTAL STEADY
IFS=, read -r -a modes <<<"$MODES"
# One untimed run per mode first: memory this VM has handed back to its
# host costs several times more to touch again, and the first run after
# the 4 GiB file was written (diskit's, in round 1) paid for all of it
# (under 1,100 IOPS through the page cache, against 7,000-13,000 after).
for mode in "${modes[@]}"; do
    read -r total steady < <(run_one diskit "$mode")
    log "warm-up $mode: $total IOPS"
done
for r in $(seq "$ROUNDS"); do
    for mode in "${modes[@]}"; do
        order="diskit qemu-nbd"; (( r % 2 == 0 )) && order="qemu-nbd diskit"
        for tool in $order; do
            read -r total steady < <(run_one "$tool" "$mode")
            log "round $r $mode $tool: $total IOPS, steady $steady"
            TOTAL[$mode/$tool]+="$total "; STEADY[$mode/$tool]+="$steady "
        done
    done
done

median() { tr ' ' '\n' | grep . | sort -n | awk '{a[NR]=$1} END{print (NR%2) ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2}'; }
OUT=$HERE/results/$BENCH_NAME-$(date +%Y-%m-%d-%H%M%S).json
{
    printf '{"rounds": %d, "runtime_s": %d, "cells": [' "$ROUNDS" "$RUNTIME"
    sep=
    for mode in "${modes[@]}"; do for tool in diskit qemu-nbd; do
        printf '%s{"mode": "%s", "server": "%s", "iops": [%s], "steady_iops": [%s]}' "$sep" "$mode" "$tool" \
            "$(echo ${TOTAL[$mode/$tool]} | tr ' ' ',')" "$(echo ${STEADY[$mode/$tool]} | tr ' ' ',')"
        sep=,
    done; done
    printf ']}\n'
} >"$OUT"
printf '%-10s %14s %14s %7s %16s %16s %7s\n' cache "diskit IOPS" "qemu-nbd IOPS" ratio "diskit steady" "qemu-nbd steady" ratio
for mode in "${modes[@]}"; do
    dt=$(echo ${TOTAL[$mode/diskit]} | median); qt=$(echo ${TOTAL[$mode/qemu-nbd]} | median)
    ds=$(echo ${STEADY[$mode/diskit]} | median); qs=$(echo ${STEADY[$mode/qemu-nbd]} | median)
    printf '%-10s %14.0f %14.0f %6.2fx %16.0f %16.0f %6.2fx\n' "$mode" "$dt" "$qt" "$(echo "$dt/$qt" | bc -l)" \
        "$ds" "$qs" "$(echo "$ds/$qs" | bc -l)"
done
log "results in $OUT"
