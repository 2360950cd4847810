//! Planning a DeployRun: pure functions from the claim, the Machine's
//! inventory, the Images, their PartitionContents and the PostHooks to the
//! immutable DeployRun spec and the agent's [`DeployPlan`].
//!
//! Nothing here talks to the API server: the caller gathers the objects
//! (and the script bodies of ConfigMap/Secret steps) and hands them in, so
//! every rule (disk hints, parameter precedence, hook order, the default
//! hook, `hooksHash`) is unit-tested.

use std::collections::{BTreeMap, BTreeSet};

use anneal_api::agent::{
    AfterDeploy as PlanAfterDeploy, DeployPlan, PlannedContent, PlannedDisk, PlannedStep,
    PlannedSwarm,
};
use anneal_api::{
    AfterDeploy, Builtin, DataImage, DeployRunSpec, DiskHints, HardwareDisk, Image, MachineClaim,
    NameRef, PartitionContent, PostHook, PostHookSpec, ResolvedDisk, SlotRole, TransferSpec,
};
use anneal_image::layout::{Layout, Role, Slot, TableKind};
use kube::ResourceExt;
use sha2::{Digest, Sha256};

/// The default hook substituted when neither the Image nor the claim names
/// one and the claim deploys an OS.
pub const DEFAULT_HOOK: &str = "anneal-default-finalize";
/// Alignment and first offset of planned partitions.
const MIB: u64 = 1 << 20;
/// Room kept at the end of a GPT disk for the backup header and entries.
const GPT_TAIL: u64 = 34 * 512;

/// Why a run cannot be planned. Every message names the object and the fix.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    /// No disk of the inventory matches a hint.
    #[error("no disk matches the disk hint of {what} ({hints}); candidates: {candidates}")]
    NoDisk {
        /// Which image the hint is for.
        what: String,
        /// The hint, as given.
        hints: String,
        /// Every disk of the inventory.
        candidates: String,
    },
    /// Several disks match a hint.
    #[error(
        "the disk hint of {what} ({hints}) matches {count} disks: {candidates}; add a hint (serialNumber, wwn) that picks one"
    )]
    AmbiguousDisk {
        /// Which image.
        what: String,
        /// The hint.
        hints: String,
        /// How many matched.
        count: usize,
        /// The matching disks.
        candidates: String,
    },
    /// Two images resolved to the same disk.
    #[error("{first} and {second} both resolve to disk {disk}; each image needs its own disk")]
    SameDisk {
        /// First image.
        first: String,
        /// Second image.
        second: String,
        /// The disk.
        disk: String,
    },
    /// The Machine has reported no inventory.
    #[error(
        "Machine {0} has no MachineHardware yet; re-inspect it (annotation anneal.dev/re-inspect)"
    )]
    NoInventory(String),
    /// A referenced object is missing or not Ready.
    #[error("{kind} {name} {problem}")]
    NotUsable {
        /// Kind.
        kind: &'static str,
        /// Name.
        name: String,
        /// What is wrong and the fix.
        problem: String,
    },
    /// The layout does not fit the disk.
    #[error("Image {image} needs {need} bytes but disk {disk} has {have}")]
    TooSmall {
        /// Image.
        image: String,
        /// Disk.
        disk: String,
        /// Bytes needed.
        need: u64,
        /// Bytes on the disk.
        have: u64,
    },
    /// A script references a parameter nobody sets.
    #[error(
        "PostHook {hook} step {step}: parameter {param} has no value (set it in the claim's or the Image's spec.params, or give the hook a default)"
    )]
    MissingParam {
        /// Hook.
        hook: String,
        /// Step.
        step: String,
        /// Parameter.
        param: String,
    },
    /// Nothing to deploy.
    #[error("the claim names no imageRef and no dataImages: nothing to deploy")]
    Nothing,
    /// The Day-1 data (userData, networkData, metaData) cannot be made; the
    /// message names the field.
    #[error("{0}")]
    Day1(String),
}

/// Everything a plan is made from.
#[derive(Debug)]
pub struct Inputs<'a> {
    /// The bound claim.
    pub claim: &'a MachineClaim,
    /// The Machine's name and namespace, `ns/name` for the agent.
    pub machine: &'a str,
    /// `x86_64` or `aarch64`.
    pub architecture: &'a str,
    /// The Machine's inventory.
    pub disks: Option<&'a [HardwareDisk]>,
    /// Images by name (the claim's namespace).
    pub images: &'a BTreeMap<String, Image>,
    /// PartitionContents by name.
    pub contents: &'a BTreeMap<String, PartitionContent>,
    /// PostHooks by name.
    pub hooks: &'a BTreeMap<String, PostHook>,
    /// Script bodies of `configMapRef`/`secretRef` steps, by
    /// `configmap/<name>/<key>` or `secret/<name>/<key>`.
    pub scripts: &'a BTreeMap<String, String>,
    /// Base URL of the content server, e.g. `http://10.0.0.1:8081`.
    pub content_url: &'a str,
    /// Seconds between progress reports.
    pub progress_interval_seconds: u32,
    /// Seed for generated GUIDs (the Machine's UID), so a replan is stable.
    pub seed: &'a str,
    /// The swarm of the Machine's Site (None: contents over HTTP only).
    pub swarm: Option<&'a SwarmInputs>,
    /// What the claim's Day-1 data (cloud-init) is rendered from.
    pub day1: Option<&'a super::cloudinit::Day1<'a>>,
}

/// The Site's swarm, as the plan hands it to the agent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SwarmInputs {
    /// The Site's tracker announce URL(s).
    pub trackers: Vec<String>,
    /// Where the Site's seeders run (IP addresses).
    pub seeder_hosts: Vec<String>,
    /// The agent's first BitTorrent port (one per content from there).
    pub listen_port: u16,
    /// Seconds without a verified piece before HTTP takes over.
    pub stall_timeout_seconds: u32,
    /// How long an agent serves the run's other machines once written.
    pub seeding: anneal_api::agent::SeedPolicy,
}

/// The planned run: the DeployRun spec and the plan (without its run id).
#[derive(Debug, Clone, PartialEq)]
pub struct Planned {
    /// The DeployRun spec.
    pub spec: DeployRunSpec,
    /// What the agent gets.
    pub plan: DeployPlan,
}

