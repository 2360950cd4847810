//! Decision tests and golden vectors for anneal-dhcp.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
#![allow(clippy::too_many_lines)]

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::path::PathBuf;

use anneal_dhcp::{
    BootFiles, BootTable, Decision, Dest, DropReason, Ingress, LeaseEffect, Leases, Loader, Mac,
    MachineEntry, Malformed, Mode, Reply, Request, ServerPort, decide,
};
use dhcproto::v4::{DhcpOption, Message, MessageType, OptionCode, UnknownOption};
use dhcproto::{Encodable, Encoder};

const NOW: u64 = 1_800_000_000;
const SERVER: Ipv4Addr = Ipv4Addr::new(10, 77, 0, 2);
const M1: Mac = Mac([0x52, 0x54, 0x00, 0x00, 0x00, 0x01]);
const M2: Mac = Mac([0x52, 0x54, 0x00, 0x00, 0x00, 0x02]);
const STRANGER: Mac = Mac([0x52, 0x54, 0x00, 0x00, 0x00, 0x99]);
const M1_ADDR: Ipv4Addr = Ipv4Addr::new(10, 77, 0, 50);

fn table(mode: Mode) -> BootTable {
    let mut machines = BTreeMap::new();
    machines.insert(
        M1,
        MachineEntry {
            name: "lab/m1".into(),
            address: Some(M1_ADDR),
            loader: Loader::Ipxe,
        },
    );
    machines.insert(
        M2,
        MachineEntry {
            name: "lab/m2".into(),
            address: None,
            loader: Loader::Ipxe,
        },
    );
    BootTable {
        mode,
        server_ip: SERVER,
        cidr: "10.77.0.0/24".parse().unwrap(),
        router: if mode == Mode::Lease {
            Some(Ipv4Addr::new(10, 77, 0, 1))
        } else {
            None
        },
        dns: vec![Ipv4Addr::new(10, 77, 0, 1)],
        lease_time: 1800,
        lease_range: Some((Ipv4Addr::new(10, 77, 0, 100), Ipv4Addr::new(10, 77, 0, 103))),
        answer_all: false,
        boot_files: BootFiles::default(),
        http_base: "http://10.77.0.2:8080".into(),
        machines,
        revision: "r1".into(),
    }
}

#[derive(Default, Clone)]
struct Pkt {
    mac: Option<Mac>,
    ty: Option<MessageType>,
    arch: Option<u16>,
    vc: Option<&'static [u8]>,
    uc: Option<&'static [u8]>,
    o175: bool,
    requested: Option<Ipv4Addr>,
    server_id: Option<Ipv4Addr>,
    ciaddr: Option<Ipv4Addr>,
    giaddr: Option<Ipv4Addr>,
    o43: Option<Vec<u8>>,
    /// The broadcast flag.
    broadcast: bool,
}

impl Pkt {
    fn bytes(&self) -> Vec<u8> {
        let mac = self.mac.unwrap_or(M1);
        let mut m = Message::new_with_id(
            0x1234_5678,
            self.ciaddr.unwrap_or(Ipv4Addr::UNSPECIFIED),
            Ipv4Addr::UNSPECIFIED,
            Ipv4Addr::UNSPECIFIED,
            self.giaddr.unwrap_or(Ipv4Addr::UNSPECIFIED),
            &mac.0,
        );
        if self.broadcast {
            m.set_flags(dhcproto::v4::Flags::default().set_broadcast());
        }
        let o = m.opts_mut();
        o.insert(DhcpOption::MessageType(
            self.ty.unwrap_or(MessageType::Discover),
        ));
        if let Some(a) = self.arch {
            o.insert(DhcpOption::ClientSystemArchitecture(a.into()));
        }
        if let Some(v) = self.vc {
            o.insert(DhcpOption::ClassIdentifier(v.to_vec()));
        }
        if let Some(v) = self.uc {
            o.insert(DhcpOption::UserClass(v.to_vec()));
        }
        if self.o175 {
            o.insert(DhcpOption::Unknown(UnknownOption::new(
                OptionCode::from(175u8),
                vec![19, 1, 1],
            )));
        }
        if let Some(v) = &self.o43 {
            o.insert(DhcpOption::VendorExtensions(v.clone()));
        }
        if let Some(a) = self.requested {
            o.insert(DhcpOption::RequestedIpAddress(a));
        }
        if let Some(a) = self.server_id {
            o.insert(DhcpOption::ServerIdentifier(a));
        }
        let mut buf = Vec::new();
        m.encode(&mut Encoder::new(&mut buf)).unwrap();
        buf
    }

    fn req(&self, port: ServerPort, src: SocketAddrV4) -> Request {
        Request::parse(&self.bytes(), Ingress { port, src }).unwrap()
    }

