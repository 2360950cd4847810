//! Managed bootd (docs/api.md "Workloads the manager owns"): one bootd per
//! Subnet whose boot half is `Managed`, run through the workload executor
//! and owned by the Subnet.
//!
//! - `kubernetes`: a Deployment `bootd-<subnet>` in the workload namespace
//!   (one replica, `Recreate`: two bootds never answer one segment), on the
//!   host's network or attached through `spec.bootd.networkRef` (Multus),
//!   as root with only the capabilities DHCP needs, with the `anneal-bootd`
//!   ServiceAccount. When the Subnet lives in the workload namespace the
//!   Deployment carries an owner reference and the garbage collector
//!   removes it with the Subnet; otherwise (owner references cannot cross
//!   namespaces) this controller removes it, including after a restart:
//!   every pass deletes the bootd Deployments no managed Subnet wants.
//! - `process`: a child `bootd` of the manager, stopped with its Subnet.
//!
//! bootd's configuration (`--config`, a file volume): the agent API's URL
//! and CA digest, from which it writes the kernel command line; the Subnet
//! itself it watches (`--subnet`). Its boot files come from the content
//! store's `boot/` directory (`--boot-dir`: `vmlinuz`, `initrd.img`,
//! `files/`), its lease file lives in the store's `.bootd/`. It binds DHCP
//! to the interface holding `serverIP` (`--interface auto`) and TFTP and
//! HTTP to `serverIP` only, so bootds of several Subnets share a host.
//!
//! Subnet `BootdAvailable` tells whether it runs (reasons `BootdRunning`,
//! `BootdStarting`, `BootdNotConfigured`).

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use anneal_api::conditions::{reasons, types};
use anneal_api::{BootdMode, Subnet};
use kube::api::{Api, ListParams, Patch};
use kube::{Resource as _, ResourceExt};
use serde_json::json;

use crate::controller::Scope;
use crate::workload::{
    Access, Executor, Kind, PassError, Phase, Program, Volume, VolumeSource, WorkloadSpec,
    workload_name,
};

/// The field manager of the Subnet conditions this controller writes.
pub const FIELD_MANAGER: &str = "anneal-bootd-controller";
/// The `app.kubernetes.io/component` of managed bootd workloads.
pub const COMPONENT: &str = "bootd";
/// Capabilities a managed bootd keeps: ports 67, 69 and 4011, broadcast
/// and the ARP entry for a unicast answer (RFC 2131 4.1).
pub const CAPABILITIES: &[&str] = &["NET_BIND_SERVICE", "NET_RAW", "NET_ADMIN"];

/// What a managed bootd needs from the manager's configuration.
#[derive(Clone, Debug, Default)]
pub struct BootdConfig {
    /// The agent API's URL as the booted machines reach it (`anneal.api`);
    /// `None`: no managed bootd can run (`BootdNotConfigured`).
    pub api_url: Option<String>,
    /// Namespace of the Secret `anneal-agent-api-ca` (the CA whose digest
    /// goes on the kernel command line).
    pub ca_namespace: String,
    /// bootd's HTTP port.
    pub http_port: u16,
    /// The ServiceAccount of a managed bootd pod.
    pub service_account: String,
    /// Environment given to bootd (the API server's in-cluster address when
    /// the manager was given one explicitly).
    pub env: BTreeMap<String, String>,
    /// Namespaces besides the manager's (`ca_namespace`) whose Subnets may
    /// get a managed bootd (`--managed-bootd-namespace`): a DHCP server on
    /// the host's network is the administrator's to grant.
    pub allowed_namespaces: Vec<String>,
}

/// Whether a managed bootd may run for `subnet`: a Subnet of the manager's
/// namespace, or of a namespace the administrator listed with
/// `--managed-bootd-namespace` (docs/api.md "Subnet"). Otherwise why not
/// (the `BootdNotAllowed` message).
pub fn bootd_allowed(subnet: &Subnet, cfg: &BootdConfig) -> Result<(), String> {
    let ns = subnet.namespace().unwrap_or_default();
    if ns == cfg.ca_namespace || cfg.allowed_namespaces.contains(&ns) {
        return Ok(());
    }
    Err(format!(
        "Subnet {ns}/{name} asks for a managed bootd (a DHCP server on the host's network), which          the manager runs only for Subnets of its namespace {home} or of a namespace the          administrator allows (manager run --managed-bootd-namespace {ns}); set          spec.bootd.mode: External and run bootd yourself, or ask the administrator",
        name = subnet.name_any(),
        home = cfg.ca_namespace,
    ))
}

