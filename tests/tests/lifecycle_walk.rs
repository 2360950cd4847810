//! The Machine lifecycle end to end on a real control plane with a real
//! QEMU VM behind anneal-qemu-bmc: enrolment, a one-time PXE power-on, the
//! agent protocol over real HTTPS (a test client stands in for the agent),
//! the security table, a manager killed and restarted between power-on and
//! registration, Available with MachineHardware, and the power-off through
//! Redfish. The boot token never shows in logs or in any status.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use anneal_api::{Machine, MachineHardware};
use anneal_manager::agentapi::AgentApiConfig;
use anneal_manager::lifecycle::LifecycleConfig;
use anneal_manager::redfish::{PowerState, TlsPolicy};
use anneal_testinfra::{ControlPlane, Netns};
use anneal_tests::bmc::*;
use anneal_tests::eventually;
use anneal_tests::lifecycle::*;
use hyper::Method;
use kube::ResourceExt;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};

/// The boot MACs of walk-a and walk-b (their registrations name them).
const MAC_A: &str = "52:54:00:7f:10:01";
const MAC_B: &str = "52:54:00:7f:10:02";

fn configs(port: u16) -> (LifecycleConfig, AgentApiConfig) {
    (
        LifecycleConfig {
            boot_token_lifetime: Duration::from_secs(45),
            graceful_shutdown_timeout: Duration::from_secs(2),
            bmc_timeout: Duration::from_secs(3),
            health_interval: Duration::from_secs(5),
            // the BMCs of the tests speak plain HTTP (redfish+http://)
            allow_insecure_bmc: true,
            ..LifecycleConfig::default()
        },
        AgentApiConfig {
            listen: ([127, 0, 0, 1], port).into(),
            namespace: "anneal-system".into(),
            server_names: vec!["127.0.0.1".into(), "localhost".into()],
            session_ttl: Duration::from_secs(600),
            session_renew_after: Duration::from_secs(300),
            long_poll: Duration::from_secs(3),
            fast_track_window: None,
        },
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lifecycle_walk_security_table_and_manager_restart() {
    let logs = capture_logs();
    let t0 = Instant::now();
    let ns = Netns::create("anllw").unwrap();
    let (cp, bmcvm) = tokio::join!(
        ControlPlane::start(),
        BmcVm::launch(&ns, "52:54:00:7f:10:01", None)
    );
    let cp = cp.unwrap();
    let client = prepare(&cp, &[("bmc-a", BMC_PASSWORD)]).await;
    let secrets: Api<k8s_openapi::api::core::v1::Secret> =
        Api::namespaced(client.clone(), "default");

    // port 0: the kernel picks; the restarted manager reuses that port
    let (lc, mut api_cfg) = configs(0);
    let mut manager = Manager::start(cp.kubeconfig_path(), lc.clone(), api_cfg.clone());
    let port = manager.api_addr.port();
    api_cfg.listen.set_port(port);
    let ca_pem = manager.ca_pem.clone();

    let machines: Api<Machine> = Api::namespaced(client.clone(), "default");
    machines
        .create(
            &PostParams::default(),
            &machine("walk-a", MAC_A, Some((&bmcvm.address(), "bmc-a"))),
        )
        .await
        .unwrap();
    // A machine with no BMC (powered by hand): armed, never powered.
    machines
        .create(&PostParams::default(), &machine("walk-b", MAC_B, None))
        .await
        .unwrap();

    // Enrolling → Inspecting: token minted, one-time PXE override, power on.
    let token_a = eventually("walk-a armed", Duration::from_secs(60), || async {
        let m = machine_json(&machines, "walk-a").await;
        if m["status"]["state"] == "Inspecting" && m["status"]["netBoot"]["tokenHash"].is_string() {
            armed_boot_token(&client, "walk-a").await
        } else {
            None
        }
    })
    .await;
    println!("walk-a armed after {:.1} s", t0.elapsed().as_secs_f64());
    let m = machine_json(&machines, "walk-a").await;
    assert_eq!(
        m["status"]["netBoot"]["tokenHash"],
        anneal_manager::lifecycle::status::token_hash(&token_a)
    );
    assert_eq!(token_a.len(), 64, "32 random bytes, hex");
    let secret = secrets.get("walk-a-boot-token").await.unwrap();
    assert_eq!(
        secret.owner_references()[0].name,
        "walk-a",
        "boot token owned by the machine"
    );
    // the arm is written before the BMC is called (the lifecycle driver):
    // wait for the power-on to reach the BMC, do not read its log once
    let (log, on) = eventually("walk-a powered on", Duration::from_secs(30), || async {
        let log = bmcvm.requests();
        match log
            .iter()
            .position(|e| e.is_reset() && e.action.as_deref() == Some("On"))
        {
            Some(on) => Ok((log, on)),
            None => Err(log),
        }
    })
    .await;
    let patch = log
        .iter()
        .position(|e| e.method == "PATCH" && e.action.as_deref() == Some("Boot=Once/Pxe"))
        .unwrap_or_else(|| panic!("no one-time Pxe override: {log:?}"));
    assert!(patch < on, "override before power-on: {log:?}");
    let rf = client_for(&bmcvm);
    assert_eq!(rf.power_state().await.unwrap(), PowerState::On);
    let token_b = eventually("walk-b armed", Duration::from_secs(30), || async {
        armed_boot_token(&client, "walk-b").await
    })
    .await;

    // --- security table (nothing changes state) --------------------------
    let before_a = machine_json(&machines, "walk-a").await["status"].clone();
    let agent = AgentClient::new(manager.api_addr, &ca_pem);
    // plain HTTP is refused (the port speaks TLS only)
    let plain = anneal_manager::redfish::http::exchange(
        &anneal_manager::redfish::Endpoint {
            tls: None,
            ..agent.ep.clone()
        },
        Method::POST,
        anneal_api::agent::paths::REGISTER,
        None,
        Some(b"{}".to_vec()),
    )
    .await;
    assert!(plain.is_err(), "plain http answered: {plain:?}");
    // schema header missing or different → 426
    let (code, _) = agent
        .call(
            Method::GET,
            anneal_api::agent::paths::NEXT,
            None,
            None,
            None,
        )
        .await;
    assert_eq!(code, 426);
    let (code, body) = agent
        .call(
            Method::GET,
            anneal_api::agent::paths::NEXT,
            None,
            Some("2"),
            None,
        )
        .await;
    assert_eq!((code, body["code"].as_str()), (426, Some("schemaMismatch")));
    // missing / malformed session tokens → 401
    let (code, _) = agent
        .call(
            Method::GET,
            anneal_api::agent::paths::NEXT,
            None,
            Some("1"),
            None,
        )
        .await;
    assert_eq!(code, 401, "missing bearer");
    let (code, _) = agent
        .call(
            Method::PUT,
            anneal_api::agent::paths::HARDWARE,
            Some("not-a-token"),
            Some("1"),
            Some(sample_hardware()),
        )
        .await;
    assert_eq!(code, 401, "malformed bearer");
    // the boot token is not a session token
    let (code, _) = agent.next(&token_a).await;
    assert_eq!(code, 401, "boot token used as session");
    // malformed / unknown boot tokens → 401
    assert_eq!(agent.register("short", Some("default/walk-a")).await.0, 401);
    assert_eq!(agent.register(&"0".repeat(64), None).await.0, 401);
    // unknown fields → 400
    let (code, _) = agent
        .call(
            Method::POST,
            anneal_api::agent::paths::REGISTER,
            None,
            Some("1"),
            Some(serde_json::json!({"bootToken": token_a, "bootMac": "x", "agentVersion": "v", "admin": true})),
        )
        .await;
    assert_eq!(code, 400);
    // a registration in another schema version: 426, AgentCompatible=False
    let (code, _) = agent
        .call(
            Method::POST,
            anneal_api::agent::paths::REGISTER,
            None,
            Some("2"),
            Some(serde_json::json!({"bootToken": token_b, "bootMac": "x", "agentVersion": "v9"})),
        )
        .await;
    assert_eq!(code, 426);
    eventually("AgentCompatible=False", Duration::from_secs(10), || async {
        let m = machine_json(&machines, "walk-b").await;
        (cond(&m, "AgentCompatible") == Some(("False".into(), "SchemaMismatch".into())))
            .then_some(())
    })
    .await;
    // another machine's token, naming this machine → 401
    assert_eq!(
        agent.register(&token_b, Some("default/walk-a")).await.0,
        401
    );
    let after_a = machine_json(&machines, "walk-a").await["status"].clone();
    assert_eq!(before_a["netBoot"], after_a["netBoot"], "walk-a changed");
    assert!(after_a["agent"].is_null(), "{after_a}");
    assert!(
        boot_token(&client, "walk-b").await.is_some(),
        "walk-b token consumed"
    );

    // --- the manager dies between power-on and registration --------------
    manager.kill();
    // the killed listener is gone once its port binds again
    eventually(
        &format!("the killed agent API's port {port} free"),
        Duration::from_secs(30),
        || async { std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() },
    )
    .await;
    let mut manager = Manager::start(cp.kubeconfig_path(), lc, api_cfg);
    assert_eq!(manager.ca_pem, ca_pem, "the CA survives in its Secret");
    let agent = AgentClient::new(manager.api_addr, &ca_pem);

    // --- registration with the real token ----------------------------------
    let (code, reg) = agent
        .register_as(&token_a, Some("default/walk-a"), MAC_A)
        .await;
    assert_eq!(code, 200, "{reg}");
    assert_eq!(reg["machine"]["name"], "walk-a");
    let session = reg["sessionToken"].as_str().unwrap().to_string();
    assert_eq!(session.len(), 64);
    // a lost answer retried (the same request from the same address, the
    // session unused) gets the same session (docs/api.md, "Agent protocol");
    // another request is refused
    let (code, again) = agent
        .register_as(&token_a, Some("default/walk-a"), MAC_A)
        .await;
    assert_eq!(
        (code, again["sessionToken"].as_str()),
        (200, Some(session.as_str())),
        "{again}"
    );
    assert_eq!(agent.register_as(&token_a, None, MAC_A).await.0, 401);
    assert!(
        boot_token(&client, "walk-a").await.is_none(),
        "plaintext deleted"
    );
    // the session of walk-a does not act for walk-b and vice versa: B's
    // registration yields B's identity only
    let (code, reg_b) = agent.register_as(&token_b, None, MAC_B).await;
    assert_eq!(
        (code, reg_b["machine"]["name"].as_str()),
        (200, Some("walk-b"))
    );
    let m = machine_json(&machines, "walk-b").await;
    assert_eq!(cond(&m, "AgentCompatible").unwrap().0, "True", "{m}");

    let (code, _) = agent
        .call(
            Method::PUT,
            anneal_api::agent::paths::HARDWARE,
            Some(&session),
            Some("1"),
            Some(sample_hardware()),
        )
        .await;
    assert_eq!(code, 204);
    // single use: once its session was used, the token is refused
    let (code, body) = agent
        .register_as(&token_a, Some("default/walk-a"), MAC_A)
        .await;
    assert_eq!((code, body["code"].as_str()), (401, Some("invalidToken")));
    let hw: Api<MachineHardware> = Api::namespaced(client.clone(), "default");
    let h = hw.get("walk-a").await.unwrap();
    assert_eq!(h.owner_references()[0].name, "walk-a");
    assert_eq!(h.spec.disks[0].device_name, "/dev/vda");
    assert!(hw.get_opt("walk-b").await.unwrap().is_none());

    // Available, then powered off through Redfish; the agent is told to
    // power off too.
    eventually("walk-a Available", Duration::from_secs(60), || async {
        (machine_json(&machines, "walk-a").await["status"]["state"] == "Available").then_some(())
    })
    .await;
    let (code, next) = agent.next(&session).await;
    assert_eq!(
        (code, next["action"].as_str()),
        (200, Some("poweroff")),
        "{next}"
    );
    eventually(
        "VM off through Redfish",
        Duration::from_secs(60),
        || async { (rf.power_state().await.ok() == Some(PowerState::Off)).then_some(()) },
    )
    .await;
    let log = bmcvm.requests();
    let resets: Vec<_> = log
        .iter()
        .filter(|e| e.is_reset())
        .filter_map(|e| e.action.clone())
        .collect();
    assert_eq!(resets, ["On", "GracefulShutdown", "ForceOff"], "{log:?}");
    // The BMC is off; the Machine's status follows at the controller's next
    // look at the BMC: wait for that state, do not read it once.
    let m = eventually(
        "walk-a status.poweredOn false",
        Duration::from_secs(60),
        || async {
            let m = machine_json(&machines, "walk-a").await;
            if m["status"]["poweredOn"] == false {
                Ok(m)
            } else {
                Err(m["status"].clone())
            }
        },
    )
    .await;
    assert_eq!(cond(&m, "BMCReachable").unwrap().0, "True", "{m}");
    assert_eq!(cond(&m, "AgentRegistered").unwrap().0, "True", "{m}");
    println!(
        "walk-a Available and off after {:.1} s",
        t0.elapsed().as_secs_f64()
    );

    // No token in any status, nor in the manager's logs.
    let all = machines.list(&ListParams::default()).await.unwrap();
    let statuses = serde_json::to_string(&all.items).unwrap();
    for (what, secret) in [
        ("boot token a", &token_a),
        ("boot token b", &token_b),
        ("session token", &session),
    ] {
        assert!(!statuses.contains(secret.as_str()), "{what} in a status");
        assert!(!logs.text().contains(secret.as_str()), "{what} in the logs");
    }
    assert!(
        logs.text().contains("agent registered"),
        "log capture works"
    );
    // Events on transitions.
    let events: Api<k8s_openapi::api::events::v1::Event> =
        Api::namespaced(client.clone(), "default");
    let evs = events.list(&ListParams::default()).await.unwrap();
    let reasons: Vec<_> = evs
        .items
        .iter()
        .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some("walk-a"))
        .filter_map(|e| e.reason.clone())
        .collect();
    assert!(reasons.iter().any(|r| r == "NetBootArmed"), "{reasons:?}");

    // --- annotations ---------------------------------------------------------
    let annotate = |name: &'static str, key: &'static str, value: Option<&'static str>| {
        let machines = machines.clone();
        async move {
            machines
                .patch(
                    name,
                    &PatchParams::default(),
                    &Patch::Merge(serde_json::json!({"metadata": {"annotations": {key: value}}})),
                )
                .await
                .unwrap();
        }
    };
    let state_is = |name: &'static str, want: &'static str| {
        let machines = machines.clone();
        async move {
            eventually(
                &format!("{name} {want}"),
                Duration::from_secs(30),
                || async {
                    let m = machine_json(&machines, name).await;
                    (m["status"]["state"] == want).then_some(m)
                },
            )
            .await
        }
    };
    // park / unpark
    annotate("walk-a", "anneal.dev/operation", Some("park")).await;
    let m = state_is("walk-a", "Parked").await;
    assert!(
        m["metadata"]["annotations"]
            .get("anneal.dev/operation")
            .is_none()
    );
    annotate("walk-a", "anneal.dev/operation", Some("unpark")).await;
    // unpark refreshes the inventory (docs/lifecycle.md, "States"): a new
    // inspection, the old MachineHardware gone until the agent reports again
    state_is("walk-a", "Inspecting").await;
    eventually(
        "walk-a's inventory gone at unpark",
        Duration::from_secs(30),
        || async { hw.get_opt("walk-a").await.unwrap().is_none().then_some(()) },
    )
    .await;
    let token_unpark = eventually(
        "walk-a's new boot token",
        Duration::from_secs(30),
        || async { armed_boot_token(&client, "walk-a").await },
    )
    .await;
    let (code, reg) = agent
        .register_as(&token_unpark, Some("default/walk-a"), MAC_A)
        .await;
    assert_eq!(code, 200, "{reg}");
    let session = reg["sessionToken"].as_str().unwrap().to_string();
    let (code, _) = agent
        .call(
            Method::PUT,
            anneal_api::agent::paths::HARDWARE,
            Some(&session),
            Some("1"),
            Some(sample_hardware()),
        )
        .await;
    assert_eq!(code, 204);
    state_is("walk-a", "Available").await;
    assert!(
        hw.get_opt("walk-a").await.unwrap().is_some(),
        "the new inventory"
    );
    // paused: nothing happens, not even a consumed annotation
    let paused_lines = || {
        logs.text()
            .lines()
            .filter(|l| l.contains("machine=walk-a") && l.contains("paused: not reconciled"))
            .count()
    };
    let paused_before = paused_lines();
    annotate("walk-a", "anneal.dev/paused", Some("")).await;
    // A reconcile that began before the pause may still call the BMC until
    // it ends; the manager has seen the pause once a reconcile says so
    // (reconciles of one Machine never overlap), and from then on nothing
    // may be called.
    eventually(
        "the manager sees the pause",
        Duration::from_secs(30),
        || async { (paused_lines() > paused_before).then_some(()) },
    )
    .await;
    let calls = bmcvm.requests().len();
    annotate("walk-a", "anneal.dev/reboot", Some(r#"{"mode":"hard"}"#)).await;
    let m = machine_json(&machines, "walk-a").await;
    assert!(
        m["metadata"]["annotations"]
            .get("anneal.dev/reboot")
            .is_some()
    );
    // unpaused: the reboot is sent and consumed. No sleep to "see nothing
    // happen" while paused: every BMC call logged since the pause must come
    // after the unpause (the request log's timestamps are the BMC's clock).
    let unpaused_at = now_ms();
    annotate("walk-a", "anneal.dev/paused", None).await;
    eventually("reboot sent", Duration::from_secs(30), || async {
        bmcvm
            .requests()
            .iter()
            .any(|e| e.is_reset() && e.action.as_deref() == Some("ForceRestart"))
            .then_some(())
    })
    .await;
    let while_paused: Vec<_> = bmcvm.requests()[calls..]
        .iter()
        .filter(|e| e.ts_ms < unpaused_at)
        .cloned()
        .collect();
    assert!(
        while_paused.is_empty(),
        "bmc called while paused: {while_paused:?}"
    );
    // re-inspect: a new boot with a new token
    annotate("walk-a", "anneal.dev/re-inspect", Some("")).await;
    let m = state_is("walk-a", "Inspecting").await;
    let rearmed = eventually("re-armed", Duration::from_secs(30), || async {
        let m = machine_json(&machines, "walk-a").await;
        m["status"]["netBoot"]["tokenHash"]
            .as_str()
            .map(str::to_string)
    })
    .await;
    assert_ne!(
        rearmed,
        anneal_manager::lifecycle::status::token_hash(&token_a),
        "{m}"
    );
    // ...and the old inventory is gone until the new agent reports
    eventually(
        "walk-a's old MachineHardware deleted",
        Duration::from_secs(30),
        || async { hw.get_opt("walk-a").await.unwrap().is_none().then_some(()) },
    )
    .await;
    // detached: no BMC calls, reported on the operational axis
    annotate("walk-a", "anneal.dev/detached", Some("")).await;
    eventually("detached", Duration::from_secs(30), || async {
        let m = machine_json(&machines, "walk-a").await;
        (m["status"]["operationalStatus"] == "detached").then_some(())
    })
    .await;
    // inspect-disable: straight to Available, no token
    let mut c = machine("walk-c", "52:54:00:7f:10:03", None);
    c.metadata.annotations = Some(
        [("anneal.dev/inspect-disable".to_string(), String::new())]
            .into_iter()
            .collect(),
    );
    machines.create(&PostParams::default(), &c).await.unwrap();
    let m = state_is("walk-c", "Available").await;
    assert!(m["status"]["netBoot"].is_null(), "{m}");
    assert!(boot_token(&client, "walk-c").await.is_none());
    annotate("walk-a", "anneal.dev/detached", None).await;

    // Deletion: the finalizer powers off and lets go.
    machines
        .delete("walk-a", &Default::default())
        .await
        .unwrap();
    eventually("walk-a deleted", Duration::from_secs(30), || async {
        machines
            .get_opt("walk-a")
            .await
            .unwrap()
            .is_none()
            .then_some(())
    })
    .await;
    manager.kill();
}

/// The BMC requests since the `before`th that could change the server
/// (anything but a GET).
fn changes_since(b: &BmcVm, before: usize) -> Vec<anneal_qemu_bmc::LogEntry> {
    b.requests()
        .into_iter()
        .skip(before)
        .filter(|e| e.method != "GET")
        .collect()
}

fn client_for(b: &BmcVm) -> anneal_manager::redfish::RedfishClient {
    client(&b.address(), BMC_PASSWORD, TlsPolicy::SystemRoots)
}

/// "No surprise power changes" (docs/lifecycle.md, "Enrolling", "Delete"):
/// enrolling a running server leaves it running until its spec allows a
/// restart; deleting a
/// Machine whose server runs leaves it running (only the pending one-time
/// boot override is cleared); a claimed Machine is not touched at all until
/// its claim releases it (Warning Event `DeletingClaimedHost`), and then goes
/// the same way. Checked on the real VM behind anneal-qemu-bmc: its power
/// state and the BMC's request log.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enrolling_or_deleting_a_machine_leaves_its_running_server_on() {
    let ns = Netns::create("anlwd").unwrap();
    let (cp, bmcvm) = tokio::join!(
        ControlPlane::start(),
        BmcVm::launch(&ns, "52:54:00:7f:10:03", None)
    );
    let cp = cp.unwrap();
    let client = prepare(&cp, &[("bmc-d", BMC_PASSWORD)]).await;
    let (lc, api_cfg) = configs(0);
    let mut manager = Manager::start(cp.kubeconfig_path(), lc, api_cfg);
    let machines: Api<Machine> = Api::namespaced(client.clone(), "default");
    let rf = client_for(&bmcvm);
    let resets = || {
        bmcvm
            .requests()
            .into_iter()
            .filter(|e| e.is_reset())
            .count()
    };
    let clears = || {
        bmcvm
            .requests()
            .into_iter()
            .filter(|e| e.method == "PATCH" && e.action.as_deref() == Some("Boot=Disabled/None"))
            .count()
    };

    for (name, claimed) in [("del-a", true), ("del-b", false)] {
        let mut m = machine(name, "52:54:00:7f:10:03", Some((&bmcvm.address(), "bmc-d")));
        // del-b finds the server still running (del-a's delete left it
        // on): enrolment may restart it only when the spec says so
        m.spec.restart_running_for_inspection = true;
        machines.create(&PostParams::default(), &m).await.unwrap();
        // armed and powered on through the BMC: the server runs
        eventually(
            &format!("{name} powered on"),
            Duration::from_secs(60),
            || async {
                machine_json(&machines, name).await["status"]["state"] == "Inspecting"
                    && rf.power_state().await.ok() == Some(PowerState::On)
            },
        )
        .await;
        let resets_before = resets();
        let clears_before = clears();
        let mp = PatchParams::default();
        if claimed {
            // what the claim controller writes when it binds
            machines
                .patch(
                    name,
                    &mp,
                    &Patch::Merge(serde_json::json!({"spec": {"claimRef": {"name": "c-del"}}})),
                )
                .await
                .unwrap();
        }
        machines.delete(name, &Default::default()).await.unwrap();
        if claimed {
            let e = event(
                &client,
                "DeletingClaimedHost",
                Duration::from_secs(60),
                |e| {
                    e.reason.as_deref() == Some("DeletingClaimedHost")
                        && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name)
                },
            )
            .await;
            let note = e.note.unwrap_or_default();
            assert!(note.contains("MachineClaim c-del"), "{note}");
            assert!(note.contains("anneal.dev/force-release"), "{note}");
            assert!(
                machines.get_opt(name).await.unwrap().is_some(),
                "{name} went while claimed"
            );
            // the claim's release clears claimRef: the delete goes on
            machines
                .patch(
                    name,
                    &mp,
                    &Patch::Merge(serde_json::json!({"spec": {"claimRef": null}})),
                )
                .await
                .unwrap();
        }
        eventually(
            &format!("{name} deleted"),
            Duration::from_secs(60),
            || async { machines.get_opt(name).await.unwrap().is_none() },
        )
        .await;
        assert_eq!(
            rf.power_state().await.unwrap(),
            PowerState::On,
            "{name}: the server was powered off by the delete"
        );
        assert_eq!(
            resets(),
            resets_before,
            "{name}: a reset after the delete: {:?}",
            bmcvm.requests()
        );
        assert!(
            clears() > clears_before,
            "{name}: the one-time override was not cleared: {:?}",
            bmcvm.requests()
        );
    }

    // Enrolling a server that runs: no power change, no boot override, a
    // Warning that says what would power-cycle it; allowed, it restarts.
    let before = bmcvm.requests().len();
    machines
        .create(
            &PostParams::default(),
            &machine(
                "enr-c",
                "52:54:00:7f:10:03",
                Some((&bmcvm.address(), "bmc-d")),
            ),
        )
        .await
        .unwrap();
    let e = event(
        &client,
        "RunningAtEnrolment",
        Duration::from_secs(60),
        |e| {
            e.reason.as_deref() == Some("RunningAtEnrolment")
                && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some("enr-c")
        },
    )
    .await;
    let note = e.note.unwrap_or_default();
    assert!(note.contains("spec.restartRunningForInspection"), "{note}");
    let m = machine_json(&machines, "enr-c").await;
    assert_ne!(m["status"]["state"], "Inspecting", "{m}");
    let changes = changes_since(&bmcvm, before);
    assert!(
        changes.is_empty(),
        "enrolment touched the running server: {changes:?}"
    );
    assert_eq!(rf.power_state().await.unwrap(), PowerState::On);
    machines
        .patch(
            "enr-c",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"spec": {"restartRunningForInspection": true}})),
        )
        .await
        .unwrap();
    eventually(
        "enr-c restarted into inspection",
        Duration::from_secs(60),
        || async {
            bmcvm.requests()[before..]
                .iter()
                .any(|e| e.is_reset() && e.action.as_deref() == Some("ForceRestart"))
        },
    )
    .await;
    // (enr-c goes with its BMC cleanup skipped)
    machines
        .patch(
            "enr-c",
            &PatchParams::default(),
            &Patch::Merge(
                serde_json::json!({"metadata": {"annotations": {"anneal.dev/force-release": ""}}}),
            ),
        )
        .await
        .unwrap();
    machines.delete("enr-c", &Default::default()).await.unwrap();
    eventually("enr-c deleted", Duration::from_secs(60), || async {
        machines.get_opt("enr-c").await.unwrap().is_none()
    })
    .await;

    // Adopting the running server (spec.externallyProvisioned) for the
    // claim that names it: Provisioned, Event AdoptedProvisionedClaim, no
    // power or boot-override request at all, no DeployRun.
    let before = bmcvm.requests().len();
    let claims: Api<anneal_api::MachineClaim> = Api::namespaced(client.clone(), "default");
    let claim: anneal_api::MachineClaim = serde_json::from_value(serde_json::json!({
        "apiVersion": "anneal.dev/v1alpha1", "kind": "MachineClaim",
        "metadata": {"name": "c-adopt", "namespace": "default"},
        "spec": {"machineName": "adopt-d", "imageRef": {"name": "debian-12"}}
    }))
    .unwrap();
    claims.create(&PostParams::default(), &claim).await.unwrap();
    let mut m = machine(
        "adopt-d",
        "52:54:00:7f:10:03",
        Some((&bmcvm.address(), "bmc-d")),
    );
    m.spec.externally_provisioned = true;
    machines.create(&PostParams::default(), &m).await.unwrap();
    eventually(
        "adopt-d waiting for its claim",
        Duration::from_secs(60),
        || async {
            let m = machine_json(&machines, "adopt-d").await;
            m["status"]["conditions"]
                .as_array()
                .is_some_and(|c| c.iter().any(|c| c["reason"] == "WaitingForClaim"))
        },
    )
    .await;
    // what the claim controller writes when it binds (both sides)
    machines
        .patch(
            "adopt-d",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"spec": {"claimRef": {"name": "c-adopt"}}})),
        )
        .await
        .unwrap();
    claims
        .patch_status(
            "c-adopt",
            &PatchParams::default(),
            &Patch::Merge(
                serde_json::json!({"status": {"phase": "Bound", "machineName": "adopt-d"}}),
            ),
        )
        .await
        .unwrap();
    let m = eventually("adopt-d Provisioned", Duration::from_secs(60), || async {
        let m = machine_json(&machines, "adopt-d").await;
        (m["status"]["state"] == "Provisioned").then_some(m)
    })
    .await;
    assert_eq!(m["status"]["adopted"]["claim"], "c-adopt", "{m}");
    event(
        &client,
        "AdoptedProvisionedClaim",
        Duration::from_secs(60),
        |e| {
            e.reason.as_deref() == Some("AdoptedProvisionedClaim")
                && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some("adopt-d")
        },
    )
    .await;
    // the next health pass (it queries the BMC) leaves it Provisioned
    let seen = bmcvm.requests().len();
    eventually(
        "adopt-d's next health pass",
        Duration::from_secs(60),
        || async { bmcvm.requests().len() > seen },
    )
    .await;
    let m = machine_json(&machines, "adopt-d").await;
    assert_eq!(m["status"]["state"], "Provisioned", "{m}");
    let changes = changes_since(&bmcvm, before);
    assert!(
        changes.is_empty(),
        "the adoption touched the server: {changes:?}"
    );
    assert_eq!(rf.power_state().await.unwrap(), PowerState::On);
    let runs = Api::<anneal_api::DeployRun>::namespaced(client.clone(), "default")
        .list(&ListParams::default())
        .await
        .unwrap();
    assert!(runs.items.is_empty(), "a deploy run for an adopted server");
    manager.kill();
}
