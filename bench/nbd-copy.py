#!/usr/bin/env python3
"""Benchmark: diskit's NBD client (`diskit copy`, `diskit convert`) against
nbdcopy and qemu-img, in the same run, alternating, medians.

Three parts (PARTS=fastzero,from,into; default all):

fastzero  The fast-zero pipeline of seed 001. A 100 MiB qcow2 with every
          other MiB written is copied with -n into
            nbdkit -U - --filter=log --filter=nozero --filter=blocksize
                   --filter=delay --filter=stats --filter=noextents
                   memory 100M delay-write=20ms delay-zero=5ms maxdata=256k
          for each nozero setting below, by `diskit convert`, `diskit copy`,
          `qemu-img convert` (with and without -W) and nbdcopy (the last two
          copiers read the qcow2 through `[ qemu-nbd -f qcow2 SRC ]`). Time
          (wall clock of the whole nbdkit --run), the client's write and
          zero requests (log filter; fast=1 counted apart) and the writes the
          memory plugin saw (stats filter, after blocksize splits them to
          256 KiB). Target: diskit faster than the best peer in every row;
          with 'zeromode=plugin' at most 4 zero requests and 200 writes.

from      Copy from an NBD source: 1 GiB of random data (random) and a 2 GiB
          export with 1 MiB of random data every 16 MiB (sparse), served by
          nbdkit memory and by qemu-nbd -r (a raw file on /dev/shm), copied
          to null: and to a file on /dev/shm by `diskit copy`,
          `diskit convert`, nbdcopy and qemu-img convert. Target: 1.2x
          nbdcopy's throughput in every row. The rows of random data also
          time bench/nbd-read-floor.c (when cc is there): the least a client
          can do (two connections, 1 MiB reads, simple replies, no extents,
          no zero detection), a bound for what any copier gets here.
          Also, without a target in the issue: into a qcow2 file on
          /dev/shm, by `diskit convert -O qcow2` and `qemu-img convert
          -O qcow2` (writes in source order; nbdcopy writes no qcow2).

into      Copy into an NBD target: a 1 GiB raw file of random data on
          /dev/shm to `diskit serve memory 1G` and to `nbdkit memory 1G`
          (started afresh for every run), by `diskit copy` and nbdcopy.
          Target: at least as fast as nbdcopy.

Environment: DISKIT_BASELINE (another diskit binary, an older commit's):
each diskit tool runs again with it as "baseline-..." (and `into` serves
with it as "baseline-serve"), and a last table gives diskit's median over
the baseline's for every cell: before/after in one run.

The tools run in a rotating order from round to round; tables give
medians over ROUNDS rounds (default 5) and ratios of times (peer time /
diskit time: above 1, diskit is faster). Free page reporting is held
still for the run as in bench/nbd.py. Output: the tables on stdout and
bench/results/nbd-copy-<date>.json. Targets are reported, not enforced.
"""

import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchlib import logger, rotated
from benchlib import nbdbench as nb

HERE = Path(__file__).resolve().parent
ROUNDS = int(os.environ.get("ROUNDS", "5"))
# DISKIT_BASELINE: an older diskit binary run beside the measured one.
BASELINE = os.environ.get("DISKIT_BASELINE")
PARTS = [p for p in os.environ.get("PARTS", "fastzero,from,into").split(",") if p]

# bench/nbd.py's helpers (build, servers, free page reporting), loaded by
# path: "nbd" is also the name of libnbd's Python module.
NOZERO = [
    "",
    "zeromode=plugin fastzeromode=ignore",
    "zeromode=emulate fastzeromode=ignore",
    "zeromode=emulate fastzeromode=none",
    "zeromode=plugin fastzeromode=none",
    "zeromode=emulate",
    "zeromode=plugin",
]


log = logger("nbd-copy.py")


def with_baseline(tools, diskit):
    """`tools` (name -> command line, a string or an argv list) with, when
    DISKIT_BASELINE is set, a "baseline-X" beside every "diskit-X" that
    runs the same command line with the baseline binary."""
    if not BASELINE:
        return tools
    out = dict(tools)
    for name, cmd in tools.items():
        if name.startswith("diskit-"):
            if isinstance(cmd, str):
                cmd = cmd.replace(f"{diskit} ", f"{BASELINE} ", 1)
            else:
                cmd = [BASELINE if a == str(diskit) else a for a in cmd]
            out["baseline-" + name[len("diskit-"):]] = cmd
    return out


