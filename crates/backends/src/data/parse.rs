//! The data plugin's language, parsed as nbdkit parses it (its
//! `plugins/data/format.c`): bytes, `@OFFSET`, `@+N`, `@-N`, `@^ALIGN`,
//! `le16:`/`be32:`... words, `"strings"`, `<FILE`, `<(SCRIPT)`, `( ... )`,
//! `EXPR*N`, `EXPR[N:M]`, `EXPR -> \NAME`, `\NAME`, `$VAR` and `#`
//! comments, with nbdkit's messages.

use std::rc::Rc;

use diskit_core::params::{c_integer_prefix, nbdkit_unsigned};
use diskit_core::{Error, Result};

/// An expression of the language (nbdkit's `expr_t`).
#[derive(Debug, Clone, PartialEq)]
pub enum Expr {
    /// Nothing.
    Null,
    /// Expressions in order, in a scope of their own.
    List(Vec<Rc<Expr>>),
    /// One byte.
    Byte(u8),
    /// `@OFFSET`.
    AbsOffset(u64),
    /// `@+N`, `@-N`.
    RelOffset(i64),
    /// `@^ALIGNMENT`.
    AlignOffset(u64),
    /// `<FILE`.
    File(String),
    /// `<(SCRIPT)`.
    Script(String),
    /// Bytes (strings, words).
    Bytes(Vec<u8>),
    /// A byte repeated.
    Fill(u8, u64),
    /// `\NAME`.
    Name(String),
    /// `EXPR -> \NAME`.
    Assign(String, Rc<Expr>),
    /// `EXPR*N`.
    Repeat(Rc<Expr>, u64),
    /// `EXPR[N:M]` (M is -1 for "to the end").
    Slice(Rc<Expr>, u64, i64),
}

impl Expr {
    /// Whether it holds data (offsets do not: `@0*10` is nonsense).
    pub fn is_data(&self) -> bool {
        !matches!(
            self,
            Expr::AbsOffset(_) | Expr::RelOffset(_) | Expr::AlignOffset(_)
        )
    }
}

/// Finds the value of `$VAR`: the plugin's extra parameters, then the
/// environment.
pub type Lookup<'a> = &'a dyn Fn(&str) -> Option<String>;

/// Parses `value`, the whole `data=` parameter, into its top-level list.
pub fn parse(value: &str, lookup: Lookup<'_>) -> Result<Expr> {
    let mut i = 0;
    parser(0, value.as_bytes(), &mut i, lookup)
}

fn parse_error(i: usize) -> Error {
    Error::invalid(format!("data parameter: parsing error at offset {i}"))
}

/// `sscanf("%" SCNi64 "%n")` at `s`: a C integer (blanks, sign, base
/// prefix), clamped to 64 bits signed, and the bytes it took.
fn scan_i64(s: &[u8]) -> Option<(i64, usize)> {
    let text = std::str::from_utf8(s).unwrap_or_else(|e| {
        // Only the valid prefix can hold a number.
        std::str::from_utf8(&s[..e.valid_up_to()]).unwrap_or("")
    });
    let (v, n, _) = c_integer_prefix(text)?;
    Some((v.clamp(i64::MIN as i128, i64::MAX as i128) as i64, n))
}

fn is_space(c: u8) -> bool {
    c.is_ascii_whitespace() || c == 0x0b
}

