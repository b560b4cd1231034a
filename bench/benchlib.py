"""What the Python benchmarks share: bench/nbd.py loaded as a module (by
path: its name is libnbd's), a logger named after the script, and the
selection of contenders from the environment."""

import importlib.util
import json
import os
import sys
import time
from pathlib import Path

_spec = importlib.util.spec_from_file_location("nbdbench", Path(__file__).resolve().parent / "nbd.py")
nbdbench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(nbdbench)


def logger(script):
    """A log function printing to stderr behind `[script]`."""

    def log(msg):
        print(f"[{script}] {msg}", file=sys.stderr, flush=True)

    return log


def chosen(var, names):
    """The comma-separated names in environment variable `var`; `names`
    (all of them) when it is unset."""
    return [c for c in os.environ.get(var, ",".join(names)).split(",") if c]


def rotated(tools, k):
    """`tools` rotated by k places, reversed in every other cycle of
    rotations: every tool goes first, and follows every other one, equally
    often (rotation alone has each always follow the same one)."""
    tools = list(tools)
    n = len(tools)
    seq = tools if (k // n) % 2 == 0 else tools[::-1]
    return seq[k % n:] + seq[:k % n]


def save(name, results, log):
    """Writes `results` as bench/results/NAME-<date>.json and says where."""
    out = Path(__file__).resolve().parent / "results" / f"{name}-{time.strftime('%Y-%m-%d-%H%M%S')}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    log(f"results in {out}")
