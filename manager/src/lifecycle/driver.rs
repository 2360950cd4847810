//! The driver of the Machine lifecycle: gathers the [`Snapshot`] (API
//! reads, the BMC system query), calls the pure handler
//! ([`handlers::apply`] / [`handlers::delete`]), carries out its decision
//! (boot-token Secret, BMC calls at their retry cadence) and commits the
//! status once: a JSON merge patch of the difference, carrying the
//! resourceVersion read as a precondition, under [`FIELD_MANAGER`], then
//! the consumed annotations and the Events.

use anneal_api::conditions::reasons;
use std::collections::BTreeMap;

use anneal_api::agent::Token;
use anneal_api::{Machine, MachineHardware, Subnet};
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ObjectMeta, Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::runtime::events::{Event as KubeEvent, EventType};
use kube::{Resource, ResourceExt};
use serde_json::json;

use super::handlers::{
    self, BackoffOp, Bmc, BmcAction, BmcFailure, Decision, DeployView, Draft, Event, Outcome,
    Snapshot, TokenOp, WarnOp,
};
use super::status::{condition, mint_token, token_hash};
use super::{
    BOOT_TOKEN_KEY, BOOT_TOKEN_LABEL, Backoff, Context, Error, FIELD_MANAGER, dhcp_gate,
    fingerprint,
};
use crate::bmc::BmcClient;
use crate::ipmi::IpmiClient;
use crate::patch::merge_diff;
use crate::redfish::{BmcAddress, BmcReason, Credentials, RedfishClient, Scheme, TlsPolicy};

fn key_of(m: &Machine) -> Result<String, Error> {
    let ns = m.namespace().ok_or(Error::NoNamespace)?;
    Ok(format!("{ns}/{}", m.name_any()))
}

/// Consecutive failures so far, and the time left before the next try
/// (None once the Machine was edited since the failure).
fn backoff_of(ctx: &Context, key: &str, m: &Machine) -> (u32, Option<std::time::Duration>) {
    let map = ctx.bmc_backoff.lock().unwrap_or_else(|p| p.into_inner());
    let Some(b) = map.get(key) else {
        return (0, None);
    };
    let now = tokio::time::Instant::now();
    let wait = (b.fingerprint == fingerprint(m) && b.next_at > now).then(|| b.next_at - now);
    (b.attempts, wait)
}

fn set_backoff(ctx: &Context, key: &str, m: &Machine, op: BackoffOp) {
    let mut map = ctx.bmc_backoff.lock().unwrap_or_else(|p| p.into_inner());
    match op {
        BackoffOp::Keep => {}
        BackoffOp::Clear => {
            map.remove(key);
        }
        BackoffOp::Failed { reason, attempt } => {
            map.insert(
                key.to_string(),
                Backoff {
                    attempts: attempt,
                    next_at: tokio::time::Instant::now() + reason.retry_after(attempt),
                    fingerprint: fingerprint(m),
                },
            );
        }
    }
}

fn set_warned(ctx: &Context, key: &str, op: WarnOp) {
    let mut map = ctx.dhcp_warned.lock().unwrap_or_else(|p| p.into_inner());
    match op {
        WarnOp::Keep => {}
        WarnOp::Clear => {
            map.remove(key);
        }
        WarnOp::Set { since, periods } => {
            map.insert(key.to_string(), (since, periods));
        }
    }
}

fn warned_of(ctx: &Context, key: &str) -> Option<(i64, i64)> {
    ctx.dhcp_warned
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get(key)
        .copied()
}

fn action_of(outcome: &Outcome) -> Action {
    outcome
        .requeue()
        .map_or_else(Action::await_change, Action::requeue)
}

/// A live Machine: snapshot, decide, carry out.
pub(super) async fn apply(m: &Machine, ctx: &Context) -> Result<Action, Error> {
    let key = key_of(m)?;
    let ns = m.namespace().ok_or(Error::NoNamespace)?;
    let (bmc_attempts, bmc_backoff) = backoff_of(ctx, &key, m);
    let hardware_session = if handlers::wants_hardware(m) {
        Api::<MachineHardware>::namespaced(ctx.client.clone(), &ns)
            .get_opt(&m.name_any())
            .await
            .map_err(Error::kube("reading machinehardware"))?
            .and_then(|h| {
                h.annotations()
                    .get(crate::agentapi::SESSION_ANNOTATION)
                    .cloned()
            })
    } else {
        None
    };
    let mut snap = Snapshot {
        machine: m,
        now: Timestamp::now(),
        cfg: &ctx.cfg,
        bmc: Bmc::None,
        bmc_attempts,
        bmc_backoff,
        hardware_session,
        subnet: None,
        dhcp_warned: warned_of(ctx, &key),
        deploy: DeployView::NotRead,
    };
    if handlers::wants_deploy(m) {
        snap.deploy = crate::deploy::runs::view(&ctx.client, m, &ctx.cfg.deploy)
            .await
            .map_err(Error::kube("planning the deploy run"))?;
    }
    let mut client = None;
    if handlers::wants_bmc(&snap) {
        match bmc_client(m, ctx).await {
            Ok(Some(c)) => match c.system().await {
                Ok(sys) => {
                    snap.bmc = Bmc::Answer {
                        powered_on: sys.powered_on,
                        offers_http_boot: sys.offers_http_boot,
                    };
                    client = Some(c);
                }
                Err(e) => snap.bmc = Bmc::Failed(e.into()),
            },
            Ok(None) => {}
            Err(f) => snap.bmc = Bmc::Failed(f),
        }
    }
    if client.is_some() && handlers::wants_subnet(&snap) {
        // The DHCP gate of a power-on.
        let (sns, sname) = dhcp_gate::subnet_of(m);
        snap.subnet = Api::<Subnet>::namespaced(ctx.client.clone(), &sns)
            .get_opt(&sname)
            .await
            .map_err(Error::kube("reading the machine's subnet"))?;
    }
    let decision = handlers::apply(&snap);
    let outcome = carry_out(ctx, &snap, decision, client.as_ref()).await?;
    Ok(action_of(&outcome))
}

