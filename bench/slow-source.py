#!/usr/bin/env python3
"""Benchmark (issues 14 and 33, seed 004): a slow source behind a writable,
cached disk, the virt-v2v input pipeline.

A 1 GiB ext4 image filled with real files (mkfs.ext4 -d from a copy of
SRC_DIR, default /usr/share) is served with DELAY_MS (50) on every read of
the source (`--filter=delay delay-read=...` at the bottom of each stack,
under a stats filter that counts the reads reaching it), and a serial
trace of READS (2000) reads of 4 to 64 KiB is replayed one at a time by a
libnbd client that checks a digest of everything read: 30% at uniform
places, 70% within 1 MiB of an earlier read. The trace is made once from
SEED (fixed), so every contender replays the same one.

Contenders (CONTENDERS, comma separated, default all but nbdkit-nocache):
TOOL-PIPELINE, TOOL diskit (`diskit serve`) or nbdkit with the same
command line, the filters first nearest the client:
  nocache               --filter=delay file IMG
  cow-on-read           --filter=cow ... cow-on-read=true
  cow-on-read-1M        ... cow-block-size=1M
  cow-cache             --filter=cow --filter=cache ... cache-on-read=true
                        (virt-v2v's order, default parameters otherwise)
  cow-readahead         --filter=cow --filter=readahead ... cow-on-read=true
  readahead-cow         --filter=readahead --filter=cow ... cow-on-read=true
                        cow-on-cache=true
  readahead-cow-cache   virt-v2v's order with readahead on top,
  cow-readahead-cache   in the middle,
  cow-cache-readahead   and at the bottom (cache-on-read=true)
and qemu-cor: qemu-nbd 10 serving a qcow2 overlay through QEMU's
copy-on-read driver; its backing file is the slow source, exported by
nbdkit --filter=stats --filter=delay file IMG.

Each contender runs once per round (ROUNDS, default 1: the nbdkit rows take
minutes), in a rotating order; the table gives the median time of the
replay (server start-up excluded), the reads that reached the source and
their MiB (the stats filter's, last round), and each time over
qemu-cor's. Target (issue 33): the diskit rows in virt-v2v's order
(cow-cache, with readahead anywhere or none) at most 15 s and at most
0.25x qemu-cor's time in the same run.

IMAGE=PATH keeps the image there (made if missing, reused if present) so
that repeated runs skip making it. Output: the table and
bench/results/slow-source-<date>.json.
"""

import hashlib
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchlib import chosen, logger
from benchlib import nbdbench as nb

HERE = Path(__file__).resolve().parent
ROUNDS = int(os.environ.get("ROUNDS", "1"))
READS = int(os.environ.get("READS", "2000"))
DELAY_MS = int(os.environ.get("DELAY_MS", "50"))
SEED = int(os.environ.get("SEED", "4"))
SRC_DIR = os.environ.get("SRC_DIR", "/usr/share")
IMG_MIB = 1024

# Pipelines: the filters (first nearest the client) and their parameters;
# stats and delay go under them, over the file plugin.
PIPELINES = {
    "nocache": ([], []),
    "cow-on-read": (["cow"], ["cow-on-read=true"]),
    "cow-on-read-1M": (["cow"], ["cow-on-read=true", "cow-block-size=1M"]),
    "cow-cache": (["cow", "cache"], ["cache-on-read=true"]),
    "cow-readahead": (["cow", "readahead"], ["cow-on-read=true"]),
    "readahead-cow": (["readahead", "cow"], ["cow-on-read=true", "cow-on-cache=true"]),
    "readahead-cow-cache": (["readahead", "cow", "cache"], ["cache-on-read=true"]),
    "cow-readahead-cache": (["cow", "readahead", "cache"], ["cache-on-read=true"]),
    "cow-cache-readahead": (["cow", "cache", "readahead"], ["cache-on-read=true"]),
}
# The rows the target is for: virt-v2v's order, readahead anywhere or none.
VIRT_V2V = ["cow-cache", "readahead-cow-cache", "cow-readahead-cache", "cow-cache-readahead"]
TARGET_SECS = 15.0
TARGET_RATIO = 0.25

ALL = ["qemu-cor"] + [f"{tool}-{p}" for p in PIPELINES for tool in ("diskit", "nbdkit")
                      if f"{tool}-{p}" != "diskit-nocache"]
