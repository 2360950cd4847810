//! The agent API's bounds against a real kube-apiserver (the agent API
//! alone, no controllers: a Machine's status is written by the test), over
//! real TLS from raw clients bound to distinct loopback source addresses
//! (the rate limit is per source address):
//!
//! - registration is idempotent: 8 concurrent registrations and a later
//!   retry of one request from one address get the same session (never
//!   usedToken); from another address, or once the session was used, the
//!   token is refused;
//! - `PUT /hardware` writes the inventory only while Inspecting;
//! - 100 connections sending a request head byte by byte are closed at the
//!   header deadline, while a well-behaved client is still served;
//! - a body that never arrives gets 408 at the body deadline;
//! - a source over its rate gets 429 with Retry-After, another source not;
//! - HTTP/2 is not spoken (ALPN h2 alone is refused, a prior-knowledge
//!   preface is not answered as HTTP/2);
//! - over the connection cap a request waits for a slot;
//! - requests with bogus tokens make the API server do no LIST.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
#![allow(clippy::too_many_lines)]

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anneal_api::{Machine, MachineHardware};
use anneal_manager::agentapi::{AgentApiConfig, AgentApiLimits, start_with_limits};
use anneal_manager::lifecycle::status::{time_in, token_hash};
use anneal_testinfra::ControlPlane;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_rustls::TlsConnector;
use tokio_rustls::client::TlsStream;
use tokio_util::sync::CancellationToken;

const HEADER_DEADLINE: Duration = Duration::from_secs(3);
const BODY_DEADLINE: Duration = Duration::from_secs(2);
const CAP: usize = 130;

fn limits() -> AgentApiLimits {
    AgentApiLimits {
        max_connections: CAP,
        header_timeout: HEADER_DEADLINE,
        body_timeout: BODY_DEADLINE,
        rate_per_sec: 2.0,
        rate_burst: 10.0,
    }
}

/// 127.0.0.`n`: a source address of its own (its own rate bucket).
fn src(n: u8) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(127, 0, 0, n))
}

struct Tls {
    connector: TlsConnector,
    h2_only: TlsConnector,
    addr: SocketAddr,
}

impl Tls {
    fn new(ca_pem: &str, addr: SocketAddr) -> Tls {
        let mut roots = rustls::RootCertStore::empty();
        use rustls::pki_types::pem::PemObject as _;
        for c in rustls::pki_types::CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
            roots.add(c.unwrap()).unwrap();
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let config = |alpn: Vec<Vec<u8>>| {
            let mut c = rustls::ClientConfig::builder_with_provider(provider.clone())
                .with_safe_default_protocol_versions()
                .unwrap()
                .with_root_certificates(roots.clone())
                .with_no_client_auth();
            c.alpn_protocols = alpn;
            TlsConnector::from(Arc::new(c))
        };
        Tls {
            connector: config(vec![]),
            h2_only: config(vec![b"h2".to_vec()]),
            addr,
        }
    }

    async fn tcp(&self, from: IpAddr) -> tokio::net::TcpStream {
        let s = tokio::net::TcpSocket::new_v4().unwrap();
        s.bind(SocketAddr::new(from, 0)).unwrap();
        s.connect(self.addr).await.unwrap()
    }

    async fn connect(&self, from: IpAddr) -> std::io::Result<TlsStream<tokio::net::TcpStream>> {
        let tcp = self.tcp(from).await;
        let name = rustls::pki_types::ServerName::try_from("127.0.0.1").unwrap();
        self.connector.connect(name, tcp).await
    }

    /// One request (`Connection: close`): status, headers, JSON body.
    async fn call(
        &self,
        from: IpAddr,
        method: &str,
        path: &str,
        bearer: Option<&str>,
        body: Option<Value>,
    ) -> (u16, String, Value) {
        let mut s = self.connect(from).await.unwrap();
        let body = body.map(|b| b.to_string()).unwrap_or_default();
        let auth = bearer
            .map(|b| format!("Authorization: Bearer {b}\r\n"))
            .unwrap_or_default();
        let req = format!(
            "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\
             Anneal-Agent-Schema: 1\r\nContent-Type: application/json\r\n{auth}\
             Content-Length: {}\r\n\r\n{body}",
            body.len()
        );
        s.write_all(req.as_bytes()).await.unwrap();
        let mut out = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(60), s.read_to_end(&mut out))
            .await
            .expect("the agent api answered within 60 s");
        parse(&out)
    }
}

