//! An X.509 certificate's subject as a string, the way QEMU names a TLS
//! client to its authorization objects (`--tls-authz`): GnuTLS's
//! `gnutls_x509_crt_get_dn2`, which writes the relative distinguished
//! names in the certificate's order, `,` between them and `+` inside a
//! multi-valued one, attributes by their short names (`C`, `O`, `CN`,
//! `EMAIL`, ...), values escaped as RFC 4514 says, and attributes it has
//! no name for as the dotted OID with the value's DER in hex
//! (`2.5.4.97=#0c026f69`).
//!
//! The subject is read from the DER at the last moment: nothing in it is
//! trusted, and bytes that do not parse give no name at all.

use rustls::pki_types::CertificateDer;

/// The subject of the certificate `cert` (DER) as QEMU names it, or `None`
/// when the certificate or its subject does not parse.
pub fn certificate_subject(cert: &[u8]) -> Option<String> {
    let cert = CertificateDer::from(cert);
    let parsed = webpki::EndEntityCert::try_from(&cert).ok()?;
    format_name(parsed.subject())
}

/// Formats the contents of a DER `Name` (the RDN sets, without the
/// outer SEQUENCE) as GnuTLS does; `None` when it does not parse.
pub fn format_name(name: &[u8]) -> Option<String> {
    let mut out = String::new();
    let mut rdns = Der(name);
    let mut first = true;
    while !rdns.is_empty() {
        let mut set = Der(rdns.take(TAG_SET)?);
        if !first {
            out.push(',');
        }
        first = false;
        let mut first_in_set = true;
        while !set.is_empty() {
            let mut atv = Der(set.take(TAG_SEQUENCE)?);
            let oid = decode_oid(atv.take(TAG_OID)?)?;
            let (tag, value, whole) = atv.any()?;
            if !atv.is_empty() {
                return None;
            }
            if !first_in_set {
                out.push('+');
            }
            first_in_set = false;
            let text = string_types(&oid)
                .contains(&tag)
                .then(|| decode_string(tag, value))
                .flatten();
            match (short_name(&oid), text) {
                (Some(name), Some(text)) => {
                    out.push_str(name);
                    out.push('=');
                    escape_into(&text, &mut out);
                }
                (name, _) => {
                    out.push_str(name.unwrap_or(&oid));
                    out.push_str("=#");
                    for b in whole {
                        out.push_str(&format!("{b:02x}"));
                    }
                }
            }
        }
        if first_in_set {
            // An empty RDN set is not a valid name.
            return None;
        }
    }
    Some(out)
}

const TAG_OID: u8 = 0x06;
const TAG_SEQUENCE: u8 = 0x30;
const TAG_SET: u8 = 0x31;

/// A DER reader over a slice: one TLV at a time.
struct Der<'a>(&'a [u8]);

impl<'a> Der<'a> {
    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The next TLV: its tag, its contents and its whole encoding.
    fn any(&mut self) -> Option<(u8, &'a [u8], &'a [u8])> {
        let input = self.0;
        let tag = *input.first()?;
        if tag & 0x1f == 0x1f {
            return None; // high tag numbers appear in no name
        }
        let first = *input.get(1)?;
        let (len, head) = if first < 0x80 {
            (usize::from(first), 2)
        } else {
            let n = usize::from(first & 0x7f);
            if n == 0 || n > 4 {
                return None;
            }
            let bytes = input.get(2..2 + n)?;
            let len = bytes.iter().fold(0usize, |l, &b| (l << 8) | usize::from(b));
            (len, 2 + n)
        };
        let end = head.checked_add(len)?;
        let contents = input.get(head..end)?;
        self.0 = &input[end..];
        Some((tag, contents, &input[..end]))
    }

    /// The contents of the next TLV, which must have `tag`.
    fn take(&mut self, tag: u8) -> Option<&'a [u8]> {
        match self.any()? {
            (t, contents, _) if t == tag => Some(contents),
            _ => None,
        }
    }
}

/// An OBJECT IDENTIFIER's contents in dotted form.
fn decode_oid(bytes: &[u8]) -> Option<String> {
    let mut arcs: Vec<u64> = Vec::new();
    let mut value: u64 = 0;
    for (i, &b) in bytes.iter().enumerate() {
        if value > u64::MAX >> 7 {
            return None;
        }
        value = (value << 7) | u64::from(b & 0x7f);
        if b & 0x80 == 0 {
            if arcs.is_empty() {
                let first = (value / 40).min(2);
                arcs.push(first);
                arcs.push(value - first * 40);
            } else {
                arcs.push(value);
            }
            value = 0;
        } else if i + 1 == bytes.len() {
            return None;
        }
    }
    if arcs.is_empty() {
        return None;
    }
    let parts: Vec<String> = arcs.iter().map(u64::to_string).collect();
    Some(parts.join("."))
}

