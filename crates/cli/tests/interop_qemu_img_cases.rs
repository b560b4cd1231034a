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
    assert_contains(&out, "read 1572864/1572864 bytes at offset 524288");
    assert_contains(&out, "Failed to zero out new clusters");
    assert_contains(&out, "Block driver does not support requested flags");
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

/// Rewrites a qcow2 image's snapshot table in place with every entry's
/// extra data cut to N bytes, as old QEMU versions wrote them
/// (`python3 short.py IMG N`), and prints a table (`show IMG`).
const SNAPSHOT_TABLE: &str = r#"cat > short.py <<'PY'
import struct, sys
p, keep = sys.argv[1], int(sys.argv[2])
f = open(p, 'r+b'); h = f.read(104); n, so = struct.unpack('>IQ', h[60:72])
f.seek(so); out = b''
for i in range(n):
    e = f.read(40); eds = struct.unpack('>I', e[36:40])[0]
    idl, nml = struct.unpack('>HH', e[12:16])
    extra = f.read(eds); names = f.read(idl + nml); f.read((-(40 + eds + idl + nml)) % 8)
    ent = e[:36] + struct.pack('>I', keep) + extra[:keep] + names
    out += ent + b'\0' * ((-len(ent)) % 8)
f.seek(so); f.write(out)
PY
show() { /usr/bin/python3 -c "
import struct
f = open('$1', 'rb'); h = f.read(104); n, so = struct.unpack('>IQ', h[60:72]); print('nsn', n, 'off', hex(so))
f.seek(so)
for i in range(n):
    e = f.read(40); idl, nml = struct.unpack('>HH', e[12:16]); eds = struct.unpack('>I', e[36:40])[0]
    extra = f.read(eds); f.read(idl + nml); f.read((-(40 + eds + idl + nml)) % 8)
    print('entry', i, 'extra', eds, extra.hex())
"; }
"#;

#[test]
fn short_snapshot_entries_are_completed_by_amend_and_by_check() {
    let out = alike(&format!(
        r#"{SNAPSHOT_TABLE}
qemu-img create -q -f qcow2 -o compat=0.10 a 1M; qemu-io -f qcow2 -c 'write -P 0x11 0 64k' a >/dev/null
qemu-img snapshot -c s1 a; qemu-img snapshot -c s2 a; /usr/bin/python3 short.py a 0
$T amend -o compat=1.1 a; echo "rc=$?"; qemu-img check a 2>&1; show a
qemu-img create -q -f qcow2 b 1M; qemu-io -f qcow2 -c 'write -P 0x11 0 64k' b >/dev/null
qemu-img snapshot -c s1 b; /usr/bin/python3 short.py b 8
$T check b 2>&1; echo rc=$?; $T check -r all b 2>&1; echo rc=$?; qemu-img check b; show b
qemu-img snapshot -a s1 b; qemu-io -f qcow2 -c 'read -P 0x11 0 64k' b | head -1
"#
    ));
    assert_contains(&out, "ERROR snapshot table entry 0 is incomplete");
    assert_contains(&out, "Repairing snapshot table entry 0 is incomplete");
    assert_eq!(out.matches(" extra 24 ").count(), 3, "{out}");
}

#[test]
fn check_rebuilds_the_refcounts_of_a_dirty_image_as_qemu_img_does() {
    // A lazy-refcounts image whose writer was killed: clusters in use
    // with a refcount of zero, which only a rebuild repairs.
    let out = alike(
        r#"
mk() { rm -f $1; qemu-img create -q -f qcow2 -o lazy_refcounts=on $1 1M
  qemu-io -f qcow2 -c "write -P 0x5a 0 512" -c "write -P 0x5b 256k 128k" -c "sigraise 9" $1 >/dev/null 2>&1 || true; }
mk d; $T check d 2>&1; echo rc=$?; $T check -r leaks d 2>&1 | sed 's/^[a-z-]*: //'; echo rc=$?
$T check -r all d 2>&1; echo rc=$?; qemu-img check d 2>&1; echo rc=$?
qemu-io -f qcow2 -c 'read -P 0x5a 0 512' -c 'read -P 0x5b 256k 128k' d | grep -c ^read
sha1sum d
mk e; $T check --output=json -r all e 2>&1; echo rc=$?
"#,
    );
    assert_contains(&out, "Rebuilding refcount structure");
    assert_contains(&out, "ERROR need to rebuild refcount structures");
}

#[test]
fn unaligned_l2_entries_and_unknown_autoclear_bits_as_qemu_img_handles_them() {
    let out = alike(
        r#"cat > poke.py <<'PY'
import struct, sys
cmd, path = sys.argv[1], sys.argv[2]
with open(path, 'r+b') as f:
    def rq(off): f.seek(off); return struct.unpack('>Q', f.read(8))[0]
    def wq(off, v): f.seek(off); f.write(struct.pack('>Q', v))
    l2o = rq(rq(40)) & 0x00fffffffffffe00
    if cmd == 'unalign-data': wq(l2o, rq(l2o) + 0x200)
    if cmd == 'unalign-zero': wq(l2o, (rq(l2o) + 0x200) | 1)
    if cmd == 'autoclear': wq(88, rq(88) | (1 << 40))
PY
qemu-img create -q -f qcow2 a 1M; qemu-io -f qcow2 -c 'write -P 0x22 0 128k' a >/dev/null
for c in unalign-data unalign-zero autoclear; do
  cp a $c; /usr/bin/python3 poke.py $c $c
  $T check $c 2>&1; echo rc=$?; $T check -r all $c 2>&1; echo rc=$?
  qemu-img check $c 2>&1; echo rc=$?; od -A d -t x1 -j 88 -N 8 $c; sha1sum $c
done
cp a l; /usr/bin/python3 poke.py autoclear l; $T check -r leaks l; od -A d -t x1 -j 88 -N 8 l
"#,
    );
    assert_contains(&out, "Repairing offset=50200: Preallocated cluster");
    assert_contains(
        &out,
        "ERROR offset=50200: Data cluster is not properly aligned",
    );
}

#[test]
fn shrinking_without_preallocation_and_passphrases_that_are_not_text() {
    let out = alike(
        r#"
qemu-img create -q -f raw r.raw 2M; run $T resize --shrink --preallocation=off -f raw r.raw 1M; stat -c %s r.raw
qemu-img create -q -f qcow2 q.qcow2 2M; run $T resize --shrink --preallocation=off q.qcow2 1M
qemu-img info q.qcow2 | grep virtual
run $T resize --preallocation=off -f raw r.raw 1M; run $T resize --preallocation=falloc -f raw r.raw 1M
printf '\xff\xfe' > sec
run $T create -q -f luks --object secret,id=s0,file=sec -o key-secret=s0 l.luks 1M; ls l.luks 2>&1 | head -1
run $T create -q -f qcow2 --object secret,id=s0,file=sec -o encrypt.format=luks,encrypt.key-secret=s0 l.qcow2 1M
ls l.qcow2 2>&1 | head -1
"#,
    );
    assert_contains(&out, "l.luks: Data from secret s0 is not valid UTF-8");
    assert!(out.starts_with("rc=0 \n1048576\n"), "{out}");
}

#[test]
fn a_bitmap_merges_from_an_overlay_of_its_own_image() {
    let out = alike(
        r#"
qemu-img create -q -f qcow2 base.qcow2 1M; qemu-img bitmap --add base.qcow2 b0
qemu-img create -q -f qcow2 -F qcow2 -b base.qcow2 ov.qcow2; qemu-img bitmap --add ov.qcow2 b1
qemu-io -f qcow2 -c 'write 0 64k' -c 'write 512k 64k' ov.qcow2 >/dev/null
run $T bitmap --merge b1 -b ov.qcow2 -F qcow2 base.qcow2 b0; qemu-img check -q base.qcow2 && echo clean
qemu-nbd -r -f qcow2 -B b0 -k "$PWD/s" base.qcow2 &
for i in $(seq 200); do [ -S s ] && break; sleep 0.05; done
nbdinfo --map=qemu:dirty-bitmap:b0 "nbd+unix:///?socket=$PWD/s"; kill %1; wait
"#,
    );
    assert!(out.starts_with("rc=0 \nclean\n"), "{out}");
    assert_eq!(out.matches("dirty").count(), 2, "{out}");
}

#[test]
fn convert_s0_allocates_everything_and_b_leaves_zeros_past_the_backing_end() {
    let out = alike(
        r#"
qemu-img create -q -f qcow2 src.qcow2 1M; qemu-io -f qcow2 -c 'write -P 0x11 0 64k' -c 'write -z 128k 64k' src.qcow2 > /dev/null
$T convert -S 0 -O qcow2 src.qcow2 o.qcow2; qemu-img map --output=json o.qcow2; qemu-img compare src.qcow2 o.qcow2
$T convert -S 0 -O raw src.qcow2 o.raw; qemu-img map --output=json -f raw o.raw; du -k o.raw | cut -f1
qemu-img create -q -f qcow2 -o compat=0.10 b.qcow2 512k; qemu-io -f qcow2 -c 'write -P 0x22 0 512k' b.qcow2 >/dev/null
qemu-img create -q -f qcow2 s2.qcow2 1M
qemu-io -f qcow2 -c 'write -P 0x22 0 512k' -c 'write -P 0x33 900k 4k' s2.qcow2 >/dev/null
for compat in 0.10 1.1; do
  rm -f o2.qcow2; $T convert -O qcow2 -B b.qcow2 -F qcow2 -o compat=$compat s2.qcow2 o2.qcow2
  # What lies past the backing file's end and reads as zeros is not written.
  qemu-img map --output=json o2.qcow2 | grep -E '"start": (0|524288|983040),'
  qemu-img compare s2.qcow2 o2.qcow2; qemu-img check -q o2.qcow2 && echo clean
done
"#,
    );
    assert!(
        out.starts_with(r#"[{ "start": 0, "length": 1048576, "depth": 0, "present": true, "zero": false, "data": true"#),
        "{out}"
    );
    assert_contains(
        &out,
        r#"{ "start": 524288, "length": 393216, "depth": 0, "present": false, "zero": true, "data": false"#,
    );
}

#[test]
fn image_opts_with_a_format_and_the_size_mismatch_warning_as_qemu_img() {
    let out = alike(
        r#"
qemu-img create -q -f qcow2 a.qcow2 1M; qemu-img create -q -f qcow2 b.qcow2 2M; qemu-img create -q -f qcow2 c.qcow2 2M
qemu-io -f qcow2 -c 'write -P 1 0 4k' b.qcow2 >/dev/null
for c in "info -f qcow2" "map -f qcow2" "check -f qcow2" "compare -f qcow2" "compare -F qcow2" \
         "convert -f qcow2" "snapshot -l -f qcow2" "amend -o lazy_refcounts=on -f qcow2" "commit -f qcow2" \
         "measure -O qcow2 -f qcow2" "bench -c 1 -f qcow2"; do
  extra=""; [[ $c == compare* ]] && extra=driver=qcow2,file.filename=a.qcow2; [[ $c == convert* ]] && extra=out.raw
  $T $c --image-opts driver=qcow2,file.filename=a.qcow2 $extra 2>&1 | sed 's/^[a-z-]*: //' | head -1
  echo "rc=${PIPESTATUS[0]}"
done
for p in "a.qcow2 b.qcow2" "a.qcow2 c.qcow2" "b.qcow2 a.qcow2" "c.qcow2 b.qcow2"; do
  $T compare $p; echo rc=$?; $T compare -s $p; echo rc=$?
done 2>&1
"#,
    );
    assert_eq!(out.matches("are mutually exclusive").count(), 11, "{out}");
    assert_eq!(
        out.matches("Warning: Image size mismatch!").count(),
        1,
        "{out}"
    );
}

#[test]
fn dd_options_after_the_operands_and_bitmap_with_image_opts() {
    let out = alike(
        r#"
qemu-img create -q -f qcow2 a.qcow2 1M
$T dd if=a.qcow2 of=d.qcow2 -O qcow2 bs=64k; echo rc=$?; qemu-img info d.qcow2 2>&1 | grep "file format"
$T bitmap --granularity 128k --add a.qcow2 bx; echo rc=$?
$T bitmap --remove --image-opts driver=qcow2,file.filename=a.qcow2 bx; echo rc=$?
qemu-img info a.qcow2 | grep -c bitmaps
$T bitmap --add --object secret,id=s0,data=x --image-opts driver=qcow2,file.filename=a.qcow2 by; echo rc=$?
qemu-img info a.qcow2 | grep -A4 bitmaps | grep name
"#,
    );
    assert!(
        out.starts_with("rc=0\nfile format: qcow2\nrc=0\nrc=0\n0\nrc=0\n"),
        "{out}"
    );
}

/// Names as qemu-img takes them: `json:` in QEMU's single quotes, a
/// `json:` backing file name, `--backing-chain` through `--image-opts`,
/// `file:` before a name with a colon, a protocol as the top node
/// (`driver=null-co`, `driver=file`) and `l2-cache-entry-size`.
#[test]
fn names_and_node_options_as_qemu_img_takes_them() {
    let out = alike(
        r#"
qemu-img create -q -f qcow2 b.qcow2 1M; qemu-io -f qcow2 -c 'write -P 0x11 0 64k' b.qcow2 >/dev/null
$T info "json:{'driver':'qcow2','file':{'driver':'file','filename':'b.qcow2'}}"; echo "rc=$?"
$T info --output=json 'json:{"driver":"qcow2","file":{"filename":"b.qcow2"}}' | grep -v actual; echo "rc=$?"
run $T info "json:{'driver':'qcow2','file':{'filename':'b.qcow2'}"
$T create -q -f qcow2 -F qcow2 -b 'json:{"driver":"qcow2","file":{"driver":"file","filename":"b.qcow2"}}' o.qcow2
$T info --backing-chain o.qcow2 | grep -E '^(image|backing)'
$T info --backing-chain --image-opts driver=qcow2,file.filename=o.qcow2 | grep -E '^(image|backing)'
qemu-io -f qcow2 -c 'read -P 0x11 0 64k' o.qcow2 | head -1
$T create -f qcow2 file:a:b.qcow2 1M; echo "rc=$?"; ls a:b.qcow2
$T convert -O raw file:a:b.qcow2 file:c:d.raw; echo "rc=$?"; ls c:d.raw
run $T create -f raw null-co:// 1M
for o in driver=null-co,size=1M driver=null-co,size=1M,read-zeroes=on driver=file,filename=c:d.raw; do
  $T info --image-opts $o | grep -v '^disk size'; echo "rc=$?"
done
$T info --output=json --image-opts driver=null-co,size=1M,read-zeroes=on
for n in 512 4096 65536 100 131072; do
  run $T info --image-opts driver=qcow2,l2-cache-entry-size=$n,file.filename=b.qcow2
done
"#,
    );
    assert_contains(&out, "image: b.qcow2\n");
    assert_contains(&out, "file format: null-co\n");
    assert_contains(&out, "file format: file\n");
    assert_contains(&out, "read 65536/65536 bytes");
    assert!(
        out.contains("\na:b.qcow2\n") && out.contains("\nc:d.raw\n"),
        "{out}"
    );
    assert_contains(&out, "L2 cache entry size must be a power of two");
}

/// LUKS key slots with and without `--force` (overwriting an active slot,
/// erasing every slot a password opens), as qemu-img changes them.
#[test]
fn luks_slots_with_and_without_force() {
    let out = alike(
        r#"
S="--object secret,id=s0,data=pw0 --object secret,id=s1,data=pw1 --object secret,id=s2,data=pw2"
qemu-img create -q -f luks $S -o key-secret=s0,iter-time=10 l.luks 1M
qemu-io $S --image-opts driver=luks,key-secret=s0,file.filename=l.luks -c 'write -P 0x5a 0 64k' >/dev/null
I="--image-opts driver=luks,key-secret=s0,file.filename=l.luks"
run $T amend $S -o state=active,new-secret=s1,keyslot=0,iter-time=10 $I
run $T amend --force $S -o state=active,new-secret=s1,keyslot=0,iter-time=10 $I
I="--image-opts driver=luks,key-secret=s1,file.filename=l.luks"
run $T amend $S -o state=active,new-secret=s2,iter-time=10 $I
run $T amend $S -o state=inactive,keyslot=0 $I
I="--image-opts driver=luks,key-secret=s2,file.filename=l.luks"
run $T amend $S -o state=inactive,old-secret=s2 $I
qemu-io $S $I -c 'read -P 0x5a 0 64k' | head -1
run $T amend --force $S -o state=inactive,old-secret=s2 $I
qemu-img info l.luks | grep -c 'active: true' || true
"#,
    );
    assert_contains(&out, "Refusing to overwrite active keyslot 0");
    assert_contains(&out, "All the active keyslots match");
    assert_contains(&out, "read 65536/65536");
    assert_eq!(out.matches("rc=0").count(), 4, "{out}");
}

/// Overlays of encrypted images are made without the backing file's key
/// (only its size is read), and a missing file further down the chain
/// still stops them, as in qemu-img.
#[test]
fn overlays_of_encrypted_images_need_no_key() {
    let out = alike(
        r#"
S="--object secret,id=s0,data=pw0 --object secret,id=s1,data=pw1"
qemu-img create -q -f qcow2 $S -o encrypt.format=luks,encrypt.key-secret=s0,encrypt.iter-time=10 base.qcow2 1M
run $T create -f qcow2 $S -b base.qcow2 -F qcow2 -o encrypt.format=luks,encrypt.key-secret=s1,encrypt.iter-time=10 ov.qcow2
run $T create -f qcow2 -b base.qcow2 -F qcow2 ov2.qcow2
run $T create -f qcow2 -b ov2.qcow2 -F qcow2 ov3.qcow2
mv base.qcow2 gone.qcow2; run $T create -f qcow2 -b ov2.qcow2 -F qcow2 ov4.qcow2; mv gone.qcow2 base.qcow2
for i in '' 2 3; do qemu-img info ov$i.qcow2 | grep -E '^(virtual|backing)'; done
qemu-io $S --image-opts driver=qcow2,encrypt.key-secret=s1,backing.encrypt.key-secret=s0,file.filename=ov.qcow2 -c 'read -P 0 0 64k' | head -1
"#,
    );
    assert_eq!(out.matches("rc=0").count(), 3, "{out}");
    assert_contains(&out, "Could not open backing file: Could not open");
    assert_contains(&out, "read 65536/65536");
}

/// `map` of a raw file one byte short of 1 MiB shows the one extent
/// qemu-img shows, and an overlay names a block device as its backing
/// file with `-F host_device` (when a loop device can be had).
#[test]
fn map_of_an_odd_sized_file_and_a_host_device_backing_file() {
    let out = alike(
        r#"
truncate -s 1048575 r.raw; $T map --output=json r.raw; $T map r.raw
printf x | dd of=r.raw bs=1 seek=1000 conv=notrunc 2>/dev/null; $T map --output=json -f raw r.raw
run $T create -f qcow2 -b r.raw -F host_device o.qcow2
truncate -s 1M h.raw
if L=$(losetup -f --show h.raw 2>/dev/null); then
  run $T create -f qcow2 -b "$L" -F host_device o.qcow2
  qemu-img info --backing-chain o.qcow2 | grep -E '^(virtual|file format|backing file format)'
  losetup -d "$L"
fi
"#,
    );
    assert_eq!(out.matches("\"start\"").count(), 3, "{out}");
    assert_contains(
        &out,
        "driver requires 'r.raw' to be either a character or block device",
    );
}
