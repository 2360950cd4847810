//! bootd DHCPv6: decode-and-decide over arbitrary datagrams against a
//! lease-mode and a proxy-mode table (gated and answer-all), with the lease
//! effect applied so later iterations see populated bindings.
#![no_main]

use std::collections::BTreeMap;
use std::net::{Ipv6Addr, SocketAddrV6};
use std::sync::Mutex;

use anneal_dhcp::v6::{
    BootTable6, Cidr6, Decision6, Duid, Ingress6, Leases6, MachineEntry6, handle6,
};
use anneal_dhcp::{BootFiles, Mac, Mode};
use libfuzzer_sys::fuzz_target;

fn table(mode: Mode, answer_all: bool) -> BootTable6 {
    let mut machines = BTreeMap::new();
    machines.insert(
        Mac([0x52, 0x54, 0, 0, 0, 1]),
        MachineEntry6 {
            name: "lab/m1".into(),
            address: Some(Ipv6Addr::new(0x2001, 0xdb8, 0x77, 0, 0, 0, 0, 0x50)),
        },
    );
    BootTable6 {
        mode,
        server_duid: Duid::ll_ethernet(Mac([2, 0, 0, 0, 0, 1])),
        server_ip: Ipv6Addr::new(0x2001, 0xdb8, 0x77, 0, 0, 0, 0, 1),
        prefix: Cidr6 {
            addr: Ipv6Addr::new(0x2001, 0xdb8, 0x77, 0, 0, 0, 0, 0),
            prefix: 64,
        },
        dns: vec![],
        preferred_lifetime: 600,
        valid_lifetime: 900,
        lease_range: Some((
            Ipv6Addr::new(0x2001, 0xdb8, 0x77, 0, 0, 0, 0, 0x1000),
            Ipv6Addr::new(0x2001, 0xdb8, 0x77, 0, 0, 0, 0, 0x1010),
        )),
        answer_all,
        boot_files: BootFiles::default(),
        http_base: "http://[2001:db8:77::1]:8080".into(),
        boot_params: vec![],
        machines,
    }
}

static LEASES: Mutex<Option<Leases6>> = Mutex::new(None);

fuzz_target!(|data: &[u8]| {
    let Some((&sel, pkt)) = data.split_first() else {
        return;
    };
    let mode = if sel & 1 == 0 { Mode::Lease } else { Mode::Proxy };
    let t = table(mode, sel & 2 != 0);
    let ingress = Ingress6 {
        src: SocketAddrV6::new(
            if sel & 4 == 0 {
                Ipv6Addr::new(0xfe80, 0, 0, 0, 0x5054, 0xff, 0xfe00, 1)
            } else {
                Ipv6Addr::new(0x2001, 0xdb8, 0x77, 0, 0, 0, 0, 0xfffe)
            },
            546,
            0,
            2,
        ),
        link_mac: None,
    };
    let mut guard = LEASES.lock().unwrap_or_else(|p| p.into_inner());
    let leases = guard.get_or_insert_with(Leases6::default);
    let now = 1_800_000_000 + u64::from(sel >> 3);
    if let Decision6::Reply(r) = handle6(pkt, ingress, &t, leases, now) {
        assert!(r.bytes.len() >= 4);
        if let Some(e) = r.effect {
            leases.apply(e);
        }
        if leases.len() > 10_000 {
            leases.collect(u64::MAX);
        }
    }
});
