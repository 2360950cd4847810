//! ICMPv6 router advertisements (RFC 4861) for a Subnet with
//! `spec.ipv6.routerAdvertisements`: the prefix on-link, no autonomous
//! addressing, the managed and other-configuration flags set (clients take
//! their address and boot URL over DHCPv6) and a router lifetime of 0
//! (bootd is no default router). A pure builder ([`build_ra`]) and
//! solicitation check ([`is_router_solicit`]); the shell ([`serve`]) sends
//! on a raw ICMPv6 socket bound to the interface: unsolicited ones at a
//! random interval between [`MIN_INTERVAL`] and [`MAX_INTERVAL`] (the first
//! [`INITIAL_COUNT`] at most [`INITIAL_INTERVAL`] apart), and one for a
//! Router Solicitation after a random delay of up to [`MAX_RA_DELAY`],
//! never two multicast ones closer than [`MIN_DELAY_BETWEEN_RAS`]. Hop
//! limit 255; the kernel fills in the checksum.

use std::net::{Ipv6Addr, SocketAddr, SocketAddrV6};
use std::time::Duration;

use anneal_api::error_chain;
use anneal_dhcp::Mac;
use anneal_dhcp::v6::Cidr6;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// MaxRtrAdvInterval (RFC 4861 6.2.1 allows 4 to 1800 s; a provisioning
/// segment wants machines that just powered on to hear one soon).
pub const MAX_INTERVAL: Duration = Duration::from_secs(30);
/// MinRtrAdvInterval (at least 3 s, at most 0.75 × MaxRtrAdvInterval).
pub const MIN_INTERVAL: Duration = Duration::from_secs(10);
/// MAX_INITIAL_RTR_ADVERTISEMENTS (RFC 4861 10).
pub const INITIAL_COUNT: u32 = 3;
/// MAX_INITIAL_RTR_ADVERT_INTERVAL (RFC 4861 10).
pub const INITIAL_INTERVAL: Duration = Duration::from_secs(16);
/// MIN_DELAY_BETWEEN_RAS (RFC 4861 10).
pub const MIN_DELAY_BETWEEN_RAS: Duration = Duration::from_secs(3);
/// MAX_RA_DELAY_TIME (RFC 4861 10).
pub const MAX_RA_DELAY: Duration = Duration::from_millis(500);
/// The all-nodes group RAs go to.
pub const ALL_NODES: Ipv6Addr = Ipv6Addr::new(0xff02, 0, 0, 0, 0, 0, 0, 1);
/// The all-routers group solicitations go to.
pub const ALL_ROUTERS: Ipv6Addr = Ipv6Addr::new(0xff02, 0, 0, 0, 0, 0, 0, 2);

const ROUTER_SOLICIT: u8 = 133;
const ROUTER_ADVERT: u8 = 134;
/// Managed address configuration flag.
pub const FLAG_MANAGED: u8 = 0x80;
/// Other configuration flag.
pub const FLAG_OTHER: u8 = 0x40;
const PREFIX_ON_LINK: u8 = 0x80;

/// What one advertisement says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RaOptions {
    pub prefix: Cidr6,
    /// bootd's MAC (source link-layer address option).
    pub source_mac: Mac,
    /// Prefix valid lifetime, seconds.
    pub valid_lifetime: u32,
    /// Prefix preferred lifetime, seconds.
    pub preferred_lifetime: u32,
}

impl RaOptions {
    /// The advertisement of a DHCPv6 segment, from bootd's MAC.
    pub fn of(o6: &crate::dhcp6::Dhcp6Options, mac: Mac) -> RaOptions {
        RaOptions {
            prefix: o6.prefix,
            source_mac: mac,
            valid_lifetime: o6.valid_lifetime,
            preferred_lifetime: o6.preferred_lifetime,
        }
    }
}

