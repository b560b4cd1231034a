"""What the shell benchmarks' reports share (bench/lib.sh's report_env
exports what they read): the facts of the run every JSON result starts
with, and the table on stdout."""

import os
import platform


def meta(env, versions=(), extra=()):
    """The run's facts from the environment: date, commit, the tools'
    versions (diskit's and qemu-img's, then `versions`), the host, size
    and rounds, then `extra`, and the two locations."""
    return {
        "date": env["B_DATE"],
        "commit": env["B_COMMIT"],
        "diskit": env["B_DISKIT_VERSION"],
        "qemu_img": env["B_QEMU_VERSION"],
        **dict(versions),
        "host": {"kernel": platform.release(), "cpus": os.cpu_count()},
        "size_mib": int(env["B_SIZE_MIB"]),
        "rounds": int(env["B_ROUNDS"]),
        **dict(extra),
        "locations": {
            "shm": {"path": "/dev/shm", "fs": env["B_SHM_FS"]},
            "disk": {"path": env["B_DISK_DIR"], "fs": env["B_DISK_FS"]},
        },
    }


def print_table(title, rows, left):
    """A blank line, `title`, then `rows` (the first the head, ruled off
    below) in columns: the first `left` columns flush left, the others
    flush right."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    print()
    print(title)
    for i, r in enumerate(rows):
        print("  ".join(cell.ljust(w) if j < left else cell.rjust(w)
                        for j, (cell, w) in enumerate(zip(r, widths))))
        if i == 0:
            print("  ".join("-" * w for w in widths))
