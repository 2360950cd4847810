//! bootd: decode-and-decide over arbitrary datagrams, on both ports, against
//! a lease-mode and a proxy-mode table (gated and answer-all), with the lease
//! effect applied so later iterations see a populated lease table.
#![no_main]

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::sync::Mutex;

use anneal_dhcp::{
    BootFiles, BootTable, Decision, Ingress, Leases, Mac, MachineEntry, Mode, Request, ServerPort,
    decide,
};
use libfuzzer_sys::fuzz_target;

fn table(mode: Mode, answer_all: bool) -> BootTable {
    let mut machines = BTreeMap::new();
    machines.insert(
        Mac([0x52, 0x54, 0, 0, 0, 1]),
        MachineEntry {
            name: "lab/m1".into(),
            address: Some(Ipv4Addr::new(10, 77, 0, 50)),
            loader: anneal_dhcp::Loader::default(),
        },
    );
    BootTable {
        mode,
        server_ip: Ipv4Addr::new(10, 77, 0, 1),
        cidr: anneal_dhcp::Cidr {
            addr: Ipv4Addr::new(10, 77, 0, 0),
            prefix: 24,
        },
        router: None,
        dns: vec![],
        lease_time: 600,
        lease_range: Some((Ipv4Addr::new(10, 77, 0, 100), Ipv4Addr::new(10, 77, 0, 110))),
        answer_all,
        boot_files: BootFiles::default(),
        http_base: "http://10.77.0.1:8080".into(),
        machines,
        revision: "fuzz".into(),
    }
}

static LEASES: Mutex<Option<Leases>> = Mutex::new(None);

fuzz_target!(|data: &[u8]| {
    let Some((&sel, pkt)) = data.split_first() else {
        return;
    };
    let port = if sel & 1 == 0 { ServerPort::Dhcp } else { ServerPort::PxeBoot };
    let mode = if sel & 2 == 0 { Mode::Lease } else { Mode::Proxy };
    let t = table(mode, sel & 4 != 0);
    let ingress = Ingress {
        port,
        src: SocketAddrV4::new(Ipv4Addr::new(10, 77, 0, 9), 68),
    };
    let Ok(req) = Request::parse(pkt, ingress) else {
        return;
    };
    let mut guard = LEASES.lock().unwrap_or_else(|p| p.into_inner());
    let leases = guard.get_or_insert_with(Leases::default);
    let now = 1_800_000_000 + u64::from(sel >> 3);
    match decide(&req, &t, leases, now) {
        Decision::Reply(r) => {
            assert!(r.bytes.len() >= 240 && r.bytes.len() <= req.max_reply_len());
            if let Some(e) = r.effect {
                leases.apply(e, now);
            }
        }
        Decision::Update(e) => leases.apply(e, now),
        Decision::Drop { .. } => {}
    }
});
