//! The LLDP listener of the inspection (docs/api.md, MachineHardware
//! `nics[].lldp`): one `AF_PACKET` socket per link bound to EtherType
//! 0x88cc and joined to the LLDP group addresses, a thread per link that
//! keeps the first valid frame, all of it bounded by a window. The frames
//! themselves are parsed by [`crate::net::lldp`].
//!
//! The window starts when the listener does (the agent starts it before the
//! boot network comes up, so a switch's frame at link-up counts) and ends
//! once [`Listener::finish`] is called and the window has passed, or earlier
//! when every link has its frame.

use std::collections::BTreeMap;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anneal_api::agent::{Lldp, Nic};
use nix::sys::socket::{AddressFamily, MsgFlags, SockFlag, SockType, recv, setsockopt, socket};
use nix::sys::time::TimeVal;

use crate::net::lldp::{self, Neighbor};
use crate::net::netlink::Netlink;

/// The window when the kernel command line does not set one
/// (`anneal.lldp`).
pub const DEFAULT_WAIT: Duration = Duration::from_secs(3);

/// How often a link's thread looks at the stop flag between frames.
const TICK: Duration = Duration::from_millis(100);

/// Frames longer than this are cut (an LLDPDU fits in 1500 bytes).
const FRAME_MAX: usize = 2048;

/// An error opening a link's socket.
#[derive(Debug, thiserror::Error)]
#[error("cannot listen for LLDP on {ifname}")]
pub struct ListenError {
    /// The link.
    pub ifname: String,
    /// The cause.
    #[source]
    pub source: io::Error,
}

/// A link to listen on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Link {
    /// Kernel name.
    pub name: String,
    /// Interface index.
    pub index: u32,
}

/// Listening threads, one per link, until [`Listener::finish`].
#[derive(Debug)]
pub struct Listener {
    stop: Arc<AtomicBool>,
    threads: Vec<(String, JoinHandle<Option<Neighbor>>)>,
}

impl Listener {
    /// Brings each link up (best effort: a link that stays down just hears
    /// nothing) and starts listening on it for `wait` at least. Links
    /// whose socket cannot be opened are returned as errors and skipped.
    pub fn start(links: &[Link], wait: Duration) -> (Self, Vec<ListenError>) {
        let started = Instant::now();
        let stop = Arc::new(AtomicBool::new(false));
        let mut threads = Vec::new();
        let mut errors = Vec::new();
        let mut nl = Netlink::open().ok();
        for link in links {
            if let Some(nl) = nl.as_mut() {
                let _ = nl.link_up(link.index);
            }
            let err = |source| ListenError {
                ifname: link.name.clone(),
                source,
            };
            let fd = match open(link.index) {
                Ok(fd) => fd,
                Err(e) => {
                    errors.push(err(e));
                    continue;
                }
            };
            let stop = Arc::clone(&stop);
            let spawned = std::thread::Builder::new()
                .name(format!("lldp-{}", link.name))
                .spawn(move || first_frame(&fd, &stop, started + wait));
            match spawned {
                Ok(h) => threads.push((link.name.clone(), h)),
                Err(e) => errors.push(err(e)),
            }
        }
        (Self { stop, threads }, errors)
    }

    /// Waits for the rest of the window (or until every link has its
    /// frame) and gives the neighbour each link heard, by link name.
    pub fn finish(self) -> BTreeMap<String, Lldp> {
        self.stop.store(true, Ordering::Relaxed);
        let mut out = BTreeMap::new();
        for (name, h) in self.threads {
            if let Ok(Some(n)) = h.join() {
                out.insert(name, report(n));
            }
        }
        out
    }
}

/// The physical Ethernet links of a `/sys/class/net` (those the inventory
/// reports as NICs).
pub fn links(sys_class_net: &std::path::Path) -> Vec<Link> {
    crate::net::interfaces(sys_class_net)
        .into_iter()
        .map(|i| Link {
            name: i.name,
            index: i.index,
        })
        .collect()
}

/// Listens on `links` for `wait` (0: not at all) and gives what each heard.
pub fn listen(links: &[Link], wait: Duration) -> (BTreeMap<String, Lldp>, Vec<ListenError>) {
    if wait.is_zero() {
        return (BTreeMap::new(), Vec::new());
    }
    let (l, errors) = Listener::start(links, wait);
    (l.finish(), errors)
}

/// Sets each NIC's `lldp` from what its link heard.
pub fn annotate(nics: &mut [Nic], heard: &BTreeMap<String, Lldp>) {
    for nic in nics {
        nic.lldp = heard.get(&nic.name).cloned();
    }
}

