//! `--filter=NAME` for `diskit serve`, as nbdkit does it: the filters come
//! from diskit-filters; here their `key=value` parameters are picked out of
//! the plugin's arguments, and the filters are stacked over the plugin's
//! device, the first `--filter` outermost (closest to the client).

use diskit_core::DeviceRef;
use diskit_filters::{FILTERS, FilterSpec};

use super::plugin;
use crate::util::CliError;

/// The arguments after PLUGIN, sorted out.
pub struct Routed {
    /// The filters, outermost first, with their parameters.
    pub filters: Vec<FilterSpec>,
    /// What is left for the plugin.
    pub plugin_args: Vec<String>,
}

/// Sends each `key=value` whose key a filter takes to the first filter on
/// the command line that takes it (nbdkit offers every key to the
/// outermost filter first, and each passes on what it does not know); the
/// rest, bare values included, go to the plugin. A key that neither a
/// filter nor the plugin takes is an error naming it.
pub fn route(plugin: &str, filters: &[String], args: &[String]) -> Result<Routed, CliError> {
    let row = plugin::find(plugin)?;
    let mut params: Vec<Vec<(String, String)>> = vec![Vec::new(); filters.len()];
    let mut plugin_args = Vec::new();
    // Unknown filter names first: their parameters would look unknown too.
    let infos = filters
        .iter()
        .map(|name| diskit_filters::info(name).map_err(|e| CliError::new(format!("serve: {e}"))))
        .collect::<Result<Vec<_>, _>>()?;
    for a in args {
        let Some((k, v)) = a.split_once('=').filter(|(k, _)| plugin::is_key(k)) else {
            plugin_args.push(a.clone());
            continue;
        };
        if let Some(i) = infos.iter().position(|f| f.keys.contains(&k)) {
            params[i].push((k.to_string(), v.to_string()));
        } else if row.takes(k) || row.keys.is_empty() {
            // (A plugin that takes nothing says so in nbdkit's words.)
            plugin_args.push(a.clone());
        } else {
            let mut takers = vec![format!("{plugin} takes {}", row.keys.join(", "))];
            for f in &infos {
                if !f.keys.is_empty() {
                    takers.push(format!("{} filter takes {}", f.name, f.keys.join(", ")));
                }
            }
            return Err(CliError::new(format!(
                "serve: unknown parameter '{k}' ({})",
                takers.join("; ")
            )));
        }
    }
    let filters = filters
        .iter()
        .zip(&params)
        .map(|(name, p)| {
            FilterSpec::parse(name, p).map_err(|e| CliError::new(format!("serve: {e}")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Routed {
        filters,
        plugin_args,
    })
}

/// Stacks `filters` (outermost first) over the plugin's `device`.
pub fn stack(
    filters: &[FilterSpec],
    device: DeviceRef,
    read_only: bool,
) -> Result<DeviceRef, CliError> {
    diskit_filters::stack(filters, device, read_only)
        .map_err(|e| CliError::new(format!("serve: {e}")))
}

/// The filter list for --help.
pub fn help() -> String {
    let mut s =
        String::from("\nFilters (--filter=NAME, repeatable, the first closest to the client):\n");
    for f in FILTERS {
        s.push_str(&format!("  {:<10} {}\n", f.name, f.help));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn keys_go_to_the_outermost_filter_that_takes_them() {
        let r = route(
            "file",
            &strings(&["offset", "truncate", "offset"]),
            &strings(&["disk.img", "offset=1M", "truncate=5M", "range=2M", "file=x"]),
        )
        .unwrap();
        assert_eq!(r.plugin_args, strings(&["disk.img", "file=x"]));
        assert_eq!(r.filters.len(), 3);
        use diskit_filters::offset::OffsetConfig;
        let want = OffsetConfig {
            offset: 1 << 20,
            range: Some(2 << 20),
        };
        assert_eq!(r.filters[0].config::<OffsetConfig>(), Some(&want));
        assert_eq!(
            r.filters[2].config::<OffsetConfig>(),
            Some(&OffsetConfig::default())
        );
    }

    /// The message of the refusal of `filters` over plugin `plugin` with
    /// `args`.
    fn refusal(plugin: &str, filters: &[&str], args: &[&str]) -> String {
        route(plugin, &strings(filters), &strings(args))
            .err()
            .unwrap()
            .message
    }

    #[test]
    fn unknown_names_and_keys_are_named() {
        let e = refusal("memory", &["nosuch"], &["1M"]);
        assert!(e.contains("unknown filter 'nosuch'"), "{e}");
        assert!(e.contains("blocksize"), "{e}");
        let e = refusal("memory", &["offset"], &["1M", "bogus=1"]);
        assert!(e.contains("unknown parameter 'bogus'"), "{e}");
        assert!(e.contains("offset filter takes offset, range"), "{e}");
        let e = refusal("memory", &["fua"], &["1M", "fuamode=sometimes"]);
        assert!(e.contains("fuamode 'sometimes'"), "{e}");
        assert!(route("nope", &[], &[]).is_err());
    }
}