/// The ICMPv6 Router Advertisement (checksum 0: the kernel computes it on
/// an ICMPv6 raw socket).
pub fn build_ra(o: &RaOptions) -> Vec<u8> {
    let mut b = Vec::with_capacity(64);
    // type, code, checksum
    b.extend_from_slice(&[ROUTER_ADVERT, 0, 0, 0]);
    // cur hop limit 64, M and O, router lifetime 0 (not a default router)
    b.extend_from_slice(&[64, FLAG_MANAGED | FLAG_OTHER, 0, 0]);
    // reachable time, retrans timer: unspecified
    b.extend_from_slice(&[0; 8]);
    // source link-layer address
    b.extend_from_slice(&[1, 1]);
    b.extend_from_slice(&o.source_mac.0);
    // prefix information: on-link, not autonomous (addresses come from
    // DHCPv6)
    b.extend_from_slice(&[3, 4, o.prefix.prefix, PREFIX_ON_LINK]);
    b.extend_from_slice(&o.valid_lifetime.to_be_bytes());
    b.extend_from_slice(&o.preferred_lifetime.min(o.valid_lifetime).to_be_bytes());
    b.extend_from_slice(&[0; 4]);
    b.extend_from_slice(&o.prefix.addr.octets());
    b
}

/// Whether `icmp` (an ICMPv6 message, no IP header) is a valid Router
/// Solicitation (RFC 4861 6.1.1: code 0, at least 8 bytes, options of
/// non-zero length that fit). The hop limit check needs ancillary data
/// and is left out: an RS only makes bootd send what it sends anyway.
pub fn is_router_solicit(icmp: &[u8]) -> bool {
    if icmp.len() < 8 || icmp[0] != ROUTER_SOLICIT || icmp[1] != 0 {
        return false;
    }
    let mut rest = &icmp[8..];
    while !rest.is_empty() {
        let len = rest.get(1).map_or(0, |l| usize::from(*l) * 8);
        if len == 0 || len > rest.len() {
            return false;
        }
        rest = &rest[len..];
    }
    true
}

/// A pseudo-random duration in `[lo, hi]` (no cryptographic need: RFC
/// 4861 asks only that routers on a link do not synchronise).
fn jitter(lo: Duration, hi: Duration, seed: u64) -> Duration {
    let span = hi.saturating_sub(lo).as_millis().max(1);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let mut x = seed ^ u64::from(nanos) ^ 0x9e37_79b9_7f4a_7c15;
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    let ms = u128::from(x) % (span + 1);
    lo + Duration::from_millis(u64::try_from(ms).unwrap_or(0))
}

/// When the next unsolicited advertisement goes after the `sent`-th one.
pub fn next_interval(sent: u32, seed: u64) -> Duration {
    let d = jitter(MIN_INTERVAL, MAX_INTERVAL, seed);
    if sent < INITIAL_COUNT {
        d.min(INITIAL_INTERVAL)
    } else {
        d
    }
}

/// A raw ICMPv6 socket on `iface`: hop limit 255, in the all-routers group
/// (to hear solicitations), multicast out of `iface`.
pub fn raw_socket(iface: &str) -> std::io::Result<std::net::UdpSocket> {
    use socket2::{Domain, Protocol, Socket, Type};
    let index = nix::net::if_::if_nametoindex(iface).map_err(std::io::Error::from)?;
    let s = Socket::new(Domain::IPV6, Type::RAW, Some(Protocol::ICMPV6))?;
    s.bind_device(Some(iface.as_bytes()))?;
    s.set_multicast_hops_v6(255)?;
    s.set_unicast_hops_v6(255)?;
    s.set_multicast_if_v6(index)?;
    s.set_multicast_loop_v6(false)?;
    s.join_multicast_v6(&ALL_ROUTERS, index)?;
    s.set_nonblocking(true)?;
    // a datagram socket in tokio's eyes: recv_from/send_to only
    Ok(s.into())
}

