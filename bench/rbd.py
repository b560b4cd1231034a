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
        The image is removed after each run (not timed). Floors, in the
        same rotation: `rbd create` of the image, and `rbd import-diff`
        of the data's extents (the image's `rbd export-diff`) into an
        image made first: Ceph's own tools making the image and writing
        only the data.
        Target: diskit at most 1.0x rbd import's time; sparse at most 0.1x.

export  The full and sparse images in RBD (put there by rbd import) to a
        file on /dev/shm by
          diskit convert -O raw|qcow2 rbd:... DST, diskit copy rbd:... DST
          rbd export rbd/IMG DST, the peer.
        Floor: `rbd info` of the image (connecting and opening it).
        Target: at most 1.0x rbd export's time; sparse at most 0.1x.

serve   nbdcopy from `diskit serve -r rbd image=rbd/full conf=C` to null:
        against `rbd export rbd/full -` into /dev/null, as throughput.
        Floor: the processor seconds of rbd export, of the OSD during it
        and of nbdcopy, spread over every processor: the highest ratio a
        server that itself cost nothing could reach.
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
import resource
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


def children_cpu():
    """Processor seconds of the children waited for so far."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def process_cpu(pid):
    """Processor seconds process `pid` has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def timed_cpu(argv, osd, **kw):
    """(seconds, the command's processor seconds, the OSD's) of a run."""
    c0, o0 = children_cpu(), process_cpu(osd)
    t = timed(argv, **kw)
    return t, children_cpu() - c0, process_cpu(osd) - o0


