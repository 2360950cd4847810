//! The agent protocol of docs/api.md: the JSON bodies the agent and the manager's
//! agent API exchange over HTTPS, with no cluster dependency (the static musl
//! agent builds against this module without kube).
//!
//! Every request carries the header [`SCHEMA_HEADER`]`: `[`SCHEMA_VERSION`];
//! a server refuses a mismatch with 426. Every body rejects unknown fields and
//! is read with at most [`MAX_BODY_BYTES`] bytes.
//!
//! | method | path | request | response |
//! |---|---|---|---|
//! | POST | [`paths::REGISTER`] | [`RegisterRequest`] | [`RegisterResponse`] |
//! | PUT | [`paths::HARDWARE`] | [`HardwareReport`] | empty (204) |
//! | GET | [`paths::NEXT`] | – | [`NextAction`] |
//! | POST | [`paths::PROGRESS`] | [`ProgressRequest`] | [`ProgressResponse`] |
//! | POST | [`paths::RESULT`] | [`ResultRequest`] | empty (204) |
//!
//! Requests after `register` authenticate with `Authorization: Bearer
//! <session token>`. Errors answer an [`ErrorResponse`] body.

use std::fmt;

use serde::{Deserialize, Serialize};

/// The version of this contract; bumped on any incompatible change of a body.
pub const CONTRACT_VERSION: u32 = 1;
/// The header every agent request carries.
pub const SCHEMA_HEADER: &str = "Anneal-Agent-Schema";
/// The value of [`SCHEMA_HEADER`] for this contract.
pub const SCHEMA_VERSION: &str = "1";
/// The largest body either side reads (requests and responses).
pub const MAX_BODY_BYTES: usize = 1 << 20;
/// The longest failure reason kept after [`sanitize_reason`].
pub const MAX_REASON_CHARS: usize = 512;

/// The request paths of the agent API.
pub mod paths {
    /// `POST`: trade the boot token for a session token.
    pub const REGISTER: &str = "/v1/agent/register";
    /// `PUT`: the hardware inventory.
    pub const HARDWARE: &str = "/v1/agent/hardware";
    /// `GET`: long-poll for the next action.
    pub const NEXT: &str = "/v1/agent/next";
    /// `POST`: deploy progress.
    pub const PROGRESS: &str = "/v1/agent/progress";
    /// `POST`: the outcome of a run.
    pub const RESULT: &str = "/v1/agent/result";
}

/// A bearer secret (boot or session token): serialised as a plain string on
/// the wire, but never shown by `Debug`, with no `Display`, and overwritten
/// with zeros when dropped.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Token(String);

impl Token {
    /// Wraps a secret.
    pub fn new(secret: impl Into<String>) -> Self {
        Self(secret.into())
    }

    /// The secret itself, for the one place that must send or hash it.
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// Length in bytes (safe to log).
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// True for an empty secret.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Compares with `other` in time that depends only on the lengths.
    pub fn ct_eq(&self, other: &[u8]) -> bool {
        ct_eq(self.0.as_bytes(), other)
    }
}

/// Constant-time equality of two byte strings (time depends only on lengths).
pub fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let mut acc = 0u8;
    for (x, y) in a.iter().zip(b) {
        acc |= std::hint::black_box(x ^ y);
    }
    acc == 0
}

impl fmt::Debug for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Token(<redacted, {} bytes>)", self.0.len())
    }
}

impl Drop for Token {
    fn drop(&mut self) {
        // Take the buffer (no copy), overwrite it, and keep the writes from
        // being optimised away.
        let mut bytes = std::mem::take(&mut self.0).into_bytes();
        for b in bytes.iter_mut() {
            *b = 0;
        }
        std::hint::black_box(&bytes);
    }
}

/// `POST /v1/agent/register`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RegisterRequest {
    /// The single-use boot token from `anneal.token`.
    pub boot_token: Token,
    /// The MAC of the NIC the machine booted from (`aa:bb:cc:dd:ee:ff`).
    pub boot_mac: String,
    /// The agent's version (its crate version).
    pub agent_version: String,
    /// `namespace/name` from `anneal.machine`, a lookup hint; the token is
    /// what authenticates.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub machine: Option<String>,
}

