//! A throw-away CA and a server certificate for 127.0.0.1 signed by it, for
//! tests of HTTPS clients that must trust a bundle instead of the system
//! roots.

use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};

/// A test CA and a leaf for `127.0.0.1` it signed, PEM and DER.
pub struct TestPki {
    /// The CA certificate (the bundle a client trusts), PEM.
    pub ca_pem: String,
    /// The CA certificate, DER.
    pub ca_der: Vec<u8>,
    /// The leaf certificate, PEM.
    pub leaf_pem: String,
    /// The leaf certificate, DER.
    pub leaf_der: Vec<u8>,
    /// The leaf's private key, PKCS#8 PEM.
    pub key_pem: String,
    /// The leaf's private key, PKCS#8 DER.
    pub key_der: Vec<u8>,
}

impl std::fmt::Debug for TestPki {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestPki")
            .field("ca_pem", &self.ca_pem)
            .field("leaf_pem", &self.leaf_pem)
            .field("key", &"(redacted)")
            .finish_non_exhaustive()
    }
}

/// A new CA named `common_name` and a leaf for 127.0.0.1 signed by it.
pub fn test_pki(common_name: &str) -> anyhow::Result<TestPki> {
    let ca_key = KeyPair::generate()?;
    let mut ca_params = CertificateParams::new(Vec::<String>::new())?;
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(DnType::CommonName, common_name);
    let ca_cert = ca_params.self_signed(&ca_key)?;
    let issuer = Issuer::new(ca_params, ca_key);
    let leaf_key = KeyPair::generate()?;
    let leaf =
        CertificateParams::new(vec!["127.0.0.1".to_owned()])?.signed_by(&leaf_key, &issuer)?;
    Ok(TestPki {
        ca_pem: ca_cert.pem(),
        ca_der: ca_cert.der().to_vec(),
        leaf_pem: leaf.pem(),
        leaf_der: leaf.der().to_vec(),
        key_pem: leaf_key.serialize_pem(),
        key_der: leaf_key.serialize_der(),
    })
}