/// A deleted Machine: BMC cleanup, then the finalizer goes.
pub(super) async fn cleanup(m: &Machine, ctx: &Context) -> Result<Action, Error> {
    let key = key_of(m)?;
    let (bmc_attempts, _) = backoff_of(ctx, &key, m);
    let mut snap = Snapshot {
        machine: m,
        now: Timestamp::now(),
        cfg: &ctx.cfg,
        bmc: Bmc::None,
        bmc_attempts,
        bmc_backoff: None,
        hardware_session: None,
        subnet: None,
        dhcp_warned: None,
        deploy: DeployView::NotRead,
    };
    let mut client = None;
    if !handlers::skips_cleanup(m) {
        match bmc_client(m, ctx).await {
            Ok(Some(c)) => {
                snap.bmc = Bmc::Resolved;
                client = Some(c);
            }
            Ok(None) => {}
            Err(f) => snap.bmc = Bmc::Failed(f),
        }
    }
    let decision = handlers::delete(&snap);
    match carry_out(ctx, &snap, decision, client.as_ref()).await? {
        Outcome::CleanupPending { message } => Err(Error::CleanupPending(message)),
        outcome => Ok(action_of(&outcome)),
    }
}

/// Carries out a decision: the in-memory DHCP warning, a minted boot token,
/// the BMC calls (the first failure turns the decision into its fallback),
/// the backoff, a deleted boot token, then the one status write.
async fn carry_out(
    ctx: &Context,
    snap: &Snapshot<'_>,
    mut decision: Decision,
    client: Option<&BmcClient>,
) -> Result<Outcome, Error> {
    let m = snap.machine;
    let key = key_of(m)?;
    if decision.token == TokenOp::Mint {
        // A new boot token replaces the Secret before the status write: a
        // pass deciding from a stale cached copy would leave the Secret's
        // token out of step with the hash in status. Decide on the server's
        // copy only.
        let live =
            Api::<Machine>::namespaced(ctx.client.clone(), &m.namespace().unwrap_or_default())
                .get(&m.name_any())
                .await
                .map_err(Error::kube(
                    "reading the machine before minting a boot token",
                ))?;
        if live.resource_version() != m.resource_version() {
            return Err(Error::Stale {
                cached: m.resource_version().unwrap_or_default(),
                live: live.resource_version().unwrap_or_default(),
            });
        }
    }
    set_warned(ctx, &key, decision.dhcp_warned);
    let mut base = std::borrow::Cow::Borrowed(m);
    let mut minted = false;
    if decision.token == TokenOp::Mint && client.is_some() && !decision.actions.is_empty() {
        // An arm is recorded before the BMC is called: the status write
        // carries the resourceVersion read as its precondition, so a pass
        // that loses a race with another writer (409) has sent nothing to
        // the BMC, and the next pass sees the arm and does not power-cycle
        // the machine a second time. If a call then fails, the fallback is
        // written over this record (no token hash: the next pass mints).
        mint(m, ctx, &mut decision).await?;
        minted = true;
        base = std::borrow::Cow::Owned(write_status(m, ctx, &decision.draft.status).await?);
    }
    let mut i = 0;
    while let (Some(c), Some(planned)) = (client, decision.actions.get(i)) {
        let action = planned.action;
        match run_action(c, action, ctx).await {
            Ok(Some(event)) => decision.draft.events.push(event),
            Ok(None) => {}
            Err(f) => {
                decision = handlers::action_failed(&decision, i, &f, snap);
                break;
            }
        }
        i += 1;
    }
    if decision.token == TokenOp::Mint && !minted {
        mint(m, ctx, &mut decision).await?;
    }
    set_backoff(ctx, &key, m, decision.backoff);
    log(m, &decision);
    if decision.token == TokenOp::Delete {
        delete_boot_token_secrets(&ctx.client, m).await?;
    }
    if decision.commit || minted {
        commit(&base, ctx, decision.draft).await?;
    }
    Ok(decision.outcome)
}

