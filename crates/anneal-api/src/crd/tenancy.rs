//! Who may use a Subnet, and which Machine holds a boot MAC on it: one
//! rule for the manager (validity, reservations) and bootd (its table), so
//! they never disagree about which Machine a MAC boots as.

use std::collections::BTreeMap;

use super::machine::Machine;
use super::network::Subnet;
use crate::mac::Mac;

/// Whether `m`'s `spec.subnetRef` names `subnet` (an empty namespace is the
/// Machine's own).
pub fn targets(m: &Machine, subnet: &Subnet) -> bool {
    let own = m.metadata.namespace.as_deref().unwrap_or_default();
    m.spec.subnet_ref.name == subnet.metadata.name.as_deref().unwrap_or_default()
        && m.spec.subnet_ref.namespace_or(own)
            == subnet.metadata.namespace.as_deref().unwrap_or_default()
}

/// `namespace/name` of a Machine.
pub fn machine_key(m: &Machine) -> String {
    format!(
        "{}/{}",
        m.metadata.namespace.as_deref().unwrap_or_default(),
        m.metadata.name.as_deref().unwrap_or_default()
    )
}

/// The holder of each boot MAC on `subnet`: among the Machines (any
/// namespace) naming it in `spec.subnetRef` that the Subnet grants
/// ([`Subnet::grants`]) and that have a boot MAC, the oldest
/// (creationTimestamp, then `namespace/name`) holds the MAC, whatever its
/// state, until it is gone; every later Machine with that MAC is a
/// duplicate and never gets the reservation or bootd's answer. A Machine
/// being deleted still holds its MAC until it is gone.
pub fn boot_mac_holders<'a>(
    subnet: &Subnet,
    machines: impl IntoIterator<Item = &'a Machine>,
) -> BTreeMap<Mac, &'a Machine> {
    let mut out: BTreeMap<Mac, &'a Machine> = BTreeMap::new();
    for m in machines {
        if !targets(m, subnet)
            || !subnet.grants(m.metadata.namespace.as_deref().unwrap_or_default())
        {
            continue;
        }
        let Some(mac) = m
            .spec
            .boot_mac_address
            .as_deref()
            .and_then(|s| s.parse::<Mac>().ok())
        else {
            continue;
        };
        match out.get(&mac) {
            Some(held) if !older(m, held) => {}
            _ => {
                out.insert(mac, m);
            }
        }
    }
    out
}

/// Key of the boot token in a boot-token Secret.
pub const BOOT_TOKEN_KEY: &str = "token";
/// Label on boot-token Secrets naming their Machine.
pub const BOOT_TOKEN_LABEL: &str = "anneal.dev/boot-token-for";
/// Label on a boot-token copy naming its Machine's namespace.
pub const BOOT_TOKEN_NAMESPACE_LABEL: &str = "anneal.dev/boot-token-namespace";
/// The one Secret of a Subnet's namespace that bootd reads: the boot
/// tokens of the Machines booting from Subnets of that namespace, one key
/// per Machine (named by [`boot_token_secret`]). bootd's Role grants
/// `get`, `list` and `watch` on this name only (RBAC `resourceNames`; a
/// list or watch must select it with `metadata.name=`), so bootd can read
/// no other Secret, the agent API CA's key included, and list none.
pub const BOOT_TOKENS_SECRET: &str = "anneal-boot-tokens";

/// Key of Machine `machine_ns/machine`'s boot token in Secret
/// [`BOOT_TOKENS_SECRET`] of `subnet_ns`, the namespace of the Subnet it
/// boots from (bootd reads that one Secret, in its own namespace): for a
/// Machine of that namespace `<machine>-boot-token` (the name of the
/// Machine's own Secret), for a Machine of another namespace
/// `<machine_ns>.<machine>.boot-token` (once the name of a copy Secret;
/// both are valid Secret keys). A namespace
/// name holds no dot, so that name is unique in the Subnet's namespace,
/// and it never takes the first form, which ends in `-boot-token`. A name
/// that would pass 253 characters uses a digest of the machine's name.
pub fn boot_token_secret(machine_ns: &str, machine: &str, subnet_ns: &str) -> String {
    if machine_ns == subnet_ns {
        return format!("{machine}-boot-token");
    }
    let name = format!("{machine_ns}.{machine}.boot-token");
    if name.len() <= 253 {
        return name;
    }
    use sha2::Digest;
    let digest = hex::encode(sha2::Sha256::digest(machine.as_bytes()));
    format!("{machine_ns}.h{}.boot-token", &digest[..32])
}

