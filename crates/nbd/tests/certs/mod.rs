//! Test certificates, made with rcgen: a CA, a server certificate for
//! "localhost", and a client certificate, written to a directory in the
//! layout nbdkit, qemu and libnbd share (ca-cert.pem, server-cert.pem,
//! server-key.pem, client-cert.pem, client-key.pem).

#![allow(dead_code)]

use std::path::Path;

pub use rcgen::DnType;

use rcgen::{
    BasicConstraints, CertificateParams, CertificateRevocationListParams, DistinguishedName,
    ExtendedKeyUsagePurpose, IsCa, Issuer, KeyIdMethod, KeyPair, KeyUsagePurpose,
    RevokedCertParams, SerialNumber, date_time_ymd,
};

fn params(cn: &str, sans: Vec<String>) -> CertificateParams {
    let mut p = CertificateParams::new(sans).expect("valid names");
    p.distinguished_name.push(DnType::CommonName, cn);
    p.not_before = date_time_ymd(2020, 1, 1);
    p.not_after = date_time_ymd(2099, 12, 31);
    p
}

/// The serial number of the "server" or "client" certificates.
fn serial(prefix: &str) -> u64 {
    if prefix == "server" { 0x5e4e } else { 0xc11e }
}

fn write(dir: &Path, name: &str, pem: String) {
    std::fs::write(dir.join(name), pem).expect("write a PEM file");
}

/// A CA that signs server and client certificates.
pub struct Ca {
    issuer: Issuer<'static, KeyPair>,
    pem: String,
}

impl Ca {
    /// A new self-signed CA.
    pub fn new(name: &str) -> Ca {
        let mut p = params(name, Vec::new());
        p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        p.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
        ];
        let key = KeyPair::generate().expect("generate a key");
        let pem = p.self_signed(&key).expect("self-sign").pem();
        Ca {
            issuer: Issuer::new(p, key),
            pem,
        }
    }

    /// The CA certificate in PEM.
    pub fn pem(&self) -> &str {
        &self.pem
    }

    /// Writes `PREFIX-cert.pem` and `PREFIX-key.pem` ("server" or
    /// "client") into `dir`, signed by this CA.
    pub fn leaf(&self, dir: &Path, prefix: &str) {
        self.leaf_with_subject(dir, prefix, &[]);
    }

    /// As [`Ca::leaf`], with `subject` (attributes in this order) before
    /// the common name "diskit test PREFIX".
    pub fn leaf_with_subject(&self, dir: &Path, prefix: &str, subject: &[(DnType, &str)]) {
        let server = prefix == "server";
        let sans = if server {
            vec!["localhost".into(), "127.0.0.1".into()]
        } else {
            Vec::new()
        };
        let mut p = CertificateParams::new(sans).expect("valid names");
        p.distinguished_name = DistinguishedName::new();
        for (t, v) in subject {
            p.distinguished_name.push(t.clone(), *v);
        }
        p.distinguished_name
            .push(DnType::CommonName, format!("diskit test {prefix}"));
        p.not_before = date_time_ymd(2020, 1, 1);
        p.not_after = date_time_ymd(2099, 12, 31);
        p.use_authority_key_identifier_extension = true;
        p.serial_number = Some(SerialNumber::from(serial(prefix)));
        // qemu insists on both usages for non-CA certificates.
        p.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        p.extended_key_usages = vec![if server {
            ExtendedKeyUsagePurpose::ServerAuth
        } else {
            ExtendedKeyUsagePurpose::ClientAuth
        }];
        let key = KeyPair::generate().expect("generate a key");
        let cert = p.signed_by(&key, &self.issuer).expect("sign");
        write(dir, &format!("{prefix}-cert.pem"), cert.pem());
        write(dir, &format!("{prefix}-key.pem"), key.serialize_pem());
    }
}

impl Ca {
    /// Writes `ca-crl.pem` into `dir`: this CA's list revoking the
    /// certificates of `prefixes` ("server", "client").
    pub fn revoke(&self, dir: &Path, prefixes: &[&str]) {
        let crl = CertificateRevocationListParams {
            this_update: date_time_ymd(2021, 1, 1),
            next_update: date_time_ymd(2099, 1, 1),
            crl_number: SerialNumber::from(1u64),
            issuing_distribution_point: None,
            revoked_certs: prefixes
                .iter()
                .map(|p| RevokedCertParams {
                    serial_number: SerialNumber::from(serial(p)),
                    revocation_time: date_time_ymd(2021, 1, 1),
                    reason_code: None,
                    invalidity_date: None,
                })
                .collect(),
            key_identifier_method: KeyIdMethod::Sha256,
        };
        let pem = crl.signed_by(&self.issuer).expect("sign a CRL").pem();
        write(dir, "ca-crl.pem", pem.expect("a CRL in PEM"));
    }
}

/// Fills `dir` with a CA, a server and a client certificate; returns the CA.
pub fn generate(dir: &Path) -> Ca {
    let ca = Ca::new("diskit test CA");
    write(dir, "ca-cert.pem", ca.pem().to_string());
    ca.leaf(dir, "server");
    ca.leaf(dir, "client");
    ca
}