/// The answer to a registration.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RegisterResponse {
    /// Bearer token for every later request; short-lived and rotated.
    pub session_token: Token,
    /// Seconds until the session token expires.
    pub expires_in_seconds: u64,
    /// The machine this agent now speaks for.
    pub machine: MachineIdentity,
}

/// Who the manager says this machine is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MachineIdentity {
    /// Namespace of the Machine.
    pub namespace: String,
    /// Name of the Machine.
    pub name: String,
}

/// `PUT /v1/agent/hardware`: the MachineHardware spec.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct HardwareReport {
    /// Disks, removable ones excluded unless asked for.
    pub disks: Vec<Disk>,
    /// Physical NICs (those backed by a device).
    pub nics: Vec<Nic>,
    /// Installed memory in bytes (DMI memory devices where present, else the
    /// kernel's MemTotal).
    pub memory_bytes: u64,
    /// Processors.
    pub cpu: Cpu,
    /// Firmware mode and Secure Boot.
    pub firmware: Firmware,
    /// DMI system identity.
    pub system: SystemInfo,
}

/// One disk, with every field a disk hint can match.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Disk {
    /// Kernel name, e.g. `nvme0n1`, `sda`, `vda`.
    pub device_name: String,
    /// Capacity in bytes.
    pub size_bytes: u64,
    /// Logical sector size in bytes.
    pub logical_sector_size: u32,
    /// Physical sector size in bytes.
    pub physical_sector_size: u32,
    /// True for spinning media.
    pub rotational: bool,
    /// True when the kernel or the bus (USB, MMC) marks it removable.
    pub removable: bool,
    /// Model string, trimmed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// Vendor string, trimmed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vendor: Option<String>,
    /// Serial number, trimmed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub serial_number: Option<String>,
    /// World-wide name (`0x5000c500a1b2c3d4`, `eui.…`, `naa.…`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wwn: Option<String>,
    /// SCSI host:channel:target:lun.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hctl: Option<String>,
    /// The PCI address of the controller, e.g. `0000:00:04.0`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pcie_path: Option<String>,
    /// Physical slot: the SES enclosure slot (`slot` of the
    /// `/sys/class/enclosure/*/*` component whose `device` is the disk's SCSI
    /// device), else the PCIe slot of the disk's PCI device (the controller:
    /// the NVMe function, the HBA) when `/sys/bus/pci/slots/<name>/address`
    /// is its domain:bus:device and `<name>` is a number; else none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slot_number: Option<u32>,
    /// Bus, e.g. `nvme`, `virtio`, `scsi`, `ata`, `usb`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bus: Option<String>,
    /// Existing partitions and what is on them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub partitions: Vec<Partition>,
}

/// A partition found on a disk.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Partition {
    /// Kernel name, e.g. `nvme0n1p1`.
    pub name: String,
    /// Partition number.
    pub number: u32,
    /// Size in bytes.
    pub size_bytes: u64,
    /// Filesystem found by the superblock prober (`ext4`, `vfat`, …).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fs_type: Option<String>,
    /// Filesystem UUID as blkid prints it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uuid: Option<String>,
    /// Filesystem label.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub label: Option<String>,
}

/// One NIC.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Nic {
    /// Kernel name, e.g. `eth0`, `enp1s0`.
    pub name: String,
    /// MAC, lowercase with colons.
    pub mac: String,
    /// Link speed in Mbit/s when the link is up and the driver knows it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub speed_mbps: Option<u32>,
    /// Bound driver.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub driver: Option<String>,
    /// PCI address of the device (or of its PCI parent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pci_address: Option<String>,
    /// True when the link has carrier.
    pub link: bool,
    /// The switch port at the other end, from the first LLDP frame the
    /// link received during inspection; absent when none came in time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lldp: Option<Lldp>,
}

/// What the neighbour (a switch) announced over LLDP on one link.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Lldp {
    /// Chassis ID: a MAC as `aa:bb:cc:dd:ee:ff`, a network address as an
    /// IP, a name as text, other subtypes as colon-separated hex.
    pub chassis_id: String,
    /// Port ID, rendered like the chassis ID (often the switch's interface
    /// name, such as `Ethernet1/17`).
    pub port_id: String,
    /// Port Description TLV.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port_description: Option<String>,
    /// System Name TLV (the switch's host name).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub system_name: Option<String>,
}

/// Processors.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Cpu {
    /// Logical CPUs.
    pub count: u32,
    /// Model name of the first CPU.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// Machine architecture as the kernel names it (`x86_64`, `aarch64`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub architecture: Option<String>,
}