fn parser(level: usize, v: &[u8], i: &mut usize, lookup: Lookup<'_>) -> Result<Expr> {
    let len = v.len();
    let mut list: Vec<Rc<Expr>> = Vec::new();
    // The last expression, for the postfix operators, which refuse
    // offsets with `what` in their message.
    let last_data = |list: &mut Vec<Rc<Expr>>, what: &str| -> Result<Rc<Expr>> {
        match list.last() {
            None => Err(Error::invalid(format!("{what} must follow an expression"))),
            Some(e) if !e.is_data() => Err(Error::invalid(format!(
                "{what} cannot be applied to this type of expression"
            ))),
            Some(_) => Ok(list.pop().expect("checked")),
        }
    };
    while *i < len {
        match v[*i] {
            b'#' => {
                while *i < len && v[*i] != b'\n' {
                    *i += 1;
                }
            }
            b'@' => {
                *i += 1;
                if *i == len {
                    return Err(parse_error(*i));
                }
                let kind = v[*i];
                if matches!(kind, b'+' | b'-' | b'^') {
                    *i += 1;
                    if *i == len {
                        return Err(parse_error(*i));
                    }
                } else if !kind.is_ascii_digit() {
                    return Err(parse_error(*i));
                }
                let (n, used) = scan_i64(&v[*i..]).ok_or_else(|| parse_error(*i))?;
                if n < 0 {
                    return Err(Error::invalid(match kind {
                        b'+' => "data parameter after @+ must not be negative",
                        b'-' => "data parameter after @- must not be negative",
                        b'^' => "data parameter after @^ must not be negative",
                        _ => "data parameter @OFFSET must not be negative",
                    }));
                }
                if kind == b'^' && !(n as u64).is_power_of_two() {
                    return Err(Error::invalid(format!(
                        "data parameter @^{n} must be a power of 2"
                    )));
                }
                *i += used;
                list.push(Rc::new(match kind {
                    b'+' => Expr::RelOffset(n),
                    b'-' => Expr::RelOffset(-n),
                    b'^' => Expr::AlignOffset(n as u64),
                    _ => Expr::AbsOffset(n as u64),
                }));
            }
            b'(' => {
                *i += 1;
                list.push(Rc::new(parser(level + 1, v, i, lookup)?));
            }
            b')' => {
                if level < 1 {
                    return Err(Error::invalid("unmatched ')' in data string"));
                }
                *i += 1;
                return Ok(Expr::List(list));
            }
            b'*' => {
                *i += 1;
                let e = last_data(&mut list, "*N")?;
                let (n, used) =
                    scan_i64(&v[*i..]).ok_or_else(|| Error::invalid("*N not numeric"))?;
                if n < 0 {
                    return Err(Error::invalid(
                        "data parameter @OFFSET must not be negative",
                    ));
                }
                *i += used;
                list.push(Rc::new(Expr::Repeat(e, n as u64)));
            }
            b'[' => {
                *i += 1;
                let e = last_data(&mut list, "[N:M]")?;
                let (n, m, used) = slice_bounds(&v[*i..])
                    .ok_or_else(|| Error::invalid("enclosed pattern (...)[N:M] not numeric"))?;
                *i += used;
                list.push(Rc::new(Expr::Slice(e, n as u64, m)));
            }
            b'<' if v.get(*i + 1) == Some(&b'(') => {
                *i += 2;
                let flen = script_len(&v[*i..]);
                if flen == 0 {
                    return Err(parse_error(*i));
                }
                let script = String::from_utf8_lossy(&v[*i..*i + flen]).into_owned();
                *i += flen + 1;
                list.push(Rc::new(Expr::Script(script)));
            }
            b'<' => {
                *i += 1;
                let flen = v[*i..]
                    .iter()
                    .position(|c| b"*[) \t\n".contains(c))
                    .unwrap_or(len - *i);
                if flen == 0 {
                    return Err(Error::invalid("data parameter <FILE not a filename"));
                }
                let name = String::from_utf8_lossy(&v[*i..*i + flen]).into_owned();
                *i += flen;
                list.push(Rc::new(Expr::File(name)));
            }
            b'"' => {
                *i += 1;
                list.push(Rc::new(Expr::Bytes(string(v, i)?)));
            }
            b'\\' => {
                let (start, flen) = name_at(v, *i);
                if flen == 0 {
                    return Err(parse_error(start));
                }
                *i = start + flen;
                let name = String::from_utf8_lossy(&v[start..*i]).into_owned();
                list.push(Rc::new(Expr::Name(name)));
            }
            b'-' => {
                *i += 1;
                if v.get(*i) != Some(&b'>') {
                    return Err(parse_error(*i));
                }
                *i += 1;
                let e = last_data(&mut list, "->")?;
                let (start, flen) = name_at(v, *i);
                if flen == 0 {
                    return Err(parse_error(start));
                }
                *i = start + flen;
                let name = String::from_utf8_lossy(&v[start..*i]).into_owned();
                list.push(Rc::new(Expr::Assign(name, e)));
            }
            b'$' => {
                let (start, flen) = var_at(v, *i);
                if flen == 0 {
                    return Err(parse_error(start));
                }
                *i = start + flen;
                let name = String::from_utf8_lossy(&v[start..*i]).into_owned();
                let content = lookup(&name)
                    .ok_or_else(|| Error::invalid(format!("${name}: variable not found")))?;
                let mut ci = 0;
                list.push(Rc::new(parser(0, content.as_bytes(), &mut ci, lookup)?));
            }
            b'0'..=b'9' => {
                let (n, used) = scan_i64(&v[*i..]).ok_or_else(|| parse_error(*i))?;
                // `%i` into an int: the value truncated to 32 bits.
                let j = n as i32;
                if !(0..=255).contains(&j) {
                    return Err(Error::invalid(
                        "data parameter BYTE must be in the range 0..255",
                    ));
                }
                *i += used;
                list.push(Rc::new(Expr::Byte(j as u8)));
            }
            b'l' | b'b' => list.push(Rc::new(Expr::Bytes(word(v, i)?))),
            c if is_space(c) => *i += 1,
            _ => return Err(parse_error(*i)),
        }
    }
    if level > 0 {
        return Err(Error::invalid("unmatched '(' in data string"));
    }
    Ok(Expr::List(list))
}

