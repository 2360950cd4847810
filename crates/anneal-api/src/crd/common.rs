//! Types shared by several kinds.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelectorRequirement;
use kube::KubeSchema;
use serde::{Deserialize, Serialize};

pub use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};

/// Regular expression of a MAC address as anneal writes it: six colon
/// separated pairs of hex digits.
pub const MAC_PATTERN: &str = "^([0-9A-Fa-f]{2}:){5}[0-9A-Fa-f]{2}$";
/// Regular expression of a Go-style duration (`90s`, `30m`, `1h30m`).
pub const DURATION_PATTERN: &str = "^([0-9]+(\\.[0-9]+)?(ns|us|ms|s|m|h))+$";

/// A reference to another object by name; an empty namespace means the
/// namespace of the object holding the reference.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct NameRef {
    /// Name of the referenced object.
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
    /// Namespace of the referenced object; empty means the namespace of the
    /// object holding this reference.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 63))]
    pub namespace: Option<String>,
}

impl NameRef {
    /// A reference to `name` in the holder's namespace.
    pub fn new(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            namespace: None,
        }
    }

    /// A reference to `name` in `namespace`.
    pub fn namespaced(name: impl Into<String>, namespace: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            namespace: Some(namespace.into()),
        }
    }

    /// The namespace this reference points into, given the holder's namespace.
    pub fn namespace_or<'a>(&'a self, holder: &'a str) -> &'a str {
        match self.namespace.as_deref() {
            Some(ns) if !ns.is_empty() => ns,
            _ => holder,
        }
    }
}

/// The only taint effect: a machine carrying the taint is not bound by a
/// claim that does not tolerate it.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema,
)]
pub enum TaintEffect {
    /// New claims do not bind the machine unless they tolerate the taint.
    #[default]
    NoBind,
}

/// A taint on a Machine: claims must tolerate it to bind the machine.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct Taint {
    /// Taint key, for example `anneal.dev/undiscovered`.
    #[schemars(length(min = 1, max = 316))]
    pub key: String,
    /// Taint value; optional.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 63))]
    pub value: Option<String>,
    /// Taint effect; `NoBind` is the only effect.
    #[serde(default)]
    pub effect: TaintEffect,
}

/// How a toleration compares its value with a taint's.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema,
)]
pub enum TolerationOperator {
    /// The taint's value must equal the toleration's value.
    #[default]
    Equal,
    /// Any value of the taint key is tolerated; `value` must be empty.
    Exists,
}

/// A toleration on a MachineClaim: lets the claim bind machines carrying a
/// matching taint.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("!has(self.operator) || self.operator != 'Exists' || !has(self.value) || self.value == ''").message("tolerations[].value must be empty when operator is Exists").field_path(".value"))]
#[x_kube(validation = Rule::new("has(self.key) || (has(self.operator) && self.operator == 'Exists')").message("tolerations[].key may be empty only with operator Exists").field_path(".key"))]
pub struct Toleration {
    /// Taint key to tolerate; empty with operator `Exists` tolerates every
    /// taint.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 316))]
    pub key: Option<String>,
    /// `Equal` (default) or `Exists`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub operator: Option<TolerationOperator>,
    /// Value to match with operator `Equal`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 63))]
    pub value: Option<String>,
    /// Effect to tolerate; empty tolerates every effect.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub effect: Option<TaintEffect>,
}

impl Toleration {
    /// Whether this toleration tolerates `taint`.
    pub fn tolerates(&self, taint: &Taint) -> bool {
        if let Some(effect) = self.effect
            && effect != taint.effect
        {
            return false;
        }
        let key = self.key.as_deref().unwrap_or("");
        match self.operator.unwrap_or_default() {
            TolerationOperator::Exists => key.is_empty() || key == taint.key,
            TolerationOperator::Equal => {
                key == taint.key
                    && self.value.as_deref().unwrap_or("") == taint.value.as_deref().unwrap_or("")
            }
        }
    }
}

/// Whether every taint in `taints` is tolerated by one of `tolerations`.
pub fn tolerates_all(tolerations: &[Toleration], taints: &[Taint]) -> bool {
    taints
        .iter()
        .all(|taint| tolerations.iter().any(|t| t.tolerates(taint)))
}

/// Hints that select one disk of a machine. Every hint given must match, and
/// together they must match exactly one disk.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("!has(self.minSizeGigabytes) || !has(self.maxSizeGigabytes) || self.minSizeGigabytes <= self.maxSizeGigabytes").message("targetDisk.minSizeGigabytes must not exceed targetDisk.maxSizeGigabytes").field_path(".minSizeGigabytes"))]
#[x_kube(validation = Rule::new("!has(self.deviceName) || self.deviceName.startsWith('/dev/')").message("targetDisk.deviceName must be a path under /dev/").field_path(".deviceName"))]
pub struct DiskHints {
    /// Kernel device path, for example `/dev/sda` or `/dev/nvme0n1`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 256))]
    pub device_name: Option<String>,
    /// Disk serial number as the disk reports it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 256))]
    pub serial_number: Option<String>,
    /// World Wide Name, for example `0x5000c500a1b2c3d4`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 256))]
    pub wwn: Option<String>,
    /// Disk model string.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 256))]
    pub model: Option<String>,
    /// Disk vendor string.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 256))]
    pub vendor: Option<String>,
    /// Smallest acceptable size, in gigabytes (10^9 bytes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub min_size_gigabytes: Option<i64>,
    /// Largest acceptable size, in gigabytes (10^9 bytes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub max_size_gigabytes: Option<i64>,
    /// Whether the disk is rotational (spinning).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rotational: Option<bool>,
    /// PCIe path of the disk's controller, for example `0000:00:1f.2`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 256))]
    pub pcie_path: Option<String>,
    /// SCSI host:channel:target:lun, for example `0:0:0:0`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 64))]
    pub hctl: Option<String>,
    /// Physical slot number, as the inventory reports it
    /// (MachineHardware `disks[].slotNumber`): the SES enclosure slot of a
    /// SAS/SATA disk behind an enclosure, else the number of the PCIe slot
    /// holding the disk's controller (an NVMe drive, an HBA), read from
    /// `/sys/bus/pci/slots`. Disks sharing one HBA in a slot share its number.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub slot_number: Option<i32>,
}

/// A label selector: `matchLabels` and `matchExpressions` (In, NotIn,
/// Exists, DoesNotExist), ANDed.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct LabelSelector {
    /// Labels that must all be present with these values.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub match_labels: Option<std::collections::BTreeMap<String, String>>,
    /// Expressions that must all hold.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub match_expressions: Option<Vec<LabelSelectorRequirement>>,
}

impl LabelSelector {
    /// Whether `labels` satisfy this selector. An empty selector matches
    /// everything; an unknown operator matches nothing.
    pub fn matches(&self, labels: &std::collections::BTreeMap<String, String>) -> bool {
        if let Some(want) = &self.match_labels
            && !want.iter().all(|(k, v)| labels.get(k) == Some(v))
        {
            return false;
        }
        self.match_expressions
            .iter()
            .flatten()
            .all(|req| requirement_matches(req, labels))
    }
}

fn requirement_matches(
    req: &LabelSelectorRequirement,
    labels: &std::collections::BTreeMap<String, String>,
) -> bool {
    let value = labels.get(&req.key);
    let values = req.values.as_deref().unwrap_or(&[]);
    match req.operator.as_str() {
        "In" => value.is_some_and(|v| values.contains(v)),
        "NotIn" => value.is_none_or(|v| !values.contains(v)),
        "Exists" => value.is_some(),
        "DoesNotExist" => value.is_none(),
        _ => false,
    }
}
