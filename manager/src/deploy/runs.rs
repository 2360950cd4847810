//! The API side of planning: gathers what [`super::plan::plan`] needs for
//! a claimed Machine, writes the DeployRun and its plan Secret, and reads the
//! current run back for the lifecycle's state handlers
//! ([`crate::lifecycle::handlers::DeployView`]).
//!
//! A DeployRun is named `<machine>-<intent>-<attempt>`: `<intent>` is the
//! first 8 hex digits of the SHA-256 of the claim's UID and the run's spec
//! without `resolvedDisks`, so a replan of the same intent finds the run it
//! wrote before (nothing is written twice after a crash between the create
//! and the Machine's status write), and a failed attempt is followed by
//! `-<attempt+1>`. Its plan (script bodies included, which may come from
//! Secrets) is kept in Secret `<run>-plan`, owned by the run, read only by
//! the agent API.

use std::collections::{BTreeMap, BTreeSet};

use anneal_api::{
    Architecture, DeployRun, DeployRunSpec, DeployRunStatus, Image, Machine, MachineClaim,
    MachineHardware, MachineState, PartitionContent, PostHook, RunPhase,
};
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ListParams, ObjectMeta, Patch, PatchParams, PostParams};
use kube::{Client, Resource as _, ResourceExt};
use serde_json::json;
use sha2::{Digest, Sha256};

use super::plan::{self, Inputs, hook_order, intent_differs};
use crate::lifecycle::handlers::DeployView;

/// Label on DeployRuns naming their Machine.
pub const MACHINE_LABEL: &str = "anneal.dev/machine";
/// Label on DeployRuns carrying the intent hash (8 hex digits).
pub const INTENT_LABEL: &str = "anneal.dev/intent";
/// Annotation on DeployRuns listing the PartitionContents their plan
/// streams (comma separated): a content an active run uses cannot be
/// deleted (docs/api.md, PartitionContent).
pub const CONTENTS_ANNOTATION: &str = "anneal.dev/contents";
/// Key of the plan JSON in Secret `<run>-plan`.
pub const PLAN_KEY: &str = "plan.json";
/// The field manager of run writes.
pub const FIELD_MANAGER: &str = "anneal-deploy";

/// Deploy settings of the manager.
#[derive(Debug, Clone, Default)]
pub struct DeployConfig {
    /// Base URL agents reach the content server at (`http://10.0.0.1:8081`).
    pub content_url: Option<String>,
    /// Seconds between two progress reports of an agent.
    pub progress_interval_seconds: u32,
    /// A started run whose agent reports nothing for this long fails (the
    /// machine lost power, the agent died); None: never.
    pub stall_timeout: Option<std::time::Duration>,
    /// How long a run may take from its creation before it fails (a claim's
    /// `spec.deployDeadline` overrides it); None: no deadline.
    pub deadline: Option<std::time::Duration>,
    /// Distribution settings: a Machine whose Site has a tracker gets its
    /// contents over BitTorrent.
    pub swarm: crate::swarm::SwarmConfig,
}

fn run_image(spec: &DeployRunSpec) -> Option<String> {
    spec.image_ref
        .as_ref()
        .or_else(|| spec.data_images.first().map(|d| &d.image_ref))
        .map(|r| r.name.clone())
}

/// The Secret holding a run's plan.
pub fn plan_secret_name(run: &str) -> String {
    format!("{run}-plan")
}

fn intent_hash(claim_uid: &str, spec: &DeployRunSpec) -> String {
    let mut s = spec.clone();
    s.resolved_disks.clear();
    let json = serde_json::to_vec(&s).unwrap_or_default();
    let mut h = Sha256::new();
    h.update(claim_uid.as_bytes());
    h.update(&json);
    hex::encode(&h.finalize()[..4])
}

