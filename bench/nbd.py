#!/usr/bin/env python3
"""Benchmark: `diskit serve` against nbdkit and qemu-nbd, in the same run.

Every row serves the same data from every server in turn, on a Unix
socket, and runs the same client workload against it:

  file/*    a raw file on /dev/shm (SIZE_MIB of random bytes):
            `diskit serve file`, `nbdkit file`, `qemu-nbd -f raw`
  memory/*  a sparse RAM disk of SIZE_MIB: `diskit serve memory`,
            `nbdkit memory`
  qcow2/*   a qcow2 image on /dev/shm: `diskit serve image`, `qemu-nbd -f
            qcow2` (reads: an image holding the random data; writes: a
            fresh copy of an empty image every run, so clusters are
            allocated as the run goes)

Workloads (fio's nbd engine, one job, RUNTIME seconds after a 1 s ramp):
  seqread    --rw=read --bs=1M --iodepth=16          (MiB/s)
  randread   --rw=randread --bs=4k --iodepth=32      (IOPS)
  randwrite  --rw=randwrite --bs=4k --iodepth=32     (IOPS)
  nbdcopy    `nbdcopy URI null:` (the whole export; MiB/s of export size)

In the file and qcow2 rows diskit also serves under qemu-nbd's own
command line (`diskit qemu-nbd ...`, "as q-nbd"; issue #30's target: at
least 2x qemu-nbd in every such row; QEMU_NBD_NAME=0 leaves it out).

Each round runs every server once per row, the order of the servers
rotating from round to round; the table gives medians over ROUNDS rounds
and the ratio diskit/peer (above 1: diskit is faster). Targets from the
issue: at least 1.0x nbdkit in every row (goal 1.3x), at least 1.5x
qemu-nbd on qcow2 random 4 KiB writes. They are reported, not enforced.

Free page reporting: on VMs whose guest hands free memory back to the host
(/sys/module/page_reporting), memory touched again after a pause costs
3-7x more, which made whichever server ran after a pause look slow. For
the length of the run freed memory waits 60 s before it is reported
(min_free_ms), however much is waiting (max_waiting_mib), and only 4 MiB
free blocks are reported (page_reporting_order), for each knob that is
writable; the old values are put back on exit. QUIET_VM=0 leaves
them alone.

Environment: SIZE_MIB (default 1024), ROUNDS (6: every server goes first
equally often), RUNTIME (5), ROWS (glob patterns, comma separated, default
'*', e.g. 'file/*,qcow2/randwrite').
Output: the table on stdout and bench/results/nbd-<date>.json.
"""

import fnmatch
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
SIZE_MIB = int(os.environ.get("SIZE_MIB", "1024"))
ROUNDS = int(os.environ.get("ROUNDS", "6"))
RUNTIME = int(os.environ.get("RUNTIME", "5"))
ROW_PATTERNS = [p for p in os.environ.get("ROWS", "*").replace(" ", ",").split(",") if p]

WORKLOADS = {
    "seqread": ["--rw=read", "--bs=1M", "--iodepth=16"],
    "randread": ["--rw=randread", "--bs=4k", "--iodepth=32"],
    "randwrite": ["--rw=randwrite", "--bs=4k", "--iodepth=32"],
}

# row -> (servers, workloads)
ROWS = {
    "file": (["diskit", "nbdkit", "qemu-nbd", "diskit-qemu-nbd"],
             ["seqread", "randread", "randwrite", "nbdcopy"]),
    "memory": (["diskit", "nbdkit"], ["seqread", "randread", "randwrite", "nbdcopy"]),
    "qcow2": (["diskit", "qemu-nbd", "diskit-qemu-nbd"],
              ["seqread", "randread", "randwrite", "nbdcopy"]),
}
# QEMU_NBD_NAME=0 leaves out "diskit-qemu-nbd" (diskit under qemu-nbd's
# command line, the same as qemu-nbd's).
if os.environ.get("QEMU_NBD_NAME", "1") == "0":
    ROWS = {row: ([s for s in servers if s != "diskit-qemu-nbd"], wls)
            for row, (servers, wls) in ROWS.items()}
