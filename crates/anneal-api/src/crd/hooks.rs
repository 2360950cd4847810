//! PostHook (steps after content is written) and ReadinessRule (taint
//! gates).

use std::collections::BTreeMap;

use kube::{CustomResource, KubeSchema};
use serde::{Deserialize, Serialize};

use super::common::{Condition, LabelSelector, NameRef, Taint};
use super::content::OsFamily;

/// A named, reusable, ordered list of steps run after content is written,
/// in the live environment (never inside the deployed OS).
#[derive(CustomResource, Clone, Debug, Default, PartialEq, Serialize, Deserialize, KubeSchema)]
#[kube(
    group = "anneal.dev",
    version = "v1alpha1",
    kind = "PostHook",
    namespaced,
    status = "PostHookStatus",
    shortname = "hook",
    shortname = "ph",
    category = "anneal",
    doc = "A named, reusable, ordered list of steps (builtins or scripts) run after content is written, in the live environment.",
    printcolumn = r#"{"name":"Steps","type":"integer","jsonPath":".status.stepCount"}"#,
    printcolumn = r#"{"name":"Valid","type":"string","jsonPath":".status.conditions[?(@.type==\"Valid\")].status"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct PostHookSpec {
    /// Named inputs the steps reference in templates, each with an optional
    /// default. Precedence: these defaults < Image params < claim params.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub params: BTreeMap<String, HookParam>,
    /// The steps, in order; at least one.
    #[schemars(length(min = 1, max = 64))]
    pub steps: Vec<HookStep>,
}

/// A declared hook parameter.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct HookParam {
    /// Value used when neither the Image nor the claim sets the parameter.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default: Option<String>,
}

/// A builtin step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema)]
pub enum Builtin {
    /// mkswap with the saved UUID of each swap slot.
    #[serde(rename = "mkswap")]
    Mkswap,
    /// A UEFI load option for the ESP's removable-media fallback path, first
    /// in BootOrder.
    #[serde(rename = "efibootmgr")]
    Efibootmgr,
    /// Grow the last partition and its file system to the disk.
    #[serde(rename = "growLastPartition")]
    GrowLastPartition,
    /// Copy shim/grub onto the ESP's removable-media fallback path.
    #[serde(rename = "install-removable-fallback")]
    InstallRemovableFallback,
}

/// One step: exactly one of `builtin` and `script`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("has(self.builtin) != has(self.script)").message("spec.steps[]: set exactly one of builtin and script").field_path(".builtin"))]
pub struct HookStep {
    /// Step name, for logs and events.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 63))]
    pub name: Option<String>,
    /// A builtin: mkswap, efibootmgr, growLastPartition or
    /// install-removable-fallback.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub builtin: Option<Builtin>,
    /// A script, from exactly one source.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub script: Option<ScriptSource>,
    /// Run only when the deployed image is of this OS family.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub os_family: Option<OsFamily>,
    /// Kill the step after this many seconds (default 60).
    #[serde(default = "default_timeout")]
    #[schemars(range(min = 1, max = 86400))]
    pub timeout_seconds: i32,
}

fn default_timeout() -> i32 {
    60
}

/// Where a script comes from: exactly one of `inline`, `configMapRef` and
/// `secretRef`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("(has(self.inline) ? 1 : 0) + (has(self.configMapRef) ? 1 : 0) + (has(self.secretRef) ? 1 : 0) == 1").message("spec.steps[].script: set exactly one of inline, configMapRef and secretRef").field_path(".inline"))]
pub struct ScriptSource {
    /// The script text (templated; starts with a `#!` line or runs under
    /// /bin/sh).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 65536))]
    pub inline: Option<String>,
    /// A key of a ConfigMap holding the script.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config_map_ref: Option<KeyRef>,
    /// A key of a Secret holding the script.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret_ref: Option<KeyRef>,
}

