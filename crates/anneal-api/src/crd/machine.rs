//! Machine: one bare-metal machine (hardware facts and access, never deploy
//! intent).

use kube::{CustomResource, KubeSchema};
use serde::{Deserialize, Serialize};

use super::common::{Condition, NameRef, Taint, Time};

/// Desired facts and access of one bare-metal machine.
#[derive(CustomResource, Clone, Debug, Default, PartialEq, Serialize, Deserialize, KubeSchema)]
#[kube(
    group = "anneal.dev",
    version = "v1alpha1",
    kind = "Machine",
    namespaced,
    status = "MachineStatus",
    shortname = "mach",
    category = "anneal",
    doc = "One bare-metal machine: hardware facts and access (BMC, boot NIC, console), never deploy intent; a MachineClaim binds it.",
    printcolumn = r#"{"name":"State","type":"string","jsonPath":".status.state","description":"Where the machine is in its lifecycle"}"#,
    printcolumn = r#"{"name":"Operational","type":"string","jsonPath":".status.operationalStatus","description":"OK, error, delayed or detached"}"#,
    printcolumn = r#"{"name":"Claim","type":"string","jsonPath":".spec.claimRef.name","description":"The MachineClaim bound to this machine"}"#,
    printcolumn = r#"{"name":"Image","type":"string","jsonPath":".status.deploy.image","description":"The OS Image deployed or being deployed"}"#,
    printcolumn = r#"{"name":"Deploy%","type":"integer","jsonPath":".status.deploy.percent","description":"Progress of the current DeployRun"}"#,
    printcolumn = r#"{"name":"Cordoned","type":"boolean","jsonPath":".spec.unclaimable","description":"Whether new claims are kept off this machine"}"#,
    printcolumn = r#"{"name":"Powered","type":"boolean","jsonPath":".status.poweredOn","description":"Last observed power state"}"#,
    printcolumn = r#"{"name":"MAC","type":"string","jsonPath":".spec.bootMACAddress","priority":1,"description":"MAC address of the boot NIC"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#,
    selectable = ".spec.subnetRef.name"
)]
#[serde(rename_all = "camelCase")]
pub struct MachineSpec {
    /// The baseboard management controller: how anneal powers the machine
    /// and sets its next boot device. Absent means no out-of-band control:
    /// the machine is powered by hand.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bmc: Option<BmcSpec>,
    /// The Subnet this machine network boots through. Required: a Machine
    /// with no Subnet cannot network boot.
    pub subnet_ref: NameRef,
    /// MAC address of the NIC that network boots (`aa:bb:cc:dd:ee:ff`). The
    /// MAC gate of bootd answers only enrolled MACs, so this is normally set
    /// before the first boot; required with the `anneal.dev/inspect-disable`
    /// annotation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self.matches('^([0-9A-Fa-f]{2}:){5}[0-9A-Fa-f]{2}$')").message("spec.bootMACAddress must be a MAC address like aa:bb:cc:dd:ee:ff"))]
    #[schemars(length(max = 17))]
    #[serde(rename = "bootMACAddress")]
    pub boot_mac_address: Option<String>,
    /// Kernel `console=` values for the live environment, in order, for
    /// example `["tty0", "ttyS0,115200n8"]`; the last is the primary console.
    /// At most 4 entries; empty falls back to bootd's default.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[x_kube(validation = Rule::new("size(self) <= 4").message("spec.console must have at most 4 entries"))]
    #[schemars(length(max = 8))]
    pub console: Vec<ConsoleEntry>,
    /// Longest wait from power-on until the agent registers, as a duration
    /// (`20m`, `1h`). Sets the boot token lifetime; it can only extend the
    /// operator-wide default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self.matches('^([0-9]+(\\\\.[0-9]+)?(ns|us|ms|s|m|h))+$')").message("spec.bootTimeout must be a duration like 20m or 1h"))]
    #[schemars(length(max = 32))]
    pub boot_timeout: Option<String>,
    /// CPU architecture; picks the boot loader and the removable-media
    /// fallback path. `x86_64` (default) or `aarch64`.
    #[serde(default)]
    pub architecture: Architecture,
    /// The network boot chain bootd serves this machine. `ipxe` (default):
    /// iPXE (`snponly.efi`, `undionly.kpxe`), then the agent. `shim`:
    /// Debian's signed shim and network GRUB (`shimx64.efi` loads
    /// `grubx64.efi`), then the signed kernel: for UEFI firmware that
    /// enforces Secure Boot with the Microsoft UEFI CA in db. Sites with
    /// their own db key keep `ipxe` and sign iPXE and the kernel
    /// (docs/bootd.md, "Secure Boot").
    #[serde(default)]
    pub boot_loader: BootLoader,
    /// Cordon: when true, no new claim binds this machine. An already bound
    /// claim stays bound.
    #[serde(default)]
    pub unclaimable: bool,
    /// Taints; a claim binds this machine only if it tolerates every taint.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64))]
    pub taints: Vec<Taint>,
    /// What happens when the bound claim is deleted. `Retain` (default): the
    /// machine becomes `Released` with its disks untouched until it is
    /// re-inspected. `Recycle`: its partition tables are wiped and it returns
    /// to `Available`.
    #[serde(default)]
    pub reclaim_policy: ReclaimPolicy,
    /// Whether deleting this Machine shuts the server down. `false`
    /// (default): the server's power is left as it is (a production server
    /// keeps running; only a pending one-time boot override is cleared).
    /// `true`: the override is cleared and the server is shut down before
    /// the Machine goes. A claimed Machine is never cleaned up while its
    /// claim holds it: it waits for the claim's release (Warning Event
    /// `DeletingClaimedHost`); `anneal.dev/force-release` skips every BMC
    /// call.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub power_off_on_delete: bool,
    /// Whether enrolment may power-cycle a server that is already on to
    /// inspect it. `false` (default): a running server is left running; the
    /// Machine waits in `Enrolling` (Ready=False, reason and Warning Event
    /// `RunningAtEnrolment`) until the server is off or this is set. `true`:
    /// the server is restarted into a network boot (the Machine says so in
    /// its `NetBootArmed` Event).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub restart_running_for_inspection: bool,
    /// Adopt a server that already runs its OS: enrolment neither powers
    /// it nor network-boots it; it waits in `Enrolling` (Ready=False, reason
    /// `WaitingForClaim`) until a MachineClaim naming it (`machineName`,
    /// with the Image it runs) binds it, then becomes `Provisioned` without
    /// a deploy (Event `AdoptedProvisionedClaim`, `status.adopted`). A later
    /// change of that claim's intent deploys as usual (after an inspection
    /// the operator asks for with `anneal.dev/re-inspect`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub externally_provisioned: bool,
    /// The MachineClaim bound to this machine. Written only by the claim
    /// controller, with the machine's resourceVersion as an optimistic lock.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub claim_ref: Option<NameRef>,
}

