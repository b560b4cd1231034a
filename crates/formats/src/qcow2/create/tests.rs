use super::*;

fn opts(list: &str) -> Result<Qcow2CreateOptions> {
    let mut o = OptionList::new();
    o.parse_into(list)?;
    Qcow2CreateOptions::parse(&o)
}

#[test]
fn summary_follows_qemus_option_order() {
    let mut o = opts("refcount_bits=0x10,compat=0.10,cluster_size=4k,backing_file=a,,b").unwrap();
    o.set_size(1536);
    assert_eq!(
        o.summary(),
        "cluster_size=4096 extended_l2=off compression_type=zlib size=1536 compat=0.10 \
         backing_file=a,,b lazy_refcounts=off refcount_bits=16"
    );
}

#[test]
fn numbers_parse_like_strtoull() {
    assert_eq!(parse_number_opt("n", "16").unwrap(), 16);
    assert_eq!(parse_number_opt("n", " 0x10").unwrap(), 16);
    assert_eq!(parse_number_opt("n", "020").unwrap(), 16);
    assert_eq!(parse_number_opt("n", "0").unwrap(), 0);
    assert_eq!(parse_number_opt("n", "-1").unwrap(), u64::MAX);
    for bad in ["", "abc", "16k", "0x", "08", "1 "] {
        assert!(parse_number_opt("n", bad).is_err(), "{bad:?}");
    }
    assert_eq!(
        parse_number_opt("n", "99999999999999999999")
            .unwrap_err()
            .to_string(),
        "Value '99999999999999999999' is too large for parameter 'n'"
    );
}

#[test]
fn validation_messages() {
    let check = |list: &str, want: &str| {
        let mut o = opts(list).unwrap();
        o.set_size(1 << 20);
        assert_eq!(o.validate().unwrap_err().to_string(), want, "{list}");
    };
    check(
        "cluster_size=1000",
        "Cluster size must be a power of two between 512 and 2048k",
    );
    check("data_file_raw=on", "data-file-raw requires data-file");
    check(
        "compat=0.10,lazy_refcounts=on",
        "Lazy refcounts only supported with compatibility level 1.1 and above (use version=v3 or greater)",
    );
    check(
        "preallocation=nope",
        "Parameter 'preallocation' does not accept value 'nope'",
    );
    let mut o = opts("data_file=d,data_file_raw=on").unwrap();
    o.set_size(1000);
    let spec = o.validate().unwrap();
    assert_eq!(spec.prealloc, Prealloc::Metadata);
    assert_eq!(spec.size, 1024);
}

#[test]
fn odd_values_never_panic() {
    let values = [
        "",
        "0",
        "-1",
        "1e",
        "18446744073709551615",
        "9223372036854775807",
        "8E",
        "0x",
        "on",
        "off",
        "yes",
        "1.5k",
        ",",
        "\u{1F600}",
        "   ",
        "2M",
        "512",
        "64",
    ];
    for (name, _, _) in OPTIONS {
        for v in values {
            let mut list = OptionList::new();
            list.set(name, v);
            if let Ok(mut o) = Qcow2CreateOptions::parse(&list) {
                let _ = o.summary();
                if o.size.is_none() {
                    o.set_size(u64::MAX);
                }
                if let Ok(spec) = o.validate() {
                    let _ = prepare(&spec);
                }
            }
        }
    }
}
