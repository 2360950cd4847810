//! Network namespaces with a bridge, IPv6 router advertisements and taps.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::Mutex;

use crate::procs::ChildGroup;
use crate::{run, unique_name};

/// A network namespace holding bridge `br0` (10.77.0.1/24, fd77::1/64) with
/// radvd sending router advertisements on it. Taps added with
/// [`Netns::add_tap`] are enslaved to the bridge. Dropping it stops radvd and
/// deletes the namespace with every interface in it.
#[derive(Debug)]
pub struct Netns {
    name: String,
    dir: tempfile::TempDir,
    radvd: Option<ChildGroup>,
    taps: Mutex<Vec<String>>,
    peers: Mutex<Vec<String>>,
}

/// The bridge address inside every test namespace.
pub const BRIDGE_IP: &str = "10.77.0.1";

impl Netns {
    /// Creates a namespace named `<prefix><unique>` with a bridge and router
    /// advertisements.
    pub fn create(prefix: &str) -> anyhow::Result<Self> {
        let ns = Self::bare(prefix)?;
        ns.ip(&["link", "add", "br0", "type", "bridge", "forward_delay", "0"])?;
        ns.ip(&["addr", "add", "10.77.0.1/24", "dev", "br0"])?;
        ns.ip(&["-6", "addr", "add", "fd77::1/64", "dev", "br0", "nodad"])?;
        ns.ip(&["link", "set", "br0", "up"])?;
        Ok(ns)
    }

    /// Creates an empty namespace (only `lo`, up).
    pub fn bare(prefix: &str) -> anyhow::Result<Self> {
        let name = unique_name(prefix);
        run(Command::new("ip").args(["netns", "add", &name]))?;
        let dir = tempfile::Builder::new().prefix("anneal-ns-").tempdir()?;
        let ns = Self {
            name,
            dir,
            radvd: None,
            taps: Mutex::new(Vec::new()),
            peers: Mutex::new(Vec::new()),
        };
        ns.ip(&["link", "set", "lo", "up"])?;
        Ok(ns)
    }

    /// Starts radvd on `br0` so iPXE and the kernel get an IPv6 prefix at once.
    pub fn start_router_advertisements(&mut self) -> anyhow::Result<()> {
        self.radvd_with("", "on")
    }

    /// radvd on `br0` for an IPv6-only provisioning segment: the managed
    /// flag set and no SLAAC on the prefix, so clients (iPXE too) take
    /// their address, and their boot URL, from DHCPv6.
    pub fn start_managed_router_advertisements(&mut self) -> anyhow::Result<()> {
        self.radvd_with("  AdvManagedFlag on;\n", "off")
    }

    fn radvd_with(&mut self, flags: &str, autonomous: &str) -> anyhow::Result<()> {
        let conf = self.dir.path().join("radvd.conf");
        std::fs::write(
            &conf,
            format!(
                "interface br0 {{\n  AdvSendAdvert on;\n  MinRtrAdvInterval 3;\n  MaxRtrAdvInterval 10;\n{flags}  prefix fd77::/64 {{ AdvOnLink on; AdvAutonomous {autonomous}; }};\n}};\n"
            ),
        )?;
        run(self
            .exec("sysctl")
            .args(["-qw", "net.ipv6.conf.all.forwarding=1"]))?;
        let pid = self.dir.path().join("radvd.pid");
        let log = std::fs::File::create(self.dir.path().join("radvd.log"))?;
        let child = ChildGroup::spawn(
            "radvd",
            self.exec("radvd")
                .arg("--nodaemon")
                .arg(format!("--config={}", conf.display()))
                .arg(format!("--pidfile={}", pid.display()))
                .arg("--logmethod=stderr")
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(log),
        )?;
        self.radvd = Some(child);
        Ok(())
    }

    /// The namespace's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// A scratch directory that lives as long as the namespace.
    pub fn dir(&self) -> PathBuf {
        self.dir.path().to_path_buf()
    }

