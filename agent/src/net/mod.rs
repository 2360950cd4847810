//! Bringing the boot network up: pick the NIC (`BOOTIF`, else race every
//! link with carrier), wait for carrier, DHCP or the static `anneal.ip`,
//! address and default route over netlink, `/etc/resolv.conf`.

pub mod dhcp;
pub mod netlink;

use std::fs;
use std::net::Ipv4Addr;
use std::path::Path;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anneal_api::{Mac, error_chain};

use crate::cmdline::StaticIp;
use crate::say;

/// A network bring-up failure, worded for the console.
#[derive(Debug, thiserror::Error)]
pub enum NetError {
    /// No Ethernet device at all.
    #[error("no Ethernet interface found (is the NIC's driver in the initramfs?)")]
    NoInterfaces,
    /// BOOTIF names a MAC no interface has.
    #[error("no interface has the BOOTIF MAC {0} (is its driver in the initramfs?)")]
    BootifMissing(Mac),
    /// No carrier anywhere before the link timeout.
    #[error("no link with carrier within {0} s (check cabling and the switch port)")]
    NoCarrier(u64),
    /// DHCP failed on every candidate.
    #[error("DHCP failed on every link with carrier: {0}")]
    Dhcp(String),
    /// Netlink configuration failed.
    #[error("configuring {ifname}")]
    Configure {
        /// The interface.
        ifname: String,
        /// The cause.
        #[source]
        source: netlink::NetlinkError,
    },
}

/// A network interface as the kernel shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Interface {
    /// Kernel name.
    pub name: String,
    /// Interface index.
    pub index: u32,
    /// MAC.
    pub mac: Mac,
}

/// Physical Ethernet interfaces under `sys_class_net`, sorted by name.
pub fn interfaces(sys_class_net: &Path) -> Vec<Interface> {
    let Ok(entries) = fs::read_dir(sys_class_net) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for e in entries.flatten() {
        let dir = e.path();
        let read = |f: &str| {
            fs::read_to_string(dir.join(f))
                .map(|s| s.trim().to_string())
                .unwrap_or_default()
        };
        if !dir.join("device").exists() || read("type") != "1" {
            continue;
        }
        let (Ok(index), Some(mac)) = (
            read("ifindex").parse::<u32>(),
            read("address").parse::<Mac>().ok(),
        ) else {
            continue;
        };
        out.push(Interface {
            name: e.file_name().to_string_lossy().to_string(),
            index,
            mac,
        });
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out
}

fn has_carrier(name: &str) -> bool {
    fs::read_to_string(format!("/sys/class/net/{name}/carrier"))
        .map(|s| s.trim() == "1")
        .unwrap_or(false)
}

/// The configured boot interface.
#[derive(Debug, Clone)]
pub struct Configured {
    /// The interface.
    pub iface: Interface,
    /// Address and prefix.
    pub address: Ipv4Addr,
    /// Prefix length.
    pub prefix: u8,
    /// Gateway.
    pub gateway: Option<Ipv4Addr>,
    /// When the address was in place.
    pub at: Instant,
}

/// Timeouts of the bring-up.
#[derive(Debug, Clone, Copy)]
pub struct Timeouts {
    /// How long to wait for carrier.
    pub link: Duration,
    /// How long DHCP may take on one link.
    pub dhcp: Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        Self {
            link: Duration::from_secs(30),
            dhcp: Duration::from_secs(30),
        }
    }
}

