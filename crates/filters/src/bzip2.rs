//! The bzip2 filter: serves the decompressed contents of a bzip2 file,
//! read-only, as the gzip filter serves a gzip file (nbdkit has none);
//! no parameters. The streams of a file made of several (`cat a.bz2
//! b.bz2`, pbzip2's) follow one another, as `bzip2 -d` reads them.

use std::io::Read;

use crate::inflate::{Codec, Decoder, Whole};

/// The keys the filter takes: none.
pub const KEYS: &[&str] = &[];

/// bzip2, through the bzip2 crate (libbz2-rs).
pub struct Bzip2;

impl Codec for Bzip2 {
    const NAME: &'static str = "bzip2";
    fn decoder<'a>(input: Box<dyn Read + 'a>) -> Decoder<'a> {
        Box::new(bzip2::read::MultiBzDecoder::new(input))
    }
}

/// The filter's configuration.
pub type Bzip2Config = Whole<Bzip2>;
