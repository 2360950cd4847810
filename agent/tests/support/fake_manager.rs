//! A small HTTPS server speaking the agent protocol types, for tests: the
//! loopback client tests use it in-process; `examples/fake_manager.rs` runs
//! it inside a VM test's network namespace. It checks what the real manager
//! checks (schema header, single-use boot token, bearer session token, unknown
//! fields denied) and records what it received.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anneal_api::agent::{
    ErrorCode, ErrorResponse, HardwareReport, MachineIdentity, NextAction, RegisterRequest,
    RegisterResponse, SCHEMA_HEADER, SCHEMA_VERSION, Token,
};
use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use sha2::{Digest, Sha256};

/// What the server does.
#[derive(Debug, Clone)]
pub struct Config {
    /// The boot token it accepts (once).
    pub boot_token: String,
    /// Answers to `next`, in order; `wait` once they run out.
    pub next: Vec<NextAction>,
    /// Send the CA in the chain (the contract); false to test the refusal.
    pub send_ca: bool,
    /// Names and IPs in the serving certificate.
    pub sans: Vec<String>,
    /// The Machine this token belongs to.
    pub machine: (String, String),
    /// Write hardware.json and events.log here as they happen.
    pub out_dir: Option<PathBuf>,
}

/// What the server saw.
#[derive(Debug, Default)]
pub struct State {
    /// Successful registrations.
    pub registrations: u32,
    /// The last hardware report.
    pub hardware: Option<HardwareReport>,
    /// One line per request: `METHOD PATH -> STATUS`.
    pub events: Vec<String>,
    used: bool,
    session: Option<String>,
    next: Vec<NextAction>,
}

/// A running server.
#[derive(Debug)]
pub struct FakeManager {
    /// Where it listens.
    pub addr: SocketAddr,
    /// SHA-256 (hex) of its CA certificate: the `anneal.ca` value.
    pub ca_sha256: String,
    /// What it saw.
    pub state: Arc<Mutex<State>>,
}

fn certs(
    sans: &[String],
) -> (
    CertificateDer<'static>,
    CertificateDer<'static>,
    PrivateKeyDer<'static>,
) {
    let ca_key = KeyPair::generate().unwrap();
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "anneal-agent-api-ca (test)");
    let ca_cert = ca_params.self_signed(&ca_key).unwrap();
    let issuer = Issuer::new(ca_params, ca_key);
    let leaf_key = KeyPair::generate().unwrap();
    let mut leaf_params = CertificateParams::new(sans.to_vec()).unwrap();
    leaf_params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "anneal-manager (test)");
    let leaf = leaf_params.signed_by(&leaf_key, &issuer).unwrap();
    (
        ca_cert.der().clone(),
        leaf.der().clone(),
        PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(leaf_key.serialize_der())),
    )
}

/// Starts serving on `listener` in background threads.
pub fn start(listener: TcpListener, cfg: Config) -> FakeManager {
    let (ca, leaf, key) = certs(&cfg.sans);
    let ca_sha256 = hex::encode(Sha256::digest(ca.as_ref()));
    let chain = if cfg.send_ca {
        vec![leaf, ca]
    } else {
        vec![leaf]
    };
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let server = Arc::new(
        rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(chain, key)
            .unwrap(),
    );
    let state = Arc::new(Mutex::new(State {
        next: cfg.next.iter().rev().cloned().collect(),
        ..State::default()
    }));
    if let Some(dir) = &cfg.out_dir {
        std::fs::create_dir_all(dir).unwrap();
        std::fs::write(dir.join("ca.sha256"), &ca_sha256).unwrap();
    }
    let addr = listener.local_addr().unwrap();
    let st = state.clone();
    let cfg = Arc::new(cfg);
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(tcp) = conn else { continue };
            let (server, st, cfg) = (server.clone(), st.clone(), cfg.clone());
            std::thread::spawn(move || {
                let _ = serve(tcp, server, &st, &cfg);
            });
        }
    });
    FakeManager {
        addr,
        ca_sha256,
        state,
    }
}

