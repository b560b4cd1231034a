//! qemu-img's behaviour where QEMU's own tests look: each case is a shell
//! script run twice in fresh directories, once with `$T` standing for
//! qemu-img and once for diskit (images made and read back with the real
//! qemu-img and qemu-io either way). Everything the script prints (exit
//! codes, messages without the program's name, maps, reads, checks) must
//! be the same.

mod common;

use common::*;

/// Runs `script` with `$T` = `tool` in a new directory; its standard
/// output. `run CMD...` prints a command's exit code and first message.
fn scenario(tool: &str, script: &str) -> String {
    let dir = workdir();
    let prelude = r#"set -u
run() { "$@" >/dev/null 2>err; echo "rc=$? $(sed 's/^[a-z-]*: //' err | head -1)"; }
"#;
    let o = timed("bash", 120)
        .arg("-c")
        .arg(format!("{prelude}{script}"))
        .env("T", tool)
        .current_dir(dir.path())
        .output()
        .unwrap();
    assert!(o.status.success(), "{tool}: {}", stderr(&o));
    stdout(&o)
}

/// The same script through qemu-img and through diskit prints the same.
fn alike(script: &str) -> String {
    let theirs = scenario("qemu-img", script);
    let ours = scenario(diskit_bin().to_str().unwrap(), script);
    assert_eq!(ours, theirs, "diskit and qemu-img differ");
    ours
}

#[test]
fn growing_an_overlay_reads_zeros_not_its_backing_file() {
    let out = alike(
        r#"
qemu-img create -q -f qcow2 b 1M; qemu-io -f qcow2 -c 'write -P 0x11 0 1M' b >/dev/null
qemu-img create -q -f qcow2 -F qcow2 -b b t1 512k; run $T resize t1 2M
qemu-img map --output=json t1; qemu-io -f qcow2 -c 'read -P 0 524288 1572864' t1 | head -1
qemu-img create -q -f qcow2 -F qcow2 -b b t2 512k; run $T resize --shrink t2 256k; run $T resize t2 1M
qemu-img map --output=json t2; qemu-io -f qcow2 -c 'read -P 0 262144 786432' t2 | head -1
qemu-img create -q -f qcow2 -F qcow2 -b b t3 1000k; run $T resize t3 1048064
qemu-io -f qcow2 -c 'read -P 0x11 0 1024000' -c 'read -P 0 1024000 24064' t3 | grep -c '^read'
qemu-img create -q -f qcow2 -F qcow2 -b b t4 512k; run $T amend -o size=1M t4
qemu-io -f qcow2 -c 'read -P 0 524288 524288' t4 | head -1
qemu-img create -q -f qcow2 -o compat=0.10 -F qcow2 -b b t5 512k; run $T resize t5 1M; qemu-img info t5 | grep virtual
qemu-img create -q -f qed -F qcow2 -b b t6 512k; run $T resize t6 1M; qemu-img info t6 | grep virtual
qemu-img create -q -f qcow2 -F qcow2 -b b t7 1M; run $T resize t7 2M; qemu-img map --output=json t7
for i in 1 2 3 4 7; do qemu-img check -q t$i && echo clean; done
"#,
    );
    // What the case is about, said outright: zeros where the backing
    // file has 0x11, and the refusals.
    assert!(
        out.contains("read 1572864/1572864 bytes at offset 524288"),
        "{out}"
    );
    assert!(out.contains("Failed to zero out new clusters"), "{out}");
    assert!(
        out.contains("Block driver does not support requested flags"),
        "{out}"
    );
    assert_eq!(out.matches("clean").count(), 5, "{out}");
}

/// Pokes a qcow2 image's first L1 or L2 entry (`python3 poke.py CMD IMG`).
const POKE: &str = r#"cat > poke.py <<'PY'
import struct, sys
cmd, path = sys.argv[1], sys.argv[2]
with open(path, 'r+b') as f:
    def rq(off): f.seek(off); return struct.unpack('>Q', f.read(8))[0]
    def wq(off, v): f.seek(off); f.write(struct.pack('>Q', v))
    l1o = rq(40); l1 = rq(l1o); l2o = l1 & 0x00fffffffffffe00
    if cmd == 'clear-l1-copied': wq(l1o, l1 & ~(1 << 63))
    if cmd == 'set-l1-copied': wq(l1o, l1 | (1 << 63))
    if cmd == 'clear-l2-copied': wq(l2o, rq(l2o) & ~(1 << 63))
    if cmd == 'set-l2-copied': wq(l2o, rq(l2o) | (1 << 63))
PY
"#;

#[test]
fn check_repairs_oflag_copied_as_qemu_img_does() {
    let out = alike(&format!(
        r#"{POKE}
qemu-img create -q -f qcow2 a 1M; qemu-io -f qcow2 -c 'write -P 0x22 0 128k' a >/dev/null
cp a s; qemu-img snapshot -c s1 s
for c in clear-l1-copied clear-l2-copied; do cp a $c; /usr/bin/python3 poke.py $c $c; done
for c in set-l1-copied set-l2-copied; do cp s $c; /usr/bin/python3 poke.py $c $c; done
for c in clear-l1-copied clear-l2-copied set-l1-copied set-l2-copied; do
  $T check $c; echo "rc=$?"
  $T check -r all $c; echo "rc=$?"
  qemu-img check $c; echo "rc=$?"
  qemu-io -f qcow2 -c 'write -P 0x33 0 64k' -c 'read -P 0x33 0 64k' -c 'read -P 0x22 64k 64k' $c | grep -c '^read'
done 2>&1
"#
    ));
    assert_eq!(out.matches("Repairing OFLAG_COPIED").count(), 4, "{out}");
    assert_eq!(out.matches("rc=0").count(), 8, "{out}");
}

#[test]
fn commit_and_rebase_work_on_qed_and_vmdk_as_in_qemu_img() {
    let out = alike(
        r#"
for fmt in qed vmdk; do
  rm -f b t o
  qemu-img create -q -f $fmt b 1M; qemu-io -f $fmt -c 'write -P 0x11 0 1M' b >/dev/null
  qemu-img create -q -f $fmt -F $fmt -b b t; qemu-io -f $fmt -c 'write -P 0x22 0 64k' t >/dev/null
  run $T commit t; qemu-img map --output=json t
  qemu-io -f $fmt -c 'read -P 0x22 0 64k' -c 'read -P 0x11 64k 64k' b | grep -c ^read
  qemu-img create -q -f $fmt o 1M; run $T rebase -u -f $fmt -b o -F $fmt t; qemu-img info t | grep backing
  run $T rebase -f $fmt -b b -F $fmt t; qemu-img info t | grep backing
  qemu-io -f $fmt -c 'read -P 0x22 0 64k' -c 'read -P 0x11 64k 64k' t | grep -c ^read
  run $T rebase -u -f $fmt -b b -F raw t; qemu-img info t | grep backing
  run $T rebase -u -f $fmt -b "" t; qemu-img info t | grep backing; qemu-img check t | head -1
  # The header as QEMU rewrites it (vmdk's CIDs are random).
  if [ $fmt = qed ]; then od -A d -t x1 -N 4096 t; fi
done
"#,
    );
    // The QED overlay was committed and rebased; vmdk refuses rebasing as
    // QEMU does.
    assert_eq!(out.matches("rc=0").count(), 5 + 1, "{out}");
    assert!(out.contains("Could not change the backing file to 'o': Operation not supported"));
}
