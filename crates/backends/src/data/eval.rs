//! The evaluation of a data expression into pages, as nbdkit's
//! `evaluate` does it: nested expressions, repeats, slices and names are
//! evaluated into pages of their own and copied in (the copy frees pages
//! it leaves all zeros), files and scripts are read in.

use std::io::Read;
use std::process::{Command, Stdio};
use std::rc::Rc;

use diskit_core::{Error, Result};

use super::pages::Pages;
use super::parse::Expr;

/// The names assigned so far in the scopes around an expression, each
/// with the names that were there when it was assigned (its environment).
#[derive(Clone, Default)]
struct Scope(Option<Rc<Binding>>);

struct Binding {
    name: String,
    expr: Rc<Expr>,
    outer: Scope,
}

impl Scope {
    fn find(&self, name: &str) -> Option<&Binding> {
        let mut at = self.0.as_deref();
        while let Some(b) = at {
            if b.name == name {
                return Some(b);
            }
            at = b.outer.0.as_deref();
        }
        None
    }
}

/// Where the evaluation writes, and how far it has got.
struct Cursor<'a> {
    pages: &'a mut Pages,
    offset: u64,
    size: u64,
}

/// Evaluates `root` into `pages` from offset 0; returns the size the
/// expression implies (its furthest offset).
pub fn evaluate(root: &Rc<Expr>, pages: &mut Pages) -> Result<u64> {
    let mut c = Cursor {
        pages,
        offset: 0,
        size: 0,
    };
    eval(&Scope::default(), root, &mut c)?;
    Ok(c.size)
}

/// Evaluates `e` in a scope of its own into new pages: the pages and
/// their size.
fn nested(scope: &Scope, e: &Rc<Expr>) -> Result<(Pages, u64)> {
    let mut pages = Pages::new();
    let size = evaluate_in(scope, e, &mut pages)?;
    Ok((pages, size))
}

fn evaluate_in(scope: &Scope, e: &Rc<Expr>, pages: &mut Pages) -> Result<u64> {
    let mut c = Cursor {
        pages,
        offset: 0,
        size: 0,
    };
    eval(scope, e, &mut c)?;
    Ok(c.size)
}

fn eval(outer: &Scope, root: &Rc<Expr>, c: &mut Cursor<'_>) -> Result<()> {
    let mut scope = outer.clone();
    let single = [root.clone()];
    let items: &[Rc<Expr>] = match &**root {
        Expr::List(items) => items,
        _ => &single,
    };
    for item in items {
        match &**item {
            Expr::Null => {}
            Expr::Byte(b) => {
                c.pages.write(&[*b], c.offset);
                c.offset += 1;
            }
            Expr::AbsOffset(o) => c.offset = *o,
            Expr::RelOffset(d) => {
                if *d < 0 && d.unsigned_abs() > c.offset {
                    return Err(Error::invalid(format!(
                        "data parameter @-{} must not be larger than the current offset {}",
                        d.unsigned_abs(),
                        c.offset
                    )));
                }
                c.offset = c.offset.wrapping_add_signed(*d);
            }
            Expr::AlignOffset(a) => c.offset = c.offset.next_multiple_of(*a),
            Expr::File(name) => store_file(c, name, 0, -1)?,
            Expr::Script(script) => store_script(c, script, None)?,
            Expr::Bytes(s) => {
                c.pages.write(s, c.offset);
                c.offset += s.len() as u64;
            }
            Expr::Fill(b, n) => {
                c.pages.fill(*b, *n, c.offset);
                c.offset += n;
            }
            Expr::Assign(name, e) => {
                scope = Scope(Some(Rc::new(Binding {
                    name: name.clone(),
                    expr: e.clone(),
                    outer: scope.clone(),
                })));
            }
            Expr::Name(name) => {
                let b = scope
                    .find(name)
                    .ok_or_else(|| Error::invalid(format!("\\{name} not defined")))?;
                // Evaluated where it was assigned, not here.
                let (pages, size) = nested(&b.outer, &b.expr)?;
                c.pages.blit(&pages, size, 0, c.offset);
                c.offset += size;
            }
            Expr::Slice(inner, n, m) if matches!(**inner, Expr::File(_)) => {
                let Expr::File(name) = &**inner else {
                    unreachable!("matched above")
                };
                store_file(c, name, *n, *m)?;
            }
            Expr::Slice(inner, 0, m) if matches!(**inner, Expr::Script(_)) => {
                let Expr::Script(script) = &**inner else {
                    unreachable!("matched above")
                };
                store_script(c, script, Some(*m))?;
            }
            Expr::List(_) => {
                let (pages, size) = nested(&scope, item)?;
                c.pages.blit(&pages, size, 0, c.offset);
                c.offset += size;
            }
            Expr::Repeat(inner, n) => {
                let (pages, size) = nested(&scope, inner)?;
                for _ in 0..*n {
                    c.pages.blit(&pages, size, 0, c.offset);
                    c.offset += size;
                }
            }
            Expr::Slice(inner, n, m) => {
                let (pages, size) = nested(&scope, inner)?;
                let end = if *m < 0 { size } else { *m as u64 };
                if *n > size || end > size || *n > end {
                    return Err(Error::invalid("[N:M] does not describe a valid slice"));
                }
                c.pages.blit(&pages, end - n, *n, c.offset);
                c.offset += end - n;
            }
        }
        c.size = c.size.max(c.offset);
    }
    Ok(())
}

