//! Distribution: the Site controller (its Subnets, its tracker URL, its
//! seeders' readiness), the Site's tracker and the seeders per (Image, Site)
//! as workloads, and the swarm a deploy plan hands to the agent. See
//! docs/distribution.md, "The manager: trackers, seeders, the Site".
//!
//! - **Tracker**: a Site with `spec.tracker.ip` gets `anneal-agent tracker`
//!   listening on `<ip>:<--tracker-port>` (workload `tracker-<site>`); with
//!   `spec.tracker.externalURL` anneal runs none. `status.trackerURL` is the
//!   announce URL either way.
//! - **Seeders**: while a DeployRun of an Image is active on a Machine of
//!   the Site, and for `--seeder-grace-secs` after the last one ended, the
//!   workload `seed-<image>-<site>` seeds every Ready content of the Image
//!   from the content store on `<seeder address>:<any port>`, announcing to
//!   the Site's tracker. The seeder address is `--seeder-address`, else the
//!   Site's `spec.tracker.ip`. PartitionContent `status.seeders` lists the
//!   Sites seeding it with the number of machines deploying there.
//! - **Plans**: a Machine whose Site has a tracker and a seeder address gets
//!   a swarm in each content of its plan ([`plan_inputs`]).
//!
//! - **SeederDegraded** on an Image: `True` while one of its seeders ended
//!   (it is restarted; `SeederFailed`, the message names the seeder, its
//!   Site and why it ended) or has not served for [`SEEDER_START_GRACE`]
//!   after starting (`SeederNotServing`); `False` once every seeder serves
//!   (`SeedersServing`) or when none runs (`NoActiveDeploy`). A transition
//!   to `True` is also a Warning Event on the Image.
//!
//! One pass every few seconds under the leader's scope; with the process
//! executor the workloads started in a term are stopped when it ends.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use anneal_api::agent::SeedPolicy;
use anneal_api::conditions::{reasons, types};
use anneal_api::{
    ContentState, DeployRun, Image, Machine, PartitionContent, RunPhase, SeederStatus, Site, Subnet,
};
use kube::api::{Api, ListParams, Patch};
use kube::{Client, Resource as _, ResourceExt};
use serde_json::json;

use crate::controller::Scope;
use crate::deploy::plan::SwarmInputs;
use crate::workload::{
    Executor, Kind, PassError, Phase, Program, Volume, VolumeSource, WorkloadSpec, tagged_name,
    workload_name,
};

/// The field manager of this controller's status writes.
pub const FIELD_MANAGER: &str = "anneal-swarm";

/// Distribution settings of the manager.
#[derive(Debug, Clone, clap::Args)]
pub struct SwarmConfig {
    /// Address seeders listen on (an address of the host they run on, on
    /// the seeder network); default: the Site's `spec.tracker.ip`.
    #[arg(long)]
    pub seeder_address: Option<String>,
    /// Port of the trackers anneal runs (`spec.tracker.ip`).
    #[arg(long, default_value_t = 6969)]
    pub tracker_port: u16,
    /// Announce interval the trackers hand out, in seconds.
    #[arg(long, default_value_t = 15)]
    pub tracker_interval_secs: u32,
    /// First TCP port a deploying agent listens on for its peers.
    #[arg(long, default_value_t = 6881)]
    pub agent_peer_port: u16,
    /// Seconds without a verified piece before an agent fetches the rest
    /// over HTTP ranges.
    #[arg(long, default_value_t = 30)]
    pub swarm_stall_timeout_secs: u32,
    /// An agent keeps seeding until nothing was uploaded for this long.
    #[arg(long, default_value_t = 15)]
    pub seed_idle_secs: u32,
    /// An agent seeds at most this long after writing its contents.
    #[arg(long, default_value_t = 300)]
    pub seed_max_secs: u32,
    /// Seeders stay this long after the last deploy of their Image in their
    /// Site ended.
    #[arg(long, default_value_t = 600)]
    pub seeder_grace_secs: u64,
    /// Upload cap of each seeder in bytes per second (none: no cap).
    #[arg(long)]
    pub seeder_upload_bps: Option<u32>,
}

impl Default for SwarmConfig {
    fn default() -> Self {
        Self {
            seeder_address: None,
            tracker_port: 6969,
            tracker_interval_secs: 15,
            agent_peer_port: 6881,
            swarm_stall_timeout_secs: 30,
            seed_idle_secs: 15,
            seed_max_secs: 300,
            seeder_grace_secs: 600,
            seeder_upload_bps: None,
        }
    }
}

