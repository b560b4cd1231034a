#!/usr/bin/env bash
# Benchmark: `diskit convert` against `qemu-img convert` for qcow2 -> raw,
# both tools in the same run.
#
# Cases (location x data x preallocation x target), named
# LOCATION/DATA/PREALLOC/TARGET, e.g. shm/sparse/metadata/null:
#   locations: shm  - /dev/shm (tmpfs)
#              disk - the work disk ($BENCH_DIR, default bench/.work)
#   data:      sparse - 64 KiB of data every 32 MiB, nothing else written
#              full   - everything written except 64 KiB every 32 MiB
#   prealloc:  default  - `qemu-img create -f qcow2` (no preallocation)
#              metadata - `-o preallocation=metadata`
#              falloc   - `-o preallocation=falloc`
#   targets:   null - `convert -n` to QEMU's null-co driver (nothing stored)
#              file - `convert -O raw` to a fresh raw file next to the source
#
# The images are created with qemu-img create and filled with qemu-io
# (`write -P BYTE OFF LEN`, 1 MiB at most per write, the pattern byte changing
# with every write and never zero), so that the preallocated layout stays.
#
# The locations are measured one after the other, so that only one
# location's images exist at a time. Per location: create the images, one
# untimed warm-up run of each tool per case (for the file target it checks
# with cmp that diskit's output equals qemu-img's and records the allocated
# size of both outputs), then ROUNDS timed rounds in which every tool runs
# once per case, the order of the tools alternating from round to round.
# Before every run the previous DST is deleted and, on the disk, everything
# is synced. Times are wall-clock seconds of the command alone.
#
# Free page reporting: on VMs whose guest reports free memory to the host
# (virtio-balloon; /sys/module/page_reporting), memory left free goes back
# to the host and costs 3-7x more to touch again (here: 2 GiB written to
# tmpfs in 1.0 s, or 3.9-7 s after a 10 s pause). Whichever tool ran after
# a pause paid for it, and file-target times were bimodal. For the length
# of the run the script makes freed memory wait 60 s before it is reported
# (min_free_ms), however much of it is waiting (max_waiting_mib), and only
# 4 MiB free blocks are reported (page_reporting_order), for each knob that
# exists and is writable, and puts the old values back on exit.
# QUIET_VM=0 leaves them alone.
#
# Page cache: the machine also runs DAMON with a "page out what was idle for
# 60 s" scheme, which dropped cached source images between rounds, so that a
# run read its source from the disk or from memory by chance. Each source is
# read once (into the page cache) right before every timed run.
#
# Environment:
#   DISKIT_BASELINE  another diskit binary (an older commit's), timed as a
#              third tool with diskit's command lines: before/after in one run
#   SIZE_MIB   virtual size of each image in MiB (default 2048)
#   ROUNDS     timed rounds per case (default 6: every tool goes first
#              equally often)
#   BENCH_DIR  directory on the work disk for the test files
#              (default <repo>/bench/.work, git-ignored)
#   CASES      which cases to run: glob patterns matched against the case
#              names, separated by spaces or commas (default '*'), e.g.
#              CASES='shm/*'  or  CASES='*/sparse/*/null,disk/full/default/*'
#
# Output: a table on stdout and bench/results/qcow2-convert-<date>.json.
# Targets (diskit <= 1.0x qemu-img, goal 0.7x) are reported, not enforced.

set -euo pipefail
export LC_ALL=C

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO_ROOT=$(cd "$SCRIPT_DIR/.." && pwd)
CASES=${CASES:-*}

TOOLS=(diskit qemu-img)
# DISKIT_BASELINE: another diskit binary (an older commit's) run as a third
# tool, "baseline", with diskit's command lines: before/after in one run.
if [[ -n ${DISKIT_BASELINE:-} ]]; then
    [[ -x $DISKIT_BASELINE ]] || { echo "DISKIT_BASELINE is not an executable" >&2; exit 1; }
    TOOLS+=(baseline)
fi
LOCATIONS=(shm disk)
KINDS=(sparse full)
PREALLOCS=(default metadata falloc)
TARGETS=(null file)

BENCH_NAME=qcow2-convert.sh
# shellcheck source=bench/lib.sh
source "$SCRIPT_DIR/lib.sh"

bench_settings
SIZE_BYTES=$((SIZE_MIB << 20))

# --------------------------------------------------------------------------
# Case selection
# --------------------------------------------------------------------------