/// How the machine booted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FirmwareMode {
    /// UEFI (efivarfs present).
    Uefi,
    /// Legacy BIOS.
    #[default]
    Bios,
}

/// Firmware facts.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Firmware {
    /// UEFI or BIOS.
    pub mode: FirmwareMode,
    /// Secure Boot enabled (always false on BIOS).
    pub secure_boot: bool,
}

/// DMI system identity.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SystemInfo {
    /// `sys_vendor`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vendor: Option<String>,
    /// `product_name`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub product: Option<String>,
    /// `product_serial`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub serial: Option<String>,
    /// `product_uuid`, lowercase.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uuid: Option<String>,
}

/// `GET /v1/agent/next`: what the agent does next.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "action", rename_all = "camelCase", deny_unknown_fields)]
pub enum NextAction {
    /// Nothing yet: poll again (the server held the request as long as it
    /// wanted; the agent waits `retryAfterSeconds` before the next poll).
    #[serde(rename_all = "camelCase")]
    Wait {
        /// Seconds before the next poll.
        #[serde(default)]
        retry_after_seconds: u32,
    },
    /// Deploy: everything the agent needs for one DeployRun, and nothing else.
    Deploy {
        /// The deploy plan.
        plan: Box<DeployPlan>,
    },
    /// Wipe disks (a released Machine with reclaimPolicy Recycle): discard
    /// where supported, else zero the partition tables at both ends and
    /// the known filesystem signatures; then report `result` with `runId`
    /// = `id`.
    #[serde(rename_all = "camelCase")]
    Wipe {
        /// What `result` names.
        id: String,
        /// Device paths (`/dev/vda`).
        disks: Vec<String>,
    },
    /// Power off.
    #[serde(rename = "poweroff")]
    PowerOff,
    /// Reboot.
    Reboot,
    /// Open a debug shell on the console.
    Shell,
}

/// The plan of one DeployRun, handed to the agent by `next`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct DeployPlan {
    /// The DeployRun's name; every `progress` and `result` names it.
    pub run_id: String,
    /// One entry per disk written: the OS image first, then data images.
    pub disks: Vec<PlannedDisk>,
    /// The post-install steps, in order (OS Image's hooks, then the claim's).
    #[serde(default)]
    pub steps: Vec<PlannedStep>,
    /// What to do after success: `Reboot` (into the deployed OS) or `PowerOff`.
    pub after_deploy: AfterDeploy,
    /// Seconds between two `progress` reports (the agent reports at least this
    /// often while a run is active).
    pub progress_interval_seconds: u32,
    /// The machine's architecture (`x86_64` or `aarch64`): picks the
    /// removable-media fallback path (`BOOTX64.EFI` or `BOOTAA64.EFI`).
    pub architecture: String,
    /// Seeding after the last content is written (contents with a swarm
    /// only); absent: the agent stops serving at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seeding: Option<SeedPolicy>,
    /// The cloud-init config drive written on the OS disk (docs/deploy.md,
    /// "Day-1 configuration (cloud-init)"); absent: none is written.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config_drive: Option<PlannedConfigDrive>,
}

/// GPT type GUID of the config drive partition (Microsoft basic data, what
/// a FAT file system carries).
pub const CONFIG_DRIVE_TYPE_GUID: &str = "EBD0A0A2-B9E5-4433-87C0-68B6B72699C7";
/// MBR type byte of the config drive partition (FAT32 LBA).
pub const CONFIG_DRIVE_MBR_TYPE: u8 = 0x0c;
/// GPT partition name of the config drive.
pub const CONFIG_DRIVE_PART_NAME: &str = "config-drive";

/// A cloud-init NoCloud config drive: a FAT file system labelled
/// [`label`](Self::label) (`CIDATA`) in its own partition at the end of the
/// OS disk, holding `user-data`, `meta-data` and `network-config` as given.
///
/// The agent reserves the partition when it writes the OS disk's table: it
/// ends at the last usable sector (1 MiB aligned start), a growing last slot
/// of the layout stops before it, and `growLastPartition` never grows past it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PlannedConfigDrive {
    /// Partition number on the OS disk (the layout's highest slot + 1).
    pub partition: u32,
    /// Size of the partition in bytes (a multiple of 1 MiB).
    pub size_bytes: u64,
    /// File system label (`CIDATA`; cloud-init matches it in either case).
    pub label: String,
    /// The files in the root directory, by name (`user-data`, `meta-data`,
    /// `network-config`).
    pub files: std::collections::BTreeMap<String, SecretBytes>,
}

