//! The agent API's certificate authority, kept in Secret
//! `anneal-agent-api-ca` (keys `ca.crt`, `ca.key`) in the manager's
//! namespace: generated on first start unless the operator provided one,
//! and the issuer of a fresh serving certificate at every start (the CA
//! certificate is never the serving certificate).
//!
//! Only the manager reads that Secret (it holds the private key). The
//! certificate alone is published in ConfigMap `anneal-agent-api-ca` (key
//! `ca.crt`) of the same namespace, which bootd, `kubectl anneal import`
//! and users read: the manager creates it at every start when it is
//! absent and writes it over when its `ca.crt` differs from the Secret's
//! (the Secret is the source of truth, so an edited ConfigMap is corrected
//! at the next start).

use std::collections::BTreeMap;
use std::net::IpAddr;

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use kube::api::{Api, ObjectMeta, Patch, PatchParams, PostParams};
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, SanType,
};
use sha2::{Digest, Sha256};

/// Name of the CA Secret (certificate and private key: the manager's
/// alone).
pub const CA_SECRET: &str = "anneal-agent-api-ca";
/// Name of the ConfigMap publishing the CA certificate (key
/// [`CA_CERT_KEY`]): what bootd, the CLI and users read.
pub const CA_CONFIGMAP: &str = "anneal-agent-api-ca";
/// Field manager of the CA ConfigMap.
pub const FIELD_MANAGER: &str = "anneal-agent-api-ca";
/// Key of the CA certificate (PEM).
pub const CA_CERT_KEY: &str = "ca.crt";
/// Key of the CA private key (PEM).
pub const CA_KEY_KEY: &str = "ca.key";

/// Errors of the CA.
#[derive(Debug, thiserror::Error)]
pub enum CaError {
    /// The Secret cannot be read or created.
    #[error("cannot read or create secret {CA_SECRET}")]
    Kube(#[source] kube::Error),
    /// The Secret lacks a key or holds junk.
    #[error("secret {CA_SECRET} lacks a usable {0}")]
    Malformed(&'static str),
    /// Certificate generation failed.
    #[error("certificate generation failed")]
    Rcgen(#[source] rcgen::Error),
    /// The ConfigMap publishing the certificate cannot be written.
    #[error(
        "cannot write configmap {namespace}/{CA_CONFIGMAP} (the agent api's ca certificate): the manager needs get, create and patch on configmaps there"
    )]
    Publish {
        /// The manager's namespace.
        namespace: String,
        /// The API error.
        #[source]
        source: kube::Error,
    },
}

/// The CA and a serving certificate it issued.
#[derive(Debug, Clone)]
pub struct AgentPki {
    /// CA certificate (PEM), what bootd publishes.
    pub ca_pem: String,
    /// SHA-256 of the CA certificate (DER), lowercase hex: `anneal.ca=`.
    pub ca_sha256: String,
    /// Serving certificate chain (PEM: leaf then CA).
    pub serving_chain_pem: String,
    /// Serving key (PEM).
    pub serving_key_pem: String,
}

fn ca_params() -> Result<CertificateParams, CaError> {
    let mut p = CertificateParams::new(Vec::<String>::new()).map_err(CaError::Rcgen)?;
    p.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    p.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, "anneal agent API CA");
    p.distinguished_name = dn;
    p.not_before = rcgen::date_time_ymd(2024, 1, 1);
    p.not_after = rcgen::date_time_ymd(2099, 12, 31);
    Ok(p)
}

/// The first certificate of a PEM bundle (DER), if any parses.
pub fn first_cert(pem: &[u8]) -> Option<rustls::pki_types::CertificateDer<'static>> {
    use rustls::pki_types::pem::PemObject as _;
    rustls::pki_types::CertificateDer::pem_slice_iter(pem)
        .next()
        .and_then(Result::ok)
}

fn secret_str(s: &Secret, key: &'static str) -> Result<String, CaError> {
    s.data
        .as_ref()
        .and_then(|d| d.get(key))
        .and_then(|b| String::from_utf8(b.0.clone()).ok())
        .ok_or(CaError::Malformed(key))
}

