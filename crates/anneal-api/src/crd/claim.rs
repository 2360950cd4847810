//! MachineClaim (deploy intent), MachineHardware (inventory) and DeployRun
//! (one attempt).

use kube::{CustomResource, KubeSchema};
use serde::{Deserialize, Serialize};

use super::common::{Condition, DiskHints, LabelSelector, NameRef, Time, Toleration};
use super::content::Params;

/// The deploy intent: which Image, which disks, which hooks; bound to one
/// Machine.
#[derive(CustomResource, Clone, Debug, Default, PartialEq, Serialize, Deserialize, KubeSchema)]
#[kube(
    group = "anneal.dev",
    version = "v1alpha1",
    kind = "MachineClaim",
    namespaced,
    status = "MachineClaimStatus",
    shortname = "mc",
    shortname = "claim",
    category = "anneal",
    doc = "The deploy intent (which Image, which disks, which hooks), bound atomically to one Machine by name or by selector.",
    printcolumn = r#"{"name":"Phase","type":"string","jsonPath":".status.phase","description":"Pending, Bound or Failed"}"#,
    printcolumn = r#"{"name":"Machine","type":"string","jsonPath":".status.machineName","description":"The Machine this claim is bound to"}"#,
    printcolumn = r#"{"name":"Image","type":"string","jsonPath":".spec.imageRef.name","description":"The OS Image to deploy"}"#,
    printcolumn = r#"{"name":"Ready","type":"string","jsonPath":".status.conditions[?(@.type==\"Ready\")].status"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("has(self.machineName) != has(self.selector)").message("spec.machineName and spec.selector are mutually exclusive; set exactly one").field_path(".machineName"))]
#[x_kube(validation = Rule::new("!has(oldSelf.machineName) || (has(self.machineName) && self.machineName == oldSelf.machineName)").message("spec.machineName is immutable").field_path(".machineName"))]
#[x_kube(validation = Rule::new("has(oldSelf.selector) == has(self.selector)").message("spec.selector cannot be added or removed after creation").field_path(".selector"))]
pub struct MachineClaimSpec {
    /// Binds exactly the Machine of this name (same namespace). Mutually
    /// exclusive with `selector`; immutable.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub machine_name: Option<String>,
    /// Chooses an Available Machine by labels and reported hardware.
    /// Mutually exclusive with `machineName`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selector: Option<MachineSelector>,
    /// Lets this claim bind machines carrying matching taints.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 32))]
    pub tolerations: Vec<Toleration>,
    /// The bootable OS Image to deploy; absent when only data images are
    /// deployed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_ref: Option<NameRef>,
    /// Non-OS images deployed in the same session, each on its own disk.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 16))]
    pub data_images: Vec<DataImage>,
    /// Hints selecting the disk for the OS image: all hints given must match
    /// exactly one disk.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_disk: Option<DiskHints>,
    /// PostHooks run after the Image's own, in order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub post_hook_refs: Vec<NameRef>,
    /// Template parameters; override Image params and hook defaults.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub params: Params,
    /// Per-machine tuning of the content transfer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transfer: Option<TransferSpec>,
    /// Power action when the deployment ends: `Reboot` (default) or
    /// `PowerOff`.
    #[serde(default)]
    pub after_deploy: AfterDeploy,
    /// How long a run of this claim may take from its start before it fails
    /// (a Go duration such as `45m`; default: the manager's
    /// `--deploy-deadline`, 20m), beside the stall timeout.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 2, max = 32))]
    pub deploy_deadline: Option<String>,
    /// cloud-init user data (cloud-config, a script or a MIME multipart
    /// archive), written as is to the config drive's `user-data`. Key
    /// `userData` unless `key` says otherwise; at most 256 KiB.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user_data: Option<SecretDataRef>,
    /// The deployed OS's network configuration (cloud-init network-config
    /// version 2): from a Secret as is, or generated from the links listed
    /// here (NICs resolved from the Machine's MachineHardware).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network_data: Option<NetworkData>,
    /// What the generated cloud-init meta-data carries besides the
    /// instance id and the Machine's name, namespace and labels.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub meta_data: Option<MetaDataSpec>,
}