# DISKIT_BASELINE: another diskit binary (an older commit's), served as a
# further server "baseline" with diskit's command lines: before/after in
# one run.
BASELINE = os.environ.get("DISKIT_BASELINE")
if BASELINE:
    ROWS = {row: (servers + ["baseline"], wls) for row, (servers, wls) in ROWS.items()}


def log(msg):
    print(f"[nbd.py] {msg}", file=sys.stderr, flush=True)


def selected(name):
    return any(fnmatch.fnmatch(name, p) for p in ROW_PATTERNS)


def require(tools):
    """Exits, saying which, when one of `tools` is not on PATH."""
    for tool in tools:
        if not shutil.which(tool):
            sys.exit(f"{tool} not found (scripts/test installs it)")


def head_commit():
    """The short hash of this tree's HEAD ("unknown" outside git)."""
    return subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True).stdout.strip() or "unknown"


def print_heading(title, rounds, commit, columns):
    """A table's heading on stdout: `title`, the rounds, fio's run time
    and the commit, then the column names."""
    print(f"\n{title}, median of {rounds} rounds ({RUNTIME} s fio runs), commit {commit}")
    print(columns)


def build():
    """The diskit binary to measure: DISKIT_BIN as it is (another commit's,
    for before/after runs), else this tree's release build."""
    if os.environ.get("DISKIT_BIN"):
        return Path(os.environ["DISKIT_BIN"])
    log("building diskit (release)")
    # With the python plugin's library, which diskit loads from beside its
    # binary (bench/python-plugin.py serves nbdkit's scripts).
    subprocess.run(["cargo", "build", "--release", "-p", "diskit", "-p", "diskit-python"],
                   cwd=REPO, check=True)
    target = Path(os.environ.get("CARGO_TARGET_DIR", REPO / "target"))
    return target / "release" / "diskit"


