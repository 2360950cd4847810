//! Redfish driver: service root discovery, the ComputerSystem, its
//! PowerState, `ComputerSystem.Reset`, one-time boot overrides, and the
//! classification of every failure into a `BMCReachable` reason with its
//! retry cadence (docs/api.md).
//!
//! Transport is hyper 1 over rustls 0.23 with ring, one connection per
//! request. `redfish://` is HTTPS (verified against the system roots or a
//! CA bundle, or not at all with insecure-skip-verify), `redfish+http://` is
//! plain HTTP for labs. `ipmi://` addresses parse here too (one address
//! grammar); their driver is [`crate::ipmi`].

pub mod http;

use std::sync::Arc;
use std::time::Duration;

use anneal_api::agent::Token;
use anneal_api::conditions::reasons;
use hyper::{Method, StatusCode};
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::sync::OnceCell;

pub use http::{Endpoint, TransportError};

/// The `BMCReachable=False` reasons of docs/api.md.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BmcReason {
    /// Connection refused/reset, no route, DNS, timeout, 502/503/504.
    BmcUnreachable,
    /// The credentials Secret is missing or lacks `username`/`password`.
    CredentialsMissing,
    /// The BMC answered 401/403.
    CredentialsRejected,
    /// The credentials Secret lists the addresses it may be sent to and the
    /// Machine's BMC is not one of them: nothing is sent.
    CredentialsNotAuthorized,
    /// `insecureSkipVerify` together with `caBundleSecretRef`, or a CA bundle
    /// that cannot be used.
    TlsConfigConflict,
    /// Anything else: unexpected answers, TLS verification failures, an
    /// unsupported scheme, no ComputerSystem.
    QueryFailed,
    /// A Secret reference names another namespace than the Machine's: it
    /// is never read.
    CrossNamespaceSecret,
    /// `redfish+http://` while the manager runs without
    /// `--allow-insecure-bmc`: no request is sent.
    InsecureBmcRefused,
}

impl BmcReason {
    /// The condition reason string.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::BmcUnreachable => reasons::BMC_UNREACHABLE,
            Self::CredentialsMissing => reasons::CREDENTIALS_MISSING,
            Self::CredentialsRejected => reasons::CREDENTIALS_REJECTED,
            Self::CredentialsNotAuthorized => reasons::CREDENTIALS_NOT_AUTHORIZED,
            Self::TlsConfigConflict => reasons::TLS_CONFIG_CONFLICT,
            Self::QueryFailed => reasons::QUERY_FAILED,
            Self::CrossNamespaceSecret => reasons::CROSS_NAMESPACE_SECRET,
            Self::InsecureBmcRefused => reasons::INSECURE_BMC_REFUSED,
        }
    }

    /// When to try again after `attempt` consecutive failures (1-based):
    /// unreachable every 15 s flat; rejected credentials and TLS conflicts
    /// every 5 min, like a refused Secret reference or plain HTTP (only an
    /// edit fixes those, and an edit retries at once); anything else
    /// exponential from 5 s, capped at 30 min.
    pub fn retry_after(self, attempt: u32) -> Duration {
        match self {
            Self::BmcUnreachable => Duration::from_secs(15),
            Self::CredentialsRejected
            | Self::CredentialsNotAuthorized
            | Self::TlsConfigConflict
            | Self::CrossNamespaceSecret
            | Self::InsecureBmcRefused => Duration::from_secs(300),
            Self::CredentialsMissing | Self::QueryFailed => {
                let exp = attempt.saturating_sub(1).min(16);
                Duration::from_secs(5u64.saturating_mul(1u64 << exp).min(1800))
            }
        }
    }
}

