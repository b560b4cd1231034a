"""diskit.Image against qemu-img and qemu-io: a qcow2 over a raw backing
file, read, mapped, written and checked. Run by scripts/libnbd-python.sh
in a scratch directory."""

import json
import subprocess

import diskit


def run(*argv):
    return subprocess.run(argv, check=True, capture_output=True,
                          text=True).stdout


run("qemu-img", "create", "-q", "-f", "raw", "base.raw", "4M")
run("qemu-io", "-f", "raw", "-c", "write -P 0x11 0 1M", "base.raw")
run("qemu-img", "create", "-q", "-f", "qcow2", "-b", "base.raw", "-F", "raw",
    "top.qcow2")
run("qemu-io", "-f", "qcow2", "-c", "write -P 0x22 512k 64k", "top.qcow2")

img = diskit.Image("top.qcow2")
assert img.format == "qcow2", img.format
assert img.size == 4 << 20
assert img.chain() == ["top.qcow2", "base.raw"], img.chain()
assert img.read(4, 0) == b"\x11" * 4
assert img.read(4, 512 << 10) == b"\x22" * 4
assert img.read(4, 2 << 20) == b"\0" * 4
# The map's runs and depths are qemu-img map's.
theirs = json.loads(run("qemu-img", "map", "--output=json", "top.qcow2"))
mine = img.map()
assert [(e["start"], e["length"], e["data"], e["zero"], e["depth"])
        for e in theirs] == [tuple(m) for m in mine], (theirs, mine)
try:
    img.write(b"x", 0)
    assert False, "a read-only image took a write"
except diskit.Error as e:
    assert e.args[1] != 0
img.close()

img = diskit.Image("top.qcow2", writable=True)
img.write(b"\x33" * 65536, 1 << 20)
img.zero(65536, 512 << 10)
img.flush()
img.close()
run("qemu-img", "check", "top.qcow2")
run("qemu-io", "-f", "qcow2", "-c", "read -P 0x33 1M 64k",
    "-c", "read -P 0 512k 64k", "-c", "read -P 0x11 0 64k", "top.qcow2")

try:
    diskit.Image("missing.qcow2")
    assert False
except diskit.Error as e:
    assert "missing.qcow2" in e.args[0], e.args
print("image: ok")
