//! The ip filter (nbdkit-ip-filter): allows or denies clients by their
//! address or, on a Unix socket, their credentials.
//!
//! `allow=RULE,...` and `deny=RULE,...` (repeatable; the lists add up).
//! A client matching an allow rule is accepted; else one matching a deny
//! rule is closed before its handshake ("client not permitted to connect
//! because of source address restriction"); else it is accepted. Rules:
//! `all`/`any`, `allipv4`/`anyipv4`, `allipv6`/`anyipv6`,
//! `allunix`/`anyunix`, `A.B.C.D[/NN]`, `IPV6[/NN]`, and on Unix sockets
//! `pid:PID`, `uid:UID`, `gid:GID`. (`allvsock`, `vsock-cid:` and
//! `vsock-port:` are taken and never match: diskit serves no vsock.)
//! Clients on standard input and output are always accepted.

use std::net::IpAddr;

use diskit_core::params::nbdkit_unsigned;
use diskit_core::{BlockDevice, DeviceRef, Error, ErrorKind, Filter, Peer, Result};

use crate::registry::{Configure, over, unknown};

/// The keys the filter takes.
pub const KEYS: &[&str] = &["allow", "deny"];

/// One rule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Rule {
    /// Any client.
    Any,
    /// Any IPv4 client.
    AnyV4,
    /// Any IPv6 client.
    AnyV6,
    /// Any client on a Unix socket.
    AnyUnix,
    /// A vsock rule: never matches.
    Vsock,
    /// An address and the length of its prefix.
    Net(IpAddr, u8),
    /// A process id (Unix sockets).
    Pid(u32),
    /// A user id (Unix sockets).
    Uid(u32),
    /// A group id (Unix sockets).
    Gid(u32),
}

/// One rule of `key=`'s list.
fn rule(key: &str, item: &str) -> Result<Rule> {
    let lower = item.to_ascii_lowercase();
    let id = |what: &str, v: &str| -> Result<u32> {
        nbdkit_unsigned(what, v, u32::MAX.into())
            .map(|n| n as u32)
            .map_err(|_| Error::invalid(format!("ip: {what}: parameter out of range")))
    };
    Ok(match lower.as_str() {
        "all" | "any" => Rule::Any,
        "allipv4" | "anyipv4" => Rule::AnyV4,
        "allipv6" | "anyipv6" => Rule::AnyV6,
        "allunix" | "anyunix" => Rule::AnyUnix,
        "allvsock" | "anyvsock" => Rule::Vsock,
        _ if lower.starts_with("pid:") => Rule::Pid(id("pid", &item[4..])?),
        _ if lower.starts_with("uid:") => Rule::Uid(id("uid", &item[4..])?),
        _ if lower.starts_with("gid:") => Rule::Gid(id("gid", &item[4..])?),
        _ if lower.starts_with("vsock-cid:") => {
            id("vsock-cid", &item[10..])?;
            Rule::Vsock
        }
        _ if lower.starts_with("vsock-port:") => {
            id("vsock-port", &item[11..])?;
            Rule::Vsock
        }
        _ => {
            let (addr, prefix) = match item.split_once('/') {
                Some((a, p)) => (a, Some(p)),
                None => (item, None),
            };
            let addr: IpAddr = addr.parse().map_err(|_| {
                Error::invalid(format!("ip: don't know how to parse rule: {key}={item}"))
            })?;
            let max = if addr.is_ipv4() { 32 } else { 128 };
            let prefix = match prefix {
                None => max,
                Some(p) => p.parse::<u8>().ok().filter(|&n| n <= max).ok_or_else(|| {
                    Error::invalid(format!("ip: cannot parse prefix length in {key}={item}"))
                })?,
            };
            Rule::Net(addr, prefix)
        }
    })
}

/// Whether `addr` is in `net`/`prefix`.
fn in_net(addr: IpAddr, net: IpAddr, prefix: u8) -> bool {
    let (a, n, bits) = match (addr, net) {
        (IpAddr::V4(a), IpAddr::V4(n)) => (u32::from(a).into(), u32::from(n).into(), 32),
        (IpAddr::V6(a), IpAddr::V6(n)) => (u128::from(a), u128::from(n), 128),
        _ => return false,
    };
    if prefix == 0 {
        return true;
    }
    let shift = bits - u32::from(prefix);
    (a >> shift) == (n >> shift)
}