/// What the lifecycle's handlers need to know about runs for `m`.
pub async fn view(
    client: &Client,
    m: &Machine,
    cfg: &DeployConfig,
) -> Result<DeployView, kube::Error> {
    let ns = m.namespace().unwrap_or_default();
    let name = m.name_any();
    let st = m.status.clone().unwrap_or_default();
    let state = st.state.unwrap_or(MachineState::Enrolling);
    let runs: Api<DeployRun> = Api::namespaced(client.clone(), &ns);
    if state == MachineState::Provisioning
        && let Some(cur) = &st.current_run_ref
    {
        return Ok(match runs.get_opt(&cur.name).await? {
            Some(r) => {
                let mut rs = r.status.clone().unwrap_or_default();
                if let Some(stalled) = stalled(&rs, cfg).or_else(|| overdue(&rs, Timestamp::now()))
                {
                    fail_run(&runs, &r, &mut rs, &stalled).await?;
                }
                let message = rs
                    .conditions
                    .iter()
                    .find(|c| c.type_ == anneal_api::conditions::types::SUCCEEDED)
                    .map(|c| c.message.clone())
                    .unwrap_or_default();
                DeployView::Current {
                    run: cur.name.clone(),
                    phase: rs.phase,
                    message,
                    image: run_image(&r.spec),
                    percent: rs.percent,
                }
            }
            None => DeployView::Current {
                run: cur.name.clone(),
                phase: Some(RunPhase::Failed),
                message: format!("DeployRun {} was deleted while active", cur.name),
                image: None,
                percent: None,
            },
        });
    }
    let Some(cref) = &m.spec.claim_ref else {
        return Ok(DeployView::NotRead);
    };
    if cref.namespace_or(&ns) != ns {
        // never followed: a claim binds only Machines of its own namespace
        // (docs/api.md, Machine `spec.claimRef`); admission refuses such a claimRef
        tracing::warn!(machine = %name, namespace = %ns, claim = %cref.name,
            claim_namespace = cref.namespace_or(&ns),
            "spec.claimRef names a claim of another namespace: ignored, nothing is planned");
        return Ok(DeployView::NotRead);
    }
    let claims: Api<MachineClaim> = Api::namespaced(client.clone(), &ns);
    let Some(claim) = claims.get_opt(&cref.name).await? else {
        return Ok(DeployView::NotRead);
    };
    if !crate::claims::select::binding_holds(m, &claim) {
        return Ok(DeployView::NotRead);
    }
    if state == MachineState::Enrolling {
        // an externally provisioned server: adopted for this claim
        return Ok(if m.spec.externally_provisioned {
            DeployView::Adoptable {
                claim: claim.name_any(),
                generation: claim.metadata.generation.unwrap_or(0),
            }
        } else {
            DeployView::NotRead
        });
    }
    if state == MachineState::Provisioned
        && let Some(a) = &st.adopted
        && a.claim == claim.name_any()
        && Some(a.claim_generation) == claim.metadata.generation
    {
        // the adopted server runs this intent already
        return Ok(DeployView::UpToDate);
    }
    if claim.spec.image_ref.is_none() && claim.spec.data_images.is_empty() {
        // a claim naming no image only holds the machine: nothing to plan,
        // nothing to report (no DeployPlanFailed on every bind)
        return Ok(DeployView::NotRead);
    }
    let planned = match gather_and_plan(client, m, &claim, cfg).await? {
        Ok(p) => p,
        Err(e) => return Ok(DeployView::PlanFailed(e)),
    };
    if state == MachineState::Provisioned
        && let Some(last) = &st.last_successful_run_ref
        && let Some(r) = runs.get_opt(&last.name).await?
        && !intent_differs(&r.spec, &planned.spec)
    {
        return Ok(DeployView::UpToDate);
    }
    let image = run_image(&planned.spec);
    let run = ensure_run(
        client,
        m,
        &claim,
        cfg,
        planned,
        st.last_attempted_run_ref.as_ref().map(|r| r.name.as_str()),
    )
    .await?;
    Ok(DeployView::Ready { run, image })
}

/// The stall message when a started run's agent has been silent longer than
/// the stall timeout.
fn stalled(rs: &DeployRunStatus, cfg: &DeployConfig) -> Option<String> {
    let timeout = cfg.stall_timeout?;
    if matches!(
        rs.phase,
        None | Some(RunPhase::Pending | RunPhase::Succeeded | RunPhase::Failed)
    ) {
        return None;
    }
    let last = rs.last_progress_time.as_ref()?;
    let secs = k8s_openapi::jiff::Timestamp::now()
        .duration_since(last.0)
        .as_secs();
    (secs >= i64::try_from(timeout.as_secs()).unwrap_or(i64::MAX)).then(|| {
        format!(
            "{:?}: the agent sent no progress for {secs} s (the machine lost power or the agent died); a new run follows",
            rs.phase.unwrap_or(RunPhase::Pending)
        )
    })
}