/// Brings the boot network up, printing a console line for each step.
pub fn bring_up(
    bootif: Option<Mac>,
    static_ip: Option<StaticIp>,
    timeouts: Timeouts,
) -> Result<Configured, NetError> {
    let mut nl = netlink::Netlink::open().map_err(|source| NetError::Configure {
        ifname: "lo".into(),
        source,
    })?;
    // Loopback first: some tools expect it.
    if let Some(lo) = fs::read_to_string("/sys/class/net/lo/ifindex")
        .ok()
        .and_then(|s| s.trim().parse::<u32>().ok())
    {
        let _ = nl.link_up(lo);
        let _ = nl.add_address(lo, Ipv4Addr::LOCALHOST, 8);
    }
    let all = wait_for_interfaces(bootif, Duration::from_secs(5));
    if all.is_empty() {
        return Err(NetError::NoInterfaces);
    }
    let candidates: Vec<Interface> = match bootif {
        Some(mac) => {
            let c: Vec<Interface> = all.into_iter().filter(|i| i.mac == mac).collect();
            if c.is_empty() {
                return Err(NetError::BootifMissing(mac));
            }
            c
        }
        None => all,
    };
    for i in &candidates {
        nl.link_up(i.index).map_err(|source| NetError::Configure {
            ifname: i.name.clone(),
            source,
        })?;
    }
    let names: Vec<&str> = candidates.iter().map(|i| i.name.as_str()).collect();
    say!("waiting for carrier on {}", names.join(", "));
    let started = Instant::now();
    let mut up: Vec<Interface> = Vec::new();
    while started.elapsed() < timeouts.link {
        up = candidates
            .iter()
            .filter(|i| has_carrier(&i.name))
            .cloned()
            .collect();
        if !up.is_empty() {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    if up.is_empty() {
        return Err(NetError::NoCarrier(timeouts.link.as_secs()));
    }
    for i in &up {
        say!(
            "link up on {} ({}) after {:.1} s",
            i.name,
            i.mac,
            started.elapsed().as_secs_f64()
        );
    }
    let (iface, address, prefix, gateway) = match static_ip {
        Some(s) => {
            let iface = up[0].clone();
            say!(
                "static address {}/{} on {} (anneal.ip), gateway {}",
                s.address,
                s.prefix,
                iface.name,
                s.gateway.map_or("none".to_string(), |g| g.to_string())
            );
            (iface, s.address, s.prefix, s.gateway)
        }
        None => {
            let (iface, lease) = race_dhcp(&up, timeouts.dhcp)?;
            say!(
                "DHCP lease {}/{} on {} from {}, router {}, lease {} s",
                lease.address,
                lease.prefix,
                iface.name,
                lease.server,
                lease.router.map_or("none".to_string(), |g| g.to_string()),
                lease.lease_secs.unwrap_or(0)
            );
            write_resolv_conf(&lease.dns);
            keep_lease(iface.clone(), lease.clone());
            (iface, lease.address, lease.prefix, lease.router)
        }
    };
    let cfg_err = |source| NetError::Configure {
        ifname: iface.name.clone(),
        source,
    };
    nl.add_address(iface.index, address, prefix)
        .map_err(cfg_err)?;
    if let Some(gw) = gateway {
        nl.add_default_route(iface.index, gw).map_err(cfg_err)?;
    }
    say!(
        "network configured: {}/{} on {}",
        address,
        prefix,
        iface.name
    );
    Ok(Configured {
        iface,
        address,
        prefix,
        gateway,
        at: Instant::now(),
    })
}

fn wait_for_interfaces(bootif: Option<Mac>, wait: Duration) -> Vec<Interface> {
    let start = Instant::now();
    loop {
        let all = interfaces(Path::new("/sys/class/net"));
        let done = match bootif {
            Some(mac) => all.iter().any(|i| i.mac == mac),
            None => !all.is_empty(),
        };
        if done || start.elapsed() >= wait {
            return all;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Runs DHCP on every candidate at once; the first lease wins.
fn race_dhcp(up: &[Interface], timeout: Duration) -> Result<(Interface, dhcp::Lease), NetError> {
    if up.len() == 1 {
        say!("DHCP on {}", up[0].name);
        return dhcp::acquire(&up[0].name, up[0].mac, timeout)
            .map(|l| (up[0].clone(), l))
            .map_err(|e| NetError::Dhcp(error_chain(&e)));
    }
    let names: Vec<&str> = up.iter().map(|i| i.name.as_str()).collect();
    say!("DHCP racing on {}", names.join(", "));
    let (tx, rx) = mpsc::channel();
    for i in up.iter().cloned() {
        let tx = tx.clone();
        std::thread::Builder::new()
            .name(format!("dhcp-{}", i.name))
            .spawn(move || {
                let r = dhcp::acquire(&i.name, i.mac, timeout);
                let _ = tx.send((i, r));
            })
            .map_err(|e| NetError::Dhcp(e.to_string()))?;
    }
    drop(tx);
    let mut errors = Vec::new();
    for (i, r) in rx {
        match r {
            Ok(lease) => return Ok((i, lease)),
            Err(e) => errors.push(error_chain(&e)),
        }
    }
    Err(NetError::Dhcp(errors.join("; ")))
}

fn write_resolv_conf(dns: &[Ipv4Addr]) {
    if dns.is_empty() {
        return;
    }
    let body: String = dns.iter().map(|d| format!("nameserver {d}\n")).collect();
    let _ = fs::create_dir_all("/etc");
    if let Err(e) = fs::write("/etc/resolv.conf", body) {
        say!("warning: cannot write /etc/resolv.conf: {e}");
    }
}

/// Keeps a DHCP lease alive for as long as the agent runs: renews at half the
/// lease time; when renewal fails until the lease is gone, starts over and
/// re-applies the address it gets.
fn keep_lease(iface: Interface, lease: dhcp::Lease) {
    let spawned = std::thread::Builder::new()
        .name("dhcp-lease".into())
        .spawn(move || {
            let mut lease = lease;
            loop {
                let total = Duration::from_secs(u64::from(lease.lease_secs.unwrap_or(3600)));
                let granted = Instant::now();
                std::thread::sleep((total / 2).max(Duration::from_secs(30)));
                let mut renewed = None;
                while granted.elapsed() < total {
                    match dhcp::renew(&iface.name, iface.mac, &lease, Duration::from_secs(10)) {
                        Ok(l) => {
                            renewed = Some(l);
                            break;
                        }
                        Err(e) => {
                            say!("DHCP renewal on {} failed: {e}; retrying", iface.name);
                            std::thread::sleep(Duration::from_secs(20));
                        }
                    }
                }
                let next = match renewed {
                    Some(l) => {
                        say!(
                            "DHCP lease {}/{} on {} renewed from {}, lease {} s",
                            l.address,
                            l.prefix,
                            iface.name,
                            l.server,
                            l.lease_secs.unwrap_or(0)
                        );
                        l
                    }
                    None => {
                        say!("DHCP lease on {} expired; asking again", iface.name);
                        match dhcp::acquire(&iface.name, iface.mac, Duration::from_secs(60)) {
                            Ok(l) => l,
                            Err(e) => {
                                say!("DHCP on {} failed: {e}", iface.name);
                                continue;
                            }
                        }
                    }
                };
                if next.address != lease.address || next.prefix != lease.prefix {
                    say!(
                        "DHCP moved {} from {} to {}/{}",
                        iface.name,
                        lease.address,
                        next.address,
                        next.prefix
                    );
                    let applied = netlink::Netlink::open().and_then(|mut nl| {
                        nl.add_address(iface.index, next.address, next.prefix)?;
                        match next.router {
                            Some(gw) => nl.add_default_route(iface.index, gw),
                            None => Ok(()),
                        }
                    });
                    if let Err(e) = applied {
                        say!("re-applying the address failed: {}", error_chain(&e));
                    }
                }
                lease = next;
            }
        });
    if let Err(e) = spawned {
        say!("warning: cannot start the DHCP lease keeper: {e}");
    }
}
