//! bootd: DHCP (proxy and lease, MAC-gated), TFTP and HTTP network boot.
//!
//! [`Server`] runs every listener of one Subnet in-process, so tests start it
//! directly (or inside a network namespace with [`NetnsServer`]). The binary
//! only parses arguments and calls in here.
#![cfg_attr(test, allow(clippy::too_many_lines))]

pub mod config;
pub mod dhcp;
pub mod dhcp6;
pub mod durable;
pub mod http;
pub mod leasefile;
pub mod metrics;
pub mod ra;
pub mod script;
pub mod state;
pub mod sys;
pub mod tftp;
pub mod watch;

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anneal_api::error_chain;
use anneal_dhcp::{Leases, ServerPort};
use tokio::task::JoinSet;

pub use config::{ConfigError, StaticConfig};
pub use state::{Shared, Snapshot};
pub use tokio_util::sync::CancellationToken;

/// Seconds since the Unix epoch.
pub fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Errors of starting or running the server.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("binding {what} on {addr}")]
    Bind {
        what: &'static str,
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("lease file")]
    LeaseFile(#[from] leasefile::LeaseFileError),
    #[error("tftp")]
    Tftp(#[from] tftp::TftpError),
    #[error("reading template {path}")]
    Template {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("entering network namespace {name}")]
    Netns {
        name: String,
        #[source]
        source: std::io::Error,
    },
    #[error("server thread ended before it started")]
    ThreadGone,
    #[error(
        "dhcpv6 needs the serving interface (--interface): its multicast group is joined there"
    )]
    Dhcp6NeedsInterface,
    #[error("dhcpv6 on {iface}: cannot read the interface's MAC for the server DUID")]
    Dhcp6NoMac { iface: String },
}

/// Where and how to listen.
#[derive(Debug, Clone)]
pub struct ServerOptions {
    /// Bind DHCP sockets to this interface (broadcasts leave through it).
    pub interface: Option<String>,
    /// Address for TFTP and HTTP (DHCP always binds 0.0.0.0).
    pub listen_ip: Ipv4Addr,
    pub dhcp_port: u16,
    /// 0 disables port 4011.
    pub pxe_port: u16,
    /// 0 disables TFTP.
    pub tftp_port: u16,
    pub http_port: u16,
    pub lease_file: Option<PathBuf>,
    /// Overrides the shipped boot script template.
    pub template: Option<PathBuf>,
    /// Per-transfer deadline and per-address cap of TFTP.
    pub tftp_limits: tftp::TftpLimits,
    /// Connection cap and deadlines of HTTP.
    pub http_limits: http::HttpLimits,
    /// DHCPv6 on `interface` (TFTP and HTTP then also listen on its
    /// IPv6 address); `None`: IPv4 only.
    pub dhcp6: Option<dhcp6::Dhcp6Options>,
    /// With `dhcp6`: send router advertisements for its prefix on
    /// `interface` ([`ra`]).
    pub router_advertisements: bool,
}

impl Default for ServerOptions {
    fn default() -> Self {
        ServerOptions {
            interface: None,
            listen_ip: Ipv4Addr::UNSPECIFIED,
            dhcp_port: 67,
            pxe_port: 4011,
            tftp_port: 69,
            http_port: 8080,
            lease_file: None,
            template: None,
            tftp_limits: tftp::TftpLimits::default(),
            http_limits: http::HttpLimits::default(),
            dhcp6: None,
            router_advertisements: false,
        }
    }
}

/// A running bootd.
#[derive(Debug)]
pub struct Server {
    shared: Arc<Shared>,
    cancel: CancellationToken,
    tasks: JoinSet<()>,
    /// Bound HTTP address.
    pub http_addr: SocketAddr,
    /// Bound TFTP address, if enabled.
    pub tftp_addr: Option<SocketAddr>,
}

fn bind_err(what: &'static str, addr: SocketAddr) -> impl FnOnce(std::io::Error) -> ServerError {
    move |source| ServerError::Bind { what, addr, source }
}

