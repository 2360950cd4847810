//! Admission rules CEL cannot express, reported as condition `Valid` with a
//! reason: address arithmetic of Subnets, cross-object checks of Sites and
//! Images, the tenancy rules of Machines (the Subnet grants the Machine's
//! namespace; one boot MAC per Subnet across namespaces). This controller
//! writes only the `Valid` condition (and `observedGeneration` when
//! absent), under the object's resourceVersion, so it composes with the
//! controllers that own the other conditions.
//!
//! Machines are judged only when what the verdict reads changes (subnetRef,
//! boot MAC, the Machines sharing that MAC, the Subnet's grants), and their
//! `Valid` is rewritten only when the verdict changes
//! ([`machine_valid_update`]): a bind, which writes `spec.claimRef` and so
//! moves `metadata.generation`, costs no Machine status write.

use anneal_api::conditions::reasons;
use std::collections::{BTreeSet, HashMap, HashSet};
use std::net::Ipv4Addr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anneal_api::{Image, Machine, PartitionContent, PostHook, Site, Subnet, SubnetSpec};
use futures::StreamExt;
use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use kube::api::{Api, Patch};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::{Event, EventType, Recorder};
use kube::runtime::reflector::ObjectRef;
use kube::runtime::reflector::Store;
use kube::runtime::watcher;
use kube::{Client, Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::json;

use crate::conditions;
use crate::controller::{Identity, ReconcileError, Scope, drive, is_conflict, patch_params};

/// Errors of one validity reconcile.
#[derive(Debug, thiserror::Error)]
pub enum ValidityError {
    /// An API call failed.
    #[error("api call failed: {0}")]
    Kube(#[from] kube::Error),
    /// The object has no namespace.
    #[error("object has no namespace")]
    NoNamespace,
}

/// A failed rule: (reason, message naming the field).
pub type Problem = (&'static str, String);

pub(crate) fn parse_cidr(cidr: &str) -> Option<(u32, u32)> {
    let (addr, len) = cidr.split_once('/')?;
    let addr: Ipv4Addr = addr.parse().ok()?;
    let len: u32 = len.parse().ok()?;
    if len > 32 {
        return None;
    }
    let mask = if len == 0 { 0 } else { u32::MAX << (32 - len) };
    Some((u32::from(addr) & mask, mask))
}

fn in_cidr(ip: u32, (net, mask): (u32, u32)) -> bool {
    ip & mask == net
}

fn ip(s: &str) -> Option<u32> {
    s.parse::<Ipv4Addr>().ok().map(u32::from)
}

/// Address rules of a Subnet that need arithmetic CEL lacks.
pub fn subnet_problem(spec: &SubnetSpec) -> Option<Problem> {
    subnet_ipv4_problem(spec).or_else(|| subnet_ipv6_problem(spec))
}

/// `(network, prefix length)` of an IPv6 CIDR.
pub(crate) fn parse_cidr6(cidr: &str) -> Option<(u128, u32)> {
    let (addr, len) = cidr.split_once('/')?;
    let addr: std::net::Ipv6Addr = addr.parse().ok()?;
    let len: u32 = len.parse().ok().filter(|l| *l <= 128)?;
    let mask = if len == 0 {
        0
    } else {
        u128::MAX << (128 - len)
    };
    Some((u128::from(addr) & mask, len))
}

fn ip6(s: &str) -> Option<u128> {
    s.parse::<std::net::Ipv6Addr>().ok().map(u128::from)
}

/// The rules of `spec.ipv6` (CEL checks the formats, the prefix length and
/// that the addresses lie inside the prefix; these repeat the latter and
/// add the ordering ones).
fn subnet_ipv6_problem(spec: &SubnetSpec) -> Option<Problem> {
    let v6 = spec.ipv6.as_ref()?;
    let (net, len) = parse_cidr6(&v6.prefix)?;
    let mask = if len == 0 {
        0
    } else {
        u128::MAX << (128 - len)
    };
    let inside = |a: u128| a & mask == net;
    let server = ip6(&v6.server_address);
    if server.is_some_and(|s| !inside(s)) {
        return Some((
            reasons::IPV6_SERVER_OUTSIDE_PREFIX,
            "spec.ipv6.serverAddress must lie inside spec.ipv6.prefix".into(),
        ));
    }
    let range = v6.lease_range.as_ref()?;
    let (start, end) = (ip6(&range.start)?, ip6(&range.end)?);
    if start > end {
        return Some((
            reasons::LEASE_RANGE_INVERTED,
            "spec.ipv6.leaseRange.start must not be after spec.ipv6.leaseRange.end".into(),
        ));
    }
    if !inside(start) || !inside(end) {
        return Some((
            reasons::LEASE_RANGE_OUTSIDE_CIDR,
            "spec.ipv6.leaseRange must lie inside spec.ipv6.prefix".into(),
        ));
    }
    if server.is_some_and(|s| (start..=end).contains(&s)) {
        return Some((
            reasons::SERVER_IP_IN_LEASE_RANGE,
            "spec.ipv6.serverAddress must lie outside spec.ipv6.leaseRange".into(),
        ));
    }
    None
}

fn subnet_ipv4_problem(spec: &SubnetSpec) -> Option<Problem> {
    let cidr = parse_cidr(&spec.cidr)?;
    let dhcp = spec.dhcp.as_ref()?;
    let server = spec.bootd.as_ref().and_then(|b| ip(&b.server_ip));
    let gateway = dhcp
        .gateway
        .as_deref()
        .filter(|g| !g.is_empty())
        .and_then(ip);
    if let Some(g) = gateway
        && !in_cidr(g, cidr)
    {
        return Some((
            reasons::GATEWAY_OUTSIDE_CIDR,
            "spec.dhcp.gateway must lie inside spec.cidr".into(),
        ));
    }
    if let Some(range) = &dhcp.lease_range {
        let (Some(start), Some(end)) = (ip(&range.start), ip(&range.end)) else {
            return None;
        };
        if start > end {
            return Some((
                reasons::LEASE_RANGE_INVERTED,
                "spec.dhcp.leaseRange.start must not be after spec.dhcp.leaseRange.end".into(),
            ));
        }
        if !in_cidr(start, cidr) || !in_cidr(end, cidr) {
            return Some((
                reasons::LEASE_RANGE_OUTSIDE_CIDR,
                "spec.dhcp.leaseRange must lie inside spec.cidr".into(),
            ));
        }
        let (net, mask) = cidr;
        let broadcast = net | !mask;
        if mask != u32::MAX && mask != u32::MAX - 1 && (start == net || end == broadcast) {
            return Some((
                reasons::LEASE_RANGE_INCLUDES_NETWORK_OR_BROADCAST,
                "spec.dhcp.leaseRange must exclude the network and broadcast addresses of spec.cidr".into(),
            ));
        }
        if let Some(s) = server
            && (start..=end).contains(&s)
        {
            return Some((
                reasons::SERVER_IP_IN_LEASE_RANGE,
                "spec.bootd.serverIP must lie outside spec.dhcp.leaseRange".into(),
            ));
        }
        if let Some(g) = gateway
            && (start..=end).contains(&g)
        {
            return Some((
                reasons::GATEWAY_IN_LEASE_RANGE,
                "spec.dhcp.gateway must lie outside spec.dhcp.leaseRange".into(),
            ));
        }
    }
    None
}

async fn site_problem(site: &Site, client: &Client) -> Result<Option<Problem>, kube::Error> {
    let ns = site.namespace().unwrap_or_default();
    let Some(r) = &site.spec.seeder_subnet_ref else {
        return Ok(None);
    };
    let api: Api<Subnet> = Api::namespaced(client.clone(), r.namespace_or(&ns));
    let Some(subnet) = api.get_opt(&r.name).await? else {
        return Ok(Some((
            reasons::SEEDER_SUBNET_NOT_FOUND,
            format!("spec.seederSubnetRef: Subnet {} does not exist", r.name),
        )));
    };
    let subnet_ns = subnet.namespace().unwrap_or_default();
    let site_ref = &subnet.spec.site_ref;
    if site_ref.name != site.name_any() || site_ref.namespace_or(&subnet_ns) != ns {
        return Ok(Some((
            reasons::SEEDER_SUBNET_IN_OTHER_SITE,
            format!(
                "spec.seederSubnetRef: Subnet {} belongs to Site {}",
                r.name, site_ref.name
            ),
        )));
    }
    if subnet.spec.seeder_network_ref.is_none() {
        return Ok(Some((
            reasons::SEEDER_SUBNET_HAS_NO_DATA_HALF,
            format!(
                "spec.seederSubnetRef: Subnet {} has no spec.seederNetworkRef",
                r.name
            ),
        )));
    }
    if let (Some(tip), Some(cidr)) = (
        site.spec
            .tracker
            .as_ref()
            .and_then(|t| t.ip.as_deref())
            .and_then(ip),
        parse_cidr(&subnet.spec.cidr),
    ) && !in_cidr(tip, cidr)
    {
        return Ok(Some((
            reasons::TRACKER_IP_OUTSIDE_SUBNET,
            format!(
                "spec.tracker.ip must lie inside the seeder Subnet's cidr {}",
                subnet.spec.cidr
            ),
        )));
    }
    Ok(None)
}

async fn image_problem(image: &Image, client: &Client) -> Result<Option<Problem>, kube::Error> {
    let ns = image.namespace().unwrap_or_default();
    let api: Api<PartitionContent> = Api::namespaced(client.clone(), &ns);
    for (i, slot) in image.spec.layout.slots.iter().enumerate() {
        let Some(r) = &slot.content_ref else { continue };
        if r.namespace
            .as_deref()
            .is_some_and(|n| !n.is_empty() && n != ns)
        {
            return Ok(Some((
                reasons::CONTENT_NAMESPACE_MISMATCH,
                format!(
                    "spec.layout.slots[{i}].contentRef.namespace must equal the Image's namespace {ns}"
                ),
            )));
        }
        let Some(content) = api.get_opt(&r.name).await? else {
            return Ok(Some((
                reasons::CONTENT_NOT_FOUND,
                format!(
                    "spec.layout.slots[{i}].contentRef: PartitionContent {} does not exist",
                    r.name
                ),
            )));
        };
        if let Some(size) = slot.size_bytes
            && content.spec.last_extent_end > size
        {
            return Ok(Some((
                reasons::CONTENT_DOES_NOT_FIT,
                format!(
                    "spec.layout.slots[{i}].sizeBytes {size} is smaller than PartitionContent {} lastExtentEnd {}",
                    r.name, content.spec.last_extent_end
                ),
            )));
        }
    }
    Ok(None)
}

/// The tenancy rules of a Machine on its Subnet (None: no Subnet to check
/// against): the Subnet grants the Machine's namespace
/// (`spec.allowedNamespaces`), and no Machine enrolled the same boot MAC on
/// it first (from any namespace). `machines`: every Machine the manager
/// sees.
pub fn machine_problem<'a>(
    m: &Machine,
    subnet: Option<&Subnet>,
    machines: impl IntoIterator<Item = &'a Machine>,
) -> Option<Problem> {
    let subnet = subnet?;
    let ns = m.namespace().unwrap_or_default();
    let skey = format!(
        "{}/{}",
        subnet.namespace().unwrap_or_default(),
        subnet.name_any()
    );
    if !subnet.grants(&ns) {
        return Some((
            reasons::SUBNET_NOT_GRANTED,
            format!(
                "spec.subnetRef: Subnet {skey} does not list namespace {ns} in spec.allowedNamespaces; ask the Subnet's owner to add {ns} there, or name a Subnet of namespace {ns}"
            ),
        ));
    }
    let mac = m
        .spec
        .boot_mac_address
        .as_deref()
        .and_then(|s| s.parse::<anneal_api::Mac>().ok())?;
    let holders = anneal_api::tenancy::boot_mac_holders(subnet, machines);
    let holder = holders.get(&mac)?;
    let me = anneal_api::tenancy::machine_key(m);
    let other = anneal_api::tenancy::machine_key(holder);
    if other == me {
        return None;
    }
    Some((
        reasons::DUPLICATE_BOOT_MAC,
        format!(
            "spec.bootMACAddress {mac} is already enrolled on Subnet {skey} by Machine {other}: this Machine gets no DHCP reservation and no answer from bootd; correct the MAC, or delete Machine {other} if it is the stale one"
        ),
    ))
}

async fn posthook_problem(
    hook: &PostHook,
    client: &Client,
) -> Result<Option<Problem>, kube::Error> {
    let ns = hook.namespace().unwrap_or_default();
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), &ns);
    let secrets: Api<Secret> = Api::namespaced(client.clone(), &ns);
    for (i, step) in hook.spec.steps.iter().enumerate() {
        let Some(script) = &step.script else { continue };
        if let Some(r) = &script.config_map_ref {
            let found = cms.get_opt(&r.name).await?;
            let has_key = found.as_ref().is_some_and(|c| {
                c.data.as_ref().is_some_and(|d| d.contains_key(&r.key))
                    || c.binary_data
                        .as_ref()
                        .is_some_and(|d| d.contains_key(&r.key))
            });
            if !has_key {
                return Ok(Some((
                    reasons::SCRIPT_SOURCE_NOT_FOUND,
                    format!(
                        "spec.steps[{i}].script.configMapRef: ConfigMap {} has no key {}",
                        r.name, r.key
                    ),
                )));
            }
        }
        if let Some(r) = &script.secret_ref {
            let found = secrets.get_opt(&r.name).await?;
            let has_key = found
                .as_ref()
                .is_some_and(|s| s.data.as_ref().is_some_and(|d| d.contains_key(&r.key)));
            if !has_key {
                return Ok(Some((
                    reasons::SCRIPT_SOURCE_NOT_FOUND,
                    format!(
                        "spec.steps[{i}].script.secretRef: Secret {} has no key {}",
                        r.name, r.key
                    ),
                )));
            }
        }
        let names = |t: &str| -> Vec<String> {
            let mut out = Vec::new();
            let mut rest = t;
            while let Some(start) = rest.find("{{") {
                let after = &rest[start + 2..];
                let Some(end) = after.find("}}") else { break };
                out.push(after[..end].trim().trim_start_matches('.').to_string());
                rest = &after[end + 2..];
            }
            out
        };
        if let Some(text) = &script.inline {
            for name in names(text) {
                let reserved = ["machineName", "imageName", "targetDisk"].contains(&name.as_str());
                if !reserved && !hook.spec.params.contains_key(&name) {
                    return Ok(Some((
                        reasons::UNDECLARED_PARAM,
                        format!(
                            "spec.steps[{i}].script.inline uses {{{{{name}}}}}, which spec.params does not declare"
                        ),
                    )));
                }
            }
        }
    }
    Ok(None)
}