/// The default hook's steps.
pub fn default_hook() -> PostHookSpec {
    PostHookSpec {
        params: BTreeMap::new(),
        steps: [
            Builtin::Mkswap,
            Builtin::InstallRemovableFallback,
            Builtin::Efibootmgr,
        ]
        .into_iter()
        .map(|b| anneal_api::HookStep {
            name: Some(builtin_name(b).to_string()),
            builtin: Some(b),
            timeout_seconds: 60,
            ..Default::default()
        })
        .collect(),
    }
}

/// The wire name of a builtin.
pub fn builtin_name(b: Builtin) -> &'static str {
    match b {
        Builtin::Mkswap => "mkswap",
        Builtin::Efibootmgr => "efibootmgr",
        Builtin::GrowLastPartition => "growLastPartition",
        Builtin::InstallRemovableFallback => "install-removable-fallback",
    }
}

/// `/dev/<name>` for a kernel name; a path stays as it is.
fn dev_path(name: &str) -> String {
    if name.starts_with('/') {
        name.to_string()
    } else {
        format!("/dev/{name}")
    }
}

fn hints_text(h: &DiskHints) -> String {
    serde_json::to_string(h).unwrap_or_default()
}

fn disk_text(d: &HardwareDisk) -> String {
    let mut s = format!("{} ({} bytes", dev_path(&d.device_name), d.size_bytes);
    if let Some(v) = &d.serial_number {
        s.push_str(&format!(", serial {v}"));
    }
    if let Some(v) = &d.wwn {
        s.push_str(&format!(", wwn {v}"));
    }
    if let Some(v) = &d.hctl {
        s.push_str(&format!(", hctl {v}"));
    }
    s.push(')');
    s
}

/// Resolves one hint (none: the only non-removable disk) to exactly one disk.
pub fn resolve_disk<'d>(
    what: &str,
    hints: Option<&DiskHints>,
    disks: &'d [HardwareDisk],
) -> Result<&'d HardwareDisk, PlanError> {
    let all = || {
        let v: Vec<String> = disks.iter().map(disk_text).collect();
        if v.is_empty() {
            "none reported".to_string()
        } else {
            v.join(", ")
        }
    };
    let matching: Vec<&HardwareDisk> = match hints {
        Some(h) => disks.iter().filter(|d| d.matches(h)).collect(),
        None => disks
            .iter()
            .filter(|d| !d.device_name.starts_with("sr") && !is_removable(d))
            .collect(),
    };
    let hint = hints.map_or_else(|| "no hint: the only fixed disk".to_string(), hints_text);
    match matching.as_slice() {
        [one] => Ok(one),
        [] => Err(PlanError::NoDisk {
            what: what.into(),
            hints: hint,
            candidates: all(),
        }),
        many => Err(PlanError::AmbiguousDisk {
            what: what.into(),
            hints: hint,
            count: many.len(),
            candidates: many
                .iter()
                .map(|d| disk_text(d))
                .collect::<Vec<_>>()
                .join(", "),
        }),
    }
}

fn is_removable(_d: &HardwareDisk) -> bool {
    // The CRD's inventory has no removable flag; USB/MMC disks carry a bus
    // in the agent report but not here. Every reported disk is a candidate.
    false
}

/// Merged params: hook defaults < Image params < claim params.
pub fn merge_params(
    hook: &PostHookSpec,
    image: Option<&Image>,
    claim: &MachineClaim,
) -> BTreeMap<String, String> {
    let mut out: BTreeMap<String, String> = hook
        .params
        .iter()
        .filter_map(|(k, v)| v.default.clone().map(|d| (k.clone(), d)))
        .collect();
    if let Some(i) = image {
        out.extend(i.spec.params.clone());
    }
    out.extend(claim.spec.params.clone());
    out
}

/// Replaces `{{ name }}` and `{{ .name }}` in a script body with a
/// reference to the param's environment variable (`${ANNEAL_PARAM_NAME}`,
/// [`anneal_api::agent::param_var`]), never with the value: a value reaches
/// the shell only through the environment, so `$(...)` or quotes in it stay
/// literal. Returns the body and the names it used; an unknown name fails.
pub fn template(
    body: &str,
    values: &BTreeMap<String, String>,
) -> Result<(String, BTreeSet<String>), String /* param */> {
    let mut out = String::with_capacity(body.len());
    let mut used = BTreeSet::new();
    let mut rest = body;
    while let Some(i) = rest.find("{{") {
        out.push_str(&rest[..i]);
        let after = &rest[i + 2..];
        let Some(j) = after.find("}}") else {
            out.push_str(&rest[i..]);
            rest = "";
            break;
        };
        let key = after[..j].trim().trim_start_matches('.').trim();
        if !values.contains_key(key) {
            return Err(key.to_string());
        }
        out.push_str("${");
        out.push_str(&anneal_api::agent::param_var(key));
        out.push('}');
        used.insert(key.to_string());
        rest = &after[j + 2..];
    }
    out.push_str(rest);
    Ok((out, used))
}

/// The ordered hook names: the OS Image's, then the claim's; the default
/// hook when neither names one and an OS is deployed.
pub fn hook_order(image: Option<&Image>, claim: &MachineClaim) -> Vec<String> {
    let mut names: Vec<String> = image
        .map(|i| {
            i.spec
                .post_hook_refs
                .iter()
                .map(|r| r.name.clone())
                .collect()
        })
        .unwrap_or_default();
    names.extend(claim.spec.post_hook_refs.iter().map(|r| r.name.clone()));
    if names.is_empty() && image.is_some() {
        names.push(DEFAULT_HOOK.to_string());
    }
    names
}

/// `sha256:<hex>` of the canonical JSON of the resolved steps.
pub fn hooks_hash(steps: &[PlannedStep]) -> String {
    let json = serde_json::to_vec(steps).unwrap_or_default();
    format!("sha256:{}", hex::encode(Sha256::digest(&json)))
}

