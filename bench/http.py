#!/usr/bin/env python3
"""Benchmark: copying a file served over HTTP, diskit against nbdkit's curl
plugin, in the same run (issue #14, benchmark 3).

A file of SIZE_MIB random bytes on /dev/shm is served by nginx on
loopback (range requests, keep-alive; nginx-light is installed with
apt-get when missing). Contenders, each copying the whole file to null:

  diskit-copy     diskit copy URL null:
  diskit-serve    diskit serve http URL, read by nbdcopy
  nbdkit-curl     nbdkit curl URL, read by nbdcopy

Each round runs every contender once, the order rotating from round to
round; the table gives the median time over ROUNDS rounds and each diskit
contender's speed-up over nbdkit (above 1: diskit is faster). Target from
the issue: faster than nbdkit curl. The free page reporting knobs are
held still for the run (bench/nbd.py).

Environment: SIZE_MIB (default 1024), ROUNDS (default 5), CONTENDERS
(comma separated, default all).
Output: the table on stdout and bench/results/http-<date>.json.
"""

import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchlib import chosen, logger, nbdbench

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
SIZE_MIB = int(os.environ.get("SIZE_MIB", "1024"))
ROUNDS = int(os.environ.get("ROUNDS", "5"))
ALL = ["diskit-copy", "diskit-serve", "nbdkit-curl"]
CONTENDERS = chosen("CONTENDERS", ALL)


log = logger("http.py")


def ensure_nginx():
    if shutil.which("nginx") or Path("/usr/sbin/nginx").exists():
        return shutil.which("nginx") or "/usr/sbin/nginx"
    log("installing nginx-light")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    subprocess.run(["apt-get", "install", "-y", "-q", "nginx-light"], check=True, env=env,
                   stdout=subprocess.DEVNULL)
    return shutil.which("nginx") or "/usr/sbin/nginx"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_nginx(nginx, root, work):
    port = free_port()
    conf = work / "nginx.conf"
    conf.write_text(f"""
daemon off;
worker_processes 2;
pid {work}/nginx.pid;
error_log {work}/nginx-error.log;
events {{ worker_connections 1024; }}
http {{
    access_log off;
    sendfile on;
    tcp_nopush on;
    keepalive_requests 1000000;
    client_body_temp_path {work}/body;
    proxy_temp_path {work}/proxy;
    fastcgi_temp_path {work}/fastcgi;
    uwsgi_temp_path {work}/uwsgi;
    scgi_temp_path {work}/scgi;
    server {{
        listen 127.0.0.1:{port};
        root {root};
    }}
}}
""")
    proc = subprocess.Popen([nginx, "-c", str(conf), "-p", str(work)],
                            stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.monotonic() + 20
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"nginx did not start: {proc.stderr.read().decode()}")
            time.sleep(0.05)
    return proc, f"http://127.0.0.1:{port}/data.raw"


def run(contender, diskit, url):
    if contender == "diskit-copy":
        argv = [str(diskit), "copy", url, "null:"]
    elif contender == "diskit-serve":
        argv = [str(diskit), "serve", "-U", "-", "http", url, "--run", 'nbdcopy "$uri" null:']
    else:
        argv = ["nbdkit", "-U", "-", "curl", url, "--run", 'nbdcopy "$uri" null:']
    start = time.monotonic()
    subprocess.run(argv, check=True)
    return time.monotonic() - start


def main():
    for tool in ["nbdkit", "nbdcopy"]:
        if not shutil.which(tool):
            sys.exit(f"{tool} not found (scripts/test installs it)")
    nginx = ensure_nginx()
    diskit = nbdbench.build()
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip() or "unknown"
    work = Path(tempfile.mkdtemp(prefix="diskit-http-bench.", dir="/dev/shm"))
    root = work / "www"
    root.mkdir()
    # nginx's workers run as another user when started as root.
    work.chmod(0o755)
    root.chmod(0o755)
    times = {}
    reporting_old = nbdbench.quiet_vm()
    proc = None
    try:
        log(f"writing {SIZE_MIB} MiB of random data")
        with open(root / "data.raw", "wb") as f:
            for _ in range(SIZE_MIB):
                f.write(os.urandom(1 << 20))
        (root / "data.raw").chmod(0o644)
        proc, url = start_nginx(nginx, root, work)
        for r in range(ROUNDS):
            order = CONTENDERS[r % len(CONTENDERS):] + CONTENDERS[:r % len(CONTENDERS)]
            for c in order:
                t = run(c, diskit, url)
                times.setdefault(c, []).append(t)
                log(f"round {r + 1}/{ROUNDS} {c}: {t:.2f} s")
    finally:
        if proc and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait()
        shutil.rmtree(work, ignore_errors=True)
        nbdbench.quiet_vm_restore(reporting_old)

    med = {c: statistics.median(v) for c, v in times.items()}
    print(f"\nHTTP source, {SIZE_MIB} MiB from nginx on loopback to null:, "
          f"median of {ROUNDS} rounds, commit {commit}")
    print(f"{'contender':<16}{'seconds':>9}{'MiB/s':>9}{'vs nbdkit-curl':>16}")
    met = True
    for c in CONTENDERS:
        ratio = med.get("nbdkit-curl", 0) / med[c] if "nbdkit-curl" in med else None
        cell = f"{ratio:>15.2f}x" if ratio and c != "nbdkit-curl" else f"{'-':>16}"
        print(f"{c:<16}{med[c]:>9.2f}{SIZE_MIB / med[c]:>9.0f}{cell}")
        if ratio and c.startswith("diskit") and ratio <= 1.0:
            met = False
    print(f"\ntarget (every diskit contender faster than nbdkit curl) met: {'yes' if met else 'no'}")
    out = nbdbench.write_results("http", {"commit": commit, "size_mib": SIZE_MIB, "rounds": ROUNDS,
                                          "times": times, "median": med, "met": met})
    log(f"wrote {out}")


if __name__ == "__main__":
    main()