    fn req67(&self) -> Request {
        self.req(
            ServerPort::Dhcp,
            SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 68),
        )
    }
}

fn uefi_pxe() -> Pkt {
    Pkt {
        arch: Some(7),
        vc: Some(b"PXEClient:Arch:00007:UNDI:003000"),
        ..Default::default()
    }
}

fn reply(d: Decision) -> Reply {
    match d {
        Decision::Reply(r) => *r,
        other => panic!("expected a reply, got {other:?}"),
    }
}

fn dropped(d: Decision) -> DropReason {
    match d {
        Decision::Drop { reason } => reason,
        other => panic!("expected a drop, got {other:?}"),
    }
}

fn opt(r: &Reply, code: u8) -> Option<Vec<u8>> {
    // read options back from the encoded bytes, independently of dhcproto
    let mut area = &r.bytes[240..];
    let mut out: Option<Vec<u8>> = None;
    while let Some((&c, rest)) = area.split_first() {
        if c == 0 {
            area = rest;
            continue;
        }
        if c == 255 {
            break;
        }
        let len = rest[0] as usize;
        if c == code {
            out.get_or_insert_with(Vec::new)
                .extend_from_slice(&rest[1..1 + len]);
        }
        area = &rest[1 + len..];
    }
    out
}

fn file(r: &Reply) -> String {
    let f = &r.bytes[108..236];
    let end = f.iter().position(|&b| b == 0).unwrap_or(f.len());
    String::from_utf8(f[..end].to_vec()).unwrap()
}

fn yiaddr(r: &Reply) -> Ipv4Addr {
    Ipv4Addr::new(r.bytes[16], r.bytes[17], r.bytes[18], r.bytes[19])
}

fn siaddr(r: &Reply) -> Ipv4Addr {
    Ipv4Addr::new(r.bytes[20], r.bytes[21], r.bytes[22], r.bytes[23])
}

fn golden(name: &str, r: &Reply) {
    golden_bytes(name, &r.bytes);
}

fn golden_bytes(name: &str, bytes: &[u8]) {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/bootd");
    let path = dir.join(format!("{name}.hex"));
    let hex = hex::encode(bytes);
    if std::env::var_os("ANNEAL_REGEN_GOLDEN").is_some() {
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(&path, format!("{hex}\n")).unwrap();
    }
    let want = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e} (run tests/fixtures/bootd/regen.sh)",
            path.display()
        )
    });
    assert_eq!(want.trim(), hex, "golden vector {name} changed");
}

#[test]
fn lease_uefi_pxe_discover_offers_reservation_and_first_stage() {
    let t = table(Mode::Lease);
    let r = reply(decide(&uefi_pxe().req67(), &t, &Leases::default(), NOW));
    assert_eq!(r.msg_type, MessageType::Offer);
    assert_eq!(yiaddr(&r), M1_ADDR);
    assert_eq!(siaddr(&r), SERVER);
    assert_eq!(file(&r), "snponly.efi");
    // no broadcast flag, giaddr or ciaddr: unicast to yiaddr at chaddr
    assert_eq!(
        r.dest,
        Dest::Client {
            addr: SocketAddrV4::new(M1_ADDR, 68),
            mac: M1
        }
    );
    assert_eq!(opt(&r, 53), Some(vec![2]));
    assert_eq!(opt(&r, 54), Some(SERVER.octets().to_vec()));
    assert_eq!(opt(&r, 51), Some(1800u32.to_be_bytes().to_vec()));
    assert_eq!(opt(&r, 1), Some(vec![255, 255, 255, 0]));
    assert_eq!(opt(&r, 3), Some(vec![10, 77, 0, 1]));
    assert_eq!(opt(&r, 6), Some(vec![10, 77, 0, 1]));
    // lease mode: a plain DHCP offer with a boot file, no PXE vendor options
    assert_eq!(opt(&r, 60), None);
    assert_eq!(opt(&r, 43), None);
    assert!(r.bytes.len() >= 300);
    golden("lease_offer_uefi_pxe", &r);
}

/// The UEFI PXE DISCOVER of `uefi_pxe()` rebuilt by hand with option 52 = 3:
/// the message type and the vendor class's tail in `file`, the architecture
/// in `sname`, split options concatenated across the fields (RFC 2131 4.1,
/// RFC 2132 9.3). `file` and `sname` carry garbage after their end option.
fn overloaded_uefi_discover() -> Vec<u8> {
    let plain = uefi_pxe().bytes();
    let mut p = plain[..240].to_vec();
    // options field: overload, then the first half of option 60
    p.extend_from_slice(&[52, 1, 3, 60, 16]);
    p.extend_from_slice(b"PXEClient:Arch:0");
    p.push(255);
    let mut file = vec![53, 1, 1, 60, 16];
    file.extend_from_slice(b"0007:UNDI:003000");
    file.extend_from_slice(&[0, 0, 255]);
    file.extend_from_slice(b"not a boot file");
    p[108..108 + file.len()].copy_from_slice(&file);
    let mut sname = vec![93, 2, 0, 7, 255];
    sname.extend_from_slice(b"not a server name");
    p[44..44 + sname.len()].copy_from_slice(&sname);
    p
}

