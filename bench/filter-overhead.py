#!/usr/bin/env python3
"""Benchmark: what each filter costs, diskit against nbdkit with the same
filter, in the same run (issue #14, benchmark 2).

Every configuration serves a RAM disk (`memory SIZE_MIB`) through one
filter (or none: `bare`) from `diskit serve` and from `nbdkit`, on a Unix
socket. The disk is first filled with random data through the filter
(nbdcopy), then measured:

  randread   fio, nbd engine, 4 KiB random reads at queue depth 32 (IOPS)
  nbdcopy    nbdcopy --no-extents URI null: (MiB/s of disk size): every
             byte is read (nbdkit 1.32's cache filter reports the plugin's
             holes for blocks dirty in its cache, and nbdcopy with extents
             then reads nothing of them)

Filters: cow, cache, readahead, log (logfile on /dev/shm), stats
(statsfile on /dev/shm), blocksize, and cow-on-read and cache-on-read
(cow and cache keeping what they read: over a fast source they must not
prefetch, issue #33); overlays and caches go to /dev/shm (TMPDIR) for
both servers. Each round runs every server once per cell,
the order alternating from round to round; the table gives medians over
ROUNDS rounds, each filter's throughput as a share of the bare plugin's
on the same server (target: diskit above 0.90, that is under 10% cost),
and diskit's over nbdkit's with the same filter (target: above 1).
The free page reporting knobs are held still for the run (bench/nbd.py).

Environment: SIZE_MIB (default 256), ROUNDS (default 3), RUNTIME (fio
seconds, default 5), FILTERS (comma separated, default all),
WORKLOADS (default randread,nbdcopy), DISKIT_BIN (the diskit binary to
measure, else this tree's release build), DISKIT_BASELINE (a column
"vs baseline": diskit over that binary with the same filter).
Output: the table on stdout and bench/results/filter-overhead-<date>.json.
"""

import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from benchlib import logger, nbdbench

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
SIZE_MIB = int(os.environ.get("SIZE_MIB", "256"))
ROUNDS = int(os.environ.get("ROUNDS", "3"))
RUNTIME = int(os.environ.get("RUNTIME", "5"))
ALL_FILTERS = ["bare", "cow", "cache", "readahead", "log", "stats", "blocksize", "cow-on-read",
               "cache-on-read"]
FILTERS = [f for f in os.environ.get("FILTERS", ",".join(ALL_FILTERS)).split(",") if f]
if "bare" not in FILTERS:
    FILTERS.insert(0, "bare")
WORKLOADS = [w for w in os.environ.get("WORKLOADS", "randread,nbdcopy").split(",") if w]
SERVERS = ["diskit", "nbdkit"]
# DISKIT_BASELINE: another diskit binary (an older commit's), run as a
# third server "baseline" with diskit's command lines: before/after in one
# run, alternating with the others.
BASELINE = os.environ.get("DISKIT_BASELINE")
if BASELINE:
    SERVERS.append("baseline")


log = logger("filter-overhead.py")


def filter_args(name, work, server):
    if name == "bare":
        return [], []
    params = {
        "log": [f"logfile={work}/log-{server}"],
        "stats": [f"statsfile={work}/stats-{server}"],
    }.get(name, [])
    if name.endswith("-on-read"):
        # The filter with its own name's parameter: cow-on-read=true.
        return [f"--filter={name.removesuffix('-on-read')}"], [f"{name}=true"]
    return [f"--filter={name}"], params


def argv(diskit, server, name, work, sock):
    filters, params = filter_args(name, work, server)
    plugin = ["memory", f"{SIZE_MIB}M"]
    if server in ("diskit", "baseline"):
        binary = BASELINE if server == "baseline" else diskit
        return [str(binary), "serve", "-f", "-U", str(sock), *filters, *plugin, *params]
    return ["nbdkit", "-f", "-U", str(sock), *filters, *plugin, *params]


