#!/usr/bin/env bash
# Benchmark: `diskit convert` against `qemu-img convert` and `cp --sparse=always`
# for raw -> raw copies.
#
# Cases (location x file kind):
#   locations: /dev/shm (tmpfs) and the work disk ($BENCH_DIR, default bench/.work)
#   kinds:     full   - SIZE_MIB of non-zero (random) data, no holes
#              sparse - SIZE_MIB file with 64 KiB of random data every 32 MiB,
#                       the rest holes
#
# Every round runs the three tools once per case, rotating their order from
# round to round so that none of them always goes first (or last). Each tool
# copies SRC to a fresh DST in the same directory; DST is deleted (and, on the
# disk, everything synced) before the clock starts. Times are wall-clock
# seconds of the command alone. Before the timed rounds, one untimed warm-up
# run per tool checks that diskit's output is byte-identical to the source and
# records the allocated size (du -B1) of each tool's output.
#
# Environment:
#   SIZE_MIB   size of each test file in MiB (default 2048)
#   ROUNDS     timed rounds per case (default 6: every tool goes first
#              equally often)
#   BENCH_DIR  directory on the work disk for the test files
#              (default <repo>/bench/.work, git-ignored)
#
# Output: a table on stdout and bench/results/convert-<date>.json.
# A missed target is reported, not treated as a failure.

set -euo pipefail
export LC_ALL=C

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO_ROOT=$(cd "$SCRIPT_DIR/.." && pwd)
TOOLS=(diskit qemu-img cp)

BENCH_NAME=convert.sh
# shellcheck source=bench/lib.sh
source "$SCRIPT_DIR/lib.sh"

# --------------------------------------------------------------------------
# Settings and prerequisites
# --------------------------------------------------------------------------

bench_settings
if ! command -v qemu-img >/dev/null; then
    die "qemu-img not found; install it with: sudo apt-get install qemu-utils"
fi

build_diskit

# --------------------------------------------------------------------------
# Scratch directories and cleanup
# --------------------------------------------------------------------------

# Per-run timings (location, kind, tool, round, seconds) and warm-up facts.
scratch_space convert

quiet_vm   # see bench/README.md

cleanup() {
    rm -rf -- "$SHM_WORK" "$DISK_WORK" "$TIMES_TSV" "$CHECKS_TSV"
    quiet_vm_restore
}
trap cleanup EXIT
trap 'exit 130' INT TERM   # make sure Ctrl-C still runs the EXIT trap

declare -A LOCATION_DIR=([shm]=$SHM_WORK [disk]=$DISK_WORK)
LOCATIONS=(shm disk)
KINDS=(full sparse)

# Each location needs room for the full source, a full copy and the sparse
# source (plus a little slack).
need_mib=$((SIZE_MIB * 2 + SIZE_MIB / 16 + 64))
for loc in "${LOCATIONS[@]}"; do
    avail_mib=$(( $(df -P -k "${LOCATION_DIR[$loc]}" | tail -n 1 | tr -s ' ' | cut -d ' ' -f 4) / 1024 ))
    (( avail_mib >= need_mib )) ||
        die "$loc (${LOCATION_DIR[$loc]}) has ${avail_mib} MiB free, needs ${need_mib} MiB"
done

# --------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------

# make_full PATH: SIZE_MIB of random data, written as one 64 MiB random block
# repeated (each copy stamped with its index so that no two blocks are equal).
make_full() {
    python3 - "$1" "$SIZE_MIB" <<'EOF'
import os, sys
path, size = sys.argv[1], int(sys.argv[2]) << 20
block = bytearray(os.urandom(64 << 20))
with open(path, "wb") as f:
    off = 0
    while off < size:
        block[:8] = (off // len(block) + 1).to_bytes(8, "little")
        n = min(len(block), size - off)
        f.write(memoryview(block)[:n])
        off += n
EOF
}

# make_sparse PATH: a SIZE_MIB file of holes with 64 KiB of random data at
# every 32 MiB boundary.
make_sparse() {
    python3 - "$1" "$SIZE_MIB" <<'EOF'
import os, sys
path, size = sys.argv[1], int(sys.argv[2]) << 20
with open(path, "wb") as f:
    f.truncate(size)
    for off in range(0, size, 32 << 20):
        f.seek(off)
        f.write(os.urandom(min(64 << 10, size - off)))
EOF
}

# run_tool TOOL SRC DST: the command being measured.
run_tool() {
    case $1 in
        diskit)   "$DISKIT" convert -f raw -O raw "$2" "$3" ;;
        qemu-img) qemu-img convert -f raw -O raw "$2" "$3" ;;
        cp)       cp --sparse=always "$2" "$3" ;;
        *)        die "unknown tool $1" ;;
    esac
}


# same_bytes A B: true when the two files have identical contents.
same_bytes() {
    if command -v cmp >/dev/null; then
        cmp -s -- "$1" "$2"
    else
        python3 -c 'import filecmp, sys; sys.exit(not filecmp.cmp(sys.argv[1], sys.argv[2], shallow=False))' "$1" "$2"
    fi
}



# --------------------------------------------------------------------------
# Test files, warm-up and verification
# --------------------------------------------------------------------------

