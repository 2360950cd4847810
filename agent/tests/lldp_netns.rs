#![allow(clippy::too_many_lines)]
//! The inspection's LLDP listener against a real LLDP agent: lldpd (Debian's
//! package) plays the switch on one end of a veth pair between two
//! namespaces made by the test, the listener runs in a thread inside the
//! other ("the machine"). Needs root, iproute2 and lldpd (tests/setup.d/agent.sh).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::mpsc;
use std::time::{Duration, Instant};

use anneal_agent::inventory::lldp::{self, Link, Listener};
use anneal_api::agent::{Lldp, Nic};
use anneal_testinfra::{ChildGroup, Netns};

const SWITCH_MAC: &str = "02:00:00:aa:bb:07";

/// Runs `f` on a thread that has entered network namespace `ns`.
fn in_netns<T: Send + 'static>(
    ns: &str,
    f: impl FnOnce() -> T + Send + 'static,
) -> std::thread::JoinHandle<T> {
    let path = format!("/run/netns/{ns}");
    std::thread::spawn(move || {
        let file = std::fs::File::open(&path).unwrap();
        nix::sched::setns(&file, nix::sched::CloneFlags::CLONE_NEWNET).unwrap();
        f()
    })
}

fn link(name: &str) -> Link {
    Link {
        name: name.to_string(),
        index: nix::net::if_::if_nametoindex(name).unwrap(),
    }
}

#[test]
fn lldpd_announcement_reaches_the_inventory_of_its_link() {
    let switch = Netns::bare("llsw").expect("ip netns add (needs root)");
    let machine = Netns::bare("llmc").unwrap();
    switch
        .ip(&[
            "link", "add", "swp7", "type", "veth", "peer", "name", "eth0",
        ])
        .unwrap();
    switch
        .ip(&["link", "set", "eth0", "netns", machine.name()])
        .unwrap();
    switch
        .ip(&["link", "set", "swp7", "address", SWITCH_MAC])
        .unwrap();
    switch.ip(&["link", "set", "swp7", "up"]).unwrap();
    // a second link of the machine whose far end sends nothing
    machine
        .ip(&[
            "link", "add", "eth1", "type", "veth", "peer", "name", "quiet1",
        ])
        .unwrap();
    machine.ip(&["link", "set", "quiet1", "up"]).unwrap();

    // The listener's sockets are bound (and eth0 brought up by it) before
    // lldpd starts, so lldpd's first frame is heard; the window is long and
    // only bounds a failure: the frame ends the wait.
    let (ready_tx, ready_rx) = mpsc::channel();
    let listening = in_netns(machine.name(), move || {
        let (listener, errors) = Listener::start(&[link("eth0")], Duration::from_secs(60));
        assert!(errors.is_empty(), "{errors:?}");
        ready_tx.send(()).unwrap();
        let t = Instant::now();
        (listener.finish(), t.elapsed())
    });
    ready_rx
        .recv_timeout(Duration::from_secs(30))
        .expect("the listener started");
    let conf = switch.dir().join("lldpd.conf");
    std::fs::write(
        &conf,
        "configure system hostname leaf-07.test\n\
         configure lldp portidsubtype ifname\n\
         configure lldp tx-interval 1\n",
    )
    .unwrap();
    let log = switch.dir().join("lldpd.log");
    let sock = switch.dir().join("lldpd.sock");
    let lldpd = ChildGroup::spawn_logged(
        "lldpd",
        switch
            .exec("lldpd")
            .args(["-d", "-I", "swp7", "-C", "swp7", "-u"])
            .arg(&sock)
            .arg("-O")
            .arg(&conf),
        &log,
    )
    .expect("lldpd (Debian package lldpd) is installed");
    let (heard, took) = listening.join().unwrap();
    let lldpd_log = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(
        took < Duration::from_secs(60),
        "no LLDP frame from lldpd within the window; lldpd said:\n{lldpd_log}"
    );
    let got = heard.get("eth0").unwrap_or_else(|| panic!("{heard:?}"));
    assert_eq!(
        got,
        &Lldp {
            chassis_id: SWITCH_MAC.into(),
            port_id: "swp7".into(),
            // lldpd describes a port without an alias by its name
            port_description: Some("swp7".into()),
            system_name: Some("leaf-07.test".into()),
        },
        "lldpd said:\n{lldpd_log}"
    );

    // The NIC named like the link carries it; the wire form is camelCase
    // and a NIC that heard nothing has no `lldp` at all.
    let mut nics = vec![
        Nic {
            name: "eth0".into(),
            mac: "52:54:00:00:00:01".into(),
            link: true,
            ..Nic::default()
        },
        Nic {
            name: "eth1".into(),
            mac: "52:54:00:00:00:02".into(),
            link: true,
            ..Nic::default()
        },
    ];
    lldp::annotate(&mut nics, &heard);
    let json = serde_json::to_value(&nics).unwrap();
    assert_eq!(
        json[0]["lldp"],
        serde_json::json!({"chassisId": SWITCH_MAC, "portId": "swp7",
                           "portDescription": "swp7", "systemName": "leaf-07.test"})
    );
    assert!(json[1].get("lldp").is_none(), "{json}");

    // A link that hears nothing gives nothing, once the window is over; a
    // link that hears lldpd (sending every second now) is kept; a window
    // of 0 does not listen at all.
    let (both, quiet_took) = in_netns(machine.name(), || {
        let t = Instant::now();
        let (heard, errors) = lldp::listen(&[link("eth0"), link("eth1")], Duration::from_secs(3));
        assert!(errors.is_empty(), "{errors:?}");
        (heard, t.elapsed())
    })
    .join()
    .unwrap();
    assert!(quiet_took >= Duration::from_secs(3), "{quiet_took:?}");
    assert!(quiet_took < Duration::from_secs(10), "{quiet_took:?}");
    assert_eq!(
        both.keys().map(String::as_str).collect::<Vec<_>>(),
        ["eth0"],
        "{both:?}"
    );
    let (off, _) = in_netns(machine.name(), || {
        lldp::listen(&[link("eth0")], Duration::ZERO)
    })
    .join()
    .unwrap();
    assert!(off.is_empty());

    // A link that does not exist is an error naming it, not a hang.
    let (none, errors) = in_netns(machine.name(), || {
        lldp::listen(
            &[Link {
                name: "gone0".into(),
                index: 999_999,
            }],
            Duration::from_secs(30),
        )
    })
    .join()
    .unwrap();
    assert!(none.is_empty());
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert!(errors[0].to_string().contains("gone0"), "{}", errors[0]);

    drop(lldpd);
    let (sw, mc) = (switch.name().to_string(), machine.name().to_string());
    drop(switch);
    drop(machine);
    assert!(!Netns::exists(&sw));
    assert!(!Netns::exists(&mc));
}