/// The announce URL of a Site's tracker.
pub fn tracker_url(site: &Site, cfg: &SwarmConfig) -> Option<String> {
    let t = site.spec.tracker.as_ref()?;
    site.spec.seeder_subnet_ref.as_ref()?;
    match (&t.ip, &t.external_url) {
        (Some(ip), _) => Some(format!("http://{ip}:{}/announce", cfg.tracker_port)),
        (None, Some(u)) => Some(u.clone()),
        (None, None) => None,
    }
}

/// Where a Site's seeders listen.
pub fn seeder_host(site: &Site, cfg: &SwarmConfig) -> Option<String> {
    site.spec.seeder_subnet_ref.as_ref()?;
    cfg.seeder_address
        .clone()
        .or_else(|| site.spec.tracker.as_ref().and_then(|t| t.ip.clone()))
}

/// The Site of a Machine (through its Subnet), when both exist.
async fn machine_site(client: &Client, m: &Machine) -> Result<Option<Site>, kube::Error> {
    let ns = m.namespace().unwrap_or_default();
    let sref = &m.spec.subnet_ref;
    let sns = sref.namespace_or(&ns).to_string();
    let Some(subnet) = Api::<Subnet>::namespaced(client.clone(), &sns)
        .get_opt(&sref.name)
        .await?
    else {
        return Ok(None);
    };
    let site_ref = &subnet.spec.site_ref;
    Api::<Site>::namespaced(client.clone(), site_ref.namespace_or(&sns))
        .get_opt(&site_ref.name)
        .await
}

/// The swarm a plan for `m` carries: its Site's tracker and seeders, or
/// None (the Site has no tracker or no seeder address: HTTP only).
pub async fn plan_inputs(
    client: &Client,
    m: &Machine,
    cfg: &SwarmConfig,
) -> Result<Option<SwarmInputs>, kube::Error> {
    let Some(site) = machine_site(client, m).await? else {
        return Ok(None);
    };
    Ok(inputs_for(&site, cfg))
}

/// [`plan_inputs`] for a known Site.
pub fn inputs_for(site: &Site, cfg: &SwarmConfig) -> Option<SwarmInputs> {
    let url = tracker_url(site, cfg)?;
    let host = seeder_host(site, cfg)?;
    Some(SwarmInputs {
        trackers: vec![url],
        seeder_hosts: vec![host],
        listen_port: cfg.agent_peer_port,
        stall_timeout_seconds: cfg.swarm_stall_timeout_secs.max(1),
        seeding: SeedPolicy {
            idle_seconds: cfg.seed_idle_secs,
            max_seconds: cfg.seed_max_secs,
        },
    })
}

/// The tracker workload of a Site with `spec.tracker.ip`.
pub fn tracker_spec(site: &Site, cfg: &SwarmConfig) -> Option<WorkloadSpec> {
    let ip = site.spec.tracker.as_ref()?.ip.as_ref()?;
    site.spec.seeder_subnet_ref.as_ref()?;
    let ns = site.namespace().unwrap_or_default();
    Some(WorkloadSpec {
        namespace: ns.clone(),
        name: workload_name("tracker", &ns, &site.name_any()),
        kind: Kind::Server,
        program: Program::Agent,
        args: vec![
            "tracker".into(),
            "--listen".into(),
            format!("{ip}:{}", cfg.tracker_port),
            "--interval".into(),
            cfg.tracker_interval_secs.max(1).to_string(),
            // Only the torrents of Ready contents (verified in the store):
            // not an open tracker on the provisioning network.
            "--allow-store".into(),
            "${volume:store}".into(),
        ],
        volumes: vec![Volume {
            name: "store".into(),
            mount_path: "/store".into(),
            source: VolumeSource::ContentStore,
        }],
        env: BTreeMap::new(),
        labels: [
            ("app.kubernetes.io/component".into(), "tracker".into()),
            ("anneal.dev/site".into(), site.name_any()),
        ]
        .into(),
        owner: site.controller_owner_ref(&()),
        deadline_secs: None,
        access: Default::default(),
    })
}