/// Reads `reader` in at the cursor, at most `limit` bytes.
fn read_in(c: &mut Cursor<'_>, reader: &mut dyn Read, limit: Option<u64>) -> std::io::Result<()> {
    let mut buf = vec![0u8; 8192];
    let mut left = limit.unwrap_or(u64::MAX);
    while left > 0 {
        let want = (buf.len() as u64).min(left) as usize;
        let n = match reader.read(&mut buf[..want]) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        c.pages.write(&buf[..n], c.offset);
        c.offset += n as u64;
        left -= n as u64;
    }
    Ok(())
}

/// `<FILE` and `<FILE[N:M]`: the file's bytes from `skip`, up to `end`
/// (-1: to the end of the file).
fn store_file(c: &mut Cursor<'_>, name: &str, skip: u64, end: i64) -> Result<()> {
    use std::io::{Seek, SeekFrom};
    if (end >= 0 && skip > end as u64) || end < -2 {
        return Err(Error::invalid("<FILE[N:M] does not describe a valid slice"));
    }
    let os = |e: std::io::Error| Error::from(e).detail();
    let mut f =
        std::fs::File::open(name).map_err(|e| Error::invalid(format!("{name}: {}", os(e))))?;
    if skip > 0 {
        f.seek(SeekFrom::Start(skip))
            .map_err(|e| Error::invalid(format!("{name}: fseek: {}", os(e))))?;
    }
    let limit = match end {
        -1 => None,
        -2 => Some(0),
        e => Some(e as u64 - skip),
    };
    read_in(c, &mut f, limit).map_err(|e| Error::io(format!("fread: {name}: {}", os(e))))
}

/// `<(SCRIPT)` (its whole output; it must succeed) and `<(SCRIPT)[:LEN]`
/// (the first LEN bytes; its exit status is not looked at, as an endless
/// generator is cut off).
fn store_script(c: &mut Cursor<'_>, script: &str, len: Option<i64>) -> Result<()> {
    let mut child = Command::new("/bin/sh")
        .arg("-c")
        .arg(script)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()
        .map_err(|e| Error::io(format!("popen: {}", Error::from(e).detail())))?;
    let mut out = child.stdout.take().expect("piped");
    let limit = len.map(|l| l.max(0) as u64);
    let read = read_in(c, &mut out, limit);
    drop(out);
    let status = child
        .wait()
        .map_err(|e| Error::io(format!("pclose: {}", Error::from(e).detail())))?;
    read.map_err(|e| Error::io(format!("fread: {}", Error::from(e).detail())))?;
    if len.is_none() && !status.success() {
        return Err(Error::io("pclose: external command failed"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::optimize::optimize;
    use super::super::parse::parse;
    use super::*;

    fn bytes(s: &str) -> Vec<u8> {
        let e = optimize(&Rc::new(parse(s, &|_| None).unwrap()));
        let mut p = Pages::new();
        let size = evaluate(&e, &mut p).unwrap();
        let mut b = vec![0u8; size as usize];
        p.read(&mut b, 0);
        b
    }

    #[test]
    fn evaluates_nbdkit_s_examples() {
        assert_eq!(bytes("0 1 2 3 @0x1fe 0x55 0xaa").len(), 512);
        assert_eq!(bytes("1 @^4 \"\\x00\""), b"\x01\0\0\0\0");
        assert_eq!(bytes("( @4 ( 0x21 )*4 )*4"), b"\0\0\0\0!!!!".repeat(4));
        assert_eq!(bytes("( \"Hello\" @^8 )*2"), b"Hello\0\0\0Hello\0\0\0");
        assert_eq!(bytes("1 (@2 2) (@3 3)"), b"\x01\0\0\x02\0\0\0\x03");
        assert_eq!(bytes("1*1000 @100 0*100")[95..205], {
            let mut v = vec![1u8; 5];
            v.extend([0u8; 100]);
            v.extend([1u8; 5]);
            v
        });
        let scoped = bytes(
            "(0x31 0x32) -> \\a (0x35 0x36) -> \\b
             ( (0x33 0x34) -> \\a (0x37 0x38) -> \\c \\a \\a \\b \\c ) \\a \\b",
        );
        assert_eq!(scoped, b"343456781256");
        let captured = bytes(
            "1 -> \\1 ( \\1 ) -> \\test \\test ( 2 -> \\1 ) \\test
             ( 3 -> \\1 \\test ) 4 -> \\1 \\test ( \\1 ) -> \\test \\test",
        );
        assert_eq!(captured, b"\x01\x01\x01\x01\x04");
        assert_eq!(
            bytes("<( i=0; while :; do printf %04d $i; i=$((i+1)); done )[:12]"),
            b"000000010002"
        );
        assert_eq!(bytes("\"Hello\"[1:3]"), b"el");
    }
}