/// Writes `Valid` into the object's status conditions (read-modify-write
/// under resourceVersion). Returns false on a conflict.
async fn write_valid<K>(
    obj: &K,
    problem: Option<Problem>,
    client: &Client,
) -> Result<bool, kube::Error>
where
    K: Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>
        + Clone
        + DeserializeOwned
        + Serialize
        + std::fmt::Debug,
{
    write_valid_with(obj, problem, serde_json::Map::new(), client).await
}

/// The verdict as a condition: (status, reason, message).
fn verdict(problem: Option<&Problem>) -> (bool, &'static str, String) {
    match problem {
        None => (true, "Valid", "spec is valid".to_string()),
        Some((r, m)) => (false, r, m.clone()),
    }
}

/// [`write_valid`] plus extra top-level status fields owned by this
/// controller.
async fn write_valid_with<K>(
    obj: &K,
    problem: Option<Problem>,
    extra: serde_json::Map<String, serde_json::Value>,
    client: &Client,
) -> Result<bool, kube::Error>
where
    K: Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>
        + Clone
        + DeserializeOwned
        + Serialize
        + std::fmt::Debug,
{
    let value = serde_json::to_value(obj).unwrap_or_default();
    let mut conds: Vec<anneal_api::Condition> =
        serde_json::from_value(value["status"]["conditions"].clone()).unwrap_or_default();
    let generation = obj.meta().generation;
    let (ok, reason, message) = verdict(problem.as_ref());
    let changed = conditions::set(&mut conds, "Valid", ok, reason, message, generation);
    let extra_changed = extra.iter().any(|(k, v)| &value["status"][k] != v);
    if !changed && !extra_changed {
        return Ok(true);
    }
    patch_conditions(obj, &conds, extra, client).await
}