for loc in "${LOCATIONS[@]}"; do
    dir=${LOCATION_DIR[$loc]}
    log "creating ${SIZE_MIB} MiB test files in $dir"
    make_full "$dir/src-full.raw"
    make_sparse "$dir/src-sparse.raw"
    if [[ $loc == disk ]]; then sync; fi

    for kind in "${KINDS[@]}"; do
        src=$dir/src-$kind.raw
        dst=$dir/dst-$kind.raw
        # One untimed run per tool: warms the page cache and the binaries,
        # checks diskit's output, and records how much each output allocates.
        for tool in "${TOOLS[@]}"; do
            fresh_dst "$loc" "$dst"
            run_tool "$tool" "$src" "$dst"
            identical=-
            if [[ $tool == diskit ]]; then
                if same_bytes "$src" "$dst"; then identical=yes; else identical=NO; fi
                [[ $identical == yes ]] || log "WARNING: diskit output differs from the source ($loc/$kind)"
            fi
            printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$loc" "$kind" "$tool" \
                "$(allocated "$dst")" "$(allocated "$src")" "$identical" >>"$CHECKS_TSV"
        done
        rm -f -- "$dst"
    done
done

# --------------------------------------------------------------------------
# Timed rounds
# --------------------------------------------------------------------------

for ((round = 0; round < ROUNDS; round++)); do
    # Rotate the tool order: round 0 = diskit qemu-img cp,
    # round 1 = qemu-img cp diskit, round 2 = cp diskit qemu-img, ...
    rotate_tools "$round"
    log "round $((round + 1))/$ROUNDS: ${order[*]}"

    for loc in "${LOCATIONS[@]}"; do
        dir=${LOCATION_DIR[$loc]}
        for kind in "${KINDS[@]}"; do
            src=$dir/src-$kind.raw
            dst=$dir/dst-$kind.raw
            for tool in "${order[@]}"; do
                fresh_dst "$loc" "$dst"
                secs=$(timed "$tool" "$src" "$dst") ||
                    die "$tool failed on $loc/$kind (round $((round + 1)))"
                printf '%s\t%s\t%s\t%s\t%s\n' "$loc" "$kind" "$tool" "$round" "$secs" >>"$TIMES_TSV"
            done
            fresh_dst "$loc" "$dst"
        done
    done
done

# --------------------------------------------------------------------------
# Report: table on stdout, JSON in bench/results/
# --------------------------------------------------------------------------

# Everything the report needs goes through the environment.
report_env convert
B_CP_VERSION=$(cp --version | head -n 1)
export B_CP_VERSION

python3 - <<'EOF'
import json, os, statistics, sys
from collections import defaultdict

sys.path.insert(0, os.environ["B_LIB"])
from report import meta as run_meta, print_table

env = os.environ
tools = env["B_TOOLS"].split()
meta = run_meta(env, versions={"cp": env["B_CP_VERSION"]})

runs = defaultdict(list)                      # (loc, kind, tool) -> [seconds]
for line in open(env["B_TIMES"]):
    loc, kind, tool, _round, secs = line.split("\t")
    runs[loc, kind, tool].append(float(secs))

checks = {}                                   # (loc, kind, tool) -> warm-up facts
for line in open(env["B_CHECKS"]):
    loc, kind, tool, dst_alloc, src_alloc, identical = line.rstrip("\n").split("\t")
    checks[loc, kind, tool] = (int(dst_alloc), int(src_alloc), identical)

cases = []
for loc, kind in dict.fromkeys((l, k) for l, k, _ in runs):   # in run order
    med = {t: statistics.median(runs[loc, kind, t]) for t in tools}
    cases.append({
        "location": loc,
        "kind": kind,
        "median_s": med,
        "runs_s": {t: runs[loc, kind, t] for t in tools},
        "diskit_vs_qemu_img": med["diskit"] / med["qemu-img"],
        "diskit_vs_cp": med["diskit"] / med["cp"],
        "source_allocated_bytes": checks[loc, kind, "diskit"][1],
        "allocated_bytes": {t: checks[loc, kind, t][0] for t in tools},
        "diskit_identical": checks[loc, kind, "diskit"][2] == "yes",
    })

# The table: medians, ratios, allocated bytes of the outputs, cmp verdict.
head = ("location", "kind", "diskit s", "qemu-img s", "cp s",
        "d/qemu", "d/cp", "alloc diskit", "alloc qemu-img", "cmp")
rows = [head]
for c in cases:
    m, a = c["median_s"], c["allocated_bytes"]
    rows.append((c["location"], c["kind"],
                 f"{m['diskit']:.3f}", f"{m['qemu-img']:.3f}", f"{m['cp']:.3f}",
                 f"{c['diskit_vs_qemu_img']:.2f}x", f"{c['diskit_vs_cp']:.2f}x",
                 str(a["diskit"]), str(a["qemu-img"]),
                 "ok" if c["diskit_identical"] else "DIFFERS"))
print_table(f"convert raw -> raw, {meta['size_mib']} MiB, median of {meta['rounds']} rounds "
            f"(wall clock, seconds), diskit at {meta['commit']}", rows, 2)

# Verdict against the target (<= 1.0x qemu-img everywhere) and goal (<= 0.8x).
worst = max(cases, key=lambda c: c["diskit_vs_qemu_img"])
worst_ratio = worst["diskit_vs_qemu_img"]
target, goal = worst_ratio <= 1.0, worst_ratio <= 0.8
identical = all(c["diskit_identical"] for c in cases)
print()
print(f"target diskit <= 1.0x qemu-img in every case: {'MET' if target else 'MISSED'}; "
      f"goal <= 0.8x: {'MET' if goal else 'MISSED'} "
      f"(worst {worst_ratio:.2f}x, {worst['location']}/{worst['kind']})"
      + ("" if identical else "; WARNING: diskit output differed from the source"))

with open(env["B_JSON"], "w") as f:
    json.dump({**meta, "cases": cases, "target_met": target, "goal_met": goal,
               "worst_diskit_vs_qemu_img": worst_ratio, "all_identical": identical},
              f, indent=2)
    f.write("\n")
print(f"results written to {env['B_JSON']}")
EOF