CONTENDERS = chosen("CONTENDERS", [c for c in ALL if c != "nbdkit-nocache"])

REPLAY = r"""
import hashlib, json, sys, time
import nbd
uri, trace = sys.argv[1], json.load(open(sys.argv[2]))
h = nbd.NBD()
h.connect_uri(uri)
d = hashlib.sha256()
t0 = time.monotonic()
for off, n in trace:
    d.update(h.pread(n, off))
secs = time.monotonic() - t0
h.shutdown()
print(json.dumps({"secs": secs, "digest": d.hexdigest()}))
"""


log = logger("slow-source.py")


def make_image(work):
    img = work / "fs.img"
    tree = work / "tree"
    log(f"copying {SRC_DIR} and making a {IMG_MIB} MiB ext4 image of it")
    # Copy as much as fits comfortably (about 70% of the image).
    subprocess.run(["cp", "-a", "--no-preserve=ownership", SRC_DIR, tree], check=False,
                   stderr=subprocess.DEVNULL)
    budget = IMG_MIB * 7 // 10 << 20
    total = 0
    for p in sorted(tree.rglob("*")):
        if p.is_file() and not p.is_symlink():
            total += p.stat().st_size
            if total > budget:
                p.unlink()
    subprocess.run(["mkfs.ext4", "-q", "-F", "-d", str(tree), str(img), f"{IMG_MIB}M"],
                   check=True)
    shutil.rmtree(tree, ignore_errors=True)
    return img


def make_trace(size):
    """READS reads of 4-64 KiB: 30% anywhere, 70% within 1 MiB of an
    earlier read (a guest inspector walking metadata and files)."""
    rng = random.Random(SEED)
    trace, seen = [], []
    for _ in range(READS):
        n = rng.choice([4, 8, 16, 32, 64]) << 10
        if seen and rng.random() < 0.7:
            base = rng.choice(seen)
            off = base + rng.randint(-(1 << 20), 1 << 20)
        else:
            off = rng.randrange(0, size)
        off = max(0, min(size - n, off)) // 512 * 512
        trace.append((off, n))
        seen.append(off)
    return trace


def expected_digest(img, trace):
    d = hashlib.sha256()
    with open(img, "rb") as f:
        for off, n in trace:
            f.seek(off)
            d.update(f.read(n))
    return d.hexdigest()


def source_args(stats):
    """The filters at the bottom of every stack: the stats filter counting
    what reaches the delay, then the delay."""
    return ["--filter=stats", "--filter=delay"], [f"statsfile={stats}",
                                                 f"delay-read={DELAY_MS}ms"]


def servers_for(name, diskit, img, work, sock, stats):
    """The processes of one contender, bottom first: [(argv, socket)]."""
    bottom, bottom_params = source_args(stats)
    if name == "qemu-cor":
        src = work / "src.sock"
        ov = work / "overlay.qcow2"
        ov.unlink(missing_ok=True)
        # -u: the backing file is not open yet (it is served below).
        subprocess.run(["qemu-img", "create", "-q", "-u", "-f", "qcow2", "-F", "raw", "-b",
                        f"nbd+unix:///?socket={src}", str(ov), str(img.stat().st_size)],
                       check=True)
        opts = ("driver=copy-on-read,file.driver=qcow2,"
                f"file.file.driver=file,file.file.filename={ov}")
        return [
            (["nbdkit", "-f", "-U", str(src), *bottom, "file", str(img), *bottom_params], src),
            (["qemu-nbd", "-t", "-k", str(sock), "--image-opts", opts], sock),
        ]
    tool, _, pipeline = name.partition("-")
    if tool == "diskit":
        base = [str(diskit), "serve", "-f", "-U", str(sock)]
    elif tool == "nbdkit":
        base = ["nbdkit", "-f", "-U", str(sock)]
    else:
        raise ValueError(name)
    filters, params = PIPELINES[pipeline]
    return [(base + [f"--filter={f}" for f in filters] + bottom + ["file", str(img)]
             + params + bottom_params, sock)]


UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}


def source_reads(stats):
    """(reads, MiB) from a stats file (nbdkit's format, diskit's too), or
    None when it has no read line."""
    try:
        lines = stats.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith("read: "):
            parts = line.split(", ")
            ops = int(parts[0].split()[1])
            value, unit = parts[2].split()
            return ops, float(value) * UNITS[unit] / (1 << 20)
    return None


