//! The DHCP power gate: a Machine on a lease-mode Subnet is powered on only
//! once its reservation is live in bootd, i.e. the Subnet's
//! `status.dhcp.reservations` holds the Machine (name and boot MAC) and
//! `status.dhcp.appliedRevision == status.dhcp.revision`. Pure.

use anneal_api::conditions::{reasons, types};
use anneal_api::{DhcpMode, Machine, Subnet};
use kube::ResourceExt;

use crate::ipam::canonical_mac;

/// The Machine condition the gate writes.
pub const CONDITION: &str = types::DHCP_RESERVATION_READY;
/// Its reason while the Machine waits.
pub const WAITING: &str = reasons::WAITING_FOR_DHCP_RESERVATION;
/// Its reason once the reservation is live.
pub const LIVE: &str = reasons::RESERVATION_LIVE;
/// The Warning Event when the wait exceeds its bound.
pub const OVERDUE_EVENT: &str = "DHCPReservationOverdue";

/// What is missing before the power-on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Missing {
    /// The Machine has no (valid) `spec.bootMACAddress`: nothing to reserve by.
    NoBootMac,
    /// `status.dhcp.reservations` has no entry for the Machine and its MAC.
    Reservation {
        /// The Machine's boot MAC (canonical).
        mac: String,
    },
    /// The entry exists, but bootd has not made its revision live yet.
    Applied {
        /// The reserved address.
        address: String,
        /// `status.dhcp.revision`.
        revision: Option<String>,
        /// `status.dhcp.appliedRevision`.
        applied: Option<String>,
    },
}

/// The outcome of the gate for one Machine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Gate {
    /// No lease-mode Subnet (proxy mode, no boot half, Subnet not found): the
    /// gate does not apply.
    NotApplicable,
    /// The reservation is live: power on.
    Ready {
        /// `namespace/name` of the Subnet.
        subnet: String,
        /// The reserved address.
        address: String,
        /// The live revision.
        revision: String,
    },
    /// Hold the power-on.
    Waiting {
        /// `namespace/name` of the Subnet.
        subnet: String,
        /// What is missing.
        missing: Missing,
    },
}

/// `namespace` and `name` of the Subnet a Machine targets.
pub fn subnet_of(m: &Machine) -> (String, String) {
    let own = m.namespace().unwrap_or_default();
    let r = &m.spec.subnet_ref;
    (r.namespace_or(&own).to_string(), r.name.clone())
}

/// Decides the gate for `m` given its Subnet (None: not found).
pub fn evaluate(m: &Machine, subnet: Option<&Subnet>) -> Gate {
    let Some(subnet) = subnet else {
        return Gate::NotApplicable;
    };
    if subnet.spec.dhcp.as_ref().map(|d| d.mode) != Some(DhcpMode::Lease) {
        return Gate::NotApplicable;
    }
    let sns = subnet.namespace().unwrap_or_default();
    let key = format!("{sns}/{}", subnet.name_any());
    let waiting = |missing| Gate::Waiting {
        subnet: key.clone(),
        missing,
    };
    let Some(mac) = m.spec.boot_mac_address.as_deref().and_then(canonical_mac) else {
        return waiting(Missing::NoBootMac);
    };
    // `Reservation.machine`: the name, `namespace/name` across namespaces.
    let mns = m.namespace().unwrap_or_default();
    let machine = if mns == sns {
        m.name_any()
    } else {
        format!("{mns}/{}", m.name_any())
    };
    let dhcp = subnet.status.as_ref().and_then(|s| s.dhcp.as_ref());
    let entry = dhcp.and_then(|d| {
        d.reservations
            .iter()
            .find(|r| r.machine == machine && canonical_mac(&r.mac).as_deref() == Some(&mac))
    });
    let Some(entry) = entry else {
        return waiting(Missing::Reservation { mac });
    };
    let revision = dhcp.and_then(|d| d.revision.clone());
    let applied = dhcp.and_then(|d| d.applied_revision.clone());
    match revision {
        Some(r) if applied.as_deref() == Some(r.as_str()) => Gate::Ready {
            subnet: key,
            address: entry.address.clone(),
            revision: r,
        },
        revision => waiting(Missing::Applied {
            address: entry.address.clone(),
            revision,
            applied,
        }),
    }
}

/// The condition message while waiting (stable: no clock in it).
pub fn waiting_message(subnet: &str, missing: &Missing, overdue: bool) -> String {
    let what = match missing {
        Missing::NoBootMac => format!(
            "power-on held: the Machine has no valid spec.bootMACAddress, and lease-mode \
             Subnet {subnet} reserves addresses by MAC"
        ),
        Missing::Reservation { mac } => format!(
            "power-on held: Subnet {subnet} has no reservation for this Machine (MAC {mac}) \
             in status.dhcp.reservations yet"
        ),
        Missing::Applied {
            address,
            revision,
            applied,
        } => format!(
            "power-on held: {address} is reserved on Subnet {subnet}, but bootd has not applied \
             it yet (status.dhcp.revision {}, appliedRevision {})",
            revision.as_deref().unwrap_or("<none>"),
            applied.as_deref().unwrap_or("<none>"),
        ),
    };
    if overdue {
        format!("{what}; overdue: {}", hint(subnet, missing))
    } else {
        what
    }
}