/// Bytes that may hold a secret (user data): base64 on the wire, never shown
/// by `Debug`, overwritten with zeros when dropped.
#[derive(Clone, PartialEq, Eq, Default)]
pub struct SecretBytes(Vec<u8>);

impl SecretBytes {
    /// Wraps the bytes.
    pub fn new(bytes: impl Into<Vec<u8>>) -> Self {
        Self(bytes.into())
    }

    /// The bytes, for the one place that writes them.
    pub fn expose(&self) -> &[u8] {
        &self.0
    }

    /// Length in bytes (safe to log).
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl fmt::Debug for SecretBytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SecretBytes(<redacted, {} bytes>)", self.0.len())
    }
}

impl Drop for SecretBytes {
    fn drop(&mut self) {
        for b in self.0.iter_mut() {
            *b = 0;
        }
        std::hint::black_box(&self.0);
    }
}

impl Serialize for SecretBytes {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use base64::Engine as _;
        s.serialize_str(&base64::engine::general_purpose::STANDARD.encode(&self.0))
    }
}

impl<'de> Deserialize<'de> for SecretBytes {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use base64::Engine as _;
        let text = String::deserialize(d)?;
        base64::engine::general_purpose::STANDARD
            .decode(text.as_bytes())
            .map(Self)
            .map_err(|e| serde::de::Error::custom(format!("not base64: {e}")))
    }
}

/// What the agent does after a successful run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum AfterDeploy {
    /// Reboot into the deployed OS.
    Reboot,
    /// Power off.
    PowerOff,
}

/// One target disk of a plan.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PlannedDisk {
    /// The Image written to this disk.
    pub image: String,
    /// True for the OS image (post-install builtins act on this disk).
    pub os: bool,
    /// Device path the hint resolved to (`/dev/sda`); the agent re-checks the
    /// serial number or WWN below before writing, since names drift.
    pub device_name: String,
    /// Serial number the hint resolved to, when the disk reports one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub serial_number: Option<String>,
    /// WWN the hint resolved to, when the disk reports one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wwn: Option<String>,
    /// The disk layout in the `layout.json` format of `anneal-image`
    /// (`partitionTable`, `sectorSize`, `diskSize`, `diskGuid`, `slots[]` with
    /// `startBytes`/`sizeBytes`/...); a slot's `contentRef` names an entry of
    /// `contents` by its `name`.
    pub layout: serde_json::Value,
    /// The contents to restore onto this disk's slots.
    #[serde(default)]
    pub contents: Vec<PlannedContent>,
}

/// One PartitionContent to fetch and restore.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PlannedContent {
    /// The PartitionContent's name (a slot's `contentRef` in the layout).
    pub name: String,
    /// Partition number it is written to.
    pub slot: u32,
    /// HTTP URL of the index on the content server.
    pub index_url: String,
    /// HTTP URL of the stream on the content server (read with Range).
    pub stream_url: String,
    /// Lowercase hex SHA-256 of the index (from PartitionContent status): the
    /// agent refuses an index that differs.
    pub index_sha256: String,
    /// Lowercase hex SHA-256 of the whole stream (PartitionContent status).
    pub stream_sha256: String,
    /// Stream length in bytes (used bytes).
    pub stream_bytes: u64,
    /// The content's swarm (docs/distribution.md, "The agent's swarm
    /// fetch"); absent: the content comes over HTTP from `stream_url` only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub swarm: Option<PlannedSwarm>,
}