/// Mints the boot token of `decision` (Secret written) and puts its hash
/// into the status to commit.
async fn mint(m: &Machine, ctx: &Context, decision: &mut Decision) -> Result<(), Error> {
    let hash = write_boot_token(m, ctx).await?;
    if let Some(nb) = decision.draft.status.net_boot.as_mut() {
        nb.token_hash = Some(hash);
    }
    Ok(())
}

/// Logs what a pass decided: its Events (a state change, a BMC failure,
/// a hold, …), the start of a DHCP hold, and its outcome.
fn log(m: &Machine, decision: &Decision) {
    for e in &decision.draft.events {
        let note = e.note.as_str();
        match e.reason {
            "StateChanged" => tracing::info!(note, "machine state changed"),
            "InspectionTimedOut" | reasons::BOOT_RETRY_EXHAUSTED => {
                tracing::warn!(reason = e.reason, note, "inspection deadline passed");
            }
            dhcp_gate::LIVE => tracing::info!(note, "dhcp reservation live; powering on"),
            dhcp_gate::OVERDUE_EVENT => tracing::warn!(note, "dhcp reservation overdue"),
            reason if e.type_ == EventType::Warning => {
                tracing::warn!(reason, note, "machine event");
            }
            reason => tracing::info!(reason, note, "machine event"),
        }
    }
    fn waiting(conds: &[anneal_api::Condition]) -> Option<&anneal_api::Condition> {
        condition(conds, dhcp_gate::CONDITION).filter(|c| c.status == "False")
    }
    let was_waiting = m
        .status
        .as_ref()
        .is_some_and(|st| waiting(&st.conditions).is_some());
    if !was_waiting && let Some(c) = waiting(&decision.draft.status.conditions) {
        tracing::info!(message = %c.message, "power-on held for the dhcp reservation");
    }
    if let BackoffOp::Failed { reason, attempt } = decision.backoff {
        tracing::info!(
            reason = reason.as_str(),
            attempt,
            retry_s = reason.retry_after(attempt).as_secs(),
            "bmc unavailable"
        );
    }
    tracing::debug!(outcome = ?decision.outcome, actions = decision.actions.len(), "pass decided");
}

/// One BMC call; an Event to add on success.
async fn run_action(
    c: &BmcClient,
    action: BmcAction,
    ctx: &Context,
) -> Result<Option<Event>, BmcFailure> {
    match action {
        BmcAction::Reset(kind) => c.reset(kind).await?,
        BmcAction::BootOnce { target, reset } => {
            c.set_boot_once(target).await?;
            c.reset(reset).await?;
        }
        BmcAction::Shutdown { announce } => {
            let outcome = c
                .shutdown(ctx.cfg.graceful_shutdown_timeout, handlers::SHUTDOWN_POLL)
                .await?;
            if announce {
                return Ok(Some(Event {
                    type_: EventType::Normal,
                    reason: "PoweredOff",
                    note: format!("idle machine powered off ({outcome:?})"),
                }));
            }
        }
        BmcAction::ClearOverride => {
            if let Err(e) = c.clear_boot_override().await {
                tracing::debug!(error = %e, "clearing the boot override failed; shutting down anyway");
            }
        }
    }
    Ok(None)
}

/// Mints a boot token, writes it to Secret `<machine>-boot-token` (owned
/// by the Machine) and returns its hash. bootd's copy goes into Secret
/// [`anneal_api::tenancy::BOOT_TOKENS_SECRET`] of the Subnet's namespace,
/// under the key [`anneal_api::tenancy::boot_token_secret`] names: the
/// only Secret bootd may read. That copy cannot be owned by the Machine
/// (one Secret for many Machines, maybe of other namespaces); it is
/// removed with the token and is spent anyway once the Machine's
/// `status.netBoot.tokenHash` moves on.
async fn write_boot_token(m: &Machine, ctx: &Context) -> Result<String, Error> {
    let ns = m.namespace().ok_or(Error::NoNamespace)?;
    let name = m.name_any();
    let (subnet_ns, key) = bootd_token_key(m)?;
    if subnet_ns != ns {
        // Another namespace's bootd Secret: only when its Subnet grants ours
        // (read fresh: a grant withdrawn a moment ago counts).
        let (_, sname) = dhcp_gate::subnet_of(m);
        let subnet = Api::<Subnet>::namespaced(ctx.client.clone(), &subnet_ns)
            .get_opt(&sname)
            .await
            .map_err(Error::kube("reading the machine's subnet"))?;
        bootd_copy_granted(m, subnet.as_ref()).map_err(Error::NotGranted)?;
    }
    let token = mint_token();
    let hash = token_hash(token.expose());
    let mut data = BTreeMap::new();
    data.insert(
        BOOT_TOKEN_KEY.to_string(),
        ByteString(token.expose().as_bytes().to_vec()),
    );
    let own = anneal_api::tenancy::boot_token_secret(&ns, &name, &ns);
    let secret = Secret {
        metadata: ObjectMeta {
            name: Some(own.clone()),
            namespace: Some(ns.clone()),
            owner_references: m.controller_owner_ref(&()).map(|o| vec![o]),
            labels: Some(BTreeMap::from([(
                BOOT_TOKEN_LABEL.to_string(),
                name.clone(),
            )])),
            ..ObjectMeta::default()
        },
        data: Some(data.clone()),
        type_: Some("Opaque".into()),
        ..Secret::default()
    };
    Api::<Secret>::namespaced(ctx.client.clone(), &ns)
        .patch(
            &own,
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(&secret),
        )
        .await
        .map_err(Error::kube("writing the boot token secret"))?;
    drop(data);
    set_bootd_token(
        &ctx.client,
        &subnet_ns,
        &key,
        Some(token.expose().as_bytes()),
    )
    .await
    .map_err(Error::kube(
        "writing bootd's boot token (secret anneal-boot-tokens)",
    ))?;
    drop(token);
    Ok(hash)
}

