use super::*;

/// The blkhash of an image described as blkhash's tests describe them
/// (`64k:A 32k:- 32k:0`: 64 KiB of 'A', a 32 KiB hole, 32 KiB of zeros
/// written as data; and `=TEXT*N`, TEXT N times), given in order.
fn checksum(name: &str, block_size: u64, image: &str) -> String {
    let h = BlockHash::new(Algorithm::find(name).unwrap(), block_size).unwrap();
    let mut off = 0;
    for piece in image.split_whitespace() {
        // Text, repeated: =TEXT or =TEXT*N.
        if let Some(text) = piece.strip_prefix('=') {
            let (text, n) = text.split_once('*').unwrap_or((text, "1"));
            let data = text.repeat(n.parse().unwrap());
            h.data(off, data.as_bytes());
            off += data.len() as u64;
            continue;
        }
        let (len, byte) = piece.split_once(':').unwrap();
        let len = diskit_core::size::parse_size(len).unwrap();
        match byte {
            "-" => h.zeros(off, len),
            "0" => h.data(off, &vec![0; len as usize]),
            b => h.data(off, &vec![b.as_bytes()[0]; len as usize]),
        }
        off += len;
    }
    h.finish(off).unwrap().hex()
}

const K64: u64 = 64 << 10;

/// blkhash's test vectors (test/blkhash-test.c: sha256, 64 KiB blocks,
/// which blkhash checks with 1 to 64 threads): an image, its digest.
const BLKHASH_VECTORS: &str = "
    64k:A 2e3a5f57d5e726ee5de62db1a85ff816f4fa6ea4627807d9a51bdc4c883e165e
    64k:0 8ab067ab7939a3d4f40cbb118956c07c06aeae2d075d6e0a2ebbb94bd42832af
    64k:- 8ab067ab7939a3d4f40cbb118956c07c06aeae2d075d6e0a2ebbb94bd42832af
    32k:A 9467334d6d7668a2f06898185b5cddc78cdfbd962f50c6bf250101f03a0e54dc
    32k:0 842d185f0ff348b0d689e184bddc47f69a19032a6934c89b879479f1e86f9d56
    32k:- 842d185f0ff348b0d689e184bddc47f69a19032a6934c89b879479f1e86f9d56
    512k:- 722ac11a3a81034edf196aa3ee68d1a2e345cd0838b0c78c2ce2fb015d4d817d
    1g:- c6d6562c3074a2caa0ceea3e1f460f3af678c792ed05e64157eb51e68ae5260d
    512k:- 32k:- e623a5702b1feb08fbb3d18e35bbb7ec10146b8cd1bcff811200a3948c78c55c
    512k:0 722ac11a3a81034edf196aa3ee68d1a2e345cd0838b0c78c2ce2fb015d4d817d
    512k:0 32k:0 e623a5702b1feb08fbb3d18e35bbb7ec10146b8cd1bcff811200a3948c78c55c
    32k:A 32k:B 32k:C 32k:D 32k:E 32k:F 4ab1586084326f5beb911621282e9557cd26856105eff7f78cace5986af4738b
    32k:A 32k:B 32k:C 32k:D 32k:E 2cad558b3a2a8d87435e80fe7bae69fa664d92eaa1b9411f573b9fbb412a4d43
    32k:A 32k:- 32k:- 32k:0 32k:E 32k:- 32k:- 32k:0 4b2b5acd96f8105f4fb26abaf35c7c5756338ef9ccce19ffe7714c9ad94b4398
    32k:A 32k:- 32k:- 32k:0 32k:E 32k:- 32k:- 2510ac29c7103f2e68c672d728cbd43db4ed3dc809a24cde96e62dc5862a0f57
";

#[test]
fn blkhash_test_vectors() {
    for line in BLKHASH_VECTORS.lines().filter(|l| !l.trim().is_empty()) {
        let (image, want) = line.trim().rsplit_once(' ').unwrap();
        assert_eq!(checksum("sha256", K64, image), want, "{image}");
    }
}

/// libnbd's test vectors for nbdcopy --blkhash (copy/copy-blkhash-known.sh,
/// cross-checked there against blkhash's reference implementation), as
/// `--blkhash`'s value, the image (nbdkit's data plugin's `"hello" @1048576
/// "goodbye"` is `=hello 1048571:- =goodbye`), the digest.
const NBDCOPY_VECTORS: &str = "
    sha256 af5570f5a1810b7af78caf4bc70a660f0df51e42baf91d4de5b2328de0e83dfc
    md5 =hello f741ac9ce55f5325906bb14e9c05d467
    sha256 =hello 337355feb53a5309d5aba92796223c2c84ffab930e706c01fef573a2722545e6
    sha512 =hello eca04a593cf12ec4132993da709048e25a2f1be3526e132fb521ec9d41f023ec4018b3fd07b014a33e36bb5fa145b36991f431e62f9e1a93bebea6c9565682c1
    md5/4 =hello 8262896de34125dec173722c920e8bd0
    sha256 =hello 1048571:- =goodbye 61b8f3a8cea76e16eeff7ce27f1b7711c1f1e437f5038cec17773772a4bded28
    md5 =12345678*131072 84fc21ac2f49ac283ff399378d834d1a
    sha256 =12345678*131072 cbb388edd25e567b85f504c7b345497f9fb4f6bbf4e39768809184b9f9e678f8
    sha512/512k =12345678*131072 379f7eb1628058c7abbc4c96941ac972074815ea9ef4aca95eefb2b4f9c29f64023fff8d966e9fddf08d07bdba548e75298917f10268fdf9ba636c2321a2214e