impl BootdConfig {
    /// The URL agents reach the agent API at: `explicit`, else
    /// `https://NAME:PORT` with the first certificate name that is not a
    /// loopback one and the agent API's port.
    pub fn api_url_from(explicit: Option<&str>, names: &[String], port: u16) -> Option<String> {
        if let Some(u) = explicit {
            return Some(u.to_string());
        }
        let name = names
            .iter()
            .find(|n| !crate::preflight::is_loopback_name(n))?;
        Some(if name.contains(':') {
            format!("https://[{name}]:{port}")
        } else {
            format!("https://{name}:{port}")
        })
    }
}

fn key(ns: &str, name: &str) -> String {
    format!("{ns}/{name}")
}

/// Whether the manager runs a bootd for `subnet`.
pub fn is_managed(subnet: &Subnet) -> bool {
    subnet.spec.dhcp.is_some()
        && subnet
            .spec
            .bootd
            .as_ref()
            .is_some_and(|b| b.mode == BootdMode::Managed)
}

/// bootd's DHCPv6 and router advertisement flags from `spec.ipv6` (none
/// without it). `--dhcp6-range` (addresses for machines without an IPv6
/// reservation) only with `spec.answerAll` in lease mode, as DHCPv4 uses
/// its range: an enrolled Machine gets the address the manager reserved.
pub fn ipv6_args(subnet: &Subnet) -> Vec<String> {
    let Some(v6) = subnet.spec.ipv6.as_ref() else {
        return Vec::new();
    };
    let mut args = vec![
        "--dhcp6-server-ip".into(),
        v6.server_address.clone(),
        "--dhcp6-prefix".into(),
        v6.prefix.clone(),
    ];
    let lease = subnet
        .spec
        .dhcp
        .as_ref()
        .is_some_and(|d| d.mode == anneal_api::DhcpMode::Lease);
    if let Some(r) = v6.lease_range.as_ref()
        && lease
        && subnet.spec.answer_all
    {
        args.push("--dhcp6-range".into());
        args.push(format!("{}-{}", r.start, r.end));
    }
    for d in &v6.dns_servers {
        args.push("--dhcp6-dns".into());
        args.push(d.clone());
    }
    if v6.router_advertisements {
        args.push("--router-advertisements".into());
    }
    args
}

/// The bootd workload of a managed Subnet, or why it cannot run (the
/// `BootdNotConfigured` message).
pub fn bootd_spec(
    subnet: &Subnet,
    cfg: &BootdConfig,
    ca_sha256: Option<&str>,
) -> Result<WorkloadSpec, String> {
    let ns = subnet.namespace().unwrap_or_default();
    let name = subnet.name_any();
    let Some(b) = subnet.spec.bootd.as_ref() else {
        return Err(format!("Subnet {ns}/{name} has no boot half"));
    };
    let Some(url) = &cfg.api_url else {
        return Err(
            "the manager has no agent API URL for the boot table: run it with --bootd-api-url \
             https://ADDRESS:PORT (or an --agent-api-name other than localhost)"
                .into(),
        );
    };
    let Some(ca) = ca_sha256 else {
        return Err(format!(
            "the agent API's CA (Secret {}/{}) does not exist yet: the manager writes it when the \
             agent API starts",
            cfg.ca_namespace,
            crate::agentapi::ca::CA_SECRET
        ));
    };
    let mode = match subnet.spec.dhcp.as_ref().map(|d| d.mode) {
        Some(anneal_api::DhcpMode::Lease) => "lease",
        _ => "proxy",
    };
    // The configuration bootd overlays with the Subnet it watches: the
    // Subnet's own fields are repeated only because the file format needs
    // them.
    let config = format!(
        "subnet: {ns}/{name}\nserverIP: {ip}\ncidr: {cidr}\ndhcp: {{mode: {mode}}}\n\
         api: {{url: {url:?}, caSha256: {ca:?}}}\n",
        ip = b.server_ip,
        cidr = subnet.spec.cidr,
    );
    let mut env = cfg.env.clone();
    env.insert(
        "ANNEAL_BOOTD_CONFIG".into(),
        anneal_api::digest(&config).to_string(),
    );
    let network_attachment = b
        .network_ref
        .as_ref()
        .map(|r| format!("{}/{}", r.namespace_or(&ns), r.name));
    let mut args = vec![
        "--config".into(),
        "${volume:config}/bootd.yaml".into(),
        "--subnet".into(),
        key(&ns, &name),
        "--interface".into(),
        "auto".into(),
        "--listen-ip".into(),
        b.server_ip.clone(),
        "--http-port".into(),
        cfg.http_port.to_string(),
        "--boot-dir".into(),
        "${volume:store}/boot".into(),
        "--lease-file".into(),
        format!("${{volume:store}}/.bootd/{ns}.{name}.leases"),
    ];
    args.extend(ipv6_args(subnet));
    Ok(WorkloadSpec {
        namespace: ns.clone(),
        name: workload_name("bootd", &ns, &name),
        kind: Kind::Server,
        program: Program::Bootd,
        args,
        volumes: vec![
            Volume {
                name: "config".into(),
                mount_path: "/config".into(),
                source: VolumeSource::Files([("bootd.yaml".into(), config.into_bytes())].into()),
            },
            Volume {
                name: "store".into(),
                mount_path: "/store".into(),
                source: VolumeSource::ContentStore,
            },
        ],
        env,
        labels: [
            ("app.kubernetes.io/component".into(), COMPONENT.into()),
            ("anneal.dev/subnet".into(), name.clone()),
        ]
        .into(),
        owner: subnet.controller_owner_ref(&()),
        deadline_secs: None,
        access: Access {
            host_network: network_attachment.is_none(),
            network_attachment,
            capabilities: CAPABILITIES.iter().map(|c| c.to_string()).collect(),
            service_account: Some(cfg.service_account.clone()),
        },
    })
}