/// Spawns DHCPv6 on `iface` and, with `router_advertisements`, the
/// router advertisements for its prefix ([`ra`]).
fn spawn_dhcp6(
    tasks: &mut tokio::task::JoinSet<()>,
    shared: &Arc<Shared>,
    o6: &dhcp6::Dhcp6Options,
    iface: &str,
    router_advertisements: bool,
    http_port: u16,
    cancel: &CancellationToken,
) -> Result<(), ServerError> {
    let mac = dhcp6::interface_mac(iface).ok_or_else(|| ServerError::Dhcp6NoMac {
        iface: iface.to_owned(),
    })?;
    let a6 = SocketAddr::new(std::net::Ipv6Addr::UNSPECIFIED.into(), 547);
    let s = dhcp6::udp_socket6(547, iface)
        .and_then(tokio::net::UdpSocket::from_std)
        .map_err(bind_err("dhcpv6", a6))?;
    tasks.spawn(dhcp6::serve(
        shared.clone(),
        s,
        o6.clone(),
        mac,
        http_port,
        cancel.clone(),
    ));
    if router_advertisements {
        let s = ra::raw_socket(iface)
            .and_then(tokio::net::UdpSocket::from_std)
            .map_err(bind_err("router advertisements (raw icmpv6)", a6))?;
        tracing::info!(interface = iface, prefix = %o6.prefix, "sending router advertisements");
        tasks.spawn(ra::serve(
            s,
            iface.to_owned(),
            ra::RaOptions::of(o6, mac),
            cancel.clone(),
        ));
    }
    Ok(())
}

/// How often expired leases are collected from the lease table.
pub const LEASE_COLLECT_INTERVAL: Duration = Duration::from_secs(30);

/// Collects expired leases every [`LEASE_COLLECT_INTERVAL`] (the first
/// pass at once), so the table and the lease file do not fill with them.
async fn collect_leases(shared: Arc<Shared>, cancel: CancellationToken) {
    let mut tick = tokio::time::interval(LEASE_COLLECT_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = cancel.cancelled() => return,
            _ = tick.tick() => {}
        }
        shared.collect_leases(unix_now());
    }
}