/// Sends `opts`'s advertisements on `sock` (from [`raw_socket`]
/// on `iface`) until cancelled.
pub async fn serve(
    sock: tokio::net::UdpSocket,
    iface: String,
    opts: RaOptions,
    cancel: CancellationToken,
) {
    let iface_index = nix::net::if_::if_nametoindex(iface.as_str()).unwrap_or(0);
    let ra = build_ra(&opts);
    let to = SocketAddr::V6(SocketAddrV6::new(ALL_NODES, 0, 0, iface_index));
    let seed = u64::from_be_bytes([
        0,
        0,
        opts.source_mac.0[0],
        opts.source_mac.0[1],
        opts.source_mac.0[2],
        opts.source_mac.0[3],
        opts.source_mac.0[4],
        opts.source_mac.0[5],
    ]);
    let mut sent: u32 = 0;
    let mut last: Option<Instant> = None;
    // the first one right away
    let mut next = Instant::now();
    let mut buf = vec![0u8; 1500];
    loop {
        tokio::select! {
            () = cancel.cancelled() => return,
            () = tokio::time::sleep_until(next) => {
                match sock.send_to(&ra, to).await {
                    Ok(_) => tracing::debug!(prefix = %opts.prefix, "router advertisement sent"),
                    Err(e) => tracing::warn!(error = %error_chain(&e), "router advertisement not sent"),
                }
                sent = sent.saturating_add(1);
                last = Some(Instant::now());
                next = Instant::now() + next_interval(sent, seed ^ u64::from(sent));
            }
            r = sock.recv_from(&mut buf) => match r {
                Ok((n, src)) if is_router_solicit(&buf[..n]) => {
                    // answer after a random delay, never sooner than
                    // MIN_DELAY_BETWEEN_RAS after the last one, and never
                    // later than the unsolicited one already due
                    let now = Instant::now();
                    let earliest = last.map_or(now, |l| l + MIN_DELAY_BETWEEN_RAS);
                    let at = earliest.max(now + jitter(Duration::ZERO, MAX_RA_DELAY, seed ^ u64::from(sent) ^ 0x5a));
                    if at < next {
                        tracing::debug!(src = %src, "router solicitation: advertisement scheduled");
                        next = at;
                    }
                }
                Ok(_) => {}
                Err(e) => tracing::warn!(error = %error_chain(&e), "icmpv6 receive failed"),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn the_advertisement_says_managed_on_link_and_no_default_router() {
        let o = RaOptions {
            prefix: "2001:db8:77::/64".parse().unwrap(),
            source_mac: Mac([0x02, 0, 0, 0, 0, 0x0a]),
            valid_lifetime: 3600,
            preferred_lifetime: 1800,
        };
        let b = build_ra(&o);
        assert_eq!(b.len(), 16 + 8 + 32);
        assert_eq!(&b[..4], &[134, 0, 0, 0]);
        assert_eq!(b[4], 64);
        assert_eq!(b[5], FLAG_MANAGED | FLAG_OTHER);
        assert_eq!(&b[6..8], &[0, 0], "router lifetime 0");
        assert_eq!(&b[16..24], &[1, 1, 0x02, 0, 0, 0, 0, 0x0a]);
        // prefix information: /64, L set, A clear
        assert_eq!(&b[24..28], &[3, 4, 64, 0x80]);
        assert_eq!(&b[28..32], &3600u32.to_be_bytes());
        assert_eq!(&b[32..36], &1800u32.to_be_bytes());
        assert_eq!(
            &b[40..56],
            &"2001:db8:77::".parse::<Ipv6Addr>().unwrap().octets()
        );
    }

    #[test]
    fn solicitations_are_checked() {
        assert!(is_router_solicit(&[133, 0, 0, 0, 0, 0, 0, 0]));
        // with a source link-layer address option
        assert!(is_router_solicit(&[
            133, 0, 0, 0, 0, 0, 0, 0, 1, 1, 2, 0, 0, 0, 0, 1
        ]));
        assert!(!is_router_solicit(&[133, 1, 0, 0, 0, 0, 0, 0]), "code");
        assert!(!is_router_solicit(&[133, 0, 0, 0]), "short");
        assert!(!is_router_solicit(&[134, 0, 0, 0, 0, 0, 0, 0]), "an RA");
        // an option of length 0 or past the end
        assert!(!is_router_solicit(&[133, 0, 0, 0, 0, 0, 0, 0, 1, 0]));
        assert!(!is_router_solicit(&[133, 0, 0, 0, 0, 0, 0, 0, 1, 2, 0, 0]));
    }

    #[test]
    fn intervals_follow_rfc_4861() {
        for i in 0..200u32 {
            let d = next_interval(i, u64::from(i) * 7919);
            assert!(d >= MIN_INTERVAL && d <= MAX_INTERVAL, "{d:?}");
            if i < INITIAL_COUNT {
                assert!(d <= INITIAL_INTERVAL);
            }
            let j = jitter(Duration::ZERO, MAX_RA_DELAY, u64::from(i));
            assert!(j <= MAX_RA_DELAY);
        }
        assert!(MIN_INTERVAL >= MIN_DELAY_BETWEEN_RAS);
        assert!(MIN_INTERVAL.as_secs_f64() <= 0.75 * MAX_INTERVAL.as_secs_f64());
    }
}