/// Whether bootd's copy of `m`'s boot token may go into its Subnet's
/// namespace: always its own; another only when that Subnet (`None`: not
/// found) lists the Machine's namespace in `spec.allowedNamespaces`.
fn bootd_copy_granted(m: &Machine, subnet: Option<&Subnet>) -> Result<(), String> {
    let ns = m.namespace().unwrap_or_default();
    let (sns, sname) = dhcp_gate::subnet_of(m);
    if sns == ns {
        return Ok(());
    }
    match subnet {
        Some(s) if s.grants(&ns) => Ok(()),
        Some(_) => Err(format!(
            "machine {ns}/{}: Subnet {sns}/{sname} does not list namespace {ns} in spec.allowedNamespaces; no boot token written to namespace {sns} (ask the Subnet's owner to add {ns}, or name a Subnet of namespace {ns})",
            m.name_any()
        )),
        None => Err(format!(
            "machine {ns}/{}: Subnet {sns}/{sname} not found; no boot token written to namespace {sns}",
            m.name_any()
        )),
    }
}

/// Where bootd reads a Machine's token: the Subnet's namespace and the
/// key in its Secret [`anneal_api::tenancy::BOOT_TOKENS_SECRET`].
fn bootd_token_key(m: &Machine) -> Result<(String, String), Error> {
    let ns = m.namespace().ok_or(Error::NoNamespace)?;
    let subnet_ns = m.spec.subnet_ref.namespace_or(&ns).to_string();
    let key = anneal_api::tenancy::boot_token_secret(&ns, &m.name_any(), &subnet_ns);
    Ok((subnet_ns, key))
}

/// Sets (`Some`) or removes (`None`) key `key` of Secret
/// [`anneal_api::tenancy::BOOT_TOKENS_SECRET`] in `namespace`, creating the
/// Secret when absent. A merge patch of that one key: the API server
/// applies concurrent patches of other keys one after the other, so
/// passes of several Machines never overwrite each other's tokens.
async fn set_bootd_token(
    client: &kube::Client,
    namespace: &str,
    key: &str,
    token: Option<&[u8]>,
) -> Result<(), kube::Error> {
    use anneal_api::tenancy::BOOT_TOKENS_SECRET;
    let api = Api::<Secret>::namespaced(client.clone(), namespace);
    let value = token.map(|t| ByteString(t.to_vec()));
    let patch = json!({"data": {key: value}});
    let pp = PatchParams {
        field_manager: Some(FIELD_MANAGER.into()),
        ..PatchParams::default()
    };
    // at most: a 404, a create that lost the race (409), the patch again
    for _ in 0..3 {
        match api
            .patch(BOOT_TOKENS_SECRET, &pp, &Patch::Merge(&patch))
            .await
        {
            Ok(_) => return Ok(()),
            Err(kube::Error::Api(e)) if e.code == 404 => {
                let Some(t) = token else {
                    return Ok(());
                };
                let secret = Secret {
                    metadata: ObjectMeta {
                        name: Some(BOOT_TOKENS_SECRET.into()),
                        namespace: Some(namespace.into()),
                        labels: Some(BTreeMap::from([(
                            "app.kubernetes.io/managed-by".to_string(),
                            "anneal-manager".to_string(),
                        )])),
                        ..ObjectMeta::default()
                    },
                    data: Some(BTreeMap::from([(key.to_string(), ByteString(t.to_vec()))])),
                    type_: Some("Opaque".into()),
                    ..Secret::default()
                };
                match api.create(&Default::default(), &secret).await {
                    Ok(_) => return Ok(()),
                    Err(kube::Error::Api(e)) if e.code == 409 => continue,
                    Err(e) => return Err(e),
                }
            }
            Err(e) => return Err(e),
        }
    }
    api.patch(BOOT_TOKENS_SECRET, &pp, &Patch::Merge(&patch))
        .await
        .map(|_| ())
}

