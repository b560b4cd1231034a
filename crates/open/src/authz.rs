//! QEMU's authorization objects (`--object authz-simple`, `authz-list`,
//! `authz-list-file`), which `--tls-authz=ID` names: who may use a TLS
//! server, by the identity the client's certificate proves (see
//! [`diskit_nbd::tls::dn`] for how it is written).
//!
//! - `authz-simple,id=ID,identity=NAME`: that identity only.
//! - `authz-list,id=ID,policy=deny|allow,rules.N.match=PATTERN,
//!   rules.N.policy=allow|deny,rules.N.format=exact|glob`: the first rule
//!   whose pattern matches decides, the list's policy (deny by default)
//!   when none does; glob patterns are fnmatch(3)'s.
//! - `authz-list-file,id=ID,filename=FILE[,refresh=on|off]`: the same list
//!   as a JSON object in a file (`{"rules": [...], "policy": ...}`), read
//!   again at every check unless `refresh=off` (QEMU watches it with
//!   inotify; an unreadable file refuses everyone until it is fixed).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock, RwLock};

use diskit_core::{Error, ErrorKind, Result};
use diskit_nbd::server::Authorizer;
use serde_json::{Map, Value};

/// What a rule or a list decides.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Policy {
    Allow,
    Deny,
}

/// How a rule's pattern is compared.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Format {
    Exact,
    Glob,
}

/// One rule of a list.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Rule {
    pattern: String,
    policy: Policy,
    format: Format,
}

/// An ordered list of rules and what applies when none matches.
#[derive(Debug, Clone, PartialEq, Eq)]
struct List {
    rules: Vec<Rule>,
    policy: Policy,
}

impl List {
    fn decide(&self, identity: &str) -> bool {
        let matching = self.rules.iter().find(|r| match r.format {
            Format::Exact => r.pattern == identity,
            Format::Glob => glob(&r.pattern, identity),
        });
        matching.map_or(self.policy, |r| r.policy) == Policy::Allow
    }

    /// A list from its properties (`rules`, `policy`); `at` names where
    /// they come from in messages.
    fn from_props(props: &Map<String, Value>, at: &str) -> Result<List> {
        let mut rules = Vec::new();
        match props.get("rules") {
            None | Some(Value::Null) => {}
            Some(Value::Array(items)) => {
                for (i, item) in items.iter().enumerate() {
                    let name = format!("rules.{i}");
                    let Value::Object(r) = item else {
                        return Err(invalid_type(at, &name, "object"));
                    };
                    let pattern = string(r, "match", at, &name)?
                        .ok_or_else(|| missing(at, &format!("{name}.match")))?;
                    let policy = string(r, "policy", at, &name)?
                        .ok_or_else(|| missing(at, &format!("{name}.policy")))?;
                    let format = string(r, "format", at, &name)?;
                    rules.push(Rule {
                        pattern,
                        policy: policy_value(&format!("{name}.policy"), &policy)?,
                        format: match format.as_deref() {
                            None | Some("exact") => Format::Exact,
                            Some("glob") => Format::Glob,
                            Some(other) => return Err(bad_value(&format!("{name}.format"), other)),
                        },
                    });
                }
            }
            Some(_) => return Err(invalid_type(at, "rules", "array")),
        }
        let policy = match string(props, "policy", at, "")? {
            None => Policy::Deny,
            Some(p) => policy_value("policy", &p)?,
        };
        Ok(List { rules, policy })
    }
}

/// One authorization object.
#[derive(Debug)]
enum Authz {
    Simple(String),
    List(List),
    File {
        path: PathBuf,
        refresh: bool,
        loaded: List,
    },
}

impl Authz {
    fn is_allowed(&self, identity: &str) -> Result<bool> {
        match self {
            Authz::Simple(name) => Ok(name == identity),
            Authz::List(list) => Ok(list.decide(identity)),
            Authz::File { path, refresh, .. } if *refresh => Ok(load(path)?.decide(identity)),
            Authz::File { loaded, .. } => Ok(loaded.decide(identity)),
        }
    }
}