def is_peer(tool):
    return not tool.startswith(("diskit", "baseline"))


def timed(argv, **kw):
    t0 = time.monotonic()
    p = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, **kw)
    t = time.monotonic() - t0
    if p.returncode != 0:
        raise RuntimeError(f"{argv} failed: {p.stderr.decode(errors='replace')[-2000:]}")
    return t, p.stderr.decode(errors="replace")


def ratio(peer, ours):
    return peer / ours if ours > 0 else float("inf")


# --------------------------------------------------------------------------
# fastzero
# --------------------------------------------------------------------------

def part_fastzero(diskit, work):
    src = work / "half.qcow2"
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", str(src), "100M"], check=True)
    cmds = []
    for i in range(0, 100, 2):
        cmds += ["-c", f"write -P {i % 255 + 1} {i}M 1M"]
    subprocess.run(["qemu-io", "-f", "qcow2", *cmds, str(src)], check=True,
                   stdout=subprocess.DEVNULL)
    qnbd = f"[ qemu-nbd -f qcow2 {src} ]"
    tools = {
        "diskit-convert": f"{diskit} convert -n -f qcow2 -O raw {src} $nbd",
        "diskit-copy": f"{diskit} copy -- {qnbd} $nbd",
        "qemu-img": f"qemu-img convert -n -f qcow2 -O raw {src} $nbd",
        "qemu-img-W": f"qemu-img convert -W -n -f qcow2 -O raw {src} $nbd",
        "nbdcopy": f"nbdcopy -- {qnbd} $nbd",
    }
    tools = with_baseline(tools, diskit)
    names = list(tools)
    logf, statsf = work / "log.txt", work / "stats.txt"
    rows = []
    for params in NOZERO:
        times = {t: [] for t in names}
        counts = {}
        for r in range(ROUNDS):
            for t in rotated(names, r):
                for f in (logf, statsf):
                    f.unlink(missing_ok=True)
                argv = ["nbdkit", "-U", "-", "--filter=log", "--filter=nozero",
                        "--filter=blocksize", "--filter=delay", "--filter=stats",
                        "--filter=noextents", "memory", "100M",
                        f"logfile={logf}", f"statsfile={statsf}", "delay-write=20ms",
                        "delay-zero=5ms", "maxdata=256k", *params.split(), "--run", tools[t]]
                secs, _ = timed(argv)
                times[t].append(secs)
                if r == 0:
                    counts[t] = count_requests(logf.read_text(), statsf.read_text())
        row = {"nozero": params or "(none)",
               "median_s": {t: statistics.median(v) for t, v in times.items()},
               "counts": counts}
        rows.append(row)
        log(f"fastzero '{params}': " + ", ".join(f"{t} {row['median_s'][t]:.3f}s" for t in names))
    return rows


def count_requests(log_text, stats_text):
    """Client requests (log filter) and the plugin's writes (stats filter)."""
    c = {"writes": 0, "zeros": 0, "fast_zeros": 0}
    for line in log_text.splitlines():
        if " Write id=" in line:
            c["writes"] += 1
        elif " Zero id=" in line:
            c["zeros"] += 1
            if "fast=1" in line:
                c["fast_zeros"] += 1
    m = re.search(r"write: (\d+) ops", stats_text)
    c["plugin_writes"] = int(m.group(1)) if m else 0
    m = re.search(r"zero: (\d+) ops", stats_text)
    c["plugin_zeros"] = int(m.group(1)) if m else 0
    return c