fn parse(raw: &[u8]) -> (u16, String, Value) {
    let text = String::from_utf8_lossy(raw);
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let code = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("not an HTTP response: {text:?}"));
    (
        code,
        head.to_ascii_lowercase(),
        serde_json::from_str(body).unwrap_or(Value::Null),
    )
}

fn hardware(memory: u64) -> Value {
    serde_json::to_value(anneal_api::agent::HardwareReport {
        disks: vec![anneal_api::agent::Disk {
            device_name: "vda".into(),
            size_bytes: 32 << 20,
            logical_sector_size: 512,
            physical_sector_size: 512,
            ..Default::default()
        }],
        nics: vec![anneal_api::agent::Nic {
            name: "eth0".into(),
            mac: "52:54:00:7f:20:01".into(),
            link: true,
            ..Default::default()
        }],
        memory_bytes: memory,
        cpu: anneal_api::agent::Cpu {
            count: 1,
            model: None,
            architecture: None,
        },
        firmware: anneal_api::agent::Firmware {
            mode: anneal_api::agent::FirmwareMode::Uefi,
            secure_boot: false,
        },
        system: Default::default(),
    })
    .unwrap()
}

/// The API server's LIST count of Machines (`apiserver_request_total`).
async fn machine_lists(client: &kube::Client) -> u64 {
    machine_requests(client, "LIST").await
}

