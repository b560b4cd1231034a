//! Deferred placement on storage that refuses writes behind it (as a new
//! S3 object does, past its first part): the image is written once, front
//! to back, and qemu-img checks it and compares it with its data.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use diskit_backends::FileDevice;
use diskit_core::{
    BlockDevice, Capabilities, Error, ErrorKind, Preallocation, Result, Storage, StorageOptions,
    WriteFlags,
};

use crate::implied::NoImpliedFiles;
use crate::qcow2::compressed::CompressedWriter;
use crate::qcow2::open::{Qcow2Options, open};
use crate::qcow2::test_tools::{qemu_img, qemu_img_create};

/// How far behind the furthest byte written a write may start.
const SLACK: u64 = 64 << 10;

/// A file written front to back: past its first `head` bytes, no write
/// starts more than [`SLACK`] bytes before the furthest byte written.
struct FrontToBack {
    file: FileDevice,
    head: u64,
    reached: AtomicU64,
}

impl FrontToBack {
    fn check(&self, offset: u64, len: u64) -> Result<()> {
        let end = offset + len;
        let reached = self.reached.fetch_max(end, Ordering::AcqRel);
        if end <= self.head || offset + SLACK >= reached {
            return Ok(());
        }
        Err(Error::new(
            ErrorKind::NotSupported,
            format!(
                "write at {offset} behind {reached}, past the head of {}",
                self.head
            ),
        ))
    }
}

impl BlockDevice for FrontToBack {
    fn size(&self) -> u64 {
        self.file.size()
    }
    fn capabilities(&self) -> Capabilities {
        self.file.capabilities()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        self.file.read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64, flags: WriteFlags) -> Result<()> {
        self.check(offset, buf.len() as u64)?;
        self.file.write_at(buf, offset, flags)
    }
    fn flush(&self) -> Result<()> {
        self.file.flush()
    }
}

impl Storage for FrontToBack {
    fn location(&self) -> &str {
        self.file.location()
    }
    fn protocol(&self) -> &'static str {
        "file"
    }
    fn file_len(&self) -> Result<u64> {
        self.file.file_len()
    }
    fn write_extend(&self, buf: &[u8], offset: u64) -> Result<()> {
        self.check(offset, buf.len() as u64)?;
        self.file.write_extend(buf, offset)
    }
    fn resize(&self, new_len: u64, prealloc: Preallocation) -> Result<()> {
        self.file.resize(new_len, prealloc)
    }
    fn writes_in_order(&self) -> bool {
        true
    }
    fn rewritable_head(&self) -> u64 {
        self.head
    }
    fn is_fixed_size(&self) -> bool {
        false
    }
}

fn front_to_back(path: &Path, head: u64) -> Arc<FrontToBack> {
    let opts = StorageOptions {
        writable: true,
        ..Default::default()
    };
    let file = FileDevice::open(path, opts).unwrap();
    let reached = AtomicU64::new(file.file_len().unwrap());
    Arc::new(FrontToBack {
        file,
        head,
        reached,
    })
}

/// 32 MiB of guest data: MiBs of random bytes, of a repeated pattern
/// (compressible) and holes.
fn guest_data() -> Vec<u8> {
    let mut data = vec![0u8; 32 << 20];
    let mut x: u64 = 0x2545_f491_4f6c_dd1d;
    for (i, chunk) in data.chunks_mut(1 << 20).enumerate() {
        match i % 4 {
            0 | 1 => chunk.iter_mut().for_each(|b| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                *b = x as u8;
            }),
            2 => chunk
                .iter_mut()
                .enumerate()
                .for_each(|(k, b)| *b = (k % 251) as u8),
            _ => {}
        }
    }
    data
}

/// The host offsets of the guest data runs `qemu-img map` finds, in
/// guest order.
fn data_offsets(img: &Path) -> Vec<u64> {
    let map = qemu_img(&["map", "--output=json", img.to_str().unwrap()]);
    let v: serde_json::Value = serde_json::from_str(&map).unwrap();
    v.as_array()
        .unwrap()
        .iter()
        .filter(|e| e["data"] == true)
        .filter_map(|e| e["offset"].as_u64())
        .collect()
}

/// Writes `data` in guest order in 1 MiB pieces (holes skipped, as a
/// convert does), compressed or not, and closes the image.
fn write_image(img: &Path, head: u64, data: &[u8], compress: bool) -> Result<()> {
    let storage = front_to_back(img, head);
    let opts = Qcow2Options {
        writable: true,
        ..Default::default()
    };
    let image = Arc::new(open(storage, opts, &mut NoImpliedFiles)?);
    let target: Arc<dyn BlockDevice> = if compress {
        Arc::new(CompressedWriter::new(image.clone()))
    } else {
        image.clone()
    };
    for (i, piece) in data.chunks(1 << 20).enumerate() {
        if piece.iter().any(|&b| b != 0) {
            target.write_at(piece, (i as u64) << 20, WriteFlags::NONE)?;
        }
    }
    image.close()
}

/// A new image of 32 MiB with 512-byte clusters (qemu-img's): an L2 table
/// per 32 KiB of guest, a refcount block per 128 KiB of file, and a
/// refcount table of one cluster (8 MiB of file) that must grow.
fn new_image(img: &Path) -> std::path::PathBuf {
    qemu_img_create(img, "cluster_size=512", "32M");
    img.to_path_buf()
}

#[test]
fn an_image_written_front_to_back_keeps_its_tables_after_the_data() {
    let dir = tempfile::tempdir().unwrap();
    let raw = dir.path().join("data.raw");
    let data = guest_data();
    std::fs::write(&raw, &data).unwrap();
    for compress in [false, true] {
        let img = new_image(&dir.path().join(format!("c{compress}.qcow2")));
        let p = img.to_str().unwrap();
        write_image(&img, 16 << 10, &data, compress).unwrap();
        let check = qemu_img(&["check", "--output=json", p]);
        let v: serde_json::Value = serde_json::from_str(&check).unwrap();
        assert_eq!(v["check-errors"], 0, "{check}");
        assert!(
            v.get("leaks").is_none() && v.get("corruptions").is_none(),
            "{check}"
        );
        qemu_img(&[
            "compare",
            "-f",
            "qcow2",
            "-F",
            "raw",
            p,
            raw.to_str().unwrap(),
        ]);
        // The data runs lie in guest order, one after the other, the
        // metadata written at the end after them.
        let offsets = data_offsets(&img);
        assert!(offsets.len() > 2, "{offsets:?}");
        assert!(offsets.windows(2).all(|w| w[0] < w[1]), "{offsets:?}");
        let len = std::fs::metadata(&img).unwrap().len();
        let h = crate::qcow2::test_tools::open(&img).1;
        assert!(h.refcount_table_offset > *offsets.last().unwrap(), "{h:?}");
        assert!(h.refcount_table_offset < len);
    }
}

#[test]
fn an_image_whose_tables_lie_past_the_head_is_refused_before_any_write() {
    let dir = tempfile::tempdir().unwrap();
    let img = new_image(&dir.path().join("a.qcow2"));
    let before = std::fs::read(&img).unwrap();
    let e = write_image(&img, 4 << 10, &[1; 512], false).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotSupported);
    assert!(
        e.to_string()
            .contains("cannot write this qcow2 image front to back"),
        "{e}"
    );
    assert!(e.to_string().contains("(L1 table) reaches byte"), "{e}");
    assert_eq!(std::fs::read(&img).unwrap(), before);
}