def print_fastzero(rows):
    print("\nfast-zero pipeline (seed 001): median seconds; client writes/zeros(fast) | plugin writes")
    names = list(rows[0]["median_s"])
    print(f"{'nozero':38} " + " ".join(f"{t:>16}" for t in names) + "   best peer  ratio")
    ok_all = True
    for row in rows:
        ms = row["median_s"]
        best_peer = min(ms[t] for t in names if is_peer(t))
        worst_ours = max(ms[t] for t in names if t.startswith("diskit"))
        ok = worst_ours < best_peer
        ok_all &= ok
        print(f"{row['nozero']:38} " + " ".join(f"{ms[t]:16.3f}" for t in names)
              + f"   {best_peer:8.3f}  {ratio(best_peer, worst_ours):5.2f}x {'ok' if ok else 'MISSED'}")
        print(f"{'':38} " + " ".join(
            f"{row['counts'][t]['writes']:>5}/{row['counts'][t]['zeros']:>3}({row['counts'][t]['fast_zeros']})|{row['counts'][t]['plugin_writes']:<4}"
            for t in names))
    plug = next(r for r in rows if r["nozero"] == "zeromode=plugin")
    for t in names:
        if t.startswith("diskit"):
            c = plug["counts"][t]
            fine = c["zeros"] <= 4 and c["plugin_writes"] <= 200
            ok_all &= fine
            print(f"zeromode=plugin {t}: {c['zeros']} zero requests, {c['plugin_writes']} writes "
                  f"(target <= 4 and <= 200): {'ok' if fine else 'MISSED'}")
    return ok_all


# --------------------------------------------------------------------------
# from: copy from an NBD source
# --------------------------------------------------------------------------

def make_sources(work):
    rnd = Path("/dev/shm") / f"diskit-bench-random-{os.getpid()}.raw"
    sparse = Path("/dev/shm") / f"diskit-bench-sparse-{os.getpid()}.raw"
    subprocess.run(["head", "-c", "1G", "/dev/urandom"], stdout=open(rnd, "wb"), check=True)
    with open(sparse, "wb") as f:
        f.truncate(2 << 30)
        with open("/dev/urandom", "rb") as u:
            for off in range(0, 2 << 30, 16 << 20):
                f.seek(off)
                f.write(u.read(1 << 20))
    return {"random": rnd, "sparse": sparse}


def build_floor(work):
    """bench/nbd-read-floor.c, compiled: the least a client can do."""
    exe = work / "nbd-read-floor"
    p = subprocess.run(["cc", "-O2", "-pthread", "-o", str(exe), str(HERE / "nbd-read-floor.c")],
                       stderr=subprocess.PIPE)
    if p.returncode != 0:
        log(f"no floor column: {p.stderr.decode(errors='replace')[-500:]}")
        return None
    return exe


def part_from(diskit, work, sources):
    sock = work / "src.sock"
    out = Path("/dev/shm") / f"diskit-bench-out-{os.getpid()}.raw"
    floor = build_floor(work)
    rows = []
    for server in ["nbdkit", "qemu-nbd"]:
        for data, path in sources.items():
            size = path.stat().st_size
            if server == "nbdkit":
                srv = nb.Server(["nbdkit", "-f", "-U", str(sock), "memory", str(size)], sock)
                subprocess.run(["nbdcopy", str(path), srv.uri], check=True)
            else:
                srv = nb.Server(["qemu-nbd", "-r", "-t", "-f", "raw", "-k", str(sock), "-e", "8",
                                 "--cache=writeback", "--aio=threads", str(path)], sock)
            uri = srv.uri
            null_opts = f"driver=null-co,size={size}"
            try:
                for dest in ["null", "file", "qcow2"]:
                    target = "null:" if dest == "null" else str(out)
                    tools = ["diskit-copy", "diskit-convert", "nbdcopy", "qemu-img"]
                    argvs = {
                        "diskit-copy": [str(diskit), "copy", uri, target],
                        "nbdcopy": ["nbdcopy", uri, target],
                    }
                    if dest == "qcow2":
                        tools = ["diskit-convert", "qemu-img"]
                        argvs = {t: [cmd, "convert", "-f", "raw", "-O", "qcow2", uri, str(out)]
                                 for t, cmd in [("diskit-convert", str(diskit)),
                                                ("qemu-img", "qemu-img")]}
                    elif dest == "null":
                        argvs["diskit-convert"] = [str(diskit), "convert", "-n", "-f", "raw", uri,
                                                   "--target-image-opts", null_opts]
                        argvs["qemu-img"] = ["qemu-img", "convert", "-n", "-f", "raw", uri,
                                             "--target-image-opts", null_opts]
                    else:
                        argvs["diskit-convert"] = [str(diskit), "convert", "-f", "raw", "-O", "raw",
                                                   uri, str(out)]
                        argvs["qemu-img"] = ["qemu-img", "convert", "-f", "raw", "-O", "raw", uri,
                                             str(out)]
                    argvs = with_baseline(argvs, diskit)
                    tools = list(argvs)
                    # The floor reads every byte (no extents): a bound for
                    # the rows of random data only.
                    if floor and data == "random" and dest != "qcow2":
                        tools.append("floor")
                        argvs["floor"] = [str(floor), str(sock),
                                          "/dev/null" if dest == "null" else str(out), "2", "8"]
                    times = {t: [] for t in tools}
                    for r in range(-1, ROUNDS):  # round -1: warm-up, checked
                        for t in rotated(tools, max(r, 0)):
                            out.unlink(missing_ok=True)
                            secs, _ = timed(argvs[t])
                            if r < 0:
                                if dest == "file":
                                    subprocess.run(["cmp", str(path), str(out)], check=True)
                                elif dest == "qcow2":
                                    subprocess.run(["qemu-img", "compare", "-q", "-f", "raw",
                                                    "-F", "qcow2", str(path), str(out)],
                                                   check=True)
                            else:
                                times[t].append(secs)
                    med = {t: statistics.median(v) for t, v in times.items()}
                    row = {"server": server, "data": data, "dest": dest, "size": size,
                           "median_s": med}
                    rows.append(row)
                    log(f"from {server}/{data}/{dest}: " + ", ".join(f"{t} {med[t]:.3f}s" for t in tools))
            finally:
                srv.stop()
                out.unlink(missing_ok=True)
    return rows