/// GnuTLS's short names of the attributes it knows.
fn short_name(oid: &str) -> Option<&'static str> {
    Some(match oid {
        "2.5.4.3" => "CN",
        "2.5.4.4" => "surName",
        "2.5.4.5" => "serialNumber",
        "2.5.4.6" => "C",
        "2.5.4.7" => "L",
        "2.5.4.8" => "ST",
        "2.5.4.9" => "street",
        "2.5.4.10" => "O",
        "2.5.4.11" => "OU",
        "2.5.4.12" => "title",
        "2.5.4.13" => "description",
        "2.5.4.15" => "businessCategory",
        "2.5.4.17" => "postalCode",
        "2.5.4.41" => "name",
        "2.5.4.42" => "givenName",
        "2.5.4.43" => "initials",
        "2.5.4.44" => "generationQualifier",
        "2.5.4.46" => "dnQualifier",
        "2.5.4.65" => "pseudonym",
        "0.9.2342.19200300.100.1.1" => "UID",
        "0.9.2342.19200300.100.1.25" => "DC",
        "1.2.840.113549.1.9.1" => "EMAIL",
        _ => return None,
    })
}

/// The string types GnuTLS decodes for an attribute: its ASN.1 type's
/// (PrintableString for a country, a serial number and a DN qualifier,
/// IA5String for a domain component and an e-mail address, a
/// DirectoryString for the others). A value of another type is shown in
/// hex.
fn string_types(oid: &str) -> &'static [u8] {
    const PRINTABLE: u8 = 0x13;
    const IA5: u8 = 0x16;
    match oid {
        "2.5.4.6" | "2.5.4.5" | "2.5.4.46" => &[PRINTABLE],
        "0.9.2342.19200300.100.1.25" | "1.2.840.113549.1.9.1" => &[IA5],
        // TeletexString, PrintableString, UniversalString, UTF8String,
        // BMPString.
        _ => &[0x14, PRINTABLE, 0x1c, 0x0c, 0x1e],
    }
}

/// The text of a string value, or `None` for another type.
fn decode_string(tag: u8, value: &[u8]) -> Option<String> {
    match tag {
        // UTF8String, PrintableString, TeletexString, IA5String.
        0x0c | 0x13 | 0x14 | 0x16 => std::str::from_utf8(value).ok().map(str::to_owned),
        // BMPString: UTF-16BE.
        0x1e if value.len().is_multiple_of(2) => {
            let units = value.chunks(2).map(|c| u16::from_be_bytes([c[0], c[1]]));
            char::decode_utf16(units)
                .collect::<Result<String, _>>()
                .ok()
        }
        // UniversalString: UTF-32BE.
        0x1c if value.len().is_multiple_of(4) => value
            .chunks(4)
            .map(|c| char::from_u32(u32::from_be_bytes([c[0], c[1], c[2], c[3]])))
            .collect(),
        _ => None,
    }
}

/// Appends `text` escaped as RFC 4514 (and GnuTLS) escape a value.
fn escape_into(text: &str, out: &mut String) {
    let last = text.chars().count().saturating_sub(1);
    for (i, c) in text.chars().enumerate() {
        let special = matches!(c, ',' | '+' | '"' | '\\' | '<' | '>' | ';')
            || (i == 0 && matches!(c, ' ' | '#'))
            || (i == last && c == ' ');
        if special {
            out.push('\\');
        }
        out.push(c);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An attribute of `oid` (its DER contents) with a UTF8String value.
    fn atv(oid: &[u8], value: &str) -> Vec<u8> {
        let mut v = vec![TAG_OID, oid.len() as u8];
        v.extend_from_slice(oid);
        v.extend_from_slice(&[0x0c, value.len() as u8]);
        v.extend_from_slice(value.as_bytes());
        let mut s = vec![TAG_SEQUENCE, v.len() as u8];
        s.extend(v);
        s
    }

    fn set(atvs: &[Vec<u8>]) -> Vec<u8> {
        let body: Vec<u8> = atvs.concat();
        let mut s = vec![TAG_SET, body.len() as u8];
        s.extend(body);
        s
    }

    const CN: &[u8] = &[0x55, 0x04, 0x03];
    const O: &[u8] = &[0x55, 0x04, 0x0a];
    const OU: &[u8] = &[0x55, 0x04, 0x0b];
    const ORG_ID: &[u8] = &[0x55, 0x04, 0x61];
    const C: &[u8] = &[0x55, 0x04, 0x06];

    #[test]
    fn names_are_written_in_certificate_order_and_escaped() {
        let name = [
            set(&[atv(O, "Example, Org")]),
            set(&[atv(CN, "b"), atv(OU, "a")]),
            set(&[atv(CN, " #x <y>;\"q\" ")]),
        ]
        .concat();
        assert_eq!(
            format_name(&name).unwrap(),
            "O=Example\\, Org,CN=b+OU=a,CN=\\ #x \\<y\\>\\;\\\"q\\\"\\ "
        );
        let name = set(&[atv(CN, "#lead")]);
        assert_eq!(format_name(&name).unwrap(), "CN=\\#lead");
    }

    #[test]
    fn unknown_attributes_and_unexpected_types_are_shown_in_hex() {
        let name = set(&[atv(ORG_ID, "oi")]);
        assert_eq!(format_name(&name).unwrap(), "2.5.4.97=#0c026f69");
        // A country must be a PrintableString.
        let name = set(&[atv(C, "GB")]);
        assert_eq!(format_name(&name).unwrap(), "C=#0c024742");
    }

    #[test]
    fn broken_names_give_none() {
        let good = set(&[atv(CN, "x")]);
        for cut in 1..good.len() {
            assert_eq!(format_name(&good[..cut]), None, "cut at {cut}");
        }
        assert_eq!(format_name(&[TAG_SET, 0]), None);
        assert_eq!(format_name(&[0x30, 0]), None);
        assert_eq!(format_name(&[]).as_deref(), Some(""));
    }
}
