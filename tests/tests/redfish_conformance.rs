//! The Redfish driver against two servers: anneal-qemu-bmc driving a real
//! QEMU VM over QMP, and sushy-tools' emulator (`--fake`), so the client is
//! not only tested against our own server. Plus failure classification
//! (wrong password, closed port, TLS trust, unknown schemes) and BMC
//! persistence. (`ipmi://` has its own driver: manager/tests/ipmi_conformance.rs.)
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use anneal_manager::redfish::{
    BmcAddress, BmcReason, BootTarget, PowerState, RedfishClient, ResetType, ShutdownOutcome,
    TlsPolicy,
};
use anneal_testinfra::Netns;
use anneal_tests::bmc::*;

/// The sequence the Machine controller relies on.
async fn conformance(c: &RedfishClient, what: &str) {
    let t0 = Instant::now();
    let sys = c.system().await.unwrap();
    assert!(
        !sys.path.is_empty() && !sys.reset_target.is_empty(),
        "{what}: {sys:?}"
    );
    assert!(
        sys.allowed_targets.iter().any(|t| t == "Pxe"),
        "{what}: Pxe not offered: {sys:?}"
    );
    // Start from off.
    if sys.power_state.is_on() {
        c.reset(ResetType::ForceOff).await.unwrap();
        wait_power(c, PowerState::Off, Duration::from_secs(30)).await;
    }
    c.set_boot_once(BootTarget::Pxe).await.unwrap();
    let sys = c.system().await.unwrap();
    assert_eq!(sys.override_target.as_deref(), Some("Pxe"), "{what}");
    c.reset(ResetType::On).await.unwrap();
    wait_power(c, PowerState::On, Duration::from_secs(30)).await;
    c.clear_boot_override().await.unwrap();
    let sys = c.system().await.unwrap();
    assert_eq!(
        sys.override_target.as_deref(),
        Some("None"),
        "{what}: {sys:?}"
    );
    c.reset(ResetType::ForceRestart).await.unwrap();
    wait_power(c, PowerState::On, Duration::from_secs(30)).await;
    // Graceful shutdown that nothing answers escalates to ForceOff.
    let outcome = c
        .shutdown(Duration::from_secs(2), Duration::from_millis(500))
        .await
        .unwrap();
    assert_ne!(outcome, ShutdownOutcome::AlreadyOff, "{what}");
    wait_power(c, PowerState::Off, Duration::from_secs(30)).await;
    assert_eq!(
        c.shutdown(Duration::from_secs(1), Duration::from_millis(200))
            .await
            .unwrap(),
        ShutdownOutcome::AlreadyOff
    );
    println!(
        "{what}: conformance sequence passed in {:.1} s ({outcome:?})",
        t0.elapsed().as_secs_f64()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redfish_client_conforms_on_qemu_bmc_and_sushy() {
    let ns = Netns::create("anlrf").unwrap();
    let (sushy, mut bmcvm) = tokio::join!(
        Sushy::start(),
        BmcVm::launch(&ns, "52:54:00:7f:00:01", None)
    );

    // --- sushy-emulator (independent implementation) -----------------------
    let sc = client(
        &format!("redfish+http://127.0.0.1:{}", sushy.port),
        "unused",
        TlsPolicy::SystemRoots,
    );
    conformance(&sc, "sushy-emulator").await;

    // --- anneal-qemu-bmc driving a real VM --------------------------------
    let qc = client(&bmcvm.address(), BMC_PASSWORD, TlsPolicy::SystemRoots);
    assert_eq!(
        qc.power_state().await.unwrap(),
        PowerState::Off,
        "-S VM is off"
    );
    conformance(&qc, "anneal-qemu-bmc").await;
    let log = bmcvm.requests();
    let resets: Vec<_> = log
        .iter()
        .filter(|e| e.is_reset())
        .filter_map(|e| e.action.clone())
        .collect();
    assert_eq!(
        resets,
        ["On", "ForceRestart", "GracefulShutdown", "ForceOff"],
        "{log:?}"
    );
    // The override is persisted: it survives a BMC restart, and Once is
    // consumed by the next power-on.
    qc.set_boot_once(BootTarget::Pxe).await.unwrap();
    bmcvm.stop_bmc().await;
    let down = qc.system().await.unwrap_err();
    assert_eq!(down.reason(), BmcReason::BmcUnreachable, "{down}");
    bmcvm.start_bmc().await;
    let sys = qc.system().await.unwrap();
    assert_eq!(
        (
            sys.override_enabled.as_deref(),
            sys.override_target.as_deref()
        ),
        (Some("Once"), Some("Pxe"))
    );
    qc.reset(ResetType::On).await.unwrap();
    let sys = qc.system().await.unwrap();
    assert_eq!(sys.override_enabled.as_deref(), Some("Disabled"));
    assert_eq!(sys.power_state, PowerState::On);
    // The one-time PXE override made the firmware boot the NIC.
    let line = bmcvm
        .vm
        .wait_for_line(
            r"Configuring \(net0|Start PXE over",
            Duration::from_secs(120),
        )
        .await
        .unwrap();
    println!(
        "network boot seen on the console after the Pxe override: {}",
        line.trim()
    );
    qc.reset(ResetType::ForceOff).await.unwrap();

    // --- failure classification ------------------------------------------
    let wrong = client(&bmcvm.address(), "wrong-password", TlsPolicy::SystemRoots);
    let e = wrong.system().await.unwrap_err();
    assert_eq!(e.reason(), BmcReason::CredentialsRejected, "{e}");
    // a port bound (so nobody else takes it) but not listening: refused
    let held = tokio::net::TcpSocket::new_v4().unwrap();
    held.bind(([127, 0, 0, 1], 0).into()).unwrap();
    let closed = client(
        &format!(
            "redfish+http://127.0.0.1:{}",
            held.local_addr().unwrap().port()
        ),
        "x",
        TlsPolicy::SystemRoots,
    );
    assert_eq!(
        closed.system().await.unwrap_err().reason(),
        BmcReason::BmcUnreachable
    );
    let unknown = BmcAddress::parse("snmp://127.0.0.1:161").unwrap_err();
    assert!(unknown.to_string().contains("ipmi://"), "{unknown}");
    assert_eq!(unknown.reason(), BmcReason::QueryFailed);
    drop(sushy);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redfish_tls_trust_by_ca_bundle_or_insecure_skip_verify() {
    let ns = Netns::create("anlrt").unwrap();
    let (ca, cert, key) = test_pki();
    let bmcvm = BmcVm::launch(
        &ns,
        "52:54:00:7f:00:02",
        Some((cert.into_bytes(), key.into_bytes())),
    )
    .await;
    let addr = bmcvm.address();
    assert!(addr.starts_with("redfish://"));
    let trusted = client(&addr, BMC_PASSWORD, TlsPolicy::CaBundle(ca.into_bytes()));
    assert_eq!(trusted.power_state().await.unwrap(), PowerState::Off);
    let insecure = client(&addr, BMC_PASSWORD, TlsPolicy::InsecureSkipVerify);
    assert_eq!(insecure.power_state().await.unwrap(), PowerState::Off);
    // An unknown CA is a TLS failure that needs a fix, not an outage.
    let (other_ca, _, _) = test_pki();
    let untrusted = client(
        &addr,
        BMC_PASSWORD,
        TlsPolicy::CaBundle(other_ca.into_bytes()),
    );
    let e = untrusted.power_state().await.unwrap_err();
    assert_eq!(e.reason(), BmcReason::QueryFailed, "{e}");
    // Plain HTTP to a TLS BMC fails too.
    let plain = client(
        &addr.replace("redfish://", "redfish+http://"),
        BMC_PASSWORD,
        TlsPolicy::SystemRoots,
    );
    assert!(plain.power_state().await.is_err());
    // A CA bundle with no certificate is a TLS configuration conflict.
    let bad = RedfishClient::new(
        &BmcAddress::parse(&addr).unwrap(),
        &anneal_manager::redfish::Credentials {
            username: BMC_USER.into(),
            password: anneal_api::agent::Token::new(BMC_PASSWORD),
        },
        &TlsPolicy::CaBundle(b"not a pem".to_vec()),
        Duration::from_secs(2),
    )
    .unwrap_err();
    assert_eq!(bad.reason(), BmcReason::TlsConfigConflict);
}
