//! The pure part of binding: which machines a claim may take, and why a
//! claim waits.

use std::collections::BTreeMap;

use anneal_api::Machine;
use anneal_api::{MachineClaim, MachineHardware, MachineState, NameRef, tolerates_all};
use kube::ResourceExt;

/// Why a machine cannot be bound by a claim (also the Bound=False reason).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Skip {
    /// Already bound to another claim.
    Claimed,
    /// Being deleted.
    Deleting,
    /// `spec.unclaimable` is set.
    Cordoned,
    /// Carries a taint the claim does not tolerate.
    Tainted,
    /// Its state does not admit a new claim.
    NotAvailable,
    /// Labels do not match the selector.
    LabelMismatch,
    /// No MachineHardware reported yet while the selector has floors.
    NoHardware,
    /// Hardware below the selector's floors.
    HardwareBelowFloor,
}

impl Skip {
    /// CamelCase reason for conditions and events.
    pub fn reason(self) -> &'static str {
        match self {
            Self::Claimed => "MachineClaimed",
            Self::Deleting => "MachineDeleting",
            Self::Cordoned => "MachineCordoned",
            Self::Tainted => "MachineTainted",
            Self::NotAvailable => "MachineNotAvailable",
            Self::LabelMismatch => "LabelMismatch",
            Self::NoHardware => "NoHardware",
            Self::HardwareBelowFloor => "HardwareBelowFloor",
        }
    }
}

/// Whether `claim_ref` (as written on a Machine in `machine_ns`) names the
/// claim `name` in `claim_ns`.
pub fn ref_names(claim_ref: &NameRef, machine_ns: &str, claim_ns: &str, name: &str) -> bool {
    claim_ref.name == name && claim_ref.namespace_or(machine_ns) == claim_ns
}

/// Whether the binding between `machine` and `claim` holds from both sides
/// (docs/api.md, Machine `spec.claimRef`): the Machine's `spec.claimRef` names the claim,
/// the claim's `status.machineName` names the Machine, and both live in one
/// namespace (a claim binds only Machines of its own namespace, so a
/// `claimRef` into another namespace never counts, whoever wrote it).
pub fn binding_holds(machine: &Machine, claim: &MachineClaim) -> bool {
    let (Some(mns), Some(cns)) = (
        machine.metadata.namespace.as_deref(),
        claim.metadata.namespace.as_deref(),
    ) else {
        return false;
    };
    let (Some(mname), Some(cname)) = (
        machine.metadata.name.as_deref(),
        claim.metadata.name.as_deref(),
    ) else {
        return false;
    };
    mns == cns
        && machine
            .spec
            .claim_ref
            .as_ref()
            .is_some_and(|r| ref_names(r, mns, cns, cname))
        && claim
            .status
            .as_ref()
            .and_then(|s| s.machine_name.as_deref())
            == Some(mname)
        && claim.metadata.deletion_timestamp.is_none()
}

/// States in which a machine named by a claim may be bound. A selector only
/// takes `Available` machines.
fn named_bindable(state: Option<MachineState>) -> bool {
    !matches!(
        state,
        Some(
            MachineState::Deprovisioning
                | MachineState::PoweringOff
                | MachineState::Released
                | MachineState::Parked
        )
    )
}

/// Checks common to both ways of binding.
fn common(machine: &Machine, claim: &MachineClaim) -> Result<(), Skip> {
    if machine.metadata.deletion_timestamp.is_some() {
        return Err(Skip::Deleting);
    }
    if machine.spec.claim_ref.is_some() {
        return Err(Skip::Claimed);
    }
    if machine.spec.unclaimable {
        return Err(Skip::Cordoned);
    }
    if !tolerates_all(&claim.spec.tolerations, &machine.spec.taints) {
        return Err(Skip::Tainted);
    }
    Ok(())
}

