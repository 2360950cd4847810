//! The only unsafe code of bootd: one ioctl.
//!
//! RFC 2131 4.1 unicasts an OFFER or ACK to a client that cannot take
//! broadcasts (broadcast flag clear) at its new address `yiaddr` and its
//! hardware address `chaddr`. The client does not answer ARP for an address
//! it does not hold yet, so the kernel must be told the link-layer address
//! first: `SIOCSARP` adds the neighbour entry, then an ordinary `sendto`
//! on the UDP socket reaches the client. (A packet socket would need
//! building Ethernet, IP and UDP headers by hand; dnsmasq and ISC dhcpd on
//! Linux inject the neighbour entry the same way.)

use std::io;
use std::net::Ipv4Addr;
use std::os::fd::AsRawFd;

/// Sets the ARP (neighbour) entry `ip` → `mac`, on `iface` or, without one,
/// on the interface the route to `ip` leaves through. Needs CAP_NET_ADMIN.
pub fn set_arp(
    sock: &impl AsRawFd,
    iface: Option<&str>,
    ip: Ipv4Addr,
    mac: [u8; 6],
) -> io::Result<()> {
    let mut pa = [0 as libc::c_char; 14];
    // sockaddr_in after the family: port (0), then the address
    for (d, s) in pa[2..6].iter_mut().zip(ip.octets()) {
        *d = s as libc::c_char;
    }
    let mut ha = [0 as libc::c_char; 14];
    for (d, s) in ha.iter_mut().zip(mac) {
        *d = s as libc::c_char;
    }
    let mut dev = [0 as libc::c_char; 16];
    if let Some(i) = iface {
        // IFNAMSIZ including the terminating NUL
        if i.len() >= dev.len() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("interface name {i:?} is longer than 15 bytes"),
            ));
        }
        for (d, s) in dev.iter_mut().zip(i.bytes()) {
            *d = s as libc::c_char;
        }
    }
    let req = libc::arpreq {
        arp_pa: libc::sockaddr {
            sa_family: libc::AF_INET as libc::sa_family_t,
            sa_data: pa,
        },
        arp_ha: libc::sockaddr {
            sa_family: libc::ARPHRD_ETHER,
            sa_data: ha,
        },
        arp_flags: libc::ATF_COM,
        arp_netmask: libc::sockaddr {
            sa_family: 0,
            sa_data: [0; 14],
        },
        arp_dev: dev,
    };
    ioctl::set_arp(sock.as_raw_fd(), &req)
}

#[allow(unsafe_code)]
mod ioctl {
    nix::ioctl_write_ptr_bad!(siocsarp, libc::SIOCSARP, libc::arpreq);

    /// SIOCSARP with `req`.
    pub(super) fn set_arp(fd: std::os::fd::RawFd, req: &libc::arpreq) -> std::io::Result<()> {
        // SAFETY: SIOCSARP reads one `struct arpreq` from the pointer, which
        // points to `req` for the duration of the call; `fd` is an open
        // socket borrowed from the caller.
        unsafe { siocsarp(fd, req) }
            .map(|_| ())
            .map_err(std::io::Error::from)
    }
}