/// A key of a ConfigMap or Secret in the PostHook's own namespace.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("!has(self.namespace) || self.namespace == ''").message("spec.steps[].script: a configMapRef or secretRef namespace must be empty: the script is read only from the PostHook's own namespace; remove the field and create the ConfigMap or Secret there").field_path(".namespace"))]
pub struct KeyRef {
    /// Object name (same namespace as the PostHook).
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
    /// Key within the object's data.
    #[schemars(length(min = 1, max = 253))]
    pub key: String,
    /// Not allowed (refused at admission): only a ConfigMap or Secret in the
    /// PostHook's own namespace may be referenced.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 63))]
    pub namespace: Option<String>,
}

/// Observed state of a PostHook.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct PostHookStatus {
    /// Number of steps.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step_count: Option<i32>,
    /// Conditions: Ready, Valid.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    /// The metadata.generation this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
}

/// Removes (or, in Continuous mode, re-applies) a taint on the Machines it
/// selects once the listed conditions hold.
#[derive(CustomResource, Clone, Debug, Default, PartialEq, Serialize, Deserialize, KubeSchema)]
#[kube(
    group = "anneal.dev",
    version = "v1alpha1",
    kind = "ReadinessRule",
    namespaced,
    status = "ReadinessRuleStatus",
    shortname = "rr",
    category = "anneal",
    doc = "Removes (or, in Continuous mode, re-applies) a taint on the Machines it selects once the listed Machine conditions hold.",
    printcolumn = r#"{"name":"Taint","type":"string","jsonPath":".spec.taint.key"}"#,
    printcolumn = r#"{"name":"Mode","type":"string","jsonPath":".spec.enforcementMode"}"#,
    printcolumn = r#"{"name":"Selected","type":"integer","jsonPath":".status.selectedMachines"}"#,
    printcolumn = r#"{"name":"Ready","type":"integer","jsonPath":".status.readyMachines"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct ReadinessRuleSpec {
    /// The Machines (same namespace) this rule governs.
    #[serde(default)]
    pub machine_selector: LabelSelector,
    /// Machine conditions that must all hold to lift the taint.
    #[schemars(length(min = 1, max = 16))]
    pub conditions: Vec<RequiredCondition>,
    /// `BootstrapOnly` (default): lift the taint once, never re-apply it.
    /// `Continuous`: re-apply it whenever a condition stops holding.
    #[serde(default)]
    pub enforcement_mode: EnforcementMode,
    /// The taint this rule lifts or applies.
    pub taint: Taint,
}

/// A Machine condition and the status it must have.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct RequiredCondition {
    /// Condition type on the Machine, for example `Discovered`.
    #[serde(rename = "type")]
    #[schemars(length(min = 1, max = 316))]
    pub type_: String,
    /// Required status: True (default), False or Unknown.
    #[serde(default)]
    pub required_status: ConditionStatus,
}

/// Status of a condition.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema,
)]
pub enum ConditionStatus {
    /// The condition holds.
    #[default]
    True,
    /// The condition does not hold.
    False,
    /// Unknown.
    Unknown,
}

impl ConditionStatus {
    /// The metav1.Condition status string.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::True => "True",
            Self::False => "False",
            Self::Unknown => "Unknown",
        }
    }
}

/// How a ReadinessRule enforces its taint.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema,
)]
pub enum EnforcementMode {
    /// Lift the taint once the conditions hold; never re-apply.
    #[default]
    BootstrapOnly,
    /// Lift the taint while the conditions hold, re-apply it otherwise.
    Continuous,
}

/// Observed state of a ReadinessRule.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct ReadinessRuleStatus {
    /// Machines the selector matches.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selected_machines: Option<i32>,
    /// Selected machines whose conditions hold.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready_machines: Option<i32>,
    /// Selected machines still carrying the taint.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tainted: Vec<NameRef>,
    /// Conditions: Valid, Ready.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    /// The metadata.generation this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
}