/// Errors of the Redfish driver.
#[derive(Debug, thiserror::Error)]
pub enum RedfishError {
    /// A scheme with no driver.
    #[error("bmc scheme {0:?} is not supported (use redfish://, redfish+http:// or ipmi://)")]
    UnsupportedScheme(String),
    /// The address does not parse.
    #[error("invalid bmc address: {0}")]
    InvalidAddress(String),
    /// The CA bundle holds no usable certificate.
    #[error("ca bundle holds no usable certificate")]
    CaBundle,
    /// The TLS configuration cannot be built.
    #[error("cannot build tls configuration")]
    TlsConfig(#[source] rustls::Error),
    /// The exchange failed below HTTP.
    #[error("request {method} {path} failed")]
    Transport {
        /// method
        method: Method,
        /// path
        path: String,
        /// cause
        #[source]
        source: TransportError,
    },
    /// The BMC answered an unexpected status.
    #[error("{method} {path} answered {status}")]
    Status {
        /// method
        method: Method,
        /// path
        path: String,
        /// status
        status: StatusCode,
    },
    /// The body does not parse.
    #[error("cannot decode the answer to GET {path}")]
    Decode {
        /// path
        path: String,
        /// cause
        #[source]
        source: serde_json::Error,
    },
    /// The service has no ComputerSystem (or several and none was named).
    #[error("no computer system found at {0}")]
    NoSystem(String),
    /// A field is missing from a resource.
    #[error("{resource} lacks {field}")]
    Missing {
        /// resource path
        resource: String,
        /// field
        field: &'static str,
    },
}

impl RedfishError {
    /// The `BMCReachable` reason of this failure.
    pub fn reason(&self) -> BmcReason {
        match self {
            Self::Transport { source, .. } => match source {
                TransportError::Connect { .. } | TransportError::Timeout { .. } => {
                    BmcReason::BmcUnreachable
                }
                // A connection closed or reset before an answer is a BMC
                // going away; an answer that is not HTTP is a query failure.
                TransportError::Http(e) if !e.is_parse() && !e.is_user() => {
                    BmcReason::BmcUnreachable
                }
                _ => BmcReason::QueryFailed,
            },
            Self::Status { status, .. } => match status.as_u16() {
                401 | 403 => BmcReason::CredentialsRejected,
                502..=504 => BmcReason::BmcUnreachable,
                _ => BmcReason::QueryFailed,
            },
            Self::CaBundle | Self::TlsConfig(_) => BmcReason::TlsConfigConflict,
            _ => BmcReason::QueryFailed,
        }
    }
}

/// The transport a scheme selects.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scheme {
    /// `redfish://`: HTTPS.
    Https,
    /// `redfish+http://`: plain HTTP (labs).
    Http,
    /// `ipmi://`: IPMI 2.0 RMCP+ over UDP (docs/lifecycle.md, "BMC access and
    /// failures").
    Ipmi,
}

/// A parsed `spec.bmc.address`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BmcAddress {
    /// Transport.
    pub scheme: Scheme,
    /// Host (no brackets).
    pub host: String,
    /// Port (443/80/623 by default).
    pub port: u16,
    /// A ComputerSystem path given in the address
    /// (`redfish://bmc/redfish/v1/Systems/1`), else discovered.
    pub system_path: Option<String>,
}

impl BmcAddress {
    /// Parses `redfish://host[:port][/redfish/v1/Systems/ID]`,
    /// `redfish+http://…` or `ipmi://host[:port]` (no path).
    pub fn parse(address: &str) -> Result<Self, RedfishError> {
        let (scheme, rest) = address
            .split_once("://")
            .ok_or_else(|| RedfishError::InvalidAddress("no scheme".into()))?;
        let scheme = match scheme {
            "redfish" | "redfish+https" => Scheme::Https,
            "redfish+http" => Scheme::Http,
            "ipmi" => Scheme::Ipmi,
            other => return Err(RedfishError::UnsupportedScheme(other.to_string())),
        };
        let (authority, path) = match rest.find('/') {
            Some(i) => rest.split_at(i),
            None => (rest, ""),
        };
        if authority.is_empty() || authority.contains('@') {
            return Err(RedfishError::InvalidAddress(
                "missing host (credentials belong in the Secret)".into(),
            ));
        }
        let default_port = match scheme {
            Scheme::Https => 443,
            Scheme::Http => 80,
            Scheme::Ipmi => crate::ipmi::DEFAULT_PORT,
        };
        let (host, port) = if let Some(v6) = authority.strip_prefix('[') {
            let (h, after) = v6
                .split_once(']')
                .ok_or_else(|| RedfishError::InvalidAddress("unclosed [".into()))?;
            let port = match after.strip_prefix(':') {
                Some(p) => parse_port(p)?,
                None if after.is_empty() => default_port,
                None => return Err(RedfishError::InvalidAddress("junk after ]".into())),
            };
            (h.to_string(), port)
        } else {
            match authority.rsplit_once(':') {
                Some((h, p)) => (h.to_string(), parse_port(p)?),
                None => (authority.to_string(), default_port),
            }
        };
        let path = path.trim_end_matches('/');
        if scheme == Scheme::Ipmi && !path.is_empty() {
            return Err(RedfishError::InvalidAddress(format!(
                "ipmi:// takes no path (got {path:?}): use ipmi://host[:port]"
            )));
        }
        let system_path = if path.is_empty() || path == "/redfish/v1" {
            None
        } else if path.starts_with("/redfish/v1/Systems/") {
            Some(path.to_string())
        } else {
            return Err(RedfishError::InvalidAddress(format!(
                "path {path:?} is not a /redfish/v1/Systems/ID"
            )));
        };
        Ok(Self {
            scheme,
            host,
            port,
            system_path,
        })
    }
}