fn guid_from(seed: &str, what: &str) -> String {
    let h = Sha256::digest(format!("{seed}/{what}").as_bytes());
    let mut b = [0u8; 16];
    b.copy_from_slice(&h[..16]);
    // RFC 4122 version 4 / variant bits, as a random GUID would carry.
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let x = hex::encode_upper(b);
    format!(
        "{}-{}-{}-{}-{}",
        &x[0..8],
        &x[8..12],
        &x[12..16],
        &x[16..20],
        &x[20..32]
    )
}

fn default_type_guid(role: SlotRole) -> &'static str {
    match role {
        SlotRole::Esp => "C12A7328-F81F-11D2-BA4B-00A0C93EC93B",
        SlotRole::Swap => "0657FD6D-A4AB-43C4-84E5-0933C84B4F4F",
        SlotRole::Msr => "E3C9E316-0B5C-4DB8-817D-F92DF00215AE",
        SlotRole::Data => "0FC63DAF-8483-4772-8E79-3D69D8477DE4",
    }
}

fn role_of(role: SlotRole) -> Role {
    match role {
        SlotRole::Esp => Role::Esp,
        SlotRole::Swap => Role::Swap,
        SlotRole::Msr => Role::Msr,
        SlotRole::Data => Role::Data,
    }
}

fn ready_content<'c>(
    contents: &'c BTreeMap<String, PartitionContent>,
    name: &str,
) -> Result<&'c PartitionContent, PlanError> {
    let pc = contents.get(name).ok_or_else(|| PlanError::NotUsable {
        kind: "PartitionContent",
        name: name.into(),
        problem: "does not exist".into(),
    })?;
    let st = pc.status.as_ref();
    let ready = st.and_then(|s| s.state) == Some(anneal_api::ContentState::Ready);
    if !ready || st.and_then(|s| s.sha256.as_ref()).is_none() {
        return Err(PlanError::NotUsable {
            kind: "PartitionContent",
            name: name.into(),
            problem:
                "is not Ready (wait for its verification, see kubectl describe partitioncontent)"
                    .into(),
        });
    }
    Ok(pc)
}

/// Lays an Image out on a disk of `disk_size` bytes: slots packed in order
/// from 1 MiB, each 1 MiB aligned, the last one growing when asked.
pub fn layout_for(
    image: &Image,
    contents: &BTreeMap<String, PartitionContent>,
    disk: &HardwareDisk,
    seed: &str,
    content_url: &str,
    swarm: Option<(&SwarmInputs, &TransferSpec)>,
) -> Result<(Layout, Vec<PlannedContent>), PlanError> {
    let name = image.name_any();
    let ns = image.namespace().unwrap_or_default();
    let sector = u64::try_from(disk.logical_sector_size.unwrap_or(512).max(512)).unwrap_or(512);
    let disk_size = u64::try_from(disk.size_bytes).unwrap_or(0);
    let gpt = matches!(
        image.spec.layout.partition_table,
        anneal_api::PartitionTable::Gpt
    );
    let mut slots = Vec::new();
    let mut planned = Vec::new();
    let mut at = MIB;
    for s in &image.spec.layout.slots {
        let number = u32::try_from(s.number).unwrap_or(0);
        let mut size = s
            .size_bytes
            .and_then(|v| u64::try_from(v).ok())
            .unwrap_or(0);
        let mut content_ref = None;
        let mut fs_type = s.fs_type.clone();
        if let Some(r) = &s.content_ref {
            let pc = ready_content(contents, &r.name)?;
            size = size.max(u64::try_from(pc.spec.size_bytes).unwrap_or(0));
            fs_type = pc.spec.fs_type.clone();
            let st = pc.status.clone().unwrap_or_default();
            planned.push(PlannedContent {
                name: r.name.clone(),
                slot: number,
                index_url: format!("{content_url}/content/{ns}/{}/index", r.name),
                stream_url: format!("{content_url}/content/{ns}/{}/stream", r.name),
                index_sha256: st.index_sha256.unwrap_or_default(),
                stream_sha256: st.sha256.unwrap_or_default(),
                stream_bytes: u64::try_from(pc.spec.used_bytes).unwrap_or(0),
                swarm: swarm
                    .zip(st.info_hash.clone())
                    .map(|((sw, transfer), info_hash)| PlannedSwarm {
                        info_hash,
                        trackers: sw.trackers.clone(),
                        seeder_hosts: sw.seeder_hosts.clone(),
                        listen_port: sw.listen_port,
                        stall_timeout_seconds: sw.stall_timeout_seconds,
                        http_fallback: transfer.http_fallback.unwrap_or(true),
                        max_connections: transfer
                            .max_connections
                            .and_then(|n| u32::try_from(n).ok()),
                        max_uploads: transfer.max_uploads.and_then(|n| u32::try_from(n).ok()),
                        cache_size_mb: transfer.cache_size_mb.and_then(|n| u32::try_from(n).ok()),
                    }),
            });
            content_ref = Some(r.name.clone());
        }
        if size == 0 {
            return Err(PlanError::NotUsable {
                kind: "Image",
                name: name.clone(),
                problem: format!(
                    "slot {number} has no sizeBytes and no content; give it spec.layout.slots[].sizeBytes"
                ),
            });
        }
        let size = size.div_ceil(sector) * sector;
        slots.push(Slot {
            number,
            role: role_of(s.role),
            start_bytes: at,
            size_bytes: size,
            grow: s.grow.unwrap_or(false),
            type_guid: gpt.then(|| {
                s.type_guid
                    .clone()
                    .unwrap_or_else(|| default_type_guid(s.role).to_string())
                    .to_uppercase()
            }),
            part_uuid: gpt.then(|| {
                s.part_uuid
                    .clone()
                    .map(|u| u.to_uppercase())
                    .unwrap_or_else(|| guid_from(seed, &format!("{name}/part/{number}")))
            }),
            mbr_type: (!gpt).then_some(match s.role {
                SlotRole::Esp => 0xef,
                SlotRole::Swap => 0x82,
                _ => 0x83,
            }),
            bootable: !gpt && s.role == SlotRole::Esp,
            name: String::new(),
            attributes: 0,
            fs_type,
            uuid: s.uuid.clone(),
            label: None,
            content_ref,
        });
        at = (at + size).div_ceil(MIB) * MIB;
    }
    let need = at + if gpt { GPT_TAIL } else { 0 };
    if need > disk_size {
        return Err(PlanError::TooSmall {
            image: name,
            disk: disk_text(disk),
            need,
            have: disk_size,
        });
    }
    let layout = Layout {
        partition_table: if gpt { TableKind::Gpt } else { TableKind::Mbr },
        sector_size: sector,
        disk_size,
        disk_guid: gpt.then(|| guid_from(seed, &format!("{name}/disk"))),
        disk_signature: (!gpt).then(|| guid_from(seed, &format!("{name}/sig"))[..8].to_lowercase()),
        slots,
    };
    Ok((layout, planned))
}