/// A key of a Secret in the claim's own namespace (there is no namespace
/// field: another namespace's Secret is never read).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct SecretDataRef {
    /// Secret name (the claim's namespace).
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
    /// Key within the Secret's data; each field names its default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub key: Option<String>,
}

/// The deployed OS's network: `secretRef` (network-config v2 passed as is)
/// or generated links, not both.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("!has(self.secretRef) || (size(self.ethernets) == 0 && size(self.bonds) == 0 && size(self.vlans) == 0)").message("spec.networkData: set secretRef or the generated links (ethernets, bonds, vlans), not both").field_path(".secretRef"))]
pub struct NetworkData {
    /// A Secret key holding a cloud-init network-config (version 2, or
    /// version 1), written as is. Key `networkData` unless `key` says
    /// otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret_ref: Option<SecretDataRef>,
    /// Physical links, each one NIC of the Machine.
    #[serde(default)]
    #[schemars(length(max = 32))]
    pub ethernets: Vec<NetEthernet>,
    /// Bonds of ethernets.
    #[serde(default)]
    #[schemars(length(max = 16))]
    pub bonds: Vec<NetBond>,
    /// VLANs on an ethernet or a bond.
    #[serde(default)]
    #[schemars(length(max = 64))]
    pub vlans: Vec<NetVlan>,
}

/// Addressing of one link (network-config v2 names).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct NetAddressing {
    /// DHCPv4 on this link.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dhcp4: Option<bool>,
    /// Static addresses in CIDR form (`10.0.0.50/24`). On the boot NIC (and
    /// a bond holding it) each must lie in the Machine's Subnet with its
    /// prefix length, off its bootd address, gateway, lease range and other
    /// Machines' reservations.
    #[serde(default)]
    #[schemars(length(max = 16))]
    pub addresses: Vec<String>,
    /// The default route's gateway.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gateway4: Option<String>,
    /// DNS servers.
    #[serde(default)]
    #[schemars(length(max = 8))]
    pub nameservers: Vec<String>,
    /// DNS search domains.
    #[serde(default)]
    #[schemars(length(max = 8))]
    pub search: Vec<String>,
    /// MTU in bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 576, max = 65535))]
    pub mtu: Option<i32>,
}

/// A physical link.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct NetEthernet {
    /// The interface name in the deployed OS (`set-name`; at most 15
    /// characters).
    #[schemars(length(min = 1, max = 15))]
    pub name: String,
    /// Which NIC: `boot` (the Machine's `spec.bootMACAddress`), a MAC
    /// address, or a NIC's name in the MachineHardware.
    #[schemars(length(min = 1, max = 64))]
    pub nic: String,
    /// Its addressing.
    #[serde(default, flatten)]
    pub addressing: NetAddressing,
}

/// A bond.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct NetBond {
    /// The bond's interface name (at most 15 characters).
    #[schemars(length(min = 1, max = 15))]
    pub name: String,
    /// Names of the ethernets it bonds.
    #[schemars(length(min = 1, max = 8))]
    pub interfaces: Vec<String>,
    /// Bonding mode: balance-rr, active-backup, balance-xor, broadcast,
    /// 802.3ad, balance-tlb or balance-alb (default active-backup).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<String>,
    /// Its addressing.
    #[serde(default, flatten)]
    pub addressing: NetAddressing,
}

/// A VLAN.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct NetVlan {
    /// The VLAN's interface name (at most 15 characters).
    #[schemars(length(min = 1, max = 15))]
    pub name: String,
    /// VLAN id.
    #[schemars(range(min = 1, max = 4094))]
    pub id: i32,
    /// The ethernet or bond it is tagged on.
    #[schemars(length(min = 1, max = 15))]
    pub link: String,
    /// Its addressing.
    #[serde(default, flatten)]
    pub addressing: NetAddressing,
}

/// Generated meta-data settings.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct MetaDataSpec {
    /// `local-hostname` (default: the Machine's name).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 63))]
    pub hostname: Option<String>,
    /// A Secret key holding SSH public keys, one per line (`public-keys`).
    /// Key `authorized_keys` unless `key` says otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub public_keys_secret_ref: Option<SecretDataRef>,
}

