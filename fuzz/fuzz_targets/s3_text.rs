//! What diskit-s3 reads as text: `s3://` names, AWS credentials and
//! config files, and S3's XML answers. Any text gives a value or an
//! error, never a panic; a name's spelling reads back as the same object.
#![no_main]

use diskit_s3::{S3Name, parse_ini, xml_text};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    if let Ok(n) = S3Name::parse(&text) {
        let again = S3Name::parse(&n.to_string()).expect("its own spelling parses");
        assert_eq!(again.to_string(), n.to_string());
    }
    for (section, keys) in parse_ini(&text) {
        assert!(!section.contains('\n'), "{section}");
        for (k, v) in keys {
            assert!(!k.contains('\n') && !v.is_empty(), "{k}={v}");
        }
    }
    for tag in ["Code", "Message", "UploadId", "ETag"] {
        let _ = xml_text(&text, tag);
    }
});