#[test]
fn overloaded_discover_is_answered_like_the_plain_one() {
    let bytes = overloaded_uefi_discover();
    golden_bytes("request_discover_overload_both", &bytes);
    let ingress = Ingress {
        port: ServerPort::Dhcp,
        src: SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 68),
    };
    let req = Request::parse(&bytes, ingress).unwrap();
    assert_eq!(req.msg_type, MessageType::Discover);
    assert_eq!(req.vendor_class(), b"PXEClient:Arch:00007:UNDI:003000");
    assert_eq!(req.arch(), Some(7));
    assert_eq!(req.header.fname(), None);
    assert_eq!(req.header.sname(), None);
    let t = table(Mode::Lease);
    let r = reply(decide(&req, &t, &Leases::default(), NOW));
    assert_eq!(r.msg_type, MessageType::Offer);
    assert_eq!(file(&r), "snponly.efi");
    let plain = reply(decide(&uefi_pxe().req67(), &t, &Leases::default(), NOW));
    assert_eq!(r.bytes, plain.bytes, "same offer as the plain DISCOVER");
    golden("lease_offer_uefi_pxe", &r);
}

#[test]
fn lease_request_acks_and_binds() {
    let t = table(Mode::Lease);
    let p = Pkt {
        ty: Some(MessageType::Request),
        requested: Some(M1_ADDR),
        server_id: Some(SERVER),
        ..uefi_pxe()
    };
    let r = reply(decide(&p.req67(), &t, &Leases::default(), NOW));
    assert_eq!(r.msg_type, MessageType::Ack);
    assert_eq!(yiaddr(&r), M1_ADDR);
    assert_eq!(
        r.effect,
        Some(LeaseEffect::Bind(anneal_dhcp::Lease {
            mac: M1,
            address: M1_ADDR,
            expires: NOW + 1800
        }))
    );
    golden("lease_ack_uefi_pxe", &r);
    // renewal: unicast to ciaddr, no server id, ciaddr set
    let renew = Pkt {
        ty: Some(MessageType::Request),
        ciaddr: Some(M1_ADDR),
        ..Default::default()
    };
    let r = reply(decide(&renew.req67(), &t, &Leases::default(), NOW));
    assert_eq!(r.msg_type, MessageType::Ack);
    assert_eq!(r.dest, Dest::Unicast(SocketAddrV4::new(M1_ADDR, 68)));
    assert_eq!(file(&r), "", "a plain client gets no boot file");
}

#[test]
fn lease_request_naks_wrong_subnet_and_wrong_address() {
    let t = table(Mode::Lease);
    for addr in [Ipv4Addr::new(192, 168, 1, 9), Ipv4Addr::new(10, 77, 0, 51)] {
        let p = Pkt {
            ty: Some(MessageType::Request),
            requested: Some(addr),
            ..Default::default()
        };
        let r = reply(decide(&p.req67(), &t, &Leases::default(), NOW));
        assert_eq!(r.msg_type, MessageType::Nak);
        assert_eq!(yiaddr(&r), Ipv4Addr::UNSPECIFIED);
        assert_eq!(r.dest, Dest::Broadcast);
        if addr.octets()[0] == 192 {
            golden("lease_nak_wrong_subnet", &r);
        }
    }
    // selecting another server: silence
    let p = Pkt {
        ty: Some(MessageType::Request),
        requested: Some(M1_ADDR),
        server_id: Some(Ipv4Addr::new(10, 77, 0, 3)),
        ..Default::default()
    };
    assert_eq!(
        dropped(decide(&p.req67(), &t, &Leases::default(), NOW)),
        DropReason::NotForUs
    );
}