/// The failure message of a started run past its deadline (from its first
/// phase's start, `status.deadlineSeconds`).
fn overdue(rs: &DeployRunStatus, now: Timestamp) -> Option<String> {
    if matches!(
        rs.phase,
        None | Some(RunPhase::Pending | RunPhase::Succeeded | RunPhase::Failed)
    ) {
        return None;
    }
    let secs = rs.deadline_seconds?;
    let start = rs.phase_timings.first()?.start.as_ref()?;
    let ran = now.duration_since(start.0).as_secs();
    (ran > secs).then(|| {
        format!(
            "{:?}: the run did not end within its deadline of {secs} s (it started {ran} s ago; set the claim's spec.deployDeadline, or the manager's --deploy-deadline, to allow more); a new run follows",
            rs.phase.unwrap_or(RunPhase::Pending),
        )
    })
}

/// A claim's deadline, or the manager's: `Err` names the field.
fn deadline_of(
    claim: &MachineClaim,
    cfg: &DeployConfig,
) -> Result<Option<std::time::Duration>, String> {
    match claim.spec.deploy_deadline.as_deref() {
        Some(s) => crate::lifecycle::status::parse_duration_ms(s)
            .and_then(|ms| u64::try_from(ms).ok())
            .filter(|ms| *ms >= 1000)
            .map(|ms| Some(std::time::Duration::from_millis(ms)))
            .ok_or_else(|| {
                format!("spec.deployDeadline: {s:?} is not a duration of at least 1s (write e.g. 45m or 1h30m)")
            }),
        None => Ok(cfg.deadline),
    }
}

async fn fail_run(
    runs: &Api<DeployRun>,
    r: &DeployRun,
    rs: &mut DeployRunStatus,
    message: &str,
) -> Result<(), kube::Error> {
    rs.phase = Some(RunPhase::Failed);
    if let Some(last) = rs.phase_timings.last_mut()
        && last.end.is_none()
    {
        last.end = Some(anneal_api::Time(k8s_openapi::jiff::Timestamp::now()));
    }
    crate::conditions::set(
        &mut rs.conditions,
        anneal_api::conditions::types::SUCCEEDED,
        false,
        anneal_api::conditions::reasons::DEPLOY_FAILED,
        message,
        r.metadata.generation,
    );
    runs.patch_status(
        &r.name_any(),
        &PatchParams {
            field_manager: Some(FIELD_MANAGER.into()),
            ..PatchParams::default()
        },
        &Patch::Merge(&json!({
            "metadata": {"resourceVersion": r.resource_version()},
            "status": rs,
        })),
    )
    .await?;
    tracing::warn!(run = %r.name_any(), message, "deploy run stalled");
    Ok(())
}

