#!/usr/bin/env python3
"""Reading an xz-compressed image through the xz filter: `nbdcopy URI
null:` from `diskit serve --filter=xz file IMG.xz` and from `nbdkit
--filter=xz file IMG.xz`, alternating (benchlib.rotated), medians.

The image (SIZE_MIB, 1024 by default) is a filesystem-like mix laid out
MiB by MiB: zeros (free space), random bytes (compressed or encrypted
files), text (logs, sources) and tables of counters (binary metadata),
compressed once with `xz -T0 --block-size=16MiB` (the default preset,
many blocks) into /dev/shm. Each server is started fresh for each run,
so nothing decompressed in one run helps the next; each serves the file
once more before the timed rounds, its bytes checked against the image's
digest. Two rows: nbdcopy as it comes (one connection per processor, at
most 4: nbdkit decompresses on each connection's thread, diskit on every
processor for all of them) and `nbdcopy --connections=1` (one sequential
reader, as qemu-img convert reads an export for CDI: nbdkit decompresses
on one thread, diskit ahead of it on the others). Target (issue #31):
diskit at least 1.5x nbdkit. A floor row, in the same rounds: `xz -dc
-T0` of the file to /dev/null, XZ Utils' own threaded decompression on
every processor (liblzma, which both servers use): no server of the file
through liblzma can be faster than that on this machine.

    bench/xz.py                      # 1 GiB, 5 rounds
    SIZE_MIB=256 ROUNDS=3 bench/xz.py
    DISKIT_BIN=target/release/diskit bench/xz.py
"""

import hashlib
import os
import random
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from benchlib import logger, nbdbench, rotated, save

log = logger("xz.py")
SIZE_MIB = int(os.environ.get("SIZE_MIB", "1024"))
ROUNDS = int(os.environ.get("ROUNDS", "5"))
TARGET = 1.5
SERVERS = ["diskit", "nbdkit"]
# Row name: nbdcopy's options.
ROWS = {"nbdcopy": [], "nbdcopy -C 1": ["--connections=1"]}

WORDS = ("the of and to in is for on that by with from at as this be are was it an or "
         "error warning info debug kernel device block disk read write sector inode "
         "file system user root mount volume size offset request reply server client "
         "connection timeout retry cache page memory buffer queue thread process").split()


def text_pool(rng, size):
    """`size` bytes of log-like lines of words and numbers."""
    out = bytearray()
    n = 0
    while len(out) < size:
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 14)))
        out += f"{n:08d} {rng.randint(0, 99999):05d} {words}\n".encode()
        n += 1
    return bytes(out[:size])


def table(k):
    """1 MiB of little-endian records with counters (metadata tables)."""
    return b"".join((k * 65536 + i).to_bytes(8, "little") + (i % 7).to_bytes(4, "little")
                    + b"\x00\x00\x00\x01" for i in range(65536))


