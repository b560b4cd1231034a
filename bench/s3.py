#!/usr/bin/env python3
"""Benchmark: diskit with S3 objects against the AWS CLI, boto3's transfer
manager and nbdkit's S3 plugin, on one radosgw (scripts/ceph-cluster.sh
start DIR BYTES rgw: a one-node Ceph cluster with its S3 gateway on
loopback, started for the run and stopped after), in the same run,
alternating, medians (issue #29).

Parts (PARTS=download,upload,sparse,serve; default all):

download  An object of SIZE_MIB (default 1024) random bytes (put there by
          `aws s3 cp`, not timed), to a raw file on /dev/shm and to null:
            diskit copy s3://B/K DST|null:
            diskit convert -f raw -O raw s3://B/K DST|null-co://  (-n for null)
            aws s3 cp s3://B/K DST|-  (to null: its stdout into /dev/null)
            boto3 download_file / download_fileobj (into a writer that
              drops the bytes), their default concurrency
          Target: diskit at most 0.67x of aws and of boto3, every cell.

upload    The same bytes as a raw file on /dev/shm into a new object:
            diskit convert -f raw -O raw SRC s3://B/K, diskit copy SRC s3://B/K
            aws s3 cp SRC s3://B/K
          The object is deleted after each run (not timed).
          Target: diskit at most 0.8x of aws s3 cp.

sparse    A sparse raw image of SPARSE_MIB (default 4096) with 64 KiB of
          random data every 32 MiB into a new object:
            diskit convert -f raw -O qcow2 SRC s3://B/K
            diskit convert -f raw -O vmdk -o subformat=streamOptimized SRC s3://B/K
            aws s3 cp SRC s3://B/K  (its raw form, every byte)
          Both are written once, front to back (qcow2's tables placed after
          the data); a diskit cell that fails is reported as failed, with
          its message.
          Target: at most 0.05x of aws s3 cp.

serve     The download part's object served read-only, copied to null by
          nbdcopy:
            diskit serve -r s3 bucket=B key=K endpoint-url=E
            nbdkit -r S3 bucket=B key=K endpoint-url=E (Python, boto3)
          Target: diskit at least 3x faster.

Tools run in a rotating order from round to round; medians over ROUNDS
rounds (default 3). Ratios are diskit's time / the peer's (below 1:
diskit is faster). Free page reporting is held still as in bench/nbd.py.
Output: tables on stdout and bench/results/s3-<date>-<time>.json.

Needs radosgw, ceph-mon, ceph-osd, awscli, python3-boto3, nbdcopy and
nbdkit-plugin-python (scripts/test installs them).
"""

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchlib import chosen, logger, nbdbench as nb, rotated, save

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
SIZE_MIB = int(os.environ.get("SIZE_MIB", "1024"))
SPARSE_MIB = int(os.environ.get("SPARSE_MIB", "4096"))
ROUNDS = int(os.environ.get("ROUNDS", "3"))
PARTS = chosen("PARTS", ["download", "upload", "sparse", "serve"])
BUCKET = "bench"
# The system's Python: boto3 and libnbd's tools are Debian's.
PYTHON = "/usr/bin/python3"

log = logger("s3.py")


class Failed(Exception):
    """A run that failed: its last line of stderr."""


def timed(argv, **kw):
    """Seconds `argv` took; Failed with its message if it failed."""
    start = time.monotonic()
    p = subprocess.run([str(a) for a in argv], stderr=subprocess.PIPE, text=True, **kw)
    took = time.monotonic() - start
    if p.returncode != 0:
        lines = p.stderr.strip().splitlines()
        raise Failed(lines[-1] if lines else f"exit status {p.returncode}")
    return took