class Cluster:
    def __init__(self, work):
        self.dir = work / "ceph"
        # Room for the images of a run: memstore keeps them in memory.
        room = (4 * SIZE_MIB + 2048) << 20
        out = run([REPO / "scripts" / "ceph-cluster.sh", "start", self.dir, room],
                  capture_output=True, text=True).stdout
        self.conf = out.strip().splitlines()[-1]
        self.osd = int(subprocess.run(["pgrep", "-f", f"ceph-osd.*{self.dir}"],
                                      capture_output=True, text=True).stdout.split()[0])

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
        # The same extents as an RBD diff stream (`rbd export-diff`), for
        # the floor: Ceph's own tool writing just that data.
        diff = work / f"{kind}.diff"
        cl.remove("diffsrc")
        cl.rbd("import", work / f"{kind}.raw", "rbd/diffsrc")
        cl.rbd("export-diff", "rbd/diffsrc", diff)
        cl.remove("diffsrc")
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

            def rbd_create():
                # The floor: connecting and making the image, no data.
                return timed(["rbd", "-c", cl.conf, "create", "--size", f"{SIZE_MIB}M",
                              "rbd/dst"])

            def rbd_import_diff():
                # The floor's other half: the data's extents written by
                # `rbd import-diff` into an image made first (not timed).
                cl.rbd("create", "--size", f"{SIZE_MIB}M", "rbd/dst")
                return timed(["rbd", "-c", cl.conf, "--no-progress", "import-diff", diff,
                              "rbd/dst"])

            tools = {"diskit convert": convert, "diskit copy": copy, "rbd import": rbd_import,
                     "rbd create": rbd_create, "rbd import-diff": rbd_import_diff}
            times = {t: [] for t in tools}
            for r in range(ROUNDS):
                for t in rotated(list(tools), r):
                    cl.remove("dst")
                    times[t].append(tools[t]())
            cl.remove("dst")
            m = medians(times)
            row = {"cell": f"{kind} {fmt}", **m,
                   "convert/rbd": m["diskit convert"] / m["rbd import"],
                   "copy/rbd": m["diskit copy"] / m["rbd import"],
                   "floor convert/rbd": (m["rbd create"] + m["rbd import-diff"]) / m["rbd import"],
                   "floor copy/rbd": m["rbd import-diff"] / m["rbd import"]}
            log(f"import {row}")
            rows.append(row)
    results["import"] = rows
    print(f"\n## import: SIZE_MIB={SIZE_MIB}, medians of {ROUNDS} (s); ratio = diskit / rbd import;"
          " floors: Ceph's own tools making the image (`rbd create`) and writing only the data's"
          " extents into it (`rbd import-diff` of the image's `rbd export-diff`), / rbd import:"
          " create + import-diff for convert (which makes the image), import-diff for copy")
    print("| source | diskit convert | diskit copy | rbd import | convert ratio | copy ratio "
          "| rbd create | rbd import-diff | convert floor | copy floor |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['cell']} | {r['diskit convert']:.3f} | {r['diskit copy']:.3f} | "
              f"{r['rbd import']:.3f} | {r['convert/rbd']:.3f} | {r['copy/rbd']:.3f} "
              f"| {r['rbd create']:.3f} | {r['rbd import-diff']:.3f} "
              f"| {r['floor convert/rbd']:.3f} | {r['floor copy/rbd']:.3f} |")


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

            def rbd_info():
                # The floor: connecting and opening the image, no data.
                return timed(["rbd", "-c", cl.conf, "info", f"rbd/{kind}"],
                             stdout=subprocess.DEVNULL)

            tools = {"diskit convert": convert, "rbd export": rbd_export, "rbd info": rbd_info}
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
                   "convert/rbd": m["diskit convert"] / m["rbd export"],
                   "floor/rbd": m["rbd info"] / m["rbd export"]}
            if "diskit copy" in m:
                row["copy/rbd"] = m["diskit copy"] / m["rbd export"]
            log(f"export {row}")
            rows.append(row)
    results["export"] = rows
    print(f"\n## export: medians of {ROUNDS} (s); ratio = diskit / rbd export (to raw);"
          " floor: `rbd info` of the image (connecting and opening it, no data) / rbd export")
    print("| image -> file | diskit convert | diskit copy | rbd export | convert ratio | copy ratio "
          "| rbd info | floor |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        copy = f"{r['diskit copy']:.3f}" if "diskit copy" in r else "-"
        ratio = f"{r['copy/rbd']:.3f}" if "copy/rbd" in r else "-"
        print(f"| {r['cell']} | {r['diskit convert']:.3f} | {copy} | {r['rbd export']:.3f} | "
              f"{r['convert/rbd']:.3f} | {ratio} | {r['rbd info']:.3f} | {r['floor/rbd']:.3f} |")


def part_serve(diskit, cl, work, results):
    cl.remove("full")
    cl.rbd("import", work / "full.raw", "rbd/full")
    sock = work / "serve.sock"
    server = nb.Server([diskit, "serve", "-f", "-r", "-U", sock, "rbd", "image=rbd/full",
                        f"conf={cl.conf}"], sock)
    # Processor seconds of each run: the tool's own (nbdcopy, rbd), the
    # OSD's, and the server's (diskit serve).
    cpu = {"nbdcopy": [], "rbd export": [], "osd (rbd export)": [], "diskit serve": []}
    try:
        def nbdcopy():
            s0 = process_cpu(server.proc.pid)
            t, own, _ = timed_cpu(["nbdcopy", server.uri, "null:"], cl.osd)
            cpu["nbdcopy"].append(own)
            cpu["diskit serve"].append(process_cpu(server.proc.pid) - s0)
            return SIZE_MIB / t

        def rbd_export():
            with open(os.devnull, "wb") as null:
                t, own, osd = timed_cpu(["rbd", "-c", cl.conf, "--no-progress", "export",
                                         "rbd/full", "-"], cl.osd, stdout=null)
            cpu["rbd export"].append(own)
            cpu["osd (rbd export)"].append(osd)
            return SIZE_MIB / t

        tools = {"nbdcopy from diskit serve": nbdcopy, "rbd export": rbd_export}
        rates = {t: [] for t in tools}
        for r in range(ROUNDS):
            for t in rotated(list(tools), r):
                rates[t].append(tools[t]())
    finally:
        server.stop()
    m = medians(rates)
    c = medians(cpu)
    # Any server's floor: the OSD's and librbd's work for the data (what
    # `rbd export` and the OSD spend) and nbdcopy's own, on every
    # processor at once, with nothing for the server itself.
    cores = os.cpu_count()
    floor_s = (c["rbd export"] + c["osd (rbd export)"] + c["nbdcopy"]) / cores
    rbd_s = SIZE_MIB / m["rbd export"]
    row = {**m, "ratio": m["nbdcopy from diskit serve"] / m["rbd export"],
           "cpu": c, "floor seconds": floor_s, "floor ratio": rbd_s / floor_s}
    log(f"serve {row}")
    results["serve"] = row
    print(f"\n## serve: {SIZE_MIB} MiB to null, medians of {ROUNDS} (MiB/s); ratio = diskit / rbd;"
          f" floor: the highest ratio any server could reach on {cores} processors (the"
          " processor seconds of rbd export, of the OSD during it and of nbdcopy, spread over"
          " every processor, the server's own work taken as none)")
    print("| nbdcopy from diskit serve | rbd export to /dev/null | ratio | cpu s: rbd export / osd /"
          " nbdcopy / diskit serve | floor |")
    print("|---|---|---|---|---|")
    print(f"| {m['nbdcopy from diskit serve']:.0f} | {m['rbd export']:.0f} | {row['ratio']:.2f} | "
          f"{c['rbd export']:.2f} / {c['osd (rbd export)']:.2f} / {c['nbdcopy']:.2f} / "
          f"{c['diskit serve']:.2f} | {row['floor ratio']:.2f} |")


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
