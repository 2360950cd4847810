//! What the DHCPv4 and DHCPv6 clients share: a UDP socket on one device,
//! and a receive loop with a deadline.

use std::io;
use std::net::{SocketAddr, UdpSocket};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use nix::sys::socket::{
    AddressFamily, SockFlag, SockType, SockaddrStorage, bind, setsockopt, socket, sockopt,
};

/// A UDP socket that sends and receives on `ifname` only
/// (`SO_BINDTODEVICE`), bound to `addr` (the client port on the unspecified
/// address) with `SO_REUSEADDR`; IPv4 with `SO_BROADCAST`, IPv6 with
/// `IPV6_V6ONLY`.
pub(crate) fn device_socket(ifname: &str, addr: SocketAddr) -> nix::Result<UdpSocket> {
    let family = if addr.is_ipv4() {
        AddressFamily::Inet
    } else {
        AddressFamily::Inet6
    };
    let fd = socket(family, SockType::Datagram, SockFlag::SOCK_CLOEXEC, None)?;
    setsockopt(&fd, sockopt::ReuseAddr, &true)?;
    if addr.is_ipv4() {
        setsockopt(&fd, sockopt::Broadcast, &true)?;
    } else {
        setsockopt(&fd, sockopt::Ipv6V6Only, &true)?;
    }
    setsockopt(
        &fd,
        sockopt::BindToDevice,
        &std::ffi::OsString::from(ifname),
    )?;
    bind(fd.as_raw_fd(), &SockaddrStorage::from(addr))?;
    Ok(UdpSocket::from(fd))
}

/// Time left until `deadline` (zero once past).
pub(crate) fn left(deadline: Instant) -> Duration {
    deadline.saturating_duration_since(Instant::now())
}

/// Receives datagrams on `sock` for up to `wait`, handing each to `take`;
/// the first value `take` returns, or `None` once the time is up.
pub(crate) fn receive_until<T>(
    sock: &UdpSocket,
    buf: &mut [u8],
    wait: Duration,
    mut take: impl FnMut(&[u8]) -> Option<T>,
) -> io::Result<Option<T>> {
    let until = Instant::now() + wait;
    loop {
        let remaining = left(until);
        if remaining.is_zero() {
            return Ok(None);
        }
        sock.set_read_timeout(Some(remaining.max(Duration::from_millis(1))))?;
        match sock.recv_from(buf) {
            Ok((n, _)) => {
                if let Some(t) = take(&buf[..n]) {
                    return Ok(Some(t));
                }
            }
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                return Ok(None);
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
}
