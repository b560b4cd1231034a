# Helpers shared by the shell benchmarks (sourced, not run). The sourcing
# script defines run_tool TOOL ARGS... and sets BENCH_NAME first.

log() { printf '[%s] %s\n' "$BENCH_NAME" "$*" >&2; }
die() { log "error: $*"; exit 1; }

# timed TOOL ARGS...: run the tool and print its wall-clock time in seconds.
# The clock is bash's own $EPOCHREALTIME (microseconds, no process start-up
# inside the measured interval); the tool's own output goes to stderr.
timed() {
    local t0 t1 us
    t0=$EPOCHREALTIME
    run_tool "$@" >&2 || return   # (errexit does not reach into $(...))
    t1=$EPOCHREALTIME
    us=$(( ${t1/./} - ${t0/./} ))         # "sec.usec" -> microseconds
    printf '%d.%06d\n' $((us / 1000000)) $((us % 1000000))
}

# fresh_dst LOC DST...: remove previous outputs and, on the disk, flush
# everything so that no write-back of an earlier run overlaps the next one.
fresh_dst() {
    local loc=$1; shift
    rm -f -- "$@"
    if [[ $loc == disk ]]; then sync; fi
}

# build_diskit: builds the release binary (the sourcing script sets
# REPO_ROOT) and sets DISKIT to it and commit to what was built, taken now:
# others may commit while the benchmark runs.
# With DISKIT_BIN set, that binary is measured as it is (no build): another
# commit's, for before/after runs of the same benchmark.
build_diskit() {
    if [[ -n ${DISKIT_BIN:-} ]]; then
        DISKIT=$DISKIT_BIN
        [[ -x $DISKIT ]] || die "DISKIT_BIN is not an executable: $DISKIT"
        commit="$("$DISKIT" --version 2>/dev/null | head -n 1) at $DISKIT"
        return
    fi
    log "building diskit (release)"
    (cd "$REPO_ROOT" && cargo build --release -p diskit)
    DISKIT=${CARGO_TARGET_DIR:-$REPO_ROOT/target}/release/diskit
    [[ -x $DISKIT ]] || die "diskit binary not found at $DISKIT"
    commit=$(git -C "$REPO_ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)
    if [[ -n $(git -C "$REPO_ROOT" status --porcelain -- crates Cargo.toml Cargo.lock 2>/dev/null) ]]; then
        commit="$commit+dirty"   # the measured binary is not exactly that commit
    fi
}

# scratch_space NAME: makes BENCH_DIR and RESULTS_DIR, a private
# subdirectory per location (SHM_WORK in /dev/shm, DISK_WORK in BENCH_DIR,
# named after NAME: only these are removed on exit) and the files
# TIMES_TSV and CHECKS_TSV.
scratch_space() {
    mkdir -p "$BENCH_DIR" "$RESULTS_DIR"
    SHM_WORK=$(mktemp -d /dev/shm/diskit-bench.XXXXXX)
    DISK_WORK=$(mktemp -d "$BENCH_DIR/$1.XXXXXX")
    TIMES_TSV=$(mktemp "${TMPDIR:-/tmp}/diskit-bench-times.XXXXXX")
    CHECKS_TSV=$(mktemp "${TMPDIR:-/tmp}/diskit-bench-checks.XXXXXX")
}

# rotate_tools ROUND: sets order to TOOLS rotated by ROUND places, and
# reversed in every other cycle of rotations, so that over 2 x TOOLS rounds
# every tool goes first equally often and follows every other tool equally
# often (with three tools, rotation alone has each follow always the same
# one, and what the one before leaves behind is no longer spread evenly).
rotate_tools() {
    local i n=${#TOOLS[@]} j
    order=()
    for ((i = 0; i < n; i++)); do
        j=$((($1 + i) % n))
        if (($1 / n % 2 == 1)); then j=$((n - 1 - j)); fi
        order+=("${TOOLS[$j]}")
    done
}

allocated() { du -B1 -- "$1" | cut -f 1; }
fstype() { df --output=fstype -- "$1" | tail -n 1; }

# Free page reporting (see bench/README.md): memory left free goes back to
# the host on these VMs and costs 3-7x to touch again. quiet_vm makes freed
# memory wait 60 s before it is reported (min_free_ms), however much of it
# is waiting (max_waiting_mib, which otherwise reports at once past 1 GiB),
# and reports only free blocks of 4 MiB (page_reporting_order 10), for each
# knob that exists and is writable (QUIET_VM=0: leave them alone);
# quiet_vm_restore puts the old values back (call it from the EXIT trap).
REPORTING_DIR=/sys/module/page_reporting/parameters
declare -A REPORTING_OLD=()
quiet_vm() {
    [[ ${QUIET_VM:-1} != 0 ]] || return 0
    local mem_mib knob value
    mem_mib=$(awk '/^MemTotal:/ { print int($2 / 1024) }' /proc/meminfo)
    for knob in min_free_ms=60000 "max_waiting_mib=$mem_mib" page_reporting_order=10; do
        value=${knob#*=} knob=$REPORTING_DIR/${knob%%=*}
        [[ -w $knob ]] || continue
        REPORTING_OLD[$knob]=$(<"$knob")
        if echo "$value" >"$knob" 2>/dev/null; then
            log "free page reporting: ${knob##*/} $value for the run (was ${REPORTING_OLD[$knob]})"
        else
            unset "REPORTING_OLD[$knob]"
        fi
    done
}
quiet_vm_restore() {
    local knob
    for knob in "${!REPORTING_OLD[@]}"; do
        echo "${REPORTING_OLD[$knob]}" >"$knob" || true
    done
}