/// The list in the JSON file at `path`.
fn load(path: &std::path::Path) -> Result<List> {
    let shown = path.display();
    let text = std::fs::read_to_string(path)
        .map_err(|e| Error::invalid(format!("Unable to read '{shown}': {e}")))?;
    let value: Value = serde_json::from_str(&text)
        .map_err(|e| Error::invalid(format!("Unable to parse '{shown}': {e}")))?;
    let Value::Object(props) = value else {
        return Err(Error::invalid(format!(
            "File '{shown}' must contain a JSON object"
        )));
    };
    List::from_props(&props, &format!("{shown}: "))
}

fn objects() -> &'static RwLock<HashMap<String, Arc<Authz>>> {
    static OBJECTS: OnceLock<RwLock<HashMap<String, Arc<Authz>>>> = OnceLock::new();
    OBJECTS.get_or_init(Default::default)
}

/// Whether `qom_type` is one of the authorization objects.
pub fn is_authz_type(qom_type: &str) -> bool {
    matches!(qom_type, "authz-simple" | "authz-list" | "authz-list-file")
}

/// Defines the authorization object of `qom_type` with the key=value
/// items of an `--object` argument (`rules.N.KEY` keys make the rules).
pub fn define_from_items(qom_type: &str, items: &[(&str, &str)]) -> Result<()> {
    let mut props = Map::new();
    let mut rules: Vec<Map<String, Value>> = Vec::new();
    for &(k, v) in items {
        if let Some(rest) = k.strip_prefix("rules.") {
            let (index, key) = rest
                .split_once('.')
                .and_then(|(i, key)| Some((i.parse::<usize>().ok()?, key)))
                .ok_or_else(|| Error::invalid(format!("Invalid parameter '{k}'")))?;
            if index > rules.len() {
                return Err(Error::invalid(format!(
                    "Parameter 'rules.{}' is missing",
                    rules.len()
                )));
            }
            if index == rules.len() {
                rules.push(Map::new());
            }
            rules[index].insert(key.to_string(), Value::String(v.to_string()));
        } else {
            props.insert(k.to_string(), Value::String(v.to_string()));
        }
    }
    if !rules.is_empty() {
        let rules = rules.into_iter().map(Value::Object).collect();
        props.insert("rules".into(), Value::Array(rules));
    }
    define(qom_type, &props)
}

/// Defines the authorization object of `qom_type` with `props` (the
/// members of a JSON `--object`, or [`define_from_items`]'s).
pub fn define(qom_type: &str, props: &Map<String, Value>) -> Result<()> {
    let allowed: &[&str] = match qom_type {
        "authz-simple" => &["id", "identity"],
        "authz-list" => &["id", "rules", "policy"],
        "authz-list-file" => &["id", "filename", "refresh"],
        _ => {
            return Err(Error::invalid(format!(
                "Invalid parameter type for 'qom-type', expected: {qom_type}"
            )));
        }
    };
    if let Some(k) = props.keys().find(|k| !allowed.contains(&k.as_str())) {
        return Err(Error::invalid(format!(
            "Property '{qom_type}.{k}' not found"
        )));
    }
    let id = string(props, "id", "", "")?.ok_or_else(|| missing("", "id"))?;
    let authz = match qom_type {
        "authz-simple" => Authz::Simple(
            string(props, "identity", "", "")?.ok_or_else(|| missing("", "identity"))?,
        ),
        "authz-list" => Authz::List(List::from_props(props, "")?),
        _ => {
            let path = PathBuf::from(
                string(props, "filename", "", "")?.ok_or_else(|| missing("", "filename"))?,
            );
            let refresh = match props.get("refresh") {
                None => true,
                Some(Value::Bool(b)) => *b,
                Some(Value::String(s)) => diskit_formats::options::bool_value("refresh", s)?,
                Some(_) => return Err(invalid_type("", "refresh", "boolean")),
            };
            let loaded = load(&path)?;
            Authz::File {
                path,
                refresh,
                loaded,
            }
        }
    };
    let mut objects = diskit_core::sync::write(objects());
    if objects.contains_key(&id) {
        return Err(Error::invalid(format!(
            "attempt to add duplicate property '{id}' to object (type 'container')"
        )));
    }
    objects.insert(id, Arc::new(authz));
    Ok(())
}