def print_from(rows):
    print("\ncopy from an NBD source: median seconds (MiB/s of export size); ratio = nbdcopy time / diskit time")
    print(f"{'server':9} {'data':7} {'dest':5} {'diskit copy':>20} {'diskit convert':>20} {'nbdcopy':>20} {'qemu-img':>20}  copy  convert   floor (nbd-read-floor.c; nbdcopy/floor)")
    ok_all = True
    for row in rows:
        if row["dest"] == "qcow2":
            continue
        ms, mib = row["median_s"], row["size"] / (1 << 20)
        cells = " ".join(f"{ms[t]:8.3f} ({mib / ms[t]:7.0f})" for t in
                         ["diskit-copy", "diskit-convert", "nbdcopy", "qemu-img"])
        rc, rv = ratio(ms["nbdcopy"], ms["diskit-copy"]), ratio(ms["nbdcopy"], ms["diskit-convert"])
        ok = rc >= 1.2 and rv >= 1.2
        ok_all &= ok
        fl = ms.get("floor")
        floor = f"   {fl:6.3f} ({ratio(ms['nbdcopy'], fl):4.2f}x)" if fl else ""
        print(f"{row['server']:9} {row['data']:7} {row['dest']:5} {cells}  {rc:4.2f}x {rv:4.2f}x {'ok' if ok else 'MISSED'}{floor}")
    qcow2 = [r for r in rows if r["dest"] == "qcow2"]
    if qcow2:
        print("\ninto a qcow2 file (writes in source order; no target): median seconds; ratio = qemu-img time / diskit time")
        for row in qcow2:
            ms = row["median_s"]
            print(f"{row['server']:9} {row['data']:7} diskit convert {ms['diskit-convert']:6.3f}"
                  f"  qemu-img {ms['qemu-img']:6.3f}  {ratio(ms['qemu-img'], ms['diskit-convert']):4.2f}x")
    return ok_all


# --------------------------------------------------------------------------
# into: copy into an NBD target
# --------------------------------------------------------------------------

def part_into(diskit, work, sources):
    src = sources["random"]
    size = src.stat().st_size
    sock = work / "dst.sock"
    servers = {
        "diskit-serve": [str(diskit), "serve", "-f", "-U", str(sock), "memory", str(size)],
        "nbdkit": ["nbdkit", "-f", "-U", str(sock), "memory", str(size)],
    }
    if BASELINE:
        servers["baseline-serve"] = [BASELINE] + servers["diskit-serve"][1:]
    tools = ["diskit-copy", "nbdcopy"] + (["baseline-copy"] if BASELINE else [])
    rows = []
    for name, argv in servers.items():
        times = {t: [] for t in tools}
        for r in range(-1, ROUNDS):
            for t in rotated(tools, max(r, 0)):
                srv = nb.Server(argv, sock)
                try:
                    client = {"diskit-copy": [str(diskit), "copy"],
                              "baseline-copy": [BASELINE, "copy"]}.get(t, ["nbdcopy"])
                    cmd = client + [str(src), srv.uri]
                    secs, _ = timed(cmd)
                    if r < 0:
                        subprocess.run(["nbdcopy", srv.uri, str(work / "check.raw")], check=True)
                        subprocess.run(["cmp", str(src), str(work / "check.raw")], check=True)
                        (work / "check.raw").unlink()
                    else:
                        times[t].append(secs)
                finally:
                    srv.stop()
        med = {t: statistics.median(v) for t, v in times.items()}
        rows.append({"server": name, "size": size, "median_s": med})
        log(f"into {name}: " + ", ".join(f"{t} {med[t]:.3f}s" for t in tools))
    return rows