/// Chooses a candidate Machine.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct MachineSelector {
    /// Labels the Machine must carry.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub match_labels: Option<std::collections::BTreeMap<String, String>>,
    /// Label expressions (In, NotIn, Exists, DoesNotExist) the Machine must
    /// satisfy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self.all(e, e.operator in ['In', 'NotIn', 'Exists', 'DoesNotExist'])").message("spec.selector.matchExpressions[].operator must be In, NotIn, Exists or DoesNotExist"))]
    #[x_kube(validation = Rule::new("self.all(e, (e.operator in ['In', 'NotIn']) == (has(e.values) && size(e.values) > 0))").message("spec.selector.matchExpressions[].values must be non-empty for In and NotIn and empty for Exists and DoesNotExist"))]
    #[schemars(length(max = 32))]
    pub match_expressions:
        Option<Vec<k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelectorRequirement>>,
    /// Hardware floors matched against the Machine's MachineHardware.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hardware: Option<HardwareFloor>,
}

impl MachineSelector {
    /// The label part of this selector.
    pub fn labels(&self) -> LabelSelector {
        LabelSelector {
            match_labels: self.match_labels.clone(),
            match_expressions: self.match_expressions.clone(),
        }
    }
}

/// Minimum hardware a Machine must report.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct HardwareFloor {
    /// At least this many logical CPUs.
    #[serde(default, skip_serializing_if = "Option::is_none", rename = "minCPUs")]
    #[schemars(range(min = 1))]
    pub min_cpus: Option<i32>,
    /// At least this much memory, in bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub min_memory_bytes: Option<i64>,
    /// Each entry must match a distinct disk of the Machine.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 16))]
    pub disks: Vec<DiskHints>,
    /// The architecture the inventory reported (`x86_64`, `aarch64`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub architecture: Option<crate::crd::machine::Architecture>,
    /// Each entry must match a distinct NIC of the Machine.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 16))]
    pub nics: Vec<NicHints>,
}

/// Hints that a NIC of the Machine's MachineHardware must match; every hint
/// given must match.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct NicHints {
    /// What the NIC's switch announced over LLDP (MachineHardware
    /// `nics[].lldp`): each field given must equal the reported one, so a
    /// NIC with no LLDP report matches none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lldp: Option<LldpHints>,
}

/// LLDP fields a NIC's report must carry, compared exactly as
/// MachineHardware renders them.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct LldpHints {
    /// The switch's chassis ID, for example `0c:a1:b2:c3:d4:e5`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 256))]
    pub chassis_id: Option<String>,
    /// The switch port, for example `Ethernet1/17`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 256))]
    pub port_id: Option<String>,
    /// The switch's system name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 512))]
    pub system_name: Option<String>,
}

/// A data image and the disk it goes to.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct DataImage {
    /// The (non-bootable) Image to deploy.
    pub image_ref: NameRef,
    /// Hints selecting its disk; must resolve to exactly one disk, distinct
    /// from every other disk of the claim.
    pub target_disk: DiskHints,
}

/// Content transfer tuning.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct TransferSpec {
    /// Maximum peer connections of the machine's BitTorrent client.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 4096))]
    pub max_connections: Option<i32>,
    /// Maximum simultaneous uploads to other machines.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 1024))]
    pub max_uploads: Option<i32>,
    /// Piece cache size in MiB; absent: derived from the machine's memory.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        rename = "cacheSizeMB"
    )]
    #[schemars(range(min = 16, max = 65536))]
    pub cache_size_mb: Option<i32>,
    /// Fall back to HTTP range requests when no peer serves a piece.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub http_fallback: Option<bool>,
}

/// Power action after a deployment.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema,
)]
pub enum AfterDeploy {
    /// Reboot into the deployed OS.
    #[default]
    Reboot,
    /// Power the machine off.
    PowerOff,
}

/// Binding phase of a claim.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema)]
pub enum ClaimPhase {
    /// Not bound yet.
    Pending,
    /// Bound to `status.machineName`.
    Bound,
    /// `spec.machineName` names a Machine that does not exist; never retried
    /// on its own.
    Failed,
}