#[test]
fn mac_gate_and_answer_all() {
    let mut t = table(Mode::Lease);
    let p = Pkt {
        mac: Some(STRANGER),
        ..uefi_pxe()
    };
    assert_eq!(
        dropped(decide(&p.req67(), &t, &Leases::default(), NOW)),
        DropReason::NotEnrolled
    );
    // enrolled but no reservation
    let p2 = Pkt {
        mac: Some(M2),
        ..uefi_pxe()
    };
    assert_eq!(
        dropped(decide(&p2.req67(), &t, &Leases::default(), NOW)),
        DropReason::NoReservation
    );
    t.answer_all = true;
    let r = reply(decide(&p.req67(), &t, &Leases::default(), NOW));
    let a = yiaddr(&r);
    assert!((100..=103).contains(&a.octets()[3]), "{a}");
    // proxy mode gate
    let tp = table(Mode::Proxy);
    assert_eq!(
        dropped(decide(&p.req67(), &tp, &Leases::default(), NOW)),
        DropReason::NotEnrolled
    );
}

#[test]
fn dynamic_pool_avoids_held_addresses_and_exhausts() {
    let mut t = table(Mode::Lease);
    t.answer_all = true;
    t.machines.clear();
    let mut leases = Leases::default();
    let mut seen = Vec::new();
    for i in 0..4u8 {
        let mac = Mac([2, 0, 0, 0, 1, i]);
        let p = Pkt {
            mac: Some(mac),
            ..Default::default()
        };
        let r = reply(decide(&p.req67(), &t, &leases, NOW));
        let a = yiaddr(&r);
        assert!(!seen.contains(&a));
        seen.push(a);
        leases.apply(
            LeaseEffect::Bind(anneal_dhcp::Lease {
                mac,
                address: a,
                expires: NOW + 100,
            }),
            NOW,
        );
    }
    let p = Pkt {
        mac: Some(Mac([2, 0, 0, 0, 1, 9])),
        ..Default::default()
    };
    assert_eq!(
        dropped(decide(&p.req67(), &t, &leases, NOW)),
        DropReason::PoolExhausted
    );
    // after expiry the pool is free again
    assert!(matches!(
        decide(&p.req67(), &t, &leases, NOW + 101),
        Decision::Reply(_)
    ));
}

/// A pool held but for a few addresses offers exactly those (never the
/// router, a declined address or a machine's reservation), then, once
/// every address is held, one whose lease expired.
#[test]
fn a_nearly_full_pool_offers_what_is_free_and_then_what_expired() {
    let mut t = table(Mode::Lease);
    t.answer_all = true;
    t.cidr = "10.77.0.0/16".parse().unwrap();
    t.lease_range = Some((Ipv4Addr::new(10, 77, 0, 0), Ipv4Addr::new(10, 77, 255, 255)));
    t.machines.clear();
    t.machines.insert(
        M1,
        MachineEntry {
            name: "lab/m1".into(),
            address: Some(Ipv4Addr::new(10, 77, 40, 1)),
            loader: Loader::Ipxe,
        },
    );
    let free = [
        Ipv4Addr::new(10, 77, 0, 1),     // the router
        Ipv4Addr::new(10, 77, 0, 2),     // bootd
        Ipv4Addr::new(10, 77, 40, 1),    // m1's reservation
        Ipv4Addr::new(10, 77, 99, 7),    // declined below
        Ipv4Addr::new(10, 77, 200, 3),   // free
        Ipv4Addr::new(10, 77, 255, 254), // free
    ];
    let mut leases = Leases::default();
    let lease = |i: u32, expires: u64| anneal_dhcp::Lease {
        mac: Mac([2, 9, 0, (i >> 16) as u8, (i >> 8) as u8, i as u8]),
        address: Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 77, 0, 0)) + i),
        expires,
    };
    for i in 0..65536u32 {
        let l = lease(i, NOW + 100 + u64::from(i % 7));
        if !free.contains(&l.address) {
            leases.apply(LeaseEffect::Bind(l), NOW);
        }
    }
    let declined = lease(
        u32::from(free[3]) - u32::from(Ipv4Addr::new(10, 77, 0, 0)),
        NOW + 100,
    );
    leases.apply(LeaseEffect::Bind(declined), NOW);
    leases.apply(
        LeaseEffect::Decline {
            mac: declined.mac,
            address: declined.address,
        },
        NOW,
    );
    let mut offered = Vec::new();
    for k in 0..2u8 {
        let mac = Mac([2, 0, 0, 0, 2, k]);
        let p = Pkt {
            mac: Some(mac),
            ..Default::default()
        };
        let a = yiaddr(&reply(decide(&p.req67(), &t, &leases, NOW)));
        assert!(free[4..].contains(&a), "offered {a}");
        assert!(!offered.contains(&a));
        offered.push(a);
        leases.apply(
            LeaseEffect::Bind(anneal_dhcp::Lease {
                mac,
                address: a,
                expires: NOW + 1000,
            }),
            NOW,
        );
    }
    let p = Pkt {
        mac: Some(Mac([2, 0, 0, 0, 3, 0])),
        ..Default::default()
    };
    assert_eq!(
        dropped(decide(&p.req67(), &t, &leases, NOW)),
        DropReason::PoolExhausted
    );
    // the leases of i % 7 == 0 expire first: one of them is offered
    let a = yiaddr(&reply(decide(&p.req67(), &t, &leases, NOW + 100)));
    let i = u32::from(a) - u32::from(Ipv4Addr::new(10, 77, 0, 0));
    assert_eq!(i % 7, 0, "offered {a}, whose lease expires later");
    assert!(!free[..4].contains(&a), "offered {a}");
}

