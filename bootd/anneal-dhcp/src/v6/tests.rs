//! DHCPv6 decisions: the exchanges a UEFI client and iPXE make, relays,
//! the MAC gate, and hostile datagrams.

use std::collections::BTreeMap;
use std::net::{Ipv6Addr, SocketAddrV6};

use super::*;
use crate::Mac;
use crate::table::{BootFiles, Mode};

const M1: Mac = Mac([0x52, 0x54, 0x00, 0x12, 0x34, 0x56]);
const SERVER_MAC: Mac = Mac([0x02, 0, 0, 0, 0, 1]);

fn ip(s: &str) -> Ipv6Addr {
    s.parse().unwrap_or(Ipv6Addr::UNSPECIFIED)
}

fn table(mode: Mode, answer_all: bool) -> BootTable6 {
    let mut machines = BTreeMap::new();
    machines.insert(
        M1,
        MachineEntry6 {
            name: "lab/m1".into(),
            address: Some(ip("2001:db8:77::50")),
        },
    );
    BootTable6 {
        mode,
        server_duid: Duid::ll_ethernet(SERVER_MAC),
        server_ip: ip("2001:db8:77::1"),
        prefix: Cidr6 {
            addr: ip("2001:db8:77::"),
            prefix: 64,
        },
        dns: vec![ip("2001:db8:77::53")],
        preferred_lifetime: 600,
        valid_lifetime: 900,
        lease_range: Some((ip("2001:db8:77::1000"), ip("2001:db8:77::10ff"))),
        answer_all,
        boot_files: BootFiles::default(),
        http_base: "http://[2001:db8:77::1]:8080".into(),
        boot_params: Vec::new(),
        machines,
    }
}

/// The link-local address UEFI forms from `mac` (EUI-64).
fn link_local(mac: Mac) -> Ipv6Addr {
    let m = mac.0;
    Ipv6Addr::from([
        0xfe,
        0x80,
        0,
        0,
        0,
        0,
        0,
        0,
        m[0] ^ 2,
        m[1],
        m[2],
        0xff,
        0xfe,
        m[3],
        m[4],
        m[5],
    ])
}

fn ingress(mac: Mac) -> Ingress6 {
    Ingress6 {
        src: SocketAddrV6::new(link_local(mac), 546, 0, 3),
        link_mac: None,
    }
}

fn uuid_duid() -> Vec<u8> {
    let mut d = vec![0, 4];
    d.extend_from_slice(&[0x11; 16]);
    d
}

fn ia(iaid: u32, addrs: &[Ipv6Addr]) -> Vec<u8> {
    let mut v = iaid.to_be_bytes().to_vec();
    v.extend_from_slice(&[0; 8]);
    let mut o = Options::default();
    for a in addrs {
        let mut b = a.octets().to_vec();
        b.extend_from_slice(&[0; 8]);
        o.push(opt::IAADDR, b);
    }
    o.encode(&mut v);
    v
}

fn vendor(class: &[u8]) -> Vec<u8> {
    let mut v = 343u32.to_be_bytes().to_vec();
    v.extend_from_slice(&u16::try_from(class.len()).unwrap_or(0).to_be_bytes());
    v.extend_from_slice(class);
    v
}

/// A UEFI PXE Solicit as EDK2 builds it: DUID-UUID, IA_NA, ORO with 59,
/// architecture 7, NII, `PXEClient` vendor class.
fn uefi_solicit(arch: u16, class: &[u8]) -> Message6 {
    let mut o = Options::default();
    o.push(opt::ELAPSED_TIME, vec![0, 0]);
    o.push(opt::CLIENTID, uuid_duid());
    o.push(opt::IA_NA, ia(0x0102_0304, &[]));
    o.push(opt::ORO, vec![0, 59, 0, 60, 0, 23, 0, 24]);
    o.push(opt::CLIENT_ARCH_TYPE, arch.to_be_bytes().to_vec());
    o.push(opt::NII, vec![1, 3, 0x10]);
    o.push(opt::VENDOR_CLASS, vendor(class));
    Message6 {
        msg_type: MsgType::Solicit,
        xid: [0xaa, 0xbb, 0xcc],
        options: o,
    }
}

fn run(m: &Message6, t: &BootTable6, leases: &Leases6, from: Ingress6) -> Decision6 {
    handle6(&m.encode(), from, t, leases, 1_000)
}