/// The seeder workload of `image` in `site`, seeding `contents`.
pub fn seeder_spec(
    image: &Image,
    site: &Site,
    contents: &[String],
    cfg: &SwarmConfig,
) -> Option<WorkloadSpec> {
    let url = tracker_url(site, cfg)?;
    let host = seeder_host(site, cfg)?;
    let ns = image.namespace().unwrap_or_default();
    let mut args = vec![
        "seed".into(),
        "--content-dir".into(),
        "${volume:store}".into(),
    ];
    for c in contents {
        args.push("--content".into());
        args.push(format!("{ns}/{c}"));
    }
    args.extend([
        "--listen".into(),
        format!("{host}:0"),
        "--tracker".into(),
        url,
    ]);
    if let Some(bps) = cfg.seeder_upload_bps {
        args.extend(["--upload-bps".into(), bps.to_string()]);
    }
    Some(WorkloadSpec {
        namespace: ns.clone(),
        // Two names joined: tagged so `a-b`/`c` and `a`/`b-c` stay apart.
        name: tagged_name(
            &format!("seed-{}-{}", image.name_any(), site.name_any()),
            &format!("{ns}/{}/{}", image.name_any(), site.name_any()),
            5,
        ),
        kind: Kind::Server,
        program: Program::Agent,
        args,
        volumes: vec![Volume {
            name: "store".into(),
            mount_path: "/store".into(),
            source: VolumeSource::ContentStore,
        }],
        env: BTreeMap::new(),
        labels: [
            ("app.kubernetes.io/component".into(), "seeder".into()),
            ("anneal.dev/image".into(), image.name_any()),
            ("anneal.dev/site".into(), site.name_any()),
        ]
        .into(),
        owner: image.controller_owner_ref(&()),
        deadline_secs: None,
        access: Default::default(),
    })
}

/// When a run ended (its last phase's end or its last progress), if it has.
fn run_ended(r: &DeployRun) -> Option<k8s_openapi::jiff::Timestamp> {
    let st = r.status.as_ref()?;
    if !matches!(st.phase, Some(RunPhase::Succeeded | RunPhase::Failed)) {
        return None;
    }
    st.phase_timings
        .iter()
        .filter_map(|t| t.end.as_ref().or(t.start.as_ref()))
        .map(|t| t.0)
        .max()
        .or_else(|| st.last_progress_time.as_ref().map(|t| t.0))
        .or_else(|| r.creation_timestamp().map(|t| t.0))
}

/// Desired state of one pass.
#[derive(Debug, Default)]
struct Desired {
    /// Workload key (`ns/name`) to spec.
    workloads: BTreeMap<String, WorkloadSpec>,
    /// Image key to its seeders: (Site name, workload key).
    image_seeders: BTreeMap<String, BTreeSet<(String, String)>>,
    /// Site key to the seeder keys it needs.
    site_seeders: BTreeMap<String, Vec<String>>,
    /// Content key (`ns/name`) to its seeding Sites (site name to machines).
    content_seeders: BTreeMap<String, BTreeMap<String, i32>>,
}

fn key(ns: &str, name: &str) -> String {
    format!("{ns}/{name}")
}

/// Keeps the trackers and seeders of every Site as they should be, and the
/// Sites' and contents' status, until `scope` is cancelled.
pub async fn controller(scope: Scope, executor: Executor, cfg: SwarmConfig) {
    let mut started: BTreeMap<String, WorkloadSpec> = BTreeMap::new();
    let mut health: BTreeMap<String, Health> = BTreeMap::new();
    loop {
        if let Err(e) = pass(&scope, &executor, &cfg, &mut started, &mut health).await {
            tracing::warn!(error = %anneal_api::error_chain(&e), "swarm pass failed; retrying");
        }
        tokio::select! {
            () = scope.cancelled() => break,
            () = tokio::time::sleep(Duration::from_secs(2)) => {}
        }
    }
    if matches!(executor, Executor::Process(_)) {
        for spec in started.values() {
            if let Err(e) = executor.remove(spec).await {
                tracing::warn!(workload = %spec.name, error = %e, "stopping a swarm workload failed");
            }
        }
    }
}