#[test]
fn arch_selects_first_stage() {
    let t = table(Mode::Lease);
    let bios = Pkt {
        arch: Some(0),
        vc: Some(b"PXEClient:Arch:00000:UNDI:002001"),
        ..Default::default()
    };
    let r = reply(decide(&bios.req67(), &t, &Leases::default(), NOW));
    assert_eq!(file(&r), "undionly.kpxe");
    golden("lease_offer_bios_pxe", &r);
    let arm = Pkt {
        arch: Some(11),
        vc: Some(b"PXEClient:Arch:00011:UNDI:003000"),
        ..Default::default()
    };
    let r = reply(decide(&arm.req67(), &t, &Leases::default(), NOW));
    assert_eq!(file(&r), "snponly-arm64.efi");
    let odd = Pkt {
        arch: Some(2),
        vc: Some(b"PXEClient:Arch:00002"),
        ..Default::default()
    };
    assert_eq!(
        dropped(decide(&odd.req67(), &t, &Leases::default(), NOW)),
        DropReason::UnsupportedArch
    );
}

#[test]
fn a_shim_machine_gets_the_signed_shim_on_uefi_and_ipxe_on_bios() {
    let mut t = table(Mode::Lease);
    if let Some(m) = t.machines.get_mut(&M1) {
        m.loader = Loader::Shim;
    }
    let r = reply(decide(&uefi_pxe().req67(), &t, &Leases::default(), NOW));
    assert_eq!(file(&r), "shimx64.efi");
    assert_eq!(yiaddr(&r), M1_ADDR);
    let http = Pkt {
        arch: Some(16),
        vc: Some(b"HTTPClient:Arch:00016:UNDI:003001"),
        ..Default::default()
    };
    let r = reply(decide(&http.req67(), &t, &Leases::default(), NOW));
    assert_eq!(file(&r), "http://10.77.0.2:8080/files/shimx64.efi");
    let arm = Pkt {
        arch: Some(11),
        vc: Some(b"PXEClient:Arch:00011:UNDI:003000"),
        ..Default::default()
    };
    let r = reply(decide(&arm.req67(), &t, &Leases::default(), NOW));
    assert_eq!(file(&r), "shimaa64.efi");
    let bios = Pkt {
        arch: Some(0),
        vc: Some(b"PXEClient:Arch:00000:UNDI:002001"),
        ..Default::default()
    };
    let r = reply(decide(&bios.req67(), &t, &Leases::default(), NOW));
    assert_eq!(file(&r), "undionly.kpxe");
    // another machine of the table keeps iPXE (proxy mode: m2 has no
    // reservation, the segment's server gives it an address)
    let mut proxy = table(Mode::Proxy);
    if let Some(m) = proxy.machines.get_mut(&M1) {
        m.loader = Loader::Shim;
    }
    let m2 = Pkt {
        mac: Some(M2),
        ..uefi_pxe()
    };
    let r = reply(decide(&m2.req67(), &proxy, &Leases::default(), NOW));
    assert_eq!(file(&r), "snponly.efi");
    let r = reply(decide(&uefi_pxe().req67(), &proxy, &Leases::default(), NOW));
    assert_eq!(file(&r), "shimx64.efi");
}

#[test]
fn http_boot_gets_url_and_httpclient() {
    let t = table(Mode::Lease);
    let p = Pkt {
        arch: Some(16),
        vc: Some(b"HTTPClient:Arch:00016:UNDI:003001"),
        ..Default::default()
    };
    let r = reply(decide(&p.req67(), &t, &Leases::default(), NOW));
    assert_eq!(file(&r), "http://10.77.0.2:8080/files/snponly.efi");
    assert_eq!(opt(&r, 60), Some(b"HTTPClient".to_vec()));
    assert_eq!(yiaddr(&r), M1_ADDR);
    golden("lease_offer_http_boot", &r);
}