/// Whether the claim may bind the machine it names.
pub fn check_named(machine: &Machine, claim: &MachineClaim) -> Result<(), Skip> {
    common(machine, claim)?;
    let state = machine.status.as_ref().and_then(|s| s.state);
    if !named_bindable(state) {
        return Err(Skip::NotAvailable);
    }
    Ok(())
}

/// Whether the claim's selector may bind `machine`, given the machine's
/// reported hardware.
pub fn check_selected(
    machine: &Machine,
    hardware: Option<&MachineHardware>,
    claim: &MachineClaim,
) -> Result<(), Skip> {
    let Some(selector) = claim.spec.selector.as_ref() else {
        return Err(Skip::LabelMismatch);
    };
    common(machine, claim)?;
    if machine.status.as_ref().and_then(|s| s.state) != Some(MachineState::Available) {
        return Err(Skip::NotAvailable);
    }
    if !selector.labels().matches(machine.labels()) {
        return Err(Skip::LabelMismatch);
    }
    if let Some(floor) = &selector.hardware {
        let Some(hw) = hardware else {
            return Err(Skip::NoHardware);
        };
        if !hw.spec.meets(floor) {
            return Err(Skip::HardwareBelowFloor);
        }
    }
    Ok(())
}

/// The most telling reason among the skips of all machines: the one that
/// got furthest (a tainted match says more than a label mismatch).
pub fn best_reason(skips: &BTreeMap<String, Skip>) -> Option<Skip> {
    let rank = |s: &Skip| match s {
        Skip::LabelMismatch => 0,
        Skip::Deleting => 1,
        Skip::NotAvailable => 2,
        Skip::NoHardware => 3,
        Skip::HardwareBelowFloor => 4,
        Skip::Claimed => 5,
        Skip::Tainted => 6,
        Skip::Cordoned => 7,
    };
    skips.values().copied().max_by_key(rank)
}

/// A stable per-claim position in a list of `len` (0 when empty), so
/// concurrent claims start at different machines instead of all racing for
/// the first one.
pub fn offset(len: usize, seed: &str) -> usize {
    if len == 0 {
        return 0;
    }
    // FNV-1a: stable across runs and processes.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in seed.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    usize::try_from(h % len as u64).unwrap_or(0)
}