    /// `ip -n <ns> <args>`.
    pub fn ip(&self, args: &[&str]) -> anyhow::Result<String> {
        run(Command::new("ip").arg("-n").arg(&self.name).args(args))
    }

    /// A command that runs `program` inside the namespace.
    pub fn exec(&self, program: &str) -> Command {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.name, program]);
        cmd
    }

    /// Adds a tap (`tapN`) enslaved to `br0` and returns its name.
    pub fn add_tap(&self) -> anyhow::Result<String> {
        let mut taps = self
            .taps
            .lock()
            .map_err(|_| anyhow::anyhow!("tap list poisoned"))?;
        let tap = format!("tap{}", taps.len());
        self.ip(&["tuntap", "add", "dev", &tap, "mode", "tap"])?;
        self.ip(&["link", "set", &tap, "master", "br0"])?;
        self.ip(&["link", "set", &tap, "up"])?;
        taps.push(tap.clone());
        Ok(tap)
    }

    /// Joins this namespace to `other` with a veth pair: `local_if` here with
    /// `local_cidr`, `peer_if` there with `peer_cidr` (either may be empty
    /// for no address). When `local_if` is `br0`-enslaved use
    /// [`Netns::add_veth_to_bridge`] instead.
    pub fn link(
        &self,
        other: &Netns,
        local_if: &str,
        local_cidr: &str,
        peer_if: &str,
        peer_cidr: &str,
    ) -> anyhow::Result<()> {
        self.ip(&[
            "link",
            "add",
            local_if,
            "type",
            "veth",
            "peer",
            "name",
            peer_if,
            "netns",
            &other.name,
        ])?;
        if !local_cidr.is_empty() {
            self.ip(&["addr", "add", local_cidr, "dev", local_if])?;
        }
        if !peer_cidr.is_empty() {
            other.ip(&["addr", "add", peer_cidr, "dev", peer_if])?;
        }
        self.ip(&["link", "set", local_if, "up"])?;
        other.ip(&["link", "set", peer_if, "up"])?;
        if let Ok(mut peers) = self.peers.lock() {
            peers.push(local_if.to_string());
        }
        Ok(())
    }

    /// Like [`Netns::link`], with the local end enslaved to `br0` (no address).
    pub fn add_veth_to_bridge(
        &self,
        other: &Netns,
        local_if: &str,
        peer_if: &str,
        peer_cidr: &str,
    ) -> anyhow::Result<()> {
        self.link(other, local_if, "", peer_if, peer_cidr)?;
        self.ip(&["link", "set", local_if, "master", "br0"])?;
        Ok(())
    }

    /// Names of every interface in the namespace (for cleanup assertions).
    pub fn interfaces(&self) -> anyhow::Result<Vec<String>> {
        let out = self.ip(&["-o", "link", "show"])?;
        Ok(out
            .lines()
            .filter_map(|l| l.split(':').nth(1))
            .map(|n| n.trim().split('@').next().unwrap_or("").to_string())
            .collect())
    }

    /// PID of radvd, if started.
    pub fn radvd_pid(&self) -> Option<u32> {
        self.radvd.as_ref().map(ChildGroup::pid)
    }

    /// True if a namespace with this name exists.
    pub fn exists(name: &str) -> bool {
        std::path::Path::new("/run/netns").join(name).exists()
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        if let Some(mut radvd) = self.radvd.take() {
            radvd.kill();
        }
        // Deleting the namespace destroys its bridge, taps and veth ends.
        let _ = Command::new("ip")
            .args(["netns", "delete", &self.name])
            .status();
    }
}

/// A TCP relay from an address inside a namespace to one in the host
/// namespace (see [`Netns::forward_tcp`]). Dropping it stops accepting;
/// connections already relayed end when either side closes.
#[derive(Debug)]
pub struct TcpForward {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
    /// The address listening inside the namespace.
    pub listen: std::net::SocketAddr,
}

