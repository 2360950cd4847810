//! anneal installed with `kubectl apply -k` on the test tier's real node
//! (docs/kubernetes.md, "On a real node (the test tier)"). FROM-scratch images
//! built by `anneal-oci` are imported into the node's containerd: the
//! workloads' (the static musl agent, as `deploy/images` builds it) and the
//! manager's (the test build's manager with its shared libraries,
//! `anneal_tests::node::manager_image`: no second compile for musl in the
//! suite); the appliance overlay is applied through a test overlay that only
//! adapts it to this machine (the API server's loopback address as the
//! in-cluster one, since the test node runs no kube-proxy; the manager's ports
//! on the node's address instead of all interfaces; the content store under
//! the node's directory). The manager pod becomes Ready (its readiness probe
//! answered by the manager itself), holds the Lease
//! `anneal-system/anneal-manager` under its own name, and writes the agent
//! API's CA Secret with its own ServiceAccount. The node leaves nothing on the
//! host.
//!
//! Then a managed bootd: a Site and a lease-mode Subnet with
//! `spec.bootd.mode: Managed` (the host's network) in `anneal-system`. The
//! manager runs `bootd-<subnet>` as a Deployment from bootd's image (the
//! test build's bootd with its shared libraries), as `anneal-bootd`, on the
//! interface the test gave `serverIP`: the host end of a veth pair whose
//! other end is a port of the bridge, in a network namespace of the test,
//! that the VM's tap is on (nothing leaves the host). bootd makes the
//! reservation table live (`status.dhcp.appliedRevision`), the Subnet says
//! `BootdAvailable=True`, and bootd serves the first stage, kernel and
//! initramfs from the content store's `boot/`. A QEMU VM (OVMF, under TCG)
//! enrolled as a Machine is powered on by the manager pod through its BMC,
//! network-boots through the bootd pod (PXE, iPXE, the Debian kernel and the
//! agent's initramfs), registers with the manager pod's agent API and is
//! inspected: `Available`.
//!
//! Then the deploy, every workload a pod: the test OS is imported through
//! an ImageImport (the ingest Job's pod fetches it from a file server on
//! the node's address and writes the content store), the machine is
//! claimed, and while its agent writes the manager pod is killed
//! (force-deleted). The replacement pod leads, adopts bootd untouched, and
//! the run in progress completes (one DeployRun, Succeeded): the agent
//! fetched the contents from the seeder pod of (Image, Site), found through
//! the Site's tracker pod (or, if the swarm stalls, from the content server
//! pod), the Machine is Provisioned and the VM boots the deployed OS
//! (its marker and the machine's name on the console). The seeder stays
//! for its grace period; deleting the Image removes it. Deleting the Subnet
//! then removes bootd's Deployment through its owner reference (the node's
//! garbage collector).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::{Duration, Instant};

