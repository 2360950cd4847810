//! The agent's HTTPS client against an in-test server speaking the protocol
//! types: registration, hardware, next; a reused or wrong boot token stops
//! with a permanent error and no registration; a CA fingerprint mismatch (or
//! a chain without the CA) refuses the connection before any request.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
#![allow(clippy::too_many_lines)]

mod support;

use std::net::TcpListener;

use anneal_agent::client::{AgentClient, ClientError};
use anneal_agent::cmdline::{ApiUrl, CaPin};
use anneal_api::agent::{ErrorCode, HardwareReport, NextAction, RegisterRequest, Token};
use support::fake_manager::{self, Config, FakeManager};

const TOKEN: &str = "Zm9vYmFyYmF6cXV4MDEyMzQ1Njc4OWFiY2RlZg";

fn server(send_ca: bool, sans: &[&str], next: Vec<NextAction>) -> FakeManager {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    fake_manager::start(
        listener,
        Config {
            boot_token: TOKEN.into(),
            next,
            send_ca,
            sans: sans.iter().map(|s| s.to_string()).collect(),
            machine: ("lab".into(), "node-1".into()),
            out_dir: None,
        },
    )
}

fn client(s: &FakeManager, pin_hex: &str) -> AgentClient {
    let api = ApiUrl::parse(&format!("https://127.0.0.1:{}", s.addr.port())).unwrap();
    AgentClient::new(api, CaPin::parse(pin_hex).unwrap()).unwrap()
}

fn register_req(token: &str) -> RegisterRequest {
    RegisterRequest {
        boot_token: Token::new(token),
        boot_mac: "52:54:00:12:34:56".into(),
        agent_version: "test".into(),
        machine: Some("lab/node-1".into()),
    }
}

#[test]
fn register_hardware_next() {
    let s = server(true, &["127.0.0.1"], vec![NextAction::Reboot]);
    let mut c = client(&s, &s.ca_sha256);
    let resp = c.register(&register_req(TOKEN)).unwrap();
    assert_eq!(
        (resp.machine.namespace.as_str(), resp.machine.name.as_str()),
        ("lab", "node-1")
    );
    assert!(!format!("{c:?}").contains(resp.session_token.expose()));
    let hw: HardwareReport = serde_json::from_slice(
        &std::fs::read(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../tests/fixtures/agent/sys/expected-qemu.json"),
        )
        .unwrap(),
    )
    .unwrap();
    c.put_hardware(&hw).unwrap();
    assert_eq!(
        c.next(std::time::Duration::from_secs(5)).unwrap(),
        NextAction::Reboot
    );
    assert_eq!(
        c.next(std::time::Duration::from_secs(5)).unwrap(),
        NextAction::Wait {
            retry_after_seconds: 1
        }
    );
    let st = s.state.lock().unwrap();
    assert_eq!(st.registrations, 1);
    assert_eq!(st.hardware.as_ref(), Some(&hw));
    assert_eq!(
        st.events,
        [
            "POST /v1/agent/register -> 200",
            "PUT /v1/agent/hardware -> 204",
            "GET /v1/agent/next -> 200",
            "GET /v1/agent/next -> 200"
        ]
    );
}

#[test]
fn reused_and_wrong_tokens_are_permanent_failures() {
    let s = server(true, &["127.0.0.1"], vec![]);
    let mut first = client(&s, &s.ca_sha256);
    first.register(&register_req(TOKEN)).unwrap();
    let mut again = client(&s, &s.ca_sha256);
    let err = again.register(&register_req(TOKEN)).unwrap_err();
    assert!(
        matches!(
            err,
            ClientError::Status {
                status: 401,
                code: Some(ErrorCode::UsedToken),
                ..
            }
        ),
        "{err:?}"
    );
    assert!(err.is_permanent());
    let used = anneal_agent::init::registration_failure(&err);
    assert!(
        used.starts_with("FAILED: registration: boot token rejected: ")
            && used.contains("(UsedToken)")
            && used.contains("re-arm"),
        "{used}"
    );
    let err = again
        .register(&register_req("AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"))
        .unwrap_err();
    assert!(
        matches!(
            err,
            ClientError::Status {
                status: 401,
                code: Some(ErrorCode::InvalidToken),
                ..
            }
        ),
        "{err:?}"
    );
    assert!(err.is_permanent());
    // The console line the agent stops with names the cause and the fix,
    // and never the token.
    let line = anneal_agent::init::registration_failure(&err);
    assert_eq!(
        line,
        "FAILED: registration: boot token rejected: POST /v1/agent/register answered HTTP 401 \
         (InvalidToken); check: the Machine must be armed for net boot and anneal.token must be \
         its current token; a boot token is single use, so a reused one is refused too: re-arm \
         the Machine's net boot for a fresh one"
    );
    assert!(!line.contains(TOKEN));
    // Without a session nothing else is possible.
    assert!(matches!(
        again.put_hardware(&HardwareReport::default()),
        Err(ClientError::NotRegistered)
    ));
    assert_eq!(s.state.lock().unwrap().registrations, 1);
}

#[test]
fn ca_fingerprint_mismatch_refuses_the_connection() {
    let s = server(true, &["127.0.0.1"], vec![]);
    let wrong = "00".repeat(32);
    let mut c = client(&s, &wrong);
    let err = c.register(&register_req(TOKEN)).unwrap_err();
    assert!(matches!(err, ClientError::CaMismatch { .. }), "{err:?}");
    assert!(err.is_permanent());
    assert!(err.to_string().contains(&wrong), "{err}");
    let line = anneal_agent::init::registration_failure(&err);
    assert!(
        line.starts_with("FAILED: registration: CA fingerprint mismatch: refusing https://")
            && line.contains("check: anneal.ca against the manager's CA"),
        "{line}"
    );
    // A chain without the CA cannot match the pin either.
    let bare = server(false, &["127.0.0.1"], vec![]);
    let mut c = client(&bare, &bare.ca_sha256);
    let err = c.register(&register_req(TOKEN)).unwrap_err();
    assert!(matches!(err, ClientError::CaMismatch { .. }), "{err:?}");
    // The TLS handshake failed: no request reached either server.
    assert!(s.state.lock().unwrap().events.is_empty());
    assert!(bare.state.lock().unwrap().events.is_empty());
}

#[test]
fn right_ca_wrong_name_is_a_tls_failure() {
    let s = server(true, &["10.9.9.9", "manager.example"], vec![]);
    let mut c = client(&s, &s.ca_sha256);
    let err = c.register(&register_req(TOKEN)).unwrap_err();
    assert!(matches!(err, ClientError::Tls { .. }), "{err:?}");
    assert!(s.state.lock().unwrap().events.is_empty());
}

#[test]
fn connection_refused_is_transient() {
    let port = {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let api = ApiUrl::parse(&format!("https://127.0.0.1:{port}")).unwrap();
    let mut c = AgentClient::new(api, CaPin([7; 32])).unwrap();
    let err = c.register(&register_req(TOKEN)).unwrap_err();
    assert!(matches!(err, ClientError::Connect { .. }), "{err:?}");
    assert!(!err.is_permanent());
}