/// Writes `conds` (and `extra`) into the object's status under its
/// resourceVersion. Returns false on a conflict or when it is gone.
async fn patch_conditions<K>(
    obj: &K,
    conds: &[anneal_api::Condition],
    mut status: serde_json::Map<String, serde_json::Value>,
    client: &Client,
) -> Result<bool, kube::Error>
where
    K: Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>
        + Clone
        + DeserializeOwned
        + std::fmt::Debug,
{
    let ns = obj.meta().namespace.clone().unwrap_or_default();
    let api: Api<K> = Api::namespaced(client.clone(), &ns);
    status.insert(
        "conditions".into(),
        serde_json::to_value(conds).unwrap_or_default(),
    );
    let patch = json!({
        "metadata": {"resourceVersion": obj.meta().resource_version},
        "status": status,
    });
    match api
        .patch_status(
            &obj.meta().name.clone().unwrap_or_default(),
            &patch_params(FIELD_MANAGER),
            &Patch::Merge(&patch),
        )
        .await
    {
        Ok(_) => Ok(true),
        Err(kube::Error::Api(s)) if s.code == 409 || s.code == 404 => Ok(false),
        Err(e) => Err(e),
    }
}

/// A Machine's conditions with the verdict `problem` written in, or None
/// when the Machine already carries that verdict (same status, reason and
/// message): no write. Unlike the other kinds, a Machine's `Valid` does not
/// follow `metadata.generation` alone: its spec is also written by
/// controllers (the claim controller's `claimRef` on every bind, readiness
/// taints), none of which can change the verdict, and a status write per
/// bind made every bind two Machine writes that raced the claim
/// controller's next bind. Its `observedGeneration` is the generation at
/// which the verdict last changed.
pub fn machine_valid_update(
    conds: &[anneal_api::Condition],
    problem: Option<&Problem>,
    generation: Option<i64>,
) -> Option<Vec<anneal_api::Condition>> {
    let (ok, reason, message) = verdict(problem);
    let status = if ok { "True" } else { "False" };
    let carried = conds.iter().find(|c| c.type_ == "Valid");
    if carried.is_some_and(|c| c.status == status && c.reason == reason && c.message == message) {
        return None;
    }
    let mut conds = conds.to_vec();
    conditions::set(&mut conds, "Valid", ok, reason, message, generation).then_some(conds)
}