def main():
    nbdbench.require(["fio", "nbdkit", "nbdcopy"])
    diskit = nbdbench.build()
    commit = nbdbench.head_commit()
    work = Path(tempfile.mkdtemp(prefix="diskit-filter-bench.", dir="/dev/shm"))
    os.environ["TMPDIR"] = str(work)
    nbdbench.SIZE_MIB = SIZE_MIB
    nbdbench.RUNTIME = RUNTIME
    results = {}
    reporting_old = nbdbench.quiet_vm()
    try:
        raw = work / "data.raw"
        with open(raw, "wb") as f:
            for _ in range(SIZE_MIB):
                f.write(os.urandom(1 << 20))
        for r in range(ROUNDS):
            for name in FILTERS:
                for wl in WORKLOADS:
                    order = SERVERS if r % 2 == 0 else SERVERS[::-1]
                    for server in order:
                        sock = work / f"{server}.sock"
                        srv = nbdbench.Server(argv(diskit, server, name, work, sock), sock)
                        try:
                            subprocess.run(["nbdcopy", str(raw), srv.uri], check=True)
                            if wl == "nbdcopy":
                                start = time.monotonic()
                                subprocess.run(["nbdcopy", "--no-extents", srv.uri, "null:"],
                                               check=True)
                                value = SIZE_MIB / (time.monotonic() - start)
                            else:
                                value = nbdbench.run_fio(srv.uri, wl)
                        finally:
                            srv.stop()
                            for p in work.glob("log-*"):
                                p.unlink()
                        results.setdefault(wl, {}).setdefault(name, {}) \
                            .setdefault(server, []).append(value)
                        log(f"round {r + 1}/{ROUNDS} {name}/{wl} {server}: {value:,.1f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
        nbdbench.quiet_vm_restore(reporting_old)

    unit = {"randread": "IOPS", "nbdcopy": "MiB/s"}
    nbdbench.print_heading(f"Filter overhead over memory {SIZE_MIB} MiB", ROUNDS, commit,
                           f"{'filter/workload':<22}{'unit':>6}{'diskit':>11}{'nbdkit':>11}"
                           f"{'diskit/bare':>13}{'nbdkit/bare':>13}{'vs nbdkit':>11}  verdict")
    summary = {}
    all_met = True
    for wl, by_filter in results.items():
        bare = {s: statistics.median(v) for s, v in by_filter["bare"].items()}
        for name, by in by_filter.items():
            med = {s: statistics.median(v) for s, v in by.items()}
            share = {s: med[s] / bare[s] for s in med}
            vs = med["diskit"] / med["nbdkit"]
            verdicts = []
            if name != "bare":
                # Targets are the filters': the bare plugins are the base.
                verdicts.append("cost ok" if share["diskit"] >= 0.9 else "cost MISSED")
                verdicts.append("faster" if vs > 1.0 else "SLOWER")
            all_met &= not any("MISSED" in v or "SLOWER" in v for v in verdicts)
            before = f"  vs baseline {med['diskit'] / med['baseline']:.3f}x" if BASELINE else ""
            print(f"{name + '/' + wl:<22}{unit[wl]:>6}{med['diskit']:>11,.0f}"
                  f"{med['nbdkit']:>11,.0f}{share['diskit']:>12.2f}x{share['nbdkit']:>12.2f}x"
                  f"{vs:>10.2f}x  {' '.join(verdicts)}{before}")
            summary[f"{name}/{wl}"] = {"unit": unit[wl], "median": med, "share_of_bare": share,
                                       "vs_nbdkit": vs, "runs": by}
            if BASELINE:
                summary[f"{name}/{wl}"]["vs_baseline"] = med["diskit"] / med["baseline"]
    print(f"\ntargets met in every row: {'yes' if all_met else 'no'}")
    out = nbdbench.write_results("filter-overhead", {
        "commit": commit, "size_mib": SIZE_MIB, "rounds": ROUNDS, "runtime_s": RUNTIME,
        "rows": summary, "met": all_met})
    log(f"wrote {out}")


if __name__ == "__main__":
    main()