/// Writes the lease changes the DHCP loop does not commit itself
/// (RELEASE, DECLINE, collection, a new table), coalescing bursts (at most
/// ~20 writes a second), and retries a failed write every
/// [`durable::RETRY`]. Its last commit runs at shutdown.
async fn persist_leases(shared: Arc<Shared>, cancel: CancellationToken) {
    loop {
        let stop = tokio::select! {
            () = cancel.cancelled() => true,
            () = shared.lease_dirty.notified() => false,
            // the retry timer (a commit with nothing to write costs no I/O)
            () = tokio::time::sleep(durable::RETRY) => false,
        };
        let s = shared.clone();
        if let Err(e) = tokio::task::spawn_blocking(move || s.commit_leases()).await {
            tracing::error!(error = %error_chain(&e), "lease writer panicked");
        }
        if stop {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

impl Server {
    /// Loads and filters the lease file, binds every listener and starts serving.
    pub async fn start(opts: ServerOptions, snapshot: Snapshot) -> Result<Server, ServerError> {
        let template = match &opts.template {
            Some(p) => std::fs::read_to_string(p).map_err(|source| ServerError::Template {
                path: p.clone(),
                source,
            })?,
            None => script::BOOT_TEMPLATE.to_owned(),
        };
        let mut leases = Leases::default();
        let mut lease_log = None;
        if let Some(path) = &opts.lease_file {
            // A file that does not read or parse stops the start (it must
            // not be overwritten); one that does not write does not.
            let (store, loaded) = leasefile::LeaseStore::open(path)?;
            leases = Leases::from_leases(loaded);
            let gone = state::filter_leases(&mut leases, &snapshot.table);
            for l in &gone {
                tracing::info!(mac = %l.mac, address = %l.address, "dropped persisted lease: mac not in the allowlist");
            }
            tracing::info!(
                kept = leases.active(),
                dropped = gone.len(),
                "lease file loaded"
            );
            // from here on, every change is journaled
            leases.track_changes();
            lease_log = Some(durable::LeaseLog::new(path, store));
        }
        let shared = Arc::new(Shared::new(snapshot, leases, template).with_lease_log(lease_log));
        // The first write compacts the loaded (and filtered) table before the
        // first packet is answered; when it fails bootd serves from memory
        // and the persister retries.
        if shared.lease_log.is_some() {
            let s = shared.clone();
            let _ = tokio::task::spawn_blocking(move || s.commit_leases()).await;
        }
        let cancel = CancellationToken::new();
        let mut tasks = JoinSet::new();
        let iface = opts.interface.as_deref();

        let dhcp_addr = SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, opts.dhcp_port);
        let s = dhcp::udp_socket(dhcp_addr, iface).map_err(bind_err("dhcp", dhcp_addr.into()))?;
        tasks.spawn_blocking(dhcp::serve_thread(
            shared.clone(),
            s,
            ServerPort::Dhcp,
            opts.interface.clone(),
            cancel.clone(),
        ));
        if opts.pxe_port != 0 {
            let a = SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, opts.pxe_port);
            let s = dhcp::udp_socket(a, iface).map_err(bind_err("pxe", a.into()))?;
            tasks.spawn_blocking(dhcp::serve_thread(
                shared.clone(),
                s,
                ServerPort::PxeBoot,
                opts.interface.clone(),
                cancel.clone(),
            ));
        }
        let mut tftp_addr = None;
        if opts.tftp_port != 0 {
            let a = SocketAddrV4::new(opts.listen_ip, opts.tftp_port);
            let s = std::net::UdpSocket::bind(a).map_err(bind_err("tftp", a.into()))?;
            tftp_addr = s.local_addr().ok();
            let srv = tftp::server(shared.clone(), s)
                .await?
                .with_limits(opts.tftp_limits);
            let c = cancel.clone();
            tasks.spawn(async move {
                tokio::select! {
                    () = c.cancelled() => {}
                    r = srv.serve() => if let Err(e) = r {
                        tracing::error!(error = %error_chain(&e), "tftp server stopped");
                    },
                }
            });
        }
        let ha = SocketAddr::V4(SocketAddrV4::new(opts.listen_ip, opts.http_port));
        let l = tokio::net::TcpListener::bind(ha)
            .await
            .map_err(bind_err("http", ha))?;
        let http_addr = l.local_addr().map_err(bind_err("http", ha))?;
        tasks.spawn(http::serve(
            shared.clone(),
            l,
            opts.http_limits,
            cancel.clone(),
        ));
        if let Some(o6) = &opts.dhcp6 {
            let iface = opts
                .interface
                .as_deref()
                .ok_or(ServerError::Dhcp6NeedsInterface)?;
            spawn_dhcp6(
                &mut tasks,
                &shared,
                o6,
                iface,
                opts.router_advertisements,
                http_addr.port(),
                &cancel,
            )?;
            if opts.tftp_port != 0 {
                let a = SocketAddr::new(o6.server_ip.into(), opts.tftp_port);
                let s = std::net::UdpSocket::bind(a).map_err(bind_err("tftp (ipv6)", a))?;
                let srv = tftp::server(shared.clone(), s)
                    .await?
                    .with_limits(opts.tftp_limits);
                let c = cancel.clone();
                tasks.spawn(async move {
                    tokio::select! {
                        () = c.cancelled() => {}
                        r = srv.serve() => if let Err(e) = r {
                            tracing::error!(error = %error_chain(&e), "tftp (ipv6) server stopped");
                        },
                    }
                });
            }
            let ha6 = SocketAddr::new(o6.server_ip.into(), http_addr.port());
            let l6 = tokio::net::TcpListener::bind(ha6)
                .await
                .map_err(bind_err("http (ipv6)", ha6))?;
            tasks.spawn(http::serve(
                shared.clone(),
                l6,
                opts.http_limits,
                cancel.clone(),
            ));
            tracing::info!(server_ip = %o6.server_ip, prefix = %o6.prefix, "dhcpv6 serving");
        }
        tasks.spawn(collect_leases(shared.clone(), cancel.clone()));
        if shared.lease_log.is_some() {
            tasks.spawn(persist_leases(shared.clone(), cancel.clone()));
        }
        tracing::info!(
            revision = %shared.snapshot().table.revision,
            mode = ?shared.snapshot().table.mode,
            %http_addr,
            "bootd serving"
        );
        Ok(Server {
            shared,
            cancel,
            tasks,
            http_addr,
            tftp_addr,
        })
    }

    /// The shared state (metrics, leases, snapshot).
    pub fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }

    /// Makes a new table live.
    pub fn install(&self, snap: Snapshot) {
        self.shared.install(snap);
    }

    /// Stops every task (the lease file gets a final write).
    pub async fn shutdown(mut self) {
        self.cancel.cancel();
        while self.tasks.join_next().await.is_some() {}
    }
}

