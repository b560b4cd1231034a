#!/usr/bin/env python3
"""Benchmark: seed 000's convert matrix (issue #15), diskit against qemu-img
in the same run.

Sources: SIZE_MIB images of each format diskit reads
  raw, qcow2, qcow2 preallocation=metadata, qcow2 preallocation=falloc,
  vdi, vpc (dynamic), qed, vmdk (monolithicSparse), vmdk streamOptimized,
  vhdx (dynamic), each
  sparse: 64 KiB of data every 32 MiB (written by qemu-io), the rest never written
  full:   every byte written (random data)
on each location: tmpfs (/dev/shm) and the work disk (BENCH_DIR).
Targets: a raw file (convert -O raw), null (convert -n to QEMU's null-co
driver sized to the image, nothing stored) and qcow2 (convert -O qcow2).

Each round runs every cell once per tool, the tool going first alternating;
the table gives medians over ROUNDS rounds, qemu-img's time over diskit's
(above 1: diskit faster), and each format's time over raw's for the same
data (issue targets: sparse at most 2x raw, full at most 1.2x raw; every
cell at most qemu-img's time). Outputs are compared with qemu-img compare
once per cell. Free page reporting is held still (bench/nbd.py).

Environment: DISKIT_BASELINE (another diskit binary, an older commit's,
timed as a third tool with diskit's command lines: before/after in one
run), SIZE_MIB (default 2048), ROUNDS (default 3), LOCATIONS
(default shm,disk), FORMATS, DATA (default sparse,full), TARGETS
(default file,null,qcow2), BENCH_DIR (default bench/.work).
Output: the table on stdout and bench/results/format-matrix-<date>.json.
"""

import json
import shutil
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchlib import logger, nbdbench, rotated

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
# DISKIT_BIN measures another binary (another commit's, for before/after runs).
DISKIT = Path(os.environ.get("DISKIT_BIN") or REPO / "target" / "release" / "diskit")
# DISKIT_BASELINE: another diskit binary (an older commit's), run as a third
# tool "baseline" with diskit's command lines: before/after in one run.
BASELINE = os.environ.get("DISKIT_BASELINE")
TOOLS = ["diskit", "qemu-img"] + (["baseline"] if BASELINE else [])
SIZE_MIB = int(os.environ.get("SIZE_MIB", "2048"))
ROUNDS = int(os.environ.get("ROUNDS", "3"))
LOCATIONS = os.environ.get("LOCATIONS", "shm,disk").split(",")
FORMATS_ALL = ["raw", "qcow2", "qcow2-metadata", "qcow2-falloc", "vdi", "vpc", "qed", "vmdk",
               "vmdk-stream", "vhdx"]
FORMATS = os.environ.get("FORMATS", ",".join(FORMATS_ALL)).split(",")
DATA = os.environ.get("DATA", "sparse,full").split(",")
TARGETS = os.environ.get("TARGETS", "file,null,qcow2").split(",")
DISK_DIR = Path(os.environ.get("BENCH_DIR", HERE / ".work"))


log = logger("format-matrix.py")


def run(cmd, **kw):
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, **kw)


def create_args(fmt):
    """(-f name, -o options) of qemu-img create for a source format."""
    return {
        "raw": ("raw", []),
        "qcow2": ("qcow2", []),
        "qcow2-metadata": ("qcow2", ["-o", "preallocation=metadata"]),
        "qcow2-falloc": ("qcow2", ["-o", "preallocation=falloc"]),
        "vdi": ("vdi", []),
        "vpc": ("vpc", ["-o", "force_size=on"]),
        "qed": ("qed", []),
        "vmdk": ("vmdk", []),
        "vmdk-stream": ("vmdk", ["-o", "subformat=streamOptimized"]),
        "vhdx": ("vhdx", []),
    }[fmt]


def make_source(work, fmt, data):
    name, opts = create_args(fmt)
    path = work / f"src-{fmt}-{data}.img"
    if path.exists():
        return path, name
    run(["qemu-img", "create", "-q", "-f", name, *opts, str(path), f"{SIZE_MIB}M"])
    if data == "sparse":
        cmds = []
        for i in range(0, SIZE_MIB, 32):
            cmds += ["-c", f"write -P {1 + i % 250} {i}M 64k"]
        run(["qemu-io", "-f", name, *cmds, str(path)])
    else:
        full = work / "full.raw"
        if not full.exists():
            with open(full, "wb") as f:
                for _ in range(SIZE_MIB):
                    f.write(os.urandom(1 << 20))
        run(["qemu-img", "convert", "-n", "-f", "raw", "-O", name, str(full), str(path)])
    return path, name


