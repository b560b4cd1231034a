#!/usr/bin/env python3
"""Benchmark: nbdcopy from nbdkit's sparse-random plugin under
`diskit serve` and under nbdkit, to null:, in the same run, alternating,
medians (issue #31's target: diskit at least 2x nbdkit).

Rows:

copy         `nbdcopy URI null:` from a running server (`SERVER -f -U SOCK
             sparse-random SIZE seed=SEED`): the copy alone.
start+copy   `SERVER -U - sparse-random SIZE seed=SEED --run 'nbdcopy "$uri"
             null:'`: the server's start (drawing the map of 4 KiB blocks)
             and the copy.

floor        (copy row only, not compared) `nbdcopy URI null:` from `diskit
             serve -r file` of the same disk written to a sparse file in
             the page cache: the same data runs served at the least cost a
             server has (splice from the page cache), which bounds what any
             sparse-random server can gain. The table also gives nbdcopy's
             own processor time (user+system) per copy: on 2 cores a copy
             cannot take less than half of it plus half of the server's.

Both servers serve the same disk (the same seed gives nbdkit's layout and
bytes under diskit: checked once here by comparing the two maps, and by
the interop tests byte for byte). nbdcopy reads the data runs only
(about PERCENT of the disk, 10 by default) over 4 connections.

Environment: SIZE (4G), SEED (1234), ROUNDS (10, alternating which server
goes first), DISKIT_BIN (a binary to measure as it is). Free page
reporting is held still as in bench/nbd.py. Output: the table on stdout and
bench/results/sparse-random-<date>.json. The target is reported, not
enforced.
"""

import os
import resource
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from benchlib import logger, rotated, save
from benchlib import nbdbench as nb

SIZE = os.environ.get("SIZE", "4G")
SEED = os.environ.get("SEED", "1234")
ROUNDS = int(os.environ.get("ROUNDS", "10"))
SERVERS = ["diskit", "nbdkit"]

log = logger("sparse-random.py")


def plugin():
    return ["sparse-random", SIZE, f"seed={SEED}"]


def server_argv(diskit, server):
    return [diskit, "serve"] if server == "diskit" else ["nbdkit"]


def timed(argv, cpu=None):
    """Wall seconds of `argv`; its processor seconds appended to `cpu`."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
    wall = time.monotonic() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if cpu is not None:
        cpu.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    return wall


def map_of(uri):
    return subprocess.run(["nbdinfo", "--map", uri], check=True, capture_output=True,
                          text=True).stdout


def main():
    nb.require(["nbdkit", "nbdcopy", "nbdinfo"])
    diskit = str(nb.build())
    commit = f"binary {diskit}" if os.environ.get("DISKIT_BIN") else nb.head_commit()
    work = Path(tempfile.mkdtemp(prefix="diskit-bench-sparse-random."))
    old = nb.quiet_vm()
    times = {"copy": {s: [] for s in SERVERS}, "start+copy": {s: [] for s in SERVERS}}
    floor_times, client_cpu = [], {s: [] for s in SERVERS + ["floor"]}
    servers = {}
    try:
        servers = {s: nb.Server(server_argv(diskit, s) + ["-f", "-U", str(work / f"{s}.sock")]
                                + plugin(), work / f"{s}.sock") for s in SERVERS}
        maps = {s: map_of(servers[s].uri) for s in SERVERS}
        if maps["diskit"] != maps["nbdkit"]:
            raise RuntimeError("the servers' maps differ")
        data = sum(int(line.split()[1]) for line in maps["diskit"].splitlines()
                   if line.split()[-1] == "data")
        log(f"{SIZE} seed={SEED}: {data} bytes of data")
        # The floor: the same disk in a sparse file, read through the page
        # cache (read once first, so that it is there).
        floor_file = work / "floor.raw"
        subprocess.run(["truncate", "-s", SIZE, str(floor_file)], check=True)
        subprocess.run(["nbdcopy", "--destination-is-zero", servers["diskit"].uri,
                        str(floor_file)], check=True)
        subprocess.run(["cat", str(floor_file)], check=True, stdout=subprocess.DEVNULL)
        floor = nb.Server([diskit, "serve", "-f", "-r", "-U", str(work / "floor.sock"),
                           "file", str(floor_file)], work / "floor.sock")
        servers["floor"] = floor
        if map_of(floor.uri) != maps["diskit"]:
            raise RuntimeError("the floor's map differs")
        for r in range(ROUNDS):
            for s in rotated(SERVERS + ["floor"], r):
                t = timed(["nbdcopy", servers[s].uri, "null:"], client_cpu[s])
                (floor_times if s == "floor" else times["copy"][s]).append(t)
        for srv in servers.values():
            srv.stop()
        servers = {}
        for r in range(ROUNDS):
            for s in rotated(SERVERS, r):
                argv = server_argv(diskit, s) + ["-U", "-"] + plugin() + [
                    "--run", 'nbdcopy "$uri" null:']
                times["start+copy"][s].append(timed(argv))
    finally:
        for srv in servers.values():
            srv.stop()
        nb.quiet_vm_restore(old)
        subprocess.run(["rm", "-rf", str(work)])
    print(f"\nsparse-random {SIZE} seed={SEED} ({data} bytes of data) to null:, "
          f"median of {ROUNDS} rounds, commit {commit}")
    print(f"{'row':<12} {'diskit s':>9} {'nbdkit s':>9} {'nbdkit/diskit':>14}")
    rows = {}
    for row, t in times.items():
        med = {s: statistics.median(v) for s, v in t.items()}
        ratio = med["nbdkit"] / med["diskit"]
        rows[row] = {"median_s": med, "runs_s": t, "speedup": ratio}
        print(f"{row:<12} {med['diskit']:>9.3f} {med['nbdkit']:>9.3f} {ratio:>13.2f}x")
    floor_med = statistics.median(floor_times)
    cpu_med = {s: statistics.median(v) for s, v in client_cpu.items()}
    print(f"{'floor':<12} {floor_med:>9.3f} {'':>9} {rows['copy']['median_s']['nbdkit'] / floor_med:>13.2f}x"
          "  (nbdkit's copy / the floor's: the most any server could reach)")
    print("nbdcopy's processor seconds per copy (median): "
          + ", ".join(f"{s} {v:.3f}" for s, v in cpu_med.items()))
    met = all(v["speedup"] >= 2.0 for v in rows.values())
    print(f"target (diskit at least 2x nbdkit in every row): {'met' if met else 'missed'}")
    save("sparse-random", {"size": SIZE, "seed": SEED, "rounds": ROUNDS, "data_bytes": data,
                           "commit": commit, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                           "rows": rows, "floor_s": {"median": floor_med, "runs": floor_times},
                           "nbdcopy_cpu_s": cpu_med, "target_met": met}, log)


if __name__ == "__main__":
    main()
