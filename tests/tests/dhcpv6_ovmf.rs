//! Real firmware against the DHCPv6 core: OVMF with IPv4 PXE switched off
//! boots from the network over IPv6 in a test namespace (radvd sends the
//! prefix), and a server built on `anneal_dhcp::v6` answers it on
//! `[::]:547` (ff02::1:2 joined on the bridge).
//!
//! - OVMF's Solicit decodes, names the VM's MAC (EUI-64 link-local source or
//!   its DUID), architecture 7 and the `PXEClient` vendor class;
//! - the Advertise offers the reservation and `tftp://[fd77::1]/…`, and
//!   OVMF's Request that follows names our server identifier and that
//!   address: the firmware accepted our Advertise.
//!
//! With `ANNEAL_WRITE_VECTORS=<dir>` the datagrams OVMF sent are written
//! there as hex: that is how `bootd/anneal-dhcp/tests/vectors/ovmf-*.hex`
//! were made (the golden vectors `anneal-dhcp`'s tests decide on).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeMap;
use std::net::{Ipv6Addr, SocketAddr, SocketAddrV6, UdpSocket};
use std::time::{Duration, Instant};

use anneal_dhcp::v6::{
    BootTable6, Cidr6, ClientKind6, Decision6, Duid, Ingress6, Leases6, MachineEntry6, MsgType,
    Request6, decide6,
};
use anneal_dhcp::{BootFiles, Mac, Mode};
use anneal_testinfra::{Netns, NicConfig, Vm, VmConfig};

const MAC: &str = "52:54:00:6e:76:36";
const RESERVED: &str = "fd77::50";

fn table(mac: Mac) -> BootTable6 {
    let mut machines = BTreeMap::new();
    machines.insert(
        mac,
        MachineEntry6 {
            name: "default/v6".into(),
            address: Some(RESERVED.parse().unwrap()),
        },
    );
    BootTable6 {
        mode: Mode::Lease,
        server_duid: Duid::ll_ethernet(Mac([0x02, 0x77, 0, 0, 0, 1])),
        server_ip: "fd77::1".parse().unwrap(),
        prefix: Cidr6 {
            addr: "fd77::".parse().unwrap(),
            prefix: 64,
        },
        dns: vec![],
        preferred_lifetime: 600,
        valid_lifetime: 900,
        lease_range: None,
        answer_all: false,
        boot_files: BootFiles::default(),
        http_base: "http://[fd77::1]:8080".into(),
        boot_params: vec![],
        machines,
    }
}

/// One datagram the firmware sent and what we answered.
struct Seen {
    bytes: Vec<u8>,
    src: SocketAddrV6,
    answered: Option<MsgType>,
}