/// Starts the workloads `want` names that do not run (again when their
/// arguments changed or they ended), records their health, and stops
/// those no one wants any more; the keys of those serving.
async fn run_workloads(
    executor: &Executor,
    want: &Desired,
    started: &mut BTreeMap<String, WorkloadSpec>,
    health: &mut BTreeMap<String, Health>,
) -> Result<BTreeSet<String>, PassError> {
    let mut running = BTreeSet::new();
    for (k, spec) in &want.workloads {
        let changed = started.get(k).is_some_and(|old| old.args != spec.args);
        if changed {
            executor.remove(&started[k]).await?;
        }
        let seen = executor.observe(spec).await?;
        let ended = match &seen.phase {
            Phase::Failed | Phase::Succeeded => Some(seen.failure()),
            Phase::Running | Phase::Absent => None,
        };
        let serving = !changed
            && seen.phase == Phase::Running
            && (spec.args.first().map(String::as_str) != Some("seed") || seen.progress.is_some());
        let h = health.remove(k);
        health.insert(
            k.clone(),
            Health::next(h, serving, changed, ended, Instant::now()),
        );
        match seen.phase {
            Phase::Running if !changed => {
                // A seeder is ready once it has checked its contents and
                // serves them (its `progress` line); a tracker once it runs.
                if serving {
                    running.insert(k.clone());
                }
            }
            Phase::Running | Phase::Absent => {
                executor.ensure(spec).await?;
                tracing::info!(workload = %k, args = ?spec.args, "swarm workload started");
            }
            Phase::Failed | Phase::Succeeded => {
                let (reason, message) = seen.failure();
                tracing::warn!(workload = %k, %reason, %message, "swarm workload ended; restarting it");
                executor.remove(spec).await?;
                executor.ensure(spec).await?;
            }
        }
        started.insert(k.clone(), spec.clone());
    }
    let gone: Vec<String> = started
        .keys()
        .filter(|k| !want.workloads.contains_key(*k))
        .cloned()
        .collect();
    health.retain(|k, _| want.workloads.contains_key(k));
    for k in gone {
        if let Some(spec) = started.remove(&k) {
            executor.remove(&spec).await?;
            tracing::info!(workload = %k, "swarm workload stopped (no active deploy, grace period over)");
        }
    }
    // What an earlier leader started and no one wants now (its Image or
    // Site gone across namespaces, its grace period over while no manager
    // led): `started` knows only this term's workloads.
    if let Executor::Kubernetes(kx) = executor {
        let keep: BTreeSet<String> = want.workloads.values().map(|s| kx.object_name(s)).collect();
        for component in ["seeder", "tracker"] {
            for name in kx.sweep_servers(component, &keep).await? {
                tracing::info!(deployment = %name, "removed a swarm Deployment no deploy wants");
            }
        }
    }
    Ok(running)
}

/// Writes each Site's subnets, tracker URL and whether its seeders are
/// ready, when they changed.
async fn write_site_status(
    scope: &Scope,
    cfg: &SwarmConfig,
    sites: &[Site],
    subnets: &[Subnet],
    subnet_site: &BTreeMap<String, String>,
    want: &Desired,
    running: &BTreeSet<String>,
) -> Result<(), PassError> {
    for s in sites {
        let ns = s.namespace().unwrap_or_default();
        let sk = key(&ns, &s.name_any());
        let subnet_refs: Vec<serde_json::Value> = subnets
            .iter()
            .filter(|n| {
                subnet_site.get(&key(&n.namespace().unwrap_or_default(), &n.name_any()))
                    == Some(&sk)
            })
            .map(|n| json!({"name": n.name_any()}))
            .collect();
        let tracker_ok =
            tracker_spec(s, cfg).is_none_or(|t| running.contains(&key(&t.namespace, &t.name)));
        let seeders_ok = want
            .site_seeders
            .get(&sk)
            .is_none_or(|l| l.iter().all(|k| running.contains(k)));
        let seeder_ready = s.spec.seeder_subnet_ref.is_some()
            && seeder_host(s, cfg).is_some()
            && tracker_url(s, cfg).is_some()
            && tracker_ok
            && seeders_ok;
        let st = s.status.clone().unwrap_or_default();
        let url = tracker_url(s, cfg);
        let refs_now: Vec<serde_json::Value> = st
            .subnet_refs
            .iter()
            .map(|r| json!({"name": r.name}))
            .collect();
        if st.tracker_url != url || st.seeder_ready != Some(seeder_ready) || refs_now != subnet_refs
        {
            Api::<Site>::namespaced(scope.client.clone(), &ns)
                .patch_status(
                    &s.name_any(),
                    &crate::controller::patch_params(FIELD_MANAGER),
                    &Patch::Merge(&json!({"status": {
                        "subnetRefs": subnet_refs,
                        "trackerURL": url,
                        "seederReady": seeder_ready,
                    }})),
                )
                .await?;
        }
    }
    Ok(())
}