/// What the Machine verdict ([`machine_problem`]) reads of a Machine, and
/// the verdict the Machine carries. A watch event that leaves both as they
/// were (a bind writing `spec.claimRef`, a taint, a lifecycle status write)
/// cannot change any verdict, so it wakes no reconcile.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VerdictInputs {
    /// `spec.subnetRef` as (namespace, name).
    subnet: (String, String),
    /// `spec.bootMACAddress`, when it parses.
    mac: Option<anneal_api::Mac>,
    /// The `Valid` condition carried: (status, reason, message).
    carried: Option<(String, String, String)>,
}

impl VerdictInputs {
    /// The inputs of `m`.
    pub fn of(m: &Machine) -> Self {
        let own = m.namespace().unwrap_or_default();
        Self {
            subnet: (
                m.spec.subnet_ref.namespace_or(&own).to_string(),
                m.spec.subnet_ref.name.clone(),
            ),
            mac: m
                .spec
                .boot_mac_address
                .as_deref()
                .and_then(|s| s.parse().ok()),
            carried: m
                .status
                .as_ref()
                .and_then(|s| s.conditions.iter().find(|c| c.type_ == "Valid"))
                .map(|c| (c.status.clone(), c.reason.clone(), c.message.clone())),
        }
    }
}

type MachineKey = (String, String);

fn machine_key(m: &Machine) -> MachineKey {
    (m.namespace().unwrap_or_default(), m.name_any())
}

/// The validity controller's index of Machines: each one's
/// [`VerdictInputs`] and the Machines per boot MAC, kept by the Machine
/// watch, so an event costs the Machines sharing its MAC, not a scan of
/// every Machine.
#[derive(Debug, Default)]
pub struct MachineIndex {
    inputs: HashMap<MachineKey, VerdictInputs>,
    by_mac: HashMap<anneal_api::Mac, BTreeSet<MachineKey>>,
    /// During a re-list: the Machines listed so far.
    relisting: Option<HashSet<MachineKey>>,
}

impl MachineIndex {
    fn insert(&mut self, key: MachineKey, inputs: VerdictInputs) -> Option<VerdictInputs> {
        let old = self.remove(&key);
        if let Some(mac) = inputs.mac {
            self.by_mac.entry(mac).or_default().insert(key.clone());
        }
        self.inputs.insert(key, inputs);
        old
    }