async fn gather_and_plan(
    client: &Client,
    m: &Machine,
    claim: &MachineClaim,
    cfg: &DeployConfig,
) -> Result<Result<plan::Planned, String>, kube::Error> {
    let ns = claim.namespace().unwrap_or_default();
    if let Err(e) = deadline_of(claim, cfg) {
        return Ok(Err(e));
    }
    let Some(content_url) = cfg.content_url.as_deref() else {
        return Ok(Err(
            "the manager has no content server URL for agents (start it with --content-url or --content-listen on a routable address)".into(),
        ));
    };
    let hw = Api::<MachineHardware>::namespaced(client.clone(), &m.namespace().unwrap_or_default())
        .get_opt(&m.name_any())
        .await?;
    let images_api: Api<Image> = Api::namespaced(client.clone(), &ns);
    let mut images = BTreeMap::new();
    let mut wanted: Vec<String> = claim
        .spec
        .image_ref
        .iter()
        .map(|r| r.name.clone())
        .collect();
    wanted.extend(
        claim
            .spec
            .data_images
            .iter()
            .map(|d| d.image_ref.name.clone()),
    );
    for n in wanted {
        if let Some(i) = images_api.get_opt(&n).await? {
            images.insert(n, i);
        }
    }
    let contents_api: Api<PartitionContent> = Api::namespaced(client.clone(), &ns);
    let mut contents = BTreeMap::new();
    for i in images.values() {
        for s in &i.spec.layout.slots {
            if let Some(r) = &s.content_ref
                && let Some(pc) = contents_api.get_opt(&r.name).await?
            {
                contents.insert(r.name.clone(), pc);
            }
        }
    }
    let hooks_api: Api<PostHook> = Api::namespaced(client.clone(), &ns);
    let mut hooks = BTreeMap::new();
    let os = claim
        .spec
        .image_ref
        .as_ref()
        .and_then(|r| images.get(&r.name));
    // the Image's Day-1 defaults fill what the claim leaves unset
    let effective = super::cloudinit::with_image_defaults(claim, os);
    let claim = &*effective;
    for h in hook_order(os, claim) {
        if let Some(hook) = hooks_api.get_opt(&h).await? {
            hooks.insert(h, hook);
        }
    }
    let mut scripts = BTreeMap::new();
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), &ns);
    let secrets: Api<Secret> = Api::namespaced(client.clone(), &ns);
    for h in hooks.values() {
        for step in &h.spec.steps {
            let Some(src) = &step.script else { continue };
            if let Some(r) = &src.config_map_ref
                && let Some(cm) = cms.get_opt(&r.name).await?
                && let Some(v) = cm.data.as_ref().and_then(|d| d.get(&r.key))
            {
                scripts.insert(format!("configmap/{}/{}", r.name, r.key), v.clone());
            }
            if let Some(r) = &src.secret_ref
                && let Some(s) = secrets.get_opt(&r.name).await?
                && let Some(v) = s.data.as_ref().and_then(|d| d.get(&r.key))
            {
                scripts.insert(
                    format!("secret/{}/{}", r.name, r.key),
                    String::from_utf8_lossy(&v.0).into_owned(),
                );
            }
        }
    }
    let machine = format!("{}/{}", m.namespace().unwrap_or_default(), m.name_any());
    let arch = match m.spec.architecture {
        Architecture::X86_64 => "x86_64",
        Architecture::Aarch64 => "aarch64",
    };
    let seed = m.uid().unwrap_or_default();
    let disks = hw.as_ref().map(|h| h.spec.disks.as_slice());
    let swarm = crate::swarm::plan_inputs(client, m, &cfg.swarm).await?;
    let day1 = if super::cloudinit::wanted(claim) {
        Some(gather_day1(client, m, claim, hw.as_ref(), &secrets).await?)
    } else {
        None
    };
    let inputs = Inputs {
        claim,
        machine: &machine,
        architecture: arch,
        disks,
        images: &images,
        contents: &contents,
        hooks: &hooks,
        scripts: &scripts,
        content_url: content_url.trim_end_matches('/'),
        progress_interval_seconds: cfg.progress_interval_seconds.max(1),
        seed: &seed,
        swarm: swarm.as_ref(),
        day1: day1.as_ref(),
    };
    Ok(plan::plan(&inputs).map_err(|e| e.to_string()))
}

/// Reads what a claim's cloud-init data is made from: its Secrets (the
/// claim's namespace only), the Machine's labels, boot MAC and Subnet, the
/// inventory's NICs.
pub(crate) async fn gather_day1<'a>(
    client: &Client,
    m: &'a Machine,
    claim: &MachineClaim,
    hw: Option<&'a MachineHardware>,
    secrets: &Api<Secret>,
) -> Result<super::cloudinit::Day1<'a>, kube::Error> {
    let mut data = BTreeMap::new();
    for (name, key) in super::cloudinit::wanted_secrets(claim) {
        if let Some(s) = secrets.get_opt(&name).await?
            && let Some(v) = s.data.as_ref().and_then(|d| d.get(&key))
        {
            data.insert(format!("secret/{name}/{key}"), v.0.clone());
        }
    }
    let ns = m.metadata.namespace.as_deref().unwrap_or_default();
    let subnet_ns = m.spec.subnet_ref.namespace_or(ns).to_string();
    let subnet = Api::<anneal_api::Subnet>::namespaced(client.clone(), &subnet_ns)
        .get_opt(&m.spec.subnet_ref.name)
        .await?;
    let reservation_key = if subnet_ns == ns {
        m.name_any()
    } else {
        format!("{ns}/{}", m.name_any())
    };
    Ok(super::cloudinit::Day1 {
        secrets: data,
        namespace: ns,
        machine: m.metadata.name.as_deref().unwrap_or_default(),
        labels: m.labels().clone(),
        boot_mac: m.spec.boot_mac_address.as_deref(),
        nics: hw.map(|h| h.spec.nics.as_slice()).unwrap_or_default(),
        subnet,
        reservation_key,
    })
}

