//! The reservations (IPAM) controller: writes `Subnet.status.dhcp` of every
//! lease-mode Subnet.
//!
//! Every Machine whose `spec.subnetRef` names the Subnet, that holds its
//! boot MAC there ([`anneal_api::tenancy::boot_mac_holders`]: the first
//! Machine enrolled with that MAC, from a namespace the Subnet grants), is
//! not being deleted and is net-booting or deployed (state
//! `Inspecting`, `Provisioning`, `Provisioned` or `Deprovisioning`: the wipe
//! of a Recycle boots the agent too) holds one reservation from
//! `spec.dhcp.leaseRange`. An existing reservation is kept as long as its
//! Machine qualifies with the same MAC (an address never moves); a new one
//! takes the lowest free address of the range that is not bootd's server
//! IP, the gateway, or the network/broadcast address. A reservation is
//! released when its Machine is deleted, leaves the Subnet, changes its MAC
//! or leaves those states. `status.dhcp.revision` is
//! [`anneal_api::reservations_revision`] of the table (bootd makes the table
//! live, then writes `appliedRevision`). `DHCPPoolExhausted` is True, naming
//! the Subnet and how many Machines wait, while a qualifying Machine has no
//! address; False otherwise (always False in proxy mode).
//! With `spec.ipv6`, every entry also carries `ipv6Address`
//! ([`assign_ipv6`]): the lowest free address of `spec.ipv6.leaseRange`
//! that is not `spec.ipv6.serverAddress`, kept as long as the entry is and
//! it stays inside the range; an entry left without one (range exhausted)
//! keeps its IPv4 address and sets `DHCPPoolExhausted` the same way, the
//! message naming `spec.ipv6.leaseRange`.
//! For the printer columns (docs/operators.md, "Columns, short names,
//! `kubectl get anneal`") it also writes, in lease mode,
//! `status.reservationCount` and `status.bootdReady` ([`bootd_ready`]); both
//! are removed in proxy mode.
//!
//! Status writes are merge patches guarded by the Subnet's resourceVersion;
//! a conflict requeues.

use anneal_api::conditions::{reasons, types};
use std::collections::{BTreeMap, BTreeSet};
use std::net::Ipv4Addr;
use std::sync::Arc;
use std::time::Duration;

use anneal_api::{
    Condition, DhcpMode, Machine, MachineState, Reservation, Subnet, Time, reservations_revision,
};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::{Event, EventType, Recorder};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::watcher;
use kube::{Client, Resource, ResourceExt};
use serde_json::json;
use tracing::{debug, info, warn};

use crate::conditions;
use crate::controller::{Identity, ReconcileError, Scope, drive, is_conflict, patch_params};
use crate::metrics::Metrics;

const KIND: &str = "SubnetReservations";
/// Field manager of the reservations controller's writes.
pub const FIELD_MANAGER: &str = "anneal-ipam";
/// The condition this controller owns.
pub const POOL_EXHAUSTED: &str = types::DHCP_POOL_EXHAUSTED;
/// How often a Subnet is looked at without any change.
const RESYNC: Duration = Duration::from_secs(60);

/// Errors of one Subnet reconcile.
#[derive(Debug, thiserror::Error)]
pub enum IpamError {
    /// An API call failed.
    #[error("api call failed: {0}")]
    Kube(#[from] kube::Error),
    /// The Machine cache never synced.
    #[error("machine cache not ready")]
    NotReady,
}

/// States whose Machines hold a reservation: net-booting (inspection, a
/// deploy, the wipe of a Recycle) or deployed.
pub fn holds_reservation(state: Option<MachineState>) -> bool {
    matches!(
        state,
        Some(
            MachineState::Inspecting
                | MachineState::Provisioning
                | MachineState::Provisioned
                | MachineState::Deprovisioning
        )
    )
}

/// A MAC in canonical form (`aa:bb:cc:dd:ee:ff`), if it is one
/// (`:` or `-` separated, any case: [`anneal_api::Mac`]'s parser).
pub fn canonical_mac(s: &str) -> Option<String> {
    s.parse::<anneal_api::Mac>().ok().map(|m| m.to_string())
}

/// `Reservation.machine` of a Machine: its name, `namespace/name` when it
/// lives in another namespace than the Subnet.
fn machine_key(m: &Machine, subnet_ns: &str) -> String {
    let ns = m.namespace().unwrap_or_default();
    if ns == subnet_ns {
        m.name_any()
    } else {
        format!("{ns}/{}", m.name_any())
    }
}

/// Whether `m` targets the Subnet `ns/name`.
fn targets(m: &Machine, ns: &str, name: &str) -> bool {
    let own = m.namespace().unwrap_or_default();
    m.spec.subnet_ref.name == name && m.spec.subnet_ref.namespace_or(&own) == ns
}

/// The outcome of planning one Subnet's table.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// The new table, sorted by address.
    pub reservations: Vec<Reservation>,
    /// Entries new in this plan.
    pub added: Vec<Reservation>,
    /// Entries of the old table that are gone.
    pub released: Vec<Reservation>,
    /// `Reservation.machine` of qualifying Machines left without an address.
    pub waiting: Vec<String>,
    /// Addresses the range offers in all (after the exclusions).
    pub pool_size: u64,
    /// `Reservation.machine` of entries left without an IPv6 address
    /// (`spec.ipv6.leaseRange` exhausted).
    pub waiting6: Vec<String>,
    /// Addresses `spec.ipv6.leaseRange` offers (after the exclusion).
    pub pool6_size: u128,
}