#[test]
fn ipxe_gets_script_url_and_no_pxedhcp() {
    let t = table(Mode::Lease);
    for p in [
        Pkt {
            uc: Some(b"iPXE"),
            ..uefi_pxe()
        },
        Pkt {
            o175: true,
            ..uefi_pxe()
        },
    ] {
        let r = reply(decide(&p.req67(), &t, &Leases::default(), NOW));
        assert_eq!(file(&r), "http://10.77.0.2:8080/ipxe/52-54-00-00-00-01");
        assert_eq!(opt(&r, 175), Some(vec![176, 1, 1]));
        assert_eq!(opt(&r, 60), None);
        if p.uc.is_some() {
            golden("lease_offer_ipxe", &r);
        }
    }
}

#[test]
fn router_tristate() {
    let mut t = table(Mode::Lease);
    t.router = None;
    let r = reply(decide(&uefi_pxe().req67(), &t, &Leases::default(), NOW));
    assert_eq!(opt(&r, 3), None);
}

#[test]
fn decline_release_inform() {
    let t = table(Mode::Lease);
    let mut leases = Leases::default();
    let decl = Pkt {
        ty: Some(MessageType::Decline),
        requested: Some(M1_ADDR),
        server_id: Some(SERVER),
        ..Default::default()
    };
    let d = decide(&decl.req67(), &t, &leases, NOW);
    let Decision::Update(e) = d else {
        panic!("{d:?}")
    };
    assert_eq!(
        e,
        LeaseEffect::Decline {
            mac: M1,
            address: M1_ADDR
        }
    );
    leases.apply(e, NOW);
    assert_eq!(
        dropped(decide(&uefi_pxe().req67(), &t, &leases, NOW + 1)),
        DropReason::AddressDeclined
    );
    let rel = Pkt {
        ty: Some(MessageType::Release),
        ciaddr: Some(M1_ADDR),
        server_id: Some(SERVER),
        ..Default::default()
    };
    assert!(matches!(
        decide(&rel.req67(), &t, &leases, NOW),
        Decision::Update(LeaseEffect::Release { .. })
    ));
    let inf = Pkt {
        ty: Some(MessageType::Inform),
        ciaddr: Some(M1_ADDR),
        ..Default::default()
    };
    let r = reply(decide(&inf.req67(), &t, &leases, NOW));
    assert_eq!(r.msg_type, MessageType::Ack);
    assert_eq!(yiaddr(&r), Ipv4Addr::UNSPECIFIED);
    assert_eq!(opt(&r, 51), None);
    assert_eq!(r.dest, Dest::Unicast(SocketAddrV4::new(M1_ADDR, 68)));
}

/// A DECLINE withholds only the address the MAC holds or would be offered,
/// inside the Subnet; any other is dropped with its own reason, and the
/// address stays available to its holder.
#[test]
fn decline_only_for_the_address_held_or_offered() {
    let decl = |mac: Mac, address: Ipv4Addr| Pkt {
        mac: Some(mac),
        ty: Some(MessageType::Decline),
        requested: Some(address),
        server_id: Some(SERVER),
        ..Default::default()
    };
    let t = table(Mode::Lease);
    let leases = Leases::default();
    // M2 has no reservation: it cannot take M1's reserved address out
    assert_eq!(
        dropped(decide(&decl(M2, M1_ADDR).req67(), &t, &leases, NOW)),
        DropReason::DeclineNotOffered
    );
    // M1 declining an address it was never given
    assert_eq!(
        dropped(decide(
            &decl(M1, Ipv4Addr::new(10, 77, 0, 60)).req67(),
            &t,
            &leases,
            NOW
        )),
        DropReason::DeclineNotOffered
    );
    // outside the Subnet
    let d = dropped(decide(
        &decl(M1, Ipv4Addr::new(192, 168, 1, 5)).req67(),
        &t,
        &leases,
        NOW,
    ));
    assert_eq!(d, DropReason::DeclineOutsideSubnet);
    assert_eq!(d.label(), "decline_outside_subnet");
    assert_eq!(DropReason::DeclineNotOffered.label(), "decline_not_offered");
    // its own reservation: accepted
    assert!(matches!(
        decide(&decl(M1, M1_ADDR).req67(), &t, &leases, NOW),
        Decision::Update(LeaseEffect::Decline { .. })
    ));
    // dynamic pool: M2 holds .100; a stranger cannot decline it, M2 can
    let mut ta = table(Mode::Lease);
    ta.answer_all = true;
    let pool = Ipv4Addr::new(10, 77, 0, 100);
    let mut leases = Leases::default();
    leases.apply(
        LeaseEffect::Bind(anneal_dhcp::Lease {
            mac: M2,
            address: pool,
            expires: NOW + 100,
        }),
        NOW,
    );
    assert_eq!(
        dropped(decide(&decl(STRANGER, pool).req67(), &ta, &leases, NOW)),
        DropReason::DeclineNotOffered
    );
    assert_eq!(leases.holder(pool, NOW), Some(M2));
    let d = decide(&decl(M2, pool).req67(), &ta, &leases, NOW);
    assert!(
        matches!(d, Decision::Update(LeaseEffect::Decline { mac, address }) if mac == M2 && address == pool),
        "{d:?}"
    );
}

