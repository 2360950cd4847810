//! The IPMI driver (docs/lifecycle.md, "BMC access and failures") against
//! Debian's ipmi_sim on loopback: power status, on, off, cycle, hard reset,
//! soft shutdown, the one-time PXE boot flags cross-checked with `ipmitool
//! chassis bootparam get 5`, and the failures the lifecycle classifies (wrong
//! password, unknown user, no BMC listening). ipmi_sim's chassis is the state
//! directory of qemu/ipmi-sim/chassis-control.sh.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
#![allow(clippy::too_many_lines)]

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anneal_api::agent::Token;
use anneal_manager::bmc::BmcClient;
use anneal_manager::ipmi::wire::ChassisControl;
use anneal_manager::ipmi::{IpmiClient, IpmiError};
use anneal_manager::redfish::{BmcReason, BootTarget, PowerState, ResetType, ShutdownOutcome};
use anneal_qemu_bmc::ipmi_sim::{self, IpmiSimConfig, RunningIpmiSim};

const USER: &str = "admin";
const PASSWORD: &str = "ipmi-test-pass";

fn free_udp() -> SocketAddr {
    let s = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    s.local_addr().unwrap()
}

fn client(addr: SocketAddr, user: &str, password: &str, timeout: Duration) -> IpmiClient {
    IpmiClient::new(
        &addr.ip().to_string(),
        addr.port(),
        user,
        Token::new(password.to_string()),
        timeout,
    )
}

/// Starts ipmi_sim and waits for its first answer.
async fn sim(dir: &std::path::Path) -> (RunningIpmiSim, SocketAddr) {
    let listen = free_udp();
    let sim = ipmi_sim::start(&IpmiSimConfig {
        listen,
        username: USER.into(),
        password: PASSWORD.into(),
        dir: dir.to_path_buf(),
        qmp: None,
    })
    .unwrap();
    let c = client(listen, USER, PASSWORD, Duration::from_millis(600));
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match c.power_state().await {
            Ok(_) => break,
            Err(e) if Instant::now() < deadline => {
                assert_eq!(e.reason(), BmcReason::BmcUnreachable, "{e}");
            }
            Err(e) => panic!("ipmi_sim did not answer: {e}\n{}", sim.log()),
        }
    }
    (sim, listen)
}