fn ip6(s: &str) -> Option<u128> {
    s.parse::<std::net::Ipv6Addr>().ok().map(u128::from)
}

/// Gives every entry of `table` an IPv6 address from `spec.ipv6.leaseRange`
/// (or removes them all when the Subnet has no `spec.ipv6`). An entry keeps
/// the address it had in `old` (same machine and IPv4 address) while that
/// stays inside the range and unique; the others take the lowest free
/// address that is not `serverAddress`, in table order. Returns the
/// machines left without one and the pool's size. Pure.
pub fn assign_ipv6(
    subnet: &Subnet,
    old: &[Reservation],
    table: &mut [Reservation],
) -> (Vec<String>, u128) {
    let v6 = subnet.spec.ipv6.as_ref();
    let range = v6
        .and_then(|v| v.lease_range.as_ref())
        .and_then(|r| Some((ip6(&r.start)?, ip6(&r.end)?)))
        .filter(|(s, e)| s <= e);
    let Some((start, end)) = range else {
        for r in table.iter_mut() {
            r.ipv6_address = None;
        }
        return (Vec::new(), 0);
    };
    let server = v6.and_then(|v| ip6(&v.server_address));
    let excluded = |a: u128| Some(a) == server;
    let size = (end - start).saturating_add(1).saturating_sub(u128::from(
        server.is_some_and(|s| (start..=end).contains(&s)),
    ));
    let before: BTreeMap<(&str, &str), u128> = old
        .iter()
        .filter_map(|r| {
            let a = ip6(r.ipv6_address.as_deref()?)?;
            Some(((r.machine.as_str(), r.address.as_str()), a))
        })
        .collect();
    let mut used: BTreeSet<u128> = BTreeSet::new();
    let mut missing = Vec::new();
    for (i, r) in table.iter_mut().enumerate() {
        let kept = before
            .get(&(r.machine.as_str(), r.address.as_str()))
            .copied()
            .filter(|a| (start..=end).contains(a) && !excluded(*a) && !used.contains(a));
        match kept {
            Some(a) => {
                used.insert(a);
                r.ipv6_address = Some(std::net::Ipv6Addr::from(a).to_string());
            }
            None => missing.push(i),
        }
    }
    let mut waiting = Vec::new();
    let mut next = start;
    for i in missing {
        while next <= end && (excluded(next) || used.contains(&next)) {
            next += 1;
        }
        let r = &mut table[i];
        if next <= end {
            used.insert(next);
            r.ipv6_address = Some(std::net::Ipv6Addr::from(next).to_string());
        } else {
            r.ipv6_address = None;
            waiting.push(r.machine.clone());
        }
    }
    (waiting, size)
}

fn ip(s: &str) -> Option<Ipv4Addr> {
    s.parse().ok()
}