class Store:
    """The cluster with radosgw, and the environment that reaches it."""

    def __init__(self, work):
        self.dir = work / "ceph"
        # Room for the objects of a run: memstore keeps them in memory.
        room = (3 * SIZE_MIB + SPARSE_MIB + 2048) << 20
        subprocess.run([REPO / "scripts" / "ceph-cluster.sh", "start", self.dir, str(room), "rgw"],
                       check=True, capture_output=True)
        # Every tool of the run (the servers too) reaches the store by
        # the environment.
        self.env = os.environ
        for line in (self.dir / "s3.env").read_text().splitlines():
            k, _, v = line.partition("=")
            self.env[k] = v
        # The user's own ~/.aws is no part of the run.
        for var in ["AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE"]:
            self.env[var] = str(work / "no-such-aws-file")
        for var in ["AWS_PROFILE", "AWS_SESSION_TOKEN"]:
            self.env.pop(var, None)
        self.endpoint = self.env["AWS_ENDPOINT_URL"]
        self.python(f"s3.create_bucket(Bucket='{BUCKET}')")

    def url(self, key):
        return f"s3://{BUCKET}/{key}"

    def aws(self, *args):
        return ["aws", "--endpoint-url", self.endpoint, *args]

    def python(self, code, timed_run=False):
        """Runs `code` with boto3's client as `s3`; timed if asked."""
        program = ("import boto3, os\n"
                   f"s3 = boto3.client('s3', endpoint_url='{self.endpoint}')\n{code}\n")
        argv = [PYTHON, "-c", program]
        if timed_run:
            return timed(argv, env=self.env)
        subprocess.run(argv, env=self.env, check=True)
        return None

    def run(self, argv, **kw):
        return timed(argv, env=self.env, **kw)

    def delete(self, key):
        subprocess.run(self.aws("s3", "rm", self.url(key)), env=self.env,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        # radosgw frees a deleted object's data later (its garbage
        # collector): at once here, or the memory store fills up within a
        # run, and a full cluster blocks every write.
        subprocess.run(["radosgw-admin", "-c", str(self.dir / "ceph.conf"), "gc", "process",
                        "--include-all"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def stop(self):
        subprocess.run([REPO / "scripts" / "ceph-cluster.sh", "stop", self.dir])


def make_sources(work):
    full = work / "full.raw"
    with open("/dev/urandom", "rb") as r, open(full, "wb") as w:
        for _ in range(SIZE_MIB):
            w.write(r.read(1 << 20))
    sparse = work / "sparse.raw"
    size = SPARSE_MIB << 20
    with open("/dev/urandom", "rb") as r, open(sparse, "wb") as w:
        w.truncate(size)
        for off in range(0, size, 32 << 20):
            w.seek(off)
            w.write(r.read(64 << 10))
    return full, sparse


def measure(tools, before=None):
    """Runs every tool ROUNDS times, rotating; {tool: median seconds or
    'failed: MESSAGE'}. `before` runs (untimed) before each run."""
    times = {t: [] for t in tools}
    failed = {}
    for r in range(ROUNDS):
        for t in rotated(list(tools), r):
            if t in failed:
                continue
            if before:
                before()
            try:
                times[t].append(tools[t]())
            except Failed as e:
                failed[t] = f"failed: {e}"
                log(f"{t}: {failed[t]}")
    if before:
        before()
    return {t: failed.get(t) or statistics.median(ts) for t, ts in times.items()}


def ratio(ours, peer):
    if isinstance(ours, float) and isinstance(peer, float) and peer > 0:
        return ours / peer
    return None


def cell(v):
    return f"{v:.2f}" if isinstance(v, float) else str(v)


def rcell(v):
    return f"{v:.3f}" if v is not None else "-"


def table(title, head, rows):
    print(f"\n## {title}")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for row in rows:
        print("| " + " | ".join(row) + " |")


def part_download(diskit, st, work, full, results):
    st.delete("rand")
    subprocess.run(st.aws("s3", "cp", "--quiet", full, st.url("rand")), env=st.env, check=True)
    dst = work / "out.raw"
    rows = []
    for where in ["file", "null"]:
        if where == "file":
            tools = {
                "diskit copy": lambda: st.run([diskit, "copy", st.url("rand"), dst]),
                "diskit convert": lambda: st.run(
                    [diskit, "convert", "-f", "raw", "-O", "raw", st.url("rand"), dst]),
                "aws s3 cp": lambda: st.run(st.aws("s3", "cp", "--quiet", st.url("rand"), dst)),
                "boto3": lambda: st.python(
                    f"s3.download_file('{BUCKET}', 'rand', '{dst}')", timed_run=True),
            }
        else:
            tools = {
                "diskit copy": lambda: st.run([diskit, "copy", st.url("rand"), "null:"]),
                "diskit convert": lambda: st.run(
                    [diskit, "convert", "-n", "-f", "raw", "-O", "raw", st.url("rand"),
                     "null-co://"]),
                "aws s3 cp": lambda: st.run(st.aws("s3", "cp", "--quiet", st.url("rand"), "-"),
                                            stdout=subprocess.DEVNULL),
                "boto3": lambda: st.python(
                    "class Null:\n    def write(self, b): return len(b)\n"
                    f"s3.download_fileobj('{BUCKET}', 'rand', Null())", timed_run=True),
            }
        m = measure(tools, before=lambda: dst.unlink(missing_ok=True))
        row = {"cell": f"to {where}", **m}
        for ours in ["diskit copy", "diskit convert"]:
            for peer in ["aws s3 cp", "boto3"]:
                row[f"{ours} / {peer}"] = ratio(m[ours], m[peer])
        log(f"download {row}")
        rows.append(row)
    results["download"] = rows
    table(f"download {SIZE_MIB} MiB of random data, medians of {ROUNDS} (s); ratio = diskit / peer "
          "(target at most 0.67)",
          ["to", "diskit copy", "diskit convert", "aws s3 cp", "boto3", "copy/aws", "copy/boto3",
           "convert/aws", "convert/boto3"],
          [[r["cell"], cell(r["diskit copy"]), cell(r["diskit convert"]), cell(r["aws s3 cp"]),
            cell(r["boto3"]), rcell(r["diskit copy / aws s3 cp"]),
            rcell(r["diskit copy / boto3"]), rcell(r["diskit convert / aws s3 cp"]),
            rcell(r["diskit convert / boto3"])] for r in rows])


def part_upload(diskit, st, work, full, results):
    tools = {
        "diskit convert": lambda: st.run(
            [diskit, "convert", "-f", "raw", "-O", "raw", full, st.url("up")]),
        "diskit copy": lambda: st.run([diskit, "copy", full, st.url("up")]),
        "aws s3 cp": lambda: st.run(st.aws("s3", "cp", "--quiet", full, st.url("up"))),
    }
    m = measure(tools, before=lambda: st.delete("up"))
    row = {**m, "convert/aws": ratio(m["diskit convert"], m["aws s3 cp"]),
           "copy/aws": ratio(m["diskit copy"], m["aws s3 cp"])}
    log(f"upload {row}")
    results["upload"] = row
    table(f"upload {SIZE_MIB} MiB raw into a new object, medians of {ROUNDS} (s); "
          "ratio = diskit / aws s3 cp (target at most 0.8)",
          ["diskit convert", "diskit copy", "aws s3 cp", "convert/aws", "copy/aws"],
          [[cell(m["diskit convert"]), cell(m["diskit copy"]), cell(m["aws s3 cp"]),
            rcell(row["convert/aws"]), rcell(row["copy/aws"])]])


def part_sparse(diskit, st, work, sparse, results):
    convert = [diskit, "convert", "-f", "raw"]
    tools = {
        "diskit qcow2": lambda: st.run([*convert, "-O", "qcow2", sparse, st.url("sparse")]),
        "diskit vmdk streamOptimized": lambda: st.run(
            [*convert, "-O", "vmdk", "-o", "subformat=streamOptimized", sparse,
             st.url("sparse")]),
        "aws s3 cp (raw)": lambda: st.run(st.aws("s3", "cp", "--quiet", sparse,
                                                 st.url("sparse"))),
    }
    m = measure(tools, before=lambda: st.delete("sparse"))
    row = {**m,
           "qcow2/aws": ratio(m["diskit qcow2"], m["aws s3 cp (raw)"]),
           "vmdk/aws": ratio(m["diskit vmdk streamOptimized"], m["aws s3 cp (raw)"])}
    log(f"sparse {row}")
    results["sparse"] = row
    table(f"a {SPARSE_MIB} MiB sparse image (64 KiB every 32 MiB) into S3, medians of {ROUNDS} "
          "(s); ratio = diskit / aws s3 cp of the raw form (target at most 0.05)",
          ["diskit -O qcow2", "diskit -O vmdk streamOptimized", "aws s3 cp (raw)", "qcow2/aws",
           "vmdk/aws"],
          [[cell(m["diskit qcow2"]), cell(m["diskit vmdk streamOptimized"]),
            cell(m["aws s3 cp (raw)"]), rcell(row["qcow2/aws"]), rcell(row["vmdk/aws"])]])


def part_serve(diskit, st, work, full, results):
    if "download" not in PARTS:
        st.delete("rand")
        subprocess.run(st.aws("s3", "cp", "--quiet", full, st.url("rand")), env=st.env,
                       check=True)
    args = [f"endpoint-url={st.endpoint}", f"bucket={BUCKET}", "key=rand"]

    def through(argv):
        # A server for each run, started and stopped untimed: nbdcopy's
        # time is the cell's.
        def run():
            sock = work / "serve.sock"
            srv = nb.Server(argv(sock), sock)
            try:
                return st.run(["nbdcopy", srv.uri, "null:"])
            finally:
                srv.stop()
        return run

    tools = {
        "diskit serve s3": through(
            lambda sock: [diskit, "serve", "-f", "-r", "-U", sock, "s3", *args]),
        "nbdkit S3": through(lambda sock: ["nbdkit", "-f", "-r", "-U", sock, "S3", *args]),
    }
    m = measure(tools)
    row = {**m, "speed-up": ratio(m["nbdkit S3"], m["diskit serve s3"])}
    log(f"serve {row}")
    results["serve"] = row
    table(f"nbdcopy of a {SIZE_MIB} MiB object to null through each server, medians of "
          f"{ROUNDS} (s); speed-up = nbdkit's time / diskit's (target at least 3)",
          ["diskit serve s3", "nbdkit S3", "speed-up"],
          [[cell(m["diskit serve s3"]), cell(m["nbdkit S3"]),
            f"{row['speed-up']:.2f}" if row["speed-up"] else "-"]])


def main():
    for tool in ["radosgw", "ceph-mon", "ceph-osd", "aws", "nbdcopy", "nbdkit"]:
        if not shutil.which(tool):
            sys.exit(f"{tool} not found (scripts/test installs it)")
    if subprocess.run(["nbdkit", "--dump-plugin", "S3"], capture_output=True).returncode != 0:
        sys.exit("nbdkit's S3 plugin not found (scripts/test installs nbdkit-plugin-python)")
    diskit = nb.build()
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip() or "unknown"
    work = Path(tempfile.mkdtemp(prefix="diskit-s3-bench.", dir="/dev/shm"))
    env = {"env": {k: os.environ.get(k) for k in ["SIZE_MIB", "SPARSE_MIB", "ROUNDS", "PARTS"]}}
    results = {"commit": commit, "size_mib": SIZE_MIB, "sparse_mib": SPARSE_MIB,
               "rounds": ROUNDS, **env}
    reporting_old = nb.quiet_vm()
    st = None
    try:
        log("sources")
        full, sparse = make_sources(work)
        log("starting the cluster with radosgw")
        st = Store(work)
        parts = {"download": (part_download, full), "upload": (part_upload, full),
                 "sparse": (part_sparse, sparse), "serve": (part_serve, full)}
        for p in PARTS:
            log(p)
            part, source = parts[p]
            part(diskit, st, work, source, results)
    finally:
        if st:
            st.stop()
        nb.quiet_vm_restore(reporting_old)
        shutil.rmtree(work, ignore_errors=True)
    save("s3", results, log)


if __name__ == "__main__":
    main()