/// Sets or clears each Image's `SeederDegraded` condition from the health
/// of its seeders.
async fn write_seeder_conditions(
    scope: &Scope,
    images: &BTreeMap<String, &Image>,
    want: &Desired,
    health: &BTreeMap<String, Health>,
) -> Result<(), PassError> {
    let now = Instant::now();
    for (ik, image) in images {
        let seeders: Vec<(String, String, Health)> = want
            .image_seeders
            .get(ik)
            .map(|l| {
                l.iter()
                    .filter_map(|(site, wk)| {
                        health
                            .get(wk)
                            .map(|h| (site.clone(), wk.clone(), h.clone()))
                    })
                    .collect()
            })
            .unwrap_or_default();
        let had = image.status.as_ref().is_some_and(|s| {
            s.conditions
                .iter()
                .any(|c| c.type_ == types::SEEDER_DEGRADED)
        });
        let Some((degraded, reason, message)) = seeder_condition(&seeders, now) else {
            if !had {
                continue;
            }
            set_seeder_condition(
                scope,
                image,
                false,
                reasons::NO_ACTIVE_DEPLOY,
                "no deploy of this Image is active: no seeder runs".into(),
            )
            .await?;
            continue;
        };
        set_seeder_condition(scope, image, degraded, reason, message).await?;
    }
    Ok(())
}

/// Writes each PartitionContent's `status.seeders` (Sites seeding it, with
/// the machines deploying it), when it changed.
async fn write_content_seeders(
    scope: &Scope,
    contents: &[PartitionContent],
    want: &Desired,
) -> Result<(), PassError> {
    for c in contents {
        let ns = c.namespace().unwrap_or_default();
        let ck = key(&ns, &c.name_any());
        let now: Vec<SeederStatus> = c
            .status
            .as_ref()
            .map(|s| s.seeders.clone())
            .unwrap_or_default();
        let want_list: Vec<SeederStatus> = want
            .content_seeders
            .get(&ck)
            .map(|m| {
                m.iter()
                    .map(|(site, machines)| SeederStatus {
                        site: site.clone(),
                        machines: *machines,
                    })
                    .collect()
            })
            .unwrap_or_default();
        if now != want_list {
            Api::<PartitionContent>::namespaced(scope.client.clone(), &ns)
                .patch_status(
                    &c.name_any(),
                    &crate::controller::patch_params(FIELD_MANAGER),
                    &Patch::Merge(&json!({"status": {"seeders": want_list}})),
                )
                .await?;
        }
    }
    Ok(())
}

async fn pass(
    scope: &Scope,
    executor: &Executor,
    cfg: &SwarmConfig,
    started: &mut BTreeMap<String, WorkloadSpec>,
    health: &mut BTreeMap<String, Health>,
) -> Result<(), PassError> {
    let lp = ListParams::default();
    let sites = scope.api::<Site>().list(&lp).await?.items;
    let all_images = scope.api::<Image>().list(&lp).await?.items;
    let images: BTreeMap<String, &Image> = all_images
        .iter()
        .map(|i| (key(&i.namespace().unwrap_or_default(), &i.name_any()), i))
        .collect();
    let subnets = scope.api::<Subnet>().list(&lp).await?.items;
    let runs = scope.api::<DeployRun>().list(&lp).await?.items;
    let contents = scope.api::<PartitionContent>().list(&lp).await?.items;
    let site_by_key: BTreeMap<String, &Site> = sites
        .iter()
        .map(|s| (key(&s.namespace().unwrap_or_default(), &s.name_any()), s))
        .collect();
    let subnet_site: BTreeMap<String, String> = subnets
        .iter()
        .map(|s| {
            let ns = s.namespace().unwrap_or_default();
            (
                key(&ns, &s.name_any()),
                key(s.spec.site_ref.namespace_or(&ns), &s.spec.site_ref.name),
            )
        })
        .collect();
    let ready: BTreeSet<String> = contents
        .iter()
        .filter(|c| c.status.as_ref().and_then(|s| s.state) == Some(ContentState::Ready))
        .map(|c| key(&c.namespace().unwrap_or_default(), &c.name_any()))
        .collect();

    let mut want = Desired::default();
    for s in &sites {
        if let Some(spec) = tracker_spec(s, cfg) {
            want.workloads
                .insert(key(&spec.namespace, &spec.name), spec);
        }
    }
    let now = k8s_openapi::jiff::Timestamp::now();
    let grace = k8s_openapi::jiff::SignedDuration::from_secs(
        i64::try_from(cfg.seeder_grace_secs).unwrap_or(i64::MAX),
    );
    for r in &runs {
        let active = match run_ended(r) {
            None => true,
            Some(t) => now.duration_since(t) < grace,
        };
        if !active {
            continue;
        }
        let ns = r.namespace().unwrap_or_default();
        let Some(m) = Api::<Machine>::namespaced(scope.client.clone(), &ns)
            .get_opt(&r.spec.machine_ref.name)
            .await?
        else {
            continue;
        };
        let subnet = key(
            m.spec
                .subnet_ref
                .namespace_or(&m.namespace().unwrap_or_default()),
            &m.spec.subnet_ref.name,
        );
        let Some(site) = subnet_site.get(&subnet).and_then(|k| site_by_key.get(k)) else {
            continue;
        };
        let mut names: Vec<String> = r.spec.image_ref.iter().map(|i| i.name.clone()).collect();
        names.extend(r.spec.data_images.iter().map(|d| d.image_ref.name.clone()));
        for n in names {
            let ik = key(&ns, &n);
            let Some(image) = images.get(&ik) else {
                continue;
            };
            let cs: Vec<String> = image
                .spec
                .layout
                .slots
                .iter()
                .filter_map(|s| s.content_ref.as_ref().map(|c| c.name.clone()))
                .filter(|c| ready.contains(&key(&ns, c)))
                .collect();
            if cs.is_empty() {
                continue;
            }
            let Some(spec) = seeder_spec(image, site, &cs, cfg) else {
                continue;
            };
            let wk = key(&spec.namespace, &spec.name);
            let sk = key(&site.namespace().unwrap_or_default(), &site.name_any());
            let list = want.site_seeders.entry(sk).or_default();
            if !list.contains(&wk) {
                list.push(wk.clone());
            }
            want.image_seeders
                .entry(ik.clone())
                .or_default()
                .insert((site.name_any(), wk.clone()));
            for c in &cs {
                let n = want
                    .content_seeders
                    .entry(key(&ns, c))
                    .or_default()
                    .entry(site.name_any())
                    .or_insert(0);
                if run_ended(r).is_none() {
                    *n += 1;
                }
            }
            want.workloads.insert(wk, spec);
        }
    }

    // Workloads: start, restart, stop.
    let running = run_workloads(executor, &want, started, health).await?;
    // Site status.
    write_site_status(scope, cfg, &sites, &subnets, &subnet_site, &want, &running).await?;
    // Image SeederDegraded.
    write_seeder_conditions(scope, &images, &want, health).await?;
    // PartitionContent status.seeders.
    write_content_seeders(scope, &contents, &want).await?;
    Ok(())
}

