//! Bringing the boot network up: pick the NIC (`BOOTIF`, else race every
//! link with carrier), wait for carrier, DHCP or the static `anneal.ip`
//! (DHCPv6 instead when the agent API is an IPv6 address), address and
//! default route over netlink, `/etc/resolv.conf`.

pub mod dhcp;
pub mod dhcp6;
pub mod lldp;
pub mod netlink;
mod udp;

use std::fs;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
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
    /// DHCPv6 failed on every candidate.
    #[error("DHCPv6 failed on every link with carrier: {0}")]
    Dhcp6(String),
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
    /// Address.
    pub address: IpAddr,
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

/// Which address family the boot network is brought up on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// DHCPv4 (or `anneal.ip`).
    V4,
    /// DHCPv6 for one address; the on-link prefix and the router come
    /// from router advertisements.
    V6,
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
    family: Family,
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
    if family == Family::V6 && static_ip.is_none() {
        return bring_up6(&mut nl, &up, timeouts);
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
            write_resolv_conf(&lease.dns.iter().map(|d| IpAddr::V4(*d)).collect::<Vec<_>>());
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
        address: IpAddr::V4(address),
        prefix,
        gateway,
        at: Instant::now(),
    })
}

/// DHCPv6 on the links with carrier (raced when there are several), the
/// address added as a /128 with its lifetimes once duplicate address
/// detection passed, the lease kept.
fn bring_up6(
    nl: &mut netlink::Netlink,
    up: &[Interface],
    timeouts: Timeouts,
) -> Result<Configured, NetError> {
    let (tx, rx) = mpsc::channel();
    let names: Vec<&str> = up.iter().map(|i| i.name.as_str()).collect();
    say!("DHCPv6 on {}", names.join(", "));
    for i in up.iter().cloned() {
        let tx = tx.clone();
        std::thread::Builder::new()
            .name(format!("dhcp6-{}", i.name))
            .spawn(move || {
                let r = wait_link_local(&i, Duration::from_secs(10))
                    .and_then(|()| dhcp6::acquire(&i.name, i.index, i.mac, timeouts.dhcp))
                    .map_err(|e| error_chain(&e));
                let _ = tx.send((i, r));
            })
            .map_err(|e| NetError::Dhcp6(e.to_string()))?;
    }
    drop(tx);
    let mut errors = Vec::new();
    let (iface, lease) = loop {
        match rx.recv() {
            Ok((i, Ok(l))) => break (i, l),
            Ok((_, Err(e))) => errors.push(e),
            Err(_) => return Err(NetError::Dhcp6(errors.join("; "))),
        }
    };
    say!(
        "DHCPv6 address {} on {}, preferred {} s, valid {} s",
        lease.address,
        iface.name,
        lease.preferred,
        lease.valid
    );
    write_resolv_conf(&lease.dns.iter().map(|d| IpAddr::V6(*d)).collect::<Vec<_>>());
    nl.add_address6(
        iface.index,
        lease.address,
        128,
        lease.preferred,
        lease.valid,
    )
    .map_err(|source| NetError::Configure {
        ifname: iface.name.clone(),
        source,
    })?;
    wait_dad(&iface, lease.address, Duration::from_secs(5))?;
    keep_lease6(iface.clone(), lease.clone());
    say!(
        "network configured: {}/128 on {}",
        lease.address,
        iface.name
    );
    Ok(Configured {
        iface,
        address: IpAddr::V6(lease.address),
        prefix: 128,
        gateway: None,
        at: Instant::now(),
    })
}

fn if_inet6() -> String {
    fs::read_to_string("/proc/net/if_inet6").unwrap_or_default()
}

/// Waits for the link-local address DHCPv6 sends from.
fn wait_link_local(i: &Interface, wait: Duration) -> Result<(), dhcp6::Dhcp6Error> {
    let start = Instant::now();
    while !dhcp6::link_local_ready(&if_inet6(), i.index) {
        if start.elapsed() >= wait {
            return Err(dhcp6::Dhcp6Error::Socket {
                ifname: i.name.clone(),
                source: std::io::Error::other(format!(
                    "no usable IPv6 link-local address within {} s (is IPv6 disabled on the kernel command line?)",
                    wait.as_secs()
                )),
            });
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}

/// Waits until duplicate address detection of `addr` is over.
fn wait_dad(i: &Interface, addr: Ipv6Addr, wait: Duration) -> Result<(), NetError> {
    let start = Instant::now();
    loop {
        let flags = dhcp6::address_flags(&if_inet6(), i.index, addr);
        match flags {
            Some(f) if f & dhcp6::IFA_F_DADFAILED != 0 => {
                return Err(NetError::Dhcp6(format!(
                    "{addr} is already in use on {}'s link (duplicate address detection failed): the DHCPv6 server handed out a taken address",
                    i.name
                )));
            }
            Some(f) if f & dhcp6::IFA_F_TENTATIVE == 0 => return Ok(()),
            _ if start.elapsed() >= wait => {
                return Err(NetError::Dhcp6(format!(
                    "{addr} on {} still tentative after {} s",
                    i.name,
                    wait.as_secs()
                )));
            }
            _ => std::thread::sleep(Duration::from_millis(50)),
        }
    }
}

/// Keeps the DHCPv6 address: Renew at T1; when renewal fails until the
/// address is no longer valid, Solicit again and add what it gets.
fn keep_lease6(iface: Interface, lease: dhcp6::Lease6) {
    let spawned = std::thread::Builder::new()
        .name("dhcp6-lease".into())
        .spawn(move || {
            let mut lease = lease;
            loop {
                let granted = Instant::now();
                let valid = Duration::from_secs(u64::from(lease.valid));
                std::thread::sleep(lease.renew_after());
                let mut renewed = None;
                while granted.elapsed() < valid {
                    match dhcp6::renew(
                        &iface.name,
                        iface.index,
                        iface.mac,
                        &lease,
                        Duration::from_secs(10),
                    ) {
                        Ok(l) => {
                            renewed = Some(l);
                            break;
                        }
                        Err(e) => {
                            say!("DHCPv6 renewal on {} failed: {e}; retrying", iface.name);
                            std::thread::sleep(Duration::from_secs(20));
                        }
                    }
                }
                let next = match renewed {
                    Some(l) => {
                        say!(
                            "DHCPv6 address {} on {} renewed, valid {} s",
                            l.address,
                            iface.name,
                            l.valid
                        );
                        l
                    }
                    None => {
                        say!("DHCPv6 address on {} expired; asking again", iface.name);
                        match dhcp6::acquire(
                            &iface.name,
                            iface.index,
                            iface.mac,
                            Duration::from_secs(60),
                        ) {
                            Ok(l) => l,
                            Err(e) => {
                                say!("DHCPv6 on {} failed: {e}", iface.name);
                                continue;
                            }
                        }
                    }
                };
                // re-added every time: the kernel takes the new lifetimes
                let applied = netlink::Netlink::open().and_then(|mut nl| {
                    nl.add_address6(iface.index, next.address, 128, next.preferred, next.valid)
                });
                if let Err(e) = applied {
                    say!("applying the DHCPv6 address failed: {}", error_chain(&e));
                }
                lease = next;
            }
        });
    if let Err(e) = spawned {
        say!("warning: cannot start the DHCPv6 lease keeper: {e}");
    }
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

fn write_resolv_conf(dns: &[IpAddr]) {
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