/// Finds or writes the Pending run of this intent; returns its name.
async fn ensure_run(
    client: &Client,
    m: &Machine,
    claim: &MachineClaim,
    cfg: &DeployConfig,
    planned: plan::Planned,
    last_attempted: Option<&str>,
) -> Result<String, kube::Error> {
    let ns = m.namespace().unwrap_or_default();
    let machine = m.name_any();
    let intent = intent_hash(&claim.uid().unwrap_or_default(), &planned.spec);
    let runs: Api<DeployRun> = Api::namespaced(client.clone(), &ns);
    let existing = runs
        .list(&ListParams::default().labels(&format!(
            "{MACHINE_LABEL}={machine},{INTENT_LABEL}={intent}"
        )))
        .await?;
    let mut attempt = 0u32;
    for r in &existing.items {
        let n = r.name_any();
        let k = n
            .rsplit('-')
            .next()
            .and_then(|k| k.parse::<u32>().ok())
            .unwrap_or(0);
        let unused = Some(n.as_str()) != last_attempted
            && r.status
                .as_ref()
                .and_then(|s| s.phase)
                .is_none_or(|p| p == RunPhase::Pending);
        if unused {
            return Ok(n);
        }
        attempt = attempt.max(k);
    }
    let name = format!("{machine}-{intent}-{}", attempt + 1);
    let mut run = DeployRun::new(&name, planned.spec);
    run.metadata.namespace = Some(ns.clone());
    run.metadata.labels = Some(BTreeMap::from([
        (MACHINE_LABEL.to_string(), machine.clone()),
        (INTENT_LABEL.to_string(), intent),
    ]));
    run.metadata.owner_references = m.controller_owner_ref(&()).map(|o| vec![o]);
    let contents: BTreeSet<&str> = planned
        .plan
        .disks
        .iter()
        .flat_map(|d| d.contents.iter().map(|c| c.name.as_str()))
        .collect();
    run.metadata.annotations = Some(BTreeMap::from([(
        CONTENTS_ANNOTATION.to_string(),
        contents.into_iter().collect::<Vec<_>>().join(","),
    )]));
    let created = match runs.create(&PostParams::default(), &run).await {
        Ok(r) => r,
        Err(kube::Error::Api(e)) if e.code == 409 => runs.get(&name).await?,
        Err(e) => return Err(e),
    };
    let mut plan = planned.plan;
    plan.run_id = name.clone();
    if let Some(cd) = plan.config_drive.as_mut() {
        super::cloudinit::stamp_instance_id(cd, &name);
    }
    let config_drive = plan
        .config_drive
        .as_ref()
        .map(|cd| anneal_api::ConfigDriveStatus {
            format: "NoCloud".into(),
            disk: plan
                .disks
                .iter()
                .find(|d| d.os)
                .map(|d| d.device_name.clone())
                .unwrap_or_default(),
            partition: i32::try_from(cd.partition).unwrap_or_default(),
            filesystem: "vfat".into(),
            label: cd.label.clone(),
            files: cd.files.keys().cloned().collect(),
        });
    let body = serde_json::to_vec(&plan).unwrap_or_default();
    let secret = Secret {
        metadata: ObjectMeta {
            name: Some(plan_secret_name(&name)),
            namespace: Some(ns.clone()),
            labels: Some(BTreeMap::from([(
                MACHINE_LABEL.to_string(),
                machine.clone(),
            )])),
            owner_references: created.controller_owner_ref(&()).map(|o| vec![o]),
            ..ObjectMeta::default()
        },
        data: Some(BTreeMap::from([(PLAN_KEY.to_string(), ByteString(body))])),
        type_: Some("Opaque".into()),
        ..Secret::default()
    };
    match Api::<Secret>::namespaced(client.clone(), &ns)
        .create(&PostParams::default(), &secret)
        .await
    {
        Ok(_) => {}
        Err(kube::Error::Api(e)) if e.code == 409 => {}
        Err(e) => return Err(e),
    }
    let status = DeployRunStatus {
        phase: Some(RunPhase::Pending),
        config_drive,
        deadline_seconds: deadline_of(claim, cfg)
            .ok()
            .flatten()
            .map(|d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX)),
        ..DeployRunStatus::default()
    };
    runs.patch_status(
        &name,
        &PatchParams {
            field_manager: Some(FIELD_MANAGER.into()),
            ..PatchParams::default()
        },
        &Patch::Merge(&json!({ "status": status })),
    )
    .await?;
    tracing::info!(machine = %machine, run = %name, "deploy run planned");
    Ok(name)
}