def make_image(path):
    """Writes the image; returns its SHA-256."""
    rng = random.Random(31)
    mib = 1 << 20
    pool = text_pool(rng, 16 * mib)
    digest = hashlib.sha256()
    text_at = 0
    with open(path, "wb") as f:
        for k in range(SIZE_MIB):
            kind = (k * 7 + k // 16) % 20
            if kind < 7:
                chunk = bytes(mib)
            elif kind < 12:
                chunk = os.urandom(mib)
            elif kind < 18:
                chunk = pool[text_at:text_at + mib]
                text_at = (text_at + mib) % len(pool)
            else:
                chunk = table(k)
            f.write(chunk)
            digest.update(chunk)
    return digest.hexdigest()


def argv(diskit, server, xz, sock):
    if server == "diskit":
        return [str(diskit), "serve", "-f", "-U", str(sock), "--filter=xz", "file", str(xz)]
    return ["nbdkit", "-f", "-U", str(sock), "--filter=xz", "file", str(xz)]


def copy(diskit, server, xz, work, dest="null:", opts=()):
    """Runs nbdcopy from a fresh server into `dest`; the seconds it took."""
    sock = work / f"{server}.sock"
    srv = nbdbench.Server(argv(diskit, server, xz, sock), sock)
    try:
        start = time.monotonic()
        subprocess.run(["nbdcopy", *opts, srv.uri, dest], check=True)
        return time.monotonic() - start
    finally:
        srv.stop()


def main():
    nbdbench.require(["nbdkit", "nbdcopy", "xz"])
    diskit = nbdbench.build()
    commit = f"binary {diskit}" if os.environ.get("DISKIT_BIN") else nbdbench.head_commit()
    work = Path(tempfile.mkdtemp(prefix="diskit-xz-bench.", dir="/dev/shm"))
    runs = {row: {s: [] for s in SERVERS} for row in ROWS}
    floor = []
    try:
        raw = work / "disk.img"
        log(f"writing a {SIZE_MIB} MiB image")
        digest = make_image(raw)
        log("compressing: xz -T0 --block-size=16MiB")
        start = time.monotonic()
        subprocess.run(["xz", "-T0", "--block-size=16MiB", str(raw)], check=True)
        xz_seconds = time.monotonic() - start
        xz = work / "disk.img.xz"
        listing = subprocess.run(["xz", "--robot", "--list", str(xz)], capture_output=True,
                                 text=True, check=True).stdout
        totals = next(line.split("\t") for line in listing.splitlines()
                      if line.startswith("totals"))
        blocks, compressed = int(totals[2]), int(totals[3])
        log(f"{compressed / (1 << 20):.0f} MiB in {blocks} blocks ({xz_seconds:.0f} s)")
        for server in SERVERS:
            out = work / "check.img"
            copy(diskit, server, xz, work, str(out))
            with open(out, "rb") as f:
                got = hashlib.file_digest(f, "sha256").hexdigest()
            out.unlink()
            if got != digest:
                raise SystemExit(f"{server} served other bytes than the image's")
        for r in range(ROUNDS * len(SERVERS)):
            server = rotated(SERVERS, r)[0]
            for row, opts in ROWS.items():
                secs = copy(diskit, server, xz, work, opts=opts)
                runs[row][server].append(secs)
                log(f"run {r + 1}/{ROUNDS * len(SERVERS)} {row} {server}: {secs:.2f} s "
                    f"({SIZE_MIB / secs:,.0f} MiB/s)")
            if r % len(SERVERS) == 0:
                start = time.monotonic()
                subprocess.run(["xz", "-dc", "-T0", str(xz)], check=True,
                               stdout=subprocess.DEVNULL)
                floor.append(time.monotonic() - start)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    print(f"\nnbdcopy from the xz filter, {SIZE_MIB} MiB image ({blocks} blocks of 16 MiB, "
          f"{compressed / (1 << 20):.0f} MiB compressed), median of {ROUNDS}, "
          f"{os.cpu_count()} processors, commit {commit}")
    print(f"{'row':<14}{'diskit s':>10}{'nbdkit s':>10}{'diskit MiB/s':>14}{'nbdkit MiB/s':>14}"
          f"{'speedup':>9}")
    rows = {}
    for row, by in runs.items():
        med = {s: statistics.median(v) for s, v in by.items()}
        speedup = med["nbdkit"] / med["diskit"]
        rows[row] = {"median_s": med, "speedup": speedup, "runs_s": by}
        print(f"{row:<14}{med['diskit']:>10.2f}{med['nbdkit']:>10.2f}"
              f"{SIZE_MIB / med['diskit']:>14,.0f}{SIZE_MIB / med['nbdkit']:>14,.0f}"
              f"{speedup:>8.2f}x")
    floor_s = statistics.median(floor)
    print(f"{'xz -dc -T0':<14}{floor_s:>10.2f}{'':>10}{SIZE_MIB / floor_s:>14,.0f}{'':>14}"
          f"{rows['nbdcopy']['median_s']['nbdkit'] / floor_s:>8.2f}x  (the floor: nbdkit's "
          "time / liblzma's own)")
    speedup = rows["nbdcopy"]["speedup"]
    verdict = "met" if speedup >= TARGET else "MISSED"
    print(f"target {TARGET}x nbdkit with nbdcopy's defaults: {verdict}")
    versions = {t: subprocess.run([t, "--version"], capture_output=True, text=True)
                .stdout.splitlines()[0] for t in ["nbdkit", "nbdcopy", "xz"]}
    save("xz", {"commit": commit, "size_mib": SIZE_MIB, "rounds": ROUNDS,
                "cores": os.cpu_count(), "xz_blocks": blocks, "compressed_bytes": compressed,
                "xz_seconds": xz_seconds, "versions": versions, "target": TARGET,
                "rows": rows, "floor_xz_dc_s": {"median": floor_s, "runs": floor}}, log)


if __name__ == "__main__":
    main()
