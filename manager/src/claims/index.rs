//! The claim controller's index of Machines: the machines a selector may
//! take, per namespace, and which machine each claim holds, so a reconcile
//! never scans every Machine.

use std::collections::HashMap;

use anneal_api::{Machine, MachineState};
use kube::ResourceExt;

use crate::controller::Index;

/// What the index knows of one Machine.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Entry {
    free: bool,
    /// (claim namespace, claim name) it is bound to.
    claim: Option<(String, String)>,
}

/// A set of names with O(1) insertion, removal and access by position
/// (a removal moves the last name into the hole), so a claim can start its
/// walk at a position of its own without walking up to it.
#[derive(Debug, Default)]
pub struct FreeSet {
    names: Vec<String>,
    at: HashMap<String, usize>,
}

impl FreeSet {
    fn insert(&mut self, name: String) {
        if !self.at.contains_key(&name) {
            self.at.insert(name.clone(), self.names.len());
            self.names.push(name);
        }
    }

    fn remove(&mut self, name: &str) {
        let Some(i) = self.at.remove(name) else {
            return;
        };
        self.names.swap_remove(i);
        if let Some(moved) = self.names.get(i) {
            self.at.insert(moved.clone(), i);
        }
    }

    /// How many names.
    pub fn len(&self) -> usize {
        self.names.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.names.is_empty()
    }

    /// Every name once, from position `start` (taken modulo the length)
    /// round to the one before it.
    pub fn iter_from(&self, start: usize) -> impl Iterator<Item = &String> {
        let start = if self.names.is_empty() {
            0
        } else {
            start % self.names.len()
        };
        self.names[start..].iter().chain(self.names[..start].iter())
    }
}

/// Machines by freedom and by claim.
#[derive(Debug, Default)]
pub struct MachineIndex {
    /// Namespace → names of machines a selector may take (Available, not
    /// bound, not cordoned, not being deleted).
    free: HashMap<String, FreeSet>,
    /// (claim namespace, claim name) → machine name (same namespace).
    by_claim: HashMap<(String, String), String>,
    entries: HashMap<(String, String), Entry>,
}

/// Whether a selector may consider `m` at all (the per-claim checks —
/// labels, taints, hardware — come after).
pub fn is_free(m: &Machine) -> bool {
    m.metadata.deletion_timestamp.is_none()
        && m.spec.claim_ref.is_none()
        && !m.spec.unclaimable
        && m.status.as_ref().and_then(|s| s.state) == Some(MachineState::Available)
}

impl MachineIndex {
    fn forget(&mut self, key: &(String, String)) {
        let Some(old) = self.entries.remove(key) else {
            return;
        };
        if old.free
            && let Some(set) = self.free.get_mut(&key.0)
        {
            set.remove(&key.1);
            if set.is_empty() {
                self.free.remove(&key.0);
            }
        }
        if let Some(c) = old.claim
            && self.by_claim.get(&c) == Some(&key.1)
        {
            self.by_claim.remove(&c);
        }
    }

    /// The free machines of `ns`.
    pub fn free(&self, ns: &str) -> Option<&FreeSet> {
        self.free.get(ns)
    }

    /// The machine the claim `ns/name` is bound to, per the cache.
    pub fn bound_to(&self, ns: &str, name: &str) -> Option<&String> {
        self.by_claim.get(&(ns.to_string(), name.to_string()))
    }
}

impl Index<Machine> for MachineIndex {
    fn upsert(&mut self, m: &Machine) {
        let ns = m.namespace().unwrap_or_default();
        let key = (ns.clone(), m.name_any());
        self.forget(&key);
        let entry = Entry {
            free: is_free(m),
            // A claim binds machines of its own namespace only.
            claim: m
                .spec
                .claim_ref
                .as_ref()
                .filter(|r| r.namespace_or(&ns) == ns)
                .map(|r| (ns.clone(), r.name.clone())),
        };
        if entry.free {
            self.free
                .entry(ns.clone())
                .or_default()
                .insert(key.1.clone());
        }
        if let Some(c) = &entry.claim {
            self.by_claim.insert(c.clone(), key.1.clone());
        }
        self.entries.insert(key, entry);
    }

    fn remove(&mut self, m: &Machine) {
        let key = (m.namespace().unwrap_or_default(), m.name_any());
        self.forget(&key);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use anneal_api::conditions::reasons;
    use serde_json::json;

    fn machine(name: &str, state: &str, claim: Option<&str>) -> Machine {
        let mut spec = json!({"subnetRef": {"name": "s"}});
        if let Some(c) = claim {
            spec["claimRef"] = json!({"name": c});
        }
        serde_json::from_value(json!({
            "apiVersion": "anneal.dev/v1alpha1", "kind": "Machine",
            "metadata": {"name": name, "namespace": "ns"},
            "spec": spec, "status": {"state": state}
        }))
        .unwrap()
    }

    #[test]
    fn free_set_and_claim_map_follow_updates() {
        let mut i = MachineIndex::default();
        i.upsert(&machine("a", "Available", None));
        i.upsert(&machine("b", "Available", None));
        i.upsert(&machine("c", "Inspecting", None));
        let free: Vec<_> = i.free("ns").unwrap().iter_from(0).cloned().collect();
        assert_eq!(free, ["a", "b"]);
        let free: Vec<_> = i.free("ns").unwrap().iter_from(3).cloned().collect();
        assert_eq!(free, ["b", "a"]);
        i.upsert(&machine("a", "Available", Some("c1")));
        let free: Vec<_> = i.free("ns").unwrap().iter_from(0).cloned().collect();
        assert_eq!(free, ["b"]);
        assert_eq!(i.bound_to("ns", "c1").map(String::as_str), Some("a"));
        i.upsert(&machine("a", reasons::RELEASED, None));
        assert_eq!(i.bound_to("ns", "c1"), None);
        i.remove(&machine("b", "Available", None));
        assert!(i.free("ns").is_none());
    }
}
