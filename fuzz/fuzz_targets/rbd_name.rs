//! QEMU's `rbd:` names: any text gives a name or an error, never a panic;
//! a name's canonical spelling reads back as the same place.
#![no_main]

use diskit_rbd::RbdName;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(n) = RbdName::parse(text) {
        assert!(!n.pool.is_empty() && !n.image.is_empty());
        let again = RbdName::parse(&n.canonical()).expect("its canonical name parses");
        assert_eq!(
            (
                &again.pool,
                &again.namespace,
                &again.image,
                &again.snapshot,
                &again.conf
            ),
            (&n.pool, &n.namespace, &n.image, &n.snapshot, &n.conf),
            "{}",
            n.canonical()
        );
    }
});
