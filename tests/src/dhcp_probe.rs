//! What bootd's decision core answers to a UEFI PXE DHCPDISCOVER from a MAC:
//! shared by the tests that check bootd's boot table without a network.

use std::net::{Ipv4Addr, SocketAddrV4};

use anneal_dhcp::{BootTable, Decision, Ingress, Leases, Mac, Request, ServerPort, decide};

/// A DHCPDISCOVER from `mac` as UEFI x64 PXE firmware sends it (option 93 =
/// 7, vendor class `PXEClient`).
pub fn pxe_discover(mac: Mac) -> Vec<u8> {
    let mut p = vec![0u8; 240];
    p[0] = 1;
    p[1] = 1;
    p[2] = 6;
    p[28..34].copy_from_slice(&mac.0);
    p[236..240].copy_from_slice(&[99, 130, 83, 99]);
    p.extend_from_slice(&[53, 1, 1, 93, 2, 0, 7, 60, 9]);
    p.extend_from_slice(b"PXEClient");
    p.push(255);
    p
}

/// bootd's decision for [`pxe_discover`] of `mac`, with `table` and `leases`.
pub fn decide_discover(table: &BootTable, leases: &Leases, mac: Mac) -> Decision {
    let req = Request::parse(
        &pxe_discover(mac),
        Ingress {
            port: ServerPort::Dhcp,
            src: SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 68),
        },
    )
    .unwrap();
    decide(&req, table, leases, anneal_bootd::unix_now())
}
