#!/usr/bin/env python3
"""Benchmark: `diskit checksum` against blkhash's `blksum` (built from
third_party/blkhash by scripts/blksum.sh), and what `diskit copy --blkhash`
costs over the same copy without it; in the same run, alternating, medians.

Rows:

raw-full      SIZE (default 2G) of random data, a raw file on /dev/shm:
              `diskit checksum -T N` and `blksum -t N` (same threads, N =
              THREADS, default the number of processors). Target: diskit at
              most 1.0x blksum's time.
qcow2-full    The same data as a qcow2 image on /dev/shm. Same target.
qcow2-sparse  A SPARSE_SIZE (default 1T) qcow2 with SPARSE_DATA (default
              64M) of data, 1 MiB pieces spread evenly. Target: diskit under
              0.1 s.
copy-file     `diskit copy SRC DST` of the raw file into a file on /dev/shm,
              with and without --blkhash. Target: at most 1.10x.
copy-nbd      The same from the raw file served by qemu-nbd -r (read on the
              connections' own threads) into the file. Same target.

Every digest is checked against blksum's in the first round (and
copy --blkhash's against the checksum's). The commands run in a rotating
order from round to round; the tables give medians over ROUNDS rounds
(default 5) and ratios (diskit's time over the other's: at most 1.0x, or
1.10x for the copies, meets the target). Free page reporting is held still
for the run as in bench/nbd.py. Output: the table on stdout and
bench/results/checksum-<date>.json. Targets are reported, not enforced.

    bench/checksum.py                                       # as the issue asks
    SIZE=64M SPARSE_SIZE=16G SPARSE_DATA=8M ROUNDS=2 bench/checksum.py  # a quick check
"""

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchlib import logger, rotated
from benchlib import nbdbench as nb

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
ROUNDS = int(os.environ.get("ROUNDS", "5"))
SIZE = os.environ.get("SIZE", "2G")
SPARSE_SIZE = os.environ.get("SPARSE_SIZE", "1T")
SPARSE_DATA = os.environ.get("SPARSE_DATA", "64M")
THREADS = int(os.environ.get("THREADS", str(os.cpu_count() or 1)))

log = logger("checksum.py")

SUFFIXES = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def size_of(text):
    """Bytes in a size such as 2G or 512M."""
    text = text.strip().upper()
    unit = text[-1] if text[-1] in SUFFIXES else ""
    return int(text[: len(text) - len(unit)]) * SUFFIXES[unit]


def blksum_build():
    out = subprocess.run([str(REPO / "scripts" / "blksum.sh")], check=True,
                         stdout=subprocess.PIPE, text=True).stdout
    return out.strip()


def run(argv):
    """Seconds the command took, and its standard output."""
    t0 = time.monotonic()
    p = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    secs = time.monotonic() - t0
    if p.returncode != 0:
        raise RuntimeError(f"{argv} failed: {p.stderr.decode(errors='replace')[-2000:]}")
    return secs, p.stdout.decode()


def digest(out):
    """The hex digest of a blksum line (HEX  NAME) or of --blkhash's line."""
    return out.split()[0]


def make_images(shm):
    raw = shm / "full.raw"
    qcow2 = shm / "full.qcow2"
    sparse = shm / "sparse.qcow2"
    log(f"making {SIZE} of random data, {raw}")
    with open(raw, "wb") as f:
        subprocess.run(["head", "-c", str(size_of(SIZE)), "/dev/urandom"], stdout=f, check=True)
    subprocess.run(["qemu-img", "convert", "-f", "raw", "-O", "qcow2", str(raw), str(qcow2)],
                   check=True)
    log(f"making a {SPARSE_SIZE} qcow2 with {SPARSE_DATA} of data, {sparse}")
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", str(sparse), SPARSE_SIZE],
                   check=True)
    pieces = max(1, size_of(SPARSE_DATA) >> 20)
    step = size_of(SPARSE_SIZE) // pieces // (1 << 20) * (1 << 20)
    cmds = []
    for i in range(pieces):
        cmds += ["-c", f"write -P {i % 255 + 1} {i * step} 1M"]
    # qemu-io takes many commands at once; a few hundred per run.
    for k in range(0, len(cmds), 512):
        subprocess.run(["qemu-io", "-f", "qcow2", *cmds[k:k + 512], str(sparse)], check=True,
                       stdout=subprocess.DEVNULL)
    return raw, qcow2, sparse