#[test]
fn reservation_held_by_other_mac_is_not_offered() {
    let t = table(Mode::Lease);
    let mut leases = Leases::default();
    leases.apply(
        LeaseEffect::Bind(anneal_dhcp::Lease {
            mac: M2,
            address: M1_ADDR,
            expires: NOW + 10,
        }),
        NOW,
    );
    assert_eq!(
        dropped(decide(&uefi_pxe().req67(), &t, &leases, NOW)),
        DropReason::AddressInUse
    );
}

#[test]
fn relay_answers_to_giaddr_and_refuses_foreign() {
    let t = table(Mode::Lease);
    let p = Pkt {
        giaddr: Some(Ipv4Addr::new(10, 77, 0, 254)),
        ..uefi_pxe()
    };
    let r = reply(decide(&p.req67(), &t, &Leases::default(), NOW));
    assert_eq!(
        r.dest,
        Dest::Unicast(SocketAddrV4::new(Ipv4Addr::new(10, 77, 0, 254), 67))
    );
    assert_eq!(&r.bytes[24..28], &[10, 77, 0, 254]);
    let f = Pkt {
        giaddr: Some(Ipv4Addr::new(10, 99, 0, 1)),
        ..uefi_pxe()
    };
    assert_eq!(
        dropped(decide(&f.req67(), &t, &Leases::default(), NOW)),
        DropReason::ForeignRelay
    );
}

#[test]
fn proxy_offer_has_no_address_and_pxe_options() {
    let t = table(Mode::Proxy);
    let r = reply(decide(&uefi_pxe().req67(), &t, &Leases::default(), NOW));
    assert_eq!(r.msg_type, MessageType::Offer);
    assert_eq!(yiaddr(&r), Ipv4Addr::UNSPECIFIED);
    assert_eq!(siaddr(&r), SERVER);
    assert_eq!(file(&r), "snponly.efi");
    assert_eq!(opt(&r, 60), Some(b"PXEClient".to_vec()));
    assert_eq!(opt(&r, 43), Some(vec![6, 1, 8, 255]));
    assert_eq!(opt(&r, 51), None);
    assert_eq!(opt(&r, 3), None);
    golden("proxy_offer_uefi_pxe", &r);
    // iPXE through proxy: PXEClient so iPXE takes it as a proxy offer
    let ipxe = Pkt {
        uc: Some(b"iPXE"),
        ..uefi_pxe()
    };
    let r = reply(decide(&ipxe.req67(), &t, &Leases::default(), NOW));
    assert_eq!(opt(&r, 60), Some(b"PXEClient".to_vec()));
    assert_eq!(file(&r), "http://10.77.0.2:8080/ipxe/52-54-00-00-00-01");
    golden("proxy_offer_ipxe", &r);
    // a plain client, and a request for the segment's own server: silence
    assert_eq!(
        dropped(decide(&Pkt::default().req67(), &t, &Leases::default(), NOW)),
        DropReason::NotBootClient
    );
    let req = Pkt {
        ty: Some(MessageType::Request),
        server_id: Some(Ipv4Addr::new(10, 77, 0, 1)),
        requested: Some(Ipv4Addr::new(10, 77, 0, 120)),
        ..uefi_pxe()
    };
    assert_eq!(
        dropped(decide(&req.req67(), &t, &Leases::default(), NOW)),
        DropReason::NotForUs
    );
}

#[test]
fn port_4011_acks_to_source_and_echoes_boot_item() {
    let t = table(Mode::Proxy);
    let src = SocketAddrV4::new(Ipv4Addr::new(10, 77, 0, 120), 68);
    let p = Pkt {
        ty: Some(MessageType::Request),
        ciaddr: Some(*src.ip()),
        o43: Some(vec![71, 4, 0x80, 0x00, 0x00, 0x00, 255]),
        ..uefi_pxe()
    };
    let r = reply(decide(
        &p.req(ServerPort::PxeBoot, src),
        &t,
        &Leases::default(),
        NOW,
    ));
    assert_eq!(r.msg_type, MessageType::Ack);
    assert_eq!(r.dest, Dest::Unicast(src));
    assert_eq!(file(&r), "snponly.efi");
    assert_eq!(opt(&r, 43), Some(vec![6, 1, 8, 71, 4, 0x80, 0, 0, 0, 255]));
    golden("pxe4011_ack_uefi", &r);
    let disc = uefi_pxe().req(ServerPort::PxeBoot, src);
    assert_eq!(
        dropped(decide(&disc, &t, &Leases::default(), NOW)),
        DropReason::UnsupportedMessage
    );
}