def cell_cmd(tool, src, fmt_name, target, out):
    exe = {"diskit": str(DISKIT), "baseline": BASELINE}.get(tool, "qemu-img")
    if target == "file":
        return [exe, "convert", "-f", fmt_name, "-O", "raw", str(src), str(out)]
    if target == "qcow2":
        return [exe, "convert", "-f", fmt_name, "-O", "qcow2", str(src), str(out)]
    # null-co sized to the image (its default is 1 GiB).
    return [exe, "convert", "-n", "-f", fmt_name, str(src), "--target-image-opts",
            f"driver=null-co,size={SIZE_MIB << 20}"]


def timed(cmd, loc, out):
    if out is not None:
        out.unlink(missing_ok=True)
    if loc == "disk":
        os.sync()
    start = time.monotonic()
    run(cmd)
    return time.monotonic() - start


def run_format(loc, work, fmt):
    """Every cell of `fmt` at `loc`: its sources made, the warm-up and
    correctness runs, ROUNDS timed rounds; the sources removed after."""
    cells = []
    for data in DATA:
        log(f"{loc}: making {fmt} {data}")
        src, name = make_source(work, fmt, data)
        for target in TARGETS:
            cells.append((fmt, data, target, src, name))
    out = work / "out.img"
    times = {(c[0], c[1], c[2]): {t: [] for t in TOOLS} for c in cells}
    # Warm-up and correctness: each tool's output compared with the source.
    for fmt, data, target, src, name in cells:
        for tool in TOOLS:
            timed(cell_cmd(tool, src, name, target, out), loc, out if target != "null" else None)
            if target != "null":
                run(["qemu-img", "compare", "-f", name, str(src), str(out)])
    for r in range(ROUNDS):
        for i, (fmt, data, target, src, name) in enumerate(cells):
            order = rotated(TOOLS, r + i)
            for tool in order:
                o = out if target != "null" else None
                times[(fmt, data, target)][tool].append(
                    timed(cell_cmd(tool, src, name, target, out), loc, o))
        log(f"{loc}: {fmt} round {r + 1}/{ROUNDS} done")
    out.unlink(missing_ok=True)
    for p in work.glob("src-*"):
        p.unlink()
    rows = []
    for (fmt, data, target), t in times.items():
        rows.append({"location": loc, "format": fmt, "data": data, "target": target,
                     "diskit_s": statistics.median(t["diskit"]),
                     "qemu_img_s": statistics.median(t["qemu-img"]), "runs": t,
                     **({"baseline_s": statistics.median(t["baseline"])} if BASELINE else {})})
    return rows


def main():
    if not DISKIT.exists():
        raise SystemExit("build first: cargo build --release -p diskit")
    old = nbdbench.quiet_vm()
    rows = []
    try:
        for loc in LOCATIONS:
            work = Path("/dev/shm/diskit-format-matrix") if loc == "shm" else DISK_DIR / "format-matrix"
            work.mkdir(parents=True, exist_ok=True)
            try:
                # One format at a time: its sources exist only while its
                # cells run (every format's full 2 GiB images at once do
                # not fit in memory).
                for fmt in FORMATS:
                    rows += run_format(loc, work, fmt)
            finally:
                shutil.rmtree(work, ignore_errors=True)
    finally:
        nbdbench.quiet_vm_restore(old)
    raw = {(r["location"], r["data"], r["target"]): r["diskit_s"] for r in rows if r["format"] == "raw"}
    print(f"{'location':<6}{'format':<16}{'data':<8}{'target':<7}{'diskit s':>10}{'qemu-img s':>12}"
          f"{'qemu/diskit':>13}{'vs raw':>8}")
    for r in rows:
        base = raw.get((r["location"], r["data"], r["target"]))
        r["speedup"] = r["qemu_img_s"] / r["diskit_s"]
        r["vs_raw"] = r["diskit_s"] / base if base else None
        vs = f"{r['vs_raw']:.2f}x" if r["vs_raw"] else "-"
        print(f"{r['location']:<6}{r['format']:<16}{r['data']:<8}{r['target']:<7}{r['diskit_s']:>10.3f}"
              f"{r['qemu_img_s']:>12.3f}{r['speedup']:>12.2f}x{vs:>8}")
    if BASELINE:
        print("\nbefore/after: diskit's median over the baseline binary's (above 1.05: 5% slower)")
        for r in rows:
            r["vs_baseline"] = r["diskit_s"] / r["baseline_s"]
            print(f"{r['location']:<6}{r['format']:<16}{r['data']:<8}{r['target']:<7}"
                  f"{r['baseline_s']:>8.3f} -> {r['diskit_s']:.3f}{r['vs_baseline']:>8.3f}")
    stamp = time.strftime("%Y-%m-%d-%H%M%S")
    path = REPO / "bench" / "results" / f"format-matrix-{stamp}.json"
    path.write_text(json.dumps({"size_mib": SIZE_MIB, "rounds": ROUNDS, "cells": rows}, indent=1))
    log(f"results in {path}")


if __name__ == "__main__":
    main()