/// Plans the reservation table of a lease-mode Subnet from the Machines
/// (any namespace; only those targeting the Subnet count). Pure.
pub fn plan(subnet: &Subnet, machines: &[Machine], now: &Time) -> Plan {
    let sns = subnet.namespace().unwrap_or_default();
    let sname = subnet.name_any();
    let old: Vec<Reservation> = subnet
        .status
        .as_ref()
        .and_then(|s| s.dhcp.as_ref())
        .map(|d| d.reservations.clone())
        .unwrap_or_default();

    // Only the holder of a boot MAC (the first Machine enrolled with it on
    // this Subnet, from a namespace the Subnet grants) may have its
    // reservation: a later Machine claiming the same MAC, from any
    // namespace, never takes it (its Valid condition says why).
    let holders = anneal_api::tenancy::boot_mac_holders(subnet, machines);
    let holds = |m: &Machine, mac: &str| {
        mac.parse::<anneal_api::Mac>()
            .ok()
            .and_then(|mac| holders.get(&mac))
            .is_some_and(|h| std::ptr::eq(*h, m))
    };
    // Qualifying machines, oldest first: key -> mac.
    let mut wanted: Vec<(&Machine, String, String)> = machines
        .iter()
        .filter(|m| targets(m, &sns, &sname))
        .filter(|m| m.metadata.deletion_timestamp.is_none())
        .filter(|m| holds_reservation(m.status.as_ref().and_then(|s| s.state)))
        .filter_map(|m| {
            let mac = m.spec.boot_mac_address.as_deref().and_then(canonical_mac)?;
            holds(m, &mac).then(|| (m, machine_key(m, &sns), mac))
        })
        .collect();
    wanted.sort_by(|a, b| {
        let ta = a.0.metadata.creation_timestamp.as_ref().map(|t| t.0);
        let tb = b.0.metadata.creation_timestamp.as_ref().map(|t| t.0);
        ta.cmp(&tb).then_with(|| a.1.cmp(&b.1))
    });
    let want_mac: BTreeMap<&str, &str> = wanted
        .iter()
        .map(|(_, k, mac)| (k.as_str(), mac.as_str()))
        .collect();

    // Keep what still qualifies, unchanged (never move an address).
    let mut kept: Vec<Reservation> = Vec::new();
    let mut used: BTreeSet<Ipv4Addr> = BTreeSet::new();
    let mut holders: BTreeSet<String> = BTreeSet::new();
    let mut released = Vec::new();
    for r in &old {
        let keep = ip(&r.address).is_some_and(|a| !used.contains(&a))
            && !holders.contains(&r.machine)
            && want_mac
                .get(r.machine.as_str())
                .is_some_and(|mac| canonical_mac(&r.mac).as_deref() == Some(*mac));
        if keep {
            if let Some(a) = ip(&r.address) {
                used.insert(a);
            }
            holders.insert(r.machine.clone());
            kept.push(r.clone());
        } else {
            released.push(r.clone());
        }
    }

    // The pool, lowest first.
    let dhcp = subnet.spec.dhcp.as_ref();
    let range = dhcp
        .and_then(|d| d.lease_range.as_ref())
        .and_then(|r| Some((ip(&r.start)?, ip(&r.end)?)));
    let mut excluded: BTreeSet<Ipv4Addr> = BTreeSet::new();
    if let Some(b) = &subnet.spec.bootd
        && let Some(a) = ip(&b.server_ip)
    {
        excluded.insert(a);
    }
    if let Some(g) = dhcp.and_then(|d| d.gateway.as_deref()).and_then(ip) {
        excluded.insert(g);
    }
    let cidr = subnet.spec.cidr.split_once('/').and_then(|(a, p)| {
        let a = u32::from(ip(a)?);
        let p: u32 = p.parse().ok().filter(|p| *p <= 32)?;
        let mask = if p == 0 { 0 } else { u32::MAX << (32 - p) };
        Some((a & mask, mask))
    });
    let usable = |a: u32| match cidr {
        Some((net, mask)) => {
            a & mask == net && (mask == u32::MAX || (a != net && a != (net | !mask)))
        }
        None => true,
    };
    let pool: Vec<Ipv4Addr> = match range {
        Some((s, e)) if u32::from(s) <= u32::from(e) => (u32::from(s)..=u32::from(e))
            .filter(|a| usable(*a))
            .map(Ipv4Addr::from)
            .filter(|a| !excluded.contains(a))
            .collect(),
        _ => Vec::new(),
    };
    let pool_size = pool.len() as u64;
    let mut free = pool.into_iter().filter(|a| !used.contains(a));

    let mut added = Vec::new();
    let mut waiting = Vec::new();
    let mut table = kept;
    for (_, key, mac) in &wanted {
        if holders.contains(key) {
            continue;
        }
        match free.next() {
            Some(a) => {
                let r = Reservation {
                    address: a.to_string(),
                    ipv6_address: None,
                    machine: key.clone(),
                    mac: mac.clone(),
                    since: Some(now.clone()),
                };
                holders.insert(key.clone());
                added.push(r.clone());
                table.push(r);
            }
            None => waiting.push(key.clone()),
        }
    }
    table.sort_by_key(|r| ip(&r.address).map_or(u64::MAX, |a| u64::from(u32::from(a))));
    let (waiting6, pool6_size) = assign_ipv6(subnet, &old, &mut table);
    for a in &mut added {
        a.ipv6_address = table
            .iter()
            .find(|r| r.machine == a.machine)
            .and_then(|r| r.ipv6_address.clone());
    }
    Plan {
        reservations: table,
        added,
        released,
        waiting,
        pool_size,
        waiting6,
        pool6_size,
    }
}

/// The `DHCPPoolExhausted` condition for a plan: (status, reason, message).
pub fn pool_condition(subnet: &Subnet, plan: &Plan) -> (bool, &'static str, String) {
    let key = format!(
        "{}/{}",
        subnet.namespace().unwrap_or_default(),
        subnet.name_any()
    );
    if plan.waiting.is_empty() && !plan.waiting6.is_empty() {
        let range = subnet
            .spec
            .ipv6
            .as_ref()
            .and_then(|v| v.lease_range.as_ref())
            .map_or("(none)".to_string(), |r| format!("{}-{}", r.start, r.end));
        return (
            true,
            reasons::POOL_EXHAUSTED,
            format!(
                "Subnet {key}: spec.ipv6.leaseRange {range} has no free address ({} usable, all reserved); {} Machine(s) waiting for an IPv6 address: {}",
                plan.pool6_size,
                plan.waiting6.len(),
                plan.waiting6.join(", ")
            ),
        );
    }
    if plan.waiting.is_empty() {
        return (
            false,
            reasons::ADDRESSES_AVAILABLE,
            format!(
                "Subnet {key}: {} of {} addresses reserved",
                plan.reservations.len(),
                plan.pool_size
            ),
        );
    }
    let range = subnet
        .spec
        .dhcp
        .as_ref()
        .and_then(|d| d.lease_range.as_ref())
        .map_or("(none)".to_string(), |r| format!("{}-{}", r.start, r.end));
    (
        true,
        reasons::POOL_EXHAUSTED,
        format!(
            "Subnet {key}: leaseRange {range} has no free address ({} usable, all reserved); {} Machine(s) waiting: {}",
            plan.pool_size,
            plan.waiting.len(),
            plan.waiting.join(", ")
        ),
    )
}