#[test]
fn hostile_packets_never_panic() {
    let t = table(Mode::Lease);
    let mut tp = table(Mode::Proxy);
    tp.answer_all = true;
    let leases = Leases::default();
    let src = SocketAddrV4::new(Ipv4Addr::new(10, 77, 0, 9), 68);
    let good = Pkt {
        uc: Some(b"iPXE"),
        requested: Some(M1_ADDR),
        ..uefi_pxe()
    }
    .bytes();
    let mut decided = 0;
    let mut check = |b: &[u8]| {
        for port in [ServerPort::Dhcp, ServerPort::PxeBoot] {
            if let Ok(r) = Request::parse(b, Ingress { port, src }) {
                for tb in [&t, &tp] {
                    let _ = decide(&r, tb, &leases, NOW);
                    decided += 1;
                }
            }
        }
    };
    // every truncation
    for n in 0..good.len() {
        check(&good[..n]);
    }
    // every single-byte corruption in the option area, three values each
    for i in 240..good.len() {
        for v in [0u8, 0xff, 0x80] {
            let mut b = good.clone();
            b[i] = v;
            check(&b);
        }
    }
    assert!(decided > 0);
    // option overflow, option 53 with an oversized length, and a huge packet
    let mut over = good[..240].to_vec();
    over.extend_from_slice(&[53, 1, 1, 43, 250, 1, 2, 3]);
    assert_eq!(
        Request::parse(
            &over,
            Ingress {
                port: ServerPort::Dhcp,
                src
            }
        )
        .err(),
        Some(Malformed::OptionOverflow)
    );
    // a jumbo datagram (IP-fragmented on the wire) is read; only more
    // than a UDP datagram can hold is oversized
    let mut huge = good.clone();
    huge.resize(9000, 0);
    let ingress = Ingress {
        port: ServerPort::Dhcp,
        src,
    };
    assert!(Request::parse(&huge, ingress).is_ok());
    huge.resize(anneal_dhcp::MAX_PACKET + 1, 0);
    assert_eq!(
        Request::parse(&huge, ingress).err(),
        Some(Malformed::Oversized)
    );
}

/// RFC 2131 4.1: an OFFER or ACK goes to yiaddr at chaddr when the client
/// set no broadcast flag and neither giaddr nor ciaddr; with the flag it is
/// broadcast; a NAK is always broadcast; a relay or ciaddr wins.
#[test]
fn offer_and_ack_unicast_to_yiaddr_unless_broadcast_flag() {
    let t = table(Mode::Lease);
    let client = Dest::Client {
        addr: SocketAddrV4::new(M1_ADDR, 68),
        mac: M1,
    };
    for ty in [MessageType::Discover, MessageType::Request] {
        for broadcast in [false, true] {
            let p = Pkt {
                ty: Some(ty),
                requested: (ty == MessageType::Request).then_some(M1_ADDR),
                server_id: (ty == MessageType::Request).then_some(SERVER),
                broadcast,
                ..Default::default()
            };
            let r = reply(decide(&p.req67(), &t, &Leases::default(), NOW));
            let want = if broadcast { Dest::Broadcast } else { client };
            assert_eq!(r.dest, want, "{ty:?} broadcast flag {broadcast}");
            // the flag is echoed (RFC 2131 4.1 and table 3)
            assert_eq!(r.bytes[10] & 0x80 != 0, broadcast);
        }
    }
    // a NAK without the flag: broadcast
    let p = Pkt {
        ty: Some(MessageType::Request),
        requested: Some(Ipv4Addr::new(10, 77, 0, 51)),
        ..Default::default()
    };
    let r = reply(decide(&p.req67(), &t, &Leases::default(), NOW));
    assert_eq!(r.msg_type, MessageType::Nak);
    assert_eq!(r.dest, Dest::Broadcast);
    // a relay gets it, flag or not
    let p = Pkt {
        giaddr: Some(Ipv4Addr::new(10, 77, 0, 254)),
        ..Default::default()
    };
    let r = reply(decide(&p.req67(), &t, &Leases::default(), NOW));
    assert_eq!(
        r.dest,
        Dest::Unicast(SocketAddrV4::new(Ipv4Addr::new(10, 77, 0, 254), 67))
    );
    // proxy mode has no yiaddr: broadcast
    let r = reply(decide(
        &uefi_pxe().req67(),
        &table(Mode::Proxy),
        &Leases::default(),
        NOW,
    ));
    assert_eq!(r.dest, Dest::Broadcast);
}