/// How the agent fetches one content over BitTorrent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PlannedSwarm {
    /// The content's BitTorrent v1 info hash (PartitionContent
    /// `status.infoHash`): the agent makes the torrent from the index it
    /// verified and refuses the content when the two hashes differ.
    pub info_hash: String,
    /// Announce URLs of the Site's tracker.
    pub trackers: Vec<String>,
    /// Addresses (IP, no port) the Site's seeders run on: bytes from them
    /// count as "from the seeder" in the run's transfer figures.
    #[serde(default)]
    pub seeder_hosts: Vec<String>,
    /// TCP port the agent listens on for the other machines of the run.
    pub listen_port: u16,
    /// Seconds without a verified piece before the swarm counts as stalled.
    pub stall_timeout_seconds: u32,
    /// After a stall, fetch the missing pieces over HTTP ranges of
    /// `stream_url` (verified the same way); false: a stall fails the run.
    pub http_fallback: bool,
    /// Most peer connections of the machine's BitTorrent client (the
    /// claim's `spec.transfer.maxConnections`); absent: librqbit's default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_connections: Option<u32>,
    /// Most machines uploaded to at once (the claim's
    /// `spec.transfer.maxUploads`; 0: none); absent: every peer that asks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_uploads: Option<u32>,
    /// MiB of verified pieces kept in memory to serve the other machines
    /// (the claim's `spec.transfer.cacheSizeMB`); absent: an eighth of the
    /// memory available on the machine.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        rename = "cacheSizeMB"
    )]
    pub cache_size_mb: Option<u32>,
}

/// How long an agent keeps seeding what it wrote before its post-install
/// steps (the run's other machines fetch from it meanwhile).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SeedPolicy {
    /// Stop once nothing was uploaded for this many seconds (the run's other
    /// machines have what they need from this one).
    pub idle_seconds: u32,
    /// Stop after this many seconds in any case.
    pub max_seconds: u32,
}

/// The environment variable a script step reads param `name` from:
/// `ANNEAL_PARAM_<NAME>`, the name upper-cased, anything but `[A-Z0-9]`
/// turned into `_`. The manager templates `{{ name }}` in a script body
/// into `${ANNEAL_PARAM_<NAME>}` (never the value itself), and the agent
/// sets the variable from [`PlannedStep::params`].
pub fn param_var(name: &str) -> String {
    let n: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_uppercase()
            } else {
                '_'
            }
        })
        .collect();
    format!("ANNEAL_PARAM_{n}")
}

/// One resolved post-install step.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PlannedStep {
    /// The PostHook it comes from.
    pub hook: String,
    /// The step's name (or `step-<i>`, 1-based, when unnamed).
    pub step: String,
    /// A builtin: `mkswap`, `efibootmgr`, `growLastPartition`,
    /// `install-removable-fallback`; exactly one of `builtin` and `script`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub builtin: Option<String>,
    /// A script body, already templated by the manager: each `{{ name }}`
    /// became `${ANNEAL_PARAM_<NAME>}` ([`param_var`]), its value in
    /// `params`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub script: Option<String>,
    /// Seconds before the step is killed and the run fails.
    pub timeout_seconds: u32,
    /// The merged params (hook defaults < Image params < claim params) the
    /// step declares or its script uses: the script's environment
    /// (`ANNEAL_PARAM_<NAME>`), and the options of builtins (`loader` of
    /// install-removable-fallback).
    #[serde(default)]
    pub params: std::collections::BTreeMap<String, String>,
}

/// Progress of one partition.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PartitionProgress {
    /// Partition number.
    pub number: u32,
    /// Bytes written.
    pub bytes_done: u64,
    /// Bytes to write.
    pub bytes_total: u64,
}

/// `POST /v1/agent/progress`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ProgressRequest {
    /// The DeployRun this is about.
    pub run_id: String,
    /// The run phase (`Partitioning`, `WritingContent`, …).
    pub phase: String,
    /// Per-partition bytes.
    #[serde(default)]
    pub partitions: Vec<PartitionProgress>,
    /// Bytes fetched over HTTP so far in this run.
    #[serde(default)]
    pub http_bytes: u64,
    /// BitTorrent figures of the run so far (contents with a swarm only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transfer: Option<SwarmTransfer>,
    /// Console lines since the last report (kept in ConfigMap
    /// `<run>-log`, bounded).
    #[serde(default)]
    pub log_lines: Vec<String>,
}

/// A run's BitTorrent figures, summed over its contents.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SwarmTransfer {
    /// Peers connected now (the seeder included).
    pub peers: u32,
    /// Bytes received from other machines (not the seeder).
    pub peer_bytes: u64,
    /// Bytes received from the Site's seeders.
    pub seeder_bytes: u64,
    /// Bytes sent to other machines.
    pub uploaded_bytes: u64,
    /// Why pieces came over HTTP (the stall), when they did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fallback_reason: Option<String>,
}