/// Observed state of a MachineClaim.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct MachineClaimStatus {
    /// Pending, Bound or Failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<ClaimPhase>,
    /// The Machine bound to this claim.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub machine_name: Option<String>,
    /// When the claim was bound.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bound_at: Option<Time>,
    /// The DeployRun in flight for this claim.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub current_run_ref: Option<NameRef>,
    /// The most recent DeployRun that succeeded for this claim.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_successful_run_ref: Option<NameRef>,
    /// Conditions: Bound, Ready (the machine reached Provisioned for the
    /// current intent), Valid.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    /// The metadata.generation this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
}

/// Hardware inventory reported by the agent; same name as its Machine.
#[derive(CustomResource, Clone, Debug, Default, PartialEq, Serialize, Deserialize, KubeSchema)]
#[kube(
    group = "anneal.dev",
    version = "v1alpha1",
    kind = "MachineHardware",
    namespaced,
    shortname = "mhw",
    category = "anneal",
    doc = "Hardware inventory reported by the agent; same name as its Machine, owned by it, no status (it is itself observed state).",
    printcolumn = r#"{"name":"CPUs","type":"integer","jsonPath":".spec.cpu.count"}"#,
    printcolumn = r#"{"name":"Memory","type":"integer","jsonPath":".spec.memoryBytes"}"#,
    printcolumn = r#"{"name":"Firmware","type":"string","jsonPath":".spec.firmware.mode"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct MachineHardwareSpec {
    /// Disks; the field set matches disk hints.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub disks: Vec<HardwareDisk>,
    /// Network interfaces.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub nics: Vec<HardwareNic>,
    /// Total memory in bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_bytes: Option<i64>,
    /// Processors.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu: Option<HardwareCpu>,
    /// Firmware kind.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub firmware: Option<HardwareFirmware>,
    /// System identity (DMI).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub system: Option<HardwareSystem>,
}

/// One disk of the inventory.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct HardwareDisk {
    /// Kernel device path, for example `/dev/nvme0n1`.
    pub device_name: String,
    /// Size in bytes.
    #[serde(default)]
    pub size_bytes: i64,
    /// Serial number.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub serial_number: Option<String>,
    /// World Wide Name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wwn: Option<String>,
    /// Model.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// Vendor.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vendor: Option<String>,
    /// Whether the disk is rotational.
    #[serde(default)]
    pub rotational: bool,
    /// PCIe path of the controller.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pcie_path: Option<String>,
    /// SCSI host:channel:target:lun.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hctl: Option<String>,
    /// Physical slot number: the SES enclosure slot (the `slot` of the
    /// `/sys/class/enclosure/*/*` component whose `device` is the disk's SCSI
    /// device), else the PCIe slot of the disk's controller (the NVMe
    /// function, the HBA) when a `/sys/bus/pci/slots/<name>` with a numeric
    /// name has its domain:bus:device as `address`; absent otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slot_number: Option<i32>,
    /// Logical sector size in bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logical_sector_size: Option<i32>,
    /// Physical sector size in bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub physical_sector_size: Option<i32>,
}

impl HardwareDisk {
    /// Whether every hint given matches this disk.
    pub fn matches(&self, hints: &DiskHints) -> bool {
        fn eq(want: &Option<String>, have: Option<&str>) -> bool {
            want.as_deref().is_none_or(|w| have == Some(w))
        }
        const GB: i64 = 1_000_000_000;
        eq(&hints.device_name, Some(&self.device_name))
            && eq(&hints.serial_number, self.serial_number.as_deref())
            && eq(&hints.wwn, self.wwn.as_deref())
            && eq(&hints.model, self.model.as_deref())
            && eq(&hints.vendor, self.vendor.as_deref())
            && eq(&hints.pcie_path, self.pcie_path.as_deref())
            && eq(&hints.hctl, self.hctl.as_deref())
            && hints.rotational.is_none_or(|r| r == self.rotational)
            && hints
                .slot_number
                .is_none_or(|s| Some(s) == self.slot_number)
            && hints
                .min_size_gigabytes
                .is_none_or(|min| self.size_bytes >= min.saturating_mul(GB))
            && hints
                .max_size_gigabytes
                .is_none_or(|max| self.size_bytes <= max.saturating_mul(GB))
    }
}