struct Context {
    client: Client,
    machines: Store<Machine>,
    recorder: Recorder,
}

/// The reservations controller's identity.
pub const ID: Identity = Identity {
    name: "ipam",
    kind: KIND,
    field_manager: FIELD_MANAGER,
};

/// Whether bootd has made the table of `revision` live: it writes
/// `appliedRevision` only after installing that table.
pub fn bootd_ready(applied: Option<&str>, revision: &str) -> bool {
    applied == Some(revision)
}

/// Runs the controller until `shutdown` resolves. `namespace` limits the
/// Subnets and Machines watched. (The manager runs it through its runtime;
/// this entry point is for tests that run it alone.)
pub async fn run(
    client: Client,
    namespace: Option<String>,
    metrics: Arc<Metrics>,
    recorder: Recorder,
    shutdown: impl std::future::Future<Output = ()> + Send + Sync + 'static,
) {
    let cancel = tokio_util::sync::CancellationToken::new();
    let scope = Scope {
        client,
        namespace,
        metrics,
        recorder,
        reporter: crate::controller::reporter(None),
        cancel: cancel.clone(),
        machines: None,
    };
    let stop = cancel.clone();
    let trigger = tokio::spawn(async move {
        shutdown.await;
        stop.cancel();
    });
    controller(scope).await;
    trigger.abort();
}

/// Runs the reservations controller in `scope` until it is cancelled. Its
/// Machine feed is taken when this is called ([`Scope::machines`]).
pub fn controller(scope: Scope) -> impl std::future::Future<Output = ()> + Send + 'static {
    let machines = scope.machines();
    run_controller(scope, machines)
}

async fn run_controller(scope: Scope, machines: crate::controller::Feed<Machine>) {
    let (machines, stream) = machines.touched();
    let controller = Controller::new(scope.api::<Subnet>(), watcher::Config::default());
    let subnets = controller.store();
    let ctx = Arc::new(Context {
        client: scope.client.clone(),
        machines,
        recorder: scope.recorder.clone(),
    });
    let controller = controller.watches_shared_stream(stream, move |m: Arc<Machine>| {
        // The Subnet it targets, and any Subnet still holding its entry
        // (it moved away, changed its MAC, or is gone).
        let own = m.namespace().unwrap_or_default();
        let target_ns = m.spec.subnet_ref.namespace_or(&own).to_string();
        let target = m.spec.subnet_ref.name.clone();
        subnets
            .state()
            .iter()
            .filter(|s| {
                let sns = s.namespace().unwrap_or_default();
                let key = machine_key(&m, &sns);
                (sns == target_ns && s.name_any() == target)
                    || s.status
                        .as_ref()
                        .and_then(|st| st.dhcp.as_ref())
                        .is_some_and(|d| d.reservations.iter().any(|r| r.machine == key))
            })
            .map(|s| ObjectRef::from_obj(s.as_ref()))
            .collect::<Vec<_>>()
    });
    drive(ID, &scope, controller, reconcile, ctx).await;
}

impl ReconcileError for IpamError {
    fn is_conflict(&self) -> bool {
        matches!(self, Self::Kube(e) if is_conflict(e))
    }

    fn kind(&self) -> &'static str {
        match self {
            Self::Kube(_) => "api",
            Self::NotReady => "not_ready",
        }
    }
}

fn event(ctx: &Context, reference: k8s_openapi::api::core::v1::ObjectReference, ev: Event) {
    // Published off the reconcile path.
    let recorder = ctx.recorder.clone();
    tokio::spawn(async move {
        if let Err(e) = recorder.publish(&ev, &reference).await {
            debug!(error = %e, "publishing event failed");
        }
    });
}