/// A stable per-claim rotation of the candidate list (see [`offset`]).
pub fn rotate<T>(candidates: &mut [T], seed: &str) {
    let k = offset(candidates.len(), seed);
    candidates.rotate_left(k);
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use anneal_api::conditions::reasons;
    use serde_json::json;

    fn machine(spec: serde_json::Value, state: &str, labels: serde_json::Value) -> Machine {
        serde_json::from_value(json!({
            "apiVersion": "anneal.dev/v1alpha1", "kind": "Machine",
            "metadata": {"name": "m", "namespace": "ns", "labels": labels},
            "spec": spec, "status": {"state": state}
        }))
        .unwrap()
    }

    fn claim(spec: serde_json::Value) -> MachineClaim {
        serde_json::from_value(json!({
            "apiVersion": "anneal.dev/v1alpha1", "kind": "MachineClaim",
            "metadata": {"name": "c", "namespace": "ns"}, "spec": spec
        }))
        .unwrap()
    }

    fn hw(cpus: i32, mem: i64, disks: serde_json::Value) -> MachineHardware {
        serde_json::from_value(json!({
            "apiVersion": "anneal.dev/v1alpha1", "kind": "MachineHardware",
            "metadata": {"name": "m", "namespace": "ns"},
            "spec": {"cpu": {"count": cpus}, "memoryBytes": mem, "disks": disks}
        }))
        .unwrap()
    }

    #[test]
    fn named_claim_skips_cordoned_tainted_and_claimed() {
        let c = claim(json!({"machineName": "m"}));
        let base = json!({"subnetRef": {"name": "s"}});
        assert_eq!(
            check_named(&machine(base.clone(), "Available", json!({})), &c),
            Ok(())
        );
        assert_eq!(
            check_named(&machine(base.clone(), "Enrolling", json!({})), &c),
            Ok(())
        );
        assert_eq!(
            check_named(
                &machine(
                    json!({"subnetRef": {"name": "s"}, "unclaimable": true}),
                    "Available",
                    json!({})
                ),
                &c
            ),
            Err(Skip::Cordoned)
        );
        assert_eq!(
            check_named(
                &machine(
                    json!({"subnetRef": {"name": "s"}, "claimRef": {"name": "x"}}),
                    "Available",
                    json!({})
                ),
                &c
            ),
            Err(Skip::Claimed)
        );
        let tainted = json!({"subnetRef": {"name": "s"}, "taints": [{"key": "gpu", "value": "yes", "effect": "NoBind"}]});
        assert_eq!(
            check_named(&machine(tainted.clone(), "Available", json!({})), &c),
            Err(Skip::Tainted)
        );
        let tolerant =
            claim(json!({"machineName": "m", "tolerations": [{"key": "gpu", "value": "yes"}]}));
        assert_eq!(
            check_named(&machine(tainted.clone(), "Available", json!({})), &tolerant),
            Ok(())
        );
        let wrong_value =
            claim(json!({"machineName": "m", "tolerations": [{"key": "gpu", "value": "no"}]}));
        assert_eq!(
            check_named(
                &machine(tainted.clone(), "Available", json!({})),
                &wrong_value
            ),
            Err(Skip::Tainted)
        );
        let exists_all =
            claim(json!({"machineName": "m", "tolerations": [{"operator": "Exists"}]}));
        assert_eq!(
            check_named(&machine(tainted, "Available", json!({})), &exists_all),
            Ok(())
        );
        assert_eq!(
            check_named(&machine(base, reasons::RELEASED, json!({})), &c),
            Err(Skip::NotAvailable)
        );
    }

    #[test]
    fn selector_matches_labels_expressions_and_hardware_floors() {
        let base = json!({"subnetRef": {"name": "s"}});
        let m = machine(
            base.clone(),
            "Available",
            json!({"rack": "a", "zone": "z1"}),
        );
        let c = claim(json!({"selector": {
            "matchLabels": {"rack": "a"},
            "matchExpressions": [{"key": "zone", "operator": "In", "values": ["z1", "z2"]},
                                 {"key": "broken", "operator": "DoesNotExist"}],
            "hardware": {"minCPUs": 4, "minMemoryBytes": 1000,
                         "disks": [{"minSizeGigabytes": 100}, {"rotational": true}]}}}));
        let big = hw(
            8,
            2000,
            json!([{"deviceName": "/dev/sda", "sizeBytes": 200_000_000_000i64},
                                     {"deviceName": "/dev/sdb", "sizeBytes": 50_000_000_000i64, "rotational": true}]),
        );
        assert_eq!(check_selected(&m, Some(&big), &c), Ok(()));
        assert_eq!(check_selected(&m, None, &c), Err(Skip::NoHardware));
        assert_eq!(
            check_selected(&m, Some(&hw(2, 2000, json!([]))), &c),
            Err(Skip::HardwareBelowFloor)
        );
        assert_eq!(
            check_selected(&m, Some(&hw(8, 10, json!([]))), &c),
            Err(Skip::HardwareBelowFloor)
        );
        // One disk cannot satisfy two hints.
        let one = hw(
            8,
            2000,
            json!([{"deviceName": "/dev/sda", "sizeBytes": 200_000_000_000i64, "rotational": true}]),
        );
        assert_eq!(
            check_selected(&m, Some(&one), &c),
            Err(Skip::HardwareBelowFloor)
        );
        let other_rack = machine(
            base.clone(),
            "Available",
            json!({"rack": "b", "zone": "z1"}),
        );
        assert_eq!(
            check_selected(&other_rack, Some(&big), &c),
            Err(Skip::LabelMismatch)
        );
        let enrolling = machine(base, "Enrolling", json!({"rack": "a", "zone": "z1"}));
        assert_eq!(
            check_selected(&enrolling, Some(&big), &c),
            Err(Skip::NotAvailable)
        );
    }

    #[test]
    fn a_selector_can_ask_for_an_architecture() {
        let m = machine(json!({"subnetRef": {"name": "s"}}), "Available", json!({}));
        let arm = claim(json!({"selector": {"hardware": {"architecture": "aarch64"}}}));
        let with_arch = |arch: Option<&str>| {
            let mut h = hw(4, 2000, json!([]));
            if let Some(c) = h.spec.cpu.as_mut() {
                c.architecture = arch.map(|a| serde_json::from_value(json!(a)).unwrap());
            }
            h
        };
        assert_eq!(
            check_selected(&m, Some(&with_arch(Some("aarch64"))), &arm),
            Ok(())
        );
        assert_eq!(
            check_selected(&m, Some(&with_arch(Some("x86_64"))), &arm),
            Err(Skip::HardwareBelowFloor)
        );
        // an inventory without the architecture does not match a claim asking for one
        assert_eq!(
            check_selected(&m, Some(&with_arch(None)), &arm),
            Err(Skip::HardwareBelowFloor)
        );
        // a claim that does not ask takes either
        let any = claim(json!({"selector": {"hardware": {"minCPUs": 1}}}));
        assert_eq!(
            check_selected(&m, Some(&with_arch(Some("x86_64"))), &any),
            Ok(())
        );
    }

    #[test]
    fn a_selector_can_ask_for_switch_ports_over_lldp() {
        let m = machine(json!({"subnetRef": {"name": "s"}}), "Available", json!({}));
        let with_nics = |nics: serde_json::Value| -> MachineHardware {
            let mut h = hw(4, 2000, json!([]));
            h.spec.nics = serde_json::from_value(nics).unwrap();
            h
        };
        let nic = |name: &str, lldp: serde_json::Value| json!({"name": name, "mac": "52:54:00:00:00:01", "link": true, "lldp": lldp});
        let leaf7 = |port: &str| {
            json!({"chassisId": "0c:a1:b2:c3:d4:e5", "portId": port,
                   "portDescription": "server uplink", "systemName": "leaf-07"})
        };
        let racked = with_nics(json!([
            nic("eno1", leaf7("Ethernet1/17")),
            {"name": "eno2", "mac": "52:54:00:00:00:02", "link": false},
        ]));
        let port =
            |p: &str| claim(json!({"selector": {"hardware": {"nics": [{"lldp": {"portId": p}}]}}}));
        assert_eq!(
            check_selected(&m, Some(&racked), &port("Ethernet1/17")),
            Ok(())
        );
        assert_eq!(
            check_selected(&m, Some(&racked), &port("Ethernet1/18")),
            Err(Skip::HardwareBelowFloor)
        );
        // every field given must match, on one NIC
        let exact = claim(json!({"selector": {"hardware": {"nics": [{"lldp": {
            "portId": "Ethernet1/17", "chassisId": "0c:a1:b2:c3:d4:e5", "systemName": "leaf-07"}}]}}}));
        assert_eq!(check_selected(&m, Some(&racked), &exact), Ok(()));
        let other_switch = claim(json!({"selector": {"hardware": {"nics": [{"lldp": {
            "portId": "Ethernet1/17", "systemName": "leaf-08"}}]}}}));
        assert_eq!(
            check_selected(&m, Some(&racked), &other_switch),
            Err(Skip::HardwareBelowFloor)
        );
        // a switch alone (any port of leaf-07)
        let switch = claim(
            json!({"selector": {"hardware": {"nics": [{"lldp": {"systemName": "leaf-07"}}]}}}),
        );
        assert_eq!(check_selected(&m, Some(&racked), &switch), Ok(()));
        // two entries need two NICs: the second NIC heard nothing
        let two = claim(json!({"selector": {"hardware": {"nics": [
            {"lldp": {"systemName": "leaf-07"}}, {"lldp": {"systemName": "leaf-07"}}]}}}));
        assert_eq!(
            check_selected(&m, Some(&racked), &two),
            Err(Skip::HardwareBelowFloor)
        );
        let dual = with_nics(json!([
            nic("eno1", leaf7("Ethernet1/17")),
            nic("eno2", leaf7("Ethernet1/18")),
        ]));
        assert_eq!(check_selected(&m, Some(&dual), &two), Ok(()));
        // an inventory without LLDP matches no LLDP hint; an empty hint any NIC
        let silent = with_nics(json!([{"name": "eno1", "mac": "52:54:00:00:00:01", "link": true}]));
        assert_eq!(
            check_selected(&m, Some(&silent), &port("Ethernet1/17")),
            Err(Skip::HardwareBelowFloor)
        );
        let any_nic = claim(json!({"selector": {"hardware": {"nics": [{}]}}}));
        assert_eq!(check_selected(&m, Some(&silent), &any_nic), Ok(()));
        assert_eq!(
            check_selected(&m, Some(&with_nics(json!([]))), &any_nic),
            Err(Skip::HardwareBelowFloor)
        );
        // no MachineHardware yet: waits like any other floor
        assert_eq!(
            check_selected(&m, None, &port("Ethernet1/17")),
            Err(Skip::NoHardware)
        );
    }

    #[test]
    fn rotation_is_stable_and_spreads() {
        let mut a: Vec<u32> = (0..10).collect();
        let mut b = a.clone();
        rotate(&mut a, "ns/claim-1");
        rotate(&mut b, "ns/claim-1");
        assert_eq!(a, b);
        let starts: std::collections::BTreeSet<u32> = (0..50)
            .map(|i| {
                let mut v: Vec<u32> = (0..10).collect();
                rotate(&mut v, &format!("ns/claim-{i}"));
                v[0]
            })
            .collect();
        assert!(
            starts.len() >= 6,
            "rotation spreads start points: {starts:?}"
        );
    }

    #[test]
    fn binding_holds_only_both_ways_and_in_one_namespace() {
        let bound_claim = |ns: &str, machine: &str| -> MachineClaim {
            serde_json::from_value(json!({
                "apiVersion": "anneal.dev/v1alpha1", "kind": "MachineClaim",
                "metadata": {"name": "c", "namespace": ns},
                "spec": {"machineName": machine},
                "status": {"phase": "Bound", "machineName": machine}
            }))
            .unwrap()
        };
        let m = |claim_ref: serde_json::Value| {
            machine(
                json!({"subnetRef": {"name": "s"}, "claimRef": claim_ref}),
                "Available",
                json!({}),
            )
        };
        // the binding the claim controller writes
        assert!(binding_holds(
            &m(json!({"name": "c", "namespace": "ns"})),
            &bound_claim("ns", "m")
        ));
        assert!(binding_holds(
            &m(json!({"name": "c"})),
            &bound_claim("ns", "m")
        ));
        // a tenant's Machine (namespace ns) naming the claim of namespace
        // other, bound there to a Machine of the same name: never
        assert!(!binding_holds(
            &m(json!({"name": "c", "namespace": "other"})),
            &bound_claim("other", "m")
        ));
        // the claim does not name this machine
        assert!(!binding_holds(
            &m(json!({"name": "c"})),
            &bound_claim("ns", "m2")
        ));
        // the Machine names another claim
        assert!(!binding_holds(
            &m(json!({"name": "c2"})),
            &bound_claim("ns", "m")
        ));
        // a claim being deleted
        let mut deleting = bound_claim("ns", "m");
        deleting.metadata.deletion_timestamp =
            Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                k8s_openapi::jiff::Timestamp::now(),
            ));
        assert!(!binding_holds(&m(json!({"name": "c"})), &deleting));
        // no claimRef at all
        let free = machine(json!({"subnetRef": {"name": "s"}}), "Available", json!({}));
        assert!(!binding_holds(&free, &bound_claim("ns", "m")));
    }
}
