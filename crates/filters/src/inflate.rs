//! Whole-stream decompression (the gzip and bzip2 filters): the device
//! below is decompressed once, when the filter is stacked, into an
//! unlinked temporary file in `$TMPDIR` (or /var/tmp), as nbdkit's gzip
//! filter does, and the file is served read-only. Blocks of zeros are
//! left as holes (so the export reports them in its extents), and reads
//! of the file may be spliced as a raw file's are. A corrupt or truncated
//! stream is an error before anything is served.

use std::io::Read;
use std::marker::PhantomData;
use std::os::unix::fs::FileExt;
use std::path::Path;

use diskit_backends::FileDevice;
use diskit_core::{
    BlockDevice, Capabilities, DeviceRef, Error, Extent, FileView, Filter, Result, StorageOptions,
    WriteFlags, ZeroFlags,
};

use crate::overlay::temp_file;
use crate::registry::{Configure, over, unknown};
use crate::xz::{decompressed, read_only};

/// How much is read below, and written, at once.
const PIECE: usize = 1 << 20;
/// Zero blocks of this size are left as holes.
const HOLE: usize = 64 << 10;

/// The device below as a stream of bytes.
struct Below<'a> {
    dev: &'a dyn BlockDevice,
    at: u64,
}

impl Read for Below<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = (self.dev.size() - self.at).min(buf.len() as u64) as usize;
        self.dev
            .read_at(&mut buf[..n], self.at)
            .map_err(std::io::Error::other)?;
        self.at += n as u64;
        Ok(n)
    }
}

/// A decompressor over a stream of bytes.
pub type Decoder<'a> = Box<dyn Read + 'a>;

/// A compression format decompressed whole: the filter's name and its
/// decoder.
pub trait Codec: Send + Sync + 'static {
    /// The filter's name.
    const NAME: &'static str;
    /// A decoder of the bytes `input` gives.
    fn decoder<'a>(input: Box<dyn Read + 'a>) -> Decoder<'a>;
}

/// The configuration of a whole-stream filter: it takes no parameters.
pub struct Whole<C>(PhantomData<C>);

impl<C> Default for Whole<C> {
    fn default() -> Self {
        Whole(PhantomData)
    }
}

impl<C: Codec> std::fmt::Debug for Whole<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Whole({})", C::NAME)
    }
}

impl<C: Codec> Configure for Whole<C> {
    fn set(&mut self, key: &str, _value: &str) -> Result<()> {
        Err(unknown(C::NAME, key))
    }

    fn stack(&self, next: DeviceRef) -> Result<DeviceRef> {
        let inflated = Inflated::new(C::NAME, &*next, C::decoder)?;
        Ok(over(inflated, next))
    }
}

/// The decompressed contents of the device below, held in a temporary
/// file.
struct Inflated {
    name: &'static str,
    file: FileDevice,
}

impl Inflated {
    /// Decompresses `next` with the decoder `decoder` makes, for filter
    /// `name`.
    fn new(
        name: &'static str,
        next: &dyn BlockDevice,
        decoder: impl for<'a> FnOnce(Box<dyn Read + 'a>) -> Decoder<'a>,
    ) -> Result<Inflated> {
        let file = temp_file(name, 0)?;
        let mut input = decoder(Box::new(std::io::BufReader::with_capacity(
            PIECE,
            Below { dev: next, at: 0 },
        )));
        let mut buf = vec![0u8; PIECE];
        let mut size = 0u64;
        loop {
            let mut n = 0;
            // Fill the buffer (decoders give little at a time).
            while n < PIECE {
                match input.read(&mut buf[n..]) {
                    Ok(0) => break,
                    Ok(k) => n += k,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(decompress_error(name, e)),
                }
            }
            if n == 0 {
                break;
            }
            for (i, piece) in buf[..n].chunks(HOLE).enumerate() {
                if !diskit_core::zero::is_zero(piece) {
                    file.write_all_at(piece, size + (i * HOLE) as u64)
                        .map_err(|e| {
                            Error::from(e)
                                .context(format!("{name}: cannot write the temporary file"))
                        })?;
                }
            }
            size += n as u64;
        }
        file.set_len(size).map_err(|e| {
            Error::from(e).context(format!("{name}: cannot size the temporary file"))
        })?;
        let file = FileDevice::adopt(
            file,
            Path::new("(temporary file)"),
            StorageOptions::default(),
        )?;
        Ok(Inflated { name, file })
    }
}

/// The error for a stream that does not decompress: the device's own
/// error when reading it failed, else the decoder's.
fn decompress_error(name: &str, e: std::io::Error) -> Error {
    let (kind, text) = (e.kind(), e.to_string());
    match e.into_inner().map(|inner| inner.downcast::<Error>()) {
        Some(Ok(below)) => *below,
        _ if kind == std::io::ErrorKind::UnexpectedEof => {
            Error::invalid(format!("{name}: the compressed stream is truncated"))
        }
        _ => Error::invalid(format!("{name}: the compressed stream is corrupt ({text})")),
    }
}

impl Filter for Inflated {
    fn name(&self) -> &str {
        self.name
    }
    fn size(&self, _next: &dyn BlockDevice) -> u64 {
        self.file.size()
    }
    /// Extents are the temporary file's holes.
    fn capabilities(&self, next: &dyn BlockDevice) -> Capabilities {
        decompressed(next, true)
    }
    fn is_known_zero(&self, _next: &dyn BlockDevice) -> bool {
        false
    }
    fn read_at(&self, _next: &dyn BlockDevice, buf: &mut [u8], offset: u64) -> Result<()> {
        self.file.read_at(buf, offset)
    }
    fn write_at(&self, _: &dyn BlockDevice, _: &[u8], _: u64, _: WriteFlags) -> Result<()> {
        Err(read_only(self.name))
    }
    fn write_zeroes(&self, _: &dyn BlockDevice, _: u64, _: u64, _: ZeroFlags) -> Result<()> {
        Err(read_only(self.name))
    }
    fn trim(&self, _: &dyn BlockDevice, _: u64, _: u64, _: WriteFlags) -> Result<()> {
        Err(read_only(self.name))
    }
    fn cache(&self, _next: &dyn BlockDevice, offset: u64, len: u64) -> Result<()> {
        self.file.cache(offset, len)
    }
    fn extents(&self, _next: &dyn BlockDevice, offset: u64, len: u64) -> Result<Vec<Extent>> {
        self.file.extents(offset, len)
    }
    fn extents_before_reads(&self, _next: &dyn BlockDevice) -> bool {
        true
    }
    fn file_view<'a>(
        &'a self,
        _next: &'a dyn BlockDevice,
        offset: u64,
        len: u64,
    ) -> Option<FileView<'a>> {
        self.file.file_view(offset, len)
    }
}