/// The `BootdAvailable` condition from what the executor observed.
fn condition(spec: &WorkloadSpec, phase: Phase, detail: &str) -> (bool, &'static str, String) {
    match phase {
        Phase::Running if detail.is_empty() => (
            true,
            reasons::BOOTD_RUNNING,
            format!("bootd {} runs", spec.name),
        ),
        Phase::Running => (false, reasons::BOOTD_STARTING, detail.to_string()),
        Phase::Absent => (
            false,
            reasons::BOOTD_STARTING,
            format!("bootd {} is being started", spec.name),
        ),
        Phase::Failed | Phase::Succeeded => (
            false,
            reasons::BOOTD_STARTING,
            format!("bootd {} ended and is restarted: {detail}", spec.name),
        ),
    }
}

/// Keeps one bootd per managed Subnet, and the Subnets' `BootdAvailable`,
/// until `scope` is cancelled.
pub async fn controller(scope: Scope, executor: Executor, cfg: BootdConfig) {
    let mut started: BTreeMap<String, WorkloadSpec> = BTreeMap::new();
    loop {
        if let Err(e) = pass(&scope, &executor, &cfg, &mut started).await {
            tracing::warn!(error = %anneal_api::error_chain(&e), "bootd pass failed; retrying");
        }
        tokio::select! {
            () = scope.cancelled() => break,
            () = tokio::time::sleep(Duration::from_secs(2)) => {}
        }
    }
    if matches!(executor, Executor::Process(_)) {
        for spec in started.values() {
            if let Err(e) = executor.remove(spec).await {
                tracing::warn!(workload = %spec.name, error = %e, "stopping a managed bootd failed");
            }
        }
    }
}

async fn ca_digest(scope: &Scope, cfg: &BootdConfig) -> Result<Option<String>, kube::Error> {
    use sha2::Digest as _;
    let secret = Api::<k8s_openapi::api::core::v1::Secret>::namespaced(
        scope.client.clone(),
        &cfg.ca_namespace,
    )
    .get_opt(crate::agentapi::ca::CA_SECRET)
    .await?;
    let der = secret
        .and_then(|s| s.data)
        .and_then(|d| d.get(crate::agentapi::ca::CA_CERT_KEY).cloned())
        .and_then(|pem| crate::agentapi::ca::first_cert(&pem.0));
    Ok(der.map(|d| hex::encode(sha2::Sha256::digest(d.as_ref()))))
}