/// One network interface of the inventory.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct HardwareNic {
    /// Interface name.
    pub name: String,
    /// MAC address.
    pub mac: String,
    /// Link speed in Mbit/s.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub speed_mbps: Option<i32>,
    /// Kernel driver.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub driver: Option<String>,
    /// PCI address.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pci_address: Option<String>,
    /// Whether the link is up.
    #[serde(default)]
    pub link: bool,
    /// The switch port at the other end of the link, from the first LLDP
    /// frame the agent received on it during inspection.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lldp: Option<NicLldp>,
}

/// What a NIC's neighbour (a switch) announced over LLDP.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct NicLldp {
    /// Chassis ID: a MAC as `aa:bb:cc:dd:ee:ff`, a network address as an
    /// IP, a name as text, other subtypes as colon-separated hex.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chassis_id: Option<String>,
    /// Port ID, rendered like the chassis ID (often the switch's
    /// interface name, such as `Ethernet1/17`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port_id: Option<String>,
    /// Port Description TLV.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port_description: Option<String>,
    /// System Name TLV (the switch's host name).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub system_name: Option<String>,
}

impl HardwareNic {
    /// Whether every hint given matches this NIC.
    pub fn matches(&self, hints: &NicHints) -> bool {
        hints.lldp.as_ref().is_none_or(|want| {
            self.lldp.as_ref().is_some_and(|have| {
                let eq = |w: &Option<String>, h: &Option<String>| {
                    w.as_ref().is_none_or(|w| h.as_ref() == Some(w))
                };
                eq(&want.chassis_id, &have.chassis_id)
                    && eq(&want.port_id, &have.port_id)
                    && eq(&want.system_name, &have.system_name)
            })
        })
    }
}

/// Processors of the inventory.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct HardwareCpu {
    /// Logical CPUs.
    pub count: i32,
    /// Model name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// Machine architecture the agent ran on (absent when the agent did not
    /// report it, or reported one anneal does not know).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub architecture: Option<crate::crd::machine::Architecture>,
}

/// Firmware kind.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema,
)]
pub enum FirmwareMode {
    /// UEFI.
    #[default]
    #[serde(rename = "uefi")]
    Uefi,
    /// Legacy BIOS.
    #[serde(rename = "bios")]
    Bios,
}

/// Firmware of the inventory.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct HardwareFirmware {
    /// uefi or bios.
    pub mode: FirmwareMode,
    /// Whether Secure Boot is enabled.
    #[serde(default)]
    pub secure_boot: bool,
}

/// System identity of the inventory (DMI).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct HardwareSystem {
    /// System vendor.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vendor: Option<String>,
    /// Product name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub product: Option<String>,
    /// Serial number.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub serial: Option<String>,
    /// System UUID.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uuid: Option<String>,
}

impl MachineHardwareSpec {
    /// Whether this inventory meets `floor`: enough CPUs, enough memory, and
    /// a distinct disk for each disk hint and a distinct NIC for each NIC
    /// hint (a small matching search each).
    pub fn meets(&self, floor: &HardwareFloor) -> bool {
        if let Some(min) = floor.min_cpus
            && self.cpu.as_ref().is_none_or(|c| c.count < min)
        {
            return false;
        }
        if let Some(min) = floor.min_memory_bytes
            && self.memory_bytes.is_none_or(|m| m < min)
        {
            return false;
        }
        if let Some(arch) = floor.architecture
            && self.cpu.as_ref().and_then(|c| c.architecture) != Some(arch)
        {
            return false;
        }
        let mut used = vec![false; self.disks.len()];
        if !assign(&floor.disks, &self.disks, &mut used, HardwareDisk::matches) {
            return false;
        }
        let mut used = vec![false; self.nics.len()];
        assign(&floor.nics, &self.nics, &mut used, HardwareNic::matches)
    }
}