def print_into(rows):
    print("\ncopy into an NBD target (1 GiB random): median seconds; ratio = nbdcopy time / diskit copy time")
    ok_all = True
    for row in rows:
        ms = row["median_s"]
        rc = ratio(ms["nbdcopy"], ms["diskit-copy"])
        ok = rc >= 1.0
        ok_all &= ok
        print(f"{row['server']:14} diskit copy {ms['diskit-copy']:.3f}  nbdcopy {ms['nbdcopy']:.3f}  {rc:4.2f}x {'ok' if ok else 'MISSED'}")
    return ok_all


def print_before_after(results):
    """diskit's median over the baseline binary's, every cell that has both
    (above 1.05: more than 5% slower than before)."""
    print("\nbefore/after: diskit's median seconds over the baseline binary's (above 1.05: 5% slower)")
    worst = 0.0
    cells = []
    for row in results.get("fastzero", []):
        cells.append((f"fastzero {row['nozero']}", row["median_s"]))
    for row in results.get("from", []):
        cells.append((f"from {row['server']}/{row['data']}/{row['dest']}", row["median_s"]))
    for row in results.get("into", []):
        cells.append((f"into {row['server']}", row["median_s"]))
    into = {r["server"]: r["median_s"] for r in results.get("into", [])}
    if "baseline-serve" in into:
        cells.append(("into serve (client nbdcopy)",
                      {"diskit-serve": into["diskit-serve"]["nbdcopy"],
                       "baseline-serve": into["baseline-serve"]["nbdcopy"]}))
    for label, ms in cells:
        for t in ms:
            if t.startswith("diskit-") and "baseline-" + t[len("diskit-"):] in ms:
                b = ms["baseline-" + t[len("diskit-"):]]
                r = ms[t] / b if b > 0 else float("inf")
                worst = max(worst, r)
                print(f"{label:52} {t:16} {b:8.3f} -> {ms[t]:8.3f} {r:6.3f}")
    print(f"worst cell: {worst:.3f}")


def main():
    for tool in ["nbdkit", "nbdcopy", "qemu-img", "qemu-io", "qemu-nbd"]:
        if not any((Path(d) / tool).exists() for d in os.environ["PATH"].split(":")):
            sys.exit(f"{tool} not found (apt-get install nbdkit libnbd-bin qemu-utils)")
    diskit = nb.build()
    old = nb.quiet_vm()
    results = {"rounds": ROUNDS, "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    sources = {}
    try:
        with tempfile.TemporaryDirectory(prefix="diskit-nbd-copy-") as w:
            work = Path(w)
            if "fastzero" in PARTS:
                results["fastzero"] = part_fastzero(diskit, work)
            if "from" in PARTS or "into" in PARTS:
                sources = make_sources(work)
            if "from" in PARTS:
                results["from"] = part_from(diskit, work, sources)
            if "into" in PARTS:
                results["into"] = part_into(diskit, work, sources)
    finally:
        for p in sources.values():
            p.unlink(missing_ok=True)
        nb.quiet_vm_restore(old)
    verdicts = []
    if "fastzero" in results:
        verdicts.append(("fastzero", print_fastzero(results["fastzero"])))
    if "from" in results:
        verdicts.append(("from", print_from(results["from"])))
    if "into" in results:
        verdicts.append(("into", print_into(results["into"])))
    if BASELINE:
        print_before_after(results)
    print()
    for part, ok in verdicts:
        print(f"target {part}: {'met' if ok else 'MISSED'}")
    results["targets"] = dict(verdicts)
    out = HERE / "results" / f"nbd-copy-{time.strftime('%Y-%m-%d-%H%M%S')}.json"
    out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"results written to {out}")


if __name__ == "__main__":
    main()
