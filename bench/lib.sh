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
# memory wait 60 s before it is reported, when the knob exists and is
# writable (QUIET_VM=0: leave it alone); quiet_vm_restore puts the old
# value back (call it from the EXIT trap).
REPORTING_KNOB=/sys/module/page_reporting/parameters/min_free_ms
REPORTING_OLD=
quiet_vm() {
    [[ ${QUIET_VM:-1} != 0 && -w $REPORTING_KNOB ]] || return 0
    REPORTING_OLD=$(<"$REPORTING_KNOB")
    if echo 60000 >"$REPORTING_KNOB" 2>/dev/null; then
        log "free page reporting delayed to 60 s for the run (was ${REPORTING_OLD} ms)"
    else
        REPORTING_OLD=
    fi
}
quiet_vm_restore() {
    if [[ -n $REPORTING_OLD ]]; then echo "$REPORTING_OLD" >"$REPORTING_KNOB" || true; fi
}