async fn pass(
    scope: &Scope,
    executor: &Executor,
    cfg: &BootdConfig,
    started: &mut BTreeMap<String, WorkloadSpec>,
) -> Result<(), PassError> {
    let subnets = scope
        .api::<Subnet>()
        .list(&ListParams::default())
        .await?
        .items;
    let managed: Vec<&Subnet> = subnets.iter().filter(|s| is_managed(s)).collect();
    let ca = if managed.is_empty() {
        None
    } else {
        ca_digest(scope, cfg).await?
    };
    let mut want: BTreeMap<String, WorkloadSpec> = BTreeMap::new();
    for s in &managed {
        if let Err(message) = bootd_allowed(s, cfg) {
            set_condition(scope, s, false, reasons::BOOTD_NOT_ALLOWED, message).await?;
            continue;
        }
        let spec = match bootd_spec(s, cfg, ca.as_deref()) {
            Ok(spec) => spec,
            Err(message) => {
                set_condition(scope, s, false, reasons::BOOTD_NOT_CONFIGURED, message).await?;
                continue;
            }
        };
        let k = key(&spec.namespace, &spec.name);
        let changed = started.get(&k).is_some_and(|old| old != &spec);
        if changed && matches!(executor, Executor::Process(_)) {
            // a process does not restart on its own: stop the old one
            executor.remove(&started[&k]).await?;
        }
        let seen = executor.observe(&spec).await?;
        match seen.phase {
            Phase::Absent => executor.ensure(&spec).await?,
            Phase::Failed | Phase::Succeeded => {
                let (reason, message) = seen.failure();
                tracing::warn!(workload = %k, %reason, %message, "managed bootd ended; restarting it");
                executor.remove(&spec).await?;
                executor.ensure(&spec).await?;
            }
            // first sight since the manager started, or a new
            // configuration: apply (a Deployment rolls, Recreate)
            Phase::Running if changed || !started.contains_key(&k) => {
                executor.ensure(&spec).await?;
            }
            Phase::Running => {}
        }
        if changed || !started.contains_key(&k) {
            tracing::info!(workload = %k, subnet = %s.name_any(), "managed bootd applied");
        }
        let (ok, reason, message) = condition(&spec, seen.phase, &seen.detail);
        set_condition(scope, s, ok, reason, message).await?;
        started.insert(k.clone(), spec.clone());
        want.insert(k, spec);
    }
    let gone: Vec<String> = started
        .keys()
        .filter(|k| !want.contains_key(*k))
        .cloned()
        .collect();
    for k in gone {
        if let Some(spec) = started.remove(&k) {
            executor.remove(&spec).await?;
            tracing::info!(workload = %k, "managed bootd stopped (its Subnet is gone or no longer Managed)");
        }
    }
    if let Executor::Kubernetes(kx) = executor {
        let keep: BTreeSet<String> = want.values().map(|s| kx.object_name(s)).collect();
        for name in kx.sweep_servers(COMPONENT, &keep).await? {
            tracing::info!(deployment = %name, "removed a bootd Deployment no managed Subnet wants");
        }
    }
    Ok(())
}

