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
