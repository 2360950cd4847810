//! The lab segment the control-plane tests share: the `lab` Subnet
//! (10.77.0.0/24, lease range .100-.150, bootd External) and bootd's boot
//! table watcher run in-process against it, asked what it would answer a
//! MAC.

use std::sync::Arc;

use anneal_api::Subnet;
use anneal_bootd::watch::{WatchConfig, build, run};
use anneal_bootd::{CancellationToken, Shared, StaticConfig};
use anneal_dhcp::{Decision, Leases, Mac};
use kube::api::{Api, PostParams};

/// The segment: its name, CIDR, bootd's address.
pub const SUBNET: &str = "lab";
pub const CIDR: &str = "10.77.0.0/24";
pub const SERVER_IP: &str = "10.77.0.1";

/// The `lab` Subnet in lease mode (`leaseTime` optional).
pub fn lease_subnet(lease_time: Option<&str>) -> Subnet {
    let mut dhcp = serde_json::json!({
        "mode": "lease", "gateway": "",
        "leaseRange": {"start": "10.77.0.100", "end": "10.77.0.150"}
    });
    if let Some(t) = lease_time {
        dhcp["leaseTime"] = t.into();
    }
    serde_json::from_value(serde_json::json!({
        "apiVersion": "anneal.dev/v1alpha1", "kind": "Subnet",
        "metadata": {"name": SUBNET},
        "spec": {
            "siteRef": {"name": "site"}, "cidr": CIDR,
            "bootd": {"serverIP": SERVER_IP, "mode": "External"},
            "dhcp": dhcp,
        }
    }))
    .unwrap()
}

/// Creates [`lease_subnet`] in `namespace`.
pub async fn create_lease_subnet(client: &kube::Client, namespace: &str) -> Api<Subnet> {
    let subnets: Api<Subnet> = Api::namespaced(client.clone(), namespace);
    subnets
        .create(&PostParams::default(), &lease_subnet(None))
        .await
        .unwrap();
    subnets
}

/// bootd's Machine/Subnet watcher for `lab` in `default`, in-process, with
/// a table built before it starts (as bootd starts it). Stopped on drop.
#[derive(Debug)]
pub struct Watcher {
    pub shared: Arc<Shared>,
    cancel: CancellationToken,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl Watcher {
    pub async fn start(client: &kube::Client) -> Self {
        Self::start_in(client, "default").await
    }

    /// The watcher of a bootd serving Subnet `lab` of `namespace`.
    pub async fn start_in(client: &kube::Client, namespace: &str) -> Self {
        let base = StaticConfig::from_yaml(&format!(
            "serverIP: {SERVER_IP}\ncidr: {CIDR}\ndhcp: {{mode: proxy}}\nartifacts: {{kernel: /k, initrd: /i}}\n",
        ))
        .unwrap();
        let cfg = WatchConfig {
            namespace: namespace.into(),
            subnet: SUBNET.into(),
            base,
            http_port: 8080,
        };
        let (snap, _, _) = build(client, &cfg).await.unwrap();
        let shared = Arc::new(Shared::new(snap, Leases::default(), String::new()));
        let cancel = CancellationToken::new();
        let task = tokio::spawn(run(client.clone(), cfg, shared.clone(), cancel.clone()));
        Self {
            shared,
            cancel,
            task: Some(task),
        }
    }

    /// What the live table answers a PXE DISCOVER from `mac` (no leases).
    pub fn answer(&self, mac: Mac) -> Decision {
        crate::dhcp_probe::decide_discover(&self.shared.snapshot().table, &Leases::default(), mac)
    }

    /// The live table's revision.
    pub fn revision(&self) -> String {
        self.shared.snapshot().table.revision.clone()
    }

    /// Stops the watcher and waits for its task.
    pub async fn stop(mut self) {
        self.cancel.cancel();
        if let Some(t) = self.task.take() {
            t.await.unwrap();
        }
    }
}

impl Drop for Watcher {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}
