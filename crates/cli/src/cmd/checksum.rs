//! `diskit checksum`: the blkhash of an image's guest data, as `blksum`
//! prints it (`HEX  NAME`).
//!
//! The image is opened as every command opens one (any format diskit
//! reads, an NBD URI, http, the remote stores) and run through the copy
//! engine into a null destination with the hash on: threads read and hash
//! blocks in parallel, and ranges the image says read as zeros are hashed
//! without being read. The digest is the same for the same guest data
//! whatever the format, and whatever the number of threads.

use std::path::PathBuf;
use std::sync::Arc;

use crate::CmdResult;
use crate::util::{CliError, ForceShare, OpenPolicy, parse_size_arg, parse_source_format};
use diskit_copy::blkhash::{ALGORITHMS, Algorithm, BlockHash};
use diskit_copy::{CopyOptions, Progress, copy};
use diskit_open::OpenOptions;

/// Arguments of `checksum`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Image format (probed if absent).
    #[arg(short = 'f', long = "format")]
    format: Option<String>,
    /// Digest algorithm, by OpenSSL's name (as blksum): sha256 (the
    /// default), sha1, sha224, sha384, sha512, sha512-224, sha512-256,
    /// sha3-224, sha3-256, sha3-384, sha3-512, blake2b512, blake2s256,
    /// md5, ripemd160, sm3, shake128, shake256.
    #[arg(short = 'd', long = "digest", default_value = "sha256")]
    digest: String,
    /// Bytes per hashed block (a power of 2); the digest depends on it.
    #[arg(long = "block-size", default_value = "64k")]
    block_size: String,
    /// Threads reading and hashing (the digest does not depend on it;
    /// default: the number of processors).
    #[arg(short = 'T', long = "threads", short_alias = 't')]
    threads: Option<usize>,
    #[command(flatten)]
    share: ForceShare,
    /// List the digest names and exit.
    #[arg(short = 'l', long = "list-digests")]
    list_digests: bool,
    /// The image: a file of any format, an NBD URI, an http(s) URL...
    #[arg(required_unless_present = "list_digests")]
    filename: Option<PathBuf>,
}

/// Bytes per read: large enough to keep the per-request work small,
/// small enough to stay in the processors' caches while it is hashed.
const REQUEST_SIZE: usize = 1 << 20;

/// Runs `diskit checksum`.
pub fn run(a: Args, policy: OpenPolicy) -> CmdResult {
    if a.list_digests {
        for alg in ALGORITHMS {
            println!("{}", alg.name);
        }
        return Ok(0);
    }
    let filename = a.filename.expect("clap requires it");
    let alg = Algorithm::find(&a.digest)
        .ok_or_else(|| CliError::new(format!("Unknown digest '{}'", a.digest)))?;
    let block_size = parse_size_arg(&a.block_size, "block size")?;
    let hash = Arc::new(
        BlockHash::new(alg, block_size).map_err(|e| CliError::new(format!("--block-size: {e}")))?,
    );
    let threads = match a.threads {
        Some(0) => return Err(CliError::new("--threads: must be at least 1")),
        Some(t) => t,
        None => std::thread::available_parallelism().map_or(1, |n| n.get()),
    };
    let format = parse_source_format(a.format.as_deref(), &filename)?;
    let img = policy
        .sharing(a.share.given())
        .open(&filename, format, OpenOptions::default())?;
    let size = img.virtual_size();
    let opts = CopyOptions {
        workers: threads,
        request_size: REQUEST_SIZE,
        // Nothing is written: no zero runs to look for in the data, no
        // zeros to write.
        min_sparse: 0,
        target_is_zero: true,
        blkhash: Some(hash.clone()),
        ..CopyOptions::default()
    };
    let null = diskit_open::local::null_sink(size);
    let name = filename.display();
    let md = copy(&*img.device, &null, &opts, &Progress::default())
        .and_then(|_| hash.finish(size))
        .and_then(|md| img.device.close().map(|()| md))
        .map_err(|e| CliError::new(format!("{name}: {e}")))?;
    println!("{}  {name}", md.hex());
    Ok(0)
}