    fn remove(&mut self, key: &MachineKey) -> Option<VerdictInputs> {
        let old = self.inputs.remove(key)?;
        if let Some(mac) = old.mac
            && let Some(set) = self.by_mac.get_mut(&mac)
        {
            set.remove(key);
            if set.is_empty() {
                self.by_mac.remove(&mac);
            }
        }
        Some(old)
    }

    /// The Machines (any namespace) whose boot MAC is `mac`.
    pub fn with_mac(&self, mac: anneal_api::Mac) -> impl Iterator<Item = &MachineKey> {
        self.by_mac.get(&mac).into_iter().flatten()
    }

    /// Applies one watch event and returns the Machines whose verdict it
    /// may have changed: the Machine itself when its [`VerdictInputs`]
    /// changed (every Machine of a list), and the Machines sharing its old
    /// or new boot MAC (the holder of a MAC is the oldest Machine naming
    /// it, so one coming, going or changing MAC can change theirs).
    pub fn to_judge<M: std::borrow::Borrow<Machine>>(
        &mut self,
        event: &watcher::Event<M>,
    ) -> Vec<MachineKey> {
        let mut out = Vec::new();
        let event = match event {
            watcher::Event::Init => watcher::Event::Init,
            watcher::Event::InitApply(m) => watcher::Event::InitApply(m.borrow()),
            watcher::Event::InitDone => watcher::Event::InitDone,
            watcher::Event::Apply(m) => watcher::Event::Apply(m.borrow()),
            watcher::Event::Delete(m) => watcher::Event::Delete(m.borrow()),
        };
        match event {
            watcher::Event::Init => self.relisting = Some(HashSet::new()),
            watcher::Event::InitApply(m) => {
                let key = machine_key(m);
                if let Some(seen) = self.relisting.as_mut() {
                    seen.insert(key.clone());
                }
                self.insert(key.clone(), VerdictInputs::of(m));
                out.push(key);
            }
            watcher::Event::InitDone => {
                // Machines gone while the watch was down: every listed
                // Machine is judged anyway, so dropping them is enough.
                if let Some(seen) = self.relisting.take() {
                    let gone: Vec<MachineKey> = self
                        .inputs
                        .keys()
                        .filter(|k| !seen.contains(*k))
                        .cloned()
                        .collect();
                    for k in gone {
                        self.remove(&k);
                    }
                }
            }
            watcher::Event::Apply(m) => {
                let key = machine_key(m);
                let new = VerdictInputs::of(m);
                let old = self.insert(key.clone(), new.clone());
                if old.as_ref() == Some(&new) {
                    return out;
                }
                let macs = [new.mac, old.and_then(|o| o.mac)];
                out.push(key.clone());
                for mac in macs.into_iter().flatten() {
                    out.extend(self.with_mac(mac).filter(|k| **k != key).cloned());
                }
            }
            watcher::Event::Delete(m) => {
                let key = machine_key(m);
                if let Some(mac) = self.remove(&key).and_then(|o| o.mac) {
                    out.extend(self.with_mac(mac).cloned());
                }
            }
        }
        out.sort();
        out.dedup();
        out
    }
}

struct Ctx {
    client: Client,
}

struct MachineCtx {
    client: Client,
    recorder: Recorder,
    machines: Store<Machine>,
    subnets: Store<Subnet>,
    index: Arc<Mutex<MachineIndex>>,
}

async fn reconcile_machine(m: Arc<Machine>, ctx: Arc<MachineCtx>) -> Result<Action, ValidityError> {
    // A verdict from a partial cache could name the wrong holder: wait for
    // both first lists (not awaited here, like the reservations
    // controller).
    for ready in [
        futures::FutureExt::now_or_never(ctx.machines.wait_until_ready()),
        futures::FutureExt::now_or_never(ctx.subnets.wait_until_ready()),
    ] {
        if !matches!(ready, Some(Ok(()))) {
            return Ok(Action::requeue(Duration::from_millis(200)));
        }
    }
    let ns = m.namespace().ok_or(ValidityError::NoNamespace)?;
    let r = &m.spec.subnet_ref;
    let subnet = ctx
        .subnets
        .get(&ObjectRef::new(&r.name).within(r.namespace_or(&ns)));
    // Only the Machines sharing its boot MAC can hold it before this one.
    let me = machine_key(&m);
    let peers: Vec<Arc<Machine>> = match VerdictInputs::of(&m).mac {
        Some(mac) => {
            let keys: Vec<MachineKey> = ctx
                .index
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .with_mac(mac)
                .filter(|k| **k != me)
                .cloned()
                .collect();
            keys.iter()
                .filter_map(|(ns, name)| ctx.machines.get(&ObjectRef::new(name).within(ns)))
                .collect()
        }
        None => Vec::new(),
    };
    let problem = machine_problem(
        &m,
        subnet.as_deref(),
        peers
            .iter()
            .map(AsRef::as_ref)
            .chain(std::iter::once(m.as_ref())),
    );
    let was = m
        .status
        .as_ref()
        .and_then(|s| s.conditions.iter().find(|c| c.type_ == "Valid"))
        .map(|c| (c.status.clone(), c.reason.clone()));
    let warn = problem
        .as_ref()
        .filter(|(reason, _)| was != Some(("False".into(), (*reason).to_string())))
        .cloned();
    let carried = m
        .status
        .as_ref()
        .map(|s| s.conditions.as_slice())
        .unwrap_or_default();
    let written = match machine_valid_update(carried, problem.as_ref(), m.metadata.generation) {
        None => true,
        Some(conds) => {
            patch_conditions(m.as_ref(), &conds, serde_json::Map::new(), &ctx.client).await?
        }
    };
    if written && let Some((reason, note)) = warn {
        let ev = Event {
            type_: EventType::Warning,
            reason: reason.into(),
            note: Some(note),
            action: "Validate".into(),
            secondary: subnet.map(|s| s.object_ref(&())),
        };
        if let Err(e) = ctx.recorder.publish(&ev, &m.object_ref(&())).await {
            tracing::warn!(error = %e, "cannot publish event");
        }
    }
    Ok(done(written, Duration::from_secs(300)))
}