impl Rule {
    /// Whether `peer` matches.
    fn matches(&self, peer: &Peer) -> bool {
        match (self, peer) {
            (Rule::Any, _) => true,
            (Rule::AnyV4, Peer::Ip(a)) => a.is_ipv4(),
            (Rule::AnyV6, Peer::Ip(a)) => a.is_ipv6(),
            (Rule::AnyUnix, Peer::Unix { .. }) => true,
            (Rule::Net(net, prefix), Peer::Ip(a)) => in_net(*a, *net, *prefix),
            (Rule::Pid(want), Peer::Unix { pid, .. }) => *pid == Some(*want),
            (Rule::Uid(want), Peer::Unix { uid, .. }) => *uid == Some(*want),
            (Rule::Gid(want), Peer::Unix { gid, .. }) => *gid == Some(*want),
            _ => false,
        }
    }
}

/// The filter: its lists.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Ip {
    /// `allow=`.
    pub allow: Vec<Rule>,
    /// `deny=`.
    pub deny: Vec<Rule>,
}

impl Configure for Ip {
    fn set(&mut self, key: &str, value: &str) -> Result<()> {
        let list = match key {
            "allow" => &mut self.allow,
            "deny" => &mut self.deny,
            _ => return Err(unknown("ip", key)),
        };
        for item in value.split(',') {
            if item.is_empty() {
                return Err(Error::invalid(format!(
                    "ip: {key}: empty entry in rule list"
                )));
            }
            list.push(rule(key, item)?);
        }
        Ok(())
    }

    fn stack(&self, next: DeviceRef) -> Result<DeviceRef> {
        Ok(over(self.clone(), next))
    }
}

impl Ip {
    /// Whether `peer` may connect.
    pub fn allows(&self, peer: &Peer) -> bool {
        if matches!(peer, Peer::Other) || self.allow.iter().any(|r| r.matches(peer)) {
            return true;
        }
        !self.deny.iter().any(|r| r.matches(peer))
    }
}

impl Filter for Ip {
    fn name(&self) -> &str {
        "ip"
    }
    fn reads_unchanged(&self) -> bool {
        true
    }
    fn submits_below(&self) -> bool {
        true
    }
    fn preconnect(&self, next: &dyn BlockDevice, peer: &Peer) -> Result<()> {
        if !self.allows(peer) {
            return Err(Error::new(
                ErrorKind::PermissionDenied,
                "client not permitted to connect because of source address restriction",
            ));
        }
        next.preconnect(peer)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::kv;

    fn ip(params: &[(&str, &str)]) -> Ip {
        Ip::from_params(&kv(params)).unwrap()
    }

    #[test]
    fn allow_comes_first_then_deny_then_everyone() {
        let v4 = |s: &str| Peer::Ip(s.parse().unwrap());
        let unix = |uid| Peer::Unix {
            pid: Some(1),
            uid: Some(uid),
            gid: Some(0),
        };
        let f = ip(&[
            ("deny", "all"),
            ("allow", "127.0.0.1,10.0.0.0/8"),
            ("allow", "uid:1000"),
        ]);
        assert!(f.allows(&v4("127.0.0.1")));
        assert!(f.allows(&v4("10.20.30.40")));
        assert!(!f.allows(&v4("11.0.0.1")));
        assert!(!f.allows(&v4("::1")));
        assert!(f.allows(&unix(1000)));
        assert!(!f.allows(&unix(0)));
        let f = ip(&[("deny", "8.0.0.0/8,anyunix")]);
        assert!(!f.allows(&v4("8.8.8.8")));
        assert!(f.allows(&v4("9.8.8.8")));
        assert!(!f.allows(&unix(0)));
        let f = ip(&[("allow", "anyipv6"), ("deny", "all")]);
        assert!(f.allows(&v4("::1")) && !f.allows(&v4("127.0.0.1")));
        for bad in ["1.2.3.4/33", "nonsense", "uid:x", "1.2.3.4,,5.6.7.8"] {
            assert!(Ip::from_params(&kv(&[("deny", bad)])).is_err(), "{bad}");
        }
    }
}
