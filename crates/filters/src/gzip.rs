//! The gzip filter (nbdkit-gzip-filter): serves the decompressed contents
//! of a gzip file, read-only; no parameters. The file is decompressed
//! once, when the filter is stacked, into a temporary file (see
//! [`crate::inflate`]); the members of a file made of several (`cat a.gz
//! b.gz`) follow one another, as `gzip -d` reads them.

use std::io::Read;

use crate::inflate::{Codec, Decoder, Whole};

/// The keys the filter takes: none.
pub const KEYS: &[&str] = &[];

/// gzip, through flate2.
pub struct Gzip;

impl Codec for Gzip {
    const NAME: &'static str = "gzip";
    fn decoder<'a>(input: Box<dyn Read + 'a>) -> Decoder<'a> {
        Box::new(flate2::read::MultiGzDecoder::new(input))
    }
}

/// The filter's configuration.
pub type GzipConfig = Whole<Gzip>;