/// Whether each hint can be given its own item, disk or NIC (backtracking;
/// hint lists are at most 16 long, items few).
fn assign<H, T>(hints: &[H], items: &[T], used: &mut [bool], matches: fn(&T, &H) -> bool) -> bool {
    let Some((first, rest)) = hints.split_first() else {
        return true;
    };
    for (i, item) in items.iter().enumerate() {
        if used.get(i).copied().unwrap_or(true) || !matches(item, first) {
            continue;
        }
        if let Some(slot) = used.get_mut(i) {
            *slot = true;
        }
        if assign(rest, items, used, matches) {
            return true;
        }
        if let Some(slot) = used.get_mut(i) {
            *slot = false;
        }
    }
    false
}

/// The immutable snapshot of one deployment attempt, owned by the Machine.
#[derive(CustomResource, Clone, Debug, Default, PartialEq, Serialize, Deserialize, KubeSchema)]
#[kube(
    group = "anneal.dev",
    version = "v1alpha1",
    kind = "DeployRun",
    namespaced,
    status = "DeployRunStatus",
    shortname = "run",
    shortname = "drun",
    category = "anneal",
    doc = "The immutable snapshot of one deployment attempt, owned by the Machine.",
    printcolumn = r#"{"name":"Machine","type":"string","jsonPath":".spec.machineRef.name"}"#,
    printcolumn = r#"{"name":"Phase","type":"string","jsonPath":".status.phase"}"#,
    printcolumn = r#"{"name":"Percent","type":"integer","jsonPath":".status.percent"}"#,
    printcolumn = r#"{"name":"MiB/s","type":"integer","jsonPath":".status.throughputMiBps"}"#,
    printcolumn = r#"{"name":"Claim","type":"string","jsonPath":".spec.claimRef.name","priority":1}"#,
    printcolumn = r#"{"name":"Image","type":"string","jsonPath":".spec.imageRef.name"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("self == oldSelf").message("spec is immutable: a DeployRun records one attempt"))]
pub struct DeployRunSpec {
    /// The Machine this run deploys to.
    pub machine_ref: NameRef,
    /// The MachineClaim this run serves (a record; the run outlives it).
    pub claim_ref: NameRef,
    /// The OS Image; absent for a data-only run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_ref: Option<NameRef>,
    /// The data images of the claim.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub data_images: Vec<DataImage>,
    /// The disk each image resolved to against the inventory at creation;
    /// excluded from the new-run comparison.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub resolved_disks: Vec<ResolvedDisk>,
    /// Content hash of every resolved hook step; a change starts a new run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hooks_hash: Option<String>,
    /// Digest of the cloud-init data (user data, network config and the
    /// meta-data without its instance id), salted with the claim's UID: a
    /// change redeploys like any other intent change.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config_hash: Option<String>,
}

/// The disk one image of a run resolved to.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct ResolvedDisk {
    /// The Image written to this disk.
    pub image_ref: NameRef,
    /// Kernel device path at resolution time.
    pub device_name: String,
    /// Serial number, when the disk reports one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub serial_number: Option<String>,
    /// World Wide Name, when the disk reports one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wwn: Option<String>,
    /// Size in bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size_bytes: Option<i64>,
}

/// Phase of a run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema)]
pub enum RunPhase {
    /// Created, waiting for the agent.
    Pending,
    /// Writing partition tables.
    Partitioning,
    /// Restoring contents.
    WritingContent,
    /// Running post hooks.
    RunningPostHook,
    /// Boot entry, sync, power action.
    Finalizing,
    /// Done.
    Succeeded,
    /// Failed; see conditions.
    Failed,
}

/// Progress of one partition of a run.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct PartitionProgressStatus {
    /// Partition number.
    pub number: i32,
    /// Bytes written.
    #[serde(default)]
    pub bytes_done: i64,
    /// Bytes to write.
    #[serde(default)]
    pub bytes_total: i64,
    /// Whole percent, 0 to 100.
    #[serde(default)]
    pub percent: i32,
}

/// When a run was in one phase.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct PhaseTiming {
    /// The phase.
    pub phase: String,
    /// When it started.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start: Option<Time>,
    /// When it ended; absent while in progress.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub end: Option<Time>,
}