/// Where a Machine's boot-token Secrets are, or were: `(namespace, name)`,
/// the Machine's own namespace first, then, when the Subnet's differs, the
/// copy Secret a manager before `anneal-boot-tokens` published there (both
/// named by [`anneal_api::tenancy::boot_token_secret`]); deleted with the
/// token so that no copy outlives an upgrade.
fn boot_token_places(m: &Machine) -> Result<Vec<(String, String)>, Error> {
    let ns = m.namespace().ok_or(Error::NoNamespace)?;
    let name = m.name_any();
    let subnet_ns = m.spec.subnet_ref.namespace_or(&ns).to_string();
    let mut places = vec![ns.clone()];
    if subnet_ns != ns {
        places.push(subnet_ns);
    }
    Ok(places
        .into_iter()
        .map(|p| {
            let secret = anneal_api::tenancy::boot_token_secret(&ns, &name, &p);
            (p, secret)
        })
        .collect())
}

/// Deletes a Machine's boot tokens: its own Secret, bootd's key in
/// `anneal-boot-tokens` (and a copy Secret an older manager wrote).
pub async fn delete_boot_token_secrets(client: &kube::Client, m: &Machine) -> Result<(), Error> {
    for (ns, name) in boot_token_places(m)? {
        match Api::<Secret>::namespaced(client.clone(), &ns)
            .delete(&name, &Default::default())
            .await
        {
            Ok(_) => {}
            Err(kube::Error::Api(e)) if e.code == 404 => {}
            Err(source) => {
                return Err(Error::Kube {
                    what: "deleting the boot token secret",
                    source,
                });
            }
        }
    }
    let (subnet_ns, key) = bootd_token_key(m)?;
    set_bootd_token(client, &subnet_ns, &key, None)
        .await
        .map_err(Error::kube(
            "removing bootd's boot token (secret anneal-boot-tokens)",
        ))?;
    Ok(())
}

/// The merge patch of `status` over `m`'s (`None`: nothing to write).
/// `observedGeneration` moves with a status write and never causes one: a
/// spec write that changes nothing this controller reports (the claim
/// controller's bind, `spec.claimRef`) writes no status.
fn status_patch(m: &Machine, status: &anneal_api::MachineStatus) -> Option<serde_json::Value> {
    let current = m.status.clone().unwrap_or_default();
    let mut status = status.clone();
    status.observed_generation = current.observed_generation;
    if status == current {
        return None;
    }
    status.observed_generation = m.metadata.generation;
    let old = serde_json::to_value(&current).unwrap_or_default();
    let new = serde_json::to_value(&status).unwrap_or_default();
    merge_diff(&old, &new)
}

/// Writes `status` over `m`'s as a merge patch of the difference
/// ([`status_patch`]), with `m`'s resourceVersion as the precondition;
/// returns the Machine written (`m` itself when nothing differs).
async fn write_status(
    m: &Machine,
    ctx: &Context,
    status: &anneal_api::MachineStatus,
) -> Result<Machine, Error> {
    let ns = m.namespace().ok_or(Error::NoNamespace)?;
    let api = Api::<Machine>::namespaced(ctx.client.clone(), &ns);
    let Some(diff) = status_patch(m, status) else {
        return Ok(m.clone());
    };
    let pp = PatchParams {
        field_manager: Some(FIELD_MANAGER.into()),
        ..PatchParams::default()
    };
    let patch = json!({
        "metadata": {"resourceVersion": m.resource_version()},
        "status": diff,
    });
    api.patch_status(&m.name_any(), &pp, &Patch::Merge(&patch))
        .await
        .map_err(Error::kube("writing machine status"))
}

/// Writes the status difference (with the resourceVersion read as a
/// precondition), drops consumed annotations, publishes Events.
async fn commit(m: &Machine, ctx: &Context, d: Draft) -> Result<(), Error> {
    let ns = m.namespace().ok_or(Error::NoNamespace)?;
    let name = m.name_any();
    let api = Api::<Machine>::namespaced(ctx.client.clone(), &ns);
    let pp = PatchParams {
        field_manager: Some(FIELD_MANAGER.into()),
        ..PatchParams::default()
    };
    write_status(m, ctx, &d.status).await?;
    if !d.drop_annotations.is_empty() {
        let mut anns = serde_json::Map::new();
        for a in &d.drop_annotations {
            anns.insert((*a).to_string(), serde_json::Value::Null);
        }
        let patch = json!({"metadata": {"annotations": anns}});
        api.patch(&name, &pp, &Patch::Merge(&patch))
            .await
            .map_err(Error::kube("removing consumed annotations"))?;
    }
    if d.delete_hardware {
        match Api::<MachineHardware>::namespaced(ctx.client.clone(), &ns)
            .delete(&name, &Default::default())
            .await
        {
            Ok(_) => tracing::info!(machine = %name, "re-inspect: the old MachineHardware deleted"),
            Err(kube::Error::Api(e)) if e.code == 404 => {}
            Err(e) => return Err(Error::kube("deleting the old MachineHardware")(e)),
        }
    }
    let reference = m.object_ref(&());
    for e in d.events {
        let ev = KubeEvent {
            type_: e.type_,
            reason: e.reason.into(),
            action: crate::controller::event_action("Reconcile", &e.note),
            note: Some(crate::controller::event_note(e.note)),
            secondary: None,
        };
        if let Err(err) = ctx.recorder.publish(&ev, &reference).await {
            tracing::warn!(error = %err, "cannot publish event");
        }
    }
    Ok(())
}