fn image<'i>(images: &'i BTreeMap<String, Image>, name: &str) -> Result<&'i Image, PlanError> {
    let i = images.get(name).ok_or_else(|| PlanError::NotUsable {
        kind: "Image",
        name: name.into(),
        problem: "does not exist (create it or fix the claim's imageRef)".into(),
    })?;
    let ready = i.status.as_ref().and_then(|s| s.state) == Some(anneal_api::ImageState::Ready);
    if !ready {
        return Err(PlanError::NotUsable {
            kind: "Image",
            name: name.into(),
            problem: "is not Ready (see kubectl describe image)".into(),
        });
    }
    Ok(i)
}

fn resolved(image_name: &str, d: &HardwareDisk) -> ResolvedDisk {
    ResolvedDisk {
        image_ref: NameRef::new(image_name),
        device_name: dev_path(&d.device_name),
        serial_number: d.serial_number.clone(),
        wwn: d.wwn.clone(),
        size_bytes: Some(d.size_bytes),
    }
}

/// Plans a run. A plan that fails powers nothing on.
pub fn plan(inp: &Inputs<'_>) -> Result<Planned, PlanError> {
    let claim = inp.claim;
    if claim.spec.image_ref.is_none() && claim.spec.data_images.is_empty() {
        return Err(PlanError::Nothing);
    }
    let disks = inp
        .disks
        .ok_or_else(|| PlanError::NoInventory(inp.machine.to_string()))?;
    let os_image = claim
        .spec
        .image_ref
        .as_ref()
        .map(|r| image(inp.images, &r.name))
        .transpose()?;
    let mut targets: Vec<(&Image, &HardwareDisk, bool)> = Vec::new();
    if let Some(i) = os_image {
        let d = resolve_disk(
            &format!("Image {} (spec.targetDisk)", i.name_any()),
            claim.spec.target_disk.as_ref(),
            disks,
        )?;
        targets.push((i, d, true));
    }
    for (
        n,
        DataImage {
            image_ref,
            target_disk,
        },
    ) in claim.spec.data_images.iter().enumerate()
    {
        let i = image(inp.images, &image_ref.name)?;
        let d = resolve_disk(
            &format!("Image {} (spec.dataImages[{n}].targetDisk)", image_ref.name),
            Some(target_disk),
            disks,
        )?;
        targets.push((i, d, false));
    }
    let mut seen: BTreeMap<&str, String> = BTreeMap::new();
    for (i, d, _) in &targets {
        if let Some(first) = seen.insert(&d.device_name, i.name_any()) {
            return Err(PlanError::SameDisk {
                first,
                second: i.name_any(),
                disk: disk_text(d),
            });
        }
    }
    let mut planned_disks = Vec::new();
    let mut resolved_disks = Vec::new();
    for (i, d, os) in &targets {
        let transfer = claim.spec.transfer.clone().unwrap_or_default();
        let swarm = inp.swarm.map(|s| (s, &transfer));
        let (layout, contents) = layout_for(i, inp.contents, d, inp.seed, inp.content_url, swarm)?;
        planned_disks.push(PlannedDisk {
            image: i.name_any(),
            os: *os,
            device_name: dev_path(&d.device_name),
            serial_number: d.serial_number.clone(),
            wwn: d.wwn.clone(),
            layout: serde_json::to_value(&layout).unwrap_or_default(),
            contents,
        });
        resolved_disks.push(resolved(&i.name_any(), d));
    }
    let steps = steps(inp, os_image, targets.first().map(|t| t.1))?;
    let hooks_hash = hooks_hash(&steps);
    let os_disk_size = targets
        .first()
        .filter(|t| t.2)
        .map(|t| u64::try_from(t.1.size_bytes).unwrap_or(0));
    let day1 = config_drive(inp, os_image.zip(planned_disks.first()), os_disk_size)?;
    let spec = DeployRunSpec {
        machine_ref: NameRef::new(inp.machine.rsplit('/').next().unwrap_or(inp.machine)),
        claim_ref: NameRef::new(claim.name_any()),
        image_ref: claim.spec.image_ref.clone(),
        data_images: claim.spec.data_images.clone(),
        resolved_disks,
        hooks_hash: Some(hooks_hash),
        config_hash: day1.as_ref().map(|r| r.hash.clone()),
    };
    let plan = DeployPlan {
        run_id: String::new(),
        disks: planned_disks,
        steps,
        after_deploy: match claim.spec.after_deploy {
            AfterDeploy::Reboot => PlanAfterDeploy::Reboot,
            AfterDeploy::PowerOff => PlanAfterDeploy::PowerOff,
        },
        progress_interval_seconds: inp.progress_interval_seconds,
        architecture: inp.architecture.to_string(),
        seeding: inp.swarm.map(|s| s.seeding),
        config_drive: day1.map(|r| r.drive),
    };
    Ok(Planned { spec, plan })
}