/// Serves DHCPv6 on `br0` (interface `ifindex`) until a Request (or a
/// rapid-commit Solicit) is answered with a Reply, or `limit` passes.
fn serve(ifindex: u32, mac: Mac, limit: Duration) -> anyhow::Result<Vec<Seen>> {
    let sock = UdpSocket::bind("[::]:547")?;
    sock.join_multicast_v6(&"ff02::1:2".parse()?, ifindex)?;
    sock.set_read_timeout(Some(Duration::from_millis(500)))?;
    let t = table(mac);
    let mut leases = Leases6::default();
    let mut seen = Vec::new();
    let deadline = Instant::now() + limit;
    let mut buf = vec![0u8; 65536];
    while Instant::now() < deadline {
        let (n, from) = match sock.recv_from(&mut buf) {
            Ok(x) => x,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                continue;
            }
            Err(e) => return Err(e.into()),
        };
        let SocketAddr::V6(src) = from else { continue };
        let bytes = buf[..n].to_vec();
        let ingress = Ingress6 {
            src,
            link_mac: None,
        };
        let req = Request6::parse(&bytes, ingress).map_err(|e| {
            anyhow::anyhow!(
                "OVMF's datagram does not decode: {e}: {}",
                hex::encode(&bytes)
            )
        })?;
        let mut answered = None;
        if let Decision6::Reply(r) = decide6(&req, &t, &leases, 1_000) {
            sock.send_to(&r.bytes, r.dest)?;
            if let Some(e) = r.effect {
                leases.apply(e);
            }
            answered = Some(r.msg_type);
        }
        let done = answered == Some(MsgType::Reply)
            && matches!(req.msg_type(), MsgType::Request | MsgType::Solicit);
        seen.push(Seen {
            bytes,
            src,
            answered,
        });
        if done {
            break;
        }
    }
    Ok(seen)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ovmf_ipv6_pxe_takes_our_advertise() {
    let mut ns = Netns::create("anlv6").unwrap();
    ns.start_router_advertisements().unwrap();
    let tap = ns.add_tap().unwrap();
    let out = ns.ip(&["-o", "link", "show", "br0"]).unwrap();
    let ifindex: u32 = out.split(':').next().unwrap().trim().parse().unwrap();
    let mac: Mac = MAC.parse().unwrap();
    let name = ns.name().to_string();
    let server = std::thread::spawn(move || {
        anneal_bootd::in_netns(&name, move || serve(ifindex, mac, Duration::from_secs(240)))
    });

    let mut nic = NicConfig::virtio(&tap, MAC);
    nic.option_rom = false;
    let cfg = VmConfig {
        memory_mib: 512,
        cpus: 1,
        nics: vec![nic],
        extra_args: vec![
            "-fw_cfg".into(),
            "name=opt/org.tianocore/IPv4PXESupport,string=n".into(),
        ],
        ..VmConfig::default()
    };
    let mut vm = Vm::launch(&cfg, Some(&ns)).unwrap();
    let seen = tokio::task::spawn_blocking(move || server.join())
        .await
        .unwrap()
        .expect("server thread panicked")
        .expect("entering the namespace")
        .expect("serving DHCPv6");
    vm.kill();

    if let Ok(dir) = std::env::var("ANNEAL_WRITE_VECTORS") {
        for (i, s) in seen.iter().enumerate() {
            let kind = MsgType::from_u8(s.bytes[0]).label();
            let path = std::path::Path::new(&dir).join(format!("ovmf-pxe6-{i}-{kind}.hex"));
            std::fs::write(&path, hex::encode(&s.bytes)).unwrap();
            println!("wrote {} (from {})", path.display(), s.src);
        }
    }
    let summary: Vec<String> = seen
        .iter()
        .map(|s| {
            format!(
                "{} → {:?}",
                MsgType::from_u8(s.bytes[0]).label(),
                s.answered
            )
        })
        .collect();
    println!("exchange: {summary:?}");
    let solicit = seen
        .iter()
        .find(|s| s.bytes[0] == 1)
        .unwrap_or_else(|| panic!("no Solicit from OVMF: {summary:?}"));
    let req = Request6::parse(
        &solicit.bytes,
        Ingress6 {
            src: solicit.src,
            link_mac: None,
        },
    )
    .unwrap();
    assert_eq!(req.mac, Some(mac), "the Solicit names the VM's MAC");
    assert_eq!(req.arch.first(), Some(&7), "architecture 7 (x64 UEFI)");
    assert_eq!(req.client_kind(), ClientKind6::Pxe);
    assert!(!req.ia_na.is_empty(), "OVMF asks for an address");
    assert_eq!(solicit.answered, Some(MsgType::Advertise));
    // OVMF chose our Advertise: its Request names our server and the address
    let t = table(mac);
    let request = seen
        .iter()
        .find(|s| s.bytes[0] == 3)
        .unwrap_or_else(|| panic!("OVMF sent no Request after our Advertise: {summary:?}"));
    let r = Request6::parse(
        &request.bytes,
        Ingress6 {
            src: request.src,
            link_mac: None,
        },
    )
    .unwrap();
    assert_eq!(r.server_id.as_deref(), Some(t.server_duid.as_slice()));
    let want: Ipv6Addr = RESERVED.parse().unwrap();
    assert!(
        r.ia_na.iter().any(|ia| ia.addrs.contains(&want)),
        "the Request names {want}: {:?}",
        r.ia_na
    );
    assert_eq!(request.answered, Some(MsgType::Reply));
}
