#!/usr/bin/env python3
"""Benchmark: issue #16's cells, diskit against qemu-img in the same run.

Cells (each a command both tools run with the same arguments):

  luks-to-raw        convert a LUKS image (SIZE_MIB of random data) to raw
  raw-to-luks        convert raw into an existing, empty LUKS image (-n)
  qcow2luks-to-raw   convert a qcow2+LUKS image to raw
  raw-to-qcow2luks   convert raw into an existing, empty qcow2+LUKS image (-n)
  dd                 dd bs=1M of a DD_MIB raw file to a new raw file
  convert-C          convert -C (copy offloading) of a DD_MIB raw file

Both tools decrypt and encrypt with AES-NI (aes-256-xts-plain64, QEMU's
default); the targets of the -n cells are copied from a pristine empty
image before every run (untimed), so that the key derivation of creating
one (QEMU measures PBKDF2 for a second or more) is not what is timed.
Every run's output is compared with the source once (the warm-up run).

Each round runs every cell once per tool, the tool going first
alternating from round to round; the table gives the median over ROUNDS
rounds and qemu-img's time over diskit's (above 1: diskit is faster).
Target from the issue: every cell at most qemu-img's time. Files live in
BENCH_DIR (default /dev/shm/diskit-bench-tools); the free page reporting
knobs are held still for the run (bench/nbd.py).

Environment: SIZE_MIB (default 1024), DD_MIB (default 2048), ROUNDS
(default 5), CELLS (comma separated, default all), BENCH_DIR, KEEP (keep
the files afterwards).
Output: the table on stdout and bench/results/qemu-img-tools-<date>.json.
"""

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchlib import chosen, logger, nbdbench

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
SIZE_MIB = int(os.environ.get("SIZE_MIB", "1024"))
DD_MIB = int(os.environ.get("DD_MIB", "2048"))
ROUNDS = int(os.environ.get("ROUNDS", "5"))
WORK = Path(os.environ.get("BENCH_DIR", "/dev/shm/diskit-bench-tools"))
DISKIT = REPO / "target" / "release" / "diskit"
SECRET = "bench-passphrase"
OBJECT = ["--object", f"secret,id=sec0,data={SECRET}"]
ALL = ["luks-to-raw", "raw-to-luks", "qcow2luks-to-raw", "raw-to-qcow2luks", "dd", "convert-C"]
CELLS = chosen("CELLS", ALL)


log = logger("qemu-img-tools.py")


def luks(name):
    return f"driver=luks,key-secret=sec0,file.filename={WORK / name}"


def qcow2luks(name):
    return f"driver=qcow2,encrypt.key-secret=sec0,file.filename={WORK / name}"


def cell_argv(cell):
    """(subcommand args after the tool, output file, prepare step, source
    to compare the output with)."""
    w = WORK
    if cell == "luks-to-raw":
        return (["convert", *OBJECT, "-O", "raw", "--image-opts", luks("src.luks"), str(w / "out.raw")],
                w / "out.raw", None, w / "src.raw")
    if cell == "raw-to-luks":
        return (["convert", *OBJECT, "-n", str(w / "src.raw"), "--target-image-opts", luks("out.luks")],
                None, ("pristine.luks", "out.luks"), None)
    if cell == "qcow2luks-to-raw":
        return (["convert", *OBJECT, "-O", "raw", "--image-opts", qcow2luks("src.qcow2"), str(w / "out.raw")],
                w / "out.raw", None, w / "src.raw")
    if cell == "raw-to-qcow2luks":
        return (["convert", *OBJECT, "-n", str(w / "src.raw"), "--target-image-opts", qcow2luks("out.qcow2")],
                None, ("pristine.qcow2", "out.qcow2"), None)
    if cell == "dd":
        return (["dd", "-f", "raw", "-O", "raw", "bs=1M", f"if={w / 'big.raw'}", f"of={w / 'out.raw'}"],
                w / "out.raw", None, w / "big.raw")
    if cell == "convert-C":
        return (["convert", "-C", "-f", "raw", "-O", "raw", str(w / "big.raw"), str(w / "out.raw")],
                w / "out.raw", None, w / "big.raw")
    raise SystemExit(f"unknown cell {cell}")


def run(cmd):
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)