/// The API server's `verb` requests of Machines (`apiserver_request_total`).
async fn machine_requests(client: &kube::Client, verb: &str) -> u64 {
    let req = http::Request::get("/metrics").body(Vec::new()).unwrap();
    let text = client.request_text(req).await.unwrap();
    text.lines()
        .filter(|l| {
            l.starts_with("apiserver_request_total{")
                && l.contains("resource=\"machines\"")
                && l.contains(&format!("verb=\"{verb}\""))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

async fn set_status(client: &kube::Client, name: &str, status: Value) {
    Api::<Machine>::namespaced(client.clone(), "default")
        .patch_status(
            name,
            &PatchParams::default(),
            &Patch::Merge(&json!({ "status": status })),
        )
        .await
        .unwrap();
}

/// Sends a request head one byte every 200 ms (never its end); how long
/// after `start` the server closed the connection (None: already during the
/// TLS handshake, whose deadline is the same), or Err when still open at
/// `give_up`.
async fn slow_head(
    tls: &Tls,
    from: IpAddr,
    start: Instant,
    give_up: Duration,
) -> Result<Option<Duration>, String> {
    let Ok(s) = tls.connect(from).await else {
        return Ok(None);
    };
    let (mut r, mut w) = tokio::io::split(s);
    let head = b"GET /v1/agent/next HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ";
    let reader = async move {
        let mut buf = [0u8; 256];
        loop {
            match r.read(&mut buf).await {
                Ok(0) | Err(_) => return start.elapsed(),
                Ok(_) => {}
            }
        }
    };
    let writer = async move {
        let mut i = 0;
        loop {
            let b = [head.get(i).copied().unwrap_or(b'a')];
            i += 1;
            if w.write_all(&b).await.is_err() || w.flush().await.is_err() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    };
    tokio::select! {
        closed = reader => Ok(Some(closed)),
        () = writer => Ok(Some(start.elapsed())),
        () = tokio::time::sleep_until((start + give_up).into()) => Err(format!("still open after {give_up:?}")),
    }
}

/// A control plane with anneal's CRDs and namespace `anneal-system`, and
/// Machine `name` (boot MAC `mac`) Inspecting with boot token `token` armed
/// for 10 minutes.
async fn armed_machine(
    name: &str,
    mac: &str,
    token: &str,
) -> (ControlPlane, kube::Client, Api<Machine>) {
    let cp = ControlPlane::start().await.unwrap();
    cp.install_crds(&anneal_api::crds()).await.unwrap();
    let client = cp.client();
    let _ = Api::<k8s_openapi::api::core::v1::Namespace>::all(client.clone())
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": "anneal-system"}})).unwrap(),
        )
        .await;
    let machines = Api::<Machine>::namespaced(client.clone(), "default");
    let m: Machine = serde_json::from_value(json!({
        "apiVersion": "anneal.dev/v1alpha1",
        "kind": "Machine",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"subnetRef": {"name": "lab"}, "bootMACAddress": mac},
    }))
    .unwrap();
    machines.create(&PostParams::default(), &m).await.unwrap();
    set_status(
        &client,
        name,
        json!({"state": "Inspecting", "netBoot": {"tokenHash": token_hash(token),
               "expiresAt": time_in(Timestamp::now(), 600_000)}}),
    )
    .await;
    (cp, client, machines)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn agent_api_bounds() {
    let token = "ab".repeat(32);
    let (_cp, client, machines) = armed_machine("m1", "52:54:00:7f:20:01", &token).await;

    let cancel = CancellationToken::new();
    let cfg = AgentApiConfig {
        listen: ([127, 0, 0, 1], 0).into(),
        namespace: "anneal-system".into(),
        server_names: vec!["127.0.0.1".into()],
        ..AgentApiConfig::default()
    };
    let api = start_with_limits(client.clone(), cfg, limits(), cancel.clone())
        .await
        .unwrap();
    let tls = Arc::new(Tls::new(&api.pki().ca_pem, api.addr()));

    // --- registration: concurrent and retried, one session ---
    let register =
        json!({"bootToken": token, "bootMac": "52:54:00:7f:20:01", "agentVersion": "test"});
    // one agent whose first attempts seemed lost: the same request from
    // the same address, concurrently
    let calls: Vec<_> = (0..8u8)
        .map(|_| {
            let tls = tls.clone();
            let body = register.clone();
            tokio::spawn(async move {
                tls.call(src(10), "POST", "/v1/agent/register", None, Some(body))
                    .await
            })
        })
        .collect();
    let mut sessions = Vec::new();
    for c in calls {
        let (code, _, body) = c.await.unwrap();
        assert_eq!(
            code, 200,
            "a concurrent registration with the same boot token was refused: {body}"
        );
        sessions.push(body["sessionToken"].as_str().unwrap().to_string());
    }
    let session = sessions[0].clone();
    assert!(
        sessions.iter().all(|s| *s == session),
        "concurrent registrations with one boot token got different sessions"
    );
    let (code, _, body) = tls
        .call(
            src(10),
            "POST",
            "/v1/agent/register",
            None,
            Some(register.clone()),
        )
        .await;
    assert_eq!(code, 200, "a retried registration was refused: {body}");
    assert_eq!(body["sessionToken"].as_str(), Some(session.as_str()));
    // the used token from another address is no retry: refused
    let (code, _, body) = tls
        .call(
            src(20),
            "POST",
            "/v1/agent/register",
            None,
            Some(register.clone()),
        )
        .await;
    assert_eq!(code, 401, "the used token from another address: {body}");
    let live = machines.get("m1").await.unwrap();
    assert_eq!(
        live.status
            .as_ref()
            .and_then(|s| s.agent.as_ref())
            .and_then(|a| a.session_token_hash.clone()),
        Some(token_hash(&session)),
        "the Machine's session is the one answered"
    );

    // --- PUT /hardware: written while Inspecting, not after ---
    let (code, _, body) = tls
        .call(
            src(21),
            "PUT",
            "/v1/agent/hardware",
            Some(&session),
            Some(hardware(512 << 20)),
        )
        .await;
    assert_eq!(code, 204, "{body}");
    let hw = Api::<MachineHardware>::namespaced(client.clone(), "default");
    assert_eq!(
        hw.get("m1").await.unwrap().spec.memory_bytes,
        Some(512 << 20)
    );
    // once the session was used, the same request is no lost answer: refused
    let (code, _, body) = tls
        .call(
            src(10),
            "POST",
            "/v1/agent/register",
            None,
            Some(register.clone()),
        )
        .await;
    assert_eq!(
        code, 401,
        "a registration replayed after its session was used: {body}"
    );
    set_status(&client, "m1", json!({"state": "Available"})).await;
    let (code, _, body) = tls
        .call(
            src(21),
            "PUT",
            "/v1/agent/hardware",
            Some(&session),
            Some(hardware(1 << 40)),
        )
        .await;
    assert_eq!(code, 204, "{body}");
    assert_eq!(
        hw.get("m1").await.unwrap().spec.memory_bytes,
        Some(512 << 20),
        "a hardware report outside Inspecting rewrote the inventory"
    );

    // --- 100 slow request heads closed at the header deadline ---
    let start = Instant::now();
    let slow: Vec<_> = (0..100u8)
        .map(|i| {
            let tls = tls.clone();
            tokio::spawn(async move {
                slow_head(
                    &tls,
                    src(100 + i),
                    start,
                    HEADER_DEADLINE + Duration::from_secs(8),
                )
                .await
            })
        })
        .collect();
    // meanwhile a well-behaved agent is served
    let (code, _, _) = tls
        .call(src(22), "GET", "/v1/agent/next", Some(&session), None)
        .await;
    assert_eq!(code, 200);
    for s in slow {
        let closed = s.await.unwrap();
        let at = closed.unwrap_or_else(|e| {
            panic!("a slow request head was not closed at the 3 s header deadline: {e}")
        });
        if let Some(at) = at {
            assert!(
                at >= HEADER_DEADLINE,
                "a slow head was closed after {at:?}, before the deadline"
            );
        }
    }
    eprintln!("100 slow heads closed within {:?}", start.elapsed());

    // --- a body that never arrives: 408 at the body deadline ---
    let mut s = tls.connect(src(23)).await.unwrap();
    s.write_all(
        b"POST /v1/agent/register HTTP/1.1\r\nHost: 127.0.0.1\r\nAnneal-Agent-Schema: 1\r\n\
          Content-Length: 200\r\n\r\n{\"bootToken\"",
    )
    .await
    .unwrap();
    let t = Instant::now();
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(30), s.read_to_end(&mut out))
        .await
        .expect("a request whose body never arrives was not closed within 30 s")
        .ok();
    let (code, _, _) = parse(&out);
    assert_eq!(code, 408);
    assert!(t.elapsed() >= BODY_DEADLINE - Duration::from_millis(100));

    // --- rate limit per source address ---
    let bogus = "cd".repeat(32);
    let burst: Vec<_> = (0..25)
        .map(|_| {
            let tls = tls.clone();
            let bogus = bogus.clone();
            tokio::spawn(async move {
                tls.call(src(30), "GET", "/v1/agent/next", Some(&bogus), None)
                    .await
            })
        })
        .collect();
    let mut limited = 0;
    for b in burst {
        let (code, head, body) = b.await.unwrap();
        if code == 429 {
            limited += 1;
            assert!(head.contains("retry-after:"), "429 without Retry-After");
            assert!(
                body["message"]
                    .as_str()
                    .unwrap_or("")
                    .contains("too many requests from 127.0.0.30")
            );
        } else {
            assert_eq!(code, 401);
        }
    }
    assert!(
        limited >= 10,
        "25 requests at once from one address (burst 10) got only {limited} 429s"
    );
    let (code, _, _) = tls
        .call(src(31), "GET", "/v1/agent/next", Some(&bogus), None)
        .await;
    assert_eq!(code, 401, "another source address was rate limited too");

    // --- HTTP/1.1 only ---
    let tcp = tls.tcp(src(32)).await;
    let name = rustls::pki_types::ServerName::try_from("127.0.0.1").unwrap();
    assert!(
        tls.h2_only.connect(name, tcp).await.is_err(),
        "a client offering only h2 in ALPN completed the TLS handshake"
    );
    let mut s = tls.connect(src(33)).await.unwrap();
    s.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00")
        .await
        .unwrap();
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(30), s.read_to_end(&mut out))
        .await
        .expect("an HTTP/2 preface was neither answered nor closed")
        .ok();
    // an HTTP/2 server answers with a SETTINGS frame (type 4 at byte 3)
    assert!(
        !(out.len() >= 9 && out[3] == 4),
        "the agent api answered an HTTP/2 preface as HTTP/2"
    );

    // --- no LIST for bogus tokens ---
    let before = machine_lists(&client).await;
    let flood: Vec<_> = (0..100u8)
        .map(|i| {
            let tls = tls.clone();
            let body = json!({"bootToken": format!("{:064x}", u64::from(i) + 1), "bootMac": "52:54:00:00:00:01", "agentVersion": "x"});
            tokio::spawn(async move {
                tls.call(src(100 + i), "POST", "/v1/agent/register", None, Some(body))
                    .await
            })
        })
        .collect();
    for f in flood {
        assert_eq!(f.await.unwrap().0, 401);
    }
    let after = machine_lists(&client).await;
    assert_eq!(
        after, before,
        "bogus registrations made the API server LIST Machines"
    );
    // naming a machine does not make a bogus token worth a GET either
    let before = machine_requests(&client, "GET").await;
    let flood: Vec<_> = (0..50u8)
        .map(|i| {
            let tls = tls.clone();
            let body = json!({"bootToken": format!("{:064x}", u64::from(i) + 1000), "bootMac": "52:54:00:00:00:01",
                "agentVersion": "x", "machine": format!("default/m-{i}")});
            tokio::spawn(async move {
                tls.call(src(150 + i), "POST", "/v1/agent/register", None, Some(body))
                    .await
            })
        })
        .collect();
    for f in flood {
        assert_eq!(f.await.unwrap().0, 401);
    }
    let after = machine_requests(&client, "GET").await;
    assert_eq!(
        after, before,
        "bogus registrations naming a machine made the API server GET Machines"
    );

    // --- the connection cap: CAP idle connections, then a request waits ---
    let start = Instant::now();
    let mut idle = Vec::new();
    for i in 0..CAP {
        idle.push(tls.tcp(src(40 + (i % 50) as u8)).await);
    }
    let (code, _, _) = tls
        .call(src(35), "GET", "/v1/agent/next", Some(&session), None)
        .await;
    let answered = start.elapsed();
    assert_eq!(code, 200);
    assert!(
        answered >= HEADER_DEADLINE,
        "a request was served after {answered:?} while {CAP} idle connections held the cap \
         (their handshake deadline is 3 s)"
    );
    drop(idle);
    cancel.cancel();
    api.join().await;
}

/// The manager process with RLIMIT_NOFILE 256 (`ulimit -n`, then `exec`):
/// connections to its agent API until accept fails with EMFILE; the accept
/// loop must pause 100 ms after each failure, not spin on it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_api_accept_errors_back_off() {
    use std::io::BufRead;
    let cp = ControlPlane::start().await.unwrap();
    cp.install_crds(&anneal_api::crds()).await.unwrap();
    let client = cp.client();
    let _ = Api::<k8s_openapi::api::core::v1::Namespace>::all(client.clone())
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": "anneal-system"}})).unwrap(),
        )
        .await;
    let mut child = std::process::Command::new("sh")
        .arg("-c")
        .arg("ulimit -n 256 && exec \"$0\" \"$@\"")
        .arg(env!("CARGO_BIN_EXE_manager"))
        .args([
            "run",
            "--no-leader-election",
            "--metrics-addr=127.0.0.1:0",
            "--agent-api-listen=127.0.0.1:0",
            "--agent-api-name=127.0.0.1",
        ])
        .env("KUBECONFIG", cp.kubeconfig_path())
        .env("RUST_LOG", "warn,anneal_manager::agentapi=info")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    struct Kill(std::process::Child);
    impl Drop for Kill {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let stderr = child.stderr.take().unwrap();
    let child = Kill(child);
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stderr).lines() {
            let Ok(line) = line else { break };
            if line.contains("agent api") {
                eprintln!("manager: {line}");
            }
            let _ = tx.send(line);
        }
    });
    let deadline = Instant::now() + Duration::from_secs(60);
    let next = |what: &str| {
        rx.recv_timeout(deadline.saturating_duration_since(Instant::now()))
            .unwrap_or_else(|_| panic!("the manager did not log {what} within 60 s"))
    };
    let addr: SocketAddr = loop {
        let line = next("\"agent api listening\"");
        if line.contains("agent api listening")
            && let Some(a) = line
                .split_whitespace()
                .find_map(|w| w.strip_prefix("addr="))
        {
            break a.parse().unwrap();
        }
    };
    let mut held = Vec::new();
    for _ in 0..300 {
        held.push(tokio::net::TcpStream::connect(addr).await.unwrap());
    }
    let span =
        anneal_testinfra::accept_failure_span(|| Some(next("11 accept failures")), "accept failed")
            .unwrap();
    assert!(
        span >= Duration::from_millis(900),
        "ten accept retries after EMFILE took {span:?}: the accept loop spins (it must pause \
         100 ms after each)"
    );
    drop(held);
    drop(child);
}