/// Whether `a` was enrolled before `b` (creationTimestamp, then
/// `namespace/name`; an object without a timestamp, never stored, is last).
fn older(a: &Machine, b: &Machine) -> bool {
    let t = |m: &Machine| {
        m.metadata
            .creation_timestamp
            .as_ref()
            .map_or(i64::MAX, |t| t.0.as_second())
    };
    (t(a), machine_key(a)) < (t(b), machine_key(b))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use serde_json::json;

    fn subnet(allowed: &[&str]) -> Subnet {
        serde_json::from_value(json!({
            "apiVersion": "anneal.dev/v1alpha1", "kind": "Subnet",
            "metadata": {"name": "lab", "namespace": "infra"},
            "spec": {"siteRef": {"name": "s"}, "cidr": "10.0.0.0/24", "allowedNamespaces": allowed,
                     "bootd": {"serverIP": "10.0.0.2", "mode": "External"}, "dhcp": {"mode": "proxy"}}
        }))
        .unwrap()
    }

    fn machine(ns: &str, name: &str, subnet_ns: Option<&str>, mac: &str, created: &str) -> Machine {
        serde_json::from_value(json!({
            "apiVersion": "anneal.dev/v1alpha1", "kind": "Machine",
            "metadata": {"name": name, "namespace": ns, "creationTimestamp": created},
            "spec": {"subnetRef": {"name": "lab", "namespace": subnet_ns}, "bootMACAddress": mac}
        }))
        .unwrap()
    }

    #[test]
    fn oldest_granted_machine_holds_the_mac() {
        let s = subnet(&["tenant-a", "tenant-z"]);
        let ms = [
            // later, and sorted after: must not take the MAC
            machine(
                "tenant-z",
                "thief",
                Some("infra"),
                "02:00:00:00:00:01",
                "2026-01-02T00:00:00Z",
            ),
            machine(
                "tenant-a",
                "first",
                Some("infra"),
                "02-00-00-00-00-01",
                "2026-01-01T00:00:00Z",
            ),
            // not granted: ignored even though older
            machine(
                "tenant-b",
                "old",
                Some("infra"),
                "02:00:00:00:00:02",
                "2025-01-01T00:00:00Z",
            ),
            machine(
                "infra",
                "own",
                None,
                "02:00:00:00:00:02",
                "2026-01-03T00:00:00Z",
            ),
            // another Subnet
            machine(
                "infra",
                "elsewhere",
                Some("other"),
                "02:00:00:00:00:03",
                "2025-01-01T00:00:00Z",
            ),
        ];
        let h = boot_mac_holders(&s, &ms);
        let names: Vec<(String, String)> = h
            .iter()
            .map(|(mac, m)| (mac.to_string(), machine_key(m)))
            .collect();
        assert_eq!(
            names,
            [
                ("02:00:00:00:00:01".into(), "tenant-a/first".into()),
                ("02:00:00:00:00:02".into(), "infra/own".into()),
            ]
        );
        // same second: namespace/name decides, in either input order
        let a = machine(
            "infra",
            "a",
            None,
            "02:00:00:00:00:09",
            "2026-01-01T00:00:00Z",
        );
        let b = machine(
            "infra",
            "b",
            None,
            "02:00:00:00:00:09",
            "2026-01-01T00:00:00Z",
        );
        for pair in [[a.clone(), b.clone()], [b, a]] {
            let h = boot_mac_holders(&s, &pair);
            assert_eq!(machine_key(h.values().next().unwrap()), "infra/a");
        }
    }

    #[test]
    fn grants_own_namespace_and_listed_ones() {
        let s = subnet(&["tenant-a"]);
        assert!(s.grants("infra") && s.grants("tenant-a"));
        assert!(!s.grants("tenant-b") && !s.grants(""));
    }

    #[test]
    fn boot_token_secrets_are_named_uniquely_in_the_subnets_namespace() {
        assert_eq!(boot_token_secret("infra", "m1", "infra"), "m1-boot-token");
        assert_eq!(
            boot_token_secret("tenant-a", "m1", "infra"),
            "tenant-a.m1.boot-token"
        );
        // `a` + machine `b-c` vs `a-b` + machine `c`: different names
        assert_ne!(
            boot_token_secret("a", "b-c", "infra"),
            boot_token_secret("a-b", "c", "infra")
        );
        // a machine of the Subnet's namespace named like a copy
        assert_ne!(
            boot_token_secret("infra", "tenant-a.m1", "infra"),
            boot_token_secret("tenant-a", "m1", "infra")
        );
        let long = "m".repeat(253);
        let n = boot_token_secret("tenant-a", &long, "infra");
        assert!(n.len() <= 253, "{n}");
        assert!(
            n.starts_with("tenant-a.h") && n.ends_with(".boot-token"),
            "{n}"
        );
        assert_ne!(n, boot_token_secret("tenant-a", &"m".repeat(252), "infra"));
    }
}