fn parse_port(p: &str) -> Result<u16, RedfishError> {
    p.parse()
        .map_err(|_| RedfishError::InvalidAddress(format!("bad port {p:?}")))
}

/// How the BMC's certificate is checked.
#[derive(Debug, Clone)]
pub enum TlsPolicy {
    /// Against the system trust store.
    SystemRoots,
    /// Against this PEM CA bundle only.
    CaBundle(Vec<u8>),
    /// Not at all (labs).
    InsecureSkipVerify,
}

/// BMC credentials (the password is a redacting, zeroizing [`Token`]).
#[derive(Debug, Clone)]
pub struct Credentials {
    /// User name.
    pub username: String,
    /// Password.
    pub password: Token,
}

/// PowerState of a ComputerSystem.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub enum PowerState {
    /// On.
    On,
    /// Off.
    Off,
    /// Transitioning on.
    PoweringOn,
    /// Transitioning off.
    PoweringOff,
    /// Paused (counts as on).
    Paused,
}

impl PowerState {
    /// True for On, PoweringOn and Paused.
    pub fn is_on(self) -> bool {
        matches!(self, Self::On | Self::PoweringOn | Self::Paused)
    }
}

/// `ComputerSystem.Reset` types anneal uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResetType {
    /// Power on.
    On,
    /// Cut power.
    ForceOff,
    /// ACPI shutdown.
    GracefulShutdown,
    /// Hard reset.
    ForceRestart,
    /// ACPI reboot.
    GracefulRestart,
}

impl ResetType {
    /// The Redfish string.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::On => "On",
            Self::ForceOff => "ForceOff",
            Self::GracefulShutdown => "GracefulShutdown",
            Self::ForceRestart => "ForceRestart",
            Self::GracefulRestart => "GracefulRestart",
        }
    }
}

/// A one-time boot override target.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BootTarget {
    /// PXE (network, TFTP).
    Pxe,
    /// UEFI HTTP boot.
    UefiHttp,
    /// The local disk.
    Hdd,
}

impl BootTarget {
    /// The Redfish string.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pxe => "Pxe",
            Self::UefiHttp => "UefiHttp",
            Self::Hdd => "Hdd",
        }
    }
}

/// What the driver read from the ComputerSystem.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SystemSummary {
    /// Its path.
    pub path: String,
    /// Its Id.
    pub id: String,
    /// PowerState.
    pub power_state: PowerState,
    /// `Boot.BootSourceOverrideEnabled` (Disabled, Once, Continuous).
    pub override_enabled: Option<String>,
    /// `Boot.BootSourceOverrideTarget`.
    pub override_target: Option<String>,
    /// Allowed override targets (empty when the BMC does not say).
    pub allowed_targets: Vec<String>,
    /// The Reset action target.
    pub reset_target: String,
}

impl SystemSummary {
    /// Whether the BMC offers UEFI HTTP boot.
    pub fn offers_http_boot(&self) -> bool {
        self.allowed_targets.iter().any(|t| t == "UefiHttp")
    }
}