/// How long a seeder may run before it serves (it verifies every content
/// of the Image first) before its Image is `SeederDegraded`.
pub const SEEDER_START_GRACE: Duration = Duration::from_secs(120);

/// What the controller knows of one workload between passes.
#[derive(Clone, Debug, PartialEq)]
enum Health {
    /// It serves.
    Serving,
    /// Started at this instant and not serving yet.
    Starting(Instant),
    /// It ended (reason, message) and was restarted; it stays so until it
    /// serves again.
    Ended(String, String),
}

impl Health {
    /// The next health from the previous one and this pass's observation:
    /// `serving`, `restarted` (its arguments changed), `ended` (with the
    /// failure's reason and message).
    fn next(
        prev: Option<Health>,
        serving: bool,
        restarted: bool,
        ended: Option<(String, String)>,
        now: Instant,
    ) -> Health {
        if let Some((reason, message)) = ended {
            return Health::Ended(reason, message);
        }
        if serving {
            return Health::Serving;
        }
        match prev {
            Some(h @ Health::Ended(..)) => h,
            Some(h @ Health::Starting(_)) if !restarted => h,
            _ => Health::Starting(now),
        }
    }
}

/// SeederDegraded for an Image from its seeders (Site, workload, health):
/// `None` when it has none.
fn seeder_condition(
    seeders: &[(String, String, Health)],
    now: Instant,
) -> Option<(bool, &'static str, String)> {
    if seeders.is_empty() {
        return None;
    }
    for (site, wk, h) in seeders {
        if let Health::Ended(reason, message) = h {
            let why = if message.is_empty() {
                reason.clone()
            } else {
                format!("{reason}: {message}")
            };
            return Some((
                true,
                reasons::SEEDER_FAILED,
                format!(
                    "seeder {wk} of Site {site} ended ({why}); the manager restarts it, \
                     and its machines fetch over HTTP meanwhile if the claim allows it"
                ),
            ));
        }
    }
    for (site, wk, h) in seeders {
        if let Health::Starting(since) = h {
            let waited = now.saturating_duration_since(*since);
            if waited >= SEEDER_START_GRACE {
                return Some((
                    true,
                    reasons::SEEDER_NOT_SERVING,
                    format!(
                        "seeder {wk} of Site {site} has not served for {} s after starting \
                         (it verifies every content of the Image first: see its log)",
                        waited.as_secs()
                    ),
                ));
            }
        }
    }
    let sites: BTreeSet<String> = seeders.iter().map(|(s, _, _)| s.clone()).collect();
    let starting = seeders
        .iter()
        .filter(|(_, _, h)| matches!(h, Health::Starting(_)))
        .count();
    let mut message = format!(
        "{} seeder(s) in Site(s) {}",
        seeders.len(),
        sites.into_iter().collect::<Vec<_>>().join(", ")
    );
    if starting > 0 {
        message.push_str(&format!(", {starting} starting"));
    }
    Some((false, reasons::SEEDERS_SERVING, message))
}