def prepare():
    WORK.mkdir(parents=True, exist_ok=True)
    src = WORK / "src.raw"
    if not src.exists() or src.stat().st_size != SIZE_MIB << 20:
        log(f"making {SIZE_MIB} MiB of random data")
        with open(src, "wb") as f:
            for _ in range(SIZE_MIB):
                f.write(os.urandom(1 << 20))
    big = WORK / "big.raw"
    if not big.exists() or big.stat().st_size != DD_MIB << 20:
        log(f"making a {DD_MIB} MiB raw file")
        with open(big, "wb") as f:
            chunk = os.urandom(1 << 20)
            for i in range(DD_MIB):
                f.write(chunk[i % 256:] + chunk[:i % 256])
    size = f"{SIZE_MIB}M"
    for name in ["pristine.luks", "src.luks"]:
        (WORK / name).unlink(missing_ok=True)
        run(["qemu-img", "create", "-q", "-f", "luks", *OBJECT, "-o", "key-secret=sec0,iter-time=10",
             str(WORK / name), size])
    for name in ["pristine.qcow2", "src.qcow2"]:
        (WORK / name).unlink(missing_ok=True)
        run(["qemu-img", "create", "-q", "-f", "qcow2", *OBJECT, "-o",
             "encrypt.format=luks,encrypt.key-secret=sec0,encrypt.iter-time=10", str(WORK / name), size])
    log("filling the encrypted sources with qemu-img")
    run(["qemu-img", "convert", *OBJECT, "-n", str(src), "--target-image-opts", luks("src.luks")])
    run(["qemu-img", "convert", *OBJECT, "-n", str(src), "--target-image-opts", qcow2luks("src.qcow2")])


def reset(prep, out):
    if out is not None:
        out.unlink(missing_ok=True)
    if prep is not None:
        subprocess.run(["cp", "--sparse=always", str(WORK / prep[0]), str(WORK / prep[1])], check=True)


def timed(tool, argv):
    exe = str(DISKIT) if tool == "diskit" else "qemu-img"
    start = time.monotonic()
    run([exe, *argv])
    return time.monotonic() - start


def verify(cell, tool, out, compare_with, prep):
    """The warm-up run's output equals the source."""
    if compare_with is not None:
        if subprocess.run(["cmp", "-s", str(out), str(compare_with)]).returncode != 0:
            raise SystemExit(f"{cell}: {tool}'s output differs from the source")
    elif prep is not None:
        target = luks(prep[1]) if prep[1].endswith(".luks") else qcow2luks(prep[1])
        run(["qemu-img", "compare", *OBJECT, "--image-opts", target,
             f"driver=raw,file.filename={WORK / 'src.raw'}"])


def main():
    if not DISKIT.exists():
        raise SystemExit("build first: cargo build --release")
    old = nbdbench.quiet_vm()
    try:
        prepare()
        times = {c: {"diskit": [], "qemu-img": []} for c in CELLS}
        for cell in CELLS:
            argv, out, prep, cmp_with = cell_argv(cell)
            for tool in ["diskit", "qemu-img"]:
                reset(prep, out)
                timed(tool, argv)
                verify(cell, tool, out, cmp_with, prep)
        for r in range(ROUNDS):
            for cell in CELLS:
                argv, out, prep, _ = cell_argv(cell)
                order = ["diskit", "qemu-img"] if (r + CELLS.index(cell)) % 2 == 0 else ["qemu-img", "diskit"]
                for tool in order:
                    reset(prep, out)
                    if out is not None or prep is not None:
                        os.sync()
                    times[cell][tool].append(timed(tool, argv))
            log(f"round {r + 1}/{ROUNDS} done")
    finally:
        nbdbench.quiet_vm_restore(old)
        # The files live in memory (tmpfs): give it back.
        if not os.environ.get("KEEP"):
            shutil.rmtree(WORK, ignore_errors=True)
    rows = []
    print(f"{'cell':<20}{'diskit s':>10}{'qemu-img s':>12}{'qemu-img/diskit':>17}")
    for cell in CELLS:
        d = statistics.median(times[cell]["diskit"])
        q = statistics.median(times[cell]["qemu-img"])
        rows.append({"cell": cell, "diskit_s": d, "qemu_img_s": q, "speedup": q / d,
                     "runs": times[cell]})
        print(f"{cell:<20}{d:>10.3f}{q:>12.3f}{q / d:>16.2f}x")
    stamp = time.strftime("%Y-%m-%d-%H%M%S")
    out = REPO / "bench" / "results" / f"qemu-img-tools-{stamp}.json"
    out.write_text(json.dumps({"size_mib": SIZE_MIB, "dd_mib": DD_MIB, "rounds": ROUNDS,
                               "bench_dir": str(WORK), "cells": rows}, indent=1))
    log(f"results in {out}")


if __name__ == "__main__":
    main()