/// Refuses, before any Secret is read or any request sent, a BMC access a
/// tenant must not have: a Secret reference into another namespace than
/// the Machine's `ns` (admission refuses one today; an object admitted
/// before still reaches here), and plain HTTP unless the manager runs with
/// `--allow-insecure-bmc`.
pub fn refuse_unsafe_access(
    bmc: &anneal_api::BmcSpec,
    address: &BmcAddress,
    ns: &str,
    allow_insecure: bool,
) -> Result<(), BmcFailure> {
    let refs = [
        (
            "spec.bmc.credentialsSecretRef",
            Some(&bmc.credentials_secret_ref),
        ),
        (
            "spec.bmc.caBundleSecretRef",
            bmc.ca_bundle_secret_ref.as_ref(),
        ),
    ];
    for (field, r) in refs {
        if let Some(r) = r
            && r.namespace_or(ns) != ns
        {
            return Err(BmcFailure {
                reason: BmcReason::CrossNamespaceSecret,
                message: format!(
                    "{field}.namespace: {other:?} must be the Machine's own namespace ({ns}) or empty; Secret {other}/{name} was not read: remove the namespace and create the Secret in {ns}",
                    other = r.namespace_or(ns),
                    name = r.name,
                ),
            });
        }
    }
    if address.scheme == Scheme::Http && !allow_insecure {
        return Err(BmcFailure {
            reason: BmcReason::InsecureBmcRefused,
            message: format!(
                "spec.bmc.address {:?} is plain HTTP (the credentials would travel in clear): use redfish:// (HTTPS), or start the manager with --allow-insecure-bmc (labs only)",
                bmc.address
            ),
        });
    }
    Ok(())
}

/// Reads the BMC access of a machine into a client (None: no BMC).
/// The key of a BMC credentials Secret that lists where it may be sent.
pub const ADDRESSES_KEY: &str = "addresses";

/// Whether `host` (a BMC address's host: a name or an IP) is in `list`:
/// entries separated by commas, spaces or newlines, each a host name
/// (compared without case), an IP address, or an IPv4/IPv6 network in
/// CIDR form containing `host`; `#` starts a comment line.
pub fn address_listed(list: &str, host: &str) -> bool {
    let ip: Option<std::net::IpAddr> = host.parse().ok();
    list.lines()
        .filter(|l| !l.trim_start().starts_with('#'))
        .flat_map(|l| l.split([',', ' ', '\t']))
        .map(str::trim)
        .filter(|e| !e.is_empty())
        .any(|e| match (e.split_once('/'), ip) {
            (Some((net, len)), Some(ip)) => in_network(ip, net, len),
            (Some(_), None) => false,
            (None, Some(ip)) => e.parse::<std::net::IpAddr>().is_ok_and(|x| x == ip),
            (None, None) => e.eq_ignore_ascii_case(host),
        })
}

fn in_network(ip: std::net::IpAddr, net: &str, len: &str) -> bool {
    use std::net::IpAddr;
    let Ok(len) = len.parse::<u32>() else {
        return false;
    };
    match (ip, net.parse::<IpAddr>()) {
        (IpAddr::V4(a), Ok(IpAddr::V4(n))) if len <= 32 => {
            let mask = u32::MAX.checked_shl(32 - len).unwrap_or(0);
            u32::from(a) & mask == u32::from(n) & mask
        }
        (IpAddr::V6(a), Ok(IpAddr::V6(n))) if len <= 128 => {
            let mask = u128::MAX.checked_shl(128 - len).unwrap_or(0);
            u128::from(a) & mask == u128::from(n) & mask
        }
        _ => false,
    }
}