def run_one(name, diskit, img, work, trace_file, want):
    """(seconds, source reads) of one replay."""
    sock = work / "nbd.sock"
    stats = work / "stats.txt"
    stats.unlink(missing_ok=True)
    procs = []
    try:
        for argv, s in servers_for(name, diskit, img, work, sock, stats):
            procs.append(nb.Server(argv, s))
        uri = f"nbd+unix:///?socket={sock}"
        out = subprocess.run(["/usr/bin/python3", "-c", REPLAY, uri, str(trace_file)],
                             check=True, capture_output=True, text=True)
        r = json.loads(out.stdout)
        if r["digest"] != want:
            raise RuntimeError(f"{name}: wrong data (digest {r['digest']}, want {want})")
    finally:
        # The top first: its close may still read below. nbdkit's
        # readahead drains its queue of cache requests (50 ms each) before
        # it exits and writes its stats: time for that.
        for p in reversed(procs):
            p.stop(grace=300)
    got = source_reads(stats)
    if got is None:
        codes = [p.proc.returncode for p in procs]
        log(f"{name}: no read count in the stats file (exit statuses {codes})")
    return r["secs"], got


def image(work):
    """The image: IMAGE's, made there if missing, or a new one in `work`."""
    keep = os.environ.get("IMAGE")
    if not keep:
        return make_image(work)
    path = Path(keep)
    if not path.exists():
        made = make_image(work)
        shutil.move(made, path)
    return path


def main():
    diskit = nb.build()
    old = nb.quiet_vm()
    work = Path(tempfile.mkdtemp(prefix="diskit-slow-source-"))
    try:
        img = image(work)
        size = img.stat().st_size
        trace = make_trace(size)
        trace_file = work / "trace.json"
        trace_file.write_text(json.dumps(trace))
        want = expected_digest(img, trace)
        load = os.getloadavg()
        times = {c: [] for c in CONTENDERS}
        reads = {}
        for r in range(ROUNDS):
            order = CONTENDERS[r % len(CONTENDERS):] + CONTENDERS[:r % len(CONTENDERS)]
            for c in order:
                secs, got = run_one(c, diskit, img, work, trace_file, want)
                times[c].append(secs)
                reads[c] = got
                seen = f", {got[0]} source reads, {got[1]:.0f} MiB" if got else ""
                log(f"round {r + 1}: {c} {secs:.1f} s{seen}")
        med = {c: statistics.median(v) for c, v in times.items()}
        qemu = med.get("qemu-cor")
        print(f"\nslow source ({READS} serial reads, {DELAY_MS} ms per source read), "
              f"load average at the start {load[0]:.2f}: median seconds")
        print(f"  {'contender':28}{'seconds':>9}{'source reads':>14}{'MiB read':>10}"
              f"{'vs qemu-cor':>13}")
        for c in CONTENDERS:
            got = reads.get(c)
            n, mib = (f"{got[0]}", f"{got[1]:.0f}") if got else ("-", "-")
            rel = f"{med[c] / qemu:.2f}x" if qemu else "-"
            print(f"  {c:28}{med[c]:9.1f}{n:>14}{mib:>10}{rel:>13}")
        verdict = None
        ours = [c for c in CONTENDERS if c.startswith("diskit-")
                and c.removeprefix("diskit-") in VIRT_V2V]
        if ours:
            verdict = True
            for c in ours:
                ok = med[c] <= TARGET_SECS and (qemu is None or med[c] <= TARGET_RATIO * qemu)
                verdict &= ok
                rel = f", {med[c] / qemu:.2f}x qemu-cor" if qemu else ""
                print(f"{c}: {med[c]:.1f} s{rel} (target <= {TARGET_SECS:.0f} s and "
                      f"<= {TARGET_RATIO}x): {'met' if ok else 'MISSED'}")
        results = HERE / "results"
        results.mkdir(exist_ok=True)
        out = results / f"slow-source-{time.strftime('%Y-%m-%d-%H%M%S')}.json"
        out.write_text(json.dumps({
            "reads": READS, "delay_ms": DELAY_MS, "seed": SEED, "loadavg": load,
            "times": times, "median": med,
            "source_reads": {c: {"reads": v[0], "mib": v[1]} for c, v in reads.items() if v},
            "met": verdict}, indent=1))
        print(f"results written to {out}")
    finally:
        nb.quiet_vm_restore(old)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