fn done(written: bool, period: Duration) -> Action {
    if written {
        Action::requeue(period)
    } else {
        Action::requeue(Duration::from_millis(200))
    }
}

/// Machine verdicts judged at once: the first list judges every Machine,
/// and an unbounded burst of status writes opens one API connection each.
const MACHINE_CONCURRENCY: u16 = 16;

/// Field manager of the validity controllers' writes.
pub const FIELD_MANAGER: &str = "anneal-validity";

const fn id(name: &'static str, kind: &'static str) -> Identity {
    Identity {
        name,
        kind,
        field_manager: FIELD_MANAGER,
    }
}

impl ReconcileError for ValidityError {
    fn is_conflict(&self) -> bool {
        matches!(self, Self::Kube(e) if is_conflict(e))
    }

    fn kind(&self) -> &'static str {
        match self {
            Self::Kube(_) => "api",
            Self::NoNamespace => "no_namespace",
        }
    }
}

/// Runs the Subnet, Site, Image, PostHook and Machine validity controllers
/// in `scope` until it is cancelled. The Machine feed is taken when this is
/// called ([`Scope::machines`]).
pub fn controller(scope: Scope) -> impl std::future::Future<Output = ()> + Send + 'static {
    let machines = scope.machines();
    run_controllers(scope, machines)
}