/// Logs and publishes what a written plan did: each address reserved (on
/// its Machine) and released (on the Subnet), and, when the pool just ran
/// out, a warning on the Subnet and on each Machine waiting.
fn publish_plan_events(ctx: &Context, subnet: &Subnet, p: &Plan, changed_cond: bool) {
    let ns = subnet.namespace().unwrap_or_default();
    let name = subnet.name_any();
    let skey = format!("{ns}/{name}");
    let machine_ref = |key: &str| -> Option<k8s_openapi::api::core::v1::ObjectReference> {
        let (mns, mname) = key.split_once('/').unwrap_or((ns.as_str(), key));
        ctx.machines
            .get(&ObjectRef::<Machine>::new(mname).within(mns))
            .map(|m| m.object_ref(&()))
    };
    for r in &p.added {
        let v6 = r
            .ipv6_address
            .as_deref()
            .map(|a| format!(" and {a}"))
            .unwrap_or_default();
        info!(subnet = %skey, machine = %r.machine, address = %r.address, ipv6 = r.ipv6_address.as_deref().unwrap_or(""), "address reserved");
        if let Some(mr) = machine_ref(&r.machine) {
            event(
                ctx,
                mr,
                Event {
                    type_: EventType::Normal,
                    reason: "AddressReserved".into(),
                    note: Some(format!("{}{v6} reserved on Subnet {skey}", r.address)),
                    action: "Reserve".into(),
                    secondary: Some(subnet.object_ref(&())),
                },
            );
        }
    }
    for r in &p.released {
        info!(subnet = %skey, machine = %r.machine, address = %r.address, "address released");
        event(
            ctx,
            subnet.object_ref(&()),
            Event {
                type_: EventType::Normal,
                reason: "AddressReleased".into(),
                note: Some(format!("{} of Machine {} released", r.address, r.machine)),
                action: "Release".into(),
                secondary: None,
            },
        );
    }
    if changed_cond && (!p.waiting.is_empty() || !p.waiting6.is_empty()) {
        let (_, _, message) = pool_condition(subnet, p);
        warn!(subnet = %skey, waiting = p.waiting.len(), "lease range exhausted");
        event(
            ctx,
            subnet.object_ref(&()),
            Event {
                type_: EventType::Warning,
                reason: POOL_EXHAUSTED.into(),
                note: Some(message.clone()),
                action: "Reserve".into(),
                secondary: None,
            },
        );
        for key in &p.waiting {
            if let Some(mr) = machine_ref(key) {
                event(
                    ctx,
                    mr,
                    Event {
                        type_: EventType::Warning,
                        reason: POOL_EXHAUSTED.into(),
                        note: Some(format!(
                            "no free address on Subnet {skey}: waiting for one to be released"
                        )),
                        action: "Reserve".into(),
                        secondary: Some(subnet.object_ref(&())),
                    },
                );
            }
        }
    }
}