fn serve(
    tcp: TcpStream,
    server: Arc<rustls::ServerConfig>,
    state: &Mutex<State>,
    cfg: &Config,
) -> std::io::Result<()> {
    tcp.set_read_timeout(Some(Duration::from_secs(10)))?;
    let conn = rustls::ServerConnection::new(server).map_err(std::io::Error::other)?;
    let mut tls = rustls::StreamOwned::new(conn, tcp);
    let mut buf = Vec::new();
    let mut chunk = [0u8; 8192];
    let (method, path, headers, body) = loop {
        let n = tls.read(&mut chunk)?;
        if n == 0 {
            return Ok(());
        }
        buf.extend_from_slice(&chunk[..n]);
        let mut hs = [httparse::EMPTY_HEADER; 32];
        let mut req = httparse::Request::new(&mut hs);
        if let httparse::Status::Complete(head) = req.parse(&buf).map_err(std::io::Error::other)? {
            let headers: Vec<(String, String)> = req
                .headers
                .iter()
                .map(|h| {
                    (
                        h.name.to_ascii_lowercase(),
                        String::from_utf8_lossy(h.value).to_string(),
                    )
                })
                .collect();
            let len: usize = headers
                .iter()
                .find(|(k, _)| k == "content-length")
                .and_then(|(_, v)| v.parse().ok())
                .unwrap_or(0);
            if buf.len() >= head + len {
                break (
                    req.method.unwrap_or("").to_string(),
                    req.path.unwrap_or("").to_string(),
                    headers,
                    buf[head..head + len].to_vec(),
                );
            }
        }
    };
    let header = |name: &str| {
        headers
            .iter()
            .find(|(k, _)| k == &name.to_ascii_lowercase())
            .map(|(_, v)| v.clone())
    };
    let (status, resp): (u16, Option<Vec<u8>>) = handle(&method, &path, header, &body, state, cfg);
    {
        let mut s = state.lock().unwrap();
        s.events.push(format!("{method} {path} -> {status}"));
        if let Some(dir) = &cfg.out_dir {
            let _ = std::fs::write(dir.join("events.log"), s.events.join("\n") + "\n");
        }
    }
    let body = resp.unwrap_or_default();
    let reason = match status {
        200 => "OK",
        204 => "No Content",
        400 => "Bad Request",
        401 => "Unauthorized",
        426 => "Upgrade Required",
        _ => "Other",
    };
    let mut out = format!(
        "HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\nConnection: close\r\n"
    );
    if status != 204 {
        out.push_str(&format!("Content-Length: {}\r\n", body.len()));
    }
    out.push_str("\r\n");
    tls.write_all(out.as_bytes())?;
    tls.write_all(&body)?;
    tls.flush()?;
    tls.conn.send_close_notify();
    let _ = tls.flush();
    Ok(())
}

fn error(status: u16, code: ErrorCode, message: &str) -> (u16, Option<Vec<u8>>) {
    (
        status,
        Some(
            serde_json::to_vec(&ErrorResponse {
                code,
                message: message.into(),
            })
            .unwrap(),
        ),
    )
}

fn handle(
    method: &str,
    path: &str,
    header: impl Fn(&str) -> Option<String>,
    body: &[u8],
    state: &Mutex<State>,
    cfg: &Config,
) -> (u16, Option<Vec<u8>>) {
    if header(SCHEMA_HEADER).as_deref() != Some(SCHEMA_VERSION) {
        return error(
            426,
            ErrorCode::SchemaMismatch,
            "Anneal-Agent-Schema must be 1",
        );
    }
    let mut s = state.lock().unwrap();
    if (method, path) == ("POST", "/v1/agent/register") {
        let Ok(req) = serde_json::from_slice::<RegisterRequest>(body) else {
            return error(400, ErrorCode::BadRequest, "malformed register body");
        };
        if !req.boot_token.ct_eq(cfg.boot_token.as_bytes()) {
            return error(401, ErrorCode::InvalidToken, "unknown boot token");
        }
        if s.used {
            return error(401, ErrorCode::UsedToken, "boot token already used");
        }
        s.used = true;
        s.registrations += 1;
        let session = hex::encode(rand::random::<[u8; 32]>());
        s.session = Some(session.clone());
        let resp = RegisterResponse {
            session_token: Token::new(session),
            expires_in_seconds: 600,
            machine: MachineIdentity {
                namespace: cfg.machine.0.clone(),
                name: cfg.machine.1.clone(),
            },
        };
        return (200, Some(serde_json::to_vec(&resp).unwrap()));
    }
    let bearer =
        header("authorization").and_then(|v| v.strip_prefix("Bearer ").map(str::to_string));
    if bearer.is_none() || bearer != s.session {
        return error(401, ErrorCode::InvalidToken, "bad session token");
    }
    match (method, path) {
        ("PUT", "/v1/agent/hardware") => match serde_json::from_slice::<HardwareReport>(body) {
            Ok(hw) => {
                if let Some(dir) = &cfg.out_dir {
                    let _ = std::fs::write(
                        dir.join("hardware.json"),
                        serde_json::to_vec_pretty(&hw).unwrap(),
                    );
                }
                s.hardware = Some(hw);
                (204, None)
            }
            Err(_) => error(400, ErrorCode::BadRequest, "malformed hardware body"),
        },
        ("GET", "/v1/agent/next") => {
            let action = s.next.pop().unwrap_or(NextAction::Wait {
                retry_after_seconds: 1,
            });
            (200, Some(serde_json::to_vec(&action).unwrap()))
        }
        _ => error(400, ErrorCode::BadRequest, "no such endpoint"),
    }
}