read -r -a CASE_PATTERNS <<<"${CASES//,/ }"
(( ${#CASE_PATTERNS[@]} > 0 )) || die "CASES is empty"

selected() {   # selected NAME: true when a CASES pattern matches NAME
    local pat
    for pat in "${CASE_PATTERNS[@]}"; do
        # shellcheck disable=SC2053   # $pat is a glob on purpose
        [[ $1 == $pat ]] && return 0
    done
    return 1
}

declare -A LOC_CASES=()    # location -> "kind/prealloc/target ..." selected
ncases=0
for loc in "${LOCATIONS[@]}"; do
    for kind in "${KINDS[@]}"; do
        for pre in "${PREALLOCS[@]}"; do
            for tgt in "${TARGETS[@]}"; do
                if selected "$loc/$kind/$pre/$tgt"; then
                    LOC_CASES[$loc]+="$kind/$pre/$tgt "
                    ncases=$((ncases + 1))
                fi
            done
        done
    done
done
(( ncases > 0 )) || die "CASES='$CASES' selects no case (names look like shm/sparse/metadata/null)"
log "$ncases case(s) selected"

# --------------------------------------------------------------------------
# Prerequisites
# --------------------------------------------------------------------------

command -v cmp >/dev/null || die "cmp is required (diffutils)"
for tool in qemu-img qemu-io; do
    command -v "$tool" >/dev/null ||
        die "$tool not found; install it with: sudo apt-get install qemu-utils"
done

build_diskit

# --------------------------------------------------------------------------
# Scratch directories and cleanup
# --------------------------------------------------------------------------

# Per-run timings, warm-up facts and image facts.
scratch_space qcow2-convert
IMAGES_TSV=$(mktemp "${TMPDIR:-/tmp}/diskit-bench-images.XXXXXX")

quiet_vm   # see "Free page reporting" above

cleanup() {
    rm -rf -- "$SHM_WORK" "$DISK_WORK" "$TIMES_TSV" "$CHECKS_TSV" "$IMAGES_TSV"
    quiet_vm_restore
}
trap cleanup EXIT
trap 'exit 130' INT TERM   # make sure Ctrl-C still runs the EXIT trap

declare -A LOCATION_DIR=([shm]=$SHM_WORK [disk]=$DISK_WORK)

# Room a location needs for its selected cases: the images (full data, or
# any falloc image, is SIZE_MIB; sparse default/metadata a 1/512 of it), the
# metadata (L2 tables: 1/8192 of the size; a MiB of slack per image) and, for
# the file target, two outputs side by side during the warm-up.
need_mib_for() {
    local loc=$1 c kind pre tgt need=64 out=0
    declare -A images=()
    for c in ${LOC_CASES[$loc]}; do
        IFS=/ read -r kind pre tgt <<<"$c"
        images[$kind/$pre]=1
        if [[ $tgt == file ]]; then
            if [[ $kind == full ]]; then out=$SIZE_MIB
            elif (( out < SIZE_MIB / 512 + 1 )); then out=$((SIZE_MIB / 512 + 1)); fi
        fi
    done
    for c in "${!images[@]}"; do
        if [[ $c == full/* || $c == */falloc ]]; then need=$((need + SIZE_MIB))
        else need=$((need + SIZE_MIB / 512)); fi
        need=$((need + SIZE_MIB / 8192 + 1))
    done
    echo $((need + 2 * out))
}

for loc in "${LOCATIONS[@]}"; do
    [[ -n ${LOC_CASES[$loc]:-} ]] || continue
    need_mib=$(need_mib_for "$loc")
    avail_mib=$(( $(df -P -k "${LOCATION_DIR[$loc]}" | tail -n 1 | tr -s ' ' | cut -d ' ' -f 4) / 1024 ))
    (( avail_mib >= need_mib )) ||
        die "$loc (${LOCATION_DIR[$loc]}) has ${avail_mib} MiB free, needs ${need_mib} MiB"
done

# --------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------

# make_image PATH KIND PREALLOC: create a SIZE_MIB qcow2 image with the given
# preallocation and write its data with qemu-io.
#   sparse: 64 KiB at every 32 MiB boundary;
#   full:   everything but the 64 KiB at every 32 MiB boundary.
# Writes are at most 1 MiB (and never cross a 1 MiB boundary); each one has
# its own pattern byte, cycling through all 255 non-zero values.
make_image() {
    local path=$1 kind=$2 pre=$3 cmds args=() c
    if [[ $pre == default ]]; then
        qemu-img create -q -f qcow2 "$path" "${SIZE_MIB}M"
    else
        qemu-img create -q -f qcow2 -o "preallocation=$pre" "$path" "${SIZE_MIB}M"
    fi
    mapfile -t cmds < <(python3 - "$kind" "$SIZE_BYTES" <<'EOF'
import sys
kind, size = sys.argv[1], int(sys.argv[2])
chunk, skip, piece = 32 << 20, 64 << 10, 1 << 20
n = 0
for base in range(0, size, chunk):
    end = min(base + chunk, size)
    start, stop = (base, min(base + skip, end)) if kind == "sparse" else (base + skip, end)
    off = start
    while off < stop:
        length = min(piece - off % piece, stop - off)
        print(f"write -q -P {1 + n * 37 % 255} {off} {length}")
        n += 1
        off += length
EOF
    )
    for c in "${cmds[@]}"; do args+=(-c "$c"); done
    (( ${#args[@]} == 0 )) || qemu-io -f qcow2 "${args[@]}" "$path" >/dev/null
}

# mapped_bytes IMAGE: bytes of the image that `qemu-img map` reports as
# allocated in the image file (data: true), i.e. what preallocation kept.
mapped_bytes() {
    qemu-img map -f qcow2 --output=json "$1" | python3 -c '
import json, sys
print(sum(e["length"] for e in json.load(sys.stdin) if e["data"] and e["depth"] == 0))'
}

# run_tool TOOL TARGET SRC DST: the command being measured.
run_tool() {
    case $1/$2 in
        # Both are told the null target reads as zeros, so that neither
        # spends time writing zeros nobody keeps.
        diskit/null)   "$DISKIT" convert -n --target-is-zero -f qcow2 -O raw "$3" null-co:// ;;
        qemu-img/null) qemu-img convert -n --target-is-zero -f qcow2 "$3" \
                           --target-image-opts "driver=null-co,size=$SIZE_BYTES" ;;
        diskit/file)   "$DISKIT" convert -f qcow2 -O raw "$3" "$4" ;;
        baseline/null) "$DISKIT_BASELINE" convert -n --target-is-zero -f qcow2 -O raw "$3" null-co:// ;;
        baseline/file) "$DISKIT_BASELINE" convert -f qcow2 -O raw "$3" "$4" ;;
        qemu-img/file) qemu-img convert -f qcow2 -O raw "$3" "$4" ;;
        *)             die "unknown tool/target $1/$2" ;;
    esac
}