/// Transfer counters of a run.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct TransferStatus {
    /// Peers currently connected.
    #[serde(default)]
    pub peers: i32,
    /// Bytes downloaded from peers.
    #[serde(default)]
    pub downloaded_bytes: i64,
    /// Bytes uploaded to other machines.
    #[serde(default)]
    pub uploaded_bytes: i64,
    /// Bytes fetched over the HTTP fallback.
    #[serde(default)]
    pub http_bytes: i64,
    /// Bytes received from the Site's seeders (`downloadedBytes` counts
    /// the other machines only).
    #[serde(default)]
    pub seeder_bytes: i64,
    /// Why pieces came over HTTP ranges instead of the swarm (the stall:
    /// no piece for the stall timeout, with the pieces and peers it had).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fallback_reason: Option<String>,
}

/// Observed state of a DeployRun.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct DeployRunStatus {
    /// Pending, Partitioning, WritingContent, RunningPostHook, Finalizing,
    /// Succeeded or Failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<RunPhase>,
    /// One entry per partition written.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub partitions: Vec<PartitionProgressStatus>,
    /// Whole percent of all partitions' bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub percent: Option<i32>,
    /// Write throughput since the previous progress report, MiB/s.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        rename = "throughputMiBps"
    )]
    pub throughput_mib_ps: Option<i64>,
    /// When the agent last reported progress (a run whose agent falls
    /// silent longer than the manager's stall timeout fails).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_progress_time: Option<Time>,
    /// Start and end of each phase entered.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub phase_timings: Vec<PhaseTiming>,
    /// Transfer counters.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transfer: Option<TransferStatus>,
    /// Where the cloud-init config drive was written.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config_drive: Option<ConfigDriveStatus>,
    /// Seconds the run may take from its start (the agent's first phase)
    /// before it fails: the claim's `deployDeadline`, else the manager's
    /// `--deploy-deadline`; absent: none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deadline_seconds: Option<i64>,
    /// Conditions: Succeeded.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    /// The metadata.generation this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
}

/// Where a run writes its cloud-init config drive.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct ConfigDriveStatus {
    /// `NoCloud`.
    pub format: String,
    /// The OS disk (`/dev/...`).
    pub disk: String,
    /// Partition number on that disk.
    pub partition: i32,
    /// File system (`vfat`) and its label (`CIDATA`).
    pub filesystem: String,
    /// File system label.
    pub label: String,
    /// The files written (names only).
    pub files: Vec<String>,
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// The disks of the `server` fixture's inventory (the agent's golden
    /// report) as a MachineHardware holds them.
    fn server_disks() -> Vec<HardwareDisk> {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../tests/fixtures/agent/sys/expected-server.json"
        );
        let report: crate::agent::HardwareReport =
            serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
        report
            .disks
            .iter()
            .map(|d| HardwareDisk {
                device_name: format!("/dev/{}", d.device_name),
                size_bytes: i64::try_from(d.size_bytes).unwrap(),
                serial_number: d.serial_number.clone(),
                wwn: d.wwn.clone(),
                model: d.model.clone(),
                vendor: d.vendor.clone(),
                rotational: d.rotational,
                pcie_path: d.pcie_path.clone(),
                hctl: d.hctl.clone(),
                slot_number: d.slot_number.map(|s| i32::try_from(s).unwrap()),
                ..HardwareDisk::default()
            })
            .collect()
    }

    #[test]
    fn a_slot_number_hint_picks_the_disk_in_that_slot() {
        let disks = server_disks();
        let picked = |slot: i32| -> Vec<&str> {
            let hints = DiskHints {
                slot_number: Some(slot),
                ..DiskHints::default()
            };
            disks
                .iter()
                .filter(|d| d.matches(&hints))
                .map(|d| d.device_name.as_str())
                .collect()
        };
        // SES enclosure bay 7 holds the SAS disk
        assert_eq!(picked(7), ["/dev/sdd"]);
        // PCIe slot 12 holds the NVMe drive
        assert_eq!(picked(12), ["/dev/nvme0n1"]);
        // the HBA sits in slot 3, but its one disk reports its bay instead
        assert!(picked(3).is_empty());
        assert!(picked(0).is_empty());
        // without the hint every disk matches
        assert_eq!(
            disks
                .iter()
                .filter(|d| d.matches(&DiskHints::default()))
                .count(),
            4
        );
    }
}