class Server:
    """One server process on a private Unix socket, stopped on exit."""

    def __init__(self, argv, sock):
        self.sock = sock
        if sock.exists():
            sock.unlink()
        self.proc = subprocess.Popen(
            argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
        )
        deadline = time.monotonic() + 30
        while not sock.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                self.stop()
                raise RuntimeError(f"server {argv} did not start: {err}")
            time.sleep(0.01)
        self.uri = f"nbd+unix:///?socket={sock}"

    def stop(self, grace=10):
        """SIGTERM, then SIGKILL if it is still there after `grace` seconds."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def server_argv(diskit, server, row, path, sock):
    size = f"{SIZE_MIB}M"
    if server in ("diskit", "baseline"):
        if server == "baseline":
            diskit = BASELINE
        plugin = {"file": ["file", str(path)], "memory": ["memory", size],
                  "qcow2": ["image", str(path)]}[row]
        return [str(diskit), "serve", "-f", "-U", str(sock), *plugin]
    if server == "nbdkit":
        plugin = {"file": ["file", str(path)], "memory": ["memory", size]}[row]
        return ["nbdkit", "-f", "-U", str(sock), *plugin]
    fmt = "qcow2" if row == "qcow2" else "raw"
    # -t: keep serving after a client leaves (fio connects twice); -e: as
    # many connections as nbdcopy opens; writeback caching as the
    # other servers (neither opens with O_DIRECT). diskit-qemu-nbd: the
    # same command line run by diskit.
    exe = [str(diskit), "qemu-nbd"] if server == "diskit-qemu-nbd" else ["qemu-nbd"]
    return [*exe, "-t", "-f", fmt, "-k", str(sock), "-e", "8", "--cache=writeback",
            "--aio=threads", str(path)]


REPORTING_DIR = Path("/sys/module/page_reporting/parameters")


def quiet_vm():
    """Delays free page reporting for the run: freed memory waits 60 s
    (min_free_ms), however much of it is waiting (max_waiting_mib, which
    otherwise reports at once past 1 GiB), and only free blocks of 4 MiB
    are reported (page_reporting_order 10). Returns {knob: old value} for
    the knobs changed, to put back with quiet_vm_restore."""
    old = {}
    if os.environ.get("QUIET_VM", "1") == "0":
        return old
    mem_mib = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") >> 20
    knobs = [("min_free_ms", 60000), ("max_waiting_mib", mem_mib), ("page_reporting_order", 10)]
    for name, value in knobs:
        knob = REPORTING_DIR / name
        if not os.access(knob, os.W_OK):
            continue
        try:
            was = knob.read_text().strip()
            knob.write_text(str(value))
        except OSError:
            continue
        old[knob] = was
        log(f"free page reporting: {name} {value} for the run (was {was})")
    return old


def quiet_vm_restore(old):
    for knob, value in old.items():
        try:
            knob.write_text(value)
        except OSError:
            pass


def run_fio(uri, workload):
    argv = ["fio", "--name=bench", "--ioengine=nbd", f"--uri={uri}", "--time_based",
            f"--runtime={RUNTIME}", "--ramp_time=1", "--output-format=json", *WORKLOADS[workload]]
    out = subprocess.run(argv, check=True, capture_output=True, text=True).stdout
    job = json.loads(out[out.index("{"):])["jobs"][0]
    side = job["write" if workload == "randwrite" else "read"]
    if workload == "seqread":
        return side["bw_bytes"] / (1 << 20)
    return side["iops"]


def run_nbdcopy(uri):
    start = time.monotonic()
    subprocess.run(["nbdcopy", uri, "null:"], check=True)
    return SIZE_MIB / (time.monotonic() - start)


def write_results(name, data):
    """Writes `data` as JSON to bench/results/NAME-<date>.json; returns
    the file's path."""
    (HERE / "results").mkdir(exist_ok=True)
    out = HERE / "results" / f"{name}-{time.strftime('%Y-%m-%d-%H%M%S')}.json"
    out.write_text(json.dumps(data, indent=2))
    return out