/// The register call's boot MAC must be the Machine's `spec.bootMACAddress`
/// (docs/api.md, "Agent protocol"). A mismatch is refused with 403 naming the
/// machine and both MACs, and uses nothing up: the token still registers from
/// the right MAC (in another accepted spelling) afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn register_refuses_another_boot_mac() {
    let token = "cd".repeat(32);
    let (_cp, client, machines) = armed_machine("m-mac", "52:54:00:7f:30:01", &token).await;
    let cancel = CancellationToken::new();
    let cfg = AgentApiConfig {
        listen: ([127, 0, 0, 1], 0).into(),
        namespace: "anneal-system".into(),
        server_names: vec!["127.0.0.1".into()],
        ..AgentApiConfig::default()
    };
    let api = start_with_limits(client.clone(), cfg, limits(), cancel.clone())
        .await
        .unwrap();
    let tls = Tls::new(&api.pki().ca_pem, api.addr());

    // another NIC's MAC: refused, named, nothing written
    let wrong = json!({"bootToken": token, "bootMac": "52:54:00:7f:30:99", "agentVersion": "test", "machine": "default/m-mac"});
    let (code, _, body) = tls
        .call(src(30), "POST", "/v1/agent/register", None, Some(wrong))
        .await;
    assert_eq!(code, 403, "a registration from another boot MAC: {body}");
    assert_eq!(body["code"], "invalidToken", "{body}");
    let message = body["message"].as_str().unwrap_or_default();
    for want in ["default/m-mac", "52:54:00:7f:30:99", "52:54:00:7f:30:01"] {
        assert!(message.contains(want), "{want:?} not in {message:?}");
    }
    let live = machines.get("m-mac").await.unwrap();
    let st = live.status.unwrap();
    assert_eq!(
        st.net_boot.and_then(|n| n.token_hash),
        Some(token_hash(&token)),
        "the refused call used the token up"
    );
    assert!(st.agent.is_none(), "a session was recorded: {:?}", st.agent);

    // the enrolled MAC, spelled with dashes and in upper case: registered
    let right = json!({"bootToken": token, "bootMac": "52-54-00-7F-30-01", "agentVersion": "test"});
    let (code, _, body) = tls
        .call(src(31), "POST", "/v1/agent/register", None, Some(right))
        .await;
    assert_eq!(code, 200, "the enrolled MAC: {body}");
    assert_eq!(body["machine"]["name"], "m-mac");
    let session = body["sessionToken"].as_str().unwrap().to_string();

    // the inspection ends as the controller writes it: Available, the
    // session's hash cleared. The session cannot act any more; its `next`
    // still gets the poweroff an idle Available machine is owed.
    let (code, _, body) = tls
        .call(
            src(31),
            "PUT",
            "/v1/agent/hardware",
            Some(&session),
            Some(hardware(1 << 30)),
        )
        .await;
    assert_eq!(code, 204, "{body}");
    set_status(
        &client,
        "m-mac",
        json!({"state": "Available", "agent": {"sessionTokenHash": null, "expiresAt": null}}),
    )
    .await;
    let (code, _, body) = tls
        .call(
            src(31),
            "PUT",
            "/v1/agent/hardware",
            Some(&session),
            Some(hardware(2 << 30)),
        )
        .await;
    assert_eq!(code, 401, "the ended session wrote the inventory: {body}");
    let (code, _, body) = tls
        .call(src(31), "GET", "/v1/agent/next", Some(&session), None)
        .await;
    assert_eq!(code, 200, "{body}");
    assert_eq!(body["action"], "poweroff", "{body}");
    cancel.cancel();
    api.join().await;
}