/// One kernel `console=` value, for example `ttyS0,115200n8`.
pub type ConsoleEntry = String;

/// Out-of-band access to the machine.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("!(has(self.insecureSkipVerify) && self.insecureSkipVerify && has(self.caBundleSecretRef))").message("spec.bmc.insecureSkipVerify and spec.bmc.caBundleSecretRef are mutually exclusive").field_path(".insecureSkipVerify"))]
#[x_kube(validation = Rule::new("!has(self.credentialsSecretRef.namespace) || self.credentialsSecretRef.namespace == ''").message("spec.bmc.credentialsSecretRef.namespace must be empty: the manager reads BMC credentials only from the Machine's own namespace; remove the field and create the Secret there").field_path(".credentialsSecretRef.namespace"))]
#[x_kube(validation = Rule::new("!has(self.caBundleSecretRef) || !has(self.caBundleSecretRef.namespace) || self.caBundleSecretRef.namespace == ''").message("spec.bmc.caBundleSecretRef.namespace must be empty: the manager reads the CA bundle only from the Machine's own namespace; remove the field and create the Secret there").field_path(".caBundleSecretRef.namespace"))]
pub struct BmcSpec {
    /// BMC endpoint URL; the scheme picks the driver: `redfish://host[:port]`
    /// (Redfish over HTTPS), `redfish+http://host[:port]` (labs only: the
    /// manager refuses it unless started with `--allow-insecure-bmc`) or
    /// `ipmi://host[:port]`.
    #[x_kube(validation = Rule::new("self.matches('^(redfish|redfish\\\\+http|ipmi)://[^/]+')").message("spec.bmc.address must start with redfish://, redfish+http:// or ipmi:// followed by a host"))]
    #[schemars(length(min = 1, max = 2048))]
    pub address: String,
    /// Secret holding the BMC credentials in keys `username` and `password`,
    /// in the Machine's own namespace (a `namespace` is refused at
    /// admission).
    pub credentials_secret_ref: NameRef,
    /// Secret holding the CA bundle (key `ca.crt`) that verifies the BMC's
    /// TLS certificate, in the Machine's own namespace (a `namespace` is
    /// refused at admission). Mutually exclusive with `insecureSkipVerify`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_bundle_secret_ref: Option<NameRef>,
    /// Skip verification of the BMC's TLS certificate (labs only). Mutually
    /// exclusive with `caBundleSecretRef`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub insecure_skip_verify: Option<bool>,
}