/// The config drive of a claim that asks for one: the partition after the
/// OS layout's last, checked to fit the OS disk.
fn config_drive(
    inp: &Inputs<'_>,
    os: Option<(&Image, &PlannedDisk)>,
    disk_size: Option<u64>,
) -> Result<Option<super::cloudinit::Rendered>, PlanError> {
    use super::cloudinit;
    let claim = inp.claim;
    if !cloudinit::wanted(claim) {
        return Ok(None);
    }
    let Some((image, disk)) = os else {
        return Err(PlanError::Day1(
            "spec.userData, spec.networkData and spec.metaData need spec.imageRef: the config drive goes on the OS disk".into(),
        ));
    };
    let layout: Layout = serde_json::from_value(disk.layout.clone()).map_err(|e| {
        PlanError::Day1(format!(
            "the layout of Image {} does not read back: {e}",
            image.name_any()
        ))
    })?;
    let number = layout.slots.iter().map(|s| s.number).max().unwrap_or(0) + 1;
    let limit = match layout.partition_table {
        TableKind::Gpt => 128,
        TableKind::Mbr => 4,
    };
    if number > limit {
        return Err(PlanError::Day1(format!(
            "Image {} uses partition {} already: its {:?} table has no entry left for the config drive",
            image.name_any(),
            number - 1,
            layout.partition_table
        )));
    }
    let end = layout
        .slots
        .iter()
        .map(|s| s.start_bytes + s.size_bytes)
        .max()
        .unwrap_or(MIB);
    let need = end.div_ceil(MIB) * MIB + cloudinit::SIZE_BYTES + MIB + GPT_TAIL;
    let have = disk_size;
    if have.is_some_and(|h| need > h) {
        return Err(PlanError::TooSmall {
            image: format!("{} with its config drive", image.name_any()),
            disk: disk.device_name.clone(),
            need,
            have: have.unwrap_or_default(),
        });
    }
    let d = inp
        .day1
        .ok_or_else(|| PlanError::Day1("the manager read no Day-1 inputs for this claim".into()))?;
    let salt = claim.uid().unwrap_or_default();
    cloudinit::render(claim, d, number, &salt)
        .map(Some)
        .map_err(PlanError::Day1)
}

fn steps(
    inp: &Inputs<'_>,
    os_image: Option<&Image>,
    os_disk: Option<&HardwareDisk>,
) -> Result<Vec<PlannedStep>, PlanError> {
    let default = default_hook();
    let family = os_image.map(|i| i.spec.os_family);
    let mut out = Vec::new();
    for hook_name in hook_order(os_image, inp.claim) {
        let spec = match inp.hooks.get(&hook_name) {
            Some(h) => &h.spec,
            None if hook_name == DEFAULT_HOOK => &default,
            None => {
                return Err(PlanError::NotUsable {
                    kind: "PostHook",
                    name: hook_name,
                    problem: "does not exist (create it or remove it from postHookRefs)".into(),
                });
            }
        };
        let mut values = merge_params(spec, os_image, inp.claim);
        values.insert(
            "machineName".into(),
            inp.machine.rsplit('/').next().unwrap_or_default().into(),
        );
        values.insert(
            "imageName".into(),
            os_image.map(ResourceExt::name_any).unwrap_or_default(),
        );
        values.insert(
            "targetDisk".into(),
            os_disk
                .map(|d| dev_path(&d.device_name))
                .unwrap_or_default(),
        );
        for (n, st) in spec.steps.iter().enumerate() {
            if let (Some(want), Some(have)) = (st.os_family, family)
                && want != have
            {
                continue;
            }
            let step = st.name.clone().unwrap_or_else(|| format!("step-{}", n + 1));
            let mut used = BTreeSet::new();
            let script = match &st.script {
                None => None,
                Some(src) => {
                    let body = if let Some(b) = &src.inline {
                        b.clone()
                    } else {
                        let key = if let Some(r) = &src.config_map_ref {
                            format!("configmap/{}/{}", r.name, r.key)
                        } else if let Some(r) = &src.secret_ref {
                            format!("secret/{}/{}", r.name, r.key)
                        } else {
                            String::new()
                        };
                        inp.scripts.get(&key).cloned().ok_or_else(|| PlanError::NotUsable {
                            kind: "PostHook",
                            name: hook_name.clone(),
                            problem: format!(
                                "step {step}: script source {key} is missing (create the ConfigMap/Secret with that key)"
                            ),
                        })?
                    };
                    let (text, names) =
                        template(&body, &values).map_err(|param| PlanError::MissingParam {
                            hook: hook_name.clone(),
                            step: step.clone(),
                            param,
                        })?;
                    used = names;
                    Some(text)
                }
            };
            let declared: BTreeSet<&String> = spec.params.keys().collect();
            let params = values
                .iter()
                .filter(|(k, _)| declared.contains(k) || used.contains(*k))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            out.push(PlannedStep {
                hook: hook_name.clone(),
                step,
                builtin: st.builtin.map(|b| builtin_name(b).to_string()),
                script,
                timeout_seconds: u32::try_from(st.timeout_seconds.max(1)).unwrap_or(60),
                params,
            });
        }
    }
    Ok(out)
}