/// Reads a run's plan (for the agent API).
pub async fn read_plan(
    client: &Client,
    ns: &str,
    run: &str,
) -> Result<Option<anneal_api::agent::DeployPlan>, kube::Error> {
    let Some(s) = Api::<Secret>::namespaced(client.clone(), ns)
        .get_opt(&plan_secret_name(run))
        .await?
    else {
        return Ok(None);
    };
    Ok(s.data
        .as_ref()
        .and_then(|d| d.get(PLAN_KEY))
        .and_then(|b| serde_json::from_slice(&b.0).ok()))
}

#[cfg(test)]
mod deadline_tests {
    use super::*;
    use anneal_api::PhaseTiming;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

    fn claim(deadline: Option<&str>) -> MachineClaim {
        let mut c = MachineClaim::new("c", Default::default());
        c.spec.deploy_deadline = deadline.map(str::to_string);
        c
    }

    #[test]
    fn a_started_run_past_its_deadline_fails_with_its_reason() {
        let now = Timestamp::now();
        let started = now - std::time::Duration::from_secs(1300);
        let mut rs = DeployRunStatus {
            phase: Some(RunPhase::WritingContent),
            deadline_seconds: Some(1200),
            phase_timings: vec![PhaseTiming {
                phase: "Partitioning".into(),
                start: Some(Time(started)),
                end: None,
            }],
            ..DeployRunStatus::default()
        };
        let why = overdue(&rs, now).expect("overdue");
        assert!(
            why.contains("WritingContent")
                && why.contains("deadline of 1200 s")
                && why.contains("spec.deployDeadline"),
            "{why}"
        );
        rs.deadline_seconds = Some(1400);
        assert_eq!(overdue(&rs, now), None, "within its deadline");
        rs.deadline_seconds = Some(1200);
        for done in [RunPhase::Pending, RunPhase::Succeeded, RunPhase::Failed] {
            rs.phase = Some(done);
            assert_eq!(overdue(&rs, now), None, "{done:?} has no deadline");
        }
        rs.phase = Some(RunPhase::Finalizing);
        rs.deadline_seconds = None;
        assert_eq!(overdue(&rs, now), None, "no deadline set");
    }

    #[test]
    fn the_claims_deadline_overrides_the_managers_and_a_bad_one_names_the_field() {
        let cfg = DeployConfig {
            deadline: Some(std::time::Duration::from_secs(1200)),
            ..DeployConfig::default()
        };
        assert_eq!(
            deadline_of(&claim(None), &cfg),
            Ok(Some(std::time::Duration::from_secs(1200)))
        );
        assert_eq!(
            deadline_of(&claim(Some("1h30m")), &cfg),
            Ok(Some(std::time::Duration::from_secs(5400)))
        );
        let e = deadline_of(&claim(Some("soon")), &cfg).unwrap_err();
        assert!(e.starts_with("spec.deployDeadline: \"soon\""), "{e}");
        assert!(deadline_of(&claim(Some("10ms")), &cfg).is_err());
    }
}