/// CPU architecture of a machine.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema,
)]
pub enum Architecture {
    /// 64-bit x86 (`BOOTX64.EFI`).
    #[default]
    #[serde(rename = "x86_64")]
    X86_64,
    /// 64-bit ARM (`BOOTAA64.EFI`).
    #[serde(rename = "aarch64")]
    Aarch64,
}

pub use crate::boot::BootLoader;

/// What happens to a machine when its bound claim is deleted.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema,
)]
pub enum ReclaimPolicy {
    /// The machine stays `Released`, disks untouched, until re-inspected.
    #[default]
    Retain,
    /// The machine's partition tables are wiped and it returns to
    /// `Available`.
    Recycle,
}

/// Where a machine is in its lifecycle.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema)]
pub enum MachineState {
    /// Newly created; the controller has not yet reached its BMC.
    Enrolling,
    /// Booting the agent to report its hardware.
    Inspecting,
    /// Inspected and idle; a claim may bind it.
    Available,
    /// Deploying the bound claim's intent.
    Provisioning,
    /// The bound claim's intent is deployed.
    Provisioned,
    /// Being cleaned up after deletion.
    Deprovisioning,
    /// Being powered off after deletion.
    PoweringOff,
    /// The bound claim is gone; disks hold what it wrote.
    Released,
    /// Powered off and out of every controller's hands.
    Parked,
}

/// The operational axis of a machine, separate from its state.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema)]
pub enum OperationalStatus {
    /// Working normally.
    #[serde(rename = "OK")]
    Ok,
    /// The last operation failed; see errorType and errorMessage.
    #[serde(rename = "error")]
    Error,
    /// Waiting on something outside the machine (address pool, retry hold).
    #[serde(rename = "delayed")]
    Delayed,
    /// The `anneal.dev/detached` annotation is set: no BMC calls.
    #[serde(rename = "detached")]
    Detached,
}

/// The kind of the last failure.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema)]
pub enum ErrorType {
    /// Retried in place.
    Transient,
    /// Restarts the current state's step; three in a row hold the machine.
    Restart,
}

/// Hash and expiry of the current net-boot token.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct NetBootStatus {
    /// SHA-256 of the boot token, lowercase hex; the token itself lives only
    /// in Secret `<machine>-boot-token`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_hash: Option<String>,
    /// When the boot token expires.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_at: Option<Time>,
}

/// The agent session of a machine.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct AgentStatus {
    /// SHA-256 of the session token, lowercase hex.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_token_hash: Option<String>,
    /// When the session token expires.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_at: Option<Time>,
    /// Version the agent reported.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<String>,
    /// Last request from the agent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_seen: Option<Time>,
    /// Address the agent connected from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub address: Option<String>,
}

/// Observed state of a machine.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct MachineStatus {
    /// Lifecycle state: Enrolling, Inspecting, Available, Provisioning,
    /// Provisioned, Deprovisioning, PoweringOff, Released or Parked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<MachineState>,
    /// OK, error, delayed or detached; a separate axis from `state`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub operational_status: Option<OperationalStatus>,
    /// Transient or Restart: how the last failure is retried.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error_type: Option<ErrorType>,
    /// Human-readable description of the last failure.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error_message: Option<String>,
    /// Consecutive failures in the current state.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error_count: Option<i32>,
    /// Consecutive `Restart` failures in the current state (a subset of
    /// errorCount); 3 hold the machine.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restart_count: Option<i32>,
    /// Last observed power state.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub powered_on: Option<bool>,
    /// The DeployRun in flight.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub current_run_ref: Option<NameRef>,
    /// The most recent DeployRun that succeeded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_successful_run_ref: Option<NameRef>,
    /// Set when an externally provisioned server was adopted: the claim it
    /// runs and that claim's generation then (its intent counts as
    /// deployed while the generation is unchanged).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub adopted: Option<Adoption>,
    /// The last DeployRun that ended, successful or not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_attempted_run_ref: Option<NameRef>,
    /// The current (or last) deploy at a glance: image, run phase, percent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deploy: Option<MachineDeploy>,
    /// The current net-boot token (hash and expiry only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub net_boot: Option<NetBootStatus>,
    /// The registered agent session.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent: Option<AgentStatus>,
    /// Conditions: Ready, Progressing, BMCReachable, AgentRegistered,
    /// AgentCompatible, RetryHeld.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    /// The metadata.generation this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
}

/// The deploy summary of a Machine (`kubectl get machines`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct MachineDeploy {
    /// The OS Image (or the first data image).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    /// The run's phase.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<String>,
    /// Whole percent of the bytes written.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub percent: Option<i32>,
}

/// The record of an adoption (`status.adopted`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct Adoption {
    /// The MachineClaim the server was adopted for.
    pub claim: String,
    /// That claim's `metadata.generation` at the adoption.
    pub claim_generation: i64,
    /// When.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub at: Option<Time>,
}