fn reply(d: Decision6) -> Reply6 {
    match d {
        Decision6::Reply(r) => *r,
        Decision6::Drop { reason } => panic!("dropped: {reason}"),
    }
}

fn reason(d: Decision6) -> DropReason6 {
    match d {
        Decision6::Drop { reason } => reason,
        Decision6::Reply(r) => panic!("answered: {:?}", r.msg_type),
    }
}

fn decoded(r: &Reply6) -> Packet6 {
    Packet6::parse_as(&r.bytes, MsgType::RelayRepl)
        .unwrap_or_else(|e| panic!("reply does not decode: {e}"))
}

fn url(p: &Packet6) -> Option<String> {
    p.message
        .options
        .get(opt::BOOTFILE_URL)
        .map(|b| String::from_utf8_lossy(b).into_owned())
}

/// The addresses and lifetimes inside the reply's IA_NA.
fn ia_addrs(p: &Packet6) -> Vec<(Ipv6Addr, u32, u32)> {
    let Some(b) = p.message.options.get(opt::IA_NA) else {
        return Vec::new();
    };
    Options::parse(&b[12..])
        .map(|o| {
            o.all(opt::IAADDR)
                .map(|a| {
                    let mut x = [0u8; 16];
                    x.copy_from_slice(&a[..16]);
                    (
                        Ipv6Addr::from(x),
                        u32::from_be_bytes([a[16], a[17], a[18], a[19]]),
                        u32::from_be_bytes([a[20], a[21], a[22], a[23]]),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

fn ia_status(p: &Packet6) -> Option<u16> {
    let b = p.message.options.get(opt::IA_NA)?;
    let o = Options::parse(&b[12..]).ok()?;
    o.get(opt::STATUS_CODE)
        .map(|s| u16::from_be_bytes([s[0], s[1]]))
}

#[test]
fn uefi_pxe_solicit_gets_its_reservation_and_a_tftp_url() {
    let t = table(Mode::Lease, false);
    let r = reply(run(
        &uefi_solicit(7, b"PXEClient:Arch:00007:UNDI:003016"),
        &t,
        &Leases6::default(),
        ingress(M1),
    ));
    assert_eq!(r.msg_type, MsgType::Advertise);
    assert_eq!(r.dest, SocketAddrV6::new(link_local(M1), 546, 0, 3));
    assert_eq!(r.effect, None, "an Advertise binds nothing");
    let p = decoded(&r);
    assert_eq!(p.message.xid, [0xaa, 0xbb, 0xcc]);
    assert_eq!(
        p.message.options.get(opt::CLIENTID),
        Some(uuid_duid().as_slice())
    );
    assert_eq!(
        p.message.options.get(opt::SERVERID),
        Some(t.server_duid.as_slice())
    );
    assert_eq!(ia_addrs(&p), vec![(ip("2001:db8:77::50"), 600, 900)]);
    assert_eq!(
        url(&p).as_deref(),
        Some("tftp://[2001:db8:77::1]/snponly.efi")
    );
    assert_eq!(
        p.message.options.get(opt::DNS_SERVERS),
        Some(ip("2001:db8:77::53").octets().as_slice())
    );
    assert!(p.message.options.get(opt::VENDOR_CLASS).is_none());
}

#[test]
fn http_boot_gets_an_http_url_and_the_httpclient_class() {
    let t = table(Mode::Lease, false);
    let r = reply(run(
        &uefi_solicit(16, b"HTTPClient:Arch:00016:UNDI:003016"),
        &t,
        &Leases6::default(),
        ingress(M1),
    ));
    let p = decoded(&r);
    assert_eq!(
        url(&p).as_deref(),
        Some("http://[2001:db8:77::1]:8080/files/snponly.efi")
    );
    let v = p.message.options.get(opt::VENDOR_CLASS).unwrap_or_default();
    assert_eq!(&v[..4], &343u32.to_be_bytes());
    assert_eq!(&v[6..], b"HTTPClient");
}

#[test]
fn arm64_gets_its_first_stage() {
    let t = table(Mode::Lease, false);
    let p = decoded(&reply(run(
        &uefi_solicit(11, b"PXEClient:Arch:00011:UNDI:003016"),
        &t,
        &Leases6::default(),
        ingress(M1),
    )));
    assert_eq!(
        url(&p).as_deref(),
        Some("tftp://[2001:db8:77::1]/snponly-arm64.efi")
    );
    let bios = run(
        &uefi_solicit(0, b"PXEClient"),
        &t,
        &Leases6::default(),
        ingress(M1),
    );
    assert_eq!(reason(bios), DropReason6::UnsupportedArch);
}

#[test]
fn ipxe_gets_its_script() {
    let t = table(Mode::Lease, false);
    let mut m = uefi_solicit(7, b"PXEClient");
    m.options
        .push(opt::USER_CLASS, vec![0, 4, b'i', b'P', b'X', b'E']);
    let p = decoded(&reply(run(&m, &t, &Leases6::default(), ingress(M1))));
    assert_eq!(
        url(&p).as_deref(),
        Some("http://[2001:db8:77::1]:8080/ipxe/52-54-00-12-34-56")
    );
}

#[test]
fn request_binds_and_renew_keeps_it() {
    let t = table(Mode::Lease, false);
    let mut leases = Leases6::default();
    let mut m = uefi_solicit(7, b"PXEClient");
    m.msg_type = MsgType::Request;
    m.options.push(opt::SERVERID, t.server_duid.clone());
    let r = reply(run(&m, &t, &leases, ingress(M1)));
    assert_eq!(r.msg_type, MsgType::Reply);
    let addr = ip("2001:db8:77::50");
    assert_eq!(
        r.effect,
        Some(LeaseEffect6::Bind {
            mac: M1,
            addr,
            expires: 1_900
        })
    );
    if let Some(e) = r.effect {
        leases.apply(e);
    }
    assert_eq!(leases.holder(addr, 1_000), Some(Some(M1)));
    // a Renew naming an old address too: that one gets lifetimes 0
    let mut renew = m.clone();
    renew.msg_type = MsgType::Renew;
    renew.options.0.retain(|(c, _)| *c != opt::IA_NA);
    renew
        .options
        .push(opt::IA_NA, ia(0x0102_0304, &[addr, ip("2001:db8:77::99")]));
    let p = decoded(&reply(run(&renew, &t, &leases, ingress(M1))));
    assert_eq!(
        ia_addrs(&p),
        vec![(addr, 600, 900), (ip("2001:db8:77::99"), 0, 0)]
    );
}

#[test]
fn server_identifiers_are_checked() {
    let t = table(Mode::Lease, false);
    let mut other = uefi_solicit(7, b"PXEClient");
    other.msg_type = MsgType::Request;
    other
        .options
        .push(opt::SERVERID, Duid::ll_ethernet(Mac([2, 9, 9, 9, 9, 9])));
    assert_eq!(
        reason(run(&other, &t, &Leases6::default(), ingress(M1))),
        DropReason6::NotForUs
    );
    let mut no_server = uefi_solicit(7, b"PXEClient");
    no_server.msg_type = MsgType::Request;
    assert_eq!(
        reason(run(&no_server, &t, &Leases6::default(), ingress(M1))),
        DropReason6::NotForUs
    );
    let mut solicit_with = uefi_solicit(7, b"PXEClient");
    solicit_with
        .options
        .push(opt::SERVERID, t.server_duid.clone());
    assert_eq!(
        reason(run(&solicit_with, &t, &Leases6::default(), ingress(M1))),
        DropReason6::NotForUs
    );
    let mut adv = uefi_solicit(7, b"PXEClient");
    adv.msg_type = MsgType::Advertise;
    assert_eq!(
        reason(run(&adv, &t, &Leases6::default(), ingress(M1))),
        DropReason6::UnsupportedMessage
    );
}

#[test]
fn the_mac_gate_holds() {
    let t = table(Mode::Lease, false);
    let stranger = Mac([0x52, 0x54, 0, 9, 9, 9]);
    assert_eq!(
        reason(run(
            &uefi_solicit(7, b"PXEClient"),
            &t,
            &Leases6::default(),
            ingress(stranger)
        )),
        DropReason6::NotEnrolled
    );
    // a DUID-UUID from a source that is not EUI-64: no MAC to gate on
    let from = Ingress6 {
        src: SocketAddrV6::new(ip("fe80::1234:5678:9abc:def0"), 546, 0, 3),
        link_mac: None,
    };
    assert_eq!(
        reason(run(
            &uefi_solicit(7, b"PXEClient"),
            &t,
            &Leases6::default(),
            from
        )),
        DropReason6::NoLinkAddress
    );
    // ... unless the shell knows the neighbour's link-layer address
    let known = Ingress6 {
        link_mac: Some(M1),
        ..from
    };
    assert!(matches!(
        run(
            &uefi_solicit(7, b"PXEClient"),
            &t,
            &Leases6::default(),
            known
        ),
        Decision6::Reply(_)
    ));
    // a DUID-LL names the MAC whatever the source address
    let mut ll = uefi_solicit(7, b"PXEClient");
    ll.options.0.retain(|(c, _)| *c != opt::CLIENTID);
    ll.options.push(opt::CLIENTID, Duid::ll_ethernet(M1));
    assert!(matches!(
        run(&ll, &t, &Leases6::default(), from),
        Decision6::Reply(_)
    ));
}

#[test]
fn proxy_mode_gives_the_url_without_an_address() {
    let t = table(Mode::Proxy, false);
    let p = decoded(&reply(run(
        &uefi_solicit(7, b"PXEClient"),
        &t,
        &Leases6::default(),
        ingress(M1),
    )));
    assert!(ia_addrs(&p).is_empty());
    assert_eq!(ia_status(&p), Some(status::NO_ADDRS_AVAIL));
    assert!(url(&p).is_some());
    // a plain client is not ours to answer in proxy mode
    let mut plain = uefi_solicit(7, b"PXEClient");
    plain
        .options
        .0
        .retain(|(c, _)| *c != opt::CLIENT_ARCH_TYPE && *c != opt::VENDOR_CLASS);
    assert_eq!(
        reason(run(&plain, &t, &Leases6::default(), ingress(M1))),
        DropReason6::NotBootClient
    );
}

#[test]
fn relayed_requests_are_gated_on_option_79_and_answered_through_the_relay() {
    let t = table(Mode::Lease, false);
    let mut hop_opts = Options::default();
    hop_opts.push(opt::INTERFACE_ID, b"eth7".to_vec());
    let mut ll = vec![0, 1];
    ll.extend_from_slice(&M1.0);
    hop_opts.push(opt::CLIENT_LINKLAYER_ADDR, ll);
    let p = Packet6 {
        relays: vec![RelayHop {
            hop_count: 0,
            link: ip("2001:db8:77::fffe"),
            peer: ip("fe80::abcd"),
            options: hop_opts,
        }],
        message: uefi_solicit(7, b"PXEClient"),
    };
    let relay = SocketAddrV6::new(ip("2001:db8:77::fffe"), 547, 0, 0);
    let from = Ingress6 {
        src: relay,
        link_mac: None,
    };
    let r = reply(handle6(
        &p.encode(MsgType::RelayForw),
        from,
        &t,
        &Leases6::default(),
        1_000,
    ));
    assert_eq!(r.dest, relay);
    let back = decoded(&r);
    assert_eq!(r.bytes[0], 13, "a Relay-Reply");
    assert_eq!(back.relays.len(), 1);
    assert_eq!(back.relays[0].peer, ip("fe80::abcd"));
    assert_eq!(
        back.relays[0].options.0,
        vec![(opt::INTERFACE_ID, b"eth7".to_vec())],
        "only the Interface-ID is echoed"
    );
    assert_eq!(back.message.msg_type, MsgType::Advertise);
    assert_eq!(ia_addrs(&back)[0].0, ip("2001:db8:77::50"));
    // a relay on another link
    let mut foreign = p.clone();
    foreign.relays[0].link = ip("2001:db8:99::1");
    assert_eq!(
        reason(handle6(
            &foreign.encode(MsgType::RelayForw),
            from,
            &t,
            &Leases6::default(),
            1_000
        )),
        DropReason6::ForeignRelay
    );
}

#[test]
fn answer_all_assigns_from_the_range_and_honours_declines() {
    let t = table(Mode::Lease, true);
    let mut leases = Leases6::default();
    let other = Mac([0x52, 0x54, 0, 7, 7, 7]);
    let mut m = uefi_solicit(7, b"PXEClient");
    m.msg_type = MsgType::Request;
    m.options.push(opt::SERVERID, t.server_duid.clone());
    let r = reply(run(&m, &t, &leases, ingress(other)));
    let a = r.address.unwrap_or(Ipv6Addr::UNSPECIFIED);
    assert!(u128::from(a) >= u128::from(ip("2001:db8:77::1000")));
    assert!(u128::from(a) <= u128::from(ip("2001:db8:77::10ff")));
    if let Some(e) = r.effect {
        leases.apply(e);
    }
    // the same client again: the same address
    assert_eq!(reply(run(&m, &t, &leases, ingress(other))).address, Some(a));
    // it declines it: a Reply with Success, and it gets another one next
    let mut decline = m.clone();
    decline.msg_type = MsgType::Decline;
    decline.options.0.retain(|(c, _)| *c != opt::IA_NA);
    decline.options.push(opt::IA_NA, ia(1, &[a]));
    let d = reply(run(&decline, &t, &leases, ingress(other)));
    assert_eq!(
        decoded(&d)
            .message
            .options
            .get(opt::STATUS_CODE)
            .map(|s| s[1]),
        Some(0)
    );
    if let Some(e) = d.effect {
        leases.apply(e);
    }
    assert_eq!(leases.holder(a, 1_000), Some(None));
    let again = reply(run(&m, &t, &leases, ingress(other))).address;
    assert!(again.is_some() && again != Some(a));
    // release gives it back
    let mut release = decline.clone();
    release.msg_type = MsgType::Release;
    release.options.0.retain(|(c, _)| *c != opt::IA_NA);
    let b = again.unwrap_or(Ipv6Addr::UNSPECIFIED);
    if let Some(e) = reply(run(&m, &t, &leases, ingress(other))).effect {
        leases.apply(e);
    }
    release.options.push(opt::IA_NA, ia(1, &[b]));
    if let Some(e) = reply(run(&release, &t, &leases, ingress(other))).effect {
        leases.apply(e);
    }
    assert_eq!(leases.holder(b, 1_000), None);
    assert_eq!(leases.collect(1_000 + 900), 1, "the decline expires");
}

#[test]
fn confirm_says_whether_the_addresses_are_on_link() {
    let t = table(Mode::Lease, false);
    let mut c = uefi_solicit(7, b"PXEClient");
    c.msg_type = MsgType::Confirm;
    c.options.0.retain(|(c, _)| *c != opt::IA_NA);
    c.options.push(opt::IA_NA, ia(1, &[ip("2001:db8:77::50")]));
    let code = |m: &Message6| {
        decoded(&reply(run(m, &t, &Leases6::default(), ingress(M1))))
            .message
            .options
            .get(opt::STATUS_CODE)
            .map(|s| u16::from_be_bytes([s[0], s[1]]))
    };
    assert_eq!(code(&c), Some(status::SUCCESS));
    c.options.0.retain(|(c, _)| *c != opt::IA_NA);
    c.options.push(opt::IA_NA, ia(1, &[ip("2001:db8:1::50")]));
    assert_eq!(code(&c), Some(status::NOT_ON_LINK));
}

#[test]
fn a_reserved_address_held_by_another_mac_is_not_given() {
    let t = table(Mode::Lease, false);
    let mut leases = Leases6::default();
    leases.apply(LeaseEffect6::Bind {
        mac: Mac([2, 2, 2, 2, 2, 2]),
        addr: ip("2001:db8:77::50"),
        expires: 5_000,
    });
    let p = decoded(&reply(run(
        &uefi_solicit(7, b"PXEClient"),
        &t,
        &leases,
        ingress(M1),
    )));
    assert!(ia_addrs(&p).is_empty());
    assert_eq!(ia_status(&p), Some(status::NO_ADDRS_AVAIL));
}

#[test]
fn hostile_datagrams_are_dropped_with_their_reason() {
    let t = table(Mode::Lease, true);
    let l = Leases6::default();
    let from = ingress(M1);
    let malformed = |b: &[u8]| match handle6(b, from, &t, &l, 0) {
        Decision6::Drop {
            reason: DropReason6::Malformed(m),
        } => m,
        other => panic!("not dropped as malformed: {other:?}"),
    };
    assert_eq!(malformed(&[]), Malformed6::Truncated);
    assert_eq!(malformed(&[1, 2]), Malformed6::Truncated);
    // an option claiming more than is there
    assert_eq!(
        malformed(&[1, 0, 0, 1, 0, 1, 0xff, 0xff, 0]),
        Malformed6::OptionOverflow
    );
    // no client id in a Solicit
    assert_eq!(
        malformed(&[1, 0, 0, 1, 0, 8, 0, 2, 0, 0]),
        Malformed6::NoClientId
    );
    // two client ids
    let mut two = uefi_solicit(7, b"PXEClient");
    two.options.push(opt::CLIENTID, uuid_duid());
    assert_eq!(malformed(&two.encode()), Malformed6::Repeated);
    // a client id too short to be a DUID
    let mut short = uefi_solicit(7, b"PXEClient");
    short.options.0.retain(|(c, _)| *c != opt::CLIENTID);
    short.options.push(opt::CLIENTID, vec![0, 1]);
    assert_eq!(malformed(&short.encode()), Malformed6::BadDuid);
    // an IA_NA shorter than its fixed part
    let mut bad_ia = uefi_solicit(7, b"PXEClient");
    bad_ia.options.push(opt::IA_NA, vec![1, 2, 3]);
    assert_eq!(malformed(&bad_ia.encode()), Malformed6::BadOptionLength);
    // an odd-length architecture option
    let mut odd = uefi_solicit(7, b"PXEClient");
    odd.options.0.retain(|(c, _)| *c != opt::CLIENT_ARCH_TYPE);
    odd.options.push(opt::CLIENT_ARCH_TYPE, vec![0, 7, 0]);
    assert_eq!(malformed(&odd.encode()), Malformed6::BadOptionLength);
    // a vendor class item that runs past the option
    let mut vc = uefi_solicit(7, b"PXEClient");
    vc.options.0.retain(|(c, _)| *c != opt::VENDOR_CLASS);
    vc.options
        .push(opt::VENDOR_CLASS, vec![0, 0, 1, 87, 0, 50, b'x']);
    assert_eq!(malformed(&vc.encode()), Malformed6::BadOptionLength);
    // relays nested past the limit, each wrapping the next
    let mut b = uefi_solicit(7, b"PXEClient").encode();
    for _ in 0..=HOP_COUNT_LIMIT {
        let mut r = vec![12u8, 0];
        r.extend_from_slice(&[0u8; 32]);
        r.extend_from_slice(&opt::RELAY_MSG.to_be_bytes());
        r.extend_from_slice(&u16::try_from(b.len()).unwrap_or(0).to_be_bytes());
        r.extend_from_slice(&b);
        b = r;
    }
    assert_eq!(malformed(&b), Malformed6::RelayTooDeep);
    // an oversized datagram
    assert_eq!(
        malformed(&vec![1u8; MAX_PACKET6 + 1]),
        Malformed6::Oversized
    );
    // random bytes never panic
    let mut x: u32 = 0x1234_5678;
    for len in 0..2_000usize {
        let mut d = Vec::with_capacity(len % 300);
        for _ in 0..len % 300 {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            d.push((x & 0xff) as u8);
        }
        if let Some(f) = d.first_mut() {
            *f = [1u8, 3, 5, 6, 11, 12][len % 6];
        }
        let _ = handle6(&d, from, &t, &l, 0);
    }
}

#[test]
fn the_range_never_hands_out_another_machines_reservation() {
    let mut t = table(Mode::Lease, true);
    let other = Mac([0x52, 0x54, 0, 7, 7, 7]);
    let mut m = uefi_solicit(7, b"PXEClient");
    m.msg_type = MsgType::Request;
    m.options.push(opt::SERVERID, t.server_duid.clone());
    let leases = Leases6::default();
    let picked = reply(run(&m, &t, &leases, ingress(other)))
        .address
        .unwrap_or(Ipv6Addr::UNSPECIFIED);
    // reserve what the range would pick for `other` to an enrolled machine
    // that has not asked yet: `other` gets a different address
    t.machines.insert(
        Mac([0x52, 0x54, 0, 9, 9, 9]),
        MachineEntry6 {
            name: "lab/m9".into(),
            address: Some(picked),
        },
    );
    let again = reply(run(&m, &t, &leases, ingress(other))).address;
    assert!(again.is_some_and(|a| a != picked), "{again:?} vs {picked}");
}