impl Drop for TcpForward {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn pump(mut from: std::net::TcpStream, mut to: std::net::TcpStream) {
    let _ = std::io::copy(&mut from, &mut to);
    let _ = to.shutdown(std::net::Shutdown::Write);
}

/// Accepts on `listener` (non-blocking) and relays each connection to
/// `target` until `stop`.
fn relay_loop(
    listener: &std::net::TcpListener,
    target: std::net::SocketAddr,
    stop: &std::sync::atomic::AtomicBool,
) {
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        match listener.accept() {
            Ok((inbound, _)) => {
                let _ = inbound.set_nonblocking(false);
                let Ok(outbound) = std::net::TcpStream::connect(target) else {
                    continue;
                };
                let (Ok(in2), Ok(out2)) = (inbound.try_clone(), outbound.try_clone()) else {
                    continue;
                };
                std::thread::spawn(move || pump(inbound, outbound));
                std::thread::spawn(move || pump(out2, in2));
            }
            Err(_) => std::thread::sleep(std::time::Duration::from_millis(20)),
        }
    }
}

/// Listens on `listen` in the host namespace and relays every connection to
/// `target` (for example the test node's address to an API server on host
/// loopback, for pods on the node's pod network).
pub fn forward_host_tcp(
    listen: std::net::SocketAddr,
    target: std::net::SocketAddr,
) -> anyhow::Result<TcpForward> {
    let listener = std::net::TcpListener::bind(listen)
        .map_err(|e| anyhow::anyhow!("binding {listen}: {e}"))?;
    listener.set_nonblocking(true)?;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let stop2 = stop.clone();
    let thread = std::thread::Builder::new()
        .name(format!("fwd-{listen}"))
        .spawn(move || relay_loop(&listener, target, &stop2))?;
    Ok(TcpForward {
        stop,
        thread: Some(thread),
        listen,
    })
}

impl Netns {
    /// Listens on `listen` inside this namespace and relays every connection
    /// to `target` in the host namespace (for example a manager or API
    /// server on host loopback that a VM must reach). The traffic never
    /// leaves the machine: one end is in the test's namespace, the other on
    /// host loopback.
    pub fn forward_tcp(
        &self,
        listen: std::net::SocketAddr,
        target: std::net::SocketAddr,
    ) -> anyhow::Result<TcpForward> {
        use nix::sched::{CloneFlags, setns};
        use std::sync::atomic::AtomicBool;

        let host_ns = std::fs::File::open("/proc/thread-self/ns/net")?;
        let ns_file = std::fs::File::open(format!("/run/netns/{}", self.name))?;
        let stop = std::sync::Arc::new(AtomicBool::new(false));
        let stop2 = stop.clone();
        let (tx, rx) = std::sync::mpsc::channel();
        let thread = std::thread::Builder::new()
            .name(format!("fwd-{}", self.name))
            .spawn(move || {
                // Network namespaces are per thread: bind inside, then come
                // back so the outgoing connections are made on the host.
                let bound = setns(&ns_file, CloneFlags::CLONE_NEWNET)
                    .map_err(|e| anyhow::anyhow!("setns into test namespace: {e}"))
                    .and_then(|()| Ok(std::net::TcpListener::bind(listen)?))
                    .and_then(|l| {
                        setns(&host_ns, CloneFlags::CLONE_NEWNET)
                            .map_err(|e| anyhow::anyhow!("setns back to host: {e}"))?;
                        l.set_nonblocking(true)?;
                        Ok(l)
                    });
                let listener = match bound {
                    Ok(l) => {
                        let _ = tx.send(Ok(()));
                        l
                    }
                    Err(e) => {
                        let _ = tx.send(Err(e));
                        return;
                    }
                };
                relay_loop(&listener, target, &stop2);
            })?;
        rx.recv()
            .map_err(|_| anyhow::anyhow!("relay thread ended early"))??;
        Ok(TcpForward {
            stop,
            thread: Some(thread),
            listen,
        })
    }
}