/// The answer to a progress report.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ProgressResponse {
    /// Go on or stop.
    pub action: ProgressAction,
}

/// Go on or stop.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum ProgressAction {
    /// Keep going.
    Continue,
    /// Stop the run.
    Abort,
}

/// `POST /v1/agent/result`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ResultRequest {
    /// The DeployRun this is about.
    pub run_id: String,
    /// How it ended.
    pub outcome: Outcome,
}

/// How a run ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "status", rename_all = "camelCase", deny_unknown_fields)]
pub enum Outcome {
    /// It worked.
    Succeeded,
    /// It did not; `reason` goes through [`sanitize_reason`] on the server.
    Failed {
        /// What failed.
        reason: String,
        /// The run phase it failed in (`WritingContent`, `RunningPostHook`, ...).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        phase: Option<String>,
    },
}

/// An error answer of the agent API.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ErrorResponse {
    /// Machine-readable cause.
    pub code: ErrorCode,
    /// Human-readable detail, safe to print (never contains a token).
    #[serde(default)]
    pub message: String,
}

/// Machine-readable error causes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum ErrorCode {
    /// The token is unknown, malformed or bound to another machine/run.
    InvalidToken,
    /// The token expired.
    ExpiredToken,
    /// The single-use boot token was already used.
    UsedToken,
    /// The schema header is missing or differs (HTTP 426).
    SchemaMismatch,
    /// The body did not parse or broke a limit.
    BadRequest,
    /// The machine is not in a state that accepts this call.
    Conflict,
    /// A server-side failure; retry later.
    Internal,
}

impl ErrorCode {
    /// True when retrying the same request cannot succeed.
    pub fn is_permanent(self) -> bool {
        matches!(
            self,
            Self::InvalidToken | Self::ExpiredToken | Self::UsedToken | Self::SchemaMismatch
        )
    }
}