/// The authorizer `--tls-authz=ID` names. As in QEMU, the object is
/// looked up at each check: a missing one refuses every client.
pub fn authorizer(id: &str) -> Arc<dyn Authorizer> {
    Arc::new(ById(id.to_string()))
}

/// An authorization object named by its id.
struct ById(String);

impl Authorizer for ById {
    fn is_allowed(&self, identity: &str) -> Result<bool> {
        let authz = objects()
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(&self.0)
            .cloned()
            .ok_or_else(|| {
                Error::new(
                    ErrorKind::NotFound,
                    format!("Cannot find QAuthZ object ID {}", self.0),
                )
            })?;
        authz.is_allowed(identity)
    }
}

/// The string member `key` of `props` (`None` when absent); a string of
/// another type is an error naming `parent.key`.
fn string(props: &Map<String, Value>, key: &str, at: &str, parent: &str) -> Result<Option<String>> {
    match props.get(key) {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(_) => {
            let name = if parent.is_empty() {
                key.to_string()
            } else {
                format!("{parent}.{key}")
            };
            Err(invalid_type(at, &name, "string"))
        }
    }
}

fn policy_value(name: &str, v: &str) -> Result<Policy> {
    match v {
        "allow" => Ok(Policy::Allow),
        "deny" => Ok(Policy::Deny),
        other => Err(bad_value(name, other)),
    }
}

fn missing(at: &str, name: &str) -> Error {
    Error::invalid(format!("{at}Parameter '{name}' is missing"))
}

fn bad_value(name: &str, v: &str) -> Error {
    Error::invalid(format!("Parameter '{name}' does not accept value '{v}'"))
}

fn invalid_type(at: &str, name: &str, expected: &str) -> Error {
    Error::invalid(format!(
        "{at}Invalid parameter type for '{name}', expected: {expected}"
    ))
}

/// fnmatch(3) without flags, as QEMU's glob rules use it: `*` any run of
/// characters (`/` and a leading `.` included), `?` any one, `[...]` a
/// set (`!` or `^` first negates it, `a-z` ranges, `]` first is itself),
/// `\` makes the next character literal.
fn glob(pattern: &str, text: &str) -> bool {
    let p: Vec<char> = pattern.chars().collect();
    let t: Vec<char> = text.chars().collect();
    let (mut pi, mut ti) = (0, 0);
    // Where to resume after the last `*`: its pattern index and the text
    // index it has swallowed up to.
    let mut star: Option<(usize, usize)> = None;
    while ti < t.len() {
        let step = match p.get(pi) {
            Some('*') => {
                star = Some((pi + 1, ti));
                pi += 1;
                continue;
            }
            Some('?') => Some(1),
            Some('[') => match class(&p[pi..], t[ti]) {
                Some((true, len)) => Some(len),
                Some((false, _)) => None,
                // No closing bracket: '[' is an ordinary character.
                None => (t[ti] == '[').then_some(1),
            },
            Some('\\') if pi + 1 < p.len() => (p[pi + 1] == t[ti]).then_some(2),
            Some(&c) => (c == t[ti]).then_some(1),
            None => None,
        };
        match (step, star) {
            (Some(len), _) => {
                pi += len;
                ti += 1;
            }
            (None, Some((sp, st))) => {
                pi = sp;
                ti = st + 1;
                star = Some((sp, st + 1));
            }
            (None, None) => return false,
        }
    }
    p[pi..].iter().all(|&c| c == '*')
}

