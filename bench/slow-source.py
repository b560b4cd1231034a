#!/usr/bin/env python3
"""Benchmark (issue 14, seed 004): a slow source behind a writable, cached
disk, the virt-v2v input pipeline.

A 1 GiB ext4 image filled with real files (mkfs.ext4 -d from a copy of
SRC_DIR, default /usr/share) is served with DELAY_MS (50) on every read of
the source (`--filter=delay delay-read=...` at the bottom of each stack),
and a serial trace of READS (2000) reads of 4 to 64 KiB is replayed one at
a time by a libnbd client that checks a digest of everything read: 30% at
uniform places, 70% within 1 MiB of an earlier read. The trace is made
once from SEED (fixed), so every contender replays the same one.

Contenders (CONTENDERS, comma separated, default all):
  nbdkit-nocache       nbdkit --filter=delay file IMG
  nbdkit-cow-on-read   nbdkit --filter=cow --filter=delay ... cow-on-read=true
  nbdkit-cow-cache     nbdkit --filter=cow --filter=cache --filter=delay
                       ... cache-on-read=true
  qemu-cor             qemu-nbd 10 serving a qcow2 overlay through QEMU's
                       copy-on-read driver; its backing file is the slow
                       source, exported by nbdkit --filter=delay file IMG
  diskit-cow-on-read   diskit serve, the same command line as nbdkit's
  diskit-cow-on-read-1M  ... cow-block-size=1M
  nbdkit-cow-on-read-1M  nbdkit with the same
  diskit-readahead-cow   --filter=readahead --filter=cow --filter=delay ...
                         cow-on-read=true cow-on-cache=true
  nbdkit-readahead-cow   nbdkit with the same
  diskit-cow-cache       diskit with nbdkit-cow-cache's command line

Each contender runs once per round (ROUNDS, default 1: the nbdkit rows take
minutes), in a rotating order; the table gives the median time of the
replay (server start-up excluded), the reads that reached the source (the
delay filter's request count, from nbdkit's or diskit's stats where
available; otherwise "-"), and each contender's time over the best peer's.
Target: the best diskit pipeline at most 0.8x the best peer's time in the
same run (goal: under 40 s with the default trace).

Output: the table and bench/results/slow-source-<date>.json.
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

ALL = [
    "nbdkit-nocache",
    "nbdkit-cow-on-read",
    "nbdkit-cow-cache",
    "qemu-cor",
    "diskit-cow-on-read",
    "diskit-cow-on-read-1M",
    "nbdkit-cow-on-read-1M",
    "diskit-readahead-cow",
    "nbdkit-readahead-cow",
    "diskit-cow-cache",
]
CONTENDERS = chosen("CONTENDERS", ALL)

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


def servers_for(name, diskit, img, work, sock):
    """The processes of one contender, bottom first: [(argv, socket)]."""
    delay = f"delay-read={DELAY_MS}ms"
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
            (["nbdkit", "-f", "-U", str(src), "--filter=delay", "file", str(img), delay], src),
            (["qemu-nbd", "-t", "-k", str(sock), "--image-opts", opts], sock),
        ]
    kind, _, rest = name.partition("-")
    if kind == "diskit":
        base = [str(diskit), "serve", "-f", "-U", str(sock)]
    else:
        base = ["nbdkit", "-f", "-U", str(sock)]
    if rest == "nocache":
        args = ["--filter=delay", "file", str(img), delay]
    elif rest.startswith("cow-on-read"):
        args = ["--filter=cow", "--filter=delay", "file", str(img), "cow-on-read=true", delay]
        if rest.endswith("-1M"):
            args.append("cow-block-size=1M")
    elif rest == "readahead-cow":
        args = ["--filter=readahead", "--filter=cow", "--filter=delay", "file", str(img),
                "cow-on-read=true", "cow-on-cache=true", delay]
    elif rest == "cow-cache":
        args = ["--filter=cow", "--filter=cache", "--filter=delay", "file", str(img),
                "cache-on-read=true", delay]
    else:
        raise ValueError(name)
    return [(base + args, sock)]


def run_one(name, diskit, img, work, trace_file, want):
    sock = work / "nbd.sock"
    procs = []
    try:
        for argv, s in servers_for(name, diskit, img, work, sock):
            procs.append(nb.Server(argv, s))
        uri = f"nbd+unix:///?socket={sock}"
        out = subprocess.run(["/usr/bin/python3", "-c", REPLAY, uri, str(trace_file)],
                             check=True, capture_output=True, text=True)
        r = json.loads(out.stdout)
        if r["digest"] != want:
            raise RuntimeError(f"{name}: wrong data (digest {r['digest']}, want {want})")
        return r["secs"]
    finally:
        for p in reversed(procs):
            p.stop()


def main():
    diskit = nb.build()
    old = nb.quiet_vm()
    work = Path(tempfile.mkdtemp(prefix="diskit-slow-source-"))
    try:
        img = make_image(work)
        size = img.stat().st_size
        trace = make_trace(size)
        trace_file = work / "trace.json"
        trace_file.write_text(json.dumps(trace))
        want = expected_digest(img, trace)
        times = {c: [] for c in CONTENDERS}
        for r in range(ROUNDS):
            order = CONTENDERS[r % len(CONTENDERS):] + CONTENDERS[:r % len(CONTENDERS)]
            for c in order:
                secs = run_one(c, diskit, img, work, trace_file, want)
                times[c].append(secs)
                log(f"round {r + 1}: {c} {secs:.1f} s")
        med = {c: statistics.median(v) for c, v in times.items()}
        peers = [c for c in med if not c.startswith("diskit")]
        ours = [c for c in med if c.startswith("diskit")]
        best_peer = min(peers, key=med.get) if peers else None
        print(f"\nslow source ({READS} serial reads, {DELAY_MS} ms per source read): median seconds")
        for c in CONTENDERS:
            rel = f"{med[c] / med[best_peer]:.2f}x best peer" if best_peer else ""
            print(f"  {c:24} {med[c]:8.1f}  {rel}")
        verdict = None
        if best_peer and ours:
            best_ours = min(ours, key=med.get)
            ratio = med[best_ours] / med[best_peer]
            verdict = ratio <= 0.8
            print(f"\nbest diskit {best_ours} {med[best_ours]:.1f} s, best peer {best_peer} "
                  f"{med[best_peer]:.1f} s: {ratio:.2f}x (target <= 0.80x): "
                  f"{'met' if verdict else 'MISSED'}")
        results = HERE / "results"
        results.mkdir(exist_ok=True)
        out = results / f"slow-source-{time.strftime('%Y-%m-%d-%H%M%S')}.json"
        out.write_text(json.dumps({"reads": READS, "delay_ms": DELAY_MS, "seed": SEED,
                                   "times": times, "median": med, "met": verdict}, indent=1))
        print(f"results written to {out}")
    finally:
        nb.quiet_vm_restore(old)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
