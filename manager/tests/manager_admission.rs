//! Admission against a real kube-apiserver: the CEL rules and schema
//! constraints of the generated CRDs refuse invalid objects with a message
//! naming the field, and accept their valid counterparts.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
#![allow(clippy::too_many_lines)]

use anneal_testinfra::ControlPlane;
use kube::api::{
    Api, ApiResource, DynamicObject, GroupVersionKind, Patch, PatchParams, PostParams,
};
use serde_json::{Value, json};

fn resource(kind: &str) -> ApiResource {
    let crd = anneal_api::crds()
        .into_iter()
        .find(|c| c.spec.names.kind == kind)
        .unwrap();
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("anneal.dev", "v1alpha1", kind),
        &crd.spec.names.plural,
    )
}

fn api(cp: &ControlPlane, kind: &str) -> Api<DynamicObject> {
    Api::namespaced_with(cp.client(), "default", &resource(kind))
}

fn object(kind: &str, name: &str, spec: Value) -> DynamicObject {
    serde_json::from_value(json!({
        "apiVersion": "anneal.dev/v1alpha1",
        "kind": kind,
        "metadata": {"name": name},
        "spec": spec,
    }))
    .unwrap()
}

/// Valid specs, one per kind (several for kinds with shapes).
fn valid() -> Vec<(&'static str, Value)> {
    vec![
        (
            "Site",
            json!({"seederSubnetRef": {"name": "lab"}, "tracker": {"ip": "10.77.0.9"}}),
        ),
        ("Site", json!({})),
        (
            "Subnet",
            json!({
                "siteRef": {"name": "s"}, "cidr": "10.77.0.0/24",
                "bootd": {"serverIP": "10.77.0.2", "mode": "External"},
                "dhcp": {"mode": "lease", "gateway": "", "leaseRange": {"start": "10.77.0.100", "end": "10.77.0.200"}, "leaseTime": "2m"}
            }),
        ),
        (
            "Subnet",
            json!({
                "siteRef": {"name": "s"}, "cidr": "10.78.0.0/16",
                "bootd": {"serverIP": "10.78.0.2", "mode": "Managed", "networkRef": {"name": "nad"}},
                "dhcp": {"mode": "proxy"}
            }),
        ),
        (
            "Subnet",
            json!({"siteRef": {"name": "s"}, "cidr": "10.79.0.0/24", "seederNetworkRef": {"name": "nad"}}),
        ),
        (
            "Subnet",
            json!({"siteRef": {"name": "s"}, "cidr": "10.80.0.0/24", "seederNetworkRef": {"name": "nad"},
                   "allowedNamespaces": ["tenant-a", "tenant-b"]}),
        ),
        (
            "ImageImport",
            json!({
                "source": {"url": "https://example.org/disk.qcow2", "checksum": format!("sha256:{}", "a".repeat(64)), "format": "qcow2"},
                "imageName": "debian", "contentPrefix": "debian"
            }),
        ),
        (
            "PartitionContent",
            json!({"fsType": "ext4", "usedBytes": 10, "sizeBytes": 100, "lastExtentEnd": 50, "blockSize": 4096, "pieceLength": 262144}),
        ),
        (
            "Image",
            json!({"layout": {"partitionTable": "gpt", "slots": [
            {"number": 1, "role": "esp", "contentRef": {"name": "c1"}},
            {"number": 2, "role": "data", "fsType": "ext4"}]}}),
        ),
        (
            "Machine",
            json!({
                "subnetRef": {"name": "lab"}, "bootMACAddress": "52:54:00:AA:bb:01", "console": ["tty0", "ttyS0,115200n8"],
                "bmc": {"address": "redfish+http://10.0.0.1:8000", "credentialsSecretRef": {"name": "bmc"}, "insecureSkipVerify": true},
                "bootTimeout": "20m"
            }),
        ),
        (
            "MachineClaim",
            json!({"machineName": "m1", "imageRef": {"name": "debian"},
            "targetDisk": {"minSizeGigabytes": 10, "maxSizeGigabytes": 20},
            "tolerations": [{"key": "k", "operator": "Exists"}]}),
        ),
        (
            "MachineClaim",
            json!({"selector": {"matchLabels": {"rack": "a"},
            "matchExpressions": [{"key": "zone", "operator": "In", "values": ["z1"]}],
            "hardware": {"minCPUs": 2, "minMemoryBytes": 1024}}}),
        ),
        (
            "MachineHardware",
            json!({"cpu": {"count": 4}, "memoryBytes": 8589934592i64, "disks": [{"deviceName": "/dev/vda", "sizeBytes": 1000}]}),
        ),
        (
            "DeployRun",
            json!({"machineRef": {"name": "m1"}, "claimRef": {"name": "c1"}, "hooksHash": "x"}),
        ),
        (
            "PostHook",
            json!({"steps": [{"builtin": "mkswap"}, {"script": {"inline": "echo hi"}}]}),
        ),
        (
            "PostHook",
            json!({"steps": [{"script": {"secretRef": {"name": "s", "key": "k", "namespace": ""}}}]}),
        ),
        (
            "ReadinessRule",
            json!({"machineSelector": {"matchLabels": {"a": "b"}}, "conditions": [{"type": "Discovered"}], "taint": {"key": "anneal.dev/undiscovered"}}),
        ),
    ]
}