/// The inventory's view of a neighbour.
fn report(n: Neighbor) -> Lldp {
    Lldp {
        chassis_id: n.chassis_id,
        port_id: n.port_id,
        port_description: n.port_description,
        system_name: n.system_name,
    }
}

/// The first frame that parses and announces a live neighbour (a TTL of 0
/// is a shutdown), or `None` once `stop` is set and `deadline` passed, or
/// when the socket fails.
fn first_frame(fd: &OwnedFd, stop: &AtomicBool, deadline: Instant) -> Option<Neighbor> {
    let mut buf = vec![0u8; FRAME_MAX];
    loop {
        if stop.load(Ordering::Relaxed) && Instant::now() >= deadline {
            return None;
        }
        match recv(fd.as_raw_fd(), &mut buf, MsgFlags::empty()) {
            Ok(n) => {
                if let Some(nb) = buf
                    .get(..n)
                    .and_then(|f| lldp::parse(f).ok())
                    .filter(|nb| nb.ttl > 0)
                {
                    return Some(nb);
                }
            }
            Err(nix::errno::Errno::EAGAIN | nix::errno::Errno::EINTR) => {}
            Err(_) => return None,
        }
    }
}

/// A packet socket receiving the LLDP frames of one link.
fn open(ifindex: u32) -> io::Result<OwnedFd> {
    let ifindex = i32::try_from(ifindex).map_err(io::Error::other)?;
    // protocol 0: nothing arrives until bind names LLDP and the link
    let fd = socket(
        AddressFamily::Packet,
        SockType::Raw,
        SockFlag::SOCK_CLOEXEC,
        None,
    )?;
    let tick = TimeVal::new(0, i64::try_from(TICK.as_micros()).unwrap_or(100_000));
    setsockopt(&fd, nix::sys::socket::sockopt::ReceiveTimeout, &tick)?;
    sys::bind(&fd, ifindex, lldp::ETHERTYPE)?;
    for group in lldp::DESTINATIONS {
        sys::add_multicast(&fd, ifindex, group)?;
    }
    Ok(fd)
}

/// The two packet-socket calls nix has no safe wrapper for.
#[allow(unsafe_code)]
mod sys {
    use std::io;
    use std::os::fd::{AsRawFd, OwnedFd};

    use nix::libc;

    /// Binds a packet socket to one EtherType on one link.
    pub fn bind(fd: &OwnedFd, ifindex: i32, ethertype: u16) -> io::Result<()> {
        let sll = libc::sockaddr_ll {
            sll_family: u16::try_from(libc::AF_PACKET).map_err(io::Error::other)?,
            sll_protocol: ethertype.to_be(),
            sll_ifindex: ifindex,
            sll_hatype: 0,
            sll_pkttype: 0,
            sll_halen: 0,
            sll_addr: [0; 8],
        };
        let len =
            u32::try_from(std::mem::size_of::<libc::sockaddr_ll>()).map_err(io::Error::other)?;
        // SAFETY: `fd` is an open socket for the duration of the call;
        // `sll` is a fully initialised sockaddr_ll that outlives the call,
        // and `len` is its size, so the kernel reads only that struct.
        let r = unsafe {
            libc::bind(
                fd.as_raw_fd(),
                (&raw const sll).cast::<libc::sockaddr>(),
                len,
            )
        };
        if r == 0 {
            Ok(())
        } else {
            Err(io::Error::last_os_error())
        }
    }

    /// Joins a link-layer multicast group on one link (left when the
    /// socket closes), so a NIC's filter lets the group's frames in.
    pub fn add_multicast(fd: &OwnedFd, ifindex: i32, group: [u8; 6]) -> io::Result<()> {
        let mut addr = [0u8; 8];
        addr[..6].copy_from_slice(&group);
        let mreq = libc::packet_mreq {
            mr_ifindex: ifindex,
            mr_type: u16::try_from(libc::PACKET_MR_MULTICAST).map_err(io::Error::other)?,
            mr_alen: 6,
            mr_address: addr,
        };
        let len =
            u32::try_from(std::mem::size_of::<libc::packet_mreq>()).map_err(io::Error::other)?;
        // SAFETY: `fd` is an open socket for the duration of the call;
        // `mreq` is a fully initialised packet_mreq that outlives the call
        // and `len` is its size, which is what PACKET_ADD_MEMBERSHIP reads.
        let r = unsafe {
            libc::setsockopt(
                fd.as_raw_fd(),
                libc::SOL_PACKET,
                libc::PACKET_ADD_MEMBERSHIP,
                (&raw const mreq).cast::<libc::c_void>(),
                len,
            )
        };
        if r == 0 {
            Ok(())
        } else {
            Err(io::Error::last_os_error())
        }
    }
}