use anneal_testinfra::{ControlPlane, NODE_DIR, Node};
use anneal_tests::node_lab::{
    Artifacts, Import, MACHINE, NS, NodeVm, SERIAL, SERVER_IP, Segment, apply, bootd_logs, claim,
    prepare_store, site_and_subnet, the_run_succeeded, wait_store_bound, wait_writing,
};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Pod, Secret};
use kube::ResourceExt;
use kube::api::{Api, ListParams};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_appliance_install_runs_the_manager_as_a_pod_holding_the_lease() {
    let work = tempfile::tempdir().unwrap();
    let art = Artifacts::build_in(work.path()).await;
    let (images, os) = (&art.images, &art.os);
    // the provisioning segment, before the manager binds its agent API there
    let segment = Segment::create();
    let cp = ControlPlane::start().await.unwrap();
    let node = Node::start(&cp, images).await.unwrap();
    let api_port = cp.url().rsplit(':').next().unwrap().to_string();
    let metrics = anneal_testinfra::free_port().unwrap();
    let agent_api = anneal_testinfra::free_port().unwrap();
    let node_ip = anneal_testinfra::NODE_IP;

    // the test overlay: the appliance, adapted to this machine only
    anneal_tests::node::apply_overlay(
        &cp,
        &work.path().join("overlay"),
        "appliance",
        &format!(
            r#"  - target:
      kind: Deployment
      name: anneal-manager
    patch: |-
      - op: replace
        path: /spec/template/spec/containers/0/args
        value:
          - run
          - --lease-namespace=anneal-system
          - --metrics-addr={node_ip}:{metrics}
          - --agent-api-listen={SERVER_IP}:{agent_api}
          - --agent-api-name={SERVER_IP}
          - --allow-insecure-bmc
          - --workload-executor=kubernetes
          - --workload-image=docker.io/anneal/agent:dev
          - --workload-namespace=anneal-system
          - --content-claim=anneal-content
          - --workload-host-network
          - --content-listen={SERVER_IP}:8088
          - --content-url=http://{SERVER_IP}:8088
          - --fast-track-window=10m
      - op: replace
        path: /spec/template/spec/containers/0/ports
        value:
          - name: agent-api
            containerPort: {agent_api}
          - name: metrics
            containerPort: {metrics}
      - op: add
        path: /spec/template/spec/containers/0/env/-
        value: {{name: KUBERNETES_SERVICE_HOST, value: "127.0.0.1"}}
      - op: add
        path: /spec/template/spec/containers/0/env/-
        value: {{name: KUBERNETES_SERVICE_PORT, value: "{api_port}"}}
      - op: replace
        path: /spec/template/spec/containers/0/imagePullPolicy
        value: Never
  - target:
      kind: PersistentVolume
      name: anneal-content
    patch: |-
      - op: replace
        path: /spec/hostPath/path
        value: {NODE_DIR}/content
"#
        ),
    );

    let client = cp.client();
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), "anneal-system");
    let pods: Api<Pod> = Api::namespaced(client.clone(), "anneal-system");
    let deadline = Instant::now() + Duration::from_secs(180);
    let pod = loop {
        let d = deployments.get("anneal-manager").await.unwrap();
        let ready = d.status.and_then(|s| s.ready_replicas).unwrap_or(0);
        let list = pods
            .list(&ListParams::default().labels("app.kubernetes.io/name=anneal-manager"))
            .await
            .unwrap();
        if ready == 1 && list.items.len() == 1 {
            break list.items[0].clone();
        }
        if Instant::now() > deadline {
            panic!(
                "the manager pod is not Ready after 180 s:\n{}",
                anneal_tests::node::manager_logs(&pods).await
            );
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    let pod_name = pod.metadata.name.unwrap();
    println!("manager pod {pod_name} Ready");

    // it leads, under its own name
    let leases: Api<Lease> = Api::namespaced(client.clone(), "anneal-system");
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let holder = leases
            .get_opt("anneal-manager")
            .await
            .unwrap()
            .and_then(|l| l.spec)
            .and_then(|s| s.holder_identity);
        if holder.as_deref() == Some(pod_name.as_str()) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the Lease is held by {holder:?}, not the pod {pod_name}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    // and acts with its own ServiceAccount: the agent API's CA
    let secrets: Api<Secret> = Api::namespaced(client.clone(), "anneal-system");
    let deadline = Instant::now() + Duration::from_secs(60);
    while secrets
        .get_opt("anneal-agent-api-ca")
        .await
        .unwrap()
        .is_none()
    {
        assert!(
            Instant::now() < deadline,
            "no agent API CA Secret after 60 s"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }

    managed_bootd(
        &client,
        &pods,
        &segment,
        (&art.vmlinuz, &art.initrd),
        os,
        work.path(),
    )
    .await;
    drop(segment);

    let left = node.stop();
    assert!(left.is_empty(), "the node left on the host: {left:?}");
}

async fn managed_bootd(
    client: &kube::Client,
    pods: &Api<Pod>,
    segment: &Segment,
    (vmlinuz, initrd): (&std::path::Path, &std::path::Path),
    os: &anneal_tests::testos::TestOs,
    work: &std::path::Path,
) {
    use anneal_api::Subnet;
    use anneal_api::conditions::types;
    prepare_store(vmlinuz, initrd);
    let first_stage = std::fs::read("/usr/lib/ipxe/snponly.efi").unwrap();
    // the content store's claim bound to its hostPath volume (the node's
    // binder does it in its own time; until then a pod mounting the store
    // is not scheduled, which the Subnet would report)
    wait_store_bound(client).await;
    site_and_subnet(client, true).await;
    // an operator's mistake: a serverIP no interface of the node holds
    apply(client, serde_json::json!({
        "apiVersion": "anneal.dev/v1alpha1", "kind": "Subnet",
        "metadata": {"name": "rack2", "namespace": "anneal-system"},
        "spec": {"siteRef": {"name": "rack1"}, "cidr": "10.90.1.0/24",
                 "bootd": {"serverIP": "10.90.1.1", "mode": "Managed"},
                 "dhcp": {"mode": "lease", "gateway": "", "leaseRange": {"start": "10.90.1.100", "end": "10.90.1.150"}}}}))
    .await;

    let applied = Instant::now();
    let mut seen = std::collections::BTreeSet::new();
    let subnets: Api<Subnet> = Api::namespaced(client.clone(), "anneal-system");
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), "anneal-system");
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let s = subnets.get("rack1").await.unwrap();
        let st = s.status.clone().unwrap_or_default();
        let available = st
            .conditions
            .iter()
            .find(|c| c.type_ == types::BOOTD_AVAILABLE)
            .map(|c| format!("{} {}: {}", c.status, c.reason, c.message));
        let dhcp = st.dhcp.clone().unwrap_or_default();
        let live = dhcp.revision.is_some() && dhcp.applied_revision == dhcp.revision;
        for (what, now) in [
            ("revision", dhcp.revision.is_some()),
            ("applied", live),
            (
                "available",
                available.as_deref().is_some_and(|a| a.starts_with("True")),
            ),
        ] {
            if now && seen.insert(what) {
                println!("  {what} at {:.1} s", applied.elapsed().as_secs_f64());
            }
        }
        if live && available.as_deref().is_some_and(|a| a.starts_with("True")) {
            println!(
                "managed bootd live {:.1} s after the Subnet: {}",
                applied.elapsed().as_secs_f64(),
                available.unwrap_or_default()
            );
            break;
        }
        let last = format!("BootdAvailable {available:?}, dhcp {dhcp:?}");
        if Instant::now() > deadline {
            let logs = bootd_logs(pods).await;
            panic!(
                "the managed bootd is not live after 120 s: {last}\n{logs}\n{}",
                anneal_tests::node::manager_logs(pods).await
            );
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    // the mistake is told on the Subnet, from the bootd pod's own error
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let s = subnets.get("rack2").await.unwrap();
        let available = s
            .status
            .unwrap_or_default()
            .conditions
            .into_iter()
            .find(|c| c.type_ == types::BOOTD_AVAILABLE);
        if let Some(c) = &available
            && c.message
                .contains("no interface of this host has the address 10.90.1.1")
        {
            assert_eq!(
                (c.status.as_str(), c.reason.as_str()),
                ("False", "BootdStarting")
            );
            assert!(
                c.message.contains("Subnet anneal-system/rack2"),
                "{}",
                c.message
            );
            println!(
                "rack2 (serverIP on no interface): BootdAvailable=False: {}",
                c.message
            );
            break;
        }
        assert!(
            Instant::now() < deadline,
            "rack2's BootdAvailable does not name the missing address after 120 s: {available:?}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    subnets.delete("rack2", &Default::default()).await.unwrap();
    let d = deployments.get("bootd-rack1").await.unwrap();
    assert_eq!(
        d.owner_references().first().map(|o| o.kind.as_str()),
        Some("Subnet")
    );
    // it serves the content store's first stage on serverIP
    let answer = http_get(&format!("{SERVER_IP}:8080"), "/files/snponly.efi").await;
    let text = String::from_utf8_lossy(&answer);
    let head = text.split("\r\n\r\n").next().unwrap_or_default();
    assert!(
        text.starts_with("HTTP/1.0 200") || text.starts_with("HTTP/1.1 200"),
        "{head}"
    );
    assert!(answer.ends_with(&first_stage), "{head}");

    // the content server, a pod on the node's network, serves on the
    // provisioning interface's address too
    // (its Deployment is made when the manager starts leading: wait for it)
    let deadline = Instant::now() + Duration::from_secs(120);
    let answer = loop {
        match try_http_get(
            &format!("{SERVER_IP}:8088"),
            "/content/anneal-system/none/index",
        )
        .await
        {
            Ok(a) => break a,
            Err(e) => assert!(
                Instant::now() < deadline,
                "no content server on {SERVER_IP}:8088 after 120 s: {e}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    let text = String::from_utf8_lossy(&answer);
    assert!(
        text.starts_with("HTTP/1.1 404") && text.contains("no such content"),
        "{text}"
    );
    println!(
        "content server answering on {SERVER_IP}:8088 ({:.1} s after the bootd)",
        Instant::now()
            .duration_since(deadline - Duration::from_secs(120))
            .as_secs_f64()
    );

    deploy_vm(client, pods, segment, os, work).await;

    // the Subnet deleted: the garbage collector removes its bootd
    subnets.delete("rack1", &Default::default()).await.unwrap();
    let deleted = Instant::now();
    let deadline = deleted + Duration::from_secs(90);
    loop {
        let d = deployments.get_opt("bootd-rack1").await.unwrap();
        let left = pods
            .list(&ListParams::default().labels("app.kubernetes.io/component=bootd"))
            .await
            .unwrap()
            .items
            .len();
        if d.is_none() && left == 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "bootd-rack1 still there 90 s after its Subnet was deleted ({left} pods)"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    println!(
        "Subnet deleted: its bootd Deployment and pod gone {:.1} s later",
        deleted.elapsed().as_secs_f64()
    );
}

/// A plain HTTP/1.0 GET: the whole answer, head and body.
async fn http_get(addr: &str, path: &str) -> Vec<u8> {
    try_http_get(addr, path).await.unwrap()
}

/// [`http_get`], or why it failed (nothing listening yet, …).
async fn try_http_get(addr: &str, path: &str) -> std::io::Result<Vec<u8>> {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut c = tokio::net::TcpStream::connect(addr).await?;
    c.write_all(format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())
        .await?;
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(30), c.read_to_end(&mut out)).await??;
    Ok(out)
}

/// A VM enrolled as Machine `node-vm` in `anneal-system`: the manager pod
/// powers it on through its BMC (PXE once), it boots through the bootd pod
/// and the agent registers with the manager pod: `Available`, its
/// MachineHardware written. Meanwhile the test OS is imported through an
/// ImageImport: the ingest Job's pod fetches it from a file server on the
/// node's address. The machine is then claimed (fast-track: the agent that
/// inspected it deploys) and, while its agent writes, the manager pod is
/// killed ([`kill_the_leader`]); the replacement leads and the run in
/// progress completes: the agent streams the contents from the seeder pod
/// of (Image, Site) (announced to the Site's tracker pod; the content
/// server pod if the swarm stalls), the Machine is Provisioned and the VM
/// boots the deployed OS. Deleting the Image removes its seeder; the
/// Machine is deleted at the end (the manager powers the VM off and lets
/// it go).
async fn deploy_vm(
    client: &kube::Client,
    pods: &Api<Pod>,
    segment: &Segment,
    os: &anneal_tests::testos::TestOs,
    work: &std::path::Path,
) {
    use anneal_api::{Image, MachineHardware};
    let mut import = Import::start(client, os, work).await;
    let localhost = std::net::Ipv4Addr::LOCALHOST.into();
    let mut vm = NodeVm::enrol(client, segment, localhost, work).await;
    vm.wait_state(client, pods, "Available", Duration::from_secs(300))
        .await;
    let hw = Api::<MachineHardware>::namespaced(client.clone(), NS)
        .get(MACHINE)
        .await
        .unwrap();
    let summary = anneal_tests::e2e::summary(&hw);
    println!("inspected through the pods: {summary}");
    assert!(summary.contains(SERIAL), "{summary}");

    // the import, by the ingest Job's pod
    match import.wait(client).await {
        Ok(t) => println!(
            "imported by the ingest Job's pod, Image Ready {:.1} s after the ImageImport",
            t.as_secs_f64()
        ),
        Err(why) => vm.fail(pods, &why).await,
    }

    // claimed; the manager killed while the agent writes
    let claimed = Instant::now();
    claim(client).await;
    wait_writing(client, &vm, pods, Duration::from_secs(300)).await;
    println!(
        "run writing {:.1} s after the claim: killing the leader",
        claimed.elapsed().as_secs_f64()
    );
    kill_the_leader(client, pods).await;
    vm.wait_state(client, pods, "Provisioned", Duration::from_secs(600))
        .await;
    println!(
        "claim → Provisioned in {:.1} s",
        claimed.elapsed().as_secs_f64()
    );
    let run = the_run_succeeded(client).await;
    let t = run.status.and_then(|s| s.transfer).unwrap_or_default();
    assert!(
        t.seeder_bytes + t.http_bytes >= 200 << 20,
        "the contents came from the seeder and content server pods: {t:?}"
    );
    println!(
        "run {}: {} peer(s), {} MiB from the seeder, {} MiB over HTTP{}",
        run.metadata.name.unwrap_or_default(),
        t.peers,
        t.seeder_bytes >> 20,
        t.http_bytes >> 20,
        t.fallback_reason
            .as_deref()
            .map(|r| format!(" (fallback: {r})"))
            .unwrap_or_default()
    );
    vm.wait_deployed_os(pods, os).await;
    println!(
        "claim → the deployed OS's marker on the console in {:.1} s",
        claimed.elapsed().as_secs_f64()
    );

    // the seeder of (testos, rack1) stays for its grace period after the
    // run; deleting the Image removes it
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), NS);
    let seeders = || async {
        deployments
            .list(&ListParams::default().labels("app.kubernetes.io/component=seeder"))
            .await
            .unwrap()
            .items
    };
    let left = seeders().await;
    assert_eq!(
        left.len(),
        1,
        "one seeder in its grace period after the run: {:?}",
        left.iter().map(ResourceExt::name_any).collect::<Vec<_>>()
    );
    assert_eq!(
        left[0]
            .owner_references()
            .first()
            .map(|o| (o.kind.as_str(), o.name.as_str())),
        Some(("Image", "testos"))
    );
    Api::<Image>::namespaced(client.clone(), NS)
        .delete("testos", &Default::default())
        .await
        .unwrap();
    let deleted = Instant::now();
    while !seeders().await.is_empty() {
        assert!(
            deleted.elapsed() < Duration::from_secs(90),
            "the seeder of Image testos still there 90 s after the Image was deleted"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    println!(
        "Image deleted: its seeder gone {:.1} s later",
        deleted.elapsed().as_secs_f64()
    );
    vm.delete(client).await;
}

/// The leader pod killed (force-deleted: no graceful hand-over, its Lease
/// must expire): the replacement takes the Lease, adopts the running bootd
/// on its first pass and leaves it as it is: the same pod, never
/// restarted, the Deployment's template unchanged (DHCP never stops for a
/// manager's restart).
async fn kill_the_leader(client: &kube::Client, pods: &Api<Pod>) {
    use anneal_api::Subnet;
    use anneal_api::conditions::types;
    let bootd_pods = || async {
        pods.list(&ListParams::default().labels("app.kubernetes.io/component=bootd"))
            .await
            .unwrap()
            .items
            .into_iter()
            .map(|p| {
                let restarts = p
                    .status
                    .as_ref()
                    .and_then(|s| s.container_statuses.as_ref())
                    .map(|c| c.iter().map(|c| c.restart_count).sum::<i32>())
                    .unwrap_or_default();
                (p.metadata.uid.unwrap_or_default(), restarts)
            })
            .collect::<Vec<_>>()
    };
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), "anneal-system");
    let before = bootd_pods().await;
    let generation = deployments
        .get("bootd-rack1")
        .await
        .unwrap()
        .metadata
        .generation;
    let managers = pods
        .list(&ListParams::default().labels("app.kubernetes.io/name=anneal-manager"))
        .await
        .unwrap()
        .items;
    assert_eq!(managers.len(), 1);
    let old = managers[0].metadata.name.clone().unwrap();
    let killed = Instant::now();
    pods.delete(&old, &kube::api::DeleteParams::default().grace_period(0))
        .await
        .unwrap();
    // the new manager pod leads and has made its first bootd pass
    let leases: Api<Lease> = Api::namespaced(client.clone(), "anneal-system");
    let deadline = Instant::now() + Duration::from_secs(180);
    let new = loop {
        let holder = leases
            .get_opt("anneal-manager")
            .await
            .unwrap()
            .and_then(|l| l.spec)
            .and_then(|s| s.holder_identity)
            .filter(|h| *h != old);
        if let Some(h) = holder {
            let log = pods.logs(&h, &Default::default()).await.unwrap_or_default();
            if log.contains("managed bootd applied") {
                break h;
            }
        }
        if Instant::now() > deadline {
            panic!(
                "no new manager pod leading with a bootd pass 180 s after {old} was killed\n{}",
                anneal_tests::node::manager_logs(pods).await
            );
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    println!(
        "manager pod {old} killed; {new} leads, bootd adopted {:.1} s later",
        killed.elapsed().as_secs_f64()
    );
    let d = deployments.get("bootd-rack1").await.unwrap();
    assert_eq!(
        d.metadata.generation, generation,
        "the new manager changed bootd's Deployment"
    );
    assert_eq!(
        bootd_pods().await,
        before,
        "bootd's pod was replaced or restarted across the manager's restart"
    );
    let s = Api::<Subnet>::namespaced(client.clone(), "anneal-system")
        .get("rack1")
        .await
        .unwrap();
    let c = s
        .status
        .unwrap_or_default()
        .conditions
        .into_iter()
        .find(|c| c.type_ == types::BOOTD_AVAILABLE)
        .unwrap();
    assert_eq!(c.status, "True", "{c:?}");
}
