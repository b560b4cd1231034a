#!/usr/bin/python3
"""nbdkit's Python plugin API under both servers: nbdkit's own example
ramdisk.py (plugins/python/examples, vendored in crates/cli/tests/python)
served by `diskit serve python` and by `nbdkit python`, fio's nbd engine
doing 4 KiB random reads with 16 requests in flight (`--rw=randread
--bs=4k --iodepth=16`, RUNTIME seconds after a 1 s ramp), alternating
(benchlib.rotated), medians of IOPS. The script is run as it is, but for
its size: ramdisk.py's 1 MiB disk becomes SIZE_MIB (512 by default), in a
copy of the script, and the disk is written once (nbdcopy from random
bytes) before the timed run of each server. Each request is a call into
the script under the GIL, as the script's thread model (nbdkit's default,
serialize_all_requests) has it. Target (issue #31 §2): diskit at least
1.0x nbdkit.

    bench/python-plugin.py                    # 512 MiB, 6 rounds, 5 s runs
    SIZE_MIB=128 ROUNDS=2 RUNTIME=3 bench/python-plugin.py
    DISKIT_BIN=target/release/diskit bench/python-plugin.py

diskit loads the plugin's library, libdiskit_python.so, from beside its
binary (cargo build --release leaves both in target/release), or from
DISKIT_PLUGIN_DIR.
"""

import json
import os
import shutil
import statistics
import subprocess
import tempfile
from pathlib import Path

from benchlib import logger, nbdbench, rotated, save

log = logger("python-plugin.py")
SIZE_MIB = int(os.environ.get("SIZE_MIB", "512"))
ROUNDS = int(os.environ.get("ROUNDS", "6"))
RUNTIME = int(os.environ.get("RUNTIME", "5"))
TARGET = 1.0
SERVERS = ["diskit", "nbdkit"]
SCRIPT = nbdbench.REPO / "crates/cli/tests/python/ramdisk.py"
FIO = ["--rw=randread", "--bs=4k", "--iodepth=16"]


def sized_script(work):
    """ramdisk.py with a disk of SIZE_MIB instead of 1 MiB."""
    text = SCRIPT.read_text()
    line = "disk = bytearray(1024 * 1024)"
    if line not in text:
        raise SystemExit(f"{SCRIPT}: no line '{line}' to size")
    out = work / "ramdisk.py"
    out.write_text(text.replace(line, f"disk = bytearray({SIZE_MIB} * 1024 * 1024)"))
    return out


def argv(diskit, server, script, sock):
    if server == "diskit":
        return [str(diskit), "serve", "-f", "-U", str(sock), "python", str(script)]
    return ["nbdkit", "-f", "-U", str(sock), "python", str(script)]


def fio_iops(uri):
    out = subprocess.run(
        ["fio", "--name=bench", "--ioengine=nbd", f"--uri={uri}", "--time_based",
         f"--runtime={RUNTIME}", "--ramp_time=1", "--output-format=json", *FIO],
        check=True, capture_output=True, text=True).stdout
    return json.loads(out[out.index("{"):])["jobs"][0]["read"]["iops"]


def main():
    nbdbench.require(["fio", "nbdkit", "nbdcopy"])
    diskit = nbdbench.build()
    commit = f"binary {diskit}" if os.environ.get("DISKIT_BIN") else nbdbench.head_commit()
    work = Path(tempfile.mkdtemp(prefix="diskit-python-bench.", dir="/dev/shm"))
    runs = {s: [] for s in SERVERS}
    try:
        script = sized_script(work)
        data = work / "data.raw"
        with open(data, "wb") as f:
            for _ in range(SIZE_MIB):
                f.write(os.urandom(1 << 20))
        for r in range(ROUNDS):
            for server in rotated(SERVERS, r):
                sock = work / f"{server}.sock"
                srv = nbdbench.Server(argv(diskit, server, script, sock), sock)
                try:
                    subprocess.run(["nbdcopy", str(data), srv.uri], check=True)
                    iops = fio_iops(srv.uri)
                finally:
                    srv.stop()
                runs[server].append(iops)
                log(f"round {r + 1}/{ROUNDS} {server}: {iops:,.0f} IOPS")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    med = {s: statistics.median(v) for s, v in runs.items()}
    ratio = med["diskit"] / med["nbdkit"]
    verdict = "ok" if ratio >= TARGET else "MISSED"
    print(f"\nramdisk.py ({SIZE_MIB} MiB), fio randread 4k iodepth 16, median of {ROUNDS} "
          f"rounds ({RUNTIME} s runs), commit {commit}")
    print(f"{'diskit':>12}{'nbdkit':>12}{'ratio':>9}  verdict")
    print(f"{med['diskit']:>12,.0f}{med['nbdkit']:>12,.0f}{ratio:>8.2f}x  {verdict}")
    versions = {t: subprocess.run([t, "--version"], capture_output=True, text=True)
                .stdout.splitlines()[0] for t in ["nbdkit", "fio"]}
    save("python-plugin", {"commit": commit, "size_mib": SIZE_MIB, "rounds": ROUNDS,
                           "runtime_s": RUNTIME, "workload": "fio " + " ".join(FIO),
                           "versions": versions, "unit": "IOPS", "median": med,
                           "ratio": ratio, "target": TARGET, "verdict": verdict,
                           "runs": runs}, log)


if __name__ == "__main__":
    main()