/// (kind, invalid spec, substring the refusal must contain: the field).
fn invalid() -> Vec<(&'static str, Value, &'static str)> {
    let subnet = |patch: Value| {
        let mut base = json!({
            "siteRef": {"name": "s"}, "cidr": "10.77.0.0/24",
            "bootd": {"serverIP": "10.77.0.2", "mode": "External"},
            "dhcp": {"mode": "lease", "gateway": "10.77.0.1", "leaseRange": {"start": "10.77.0.100", "end": "10.77.0.200"}}
        });
        merge(&mut base, patch);
        base
    };
    let machine = |patch: Value| {
        let mut base = json!({"subnetRef": {"name": "lab"}});
        merge(&mut base, patch);
        base
    };
    let bmc = json!({"address": "redfish://10.0.0.1", "credentialsSecretRef": {"name": "bmc"}});
    let image = |slots: Value, bootable: bool| json!({"bootable": bootable, "layout": {"partitionTable": "gpt", "slots": slots}});
    vec![
        (
            "Site",
            json!({"seederSubnetRef": {"name": "lab"}, "tracker": {"ip": "10.0.0.1", "externalURL": "http://t/announce"}}),
            "spec.tracker.ip and spec.tracker.externalURL",
        ),
        (
            "Site",
            json!({"tracker": {"ip": "10.0.0.1"}}),
            "spec.tracker needs spec.seederSubnetRef",
        ),
        (
            "Site",
            json!({"seederSubnetRef": {"name": "lab"}, "tracker": {"ip": "fd00::1"}}),
            "spec.tracker.ip must be an IPv4",
        ),
        (
            "Subnet",
            json!({"siteRef": {"name": "s"}, "cidr": "10.0.0.0/24"}),
            "spec.seederNetworkRef",
        ),
        (
            "Subnet",
            subnet(json!({"dhcp": null})),
            "spec.bootd and spec.dhcp",
        ),
        (
            "Subnet",
            subnet(json!({"dhcp": {"gateway": null}})),
            "spec.dhcp.gateway is required in lease mode",
        ),
        (
            "Subnet",
            subnet(json!({"dhcp": {"mode": "proxy", "leaseRange": null}})),
            "spec.dhcp.gateway must be absent",
        ),
        (
            "Subnet",
            subnet(json!({"dhcp": {"leaseTime": "1m"}})),
            "spec.dhcp.leaseTime",
        ),
        (
            "Subnet",
            subnet(json!({"dhcp": {"leaseTime": "soon"}})),
            "spec.dhcp.leaseTime",
        ),
        (
            "Subnet",
            subnet(json!({"dhcp": {"leaseRange": null}})),
            "spec.dhcp.leaseRange",
        ),
        (
            "Subnet",
            subnet(json!({"dhcp": {"gateway": "router"}})),
            "spec.dhcp.gateway must be an IPv4",
        ),
        (
            "Subnet",
            subnet(json!({"cidr": "10.77.0.0/33"})),
            "spec.cidr",
        ),
        (
            "Subnet",
            subnet(json!({"cidr": "10.77.0.5/24"})),
            "spec.cidr",
        ),
        ("Subnet", subnet(json!({"cidr": "fd77::/64"})), "spec.cidr"),
        (
            "Subnet",
            // (Managed without networkRef is the host's network: accepted)
            subnet(json!({"bootd": {"mode": "Sometimes"}})),
            "spec.bootd.mode",
        ),
        (
            "Subnet",
            subnet(json!({"bootd": {"serverIP": "10.99.0.2"}})),
            "spec.bootd.serverIP must lie inside spec.cidr",
        ),
        (
            "Subnet",
            subnet(json!({"dhcp": {"dnsServers": ["dns.example"]}})),
            "spec.dhcp.dnsServers",
        ),
        (
            "ImageImport",
            json!({"source": {"url": "https://x/y", "checksum": "md5:abc"}, "imageName": "i", "contentPrefix": "p"}),
            "spec.source.checksum",
        ),
        (
            "ImageImport",
            json!({"source": {"url": "ftp://x/y"}, "imageName": "i", "contentPrefix": "p"}),
            "spec.source.url",
        ),
        (
            "PartitionContent",
            json!({"usedBytes": 200, "sizeBytes": 100, "lastExtentEnd": 50, "blockSize": 4096, "pieceLength": 262144}),
            "spec.usedBytes",
        ),
        (
            "PartitionContent",
            json!({"usedBytes": 10, "sizeBytes": 100, "lastExtentEnd": 500, "blockSize": 4096, "pieceLength": 262144}),
            "spec.lastExtentEnd",
        ),
        (
            "Image",
            image(
                json!([{"number": 1, "role": "esp", "contentRef": {"name": "c"}, "fsType": "vfat"}]),
                true,
            ),
            "contentRef and fsType",
        ),
        (
            "Image",
            image(
                json!([{"number": 1, "role": "data", "contentRef": {"name": "c"}}]),
                true,
            ),
            "spec.bootable needs an esp slot",
        ),
        (
            "Image",
            image(
                json!([{"number": 1, "role": "esp"}, {"number": 1, "role": "data"}]),
                true,
            ),
            "spec.layout.slots[].number must be unique",
        ),
        (
            "Image",
            image(json!([{"number": 1, "role": "root"}]), false),
            "spec.layout.slots[0].role",
        ),
        (
            "Machine",
            machine(json!({"bootMACAddress": "52:54:00:00:00"})),
            "spec.bootMACAddress",
        ),
        (
            "Machine",
            machine(json!({"console": ["a", "b", "c", "d", "e"]})),
            "spec.console",
        ),
        (
            "Machine",
            machine(
                json!({"bmc": {"address": "https://10.0.0.1", "credentialsSecretRef": {"name": "bmc"}}}),
            ),
            "spec.bmc.address",
        ),
        (
            "Machine",
            machine(
                json!({"bmc": merged(&bmc, json!({"insecureSkipVerify": true, "caBundleSecretRef": {"name": "ca"}}))}),
            ),
            "spec.bmc.insecureSkipVerify and spec.bmc.caBundleSecretRef",
        ),
        (
            "Machine",
            machine(json!({"bmc": {"address": "redfish://10.0.0.1"}})),
            "spec.bmc.credentialsSecretRef",
        ),
        (
            "Machine",
            machine(
                json!({"bmc": merged(&bmc, json!({"credentialsSecretRef": {"name": "bmc", "namespace": "tenant-b"}}))}),
            ),
            "spec.bmc.credentialsSecretRef.namespace must be empty",
        ),
        (
            "Machine",
            machine(
                json!({"bmc": merged(&bmc, json!({"caBundleSecretRef": {"name": "ca", "namespace": "tenant-b"}}))}),
            ),
            "spec.bmc.caBundleSecretRef.namespace must be empty",
        ),
        (
            "Machine",
            machine(json!({"bootTimeout": "forever"})),
            "spec.bootTimeout",
        ),
        (
            "Machine",
            machine(json!({"architecture": "riscv64"})),
            "spec.architecture",
        ),
        (
            "Machine",
            json!({"bootMACAddress": "52:54:00:00:00:01"}),
            "spec.subnetRef",
        ),
        (
            "MachineClaim",
            json!({"machineName": "m", "selector": {}}),
            "spec.machineName and spec.selector",
        ),
        (
            "MachineClaim",
            json!({"imageRef": {"name": "i"}}),
            "spec.machineName and spec.selector",
        ),
        (
            "MachineClaim",
            json!({"machineName": "m", "targetDisk": {"minSizeGigabytes": 30, "maxSizeGigabytes": 20}}),
            "targetDisk.minSizeGigabytes",
        ),
        (
            "MachineClaim",
            json!({"machineName": "m", "targetDisk": {"deviceName": "sda"}}),
            "targetDisk.deviceName",
        ),
        (
            "MachineClaim",
            json!({"machineName": "m", "tolerations": [{"key": "k", "operator": "Exists", "value": "v"}]}),
            "tolerations[].value",
        ),
        (
            "MachineClaim",
            json!({"selector": {"matchExpressions": [{"key": "k", "operator": "Near", "values": ["x"]}]}}),
            "spec.selector.matchExpressions[].operator",
        ),
        (
            "MachineClaim",
            json!({"selector": {"matchExpressions": [{"key": "k", "operator": "In"}]}}),
            "spec.selector.matchExpressions[].values",
        ),
        (
            "MachineClaim",
            json!({"machineName": "m", "afterDeploy": "Explode"}),
            "spec.afterDeploy",
        ),
        (
            "PostHook",
            json!({"steps": [{"builtin": "mkswap", "script": {"inline": "x"}}]}),
            "exactly one of builtin and script",
        ),
        (
            "PostHook",
            json!({"steps": [{"script": {"inline": "x", "configMapRef": {"name": "c", "key": "k"}}}]}),
            "exactly one of inline, configMapRef and secretRef",
        ),
        ("PostHook", json!({"steps": []}), "spec.steps"),
        (
            "PostHook",
            json!({"steps": [{"script": {"secretRef": {"name": "s", "key": "k", "namespace": "tenant-b"}}}]}),
            "spec.steps[0].script.secretRef.namespace",
        ),
        (
            "PostHook",
            json!({"steps": [{"script": {"configMapRef": {"name": "c", "key": "k", "namespace": "tenant-b"}}}]}),
            "spec.steps[0].script.configMapRef.namespace",
        ),
        (
            "Subnet",
            json!({"siteRef": {"name": "s"}, "cidr": "10.81.0.0/24", "seederNetworkRef": {"name": "nad"},
                   "allowedNamespaces": ["Tenant_A"]}),
            "spec.allowedNamespaces",
        ),
        (
            "PostHook",
            json!({"steps": [{"builtin": "reformat-everything"}]}),
            "spec.steps[0].builtin",
        ),
        (
            "ReadinessRule",
            json!({"conditions": [], "taint": {"key": "k"}}),
            "spec.conditions",
        ),
        (
            "ReadinessRule",
            json!({"conditions": [{"type": "A"}], "taint": {"key": "k", "effect": "NoSchedule"}}),
            "spec.taint.effect",
        ),
    ]
}