# --------------------------------------------------------------------------
# Per location: images, warm-up and verification, timed rounds
# --------------------------------------------------------------------------

t_start=$EPOCHREALTIME
for loc in "${LOCATIONS[@]}"; do
    [[ -n ${LOC_CASES[$loc]:-} ]] || continue
    dir=${LOCATION_DIR[$loc]}
    read -r -a cases <<<"${LOC_CASES[$loc]}"

    # The images this location's cases need, each made once.
    declare -A made=()
    for c in "${cases[@]}"; do
        IFS=/ read -r kind pre _ <<<"$c"
        [[ -z ${made[$kind/$pre]:-} ]] || continue
        made[$kind/$pre]=1
        img=$dir/src-$kind-$pre.qcow2
        log "$loc: creating $kind $pre image ($SIZE_MIB MiB) in $dir"
        make_image "$img" "$kind" "$pre"
        printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$loc" "$kind" "$pre" \
            "$(stat -c %s -- "$img")" "$(allocated "$img")" "$(mapped_bytes "$img")" >>"$IMAGES_TSV"
    done
    if [[ $loc == disk ]]; then sync; fi

    # One untimed run per tool and case: warms the page cache and the
    # binaries; for the file target, checks that diskit's output equals
    # qemu-img's and records how much each output allocates.
    for c in "${cases[@]}"; do
        IFS=/ read -r kind pre tgt <<<"$c"
        src=$dir/src-$kind-$pre.qcow2
        declare -A out=()
        for tool in "${TOOLS[@]}"; do
            out[$tool]=$dir/warm-$tool.raw
            fresh_dst "$loc" "${out[$tool]}"
            if ! run_tool "$tool" "$tgt" "$src" "${out[$tool]}"; then
                die "$tool failed on $loc/$c: see its message above"
            fi
        done
        if [[ $tgt == file ]]; then
            if cmp -s -- "${out[diskit]}" "${out[qemu-img]}"; then identical=yes; else identical=NO; fi
            [[ $identical == yes ]] || log "WARNING: diskit output differs from qemu-img's ($loc/$c)"
            for tool in "${TOOLS[@]}"; do
                printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$loc" "$kind" "$pre" "$tgt" "$tool" \
                    "$(allocated "${out[$tool]}")" "$identical" >>"$CHECKS_TSV"
            done
        fi
        fresh_dst "$loc" "${out[@]}"
        unset out
    done

    for ((round = 0; round < ROUNDS; round++)); do
        # Alternate the tool order: diskit first in even rounds, qemu-img
        # first in odd ones (a rotation, for any number of tools).
        rotate_tools "$round"
        log "$loc: round $((round + 1))/$ROUNDS: ${order[*]}"
        for c in "${cases[@]}"; do
            IFS=/ read -r kind pre tgt <<<"$c"
            src=$dir/src-$kind-$pre.qcow2
            dst=$dir/dst.raw
            for tool in "${order[@]}"; do
                fresh_dst "$loc" "$dst"
                cat -- "$src" >/dev/null
                secs=$(timed "$tool" "$tgt" "$src" "$dst") ||
                    die "$tool failed on $loc/$c (round $((round + 1)))"
                printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' \
                    "$loc" "$kind" "$pre" "$tgt" "$tool" "$round" "$secs" >>"$TIMES_TSV"
            done
            fresh_dst "$loc" "$dst"
        done
    done

    # Free the location before the next one is filled.
    rm -f -- "$dir"/*.qcow2 "$dir"/*.raw
    unset made
done
t_end=$EPOCHREALTIME
elapsed_us=$(( ${t_end/./} - ${t_start/./} ))

# --------------------------------------------------------------------------
# Report: table on stdout, JSON in bench/results/
# --------------------------------------------------------------------------

# Everything the report needs goes through the environment.
report_env qcow2-convert
export B_IMAGES=$IMAGES_TSV B_CASES=$CASES B_ELAPSED_S=$((elapsed_us / 1000000))

python3 - <<'EOF'
import json, os, statistics, sys
from collections import defaultdict

sys.path.insert(0, os.environ["B_LIB"])
from report import meta as run_meta, print_table

TARGET, GOAL = 1.0, 0.7        # diskit/qemu-img: target and goal
PATHOLOGY = 1.5                # prealloc sparse / default sparse above this: suspicious,
NOISE_S = 0.02                 # unless the difference is below this (start-up, scheduling)

env = os.environ
tools = env["B_TOOLS"].split()
meta = run_meta(env, extra={"cases_filter": env["B_CASES"],
                             "elapsed_s": int(env["B_ELAPSED_S"])})

runs = defaultdict(list)       # (loc, kind, pre, tgt, tool) -> [seconds]
for line in open(env["B_TIMES"]):
    loc, kind, pre, tgt, tool, _round, secs = line.split("\t")
    runs[loc, kind, pre, tgt, tool].append(float(secs))

checks = {}                    # (loc, kind, pre, tool) -> (allocated, identical), file target
for line in open(env["B_CHECKS"]):
    loc, kind, pre, _tgt, tool, alloc, identical = line.rstrip("\n").split("\t")
    checks[loc, kind, pre, tool] = (int(alloc), identical == "yes")

images = {}                    # (loc, kind, pre) -> facts about the source image
for line in open(env["B_IMAGES"]):
    loc, kind, pre, size, alloc, mapped = line.rstrip("\n").split("\t")
    images[loc, kind, pre] = {"file_bytes": int(size), "allocated_bytes": int(alloc),
                              "mapped_bytes": int(mapped)}

def verdict(r):
    # On the ratio as printed (two decimals): 1.004x is shown, and counts, as 1.00x.
    r = round(r, 2)
    return "goal" if r <= GOAL else "ok" if r <= TARGET else "MISSED"

cases, by_key = [], {}
for key in dict.fromkeys(k[:4] for k in runs):              # in run order
    loc, kind, pre, tgt = key
    med = {t: statistics.median(runs[key + (t,)]) for t in tools}
    ratio = med["diskit"] / med["qemu-img"]
    case = {
        "name": "/".join(key),
        "location": loc, "data": kind, "preallocation": pre, "target": tgt,
        "median_s": med,
        "runs_s": {t: runs[key + (t,)] for t in tools},
        "diskit_vs_qemu_img": ratio,
        "verdict": verdict(ratio),
        "source": images.get((loc, kind, pre)),
    }
    if tgt == "file":
        case["allocated_bytes"] = {t: checks[loc, kind, pre, t][0] for t in tools}
        case["identical_to_qemu_img"] = checks[loc, kind, pre, "diskit"][1]
    cases.append(case)
    by_key[key] = case

# The table: medians, ratio and verdict; for the file target the allocated
# bytes of both outputs and the cmp verdict.
head = ("location", "data", "prealloc", "target", "diskit s", "qemu-img s", "d/q",
        "verdict", "alloc diskit", "alloc qemu-img", "cmp")
rows = [head]
for c in cases:
    m = c["median_s"]
    file = c["target"] == "file"
    rows.append((c["location"], c["data"], c["preallocation"], c["target"],
                 f"{m['diskit']:.3f}", f"{m['qemu-img']:.3f}",
                 f"{c['diskit_vs_qemu_img']:.2f}x", c["verdict"],
                 str(c["allocated_bytes"]["diskit"]) if file else "-",
                 str(c["allocated_bytes"]["qemu-img"]) if file else "-",
                 ("ok" if c["identical_to_qemu_img"] else "DIFFERS") if file else "-"))
print_table(f"convert qcow2 -> raw, {meta['size_mib']} MiB, median of {meta['rounds']} rounds "
            f"(wall clock, seconds), diskit at {meta['commit']}; "
            f"verdict: goal <= {GOAL}x, ok <= {TARGET}x, MISSED above", rows, 4)

# Pathology check: a preallocated sparse image should convert about as fast
# as a default sparse one (the preallocated clusters hold no data).
pathology = []
for loc in ("shm", "disk"):
    for tgt in ("null", "file"):
        base = by_key.get((loc, "sparse", "default", tgt))
        if base is None:
            continue
        for pre in ("metadata", "falloc"):
            other = by_key.get((loc, "sparse", pre, tgt))
            if other is None:
                continue
            r = {t: other["median_s"][t] / base["median_s"][t] for t in tools}
            extra = other["median_s"]["diskit"] - base["median_s"]["diskit"]
            pathology.append({"location": loc, "target": tgt, "preallocation": pre,
                              "median_s": {t: other["median_s"][t] for t in tools},
                              "default_median_s": {t: base["median_s"][t] for t in tools},
                              "vs_default_sparse": r,
                              # falloc clusters are allocated in the file
                              # system too: slower is expected there.
                              "suspicious": pre == "metadata" and r["diskit"] > PATHOLOGY
                                            and extra > NOISE_S})
if pathology:
    print()
    print(f"pathology check: sparse PREALLOC vs sparse default, same location and target, "
          f"median s and ratio (about 1 expected for metadata, flagged HIGH above "
          f"{PATHOLOGY}x and {NOISE_S * 1000:.0f} ms more; falloc for reference)")
    for p in pathology:
        r, m, b = p["vs_default_sparse"], p["median_s"], p["default_median_s"]
        print(f"  {p['location']:4}  {p['target']:4}  {p['preallocation']:8}  "
              + "   ".join(f"{t} {m[t]:.3f}/{b[t]:.3f} = {r[t]:5.2f}x" for t in tools)
              + ("   HIGH" if p["suspicious"] else ""))

# Images whose preallocation did not survive the writes (should not happen).
for (loc, kind, pre), im in sorted(images.items()):
    if pre != "default" and im["mapped_bytes"] != meta["size_mib"] << 20:
        print(f"WARNING: {loc}/{kind}/{pre} image maps {im['mapped_bytes']} bytes, "
              f"not the whole {meta['size_mib']} MiB")

if "baseline" in tools:
    print()
    print("before/after: diskit's median over the baseline binary's (above 1.05: 5% slower)")
    for c in cases:
        m = c["median_s"]
        print(f"  {c['name']:<28} {m['baseline']:.3f} -> {m['diskit']:.3f}  "
              f"{m['diskit'] / m['baseline']:.3f}")

worst = max(cases, key=lambda c: c["diskit_vs_qemu_img"])
worst_ratio = worst["diskit_vs_qemu_img"]
missed = [c["name"] for c in cases if c["verdict"] == "MISSED"]
target, goal = verdict(worst_ratio) != "MISSED", verdict(worst_ratio) == "goal"
identical = all(c.get("identical_to_qemu_img", True) for c in cases)
print()
print(f"target diskit <= {TARGET}x qemu-img in every case: {'MET' if target else 'MISSED'}"
      + (f" ({len(missed)} of {len(cases)} cells)" if missed else "")
      + f"; goal <= {GOAL}x: {'MET' if goal else 'MISSED'} "
      f"(worst {worst_ratio:.2f}x, {worst['name']})"
      + ("" if identical else "; WARNING: diskit output differed from qemu-img's"))
print(f"elapsed {meta['elapsed_s']} s (image creation, warm-up and rounds)")

with open(env["B_JSON"], "w") as f:
    json.dump({**meta, "cases": cases, "pathology_check": pathology,
               "images": [{"location": l, "data": k, "preallocation": p, **v}
                          for (l, k, p), v in images.items()],
               "target_met": target, "goal_met": goal, "missed": missed,
               "worst_diskit_vs_qemu_img": worst_ratio, "all_identical": identical},
              f, indent=2)
    f.write("\n")
print(f"results written to {env['B_JSON']}")
EOF
