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

# bench_settings: what the sourcing script (which sets SCRIPT_DIR) takes
# from the environment, with its default, checked: SIZE_MIB (2048), ROUNDS
# (6: every tool goes first equally often), BENCH_DIR (bench/.work, git-
# ignored); RESULTS_DIR is bench/results. Also checks for bash 5 (for
# $EPOCHREALTIME) and python3 (the report).
bench_settings() {
    SIZE_MIB=${SIZE_MIB:-2048}
    ROUNDS=${ROUNDS:-6}
    BENCH_DIR=${BENCH_DIR:-$SCRIPT_DIR/.work}
    RESULTS_DIR=$SCRIPT_DIR/results
    [[ $SIZE_MIB =~ ^[1-9][0-9]*$ ]] || die "SIZE_MIB must be a positive integer (got '$SIZE_MIB')"
    [[ $ROUNDS =~ ^[1-9][0-9]*$ ]] || die "ROUNDS must be a positive integer (got '$ROUNDS')"
    (( BASH_VERSINFO[0] >= 5 )) || die "bash 5 or later is required (for \$EPOCHREALTIME)"
    command -v python3 >/dev/null || die "python3 is required"
}

# report_env NAME: exports everything the report (Python, with
# bench/report.py) reads from the environment: the files scratch_space
# made (B_TIMES, B_CHECKS), B_JSON (bench/results/NAME-DATE.json), the
# settings, TOOLS, commit, the versions of diskit and qemu-img, the file
# systems of the two locations, and B_LIB (bench/, for the import).
report_env() {
    local stamp
    stamp=$(date +%Y-%m-%d-%H%M%S)
    export B_TIMES=$TIMES_TSV B_CHECKS=$CHECKS_TSV B_JSON=$RESULTS_DIR/$1-$stamp.json
    export B_DATE=$stamp B_COMMIT=$commit B_SIZE_MIB=$SIZE_MIB B_ROUNDS=$ROUNDS B_TOOLS="${TOOLS[*]}"
    B_DISKIT_VERSION=$("$DISKIT" --version 2>/dev/null | head -n 1 || true)
    B_QEMU_VERSION=$(qemu-img --version | head -n 1)
    B_SHM_FS=$(fstype "$SHM_WORK") B_DISK_FS=$(fstype "$DISK_WORK")
    export B_DISKIT_VERSION B_QEMU_VERSION B_SHM_FS B_DISK_FS B_DISK_DIR=$BENCH_DIR B_LIB=$SCRIPT_DIR
    export PYTHONDONTWRITEBYTECODE=1   # no __pycache__ in bench/
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