/// Waits until `f` holds, reading the simulator's state after each
/// answer of the BMC.
async fn until(c: &IpmiClient, what: &str, timeout: Duration, f: impl Fn(PowerState) -> bool) {
    let deadline = Instant::now() + timeout;
    loop {
        let p = c.power_state().await.unwrap();
        if f(p) {
            return;
        }
        assert!(Instant::now() < deadline, "{what}: still {p:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn ipmitool(addr: SocketAddr, args: &[&str]) -> String {
    let out = std::process::Command::new("ipmitool")
        .args(["-I", "lanplus", "-C", "3", "-H"])
        .arg(addr.ip().to_string())
        .arg("-p")
        .arg(addr.port().to_string())
        .args(["-U", USER, "-P", PASSWORD])
        .args(args)
        .output()
        .expect("ipmitool (apt-get install ipmitool)");
    assert!(
        out.status.success(),
        "ipmitool {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[tokio::test]
async fn ipmi_driver_against_ipmi_sim() {
    let dir = tempfile::tempdir().unwrap();
    let (sim, addr) = sim(dir.path()).await;
    let c = client(addr, USER, PASSWORD, Duration::from_secs(3));
    let t0 = Instant::now();

    assert_eq!(c.power_state().await.unwrap(), PowerState::Off);
    // One-time PXE (valid, once, EFI): ipmi_sim keeps the device and
    // ipmitool reads it back as Force PXE.
    c.set_boot_once(BootTarget::Pxe).await.unwrap();
    assert_eq!(sim.boot_device(), "pxe");
    let param5 = ipmitool(addr, &["chassis", "bootparam", "get", "5"]);
    assert!(
        param5.contains("Boot Device Selector : Force PXE"),
        "{param5}"
    );
    // Power on, through the BmcClient the lifecycle driver uses.
    let bmc = BmcClient::Ipmi(client(addr, USER, PASSWORD, Duration::from_secs(3)));
    bmc.reset(ResetType::On).await.unwrap();
    assert!(bmc.system().await.unwrap().powered_on);
    assert!(!bmc.system().await.unwrap().offers_http_boot);
    assert!(sim.powered_on());
    // Hard reset is a reset pulse, the power stays on.
    c.reset(ResetType::ForceRestart).await.unwrap();
    assert_eq!(sim.calls().last().map(String::as_str), Some("set reset 1"));
    assert_eq!(c.power_state().await.unwrap(), PowerState::On);
    // Power cycle: off now, on again by ipmi_sim's timer (1 s).
    let before = sim.calls().len();
    c.chassis_control(ChassisControl::PowerCycle).await.unwrap();
    until(&c, "power cycle", Duration::from_secs(10), |p| p.is_on()).await;
    assert_eq!(
        &sim.calls()[before..],
        ["set power 0", "set power 1"],
        "{:?}",
        sim.calls()
    );
    // Clearing the override: ipmi_sim passes device 0 ("none").
    bmc.clear_boot_override().await.unwrap();
    assert_eq!(sim.boot_device(), "none");
    // Off, then a graceful shutdown of an off chassis sends nothing.
    c.reset(ResetType::ForceOff).await.unwrap();
    assert_eq!(c.power_state().await.unwrap(), PowerState::Off);
    let n = sim.calls().len();
    assert_eq!(
        c.shutdown(Duration::from_secs(2), Duration::from_millis(100))
            .await
            .unwrap(),
        ShutdownOutcome::AlreadyOff
    );
    assert_eq!(sim.calls().len(), n);
    // A soft shutdown that the chassis honours is graceful.
    c.reset(ResetType::On).await.unwrap();
    assert_eq!(
        bmc.shutdown(Duration::from_secs(5), Duration::from_millis(100))
            .await
            .unwrap(),
        ShutdownOutcome::Graceful
    );
    assert_eq!(
        sim.calls().last().map(String::as_str),
        Some("set shutdown 1")
    );
    // Disk once.
    c.set_boot_once(BootTarget::Hdd).await.unwrap();
    let param5 = ipmitool(addr, &["chassis", "bootparam", "get", "5"]);
    // ipmi_sim names device 0x08 (disk) "default"; ipmitool reads it back.
    assert_eq!(sim.boot_device(), "default");
    assert!(
        param5.contains("Force Boot from default Hard-Drive"),
        "{param5}"
    );
    // UEFI HTTP boot cannot be selected over IPMI.
    let e = c.set_boot_once(BootTarget::UefiHttp).await.unwrap_err();
    assert!(matches!(e, IpmiError::UnsupportedTarget { .. }), "{e}");
    println!(
        "ipmi conformance: {} chassis sets in {:?}",
        sim.calls().len(),
        t0.elapsed()
    );
    sim.stop();
}

#[tokio::test]
async fn ipmi_failures_are_classified_and_name_the_bmc() {
    let dir = tempfile::tempdir().unwrap();
    let (sim, addr) = sim(dir.path()).await;
    let bmc = addr.to_string();

    // Wrong password: RAKP 2 does not verify with it.
    let e = client(addr, USER, "not-the-password", Duration::from_secs(3))
        .power_state()
        .await
        .unwrap_err();
    assert_eq!(e.reason(), BmcReason::CredentialsRejected, "{e}");
    let msg = e.to_string();
    assert!(msg.contains(&bmc) && msg.contains("password"), "{msg}");
    // Unknown user: the BMC refuses RAKP 1 (unauthorized name).
    let e = client(addr, "nobody", PASSWORD, Duration::from_secs(3))
        .power_state()
        .await
        .unwrap_err();
    assert_eq!(e.reason(), BmcReason::CredentialsRejected, "{e}");
    assert!(e.to_string().contains(&bmc), "{e}");
    // Nothing was switched by the refused sessions.
    assert!(sim.calls().is_empty(), "{:?}", sim.calls());
    sim.stop();

    // No BMC: every attempt within the timeout, then unreachable.
    let silent = free_udp();
    let t0 = Instant::now();
    let e = client(silent, USER, PASSWORD, Duration::from_millis(900))
        .power_state()
        .await
        .unwrap_err();
    let took = t0.elapsed();
    assert_eq!(e.reason(), BmcReason::BmcUnreachable, "{e}");
    assert!(e.to_string().contains(&silent.to_string()), "{e}");
    assert!(matches!(e, IpmiError::Timeout { attempts: 3, .. }), "{e}");
    assert!(took >= Duration::from_millis(600), "gave up after {took:?}");
}