/// Writes an Image's SeederDegraded condition when it changes (the other
/// conditions kept; a conflict retries next pass); a transition to `True`
/// is also a Warning Event.
async fn set_seeder_condition(
    scope: &Scope,
    image: &Image,
    degraded: bool,
    reason: &str,
    message: String,
) -> Result<(), kube::Error> {
    let mut all = image
        .status
        .as_ref()
        .map(|s| s.conditions.clone())
        .unwrap_or_default();
    let was = crate::conditions::status(&all, types::SEEDER_DEGRADED) == Some("True");
    if !crate::conditions::set(
        &mut all,
        types::SEEDER_DEGRADED,
        degraded,
        reason,
        message.clone(),
        image.metadata.generation,
    ) {
        return Ok(());
    }
    if degraded && !was {
        let warning = kube::runtime::events::EventType::Warning;
        crate::controller::publish_event(&scope.recorder, image, warning, "Seed", reason, message);
    }
    let patch = json!({
        "metadata": {"resourceVersion": image.resource_version()},
        "status": {"conditions": all},
    });
    match Api::<Image>::namespaced(scope.client.clone(), &image.namespace().unwrap_or_default())
        .patch_status(
            &image.name_any(),
            &crate::controller::patch_params(FIELD_MANAGER),
            &Patch::Merge(&patch),
        )
        .await
    {
        Err(kube::Error::Api(e)) if e.code == 409 => Ok(()),
        r => r.map(|_| ()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use anneal_api::{NameRef, SiteSpec, TrackerSpec};

    fn site(tracker: Option<TrackerSpec>, seeder_subnet: bool) -> Site {
        let mut s = Site::new(
            "rack1",
            SiteSpec {
                seeder_subnet_ref: seeder_subnet.then(|| NameRef::new("prov")),
                tracker,
            },
        );
        s.metadata.namespace = Some("default".into());
        s.metadata.uid = Some("uid-site".into());
        s
    }

    #[test]
    fn a_seeders_health_follows_its_observations() {
        let t0 = Instant::now();
        let t1 = t0 + Duration::from_secs(5);
        let ended = || Some(("WorkloadFailed".to_string(), "exit 1".to_string()));
        // Started, still starting (the first instant kept), serving.
        let h = Health::next(None, false, false, None, t0);
        assert_eq!(h, Health::Starting(t0));
        let h = Health::next(Some(h), false, false, None, t1);
        assert_eq!(h, Health::Starting(t0));
        let h = Health::next(Some(h), true, false, None, t1);
        assert_eq!(h, Health::Serving);
        // Removed or restarted with new arguments: starting again.
        assert_eq!(
            Health::next(Some(Health::Serving), false, false, None, t1),
            Health::Starting(t1)
        );
        assert_eq!(
            Health::next(Some(Health::Starting(t0)), false, true, None, t1),
            Health::Starting(t1)
        );
        // Ended: stays ended through its restart until it serves.
        let h = Health::next(Some(Health::Serving), false, false, ended(), t1);
        assert!(matches!(h, Health::Ended(..)));
        let h = Health::next(Some(h), false, false, None, t1);
        assert!(matches!(h, Health::Ended(..)));
        assert_eq!(
            Health::next(Some(h), true, false, None, t1),
            Health::Serving
        );
    }

    #[test]
    fn seeder_degraded_names_the_seeder_its_site_and_why() {
        let t0 = Instant::now();
        let s = |site: &str, h: Health| (site.to_string(), format!("rack/seed-debian-{site}"), h);
        assert_eq!(seeder_condition(&[], t0), None);
        let (degraded, reason, message) =
            seeder_condition(&[s("a", Health::Serving), s("b", Health::Starting(t0))], t0).unwrap();
        assert!(!degraded);
        assert_eq!(reason, reasons::SEEDERS_SERVING);
        assert_eq!(message, "2 seeder(s) in Site(s) a, b, 1 starting");
        let (degraded, reason, message) = seeder_condition(
            &[
                s("a", Health::Serving),
                s(
                    "b",
                    Health::Ended("WorkloadFailed".into(), "no index".into()),
                ),
            ],
            t0,
        )
        .unwrap();
        assert!(degraded);
        assert_eq!(reason, reasons::SEEDER_FAILED);
        assert!(
            message.starts_with(
                "seeder rack/seed-debian-b of Site b ended (WorkloadFailed: no index)"
            ),
            "{message}"
        );
        // Starting for longer than the grace period.
        let later = t0 + SEEDER_START_GRACE + Duration::from_secs(1);
        let (degraded, reason, message) =
            seeder_condition(&[s("a", Health::Starting(t0))], later).unwrap();
        assert!(degraded);
        assert_eq!(reason, reasons::SEEDER_NOT_SERVING);
        assert!(message.contains("has not served for 121 s"), "{message}");
    }

    #[test]
    fn tracker_and_seeders_follow_the_site() {
        let cfg = SwarmConfig::default();
        let pinned = site(
            Some(TrackerSpec {
                ip: Some("10.77.0.1".into()),
                external_url: None,
            }),
            true,
        );
        assert_eq!(
            tracker_url(&pinned, &cfg).as_deref(),
            Some("http://10.77.0.1:6969/announce")
        );
        assert_eq!(seeder_host(&pinned, &cfg).as_deref(), Some("10.77.0.1"));
        let t = tracker_spec(&pinned, &cfg).unwrap();
        assert_eq!(t.name, "tracker-rack1");
        assert_eq!(
            t.args,
            [
                "tracker",
                "--listen",
                "10.77.0.1:6969",
                "--interval",
                "15",
                "--allow-store",
                "${volume:store}"
            ]
        );
        assert_eq!(t.volumes.len(), 1);
        assert_eq!(t.volumes[0].source, VolumeSource::ContentStore);
        let inputs = inputs_for(&pinned, &cfg).unwrap();
        assert_eq!(inputs.trackers, ["http://10.77.0.1:6969/announce"]);
        assert_eq!(inputs.seeder_hosts, ["10.77.0.1"]);

        // An external tracker: anneal runs none, seeders need an address.
        let external = site(
            Some(TrackerSpec {
                ip: None,
                external_url: Some("http://tracker.example:6969/announce".into()),
            }),
            true,
        );
        assert!(tracker_spec(&external, &cfg).is_none());
        assert!(inputs_for(&external, &cfg).is_none());
        let with_addr = SwarmConfig {
            seeder_address: Some("10.0.0.5".into()),
            ..SwarmConfig::default()
        };
        assert_eq!(
            inputs_for(&external, &with_addr).unwrap().seeder_hosts,
            ["10.0.0.5"]
        );

        // No tracker, or no seeder Subnet: HTTP only.
        assert!(inputs_for(&site(None, true), &cfg).is_none());
        let no_subnet = site(
            Some(TrackerSpec {
                ip: Some("10.77.0.1".into()),
                external_url: None,
            }),
            false,
        );
        assert!(inputs_for(&no_subnet, &cfg).is_none());
        assert!(tracker_spec(&no_subnet, &cfg).is_none());
    }

    #[test]
    fn seeder_seeds_the_ready_contents() {
        let cfg = SwarmConfig {
            seeder_upload_bps: Some(1000),
            ..SwarmConfig::default()
        };
        let s = site(
            Some(TrackerSpec {
                ip: Some("10.77.0.1".into()),
                external_url: None,
            }),
            true,
        );
        let mut image: Image = serde_json::from_value(json!({
            "apiVersion": "anneal.dev/v1alpha1", "kind": "Image",
            "metadata": {"name": "debian", "namespace": "default", "uid": "uid-img"},
            "spec": {"osFamily": "Linux", "layout": {"partitionTable": "gpt", "slots": []}}
        }))
        .unwrap();
        image.metadata.namespace = Some("default".into());
        let spec = seeder_spec(&image, &s, &["root".into(), "esp".into()], &cfg).unwrap();
        // image and Site joined, tagged so `a-b`/`c` and `a`/`b-c` differ
        assert!(
            spec.name.starts_with("seed-debian-rack1-")
                && spec.name.len() == "seed-debian-rack1-".len() + 10,
            "{}",
            spec.name
        );
        assert_eq!(
            spec.args,
            [
                "seed",
                "--content-dir",
                "${volume:store}",
                "--content",
                "default/root",
                "--content",
                "default/esp",
                "--listen",
                "10.77.0.1:0",
                "--tracker",
                "http://10.77.0.1:6969/announce",
                "--upload-bps",
                "1000"
            ]
        );
        assert_eq!(spec.owner.unwrap().uid, "uid-img");
    }
}