fn merge(base: &mut Value, patch: Value) {
    match (base, patch) {
        (Value::Object(b), Value::Object(p)) => {
            for (k, v) in p {
                if v.is_null() {
                    b.remove(&k);
                } else {
                    merge(b.entry(k).or_insert(Value::Null), v);
                }
            }
        }
        (b, p) => *b = p,
    }
}

fn merged(base: &Value, patch: Value) -> Value {
    let mut out = base.clone();
    merge(&mut out, patch);
    out
}

/// Updates that must be refused: (kind, valid spec, merge patch of spec,
/// substring).
fn invalid_updates() -> Vec<(&'static str, Value, Value, &'static str)> {
    vec![
        (
            "ImageImport",
            json!({"source": {"url": "https://x/y"}, "imageName": "i", "contentPrefix": "p"}),
            json!({"imageName": "j"}),
            "spec is immutable",
        ),
        (
            "PartitionContent",
            json!({"usedBytes": 10, "sizeBytes": 100, "lastExtentEnd": 50, "blockSize": 4096, "pieceLength": 262144}),
            json!({"usedBytes": 11}),
            "spec is immutable",
        ),
        (
            "Image",
            json!({"bootable": false, "layout": {"partitionTable": "gpt", "slots": [{"number": 1, "role": "data", "fsType": "ext4"}]}}),
            json!({"osFamily": "Windows"}),
            "spec is immutable",
        ),
        (
            "DeployRun",
            json!({"machineRef": {"name": "m"}, "claimRef": {"name": "c"}}),
            json!({"hooksHash": "changed"}),
            "spec is immutable",
        ),
        (
            "MachineClaim",
            json!({"machineName": "m"}),
            json!({"machineName": "other"}),
            "spec.machineName is immutable",
        ),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admission_refuses_invalid_objects_naming_the_field() {
    let cp = ControlPlane::start().await.unwrap();
    cp.install_crds(&anneal_api::crds()).await.unwrap();

    for (i, (kind, spec)) in valid().into_iter().enumerate() {
        let name = format!("valid-{i}");
        api(&cp, kind)
            .create(&PostParams::default(), &object(kind, &name, spec.clone()))
            .await
            .unwrap_or_else(|e| panic!("valid {kind} {spec} refused: {e}"));
    }

    let cases = invalid();
    assert!(cases.len() >= 25, "at least 25 invalid objects");
    let mut failures = Vec::new();
    for (i, (kind, spec, needle)) in cases.into_iter().enumerate() {
        let name = format!("invalid-{i}");
        match api(&cp, kind)
            .create(&PostParams::default(), &object(kind, &name, spec.clone()))
            .await
        {
            Ok(_) => failures.push(format!("#{i} {kind} {spec} was accepted")),
            Err(kube::Error::Api(status)) => {
                println!("#{i} {kind}: {}", status.message);
                if status.code != 422 || !status.message.contains(needle) {
                    failures.push(format!(
                        "#{i} {kind} {spec}: want 422 naming {needle:?}, got {} {}",
                        status.code, status.message
                    ));
                }
            }
            Err(e) => failures.push(format!("#{i} {kind}: unexpected error {e}")),
        }
    }

    for (i, (kind, spec, patch, needle)) in invalid_updates().into_iter().enumerate() {
        let name = format!("update-{i}");
        let api = api(&cp, kind);
        api.create(&PostParams::default(), &object(kind, &name, spec.clone()))
            .await
            .unwrap_or_else(|e| panic!("valid {kind} {spec} refused: {e}"));
        let patch = json!({"spec": patch});
        match api
            .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            Ok(_) => failures.push(format!("update #{i} {kind} {patch} was accepted")),
            Err(kube::Error::Api(status)) => {
                println!("#{i} {kind}: {}", status.message);
                if status.code != 422 || !status.message.contains(needle) {
                    failures.push(format!(
                        "update #{i} {kind}: want 422 naming {needle:?}, got {} {}",
                        status.code, status.message
                    ));
                }
            }
            Err(e) => failures.push(format!("update #{i} {kind}: unexpected error {e}")),
        }
    }
    assert!(
        failures.is_empty(),
        "admission failures:\n{}",
        failures.join("\n")
    );
}