/// Matches `c` against the bracket expression at the start of `p`:
/// whether it matched and the expression's length, or `None` when the
/// expression is not closed.
fn class(p: &[char], c: char) -> Option<(bool, usize)> {
    let mut i = 1;
    let negate = matches!(p.get(i), Some('!' | '^'));
    if negate {
        i += 1;
    }
    let mut matched = false;
    let mut first = true;
    loop {
        let mut lo = *p.get(i)?;
        if lo == ']' && !first {
            return Some((matched != negate, i + 1));
        }
        first = false;
        if lo == '\\' {
            i += 1;
            lo = *p.get(i)?;
        }
        i += 1;
        if p.get(i) == Some(&'-') && p.get(i + 1).is_some_and(|&h| h != ']') {
            let mut hi = p[i + 1];
            i += 2;
            if hi == '\\' {
                hi = *p.get(i)?;
                i += 1;
            }
            matched |= lo <= c && c <= hi;
        } else {
            matched |= lo == c;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn globs_match_as_fnmatch_does() {
        let cases = [
            ("*", "", true),
            ("*", "a/b.c", true),
            ("C=GB*", "C=GB,O=x", true),
            ("C=GB*", "C=FR,O=x", false),
            ("*CN=client", "O=a,CN=client", true),
            ("*CN=client", "O=a,CN=client2", false),
            ("a?c", "abc", true),
            ("a?c", "ac", false),
            ("[a-c]x", "bx", true),
            ("[!a-c]x", "bx", false),
            ("[^a-c]x", "dx", true),
            ("[]]", "]", true),
            ("[a-]", "-", true),
            ("a\\*", "a*", true),
            ("a\\*", "ab", false),
            ("[ab", "[ab", true),
            ("*a*b*", "xxaxxbxx", true),
            ("*a*b", "xxaxxbxxc", false),
        ];
        for (p, t, want) in cases {
            assert_eq!(glob(p, t), want, "{p:?} against {t:?}");
        }
    }

    #[test]
    fn lists_decide_by_the_first_matching_rule() {
        define_from_items(
            "authz-list",
            &[
                ("id", "t-list"),
                ("rules.0.match", "CN=bad*"),
                ("rules.0.policy", "deny"),
                ("rules.0.format", "glob"),
                ("rules.1.match", "CN=*"),
                ("rules.1.policy", "allow"),
                ("rules.1.format", "glob"),
                ("rules.2.match", "O=x"),
                ("rules.2.policy", "allow"),
            ],
        )
        .unwrap();
        let a = authorizer("t-list");
        assert!(a.is_allowed("CN=good").unwrap());
        assert!(!a.is_allowed("CN=bad one").unwrap());
        assert!(a.is_allowed("O=x").unwrap());
        assert!(!a.is_allowed("O=y").unwrap());
        let missing = authorizer("t-none").is_allowed("CN=x").unwrap_err();
        assert_eq!(missing.to_string(), "Cannot find QAuthZ object ID t-none");
        let e = define_from_items("authz-list", &[("id", "t-2"), ("rules.1.match", "x")]);
        assert!(e.is_err());
        let e = define_from_items(
            "authz-list",
            &[
                ("id", "t-3"),
                ("rules.0.match", "x"),
                ("rules.0.policy", "maybe"),
            ],
        );
        assert_eq!(
            e.unwrap_err().to_string(),
            "Parameter 'rules.0.policy' does not accept value 'maybe'"
        );
        define_from_items("authz-simple", &[("id", "t-s"), ("identity", "CN=a")]).unwrap();
        assert!(authorizer("t-s").is_allowed("CN=a").unwrap());
        assert!(!authorizer("t-s").is_allowed("CN=b").unwrap());
    }

    #[test]
    fn list_files_are_read_again_unless_refresh_is_off() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("rules.json");
        let allow = |who: &str| {
            format!(r#"{{"rules":[{{"match":"{who}","policy":"allow"}}],"policy":"deny"}}"#)
        };
        std::fs::write(&path, allow("CN=a")).unwrap();
        let file = path.to_str().unwrap();
        define_from_items("authz-list-file", &[("id", "t-f"), ("filename", file)]).unwrap();
        define_from_items(
            "authz-list-file",
            &[("id", "t-f0"), ("filename", file), ("refresh", "off")],
        )
        .unwrap();
        assert!(authorizer("t-f").is_allowed("CN=a").unwrap());
        std::fs::write(&path, allow("CN=b")).unwrap();
        assert!(!authorizer("t-f").is_allowed("CN=a").unwrap());
        assert!(authorizer("t-f").is_allowed("CN=b").unwrap());
        assert!(authorizer("t-f0").is_allowed("CN=a").unwrap());
        std::fs::write(&path, "not json").unwrap();
        assert!(authorizer("t-f").is_allowed("CN=b").is_err());
    }
}
