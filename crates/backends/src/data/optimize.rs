//! nbdkit's simplification of a parsed data expression (`optimize_ast`),
//! step for step: which bytes end up written, filled, zeroed or copied
//! decides which pages of the disk exist, and so its block status.

use std::rc::Rc;

use super::parse::Expr;

/// The expression simplified as nbdkit simplifies it.
pub fn optimize(e: &Rc<Expr>) -> Rc<Expr> {
    match &**e {
        Expr::List(items) => list(items),
        Expr::Assign(name, inner) => Rc::new(Expr::Assign(name.clone(), optimize(inner))),
        Expr::Repeat(_, 0) => Rc::new(Expr::Null),
        Expr::Repeat(inner, n) => repeat(optimize(inner), *n),
        Expr::Slice(inner, n, m) => {
            if *n == *m as u64 {
                return Rc::new(Expr::Null);
            }
            slice(optimize(inner), *n, *m)
        }
        Expr::Bytes(s) if s.is_empty() => Rc::new(Expr::Null),
        Expr::Bytes(s) if s.len() > 1 && s.iter().all(|&b| b == s[0]) => {
            Rc::new(Expr::Fill(s[0], s.len() as u64))
        }
        Expr::Fill(_, 0) => Rc::new(Expr::Null),
        _ => e.clone(),
    }
}

fn list(items: &[Rc<Expr>]) -> Rc<Expr> {
    let mut out: Vec<Rc<Expr>> = Vec::with_capacity(items.len());
    for item in items {
        let o = optimize(item);
        match &*o {
            Expr::Null => {}
            Expr::List(inner) if inner.iter().all(|e| safe_to_inline(e)) => {
                out.extend(inner.iter().cloned());
            }
            _ => out.push(o),
        }
    }
    let mut i = 1;
    while i < out.len() {
        if let Some(c) = combine(&out[i - 1], &out[i]) {
            out[i - 1] = Rc::new(c);
            out.remove(i);
        } else {
            i += 1;
        }
    }
    match out.len() {
        0 => Rc::new(Expr::Null),
        1 if safe_to_inline(&out[0]) => out.pop().expect("one element"),
        _ => Rc::new(Expr::List(out)),
    }
}

fn repeat(inner: Rc<Expr>, n: u64) -> Rc<Expr> {
    if n == 1 || matches!(*inner, Expr::Null) {
        return inner;
    }
    match &*inner {
        Expr::Repeat(e, m) => return Rc::new(Expr::Repeat(e.clone(), n.wrapping_mul(*m))),
        Expr::Fill(b, m) => return Rc::new(Expr::Fill(*b, n.wrapping_mul(*m))),
        Expr::Bytes(s) if n <= 4 && s.len() <= 512 => {
            return Rc::new(Expr::Bytes(s.repeat(n as usize)));
        }
        _ => {}
    }
    match single_byte(&inner) {
        Some(b) => Rc::new(Expr::Fill(b, n)),
        None => Rc::new(Expr::Repeat(inner, n)),
    }
}

fn slice(inner: Rc<Expr>, n: u64, m: i64) -> Rc<Expr> {
    let to_end = n == 0 && m == -1;
    // A piece `n..end` of a constant of `len` bytes, when the bounds are
    // valid: one byte, or a shorter constant made by `part`.
    let piece = |len: u64, byte: &dyn Fn(u64) -> u8, part: &dyn Fn(u64, u64) -> Expr| {
        let end = if m >= 0 && n <= m as u64 && m as u64 <= len {
            m as u64
        } else if m == -1 && n <= len {
            len
        } else {
            return None;
        };
        Some(Rc::new(if end - n == 1 {
            Expr::Byte(byte(n))
        } else {
            part(n, end)
        }))
    };
    let done = match &*inner {
        Expr::Null if m == 0 || to_end => Some(Rc::new(Expr::Null)),
        Expr::Byte(b) if m == 1 || to_end => Some(Rc::new(Expr::Byte(*b))),
        Expr::Bytes(s) => piece(s.len() as u64, &|i| s[i as usize], &|a, b| {
            Expr::Bytes(s[a as usize..b as usize].to_vec())
        }),
        Expr::Fill(b, len) => piece(*len, &|_| *b, &|a, e| Expr::Fill(*b, e - a)),
        _ => None,
    };
    done.unwrap_or_else(|| Rc::new(Expr::Slice(inner, n, m)))
}

/// Whether `e` keeps its meaning when its list is flattened into the
/// list around it (names and offsets are scoped).
fn safe_to_inline(e: &Expr) -> bool {
    !matches!(
        e,
        Expr::Assign(..)
            | Expr::Name(_)
            | Expr::AbsOffset(_)
            | Expr::RelOffset(_)
            | Expr::AlignOffset(_)
    )
}

/// The byte of a constant one byte long.
fn single_byte(e: &Expr) -> Option<u8> {
    match e {
        Expr::Byte(b) => Some(*b),
        Expr::List(items) if items.len() == 1 => single_byte(&items[0]),
        Expr::Bytes(s) if s.len() == 1 => Some(s[0]),
        Expr::Fill(b, 1) => Some(*b),
        Expr::Repeat(inner, 1) => single_byte(inner),
        _ => None,
    }
}

/// Two neighbouring constants as one, where nbdkit joins them.
fn combine(a: &Expr, b: &Expr) -> Option<Expr> {
    Some(match (a, b) {
        (Expr::Byte(x), Expr::Byte(y)) if x == y => Expr::Fill(*x, 2),
        (Expr::Byte(x), Expr::Byte(y)) => Expr::Bytes(vec![*x, *y]),
        (Expr::Byte(x), Expr::Bytes(s)) => Expr::Bytes([&[*x], &s[..]].concat()),
        (Expr::Byte(x), Expr::Fill(y, n)) if x == y => Expr::Fill(*x, n + 1),
        (Expr::Bytes(s), Expr::Byte(y)) => Expr::Bytes([&s[..], &[*y]].concat()),
        (Expr::Bytes(s), Expr::Bytes(t)) => Expr::Bytes([&s[..], &t[..]].concat()),
        (Expr::Fill(x, n), Expr::Byte(y)) if x == y => Expr::Fill(*x, n + 1),
        (Expr::Fill(x, n), Expr::Fill(y, m)) if x == y => Expr::Fill(*x, n + m),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::super::parse::parse;
    use super::*;

    fn opt(s: &str) -> Expr {
        (*optimize(&Rc::new(parse(s, &|_| None).unwrap()))).clone()
    }

    #[test]
    fn simplifies_as_nbdkit_does() {
        assert_eq!(opt("0 0"), Expr::Fill(0, 2));
        assert_eq!(opt("1 2 \"3\""), Expr::Bytes(b"\x01\x023".to_vec()));
        assert_eq!(opt("1*2*3"), Expr::Fill(1, 6));
        assert_eq!(opt("( ( ( 1 2 ) ) )"), Expr::Bytes(vec![1, 2]));
        assert_eq!(opt("\"foo\"*2"), Expr::Bytes(b"foofoo".to_vec()));
        assert_eq!(opt("\"Hello\"[3:]"), Expr::Bytes(b"lo".to_vec()));
        assert_eq!(opt("\"Hello\"[99:99]"), Expr::Null);
        assert_eq!(opt("() ()*2 ( () )"), Expr::Null);
        // Offsets keep their list: nothing is flattened or merged across.
        assert!(matches!(opt("1 (@2 2)"), Expr::List(ref l) if l.len() == 2));
        // A string repeated more than 4 times stays a repeat.
        assert!(matches!(opt("\"ab\"*5"), Expr::Repeat(_, 5)));
    }
}
