//! Export names, listings and descriptions under nbdkit 1.32 and under
//! `diskit serve` on the same command lines: the exportname filter in each
//! of its modes, and the script plugins' `list_exports`,
//! `default_export` and `export_description`, as nbdinfo sees them
//! (`--list`, the default export, an export by name), output and failures
//! alike.

mod common;

use common::*;

/// What nbdinfo says of the server: the listing, the default export, and
/// export `b`'s size, each with its exit status (the names, descriptions,
/// sizes and errors; flags and contexts are other tests').
const LOOK: &str = r#"
nbdinfo --list --json "$uri" 2>&1; echo "list: $?"
nbdinfo --json "$uri" 2>&1; echo "default: $?"
nbdinfo --size "nbd+unix:///b?socket=$unixsocket" 2>&1; echo "b: $?"
"#;

fn normalized(out: &str) -> String {
    let fields = ["\"export-name\"", "\"description\"", "\"export-size\""];
    let statuses = ["list: ", "default: ", "b: ", "nbdinfo:"];
    out.lines()
        .filter(|l| {
            fields.iter().any(|k| l.contains(k))
                || statuses.iter().any(|k| l.starts_with(k))
                || l.parse::<u64>().is_ok()
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Both servers say the same of `args`; returns what they said.
fn alike(args: &[&str]) -> String {
    let dir = workdir();
    let [nbdkit, diskit] = SERVERS.map(|server| {
        let o = run(server, dir.path(), args, LOOK);
        normalized(&format!("{}{}", stdout(&o), stderr(&o)))
    });
    assert_eq!(nbdkit, diskit, "{args:?}");
    diskit
}

#[test]
fn exportname_filter_lists_names_and_opens_as_nbdkit_s() {
    let filter = ["--filter=exportname", "memory", "1M"];
    let cases: &[&[&str]] = &[
        &[],
        &["exportname-list=error"],
        &["exportname-list=empty"],
        &["exportname-list=defaultonly", "default-export=x"],
        &[
            "exportname-list=explicit",
            "exportname=a",
            "exportname=b",
            "exportdesc=fixed:hello",
        ],
        &["exportname-strict=true", "exportname=a"],
        &[
            "exportname-strict=true",
            "exportname=",
            "exportname=b",
            "default-export=b",
            "exportname-list=explicit",
            "exportdesc=script:echo \"about $name\"",
        ],
        &["default-export=c", "exportdesc=none"],
    ];
    for extra in cases {
        let args: Vec<&str> = filter.iter().chain(extra.iter()).copied().collect();
        let said = alike(&args);
        // Each case is seen to do something.
        match extra.first() {
            Some(&"exportname-list=error") => assert!(said.contains("list: 1"), "{said}"),
            Some(&"exportname-list=explicit") => assert!(said.contains("\"b\""), "{said}"),
            Some(&"exportname-strict=true") if extra.len() == 2 => {
                assert!(
                    said.contains("b: 1") && said.contains("default: 1"),
                    "{said}"
                )
            }
            _ => {}
        }
    }
    // -e only names the export for --run's $uri: listings show the
    // plugin's default export, "".
    let said = alike(&["-e", "foo", "memory", "1M"]);
    assert!(said.contains("\"export-name\": \"\""), "{said}");
}

/// An eval plugin that lists exports, names its default and describes each
/// export by the name it was opened with (its handle).
fn eval_exports(list: &str) -> Vec<String> {
    [
        "eval",
        "open=echo \"$3\"",
        "get_size=echo 1M",
        "pread=dd if=/dev/zero count=$3 iflag=count_bytes status=none",
        "export_description=echo \"the disk called $2\"",
        "default_export=echo b",
    ]
    .iter()
    .map(|s| s.to_string())
    .chain([format!("list_exports={list}")])
    .collect()
}

#[test]
fn script_plugins_list_describe_and_name_their_exports() {
    for list in [
        "printf 'a\\nb\\n'",
        "printf 'NAMES\\na\\nb\\nc'",
        "printf 'INTERLEAVED\\na\\nfirst\\nb\\nsecond\\n'",
        "printf 'NAMES+DESCRIPTIONS\\na\\nb\\nfirst\\nsecond\\n'",
        "exit 2",
    ] {
        let args = eval_exports(list);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let said = alike(&args);
        assert!(said.contains("the disk called b"), "{list}: {said}");
        // Under the exportname filter, descriptions kept, dropped, fixed.
        for extra in [
            "exportdesc=keep",
            "exportdesc=none",
            "exportdesc=fixed:same",
            "exportname-list=defaultonly",
        ] {
            let mut with: Vec<&str> = vec!["--filter=exportname"];
            with.extend(&args);
            with.push(extra);
            alike(&with);
        }
    }
}