/// A session in use is renewed (docs/api.md, "Agent protocol"; its expiry
/// moves to now + the TTL once `session_renew_after` has passed since it was
/// set), so a deploy longer than the TTL keeps its session; an expired one is
/// refused and never renewed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_used_session_is_renewed_and_an_expired_one_is_not() {
    let token = "ef".repeat(32);
    let (_cp, client, machines) = armed_machine("m-renew", "52:54:00:7f:40:01", &token).await;
    let cancel = CancellationToken::new();
    let renew_after = Duration::from_secs(1);
    let cfg = AgentApiConfig {
        listen: ([127, 0, 0, 1], 0).into(),
        namespace: "anneal-system".into(),
        server_names: vec!["127.0.0.1".into()],
        session_ttl: Duration::from_secs(600),
        session_renew_after: renew_after,
        ..AgentApiConfig::default()
    };
    let api = start_with_limits(client.clone(), cfg, limits(), cancel.clone())
        .await
        .unwrap();
    let tls = Tls::new(&api.pki().ca_pem, api.addr());
    let reg = json!({"bootToken": token, "bootMac": "52:54:00:7f:40:01", "agentVersion": "test"});
    let (code, _, body) = tls
        .call(src(40), "POST", "/v1/agent/register", None, Some(reg))
        .await;
    assert_eq!(code, 200, "{body}");
    let session = body["sessionToken"].as_str().unwrap().to_string();
    let expiry = |m: Machine| {
        m.status
            .and_then(|s| s.agent)
            .and_then(|a| a.expires_at)
            .map(|t| t.0.as_millisecond())
            .unwrap()
    };
    let first = expiry(machines.get("m-renew").await.unwrap());
    // the renewal period passes (more time only makes it surer), then the
    // session is used
    tokio::time::sleep(renew_after + Duration::from_millis(100)).await;
    let (code, _, body) = tls
        .call(
            src(40),
            "PUT",
            "/v1/agent/hardware",
            Some(&session),
            Some(hardware(1 << 30)),
        )
        .await;
    assert_eq!(code, 204, "{body}");
    let renewed = expiry(machines.get("m-renew").await.unwrap());
    assert!(
        renewed >= first + 1000,
        "the used session's expiry did not move: {first} -> {renewed}"
    );

    // an expired session: refused, and its expiry stays in the past
    let past = time_in(Timestamp::now(), -60_000);
    set_status(&client, "m-renew", json!({"agent": {"expiresAt": past}})).await;
    let (code, _, body) = tls
        .call(src(40), "GET", "/v1/agent/next", Some(&session), None)
        .await;
    assert_eq!(code, 401, "an expired session acted: {body}");
    let after = expiry(machines.get("m-renew").await.unwrap());
    assert!(
        after < Timestamp::now().as_millisecond(),
        "an expired session was renewed"
    );
    cancel.cancel();
    api.join().await;
}
