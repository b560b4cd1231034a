//! The opener's description parsers (`json:{...}` and `--image-opts`): any
//! text gives a spec or an error, never a panic, deep recursion or
//! unbounded memory; accepted specs keep only well-formed keys.
#![no_main]

use diskit_open::spec::{self, NodeKind, Spec};
use libfuzzer_sys::fuzz_target;

fn check(s: &Spec) {
    for k in s.keys() {
        assert!(!k.is_empty() && !k.split('.').any(str::is_empty), "{k:?}");
    }
    let _ = s.check_keys(NodeKind::Format, "qcow2", &["driver", "backing"], &["file"]);
    let _ = s.check_keys(NodeKind::Protocol, "nbd", &["driver", "path"], &["server"]);
    let _ = s.child("file").get("filename");
    let _ = s.qemu_json_name();
}

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(s) = spec::parse_image_opts(text) {
        check(&s);
    }
    if let Ok(s) = spec::parse_json(text) {
        check(&s);
        // QEMU's name for a description reads back as the same keys.
        let name = s.qemu_json_name();
        let again = spec::parse_json(&name["json:".len()..]).expect("its own name parses");
        assert_eq!(again, s, "{name}");
    }
    let _ = diskit_open::name_spec(text, None);
});