/// Makes a failure reason safe for a status field: control characters become
/// spaces, runs of whitespace collapse, and the result is capped at
/// [`MAX_REASON_CHARS`] characters (with `…` when cut).
pub fn sanitize_reason(reason: &str) -> String {
    let mut out = String::new();
    let mut count = 0usize;
    let mut last_space = true;
    for c in reason.chars() {
        let c = if c.is_control() || c.is_whitespace() {
            ' '
        } else {
            c
        };
        if c == ' ' && last_space {
            continue;
        }
        last_space = c == ' ';
        if count + 1 >= MAX_REASON_CHARS {
            out.push('…');
            return out.trim_end().to_string();
        }
        out.push(c);
        count += 1;
    }
    out.trim_end().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_debug_is_redacted_and_json_is_plain() {
        let t = Token::new("s3cr3t-value");
        assert_eq!(format!("{t:?}"), "Token(<redacted, 12 bytes>)");
        let req = RegisterRequest {
            boot_token: t,
            boot_mac: "52:54:00:12:34:56".into(),
            agent_version: "0.1.0".into(),
            machine: Some("default/m1".into()),
        };
        assert!(!format!("{req:?}").contains("s3cr3t"));
        let json = serde_json::to_string(&req).unwrap();
        assert_eq!(
            json,
            r#"{"bootToken":"s3cr3t-value","bootMac":"52:54:00:12:34:56","agentVersion":"0.1.0","machine":"default/m1"}"#
        );
        let back: RegisterRequest = serde_json::from_str(&json).unwrap();
        assert_eq!(back, req);
    }

    #[test]
    fn unknown_fields_are_refused() {
        let bad = r#"{"bootToken":"x","bootMac":"m","agentVersion":"v","extra":1}"#;
        assert!(serde_json::from_str::<RegisterRequest>(bad).is_err());
        let bad = r#"{"action":"wait","retryAfterSeconds":1,"extra":true}"#;
        assert!(serde_json::from_str::<NextAction>(bad).is_err());
        let bad = r#"{"action":"launchMissiles"}"#;
        assert!(serde_json::from_str::<NextAction>(bad).is_err());
    }

    #[test]
    fn next_actions_round_trip() {
        for (json, want) in [
            (
                r#"{"action":"wait","retryAfterSeconds":5}"#,
                NextAction::Wait {
                    retry_after_seconds: 5,
                },
            ),
            (r#"{"action":"poweroff"}"#, NextAction::PowerOff),
            (r#"{"action":"reboot"}"#, NextAction::Reboot),
            (r#"{"action":"shell"}"#, NextAction::Shell),
            (
                r#"{"action":"wipe","id":"m1-wipe","disks":["/dev/vda"]}"#,
                NextAction::Wipe {
                    id: "m1-wipe".into(),
                    disks: vec!["/dev/vda".into()],
                },
            ),
        ] {
            let got: NextAction = serde_json::from_str(json).unwrap();
            assert_eq!(got, want);
            assert_eq!(serde_json::to_string(&got).unwrap(), json);
        }
        let failed = ResultRequest {
            run_id: "r1".into(),
            outcome: Outcome::Failed {
                reason: "disk gone".into(),
                phase: Some("WritingContent".into()),
            },
        };
        assert_eq!(
            serde_json::to_string(&failed).unwrap(),
            r#"{"runId":"r1","outcome":{"status":"failed","reason":"disk gone","phase":"WritingContent"}}"#
        );
    }

    #[test]
    fn deploy_plan_round_trips_and_refuses_unknown_fields() {
        let json = r#"{"action":"deploy","plan":{"runId":"m1-run-1","disks":[{"image":"debian","os":true,"deviceName":"/dev/vda","serialNumber":"S1","layout":{"partitionTable":"gpt","sectorSize":512,"diskSize":1073741824,"slots":[]},"contents":[{"name":"debian-p1","slot":1,"indexUrl":"http://10.0.0.1:8081/content/default/debian-p1/index","streamUrl":"http://10.0.0.1:8081/content/default/debian-p1/stream","indexSha256":"aa","streamSha256":"bb","streamBytes":4096}]}],"steps":[{"hook":"anneal-default-finalize","step":"mkswap","builtin":"mkswap","timeoutSeconds":60,"params":{}}],"afterDeploy":"Reboot","progressIntervalSeconds":2,"architecture":"x86_64"}}"#;
        let got: NextAction = serde_json::from_str(json).unwrap();
        let NextAction::Deploy { plan } = &got else {
            panic!("not a deploy: {got:?}");
        };
        assert_eq!(plan.run_id, "m1-run-1");
        assert_eq!(plan.disks[0].contents[0].stream_bytes, 4096);
        assert_eq!(plan.steps[0].builtin.as_deref(), Some("mkswap"));
        let back: serde_json::Value = serde_json::to_value(&got).unwrap();
        let want: serde_json::Value = serde_json::from_str(json).unwrap();
        assert_eq!(back, want);
        let bad = json.replace(r#""os":true"#, r#""os":true,"token":"x""#);
        assert!(serde_json::from_str::<NextAction>(&bad).is_err());
    }

    #[test]
    fn constant_time_compare() {
        let t = Token::new("abc");
        assert!(t.ct_eq(b"abc"));
        assert!(!t.ct_eq(b"abd"));
        assert!(!t.ct_eq(b"abcd"));
        assert!(!t.ct_eq(b""));
    }

    #[test]
    fn reasons_are_sanitized_and_capped() {
        assert_eq!(sanitize_reason("a\n\tb\u{7}  c "), "a b c");
        let long = "x".repeat(5000);
        let s = sanitize_reason(&long);
        assert_eq!(s.chars().count(), MAX_REASON_CHARS);
        assert!(s.ends_with('…'));
    }

    #[test]
    fn config_drive_files_travel_as_base64_and_never_show_in_debug() {
        let mut files = std::collections::BTreeMap::new();
        files.insert(
            "user-data".to_string(),
            SecretBytes::new(&b"#cloud-config\npassword: hunter2\n"[..]),
        );
        let cd = PlannedConfigDrive {
            partition: 4,
            size_bytes: 16 << 20,
            label: "CIDATA".into(),
            files,
        };
        let json = serde_json::to_string(&cd).unwrap();
        assert!(!json.contains("hunter2"), "{json}");
        assert!(json.contains("I2Nsb3VkLWNvbmZpZw"), "{json}");
        let back: PlannedConfigDrive = serde_json::from_str(&json).unwrap();
        assert_eq!(back, cd);
        assert!(!format!("{cd:?}").contains("hunter2"));
        assert!(format!("{cd:?}").contains("redacted"));
        let bad = json.replace("I2Nsb3VkLWNvbmZpZw", "!!");
        assert!(serde_json::from_str::<PlannedConfigDrive>(&bad).is_err());
    }
}