/// The bounds of `[N:M]` after the `[`: `N:M]`, `:M]`, `N:]` or `:]`
/// (N 0 and M -1 when left out), and the bytes they take.
fn slice_bounds(s: &[u8]) -> Option<(i64, i64, usize)> {
    let int_then = |at: usize, c: u8| -> Option<(i64, usize)> {
        let (n, used) = scan_i64(&s[at..])?;
        (s.get(at + used) == Some(&c)).then_some((n, at + used + 1))
    };
    if let Some((n, at)) = int_then(0, b':') {
        if let Some((m, end)) = int_then(at, b']') {
            return Some((n, m, end));
        }
        if s.get(at) == Some(&b']') {
            return Some((n, -1, at + 1));
        }
        return None;
    }
    if s.first() == Some(&b':') {
        if let Some((m, end)) = int_then(1, b']') {
            return Some((0, m, end));
        }
        if s.get(1) == Some(&b']') {
            return Some((0, -1, 2));
        }
    }
    None
}

/// The length of a `<(SCRIPT)`'s script: up to its unmatched `)`, 0 if
/// there is none.
fn script_len(s: &[u8]) -> usize {
    let mut depth = 0usize;
    for (n, &c) in s.iter().enumerate() {
        match c {
            b'(' => depth += 1,
            b')' if depth > 0 => depth -= 1,
            b')' => return n,
            _ => {}
        }
    }
    0
}

/// The word after `sigil` at or after blanks from `i`, as nbdkit's
/// `get_name` (`\NAME`) and `get_var` (`$VAR`) find it: where the parse
/// goes on (after the sigil once there is one: an error is reported
/// there) and the word's length, 0 for none. A word starts with a byte
/// `first` takes and goes on with bytes `rest` takes.
fn word_after(
    v: &[u8],
    mut i: usize,
    sigil: u8,
    first: fn(u8) -> bool,
    rest: fn(u8) -> bool,
) -> (usize, usize) {
    let from = i;
    while i < v.len() && is_space(v[i]) {
        i += 1;
    }
    if v.get(i) != Some(&sigil) || i + 1 >= v.len() {
        return (from, 0);
    }
    let start = i + 1;
    if !first(v[start]) {
        return (start, 0);
    }
    (start, v[start..].iter().take_while(|c| rest(**c)).count())
}

/// A `\NAME`: letters, digits, `_` and `-`.
fn name_at(v: &[u8], i: usize) -> (usize, usize) {
    let name = |c: u8| c.is_ascii_alphanumeric() || c == b'_' || c == b'-';
    word_after(v, i, b'\\', name, name)
}

/// A `$VAR`: a letter or `_`, then letters, digits or `_`.
fn var_at(v: &[u8], i: usize) -> (usize, usize) {
    word_after(
        v,
        i,
        b'$',
        |c| c.is_ascii_alphabetic() || c == b'_',
        |c| c.is_ascii_alphanumeric() || c == b'_',
    )
}

/// A `"string"` with C's escapes, from after its opening quote.
fn string(v: &[u8], i: &mut usize) -> Result<Vec<u8>> {
    let unterminated = || Error::invalid("data parameter: unterminated string");
    let mut out = Vec::new();
    while *i < v.len() {
        let mut c = v[*i];
        match c {
            b'"' => {
                *i += 1;
                return Ok(out);
            }
            b'\\' => {
                *i += 1;
                c = *v.get(*i).ok_or_else(unterminated)?;
                c = match c {
                    b'a' => 0x07,
                    b'b' => 0x08,
                    b'f' => 0x0c,
                    b'n' => 0x0a,
                    b'r' => 0x0d,
                    b't' => 0x09,
                    b'v' => 0x0b,
                    b'x' => {
                        let x0 = *v.get(*i + 1).ok_or_else(unterminated)?;
                        let x1 = *v.get(*i + 2).ok_or_else(unterminated)?;
                        *i += 2;
                        let hex = |d: u8| (d as char).to_digit(16);
                        match (hex(x0), hex(x1)) {
                            (Some(a), Some(b)) => (a * 16 + b) as u8,
                            _ => {
                                return Err(Error::invalid(
                                    "data: \\xNN must be followed by exactly two hexadecimal characters",
                                ));
                            }
                        }
                    }
                    b'0'..=b'9' | b'u' => {
                        return Err(Error::invalid(
                            "data: string numeric and unicode sequences are not yet implemented",
                        ));
                    }
                    other => other,
                };
                out.push(c);
            }
            _ => out.push(c),
        }
        *i += 1;
    }
    Err(unterminated())
}