";

#[test]
fn nbdcopy_test_vectors() {
    for line in NBDCOPY_VECTORS.lines().filter(|l| !l.trim().is_empty()) {
        let words: Vec<&str> = line.split_whitespace().collect();
        let (spec, image, want) = (
            words[0],
            words[1..words.len() - 1].join(" "),
            words[words.len() - 1],
        );
        let (alg, bs) = parse_spec(spec).unwrap();
        assert_eq!(checksum(alg.name, bs, &image), want, "{line}");
    }
}

/// The same bytes given in small, unaligned pieces, out of order, on
/// several threads, zeros as data or as holes: the same digest.
#[test]
fn order_and_threads_do_not_matter() {
    let size = 3 * K64 * 7 + 12345;
    let mut image = vec![0u8; size as usize];
    for (i, b) in image.iter_mut().enumerate() {
        // Data with zero stretches, some whole blocks long.
        if (i / 50_000) % 3 != 1 {
            *b = (i * 7 % 251) as u8;
        }
    }
    let want = {
        let h = BlockHash::new(Algorithm::default_algorithm(), K64).unwrap();
        h.data(0, &image);
        h.finish(size).unwrap()
    };
    // Pieces of varying, unaligned lengths.
    let mut pieces = Vec::new();
    let mut off = 0u64;
    let mut step = 1000u64;
    while off < size {
        let n = step.min(size - off);
        pieces.push((off, n));
        off += n;
        step = step * 13 % 97_003 + 1;
    }
    for threads in [1, 2, 5] {
        let h = BlockHash::new(Algorithm::default_algorithm(), K64).unwrap();
        std::thread::scope(|s| {
            for t in 0..threads {
                let (h, image, pieces) = (&h, &image, &pieces);
                s.spawn(move || {
                    // Each thread its share, last piece first.
                    for (i, &(off, n)) in pieces.iter().enumerate().rev() {
                        if i % threads != t {
                            continue;
                        }
                        let data = &image[off as usize..(off + n) as usize];
                        if is_zero(data) && i % 2 == 0 {
                            h.zeros(off, n);
                        } else {
                            h.data(off, data);
                        }
                    }
                });
            }
        });
        assert_eq!(h.finish(size).unwrap(), want, "{threads} threads");
    }
}

#[test]
fn missing_bytes_are_an_error() {
    let h = BlockHash::new(Algorithm::default_algorithm(), K64).unwrap();
    h.data(0, &[1; 100]);
    h.data(200, &[1; 100]);
    assert!(h.finish(300).is_err());
    let h = BlockHash::new(Algorithm::default_algorithm(), K64).unwrap();
    h.zeros(K64, K64);
    assert!(h.finish(2 * K64).is_err());
    let h = BlockHash::new(Algorithm::default_algorithm(), K64).unwrap();
    h.zeros(0, K64);
    assert!(h.finish(2 * K64).is_err());
    // Bytes given twice, in whole blocks or in parts of one.
    let h = BlockHash::new(Algorithm::default_algorithm(), K64).unwrap();
    h.zeros(0, 2 * K64);
    h.data(K64, &vec![1; K64 as usize]);
    assert!(h.finish(2 * K64).is_err());
    let h = BlockHash::new(Algorithm::default_algorithm(), K64).unwrap();
    h.data(0, &vec![1; 40_000]);
    h.zeros(30_000, K64 - 30_000);
    assert!(h.finish(K64).is_err());
}

#[test]
fn names_and_specs() {
    assert_eq!(Algorithm::find("SHA2-256").unwrap().name, "sha256");
    assert_eq!(Algorithm::find("SHA512-256").unwrap().name, "sha512-256");
    assert_eq!(Algorithm::find("BLAKE2b512").unwrap().name, "blake2b512");
    assert!(Algorithm::find("sha").is_none());
    let (a, bs) = parse_spec("").unwrap();
    assert_eq!((a.name, bs), ("sha256", K64));
    let (a, bs) = parse_spec("md5/4").unwrap();
    assert_eq!((a.name, bs), ("md5", 4));
    let (a, bs) = parse_spec("sha512/512k").unwrap();
    assert_eq!((a.name, bs), ("sha512", 512 << 10));
    assert!(parse_spec("whirlpool").is_err());
    assert!(parse_spec("sha256/3").is_err());
    assert!(parse_spec("sha256/x").is_err());
    // Every digest has the length OpenSSL gives it.
    for (name, len) in [
        ("md5", 16),
        ("sha1", 20),
        ("shake128", 16),
        ("shake256", 32),
    ] {
        assert_eq!(
            Algorithm::find(name).unwrap().digest(b"").as_bytes().len(),
            len
        );
    }
}