/// Loads the CA from its Secret, creating it on first start, and issues a
/// serving certificate for `names` (DNS names or IP addresses).
pub async fn load_or_create(
    client: kube::Client,
    namespace: &str,
    names: &[String],
) -> Result<AgentPki, CaError> {
    let api = Api::<Secret>::namespaced(client.clone(), namespace);
    let secret = match api.get_opt(CA_SECRET).await.map_err(CaError::Kube)? {
        Some(s) => s,
        None => {
            let key = KeyPair::generate().map_err(CaError::Rcgen)?;
            let cert = ca_params()?.self_signed(&key).map_err(CaError::Rcgen)?;
            let mut data = BTreeMap::new();
            data.insert(CA_CERT_KEY.to_string(), ByteString(cert.pem().into_bytes()));
            data.insert(
                CA_KEY_KEY.to_string(),
                ByteString(key.serialize_pem().into_bytes()),
            );
            let s = Secret {
                metadata: ObjectMeta {
                    name: Some(CA_SECRET.into()),
                    namespace: Some(namespace.into()),
                    ..ObjectMeta::default()
                },
                data: Some(data),
                type_: Some("Opaque".into()),
                ..Secret::default()
            };
            match api.create(&PostParams::default(), &s).await {
                Ok(created) => {
                    tracing::info!(namespace, "generated the agent api ca");
                    created
                }
                // Another manager won the race: use its CA.
                Err(kube::Error::Api(e)) if e.code == 409 => {
                    api.get(CA_SECRET).await.map_err(CaError::Kube)?
                }
                Err(e) => return Err(CaError::Kube(e)),
            }
        }
    };
    let ca_pem = secret_str(&secret, CA_CERT_KEY)?;
    let ca_key = KeyPair::from_pem(&secret_str(&secret, CA_KEY_KEY)?)
        .map_err(|_| CaError::Malformed(CA_KEY_KEY))?;
    let issuer =
        Issuer::from_ca_cert_pem(&ca_pem, ca_key).map_err(|_| CaError::Malformed(CA_CERT_KEY))?;
    let ca_der = first_cert(ca_pem.as_bytes()).ok_or(CaError::Malformed(CA_CERT_KEY))?;
    let ca_sha256 = hex::encode(Sha256::digest(ca_der.as_ref()));
    publish(&client, namespace, &ca_pem)
        .await
        .map_err(|source| CaError::Publish {
            namespace: namespace.into(),
            source,
        })?;

    let leaf_key = KeyPair::generate().map_err(CaError::Rcgen)?;
    let mut leaf = CertificateParams::new(Vec::<String>::new()).map_err(CaError::Rcgen)?;
    for n in names {
        match n.parse::<IpAddr>() {
            Ok(ip) => leaf.subject_alt_names.push(SanType::IpAddress(ip)),
            Err(_) => leaf.subject_alt_names.push(SanType::DnsName(
                n.clone().try_into().map_err(CaError::Rcgen)?,
            )),
        }
    }
    leaf.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    leaf.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, "anneal agent API");
    leaf.distinguished_name = dn;
    let leaf_cert = leaf.signed_by(&leaf_key, &issuer).map_err(CaError::Rcgen)?;
    Ok(AgentPki {
        serving_chain_pem: format!("{}{}", leaf_cert.pem(), ca_pem),
        serving_key_pem: leaf_key.serialize_pem(),
        ca_pem,
        ca_sha256,
    })
}

/// The ConfigMap publishing `ca_pem` (key [`CA_CERT_KEY`]) in `namespace`.
pub fn ca_configmap(namespace: &str, ca_pem: &str) -> ConfigMap {
    ConfigMap {
        metadata: ObjectMeta {
            name: Some(CA_CONFIGMAP.into()),
            namespace: Some(namespace.into()),
            labels: Some(BTreeMap::from([(
                "app.kubernetes.io/managed-by".to_string(),
                "anneal-manager".to_string(),
            )])),
            ..ObjectMeta::default()
        },
        data: Some(BTreeMap::from([(CA_CERT_KEY.to_string(), ca_pem.into())])),
        ..ConfigMap::default()
    }
}

/// Creates ConfigMap [`CA_CONFIGMAP`] with `ca_pem` when absent, writes it
/// over when its `ca.crt` differs (a stale or edited copy); untouched when
/// it already holds `ca_pem`.
async fn publish(client: &kube::Client, namespace: &str, ca_pem: &str) -> Result<(), kube::Error> {
    let api = Api::<ConfigMap>::namespaced(client.clone(), namespace);
    let held = api.get_opt(CA_CONFIGMAP).await?;
    let current = held
        .as_ref()
        .and_then(|c| c.data.as_ref())
        .and_then(|d| d.get(CA_CERT_KEY));
    if current.map(String::as_str) == Some(ca_pem) {
        return Ok(());
    }
    let want = ca_configmap(namespace, ca_pem);
    if held.is_none() {
        match api.create(&PostParams::default(), &want).await {
            Ok(_) => {
                tracing::info!(
                    namespace,
                    configmap = CA_CONFIGMAP,
                    "published the agent api ca certificate"
                );
                return Ok(());
            }
            // another replica created it meanwhile: write ours over it
            // below (both publish the Secret's certificate)
            Err(kube::Error::Api(e)) if e.code == 409 => {}
            Err(e) => return Err(e),
        }
    } else {
        tracing::warn!(
            namespace,
            configmap = CA_CONFIGMAP,
            "the published agent api ca certificate differs from the ca secret's; writing it over"
        );
    }
    // a merge patch of `data.ca.crt` only: other keys an operator added stay
    let patch = serde_json::json!({"data": {CA_CERT_KEY: ca_pem}});
    api.patch(
        CA_CONFIGMAP,
        &PatchParams {
            field_manager: Some(FIELD_MANAGER.into()),
            ..PatchParams::default()
        },
        &Patch::Merge(&patch),
    )
    .await?;
    Ok(())
}

impl AgentPki {
    /// The rustls server configuration serving this PKI's certificate
    /// (HTTP/1.1 by ALPN): the agent API and the staged upload endpoint.
    /// `None` when the PEM does not parse.
    pub fn server_tls(&self) -> Option<rustls::ServerConfig> {
        use rustls::pki_types::pem::PemObject as _;
        let certs: Vec<_> =
            rustls::pki_types::CertificateDer::pem_slice_iter(self.serving_chain_pem.as_bytes())
                .collect::<Result<_, _>>()
                .ok()?;
        let key = rustls::pki_types::PrivateKeyDer::from_pem_slice(self.serving_key_pem.as_bytes())
            .ok()?;
        let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
        let mut tls = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .ok()?
            .with_no_client_auth()
            .with_single_cert(certs, key)
            .ok()?;
        tls.alpn_protocols = vec![b"http/1.1".to_vec()];
        Some(tls)
    }
}