/// A `le16:`, `be32:`, ... word: the token up to the next blank.
fn word(v: &[u8], i: &mut usize) -> Result<Vec<u8>> {
    let start = *i;
    while *i < v.len() && !is_space(v[*i]) {
        *i += 1;
    }
    let token = String::from_utf8_lossy(&v[start..*i]).into_owned();
    let (little, bytes) = match token.get(..5) {
        Some("le16:") => (true, 2),
        Some("le32:") => (true, 4),
        Some("le64:") => (true, 8),
        Some("be16:") => (false, 2),
        Some("be32:") => (false, 4),
        Some("be64:") => (false, 8),
        _ => {
            return Err(Error::invalid(format!(
                "data parameter: expected \"le16/32/64:\" or \"be16/32/64:\" at offset {}",
                *i
            )));
        }
    };
    let max = if bytes == 8 {
        u64::MAX
    } else {
        (1u64 << (8 * bytes)) - 1
    };
    let n = nbdkit_unsigned("data", &token[5..], max)?;
    Ok(if little {
        n.to_le_bytes()[..bytes].to_vec()
    } else {
        n.to_be_bytes()[8 - bytes..].to_vec()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(s: &str) -> Result<Expr> {
        parse(s, &|name| (name == "pat").then(|| "1 2".to_string()))
    }

    fn list(items: Vec<Expr>) -> Expr {
        Expr::List(items.into_iter().map(Rc::new).collect())
    }

    #[test]
    fn parses_nbdkit_s_forms() {
        use Expr::*;
        assert_eq!(
            p("0 1 @0x1fe 0x55 017 @+2 @-1 @^8").unwrap(),
            list(vec![
                Byte(0),
                Byte(1),
                AbsOffset(0x1fe),
                Byte(0x55),
                Byte(15),
                RelOffset(2),
                RelOffset(-1),
                AlignOffset(8)
            ])
        );
        assert_eq!(
            p("le16:0xaa55 be32:1").unwrap(),
            list(vec![Bytes(vec![0x55, 0xaa]), Bytes(vec![0, 0, 0, 1])])
        );
        assert_eq!(
            p(r#""a\x01\n" # c"#).unwrap(),
            list(vec![Bytes(b"a\x01\n".to_vec())])
        );
        assert_eq!(
            p("( 1 )*3 \"ab\"[1:] <f -> \\x \\x $pat").unwrap(),
            list(vec![
                Repeat(Rc::new(list(vec![Byte(1)])), 3),
                Slice(Rc::new(Bytes(b"ab".to_vec())), 1, -1),
                Assign("x".into(), Rc::new(File("f".into()))),
                Name("x".into()),
                list(vec![Byte(1), Byte(2)]),
            ])
        );
        assert_eq!(
            p("<(echo (hi)) ").unwrap(),
            list(vec![Script("echo (hi)".into())])
        );
    }

    #[test]
    fn refuses_with_nbdkit_s_messages() {
        let e = |s: &str| p(s).unwrap_err().to_string();
        assert!(e("256").contains("BYTE must be in the range 0..255"));
        assert!(e("( 1").contains("unmatched '('"));
        assert!(e("1 )").contains("unmatched ')'"));
        assert!(e("@0*2").contains("cannot be applied"));
        assert!(e("*2").contains("must follow an expression"));
        assert!(e("@^3").contains("must be a power of 2"));
        assert!(e("\"abc").contains("unterminated string"));
        assert!(e("$nope").contains("$nope: variable not found"));
        assert!(e("x").contains("parsing error at offset 0"));
        assert!(e("le16:0x10000").contains("out of range"));
        assert!(e("lx:1").contains("expected \"le16/32/64:\""));
        assert!(e("1[a]").contains("not numeric"));
    }
}