async fn reconcile(subnet: Arc<Subnet>, ctx: Arc<Context>) -> Result<Action, IpamError> {
    // An empty cache would release every reservation: come back once the
    // first list is in. (Not awaited here: a second reconcile parked on the
    // same readiness signal was seen never to wake.)
    match futures::FutureExt::now_or_never(ctx.machines.wait_until_ready()) {
        Some(Ok(())) => {}
        Some(Err(_)) => return Err(IpamError::NotReady),
        None => return Ok(Action::requeue(Duration::from_millis(200))),
    }
    let ns = subnet.namespace().unwrap_or_default();
    let name = subnet.name_any();
    debug!(subnet = %format!("{ns}/{name}"), "reconciling reservations");
    let status = subnet.status.clone().unwrap_or_default();
    let mut conds: Vec<Condition> = status.conditions.clone();
    let generation = subnet.meta().generation;
    let lease = subnet
        .spec
        .dhcp
        .as_ref()
        .is_some_and(|d| d.mode == DhcpMode::Lease);

    let mut patch_status = serde_json::Map::new();
    let mut planned = None;
    let changed_cond;
    if lease {
        let machines: Vec<Machine> = ctx
            .machines
            .state()
            .iter()
            .map(|m| m.as_ref().clone())
            .collect();
        let now = Time(Timestamp::now());
        let p = plan(&subnet, &machines, &now);
        let revision = reservations_revision(&p.reservations);
        let old_dhcp = status.dhcp.clone().unwrap_or_default();
        if old_dhcp.reservations != p.reservations
            || old_dhcp.revision.as_deref() != Some(revision.as_str())
        {
            patch_status.insert(
                "dhcp".into(),
                json!({"reservations": p.reservations, "revision": revision}),
            );
        }
        let count = i32::try_from(p.reservations.len()).unwrap_or(i32::MAX);
        if status.reservation_count != Some(count) {
            patch_status.insert("reservationCount".into(), json!(count));
        }
        let ready = bootd_ready(old_dhcp.applied_revision.as_deref(), &revision);
        if status.bootd_ready != Some(ready) {
            patch_status.insert("bootdReady".into(), json!(ready));
        }
        let (st, reason, message) = pool_condition(&subnet, &p);
        changed_cond = conditions::set(&mut conds, POOL_EXHAUSTED, st, reason, message, generation);
        planned = Some(p);
    } else {
        // proxy mode: no table, and bootd reports nothing
        if status.reservation_count.is_some() {
            patch_status.insert("reservationCount".into(), serde_json::Value::Null);
        }
        if status.bootd_ready.is_some() {
            patch_status.insert("bootdReady".into(), serde_json::Value::Null);
        }
        changed_cond = conditions::set(
            &mut conds,
            POOL_EXHAUSTED,
            false,
            reasons::PROXY_MODE,
            "proxy mode assigns no addresses",
            generation,
        );
    }
    if patch_status.is_empty() && !changed_cond {
        return Ok(Action::requeue(RESYNC));
    }
    patch_status.insert("conditions".into(), json!(conds));
    let patch = json!({
        "metadata": {"resourceVersion": subnet.meta().resource_version},
        "status": patch_status,
    });
    let api: Api<Subnet> = Api::namespaced(ctx.client.clone(), &ns);
    match api
        .patch_status(&name, &patch_params(FIELD_MANAGER), &Patch::Merge(&patch))
        .await
    {
        Ok(_) => {}
        Err(kube::Error::Api(s)) if s.code == 409 => {
            debug!(subnet = %format!("{ns}/{name}"), "reservations write conflicted; requeue");
            return Ok(Action::requeue(Duration::from_millis(200)));
        }
        Err(kube::Error::Api(s)) if s.code == 404 => return Ok(Action::await_change()),
        Err(e) => return Err(e.into()),
    }
    debug!(subnet = %format!("{ns}/{name}"), "status written");

    // Written: tell people.
    let Some(p) = planned else {
        return Ok(Action::requeue(RESYNC));
    };
    publish_plan_events(&ctx, &subnet, &p, changed_cond);
    Ok(Action::requeue(RESYNC))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn subnet(range: (&str, &str), reservations: serde_json::Value) -> Subnet {
        serde_json::from_value(json!({
            "apiVersion": "anneal.dev/v1alpha1", "kind": "Subnet",
            "metadata": {"name": "lab", "namespace": "default"},
            "spec": {
                "siteRef": {"name": "site"}, "cidr": "10.0.0.0/24",
                "bootd": {"serverIP": "10.0.0.10", "mode": "External"},
                "dhcp": {"mode": "lease", "gateway": "10.0.0.11",
                         "leaseRange": {"start": range.0, "end": range.1}}
            },
            "status": {"dhcp": {"reservations": reservations}}
        }))
        .unwrap()
    }

    fn machine(name: &str, mac: &str, state: &str, created: &str) -> Machine {
        serde_json::from_value(json!({
            "apiVersion": "anneal.dev/v1alpha1", "kind": "Machine",
            "metadata": {"name": name, "namespace": "default", "creationTimestamp": created},
            "spec": {"subnetRef": {"name": "lab"}, "bootMACAddress": mac},
            "status": {"state": state}
        }))
        .unwrap()
    }

    fn now() -> Time {
        Time(Timestamp::now())
    }

    fn table(p: &Plan) -> Vec<(String, String)> {
        p.reservations
            .iter()
            .map(|r| (r.address.clone(), r.machine.clone()))
            .collect()
    }

    #[test]
    fn lowest_free_skipping_server_gateway_and_kept() {
        let s = subnet(
            ("10.0.0.9", "10.0.0.14"),
            json!([{"address": "10.0.0.9", "machine": "old", "mac": "02:00:00:00:00:01"}]),
        );
        let ms = [
            machine(
                "old",
                "02:00:00:00:00:01",
                reasons::PROVISIONED,
                "2026-01-01T00:00:00Z",
            ),
            machine(
                "b",
                "02:00:00:00:00:03",
                "Inspecting",
                "2026-01-01T00:00:02Z",
            ),
            machine(
                "a",
                "02:00:00:00:00:02",
                "Provisioning",
                "2026-01-01T00:00:01Z",
            ),
            machine(
                "idle",
                "02:00:00:00:00:04",
                "Available",
                "2026-01-01T00:00:00Z",
            ),
        ];
        let p = plan(&s, &ms, &now());
        assert_eq!(
            table(&p),
            [
                ("10.0.0.9".into(), "old".into()),
                ("10.0.0.12".into(), "a".into()),
                ("10.0.0.13".into(), "b".into()),
            ]
        );
        assert_eq!(p.added.len(), 2);
        assert!(p.released.is_empty() && p.waiting.is_empty());
        // 9..14 minus server .10 and gateway .11
        assert_eq!(p.pool_size, 4);
        assert!(!pool_condition(&s, &p).0);
    }

    #[test]
    fn net_booting_and_deployed_states_hold_a_reservation() {
        use MachineState::*;
        for st in [Inspecting, Provisioning, Provisioned, Deprovisioning] {
            assert!(holds_reservation(Some(st)), "{st:?}");
        }
        for st in [Enrolling, Available, Released, Parked] {
            assert!(!holds_reservation(Some(st)), "{st:?}");
        }
        assert!(!holds_reservation(None));
    }

    #[test]
    fn stable_release_and_exhaustion() {
        let s = subnet(
            ("10.0.0.20", "10.0.0.21"),
            json!([
                {"address": "10.0.0.21", "machine": "a", "mac": "02:00:00:00:00:02"},
                {"address": "10.0.0.20", "machine": "gone", "mac": "02:00:00:00:00:09"},
            ]),
        );
        let ms = [
            machine(
                "a",
                "02:00:00:00:00:02",
                reasons::PROVISIONED,
                "2026-01-01T00:00:01Z",
            ),
            machine(
                "b",
                "02:00:00:00:00:03",
                "Inspecting",
                "2026-01-01T00:00:02Z",
            ),
            machine(
                "c",
                "02-00-00-00-00-04",
                "Inspecting",
                "2026-01-01T00:00:03Z",
            ),
        ];
        let p = plan(&s, &ms, &now());
        // a keeps .21 (never moves), gone's .20 goes to b, c waits.
        assert_eq!(
            table(&p),
            [
                ("10.0.0.20".into(), "b".into()),
                ("10.0.0.21".into(), "a".into())
            ]
        );
        assert_eq!(p.released.len(), 1);
        assert_eq!(p.waiting, ["c"]);
        let (st, reason, msg) = pool_condition(&s, &p);
        assert!(st);
        assert_eq!(reason, reasons::POOL_EXHAUSTED);
        assert!(
            msg.contains("default/lab") && msg.contains("1 Machine(s) waiting: c"),
            "{msg}"
        );
    }

    #[test]
    fn mac_change_and_leaving_the_subnet_release() {
        let s = subnet(
            ("10.0.0.20", "10.0.0.30"),
            json!([
                {"address": "10.0.0.25", "machine": "a", "mac": "02:00:00:00:00:02"},
                {"address": "10.0.0.26", "machine": "b", "mac": "02:00:00:00:00:03"},
            ]),
        );
        let mut b = machine(
            "b",
            "02:00:00:00:00:03",
            "Inspecting",
            "2026-01-01T00:00:02Z",
        );
        b.spec.subnet_ref.name = "elsewhere".into();
        let ms = [
            machine(
                "a",
                "02:00:00:00:00:0a",
                "Inspecting",
                "2026-01-01T00:00:01Z",
            ),
            b,
        ];
        let p = plan(&s, &ms, &now());
        assert_eq!(table(&p), [("10.0.0.20".into(), "a".into())]);
        assert_eq!(p.released.len(), 2);
    }

    #[test]
    fn a_duplicate_boot_mac_never_takes_the_reservation() {
        let mut s = subnet(("10.0.0.20", "10.0.0.30"), json!([]));
        s.spec.allowed_namespaces = vec!["tenant-b".into()];
        let first = machine(
            "first",
            "02:00:00:00:00:01",
            "Available",
            "2026-01-01T00:00:00Z",
        );
        let in_ns = |ns: &str, name: &str, mac: &str, created: &str| {
            let mut m = machine(name, mac, "Inspecting", created);
            m.metadata.namespace = Some(ns.into());
            m.spec.subnet_ref.namespace = Some("default".into());
            m
        };
        // same MAC, later, another (granted) namespace, net-booting: the
        // first Machine holds the MAC even while it needs no address
        let thief = in_ns(
            "tenant-b",
            "thief",
            "02-00-00-00-00-01",
            "2026-01-02T00:00:00Z",
        );
        // a namespace the Subnet does not grant
        let stranger = in_ns(
            "tenant-c",
            "stranger",
            "02:00:00:00:00:05",
            "2025-01-01T00:00:00Z",
        );
        let granted = in_ns(
            "tenant-b",
            "granted",
            "02:00:00:00:00:06",
            "2026-01-03T00:00:00Z",
        );
        let p = plan(&s, &[thief, first.clone(), stranger, granted], &now());
        assert_eq!(table(&p), [("10.0.0.20".into(), "tenant-b/granted".into())]);
        assert!(p.waiting.is_empty());
        // once the first inspects, it gets its address; the thief still none
        let mut first = first;
        first.status.as_mut().unwrap().state = Some(MachineState::Inspecting);
        let thief = in_ns(
            "tenant-b",
            "thief",
            "02:00:00:00:00:01",
            "2026-01-02T00:00:00Z",
        );
        let p = plan(&s, &[thief, first], &now());
        assert_eq!(table(&p), [("10.0.0.20".into(), "first".into())]);
    }

    fn subnet6(range6: (&str, &str), reservations: serde_json::Value) -> Subnet {
        let mut s = subnet(("10.0.0.20", "10.0.0.30"), reservations);
        s.spec.ipv6 = Some(
            serde_json::from_value(json!({
                "prefix": "2001:db8:77::/64", "serverAddress": "2001:db8:77::1000",
                "leaseRange": {"start": range6.0, "end": range6.1}
            }))
            .unwrap(),
        );
        s
    }

    fn table6(p: &Plan) -> Vec<(String, Option<String>)> {
        p.reservations
            .iter()
            .map(|r| (r.machine.clone(), r.ipv6_address.clone()))
            .collect()
    }

    #[test]
    fn ipv6_addresses_are_stable_unique_and_skip_the_server() {
        let ms = [
            machine(
                "a",
                "02:00:00:00:00:01",
                "Inspecting",
                "2026-01-01T00:00:01Z",
            ),
            machine(
                "b",
                "02:00:00:00:00:02",
                "Provisioned",
                "2026-01-01T00:00:02Z",
            ),
            machine(
                "c",
                "02:00:00:00:00:03",
                "Provisioning",
                "2026-01-01T00:00:03Z",
            ),
        ];
        // the server address sits at the start of the range: skipped
        let s = subnet6(("2001:db8:77::1000", "2001:db8:77::10ff"), json!([]));
        let p = plan(&s, &ms, &now());
        let v6 = |a: &str| Some(a.to_string());
        assert_eq!(
            table6(&p),
            [
                ("a".into(), v6("2001:db8:77::1001")),
                ("b".into(), v6("2001:db8:77::1002")),
                ("c".into(), v6("2001:db8:77::1003")),
            ]
        );
        assert_eq!(p.added[0].ipv6_address, v6("2001:db8:77::1001"));
        assert_eq!(p.pool6_size, 255);
        // planned again from its own table: nothing moves
        let again = subnet6(
            ("2001:db8:77::1000", "2001:db8:77::10ff"),
            serde_json::to_value(&p.reservations).unwrap(),
        );
        assert_eq!(table6(&plan(&again, &ms, &now())), table6(&p));
        // a goes; b keeps its address; c's old entry was made to repeat b's
        // (a corrupt table): only the first keeps it; the newcomer d (on
        // a's IPv4 address, first in the table) takes the freed lowest, c
        // the next free one
        let mut old = serde_json::to_value(&p.reservations).unwrap();
        old[2]["ipv6Address"] = json!("2001:db8:77::1002");
        let s = subnet6(("2001:db8:77::1000", "2001:db8:77::10ff"), old);
        let ms = [
            ms[1].clone(),
            ms[2].clone(),
            machine(
                "d",
                "02:00:00:00:00:04",
                "Inspecting",
                "2026-01-01T00:00:04Z",
            ),
        ];
        let p = plan(&s, &ms, &now());
        let got = table6(&p);
        assert_eq!(got[1], ("b".into(), v6("2001:db8:77::1002")), "{got:?}");
        assert_eq!(got[2], ("c".into(), v6("2001:db8:77::1003")), "{got:?}");
        assert_eq!(got[0], ("d".into(), v6("2001:db8:77::1001")), "{got:?}");
        let all: BTreeSet<_> = got.iter().map(|(_, a)| a.clone()).collect();
        assert_eq!(all.len(), 3);
        // without spec.ipv6 the addresses go, the IPv4 table stays
        let mut s4 = s.clone();
        s4.spec.ipv6 = None;
        let p4 = plan(&s4, &ms, &now());
        assert!(p4.reservations.iter().all(|r| r.ipv6_address.is_none()));
        assert_eq!(p4.reservations.len(), 3);
    }

    #[test]
    fn ipv6_exhaustion_names_the_subnet_and_field() {
        let ms = [
            machine(
                "a",
                "02:00:00:00:00:01",
                "Inspecting",
                "2026-01-01T00:00:01Z",
            ),
            machine(
                "b",
                "02:00:00:00:00:02",
                "Inspecting",
                "2026-01-01T00:00:02Z",
            ),
        ];
        let s = subnet6(("2001:db8:77::1000", "2001:db8:77::1001"), json!([]));
        let p = plan(&s, &ms, &now());
        assert_eq!(p.reservations.len(), 2, "both keep their IPv4 address");
        assert_eq!(p.waiting6, ["b"]);
        assert_eq!(p.pool6_size, 1);
        let (st, reason, msg) = pool_condition(&s, &p);
        assert!(st);
        assert_eq!(reason, reasons::POOL_EXHAUSTED);
        assert!(
            msg.contains(
                "Subnet default/lab: spec.ipv6.leaseRange 2001:db8:77::1000-2001:db8:77::1001"
            ) && msg.contains("1 Machine(s) waiting for an IPv6 address: b"),
            "{msg}"
        );
        // the revision covers the IPv6 addresses
        let mut other = p.reservations.clone();
        other[0].ipv6_address = Some("2001:db8:77::1005".into());
        assert_ne!(
            reservations_revision(&p.reservations),
            reservations_revision(&other)
        );
    }

    #[test]
    fn bootd_is_ready_once_it_applied_the_current_revision() {
        assert!(!bootd_ready(None, "r2"));
        assert!(!bootd_ready(Some("r1"), "r2"));
        assert!(bootd_ready(Some("r2"), "r2"));
    }

    #[test]
    fn revision_is_order_independent() {
        let r = |a: &str, m: &str| Reservation {
            address: a.into(),
            ipv6_address: None,
            machine: m.into(),
            mac: "02:00:00:00:00:01".into(),
            since: None,
        };
        let x = reservations_revision(&[r("10.0.0.9", "a"), r("10.0.0.10", "b")]);
        let y = reservations_revision(&[r("10.0.0.10", "b"), r("10.0.0.9", "a")]);
        assert_eq!(x, y);
        assert_ne!(x, reservations_revision(&[r("10.0.0.9", "a")]));
        assert_eq!(x.len(), 16);
    }
}