/// Dropping a server without [`Server::shutdown`] (a test that failed)
/// still stops its tasks: the DHCP threads end at the cancellation, so a
/// runtime waiting for its blocking threads does not wait forever.
impl Drop for Server {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

/// Runs `f` on a fresh thread that has entered the network namespace
/// `/run/netns/NAME` (namespaces are per thread; the caller's is untouched).
pub fn in_netns<T: Send + 'static>(
    netns: &str,
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, ServerError> {
    let name = netns.to_owned();
    let err = |source| ServerError::Netns {
        name: netns.to_owned(),
        source,
    };
    std::thread::spawn(move || -> std::io::Result<T> {
        let file = std::fs::File::open(format!("/run/netns/{name}"))?;
        nix::sched::setns(file, nix::sched::CloneFlags::CLONE_NEWNET)
            .map_err(std::io::Error::from)?;
        Ok(f())
    })
    .join()
    .map_err(|_| ServerError::ThreadGone)?
    .map_err(err)
}

/// A [`Server`] running on its own thread inside a named network namespace
/// (`/run/netns/NAME`). Dropping it stops the server.
#[derive(Debug)]
pub struct NetnsServer {
    shared: Arc<Shared>,
    cancel: CancellationToken,
    thread: Option<std::thread::JoinHandle<()>>,
    pub http_addr: SocketAddr,
}

impl NetnsServer {
    /// Starts `Server::start(opts, snapshot)` inside `netns`.
    pub fn start(
        netns: &str,
        opts: ServerOptions,
        snapshot: Snapshot,
    ) -> Result<NetnsServer, ServerError> {
        let (tx, rx) = std::sync::mpsc::channel();
        let name = netns.to_owned();
        let thread = std::thread::Builder::new()
            .name(format!("bootd-{name}"))
            .spawn(move || {
                let enter = || -> std::io::Result<tokio::runtime::Runtime> {
                    let f = std::fs::File::open(format!("/run/netns/{name}"))?;
                    nix::sched::setns(f, nix::sched::CloneFlags::CLONE_NEWNET)
                        .map_err(std::io::Error::from)?;
                    tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                };
                let rt = match enter() {
                    Ok(rt) => rt,
                    Err(source) => {
                        let _ = tx.send(Err(ServerError::Netns { name, source }));
                        return;
                    }
                };
                rt.block_on(async move {
                    match Server::start(opts, snapshot).await {
                        Ok(srv) => {
                            let cancel = CancellationToken::new();
                            let _ =
                                tx.send(Ok((srv.shared.clone(), cancel.clone(), srv.http_addr)));
                            cancel.cancelled().await;
                            srv.shutdown().await;
                        }
                        Err(e) => {
                            let _ = tx.send(Err(e));
                        }
                    }
                });
            })
            .map_err(|source| ServerError::Netns {
                name: netns.to_owned(),
                source,
            })?;
        let (shared, cancel, http_addr) = rx.recv().map_err(|_| ServerError::ThreadGone)??;
        Ok(NetnsServer {
            shared,
            cancel,
            thread: Some(thread),
            http_addr,
        })
    }

    /// The shared state.
    pub fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }

    /// Stops the server and waits for its thread.
    pub fn stop(mut self) {
        self.stop_inner();
    }

    fn stop_inner(&mut self) {
        self.cancel.cancel();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for NetnsServer {
    fn drop(&mut self) {
        self.stop_inner();
    }
}
