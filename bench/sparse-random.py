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


def timed(argv):
    t0 = time.monotonic()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
    return time.monotonic() - t0


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
        for r in range(ROUNDS):
            for s in rotated(SERVERS, r):
                times["copy"][s].append(timed(["nbdcopy", servers[s].uri, "null:"]))
        for srv in servers.values():
            srv.stop()
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
    met = all(v["speedup"] >= 2.0 for v in rows.values())
    print(f"target (diskit at least 2x nbdkit in every row): {'met' if met else 'missed'}")
    save("sparse-random", {"size": SIZE, "seed": SEED, "rounds": ROUNDS, "data_bytes": data,
                           "commit": commit, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                           "rows": rows, "target_met": met}, log)


if __name__ == "__main__":
    main()