/// What an operator should check when the wait is overdue.
pub fn hint(subnet: &str, missing: &Missing) -> String {
    match missing {
        Missing::NoBootMac => "set spec.bootMACAddress".to_string(),
        Missing::Reservation { .. } => format!(
            "is the lease range of Subnet {subnet} exhausted (condition DHCPPoolExhausted)? \
             is the manager's reservations controller running?"
        ),
        Missing::Applied { .. } => format!(
            "is bootd running for Subnet {subnet} (bootd --subnet {subnet}) and able to write \
             status.dhcp.appliedRevision?"
        ),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use serde_json::json;

    fn subnet(mode: &str, dhcp_status: serde_json::Value) -> Subnet {
        let dhcp = if mode == "lease" {
            json!({"mode": "lease", "gateway": "", "leaseRange": {"start": "10.0.0.100", "end": "10.0.0.110"}})
        } else {
            json!({"mode": "proxy"})
        };
        serde_json::from_value(json!({
            "apiVersion": "anneal.dev/v1alpha1", "kind": "Subnet",
            "metadata": {"name": "lab", "namespace": "default"},
            "spec": {
                "siteRef": {"name": "site"}, "cidr": "10.0.0.0/24",
                "bootd": {"serverIP": "10.0.0.1", "mode": "External"},
                "dhcp": dhcp
            },
            "status": {"dhcp": dhcp_status}
        }))
        .unwrap()
    }

    fn machine(ns: &str, mac: Option<&str>) -> Machine {
        let mut spec = json!({"subnetRef": {"name": "lab", "namespace": "default"}});
        if let Some(mac) = mac {
            spec["bootMACAddress"] = json!(mac);
        }
        serde_json::from_value(json!({
            "apiVersion": "anneal.dev/v1alpha1", "kind": "Machine",
            "metadata": {"name": "m1", "namespace": ns},
            "spec": spec
        }))
        .unwrap()
    }

    fn table(machine: &str, applied: Option<&str>) -> serde_json::Value {
        let mut t = json!({
            "reservations": [{"address": "10.0.0.100", "machine": machine, "mac": "52:54:00:AA:BB:01"}],
            "revision": "r1",
        });
        if let Some(a) = applied {
            t["appliedRevision"] = json!(a);
        }
        t
    }

    #[test]
    fn not_applicable_without_a_lease_mode_subnet() {
        let m = machine("default", Some("52:54:00:aa:bb:01"));
        assert_eq!(evaluate(&m, None), Gate::NotApplicable);
        let proxy = subnet("proxy", json!({}));
        assert_eq!(evaluate(&m, Some(&proxy)), Gate::NotApplicable);
        let mut data_only = subnet("lease", json!({}));
        data_only.spec.dhcp = None;
        assert_eq!(evaluate(&m, Some(&data_only)), Gate::NotApplicable);
    }

    #[test]
    fn waits_for_the_reservation_then_for_bootd() {
        let m = machine("default", Some("52-54-00-aa-bb-01"));
        let empty = subnet("lease", json!({}));
        assert_eq!(
            evaluate(&m, Some(&empty)),
            Gate::Waiting {
                subnet: "default/lab".into(),
                missing: Missing::Reservation {
                    mac: "52:54:00:aa:bb:01".into()
                }
            }
        );
        let lagging = subnet("lease", table("m1", Some("r0")));
        let g = evaluate(&m, Some(&lagging));
        let Gate::Waiting {
            subnet: key,
            missing,
        } = &g
        else {
            panic!("{g:?}")
        };
        assert_eq!(
            missing,
            &Missing::Applied {
                address: "10.0.0.100".into(),
                revision: Some("r1".into()),
                applied: Some("r0".into())
            }
        );
        let msg = waiting_message(key, missing, false);
        assert!(
            msg.contains("default/lab") && msg.contains("appliedRevision r0"),
            "{msg}"
        );
        assert!(waiting_message(key, missing, true).contains("is bootd running"));
        let live = subnet("lease", table("m1", Some("r1")));
        assert_eq!(
            evaluate(&m, Some(&live)),
            Gate::Ready {
                subnet: "default/lab".into(),
                address: "10.0.0.100".into(),
                revision: "r1".into()
            }
        );
    }

    #[test]
    fn the_entry_must_match_name_and_mac() {
        // another MAC under the same name
        let m = machine("default", Some("52:54:00:aa:bb:02"));
        let live = subnet("lease", table("m1", Some("r1")));
        assert!(matches!(
            evaluate(&m, Some(&live)),
            Gate::Waiting {
                missing: Missing::Reservation { .. },
                ..
            }
        ));
        // a Machine of another namespace is keyed `namespace/name`
        let other = machine("team", Some("52:54:00:aa:bb:01"));
        assert!(matches!(
            evaluate(&other, Some(&live)),
            Gate::Waiting { .. }
        ));
        let keyed = subnet("lease", table("team/m1", Some("r1")));
        assert!(matches!(evaluate(&other, Some(&keyed)), Gate::Ready { .. }));
        // no MAC at all
        let nomac = machine("default", None);
        assert!(matches!(
            evaluate(&nomac, Some(&live)),
            Gate::Waiting {
                missing: Missing::NoBootMac,
                ..
            }
        ));
    }
}