def main():
    require(["fio", "nbdkit", "qemu-nbd", "qemu-img", "nbdcopy"])
    diskit = build()
    commit = f"binary {diskit}" if os.environ.get("DISKIT_BIN") else head_commit()
    work = Path(tempfile.mkdtemp(prefix="diskit-nbd-bench.", dir="/dev/shm"))
    results = {}
    reporting_old = quiet_vm()
    try:
        raw = work / "data.raw"
        log(f"writing {SIZE_MIB} MiB of random data")
        with open(raw, "wb") as f:
            for _ in range(SIZE_MIB):
                f.write(os.urandom(1 << 20))
        full_qcow2 = work / "full.qcow2"
        empty_qcow2 = work / "empty.qcow2"
        subprocess.run(["qemu-img", "convert", "-f", "raw", "-O", "qcow2", str(raw),
                        str(full_qcow2)], check=True)
        subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", str(empty_qcow2),
                        f"{SIZE_MIB}M"], check=True)
        cases = [(row, wl) for row, (_, wls) in ROWS.items() for wl in wls
                 if selected(f"{row}/{wl}")]
        if not cases:
            sys.exit(f"ROWS={os.environ.get('ROWS')} selects nothing")
        for r in range(ROUNDS):
            for row, wl in cases:
                servers = ROWS[row][0]
                order = servers[r % len(servers):] + servers[:r % len(servers)]
                for server in order:
                    path = raw
                    if row == "qcow2":
                        path = work / "run.qcow2"
                        src = empty_qcow2 if wl == "randwrite" else full_qcow2
                        shutil.copyfile(src, path)
                    sock = work / f"{server}.sock"
                    srv = Server(server_argv(diskit, server, row, path, sock), sock)
                    try:
                        if row == "memory" and wl != "randwrite":
                            # Reads of a RAM disk that holds data.
                            subprocess.run(["nbdcopy", str(raw), srv.uri], check=True)
                        value = run_nbdcopy(srv.uri) if wl == "nbdcopy" else run_fio(srv.uri, wl)
                    finally:
                        srv.stop()
                    results.setdefault(f"{row}/{wl}", {}).setdefault(server, []).append(value)
                    log(f"round {r + 1}/{ROUNDS} {row}/{wl} {server}: {value:,.1f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
        quiet_vm_restore(reporting_old)

    unit = {"seqread": "MiB/s", "randread": "IOPS", "randwrite": "IOPS", "nbdcopy": "MiB/s"}
    print_heading(f"NBD servers, {SIZE_MIB} MiB on /dev/shm", ROUNDS, commit,
                  f"{'row':<18}{'unit':>7}{'diskit':>12}{'nbdkit':>12}{'qemu-nbd':>12}"
                  f"{'as q-nbd':>12}{'vs nbdkit':>11}{'vs qemu-nbd':>13}{'as/qemu-nbd':>13}"
                  "  verdict")
    summary = {}
    all_met = True
    for name, by in results.items():
        med = {s: statistics.median(v) for s, v in by.items()}
        row, wl = name.split("/")
        ratios = {p: med["diskit"] / med[p] for p in med
                  if p not in ("diskit", "baseline", "diskit-qemu-nbd") and med[p] > 0}
        if "diskit-qemu-nbd" in med and med.get("qemu-nbd", 0) > 0:
            # Issue #30: diskit as qemu-nbd at least 2x qemu-nbd in every row.
            ratios["as-qemu-nbd"] = med["diskit-qemu-nbd"] / med["qemu-nbd"]
        verdicts = []
        if "nbdkit" in ratios:
            verdicts.append("goal" if ratios["nbdkit"] >= 1.3 else
                            "ok" if ratios["nbdkit"] >= 1.0 else "MISSED")
        if name == "qcow2/randwrite":
            verdicts.append("ok" if ratios["qemu-nbd"] >= 1.5 else "MISSED")
        if "as-qemu-nbd" in ratios:
            verdicts.append("2x" if ratios["as-qemu-nbd"] >= 2.0 else "MISSED-2x")
        all_met &= "MISSED" not in verdicts
        cells = "".join(f"{med[s]:>12,.0f}" if s in med else f"{'-':>12}"
                        for s in ["diskit", "nbdkit", "qemu-nbd", "diskit-qemu-nbd"])
        rcells = "".join(f"{ratios[p]:>{w}.2f}x" if p in ratios else f"{'-':>{w + 1}}"
                         for p, w in [("nbdkit", 10), ("qemu-nbd", 12), ("as-qemu-nbd", 12)])
        print(f"{name:<18}{unit[wl]:>7}{cells}{rcells}  {' '.join(verdicts) or '-'}")
        summary[name] = {"unit": unit[wl], "median": med, "ratio": ratios, "runs": by}
    print(f"\ntargets met in every row: {'yes' if all_met else 'no'}")
    if BASELINE:
        print("\nbefore/after: diskit's median over the baseline binary's "
              "(throughput: below 0.95, 5% slower)")
        for name, by in summary.items():
            med = by["median"]
            by["vs_baseline"] = med["diskit"] / med["baseline"]
            print(f"{name:<18}{med['baseline']:>12,.0f} -> {med['diskit']:>10,.0f}"
                  f"{by['vs_baseline']:>8.3f}")
    versions = {t: subprocess.run([t, "--version"], capture_output=True, text=True)
                .stdout.splitlines()[0] for t in ["nbdkit", "qemu-nbd", "fio", "nbdcopy"]}
    out = write_results("nbd", {"commit": commit, "size_mib": SIZE_MIB, "rounds": ROUNDS,
                                "runtime_s": RUNTIME, "versions": versions, "rows": summary})
    log(f"wrote {out}")


if __name__ == "__main__":
    main()