/// How a graceful shutdown ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShutdownOutcome {
    /// Already off: nothing was sent.
    AlreadyOff,
    /// The OS shut down in time.
    Graceful,
    /// The timeout passed and ForceOff was sent.
    Forced,
}

/// A Redfish client for one BMC.
pub struct RedfishClient {
    endpoint: Endpoint,
    authorization: Token,
    system_path: OnceCell<String>,
    fixed_system: Option<String>,
}

impl std::fmt::Debug for RedfishClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedfishClient")
            .field("endpoint", &self.endpoint)
            .field("system", &self.system_path.get())
            .finish_non_exhaustive()
    }
}

#[derive(Deserialize)]
struct OdataRef {
    #[serde(rename = "@odata.id")]
    id: String,
}

/// Builds the rustls client configuration for a policy (ring provider).
pub fn tls_config(policy: &TlsPolicy) -> Result<Arc<rustls::ClientConfig>, RedfishError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(RedfishError::TlsConfig)?;
    let cfg = match policy {
        TlsPolicy::InsecureSkipVerify => builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(NoVerify(provider)))
            .with_no_client_auth(),
        TlsPolicy::CaBundle(pem) => {
            let mut roots = rustls::RootCertStore::empty();
            use rustls::pki_types::pem::PemObject as _;
            for cert in rustls::pki_types::CertificateDer::pem_slice_iter(pem).flatten() {
                let _ = roots.add(cert);
            }
            if roots.is_empty() {
                return Err(RedfishError::CaBundle);
            }
            builder.with_root_certificates(roots).with_no_client_auth()
        }
        TlsPolicy::SystemRoots => {
            let mut roots = rustls::RootCertStore::empty();
            for cert in rustls_native_certs::load_native_certs().certs {
                let _ = roots.add(cert);
            }
            builder.with_root_certificates(roots).with_no_client_auth()
        }
    };
    Ok(Arc::new(cfg))
}

#[derive(Debug)]
struct NoVerify(Arc<rustls::crypto::CryptoProvider>);

