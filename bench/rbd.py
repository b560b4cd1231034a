#!/usr/bin/env python3
"""Benchmark: diskit with Ceph RBD images against Ceph's own `rbd` tool,
on one one-node cluster (scripts/ceph-cluster.sh: a monitor and one
memstore OSD, started for the run and stopped after), in the same run,
alternating, medians.

Parts (PARTS=import,export,serve,fio; default all):

import  Sources on /dev/shm: SIZE_MIB (default 2048) of random data (full)
        and the same size with 64 KiB of random data every 32 MiB
        (sparse), each as raw and as qcow2. Into a new RBD image by
          diskit convert -f FMT -O raw SRC rbd:rbd/dst:conf=C
          diskit copy --destination-is-zero SRC rbd:rbd/dst:conf=C
            (the image made first by `rbd create`, not timed; a qcow2
            source is read through `[ diskit serve -r image SRC ]`, as
            nbdcopy reads one through qemu-nbd)
          rbd import RAW rbd/dst  (the same data as raw: the users'
            workaround), the peer.
        The image is removed after each run (not timed).
        Target: diskit at most 1.0x rbd import's time; sparse at most 0.1x.

export  The full and sparse images in RBD (put there by rbd import) to a
        file on /dev/shm by
          diskit convert -O raw|qcow2 rbd:... DST, diskit copy rbd:... DST
          rbd export rbd/IMG DST, the peer.
        Target: at most 1.0x rbd export's time; sparse at most 0.1x.

serve   nbdcopy from `diskit serve -r rbd image=rbd/full conf=C` to null:
        against `rbd export rbd/full -` into /dev/null, as throughput.
        Target: at least 1.0x.

fio     4 KiB random writes, queue depth 16, through `diskit serve rbd`
        (fio's nbd engine, RUNTIME seconds) beside `rbd bench --io-type
        write --io-pattern rand --io-size 4K --io-threads 16` on another
        image of the same size: the cluster's own ceiling. Reported, no
        target.

Tools run in a rotating order from round to round; medians over ROUNDS
rounds (default 3). Ratios are diskit's time / the peer's (below 1:
diskit is faster); for serve and fio, diskit's throughput / the peer's.
Free page reporting is held still as in bench/nbd.py. Output: tables on
stdout and bench/results/rbd-<date>.json.
"""

import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchlib import logger, nbdbench as nb, rotated

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
SIZE_MIB = int(os.environ.get("SIZE_MIB", "2048"))
ROUNDS = int(os.environ.get("ROUNDS", "3"))
RUNTIME = int(os.environ.get("RUNTIME", "15"))
PARTS = [p for p in os.environ.get("PARTS", "import,export,serve,fio").split(",") if p]

log = logger("rbd.py")


def run(argv, **kw):
    return subprocess.run([str(a) for a in argv], check=True, **kw)


def timed(argv, **kw):
    start = time.monotonic()
    run(argv, **kw)
    return time.monotonic() - start