async fn bmc_client(m: &Machine, ctx: &Context) -> Result<Option<BmcClient>, BmcFailure> {
    let Some(bmc) = &m.spec.bmc else {
        return Ok(None);
    };
    let ns = m.namespace().unwrap_or_default();
    let address = BmcAddress::parse(&bmc.address)?;
    refuse_unsafe_access(bmc, &address, &ns, ctx.cfg.allow_insecure_bmc)?;
    let insecure = bmc.insecure_skip_verify.unwrap_or(false);
    if insecure && bmc.ca_bundle_secret_ref.is_some() {
        return Err(BmcFailure {
            reason: BmcReason::TlsConfigConflict,
            message: "insecureSkipVerify and caBundleSecretRef are mutually exclusive".into(),
        });
    }
    let secret_key = |s: &Secret, key: &str| -> Option<Vec<u8>> {
        s.data
            .as_ref()
            .and_then(|d| d.get(key))
            .map(|b| b.0.clone())
            .or_else(|| {
                s.string_data
                    .as_ref()
                    .and_then(|d| d.get(key))
                    .map(|v| v.clone().into_bytes())
            })
    };
    let cref = &bmc.credentials_secret_ref;
    // Only ever the Machine's own namespace (refuse_unsafe_access checked
    // the references name no other).
    let secrets = Api::<Secret>::namespaced(ctx.client.clone(), &ns);
    let missing = |what: String| BmcFailure {
        reason: BmcReason::CredentialsMissing,
        message: what,
    };
    let secret = match secrets.get_opt(&cref.name).await {
        Ok(Some(s)) => s,
        Ok(None) => return Err(missing(format!("secret {} not found", cref.name))),
        Err(kube::Error::Api(e)) if e.code == 403 => {
            return Err(BmcFailure {
                reason: BmcReason::QueryFailed,
                message: format!(
                    "cannot read secret {}: the manager may not read Secrets in namespace {ns}: bind ClusterRole anneal-manager-secrets there (kubectl create rolebinding anneal-manager-secrets -n {ns} --clusterrole=anneal-manager-secrets --serviceaccount=anneal-system:anneal-manager)",
                    cref.name
                ),
            });
        }
        Err(e) => {
            return Err(BmcFailure {
                reason: BmcReason::QueryFailed,
                message: format!("cannot read secret {}: {e}", cref.name),
            });
        }
    };
    if let Some(list) = secret_key(&secret, ADDRESSES_KEY) {
        let list = String::from_utf8_lossy(&list);
        if !address_listed(&list, &address.host) {
            return Err(BmcFailure {
                reason: BmcReason::CredentialsNotAuthorized,
                message: format!(
                    "secret {} may be sent only to the BMC addresses its key {ADDRESSES_KEY} lists, and {} is not one of them: add it there or correct spec.bmc.address",
                    cref.name, address.host
                ),
            });
        }
    }
    let username = secret_key(&secret, "username")
        .and_then(|b| String::from_utf8(b).ok())
        .ok_or_else(|| missing(format!("secret {} lacks username", cref.name)))?;
    let password = secret_key(&secret, "password")
        .and_then(|b| String::from_utf8(b).ok())
        .ok_or_else(|| missing(format!("secret {} lacks password", cref.name)))?;
    if address.scheme == Scheme::Ipmi {
        // caBundleSecretRef and insecureSkipVerify do not apply: RMCP+
        // authenticates both ends with the password (RAKP).
        return Ok(Some(BmcClient::Ipmi(IpmiClient::new(
            &address.host,
            address.port,
            &username,
            Token::new(password),
            ctx.cfg.bmc_timeout,
        ))));
    }
    let tls = if insecure {
        TlsPolicy::InsecureSkipVerify
    } else if let Some(ca) = &bmc.ca_bundle_secret_ref {
        let api = Api::<Secret>::namespaced(ctx.client.clone(), &ns);
        let pem = match api.get_opt(&ca.name).await {
            Ok(Some(s)) => secret_key(&s, "ca.crt"),
            _ => None,
        };
        TlsPolicy::CaBundle(pem.ok_or_else(|| BmcFailure {
            reason: BmcReason::TlsConfigConflict,
            message: format!("ca bundle secret {} lacks ca.crt", ca.name),
        })?)
    } else {
        TlsPolicy::SystemRoots
    };
    let creds = Credentials {
        username,
        password: Token::new(password),
    };
    Ok(Some(BmcClient::Redfish(RedfishClient::new(
        &address,
        &creds,
        &tls,
        ctx.cfg.bmc_timeout,
    )?)))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn the_boot_token_copy_goes_only_where_the_subnet_grants() {
        let machine = |ns: &str| -> Machine {
            serde_json::from_value(json!({
                "apiVersion": "anneal.dev/v1alpha1", "kind": "Machine",
                "metadata": {"name": "m", "namespace": ns},
                "spec": {"subnetRef": {"name": "rack1", "namespace": "anneal-system"}},
            }))
            .unwrap()
        };
        let subnet = |allowed: &[&str]| -> Subnet {
            serde_json::from_value(json!({
                "apiVersion": "anneal.dev/v1alpha1", "kind": "Subnet",
                "metadata": {"name": "rack1", "namespace": "anneal-system"},
                "spec": {"siteRef": {"name": "site"}, "cidr": "10.77.0.0/24",
                    "bootd": {"serverIP": "10.77.0.2", "mode": "External"},
                    "allowedNamespaces": allowed},
            }))
            .unwrap()
        };
        // its own namespace: always
        assert_eq!(bootd_copy_granted(&machine("anneal-system"), None), Ok(()));
        // another's: only when listed
        assert_eq!(
            bootd_copy_granted(&machine("team-a"), Some(&subnet(&["team-a"]))),
            Ok(())
        );
        let refused =
            bootd_copy_granted(&machine("team-b"), Some(&subnet(&["team-a"]))).unwrap_err();
        assert!(
            refused.contains("machine team-b/m")
                && refused.contains("does not list namespace team-b")
                && refused.contains("no boot token written to namespace anneal-system"),
            "{refused}"
        );
        let gone = bootd_copy_granted(&machine("team-a"), None).unwrap_err();
        assert!(gone.contains("not found"), "{gone}");
    }

    #[test]
    fn a_bind_alone_writes_no_status() {
        let m: Machine = serde_json::from_value(json!({
            "apiVersion": "anneal.dev/v1alpha1", "kind": "Machine",
            "metadata": {"name": "m", "namespace": "ns", "generation": 3},
            "spec": {"subnetRef": {"name": "s"}, "claimRef": {"name": "c"}},
            "status": {"state": "Available", "observedGeneration": 2}
        }))
        .unwrap();
        // the claim's bind moved the generation; the pass changes nothing
        let same = m.status.clone().unwrap();
        assert_eq!(status_patch(&m, &same), None);
        // a change is written with the generation it saw
        let mut deploying = same;
        deploying.state = Some(anneal_api::MachineState::Provisioning);
        assert_eq!(
            status_patch(&m, &deploying),
            Some(json!({"state": "Provisioning", "observedGeneration": 3}))
        );
    }

    #[test]
    fn a_credentials_secret_goes_only_to_the_addresses_it_lists() {
        let list = "# rack 7\n10.7.0.0/24, bmc-r8.example.net\n2001:db8::/64 192.0.2.9";
        for host in [
            "10.7.0.15",
            "BMC-R8.example.net",
            "2001:db8::42",
            "192.0.2.9",
        ] {
            assert!(address_listed(list, host), "{host}");
        }
        for host in [
            "10.7.1.15",
            "bmc-r9.example.net",
            "2001:db9::1",
            "192.0.2.90",
            "rack",
            "10.7.0.0.evil.example",
        ] {
            assert!(!address_listed(list, host), "{host}");
        }
        assert!(
            !address_listed("", "10.7.0.15"),
            "an empty list allows nothing"
        );
        assert!(!address_listed("10.0.0.0/40", "10.0.0.1"));
    }

    fn bmc(address: &str, creds_ns: Option<&str>, ca_ns: Option<&str>) -> anneal_api::BmcSpec {
        serde_json::from_value(json!({
            "address": address,
            "credentialsSecretRef": {"name": "bmc", "namespace": creds_ns},
            "caBundleSecretRef": {"name": "ca", "namespace": ca_ns},
        }))
        .unwrap()
    }

    fn check(b: &anneal_api::BmcSpec, allow_insecure: bool) -> Result<(), BmcFailure> {
        let address = BmcAddress::parse(&b.address).unwrap();
        refuse_unsafe_access(b, &address, "tenant-a", allow_insecure)
    }

    #[test]
    fn own_namespace_or_empty_only_and_plain_http_only_when_allowed() {
        let https = "redfish://10.0.0.1";
        assert_eq!(check(&bmc(https, None, None), false), Ok(()));
        assert_eq!(
            check(&bmc(https, Some("tenant-a"), Some("")), false),
            Ok(())
        );
        let f = check(&bmc(https, Some("tenant-b"), None), true).unwrap_err();
        assert_eq!(f.reason, BmcReason::CrossNamespaceSecret);
        assert!(
            f.message.starts_with("spec.bmc.credentialsSecretRef.namespace: \"tenant-b\" must be the Machine's own namespace (tenant-a) or empty"),
            "{}",
            f.message
        );
        let f = check(&bmc(https, None, Some("tenant-b")), true).unwrap_err();
        assert_eq!(f.reason, BmcReason::CrossNamespaceSecret);
        assert!(
            f.message
                .starts_with("spec.bmc.caBundleSecretRef.namespace"),
            "{}",
            f.message
        );

        let http = "redfish+http://10.0.0.1:8000";
        let f = check(&bmc(http, None, None), false).unwrap_err();
        assert_eq!(f.reason, BmcReason::InsecureBmcRefused);
        assert!(f.message.contains("--allow-insecure-bmc"), "{}", f.message);
        assert_eq!(check(&bmc(http, None, None), true), Ok(()));
        // a foreign Secret stays refused even with plain HTTP allowed
        assert_eq!(
            check(&bmc(http, Some("tenant-b"), None), true)
                .unwrap_err()
                .reason,
            BmcReason::CrossNamespaceSecret
        );
    }
}