/// Sets `BootdAvailable` (other conditions kept; a conflict retries next
/// pass).
async fn set_condition(
    scope: &Scope,
    subnet: &Subnet,
    ok: bool,
    reason: &str,
    message: String,
) -> Result<(), kube::Error> {
    let mut all = subnet
        .status
        .as_ref()
        .map(|s| s.conditions.clone())
        .unwrap_or_default();
    if !crate::conditions::set(
        &mut all,
        types::BOOTD_AVAILABLE,
        ok,
        reason,
        message,
        subnet.metadata.generation,
    ) {
        return Ok(());
    }
    let patch = json!({
        "metadata": {"resourceVersion": subnet.resource_version()},
        "status": {"conditions": all},
    });
    match Api::<Subnet>::namespaced(
        scope.client.clone(),
        &subnet.namespace().unwrap_or_default(),
    )
    .patch_status(
        &subnet.name_any(),
        &crate::controller::patch_params(FIELD_MANAGER),
        &Patch::Merge(&patch),
    )
    .await
    {
        Err(kube::Error::Api(e)) if e.code == 409 || e.code == 404 => Ok(()),
        r => r.map(|_| ()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn subnet(ns: &str, mode: &str, network_ref: Option<&str>) -> Subnet {
        let mut bootd = json!({"serverIP": "10.90.0.1", "mode": mode});
        if let Some(n) = network_ref {
            bootd["networkRef"] = json!({"name": n});
        }
        let mut s: Subnet = serde_json::from_value(json!({
            "apiVersion": "anneal.dev/v1alpha1", "kind": "Subnet",
            "metadata": {"name": "rack1", "namespace": ns, "uid": "u-1"},
            "spec": {"siteRef": {"name": "site"}, "cidr": "10.90.0.0/24",
                     "bootd": bootd,
                     "dhcp": {"mode": "lease", "gateway": "", "leaseRange": {"start": "10.90.0.100", "end": "10.90.0.200"}}},
        }))
        .unwrap_or_else(|e| panic!("{e}"));
        s.metadata.namespace = Some(ns.into());
        s
    }

    fn cfg() -> BootdConfig {
        BootdConfig {
            api_url: Some("https://10.90.0.1:8443".into()),
            ca_namespace: "anneal-system".into(),
            http_port: 8080,
            service_account: "anneal-bootd".into(),
            env: BTreeMap::new(),
            allowed_namespaces: Vec::new(),
        }
    }

    #[test]
    fn a_managed_subnet_gets_a_host_network_bootd_it_owns() {
        let s = subnet("anneal-system", "Managed", None);
        assert!(is_managed(&s));
        let spec = bootd_spec(&s, &cfg(), Some("abc")).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(spec.name, "bootd-rack1");
        assert_eq!(spec.program, Program::Bootd);
        assert_eq!(spec.kind, Kind::Server);
        let args = spec.resolved_args(|v| v.mount_path.clone());
        let at = |flag: &str| {
            let i = args
                .iter()
                .position(|a| a == flag)
                .unwrap_or_else(|| panic!("{flag} in {args:?}"));
            args[i + 1].clone()
        };
        assert_eq!(at("--subnet"), "anneal-system/rack1");
        assert_eq!(at("--interface"), "auto");
        assert_eq!(at("--listen-ip"), "10.90.0.1");
        assert_eq!(at("--config"), "/config/bootd.yaml");
        assert_eq!(at("--boot-dir"), "/store/boot");
        assert_eq!(
            at("--lease-file"),
            "/store/.bootd/anneal-system.rack1.leases"
        );
        assert_eq!(spec.owner.as_ref().map(|o| o.uid.as_str()), Some("u-1"));
        assert!(spec.access.host_network);
        assert_eq!(spec.access.network_attachment, None);
        assert_eq!(spec.access.service_account.as_deref(), Some("anneal-bootd"));
        // the configuration carries the agent API and its CA digest, and
        // parses as bootd's own file format
        let VolumeSource::Files(files) = &spec.volumes[0].source else {
            panic!("config volume");
        };
        let text = String::from_utf8(files["bootd.yaml"].clone()).unwrap_or_default();
        let parsed = anneal_bootd_config_fields(&text);
        assert_eq!(
            parsed,
            vec![
                "api.caSha256=abc",
                "api.url=https://10.90.0.1:8443",
                "cidr=10.90.0.0/24",
                "dhcp.mode=lease",
                "serverIP=10.90.0.1"
            ]
        );
        // a configuration change changes the pod (a rollout)
        let other = bootd_spec(&s, &cfg(), Some("def")).unwrap_or_else(|e| panic!("{e}"));
        assert_ne!(
            spec.env.get("ANNEAL_BOOTD_CONFIG"),
            other.env.get("ANNEAL_BOOTD_CONFIG")
        );
    }

    #[test]
    fn ipv6_renders_the_dhcpv6_and_router_advertisement_flags() {
        let mut s = subnet("anneal-system", "Managed", None);
        let v4_only = bootd_spec(&s, &cfg(), Some("abc")).unwrap_or_else(|e| panic!("{e}"));
        assert!(
            !v4_only
                .args
                .iter()
                .any(|a| a.starts_with("--dhcp6") || a == "--router-advertisements")
        );
        s.spec.ipv6 = Some(
            serde_json::from_value(json!({
                "prefix": "2001:db8:90::/64", "serverAddress": "2001:db8:90::1",
                "leaseRange": {"start": "2001:db8:90::100", "end": "2001:db8:90::1ff"},
                "dnsServers": ["2001:db8:90::53", "2001:db8:90::54"],
                "routerAdvertisements": true
            }))
            .unwrap_or_else(|e| panic!("{e}")),
        );
        let spec = bootd_spec(&s, &cfg(), Some("abc")).unwrap_or_else(|e| panic!("{e}"));
        let tail: Vec<&str> = spec.args[v4_only.args.len()..]
            .iter()
            .map(String::as_str)
            .collect();
        assert_eq!(
            tail,
            [
                "--dhcp6-server-ip",
                "2001:db8:90::1",
                "--dhcp6-prefix",
                "2001:db8:90::/64",
                "--dhcp6-dns",
                "2001:db8:90::53",
                "--dhcp6-dns",
                "2001:db8:90::54",
                "--router-advertisements",
            ]
        );
        // answerAll in lease mode: the range serves machines without a
        // reservation; no RA
        s.spec.answer_all = true;
        if let Some(v6) = s.spec.ipv6.as_mut() {
            v6.router_advertisements = false;
            v6.dns_servers.clear();
        }
        let tail = ipv6_args(&s);
        assert_eq!(
            tail,
            [
                "--dhcp6-server-ip",
                "2001:db8:90::1",
                "--dhcp6-prefix",
                "2001:db8:90::/64",
                "--dhcp6-range",
                "2001:db8:90::100-2001:db8:90::1ff",
            ]
        );
    }

    /// The scalar fields of the YAML, flattened and sorted.
    fn anneal_bootd_config_fields(text: &str) -> Vec<String> {
        let v: serde_json::Value =
            serde_saphyr::from_str(text).unwrap_or_else(|e| panic!("{e}: {text}"));
        let mut out = Vec::new();
        for (k, val) in v.as_object().into_iter().flatten() {
            match val {
                serde_json::Value::Object(m) => {
                    for (k2, v2) in m {
                        if let Some(s) = v2.as_str() {
                            out.push(format!("{k}.{k2}={s}"));
                        }
                    }
                }
                serde_json::Value::String(s) if k != "subnet" => out.push(format!("{k}={s}")),
                _ => {}
            }
        }
        out.sort();
        out
    }

    #[test]
    fn a_network_ref_attaches_through_multus_and_external_is_not_managed() {
        let s = subnet("lab", "Managed", Some("prov"));
        let spec = bootd_spec(&s, &cfg(), Some("abc")).unwrap_or_else(|e| panic!("{e}"));
        assert!(!spec.access.host_network);
        assert_eq!(spec.access.network_attachment.as_deref(), Some("lab/prov"));
        assert!(!is_managed(&subnet("lab", "External", None)));
    }

    #[test]
    fn a_managed_bootd_runs_only_where_the_administrator_allows() {
        let c = cfg();
        assert_eq!(
            bootd_allowed(&subnet("anneal-system", "Managed", None), &c),
            Ok(())
        );
        let e = bootd_allowed(&subnet("tenant-a", "Managed", None), &c).unwrap_err();
        assert!(
            e.contains("Subnet tenant-a/rack1")
                && e.contains("--managed-bootd-namespace tenant-a")
                && e.contains("spec.bootd.mode: External"),
            "{e}"
        );
        let granted = BootdConfig {
            allowed_namespaces: vec!["tenant-a".into()],
            ..cfg()
        };
        assert_eq!(
            bootd_allowed(&subnet("tenant-a", "Managed", None), &granted),
            Ok(())
        );
        assert!(bootd_allowed(&subnet("tenant-b", "Managed", None), &granted).is_err());
    }

    #[test]
    fn what_is_missing_is_named() {
        let s = subnet("lab", "Managed", None);
        let no_url = BootdConfig {
            api_url: None,
            ..cfg()
        };
        let e = bootd_spec(&s, &no_url, Some("abc")).unwrap_err();
        assert!(e.contains("--bootd-api-url"), "{e}");
        let e = bootd_spec(&s, &cfg(), None).unwrap_err();
        assert!(e.contains("anneal-agent-api-ca"), "{e}");
        assert_eq!(
            BootdConfig::api_url_from(None, &["localhost".into(), "10.0.0.5".into()], 8443),
            Some("https://10.0.0.5:8443".into())
        );
        assert_eq!(
            BootdConfig::api_url_from(None, &["localhost".into(), "127.0.0.1".into()], 8443),
            None
        );
        assert_eq!(
            BootdConfig::api_url_from(Some("https://api.lab:9443"), &[], 8443),
            Some("https://api.lab:9443".into())
        );
    }

    #[test]
    fn the_condition_follows_the_workload() {
        let s = subnet("lab", "Managed", None);
        let spec = bootd_spec(&s, &cfg(), Some("abc")).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            condition(&spec, Phase::Running, ""),
            (
                true,
                reasons::BOOTD_RUNNING,
                "bootd bootd-rack1 runs".into()
            )
        );
        let (ok, reason, msg) = condition(
            &spec,
            Phase::Running,
            "Deployment bootd-rack1 has no ready replica",
        );
        assert!(!ok);
        assert_eq!(reason, reasons::BOOTD_STARTING);
        assert!(msg.contains("no ready replica"));
        let (ok, _, msg) = condition(&spec, Phase::Failed, "exit 1: no interface");
        assert!(!ok && msg.contains("no interface"), "{msg}");
    }
}