class Cluster:
    def __init__(self, work):
        self.dir = work / "ceph"
        # Room for the images of a run: memstore keeps them in memory.
        room = (4 * SIZE_MIB + 2048) << 20
        out = run([REPO / "scripts" / "ceph-cluster.sh", "start", self.dir, room],
                  capture_output=True, text=True).stdout
        self.conf = out.strip().splitlines()[-1]

    def name(self, image):
        return f"rbd:rbd/{image}:conf={self.conf}"

    def rbd(self, *args, **kw):
        return run(["rbd", "-c", self.conf, "--no-progress", *args], **kw)

    def remove(self, image):
        subprocess.run(["rbd", "-c", self.conf, "--no-progress", "rm", f"rbd/{image}"],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def stop(self):
        run([REPO / "scripts" / "ceph-cluster.sh", "stop", self.dir])


def make_sources(work):
    size = SIZE_MIB << 20
    full = work / "full.raw"
    with open("/dev/urandom", "rb") as r, open(full, "wb") as w:
        for _ in range(SIZE_MIB):
            w.write(r.read(1 << 20))
    sparse = work / "sparse.raw"
    with open("/dev/urandom", "rb") as r, open(sparse, "wb") as w:
        w.truncate(size)
        for off in range(0, size, 32 << 20):
            w.seek(off)
            w.write(r.read(64 << 10))
    for kind in ["full", "sparse"]:
        run(["qemu-img", "convert", "-f", "raw", "-O", "qcow2", work / f"{kind}.raw",
             work / f"{kind}.qcow2"])
    return {"full": full, "sparse": sparse}


def medians(rounds):
    return {tool: statistics.median(ts) for tool, ts in rounds.items()}


def part_import(diskit, cl, work, results):
    rows = []
    for kind in ["full", "sparse"]:
        for fmt in ["raw", "qcow2"]:
            src = work / f"{kind}.{fmt}"
            raw = work / f"{kind}.raw"

            def convert():
                return timed([diskit, "convert", "-f", fmt, "-O", "raw", src, cl.name("dst")])

            def copy():
                cl.rbd("create", "--size", f"{SIZE_MIB}M", "rbd/dst")
                side = [src] if fmt == "raw" else ["[", diskit, "serve", "-r", "image", src, "]"]
                return timed([diskit, "copy", "--destination-is-zero", *side, cl.name("dst")])

            def rbd_import():
                return timed(["rbd", "-c", cl.conf, "--no-progress", "import", raw, "rbd/dst"])

            tools = {"diskit convert": convert, "diskit copy": copy, "rbd import": rbd_import}
            times = {t: [] for t in tools}
            for r in range(ROUNDS):
                for t in rotated(list(tools), r):
                    cl.remove("dst")
                    times[t].append(tools[t]())
            cl.remove("dst")
            m = medians(times)
            row = {"cell": f"{kind} {fmt}", **m,
                   "convert/rbd": m["diskit convert"] / m["rbd import"],
                   "copy/rbd": m["diskit copy"] / m["rbd import"]}
            log(f"import {row}")
            rows.append(row)
    results["import"] = rows
    print(f"\n## import: SIZE_MIB={SIZE_MIB}, medians of {ROUNDS} (s); ratio = diskit / rbd import")
    print("| source | diskit convert | diskit copy | rbd import | convert ratio | copy ratio |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['cell']} | {r['diskit convert']:.2f} | {r['diskit copy']:.2f} | "
              f"{r['rbd import']:.2f} | {r['convert/rbd']:.3f} | {r['copy/rbd']:.3f} |")


def part_export(diskit, cl, work, results):
    rows = []
    for kind in ["full", "sparse"]:
        cl.remove(kind)
        cl.rbd("import", work / f"{kind}.raw", f"rbd/{kind}")
        for fmt in ["raw", "qcow2"]:
            dst = work / f"out.{fmt}"

            def convert():
                return timed([diskit, "convert", "-O", fmt, cl.name(kind), dst])

            def copy():
                return timed([diskit, "copy", cl.name(kind), dst])

            def rbd_export():
                return timed(["rbd", "-c", cl.conf, "--no-progress", "export", f"rbd/{kind}", dst])

            tools = {"diskit convert": convert, "rbd export": rbd_export}
            if fmt == "raw":
                tools["diskit copy"] = copy
            times = {t: [] for t in tools}
            for r in range(ROUNDS):
                for t in rotated(list(tools), r):
                    dst.unlink(missing_ok=True)
                    times[t].append(tools[t]())
            dst.unlink(missing_ok=True)
            m = medians(times)
            row = {"cell": f"{kind} -> {fmt}", **m,
                   "convert/rbd": m["diskit convert"] / m["rbd export"]}
            if "diskit copy" in m:
                row["copy/rbd"] = m["diskit copy"] / m["rbd export"]
            log(f"export {row}")
            rows.append(row)
    results["export"] = rows
    print(f"\n## export: medians of {ROUNDS} (s); ratio = diskit / rbd export (to raw)")
    print("| image -> file | diskit convert | diskit copy | rbd export | convert ratio | copy ratio |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        copy = f"{r['diskit copy']:.2f}" if "diskit copy" in r else "-"
        ratio = f"{r['copy/rbd']:.3f}" if "copy/rbd" in r else "-"
        print(f"| {r['cell']} | {r['diskit convert']:.2f} | {copy} | {r['rbd export']:.2f} | "
              f"{r['convert/rbd']:.3f} | {ratio} |")


def part_serve(diskit, cl, work, results):
    cl.remove("full")
    cl.rbd("import", work / "full.raw", "rbd/full")
    sock = work / "serve.sock"
    server = nb.Server([diskit, "serve", "-f", "-r", "-U", sock, "rbd", "image=rbd/full",
                        f"conf={cl.conf}"], sock)
    try:
        def nbdcopy():
            return SIZE_MIB / timed(["nbdcopy", server.uri, "null:"])

        def rbd_export():
            with open(os.devnull, "wb") as null:
                return SIZE_MIB / timed(["rbd", "-c", cl.conf, "--no-progress", "export",
                                         "rbd/full", "-"], stdout=null)

        tools = {"nbdcopy from diskit serve": nbdcopy, "rbd export": rbd_export}
        rates = {t: [] for t in tools}
        for r in range(ROUNDS):
            for t in rotated(list(tools), r):
                rates[t].append(tools[t]())
    finally:
        server.stop()
    m = medians(rates)
    row = {**m, "ratio": m["nbdcopy from diskit serve"] / m["rbd export"]}
    log(f"serve {row}")
    results["serve"] = row
    print(f"\n## serve: {SIZE_MIB} MiB to null, medians of {ROUNDS} (MiB/s); ratio = diskit / rbd")
    print("| nbdcopy from diskit serve | rbd export to /dev/null | ratio |")
    print("|---|---|---|")
    print(f"| {m['nbdcopy from diskit serve']:.0f} | {m['rbd export']:.0f} | {row['ratio']:.2f} |")


def part_fio(diskit, cl, work, results):
    size = min(SIZE_MIB, 1024)
    for img in ["fio", "bench"]:
        cl.remove(img)
        cl.rbd("create", "--size", f"{size}M", f"rbd/{img}")
    sock = work / "fio.sock"
    server = nb.Server([diskit, "serve", "-f", "-U", sock, "rbd", "image=rbd/fio",
                        f"conf={cl.conf}"], sock)
    iops = {"diskit serve (fio)": [], "rbd bench": []}
    try:
        for _ in range(ROUNDS):
            argv = ["fio", "--name=bench", "--ioengine=nbd", f"--uri={server.uri}",
                    "--rw=randwrite", "--bs=4k", "--iodepth=16", f"--size={size}M",
                    "--time_based", f"--runtime={RUNTIME}", "--ramp_time=1",
                    "--output-format=json"]
            out = run(argv, capture_output=True, text=True).stdout
            iops["diskit serve (fio)"].append(
                json.loads(out[out.index("{"):])["jobs"][0]["write"]["iops"])
            out = run(["rbd", "-c", cl.conf, "bench", "--io-type", "write", "--io-pattern",
                       "rand", "--io-size", "4K", "--io-threads", "16", "--io-total",
                       f"{min(size, 256)}M", "rbd/bench"], capture_output=True, text=True).stdout
            m = re.search(r"ops/sec:\s*([\d.]+)", out)
            if not m:
                raise RuntimeError(f"rbd bench said: {out}")
            iops["rbd bench"].append(float(m.group(1)))
    finally:
        server.stop()
    m = medians(iops)
    row = {**m, "ratio": m["diskit serve (fio)"] / m["rbd bench"]}
    log(f"fio {row}")
    results["fio"] = row
    print(f"\n## 4 KiB random writes, QD16, medians of {ROUNDS} (IOPS)")
    print("| diskit serve rbd (fio, nbd engine) | rbd bench (the cluster's ceiling) | ratio |")
    print("|---|---|---|")
    print(f"| {m['diskit serve (fio)']:.0f} | {m['rbd bench']:.0f} | {row['ratio']:.2f} |")


def main():
    for tool in ["rbd", "ceph-mon", "ceph-osd", "qemu-img", "nbdcopy", "fio"]:
        if not shutil.which(tool):
            sys.exit(f"{tool} not found (scripts/test installs it)")
    diskit = nb.build()
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip() or "unknown"
    work = Path(tempfile.mkdtemp(prefix="diskit-rbd-bench.", dir="/dev/shm"))
    results = {"commit": commit, "size_mib": SIZE_MIB, "rounds": ROUNDS}
    reporting_old = nb.quiet_vm()
    cl = None
    try:
        log("sources")
        make_sources(work)
        log("starting the cluster")
        cl = Cluster(work)
        parts = {"import": part_import, "export": part_export, "serve": part_serve,
                 "fio": part_fio}
        for p in PARTS:
            parts[p](diskit, cl, work, results)
    finally:
        if cl:
            cl.stop()
        nb.quiet_vm_restore(reporting_old)
        shutil.rmtree(work, ignore_errors=True)
    out = HERE / "results" / f"rbd-{time.strftime('%Y-%m-%d')}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    log(f"results in {out}")


if __name__ == "__main__":
    main()