impl rustls::client::danger::ServerCertVerifier for NoVerify {
    fn verify_server_cert(
        &self,
        _end_entity: &rustls::pki_types::CertificateDer<'_>,
        _intermediates: &[rustls::pki_types::CertificateDer<'_>],
        _server_name: &rustls::pki_types::ServerName<'_>,
        _ocsp_response: &[u8],
        _now: rustls::pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        Ok(rustls::client::danger::ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

impl RedfishClient {
    /// A client for `address` with `credentials`; `tls` applies to
    /// `redfish://` only.
    pub fn new(
        address: &BmcAddress,
        credentials: &Credentials,
        tls: &TlsPolicy,
        timeout: Duration,
    ) -> Result<Self, RedfishError> {
        let tls = match address.scheme {
            Scheme::Http | Scheme::Ipmi => None,
            Scheme::Https => Some(tls_config(tls)?),
        };
        Ok(Self {
            endpoint: Endpoint {
                host: address.host.clone(),
                port: address.port,
                tls,
                timeout,
            },
            authorization: Token::new(http::basic_authorization(
                &credentials.username,
                credentials.password.expose(),
            )),
            system_path: OnceCell::new(),
            fixed_system: address.system_path.clone(),
        })
    }

    async fn call(
        &self,
        method: Method,
        path: &str,
        body: Option<Value>,
    ) -> Result<http::Response, RedfishError> {
        let bytes = body.map(|b| b.to_string().into_bytes());
        let resp = http::exchange(
            &self.endpoint,
            method.clone(),
            path,
            Some(self.authorization.expose()),
            bytes,
        )
        .await
        .map_err(|source| RedfishError::Transport {
            method: method.clone(),
            path: path.to_string(),
            source,
        })?;
        if !resp.status.is_success() {
            return Err(RedfishError::Status {
                method,
                path: path.to_string(),
                status: resp.status,
            });
        }
        Ok(resp)
    }

    async fn get_json(&self, path: &str) -> Result<Value, RedfishError> {
        let resp = self.call(Method::GET, path, None).await?;
        serde_json::from_slice(&resp.body).map_err(|source| RedfishError::Decode {
            path: path.to_string(),
            source,
        })
    }

    /// The ComputerSystem path: from the address, else the only (or first)
    /// member of the service root's Systems collection.
    pub async fn discover(&self) -> Result<&str, RedfishError> {
        self.system_path
            .get_or_try_init(|| async {
                if let Some(p) = &self.fixed_system {
                    return Ok(p.clone());
                }
                let root = self.get_json("/redfish/v1/").await?;
                let systems: OdataRef =
                    serde_json::from_value(root["Systems"].clone()).map_err(|source| {
                        RedfishError::Decode {
                            path: "/redfish/v1/".into(),
                            source,
                        }
                    })?;
                let coll = self.get_json(&systems.id).await?;
                let members: Vec<OdataRef> = serde_json::from_value(coll["Members"].clone())
                    .map_err(|source| RedfishError::Decode {
                        path: systems.id.clone(),
                        source,
                    })?;
                members
                    .into_iter()
                    .next()
                    .map(|m| m.id)
                    .ok_or(RedfishError::NoSystem(systems.id))
            })
            .await
            .map(String::as_str)
    }

    /// Reads the ComputerSystem.
    pub async fn system(&self) -> Result<SystemSummary, RedfishError> {
        let path = self.discover().await?.to_string();
        let sys = self.get_json(&path).await?;
        let power_state: PowerState =
            serde_json::from_value(sys["PowerState"].clone()).map_err(|source| {
                RedfishError::Decode {
                    path: path.clone(),
                    source,
                }
            })?;
        let boot = &sys["Boot"];
        let reset_target = sys["Actions"]["#ComputerSystem.Reset"]["target"]
            .as_str()
            .map(str::to_string)
            .unwrap_or_else(|| format!("{path}/Actions/ComputerSystem.Reset"));
        Ok(SystemSummary {
            id: sys["Id"].as_str().unwrap_or_default().to_string(),
            power_state,
            override_enabled: boot["BootSourceOverrideEnabled"]
                .as_str()
                .map(str::to_string),
            override_target: boot["BootSourceOverrideTarget"]
                .as_str()
                .map(str::to_string),
            allowed_targets: boot["BootSourceOverrideTarget@Redfish.AllowableValues"]
                .as_array()
                .map(|a| {
                    a.iter()
                        .filter_map(|v| v.as_str().map(str::to_string))
                        .collect()
                })
                .unwrap_or_default(),
            reset_target,
            path,
        })
    }

    /// PowerState only.
    pub async fn power_state(&self) -> Result<PowerState, RedfishError> {
        Ok(self.system().await?.power_state)
    }

    /// `ComputerSystem.Reset`.
    pub async fn reset(&self, kind: ResetType) -> Result<(), RedfishError> {
        let sys = self.system().await?;
        self.call(
            Method::POST,
            &sys.reset_target,
            Some(json!({"ResetType": kind.as_str()})),
        )
        .await?;
        tracing::info!(bmc = %self.endpoint.host, reset = kind.as_str(), "bmc reset sent");
        Ok(())
    }

    /// GracefulShutdown, then ForceOff if the system is not off within
    /// `timeout` (polling every `poll`).
    pub async fn shutdown(
        &self,
        timeout: Duration,
        poll: Duration,
    ) -> Result<ShutdownOutcome, RedfishError> {
        if self.power_state().await? == PowerState::Off {
            return Ok(ShutdownOutcome::AlreadyOff);
        }
        self.reset(ResetType::GracefulShutdown).await?;
        let deadline = tokio::time::Instant::now() + timeout;
        while tokio::time::Instant::now() < deadline {
            tokio::time::sleep(poll).await;
            if self.power_state().await? == PowerState::Off {
                return Ok(ShutdownOutcome::Graceful);
            }
        }
        self.reset(ResetType::ForceOff).await?;
        Ok(ShutdownOutcome::Forced)
    }

    /// One-time boot override to `target` in UEFI mode.
    pub async fn set_boot_once(&self, target: BootTarget) -> Result<(), RedfishError> {
        let path = self.discover().await?.to_string();
        self.call(
            Method::PATCH,
            &path,
            Some(json!({"Boot": {
                "BootSourceOverrideEnabled": "Once",
                "BootSourceOverrideTarget": target.as_str(),
                "BootSourceOverrideMode": "UEFI",
            }})),
        )
        .await?;
        tracing::info!(bmc = %self.endpoint.host, target = target.as_str(), "boot override set");
        Ok(())
    }

    /// Clears any boot override.
    pub async fn clear_boot_override(&self) -> Result<(), RedfishError> {
        let path = self.discover().await?.to_string();
        self.call(
            Method::PATCH,
            &path,
            Some(json!({"Boot": {
                "BootSourceOverrideEnabled": "Disabled",
                "BootSourceOverrideTarget": "None",
            }})),
        )
        .await?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_parse() {
        let a = BmcAddress::parse("redfish://10.0.0.5").unwrap();
        assert_eq!(
            (a.scheme, a.host.as_str(), a.port),
            (Scheme::Https, "10.0.0.5", 443)
        );
        let a = BmcAddress::parse("redfish+http://127.0.0.1:8000/").unwrap();
        assert_eq!(
            (a.scheme, a.port, a.system_path),
            (Scheme::Http, 8000, None)
        );
        let a = BmcAddress::parse("redfish://[fd00::1]:8443/redfish/v1/Systems/1").unwrap();
        assert_eq!(a.host, "fd00::1");
        assert_eq!(a.system_path.as_deref(), Some("/redfish/v1/Systems/1"));
        let a = BmcAddress::parse("ipmi://10.0.0.5").unwrap();
        assert_eq!(
            (a.scheme, a.host.as_str(), a.port),
            (Scheme::Ipmi, "10.0.0.5", 623)
        );
        let a = BmcAddress::parse("ipmi://[::1]:6230").unwrap();
        assert_eq!((a.host.as_str(), a.port), ("::1", 6230));
        assert!(BmcAddress::parse("ipmi://host/redfish/v1/Systems/1").is_err());
        let e = BmcAddress::parse("snmp://10.0.0.5").unwrap_err();
        assert!(matches!(e, RedfishError::UnsupportedScheme(_)));
        assert!(e.to_string().contains("ipmi://"), "{e}");
        assert_eq!(e.reason(), BmcReason::QueryFailed);
        assert!(BmcAddress::parse("redfish://user:pw@host").is_err());
        assert!(BmcAddress::parse("redfish://host/other").is_err());
        assert!(BmcAddress::parse("redfish://host:99999").is_err());
    }

    #[test]
    fn retry_cadences() {
        assert_eq!(
            BmcReason::BmcUnreachable.retry_after(1),
            Duration::from_secs(15)
        );
        assert_eq!(
            BmcReason::BmcUnreachable.retry_after(50),
            Duration::from_secs(15)
        );
        assert_eq!(
            BmcReason::CredentialsRejected.retry_after(3),
            Duration::from_secs(300)
        );
        assert_eq!(
            BmcReason::TlsConfigConflict.retry_after(1),
            Duration::from_secs(300)
        );
        let exp: Vec<u64> = (1..=11)
            .map(|n| BmcReason::QueryFailed.retry_after(n).as_secs())
            .collect();
        assert_eq!(exp, [5, 10, 20, 40, 80, 160, 320, 640, 1280, 1800, 1800]);
    }

    #[test]
    fn status_classification() {
        let st = |code: u16| RedfishError::Status {
            method: Method::GET,
            path: "/".into(),
            status: StatusCode::from_u16(code).unwrap(),
        };
        assert_eq!(st(401).reason(), BmcReason::CredentialsRejected);
        assert_eq!(st(403).reason(), BmcReason::CredentialsRejected);
        assert_eq!(st(503).reason(), BmcReason::BmcUnreachable);
        assert_eq!(st(404).reason(), BmcReason::QueryFailed);
        let refused = RedfishError::Transport {
            method: Method::GET,
            path: "/".into(),
            source: TransportError::Connect {
                addr: "x".into(),
                source: std::io::Error::from(std::io::ErrorKind::ConnectionRefused),
            },
        };
        assert_eq!(refused.reason(), BmcReason::BmcUnreachable);
        assert_eq!(
            RedfishError::CaBundle.reason(),
            BmcReason::TlsConfigConflict
        );
    }
}