async fn run_controllers(scope: Scope, machines: crate::controller::Feed<Machine>) {
    let ctx = Arc::new(Ctx {
        client: scope.client.clone(),
    });

    let (subnet_store, subnet_stream) = scope.reflected::<Subnet>();
    // One Machine watch: each event wakes the Machines whose verdict it may
    // change ([`MachineIndex::to_judge`]), read from the store the event
    // was just applied to (a second watch could deliver a holder's deletion
    // before the store knew it, leaving the next Machine's verdict stale).
    // A bind (`spec.claimRef`) wakes nothing.
    let machine_store = machines.store;
    let index: Arc<Mutex<MachineIndex>> = Arc::default();
    let feed = index.clone();
    let lookup = machine_store.clone();
    let machine_stream = machines.events.flat_map(move |ev| {
        let keys = feed.lock().unwrap_or_else(|p| p.into_inner()).to_judge(&ev);
        // The event's own Machine from the event (during a list the store
        // shows it only at the end), the others from the store.
        let own = match &ev {
            watcher::Event::Apply(m) | watcher::Event::InitApply(m) => Some(m),
            _ => None,
        };
        let machines: Vec<Arc<Machine>> = keys
            .iter()
            .filter_map(|k| match own {
                Some(m) if machine_key(m) == *k => Some(m.clone()),
                _ => lookup.get(&ObjectRef::new(&k.1).within(&k.0)),
            })
            .collect();
        futures::stream::iter(machines)
    });
    let by_subnet = machine_store.clone();
    let machine_ctl = Controller::for_shared_stream(machine_stream, machine_store.clone())
        .with_config(kube::runtime::controller::Config::default().concurrency(MACHINE_CONCURRENCY));
    let machine_ctx = Arc::new(MachineCtx {
        client: scope.client.clone(),
        recorder: scope.recorder.clone(),
        machines: machine_store,
        subnets: subnet_store,
        index,
    });
    let machines = drive(
        id("validity-machine", "Machine"),
        &scope,
        machine_ctl
            // a Subnet's grants change: its Machines' verdicts
            .watches_stream(subnet_stream, move |s: Subnet| {
                by_subnet
                    .state()
                    .iter()
                    .filter(|m| anneal_api::tenancy::targets(m, &s))
                    .map(|m| ObjectRef::from_obj(m.as_ref()))
                    .collect::<Vec<_>>()
            }),
        reconcile_machine,
        machine_ctx,
    );

    let subnets = drive(
        id("validity-subnet", "Subnet"),
        &scope,
        Controller::new(scope.api::<Subnet>(), watcher::Config::default()),
        |s: Arc<Subnet>, ctx: Arc<Ctx>| async move {
            let written = write_valid(s.as_ref(), subnet_problem(&s.spec), &ctx.client).await?;
            Ok::<_, ValidityError>(done(written, Duration::from_secs(600)))
        },
        ctx.clone(),
    );

    let sites = drive(
        id("validity-site", "Site"),
        &scope,
        Controller::new(scope.api::<Site>(), watcher::Config::default()).watches(
            scope.api::<Subnet>(),
            watcher::Config::default(),
            |s: Subnet| {
                let ns = s.namespace().unwrap_or_default();
                Some(
                    ObjectRef::new(&s.spec.site_ref.name).within(s.spec.site_ref.namespace_or(&ns)),
                )
            },
        ),
        |s: Arc<Site>, ctx: Arc<Ctx>| async move {
            if s.namespace().is_none() {
                return Err(ValidityError::NoNamespace);
            }
            let problem = site_problem(&s, &ctx.client).await?;
            let written = write_valid(s.as_ref(), problem, &ctx.client).await?;
            Ok(done(written, Duration::from_secs(300)))
        },
        ctx.clone(),
    );

    let images = drive(
        id("validity-image", "Image"),
        &scope,
        Controller::new(scope.api::<Image>(), watcher::Config::default()),
        |i: Arc<Image>, ctx: Arc<Ctx>| async move {
            let problem = image_problem(&i, &ctx.client).await?;
            let written = write_valid(i.as_ref(), problem, &ctx.client).await?;
            // Contents may appear later: look again.
            Ok::<_, ValidityError>(done(written, Duration::from_secs(60)))
        },
        ctx.clone(),
    );

    let hooks = drive(
        id("validity-posthook", "PostHook"),
        &scope,
        Controller::new(scope.api::<PostHook>(), watcher::Config::default()),
        |h: Arc<PostHook>, ctx: Arc<Ctx>| async move {
            let problem = posthook_problem(&h, &ctx.client).await?;
            let mut extra = serde_json::Map::new();
            extra.insert("stepCount".into(), json!(h.spec.steps.len()));
            extra.insert("observedGeneration".into(), json!(h.metadata.generation));
            let written = write_valid_with(h.as_ref(), problem, extra, &ctx.client).await?;
            // ConfigMaps and Secrets may appear later: look again.
            Ok::<_, ValidityError>(done(written, Duration::from_secs(60)))
        },
        ctx.clone(),
    );
    futures::join!(subnets, sites, images, hooks, machines);
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn subnet(patch: serde_json::Value) -> SubnetSpec {
        let mut base = json!({
            "siteRef": {"name": "s"}, "cidr": "10.77.0.0/24",
            "bootd": {"serverIP": "10.77.0.2", "mode": "External"},
            "dhcp": {"mode": "lease", "gateway": "10.77.0.1", "leaseRange": {"start": "10.77.0.100", "end": "10.77.0.200"}}
        });
        for (k, v) in patch.as_object().unwrap() {
            for (k2, v2) in v.as_object().unwrap() {
                base[k][k2] = v2.clone();
            }
        }
        serde_json::from_value(base).unwrap()
    }

    fn machine(name: &str, mac: &str, patch: serde_json::Value) -> Machine {
        let mut m = json!({
            "apiVersion": "anneal.dev/v1alpha1", "kind": "Machine",
            "metadata": {"name": name, "namespace": "default", "generation": 1,
                         "resourceVersion": "10", "uid": format!("uid-{name}")},
            "spec": {"subnetRef": {"name": "lab"}, "bootMACAddress": mac},
            "status": {"state": "Available", "conditions": [{
                "type": "Valid", "status": "True", "reason": "Valid",
                "message": "spec is valid", "observedGeneration": 1,
                "lastTransitionTime": "2026-12-01T00:00:00Z"}]}
        });
        for (k, v) in patch.as_object().unwrap() {
            for (k2, v2) in v.as_object().unwrap() {
                m[k][k2] = v2.clone();
            }
        }
        serde_json::from_value(m).unwrap()
    }

    fn conds(m: &Machine) -> &[anneal_api::Condition] {
        &m.status.as_ref().unwrap().conditions
    }

    #[test]
    fn a_bind_writes_no_machine_status() {
        // The claim controller's bind: spec.claimRef set, generation 1 -> 2.
        let free = machine("m0", "52:54:00:00:00:01", json!({}));
        let bound = machine(
            "m0",
            "52:54:00:00:00:01",
            json!({"metadata": {"generation": 2, "resourceVersion": "11"},
                   "spec": {"claimRef": {"name": "c0", "namespace": "default"}}}),
        );
        assert_eq!(
            machine_valid_update(conds(&bound), None, bound.metadata.generation),
            None,
            "an unchanged verdict is no status write"
        );
        // ... and wakes no reconcile at all.
        let mut index = MachineIndex::default();
        assert_eq!(
            index.to_judge(&watcher::Event::InitApply(free)),
            vec![("default".to_string(), "m0".to_string())]
        );
        assert!(index.to_judge(&watcher::Event::Apply(bound)).is_empty());
    }

    #[test]
    fn a_changed_verdict_is_written_at_the_current_generation() {
        let m = machine(
            "m0",
            "52:54:00:00:00:01",
            json!({"metadata": {"generation": 3}}),
        );
        let problem: Problem = (reasons::DUPLICATE_BOOT_MAC, "taken".into());
        let written = machine_valid_update(conds(&m), Some(&problem), Some(3)).unwrap();
        let valid = written.iter().find(|c| c.type_ == "Valid").unwrap();
        assert_eq!(
            (
                valid.status.as_str(),
                valid.reason.as_str(),
                valid.observed_generation
            ),
            ("False", reasons::DUPLICATE_BOOT_MAC, Some(3))
        );
        // a Machine that carries no verdict yet gets one
        let new = machine(
            "m1",
            "52:54:00:00:00:02",
            json!({"status": {"conditions": []}}),
        );
        let written = machine_valid_update(conds(&new), None, Some(1)).unwrap();
        assert_eq!(conditions::status(&written, "Valid"), Some("True"));
    }

    #[test]
    fn machines_sharing_a_mac_are_judged_together() {
        let key = |n: &str| ("default".to_string(), n.to_string());
        let a = machine("a", "52:54:00:00:00:01", json!({}));
        let b = machine("b", "52:54:00:00:00:01", json!({}));
        let c = machine("c", "52:54:00:00:00:03", json!({}));
        let mut index = MachineIndex::default();
        for m in [&a, &b, &c] {
            index.to_judge(&watcher::Event::InitApply(m.clone()));
        }
        index.to_judge(&watcher::Event::<Machine>::InitDone);
        // b moves to c's MAC: b, a (its old MAC) and c (its new one)
        let moved = machine("b", "52:54:00:00:00:03", json!({}));
        assert_eq!(
            index.to_judge(&watcher::Event::Apply(moved.clone())),
            vec![key("a"), key("b"), key("c")]
        );
        // b goes: c, which shares its MAC, is judged again
        assert_eq!(
            index.to_judge(&watcher::Event::Delete(moved)),
            vec![key("c")]
        );
        // the verdict the Machine carries changed (someone rewrote it): judged
        let rewritten = machine(
            "a",
            "52:54:00:00:00:01",
            json!({"status": {"conditions": []}}),
        );
        assert_eq!(
            index.to_judge(&watcher::Event::Apply(rewritten)),
            vec![key("a")]
        );
        // a re-list forgets Machines that went while the watch was down
        index.to_judge(&watcher::Event::<Machine>::Init);
        index.to_judge(&watcher::Event::InitApply(a));
        index.to_judge(&watcher::Event::<Machine>::InitDone);
        assert_eq!(
            index.with_mac("52:54:00:00:00:03".parse().unwrap()).count(),
            0
        );
    }

    #[test]
    fn subnet_address_rules() {
        assert_eq!(subnet_problem(&subnet(json!({}))), None);
        let reason = |p: serde_json::Value| subnet_problem(&subnet(p)).map(|(r, _)| r);
        assert_eq!(
            reason(json!({"dhcp": {"leaseRange": {"start": "10.77.0.200", "end": "10.77.0.100"}}})),
            Some(reasons::LEASE_RANGE_INVERTED)
        );
        assert_eq!(
            reason(json!({"dhcp": {"leaseRange": {"start": "10.77.0.100", "end": "10.77.1.5"}}})),
            Some(reasons::LEASE_RANGE_OUTSIDE_CIDR)
        );
        assert_eq!(
            reason(json!({"dhcp": {"leaseRange": {"start": "10.77.0.100", "end": "10.77.0.255"}}})),
            Some("LeaseRangeIncludesNetworkOrBroadcast")
        );
        assert_eq!(
            reason(json!({"bootd": {"serverIP": "10.77.0.150"}})),
            Some(reasons::SERVER_IP_IN_LEASE_RANGE)
        );
        assert_eq!(
            reason(json!({"dhcp": {"gateway": "10.77.0.120"}})),
            Some(reasons::GATEWAY_IN_LEASE_RANGE)
        );
        assert_eq!(
            reason(json!({"dhcp": {"gateway": "10.99.0.1"}})),
            Some(reasons::GATEWAY_OUTSIDE_CIDR)
        );
        assert_eq!(reason(json!({"dhcp": {"gateway": ""}})), None);
    }

    #[test]
    fn subnet_ipv6_rules_name_the_field() {
        let v6 = |patch: serde_json::Value| {
            let mut v = json!({"ipv6": {"prefix": "2001:db8:77::/64", "serverAddress": "2001:db8:77::2",
                "leaseRange": {"start": "2001:db8:77::1000", "end": "2001:db8:77::10ff"}}});
            for (k, val) in patch.as_object().unwrap() {
                v["ipv6"][k] = val.clone();
            }
            subnet_problem(&subnet(v))
        };
        assert_eq!(v6(json!({})), None);
        let (r, m) =
            v6(json!({"leaseRange": {"start": "2001:db8:77::10ff", "end": "2001:db8:77::1000"}}))
                .unwrap();
        assert_eq!(r, reasons::LEASE_RANGE_INVERTED);
        assert!(m.contains("spec.ipv6.leaseRange.start"), "{m}");
        let (r, m) =
            v6(json!({"leaseRange": {"start": "2001:db8:77::1000", "end": "2001:db8:78::1"}}))
                .unwrap();
        assert_eq!(r, reasons::LEASE_RANGE_OUTSIDE_CIDR);
        assert!(m.contains("spec.ipv6.prefix"), "{m}");
        let (r, m) = v6(json!({"serverAddress": "2001:db8:77::1001"})).unwrap();
        assert_eq!(r, reasons::SERVER_IP_IN_LEASE_RANGE);
        assert!(m.contains("spec.ipv6.serverAddress"), "{m}");
        let (r, m) = v6(json!({"serverAddress": "2001:db8:99::2"})).unwrap();
        assert_eq!(r, reasons::IPV6_SERVER_OUTSIDE_PREFIX);
        assert!(m.contains("spec.ipv6.serverAddress"), "{m}");
        // the IPv4 rules come first
        let mut both = json!({"dhcp": {"gateway": "10.99.0.1"}});
        both["ipv6"] = json!({"prefix": "2001:db8:77::/64", "serverAddress": "2001:db8:99::2"});
        assert_eq!(
            subnet_problem(&subnet(both)).map(|p| p.0),
            Some(reasons::GATEWAY_OUTSIDE_CIDR)
        );
    }
}