def measure(row, commands, check):
    """Runs each of `commands` ({name: argv}) ROUNDS times, rotating; `check`
    is given the outputs of the first round. Returns {name: median s}."""
    times = {name: [] for name in commands}
    names = list(commands)
    for r in range(ROUNDS):
        outs = {}
        for name in rotated(names, r):
            secs, out = run(commands[name])
            times[name].append(secs)
            outs[name] = out
        if r == 0:
            check(outs)
    med = {name: statistics.median(v) for name, v in times.items()}
    log(f"{row}: " + ", ".join(f"{n} {med[n]:.3f}s" for n in names))
    return {"median_s": med, "runs_s": times}


def same_digests(row):
    def check(outs):
        ds = {name: digest(out) for name, out in outs.items()}
        if len(set(ds.values())) != 1:
            raise RuntimeError(f"{row}: digests differ: {ds}")
    return check


def main():
    for tool in ["qemu-img", "qemu-io", "qemu-nbd"]:
        if not any((Path(d) / tool).exists() for d in os.environ["PATH"].split(":")):
            sys.exit(f"{tool} not found (apt-get install qemu-utils)")
    diskit = str(nb.build())
    blksum = blksum_build()
    old = nb.quiet_vm()
    shm = Path(tempfile.mkdtemp(prefix="diskit-bench-checksum-", dir="/dev/shm"))
    results = {"rounds": ROUNDS, "size": SIZE, "sparse_size": SPARSE_SIZE,
               "sparse_data": SPARSE_DATA, "threads": THREADS,
               "date": time.strftime("%Y-%m-%d %H:%M:%S"), "rows": {}}
    rows = results["rows"]
    server = None
    try:
        raw, qcow2, sparse = make_images(shm)
        t = str(THREADS)
        want = digest(run([blksum, str(raw)])[1])
        for row, img in [("raw-full", raw), ("qcow2-full", qcow2), ("qcow2-sparse", sparse)]:
            rows[row] = measure(row, {
                "diskit": [diskit, "checksum", "-T", t, str(img)],
                "blksum": [blksum, "-t", t, str(img)],
            }, same_digests(row))
        out = shm / "out.raw"

        def copy_check(outs):
            got = digest(outs["diskit --blkhash"])
            if got != want:
                raise RuntimeError(f"copy --blkhash gave {got}, blksum {want}")

        rows["copy-file"] = measure("copy-file", {
            "diskit --blkhash": [diskit, "copy", "--blkhash", str(raw), str(out)],
            "diskit": [diskit, "copy", str(raw), str(out)],
        }, copy_check)
        sock = shm / "src.sock"
        server = nb.Server(["qemu-nbd", "-r", "-t", "-f", "raw", "-k", str(sock), "-e", "8",
                            "--cache=writeback", "--aio=threads", str(raw)], sock)
        rows["copy-nbd"] = measure("copy-nbd", {
            "diskit --blkhash": [diskit, "copy", "--blkhash", server.uri, str(out)],
            "diskit": [diskit, "copy", server.uri, str(out)],
        }, copy_check)
    finally:
        if server:
            server.stop()
        for p in shm.iterdir():
            p.unlink()
        shm.rmdir()
        nb.quiet_vm_restore(old)

    print(f"\ndiskit checksum vs blksum ({THREADS} threads each), diskit copy with and without"
          f" --blkhash: median seconds over {ROUNDS} rounds")
    print(f"{'row':14} {'diskit':>10} {'other':>10} {'ratio':>7}  target")
    verdicts = {}
    for row, r in rows.items():
        med = r["median_s"]
        if row.startswith("copy"):
            ours, other, limit = med["diskit --blkhash"], med["diskit"], 1.10
        else:
            ours, other, limit = med["diskit"], med["blksum"], 1.0
        ratio = ours / other if other > 0 else float("inf")
        ok = ratio <= limit
        if row == "qcow2-sparse":
            ok = ours < 0.1
            target = f"diskit < 0.1 s: {'met' if ok else 'MISSED'}"
        else:
            target = f"<= {limit:.2f}x: {'met' if ok else 'MISSED'}"
        verdicts[row] = ok
        print(f"{row:14} {ours:10.3f} {other:10.3f} {ratio:6.2f}x  {target}")
    results["targets"] = verdicts
    print(f"results written to {nb.write_results('checksum', results)}")


if __name__ == "__main__":
    main()