/// Whether the claim's intent differs from a run's snapshot
/// (`resolvedDisks` excluded, `hooksHash` included).
pub fn intent_differs(last: &DeployRunSpec, next: &DeployRunSpec) -> bool {
    last.image_ref.as_ref().map(|r| &r.name) != next.image_ref.as_ref().map(|r| &r.name)
        || last.data_images != next.data_images
        || last.hooks_hash != next.hooks_hash
        || last.config_hash != next.config_hash
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn disk(name: &str, serial: &str, gb: i64) -> HardwareDisk {
        serde_json::from_value(json!({
            "deviceName": name, "sizeBytes": gb * 1_000_000_000, "serialNumber": serial,
            "rotational": false, "logicalSectorSize": 512
        }))
        .unwrap()
    }

    fn image(name: &str, hooks: &[&str], params: Value) -> Image {
        serde_json::from_value(json!({
            "apiVersion": "anneal.dev/v1alpha1", "kind": "Image",
            "metadata": {"name": name, "namespace": "ns"},
            "spec": {"osFamily": "Linux", "bootable": true,
                "layout": {"partitionTable": "gpt", "slots": [
                    {"number": 1, "role": "esp", "contentRef": {"name": format!("{name}-p1")}},
                    {"number": 2, "role": "swap", "fsType": "swap", "sizeBytes": 67108864,
                     "uuid": "0e3b0c44-298f-4c14-9afb-f4c8996fb924"},
                    {"number": 3, "role": "data", "contentRef": {"name": format!("{name}-p3")}, "grow": true}
                ]},
                "params": params,
                "postHookRefs": hooks.iter().map(|h| json!({"name": h})).collect::<Vec<_>>()},
            "status": {"state": "Ready"}
        }))
        .unwrap()
    }

    fn content(name: &str, size: i64, used: i64) -> PartitionContent {
        serde_json::from_value(json!({
            "apiVersion": "anneal.dev/v1alpha1", "kind": "PartitionContent",
            "metadata": {"name": name, "namespace": "ns"},
            "spec": {"fsType": "ext4", "usedBytes": used, "sizeBytes": size, "lastExtentEnd": used,
                     "blockSize": 4096, "pieceLength": 4194304},
            "status": {"state": "Ready", "sha256": "ab", "indexSha256": "cd"}
        }))
        .unwrap()
    }

    fn claim(spec: Value) -> MachineClaim {
        serde_json::from_value(json!({
            "apiVersion": "anneal.dev/v1alpha1", "kind": "MachineClaim",
            "metadata": {"name": "c1", "namespace": "ns"}, "spec": spec
        }))
        .unwrap()
    }

    fn hook(params: Value, steps: Value) -> PostHook {
        serde_json::from_value(json!({
            "apiVersion": "anneal.dev/v1alpha1", "kind": "PostHook",
            "metadata": {"name": "h", "namespace": "ns"},
            "spec": {"params": params, "steps": steps}
        }))
        .unwrap()
    }

    use serde_json::Value;

    struct World {
        images: BTreeMap<String, Image>,
        contents: BTreeMap<String, PartitionContent>,
        hooks: BTreeMap<String, PostHook>,
        scripts: BTreeMap<String, String>,
        disks: Vec<HardwareDisk>,
    }

    impl World {
        fn new() -> Self {
            let mut images = BTreeMap::new();
            images.insert("os".into(), image("os", &[], json!({})));
            images.insert("data".into(), image("data", &[], json!({})));
            let mut contents = BTreeMap::new();
            for n in ["os-p1", "data-p1"] {
                contents.insert(n.to_string(), content(n, 64 << 20, 8 << 20));
            }
            for n in ["os-p3", "data-p3"] {
                contents.insert(n.to_string(), content(n, 1 << 30, 300 << 20));
            }
            Self {
                images,
                contents,
                hooks: BTreeMap::new(),
                scripts: BTreeMap::new(),
                disks: vec![disk("vda", "A1", 8), disk("vdb", "B1", 8)],
            }
        }

        fn plan(&self, c: &MachineClaim) -> Result<Planned, PlanError> {
            self.plan_in_swarm(c, None)
        }

        fn plan_in_swarm(
            &self,
            c: &MachineClaim,
            swarm: Option<&SwarmInputs>,
        ) -> Result<Planned, PlanError> {
            plan(&Inputs {
                claim: c,
                machine: "ns/m1",
                architecture: "x86_64",
                disks: Some(&self.disks),
                images: &self.images,
                contents: &self.contents,
                hooks: &self.hooks,
                scripts: &self.scripts,
                content_url: "http://10.0.0.1:8081",
                progress_interval_seconds: 2,
                seed: "uid-1",
                swarm,
                day1: None,
            })
        }
    }

    /// A Site with a swarm: every content gets one, with the claim's
    /// `spec.transfer` (absent: HTTP fallback on, the agent's defaults).
    #[test]
    fn the_claims_transfer_settings_reach_each_contents_swarm() {
        let mut w = World::new();
        w.disks.truncate(1);
        for c in w.contents.values_mut() {
            c.status.as_mut().unwrap().info_hash = Some("0123".into());
        }
        let sw = SwarmInputs {
            trackers: vec!["http://10.0.0.1:6969/announce".into()],
            seeder_hosts: vec!["10.0.0.1".into()],
            listen_port: 6881,
            stall_timeout_seconds: 30,
            seeding: anneal_api::agent::SeedPolicy {
                idle_seconds: 15,
                max_seconds: 300,
            },
        };
        let swarms = |c: &MachineClaim| -> Vec<PlannedSwarm> {
            let p = w.plan_in_swarm(c, Some(&sw)).unwrap();
            p.plan.disks[0]
                .contents
                .iter()
                .map(|c| c.swarm.clone().unwrap())
                .collect()
        };
        let tuned = claim(json!({"imageRef": {"name": "os"}, "transfer": {
            "maxConnections": 40, "maxUploads": 4, "cacheSizeMB": 128, "httpFallback": false}}));
        let got = swarms(&tuned);
        assert_eq!(got.len(), 2);
        for s in &got {
            assert_eq!(s.info_hash, "0123");
            assert_eq!(s.max_connections, Some(40));
            assert_eq!(s.max_uploads, Some(4));
            assert_eq!(s.cache_size_mb, Some(128));
            assert!(!s.http_fallback);
            let v = serde_json::to_value(s).unwrap();
            assert_eq!(v["cacheSizeMB"], 128, "{v}");
            assert_eq!(v["maxConnections"], 40, "{v}");
            assert_eq!(v["maxUploads"], 4, "{v}");
        }
        for s in swarms(&claim(json!({"imageRef": {"name": "os"}}))) {
            assert_eq!(
                (s.max_connections, s.max_uploads, s.cache_size_mb),
                (None, None, None)
            );
            assert!(s.http_fallback);
            let v = serde_json::to_value(&s).unwrap();
            assert!(v.get("cacheSizeMB").is_none(), "{v}");
        }
    }

    #[test]
    fn ambiguous_and_unmatched_hints_fail_listing_the_candidates() {
        let w = World::new();
        let e = w
            .plan(&claim(
                json!({"machineName": "m1", "imageRef": {"name": "os"}}),
            ))
            .unwrap_err();
        let msg = e.to_string();
        assert!(
            matches!(e, PlanError::AmbiguousDisk { count: 2, .. }),
            "{msg}"
        );
        assert!(
            msg.contains("/dev/vda") && msg.contains("/dev/vdb") && msg.contains("serialNumber"),
            "{msg}"
        );
        let e = w
            .plan(&claim(
                json!({"machineName": "m1", "imageRef": {"name": "os"},
                "targetDisk": {"minSizeGigabytes": 2}}),
            ))
            .unwrap_err();
        assert!(matches!(e, PlanError::AmbiguousDisk { .. }), "{e}");
        let e = w
            .plan(&claim(
                json!({"machineName": "m1", "imageRef": {"name": "os"},
                "targetDisk": {"serialNumber": "ZZ"}}),
            ))
            .unwrap_err();
        assert!(matches!(e, PlanError::NoDisk { .. }), "{e}");
        assert!(
            e.to_string().contains("serial A1") && e.to_string().contains("serial B1"),
            "{e}"
        );
    }

    #[test]
    fn os_and_data_images_resolve_to_distinct_disks_with_a_packed_layout() {
        let w = World::new();
        let c = claim(json!({"machineName": "m1", "imageRef": {"name": "os"},
            "targetDisk": {"serialNumber": "A1"},
            "dataImages": [{"imageRef": {"name": "data"}, "targetDisk": {"serialNumber": "B1"}}]}));
        let p = w.plan(&c).unwrap();
        assert_eq!(p.spec.resolved_disks.len(), 2);
        assert_eq!(p.spec.resolved_disks[0].device_name, "/dev/vda");
        assert_eq!(p.spec.resolved_disks[1].device_name, "/dev/vdb");
        assert!(p.plan.disks[0].os && !p.plan.disks[1].os);
        let l: Layout = serde_json::from_value(p.plan.disks[0].layout.clone()).unwrap();
        assert_eq!(l.slots[0].start_bytes, MIB);
        assert_eq!(l.slots[1].start_bytes, MIB + (64 << 20));
        assert_eq!(l.slots[2].start_bytes, MIB + (128 << 20));
        assert!(l.slots[2].grow);
        assert_eq!(
            l.slots[1].uuid.as_deref(),
            Some("0e3b0c44-298f-4c14-9afb-f4c8996fb924")
        );
        assert_eq!(
            l.slots[0].type_guid.as_deref(),
            Some("C12A7328-F81F-11D2-BA4B-00A0C93EC93B")
        );
        assert_eq!(
            p.plan.disks[0].contents[1].stream_url,
            "http://10.0.0.1:8081/content/ns/os-p3/stream"
        );
        assert_eq!(p.plan.disks[0].contents[1].index_sha256, "cd");
        // Stable across replans (same seed).
        assert_eq!(w.plan(&c).unwrap(), p);
        // The default hook only for the OS disk's run.
        let names: Vec<_> = p.plan.steps.iter().map(|s| s.step.as_str()).collect();
        assert_eq!(
            names,
            ["mkswap", "install-removable-fallback", "efibootmgr"]
        );
        // Same disk twice fails.
        let c = claim(json!({"machineName": "m1", "imageRef": {"name": "os"},
            "targetDisk": {"serialNumber": "A1"},
            "dataImages": [{"imageRef": {"name": "data"}, "targetDisk": {"deviceName": "vda"}}]}));
        assert!(matches!(
            w.plan(&c).unwrap_err(),
            PlanError::SameDisk { .. }
        ));
    }

    #[test]
    fn data_only_claims_get_no_default_hook_and_too_small_disks_fail() {
        let mut w = World::new();
        let c = claim(json!({"machineName": "m1",
            "dataImages": [{"imageRef": {"name": "data"}, "targetDisk": {"serialNumber": "B1"}}]}));
        let p = w.plan(&c).unwrap();
        assert!(p.plan.steps.is_empty());
        assert!(p.spec.image_ref.is_none());
        w.disks = vec![disk("vda", "A1", 1)];
        let e = w
            .plan(&claim(
                json!({"machineName": "m1", "imageRef": {"name": "os"}}),
            ))
            .unwrap_err();
        assert!(matches!(e, PlanError::TooSmall { .. }), "{e}");
    }

    #[test]
    fn params_precedence_templating_and_hooks_hash() {
        let mut w = World::new();
        w.images.insert(
            "os".into(),
            image("os", &["h"], json!({"who": "image", "b": "image"})),
        );
        w.hooks.insert(
            "h".into(),
            hook(
                json!({"who": {"default": "hook"}, "a": {"default": "hook-a"}, "b": {}}),
                json!([{"name": "say", "script": {"inline": "echo {{ who }} {{ .a }} {{b}} on {{ machineName }} {{targetDisk}}"}},
                       {"builtin": "growLastPartition", "timeoutSeconds": 120},
                       {"name": "win", "osFamily": "Windows", "script": {"inline": "x"}}]),
            ),
        );
        let c = claim(json!({"machineName": "m1", "imageRef": {"name": "os"},
            "targetDisk": {"serialNumber": "A1"}, "params": {"who": "claim"}}));
        let p = w.plan(&c).unwrap();
        assert_eq!(p.plan.steps.len(), 2, "the Windows step is filtered out");
        // names become variable references; the values travel in params
        assert_eq!(
            p.plan.steps[0].script.as_deref(),
            Some(
                "echo ${ANNEAL_PARAM_WHO} ${ANNEAL_PARAM_A} ${ANNEAL_PARAM_B} on ${ANNEAL_PARAM_MACHINENAME} ${ANNEAL_PARAM_TARGETDISK}"
            )
        );
        let params = &p.plan.steps[0].params;
        for (k, v) in [
            ("who", "claim"),
            ("a", "hook-a"),
            ("b", "image"),
            ("machineName", "m1"),
            ("targetDisk", "/dev/vda"),
        ] {
            assert_eq!(params.get(k).map(String::as_str), Some(v), "param {k}");
        }
        assert_eq!(p.plan.steps[1].step, "step-2");
        assert_eq!(p.plan.steps[1].timeout_seconds, 120);
        // Editing only the hook changes hooksHash (a new run), nothing else.
        let before = p.spec.clone();
        w.hooks.insert(
            "h".into(),
            hook(
                json!({"who": {"default": "hook"}, "a": {"default": "hook-a"}, "b": {}}),
                json!([{"name": "say", "script": {"inline": "echo changed"}}]),
            ),
        );
        let after = w.plan(&c).unwrap().spec;
        assert_ne!(before.hooks_hash, after.hooks_hash);
        assert!(intent_differs(&before, &after));
        // Only the resolved disks differing starts no run.
        let mut drift = before.clone();
        drift.resolved_disks[0].device_name = "/dev/sdz".into();
        assert!(!intent_differs(&before, &drift));
        // A missing param names hook, step and param.
        w.hooks.insert(
            "h".into(),
            hook(
                json!({}),
                json!([{"name": "s", "script": {"inline": "{{ nope }}"}}]),
            ),
        );
        let e = w.plan(&c).unwrap_err().to_string();
        assert!(e.contains("PostHook h step s: parameter nope"), "{e}");
        // A ConfigMap script source that is missing is named.
        w.hooks.insert(
            "h".into(),
            hook(
                json!({}),
                json!([{"name": "s", "script": {"configMapRef": {"name": "cm", "key": "run.sh"}}}]),
            ),
        );
        let e = w.plan(&c).unwrap_err().to_string();
        assert!(e.contains("configmap/cm/run.sh"), "{e}");
        w.scripts
            .insert("configmap/cm/run.sh".into(), "echo {{imageName}}".into());
        let step = &w.plan(&c).unwrap().plan.steps[0];
        assert_eq!(
            step.script.as_deref(),
            Some("echo ${ANNEAL_PARAM_IMAGENAME}")
        );
        assert_eq!(step.params.get("imageName").map(String::as_str), Some("os"));
    }

    #[test]
    fn a_param_is_never_spliced_into_the_script() {
        let mut w = World::new();
        w.images.insert("os".into(), image("os", &["h"], json!({})));
        w.hooks.insert(
            "h".into(),
            hook(
                json!({"p": {}}),
                json!([{"name": "s", "script": {"inline": "echo {{ p }} \"{{p}}\""}}]),
            ),
        );
        let evil = "$(touch /tmp/pwned) `id` '; rm -rf / #";
        let c = claim(json!({"machineName": "m1", "imageRef": {"name": "os"},
            "targetDisk": {"serialNumber": "A1"}, "params": {"p": evil}}));
        let p = w.plan(&c).unwrap();
        let step = &p.plan.steps[0];
        let script = step.script.as_deref().unwrap();
        assert_eq!(script, "echo ${ANNEAL_PARAM_P} \"${ANNEAL_PARAM_P}\"");
        assert!(!script.contains("touch"), "{script}");
        assert_eq!(step.params.get("p").map(String::as_str), Some(evil));
    }

    #[test]
    fn unready_images_and_contents_are_named() {
        let mut w = World::new();
        w.contents.get_mut("os-p3").unwrap().status = None;
        let e = w
            .plan(&claim(json!({"machineName": "m1", "imageRef": {"name": "os"}, "targetDisk": {"serialNumber": "A1"}})))
            .unwrap_err()
            .to_string();
        assert!(e.contains("PartitionContent os-p3 is not Ready"), "{e}");
        let e = w
            .plan(&claim(
                json!({"machineName": "m1", "imageRef": {"name": "gone"}}),
            ))
            .unwrap_err()
            .to_string();
        assert!(e.contains("Image gone does not exist"), "{e}");
    }

    /// A claim with Day-1 data gets a config drive after the layout's last
    /// partition, its files hashed into the intent; the user data itself is
    /// never in the spec.
    #[test]
    fn day1_data_makes_a_config_drive_and_a_changed_user_data_a_new_intent() {
        use super::super::cloudinit::Day1;
        let w = World::new();
        let c = claim(
            json!({"imageRef": {"name": "os"}, "targetDisk": {"serialNumber": "A1"}, "userData": {"name": "ud"},
            "metaData": {"publicKeysSecretRef": {"name": "keys", "key": "k"}}}),
        );
        let with = |ud: &str| {
            let mut d = Day1 {
                namespace: "ns",
                machine: "m1",
                ..Day1::default()
            };
            d.secrets
                .insert("secret/ud/userData".into(), ud.as_bytes().to_vec());
            d.secrets
                .insert("secret/keys/k".into(), b"ssh-ed25519 AAAA op@x\n".to_vec());
            d
        };
        let d1 = with("#cloud-config\nruncmd: [echo s3cr3t-one]\n");
        let mut inp = Inputs {
            claim: &c,
            machine: "ns/m1",
            architecture: "x86_64",
            disks: Some(&w.disks),
            images: &w.images,
            contents: &w.contents,
            hooks: &w.hooks,
            scripts: &w.scripts,
            content_url: "http://10.0.0.1:8081",
            progress_interval_seconds: 2,
            seed: "uid-1",
            swarm: None,
            day1: Some(&d1),
        };
        let one = plan(&inp).unwrap();
        let cd = one.plan.config_drive.as_ref().unwrap();
        assert_eq!(cd.partition, 4, "after slot 3");
        assert_eq!(cd.label, "CIDATA");
        assert_eq!(
            cd.files.keys().collect::<Vec<_>>(),
            ["meta-data", "user-data"]
        );
        let meta: Value = serde_json::from_slice(cd.files["meta-data"].expose()).unwrap();
        assert_eq!(meta["local-hostname"], "m1");
        assert_eq!(meta["public-keys"], json!(["ssh-ed25519 AAAA op@x"]));
        let spec = serde_json::to_string(&one.spec).unwrap();
        assert!(!spec.contains("s3cr3t"), "{spec}");
        assert!(one.spec.config_hash.is_some());
        let again = plan(&inp).unwrap();
        assert!(!intent_differs(&one.spec, &again.spec));
        let d2 = with("#cloud-config\nruncmd: [echo s3cr3t-two]\n");
        inp.day1 = Some(&d2);
        let two = plan(&inp).unwrap();
        assert!(intent_differs(&one.spec, &two.spec));
        // a missing Secret key names the field and the Secret, no value
        let empty = Day1 {
            namespace: "ns",
            machine: "m1",
            ..Day1::default()
        };
        inp.day1 = Some(&empty);
        let err = plan(&inp).unwrap_err().to_string();
        assert!(
            err.contains("spec.userData") && err.contains("Secret ud") && err.contains("userData"),
            "{err}"
        );
        // no OS image: refused
        let data_only = claim(
            json!({"dataImages": [{"imageRef": {"name": "data"}, "targetDisk": {"serialNumber": "B1"}}],
            "userData": {"name": "ud"}}),
        );
        inp.claim = &data_only;
        inp.day1 = Some(&d1);
        let err = plan(&inp).unwrap_err().to_string();
        assert!(err.contains("need spec.imageRef"), "{err}");
    }
}
