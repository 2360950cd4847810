//! `status.conditions` vocabulary of docs/api.md: condition types in
//! [`types`], their reasons in [`reasons`]. Writers (the manager's
//! controllers) and readers (bootd, tests, ReadinessRules) name them through
//! these constants so a typo is a compile error, not a condition nobody sees.
//!
//! The `type` and `reason` strings are part of the contract: changing one is
//! an API change (docs/api.md).

/// Condition types (`metav1.Condition.type`).
pub mod types {
    /// Every kind: the object is usable (Site, Subnet, Image, Machine,
    /// MachineClaim, ReadinessRule).
    pub const READY: &str = "Ready";
    /// The spec passes the checks CEL cannot express; `False` with a reason
    /// naming the rule (Site, Subnet, Image, PostHook, Machine, MachineClaim,
    /// ReadinessRule).
    pub const VALID: &str = "Valid";
    /// Machine: a state transition is under way.
    pub const PROGRESSING: &str = "Progressing";
    /// MachineClaim: the claim holds a Machine (`spec.claimRef` written).
    pub const BOUND: &str = "Bound";
    /// Machine: the BMC answers (reasons BMCUnreachable, CredentialsMissing,
    /// CredentialsRejected, TLSConfigConflict, QueryFailed,
    /// CrossNamespaceSecret, InsecureBMCRefused).
    pub const BMC_REACHABLE: &str = "BMCReachable";
    /// Machine: the agent of the current boot registered with its boot token.
    pub const AGENT_REGISTERED: &str = "AgentRegistered";
    /// Machine: the agent speaks this manager's `Anneal-Agent-Schema`.
    pub const AGENT_COMPATIBLE: &str = "AgentCompatible";
    /// Machine: 3 consecutive `Restart` failures in one state; the controller
    /// stops calling the BMC until `anneal.dev/clear-error`.
    pub const RETRY_HELD: &str = "RetryHeld";
    /// Machine in a lease-mode Subnet: its DHCP reservation is live in bootd
    /// (`status.dhcp.appliedRevision`), so powering on may proceed.
    pub const DHCP_RESERVATION_READY: &str = "DHCPReservationReady";
    /// Subnet (lease mode): `spec.dhcp.leaseRange` has no free address for a
    /// Machine that needs one.
    pub const DHCP_POOL_EXHAUSTED: &str = "DHCPPoolExhausted";
    /// PartitionContent: deletion waits while an Image slot or an active
    /// DeployRun references it (finalizer).
    pub const DELETION_BLOCKED: &str = "DeletionBlocked";
    /// Image: a seeder of its content is not serving.
    pub const SEEDER_DEGRADED: &str = "SeederDegraded";
    /// Subnet with a `Managed` boot half: the bootd the manager runs for it
    /// has a ready replica.
    pub const BOOTD_AVAILABLE: &str = "BootdAvailable";
    /// ImageImport: the import finished (`True`) or failed (`False`, the
    /// reason names why: an ingest reason such as ChecksumMismatch, or
    /// NameTaken).
    pub const SUCCEEDED: &str = "Succeeded";

    /// Every condition type above.
    pub const ALL: &[&str] = &[
        READY,
        VALID,
        PROGRESSING,
        BOUND,
        BMC_REACHABLE,
        AGENT_REGISTERED,
        AGENT_COMPATIBLE,
        RETRY_HELD,
        DHCP_RESERVATION_READY,
        DHCP_POOL_EXHAUSTED,
        DELETION_BLOCKED,
        SEEDER_DEGRADED,
        BOOTD_AVAILABLE,
        SUCCEEDED,
    ];
}

/// Condition reasons (`metav1.Condition.reason`), grouped by the condition
/// type they go with.
pub mod reasons {
    // --- Valid ---
    /// Valid=True: the spec is valid.
    pub const VALID: &str = "Valid";
    /// Subnet: `spec.dhcp.gateway` is not inside `spec.cidr`.
    pub const GATEWAY_OUTSIDE_CIDR: &str = "GatewayOutsideCIDR";
    /// Subnet: `spec.dhcp.leaseRange` start is after its end.
    pub const LEASE_RANGE_INVERTED: &str = "LeaseRangeInverted";
    /// Subnet: `spec.dhcp.leaseRange` is not inside `spec.cidr`.
    pub const LEASE_RANGE_OUTSIDE_CIDR: &str = "LeaseRangeOutsideCIDR";
    /// Subnet: `spec.dhcp.leaseRange` includes the network or broadcast address.
    pub const LEASE_RANGE_INCLUDES_NETWORK_OR_BROADCAST: &str =
        "LeaseRangeIncludesNetworkOrBroadcast";
    /// Subnet: `spec.bootd.serverIP` is inside `spec.dhcp.leaseRange`.
    pub const SERVER_IP_IN_LEASE_RANGE: &str = "ServerIPInLeaseRange";
    /// Subnet: `spec.dhcp.gateway` is inside `spec.dhcp.leaseRange`.
    pub const GATEWAY_IN_LEASE_RANGE: &str = "GatewayInLeaseRange";
    /// Subnet: `spec.ipv6.serverAddress` is outside `spec.ipv6.prefix`.
    pub const IPV6_SERVER_OUTSIDE_PREFIX: &str = "IPv6ServerOutsidePrefix";
    /// Site: `spec.seederSubnetRef` names no Subnet.
    pub const SEEDER_SUBNET_NOT_FOUND: &str = "SeederSubnetNotFound";
    /// Site: `spec.seederSubnetRef` names a Subnet of another Site.
    pub const SEEDER_SUBNET_IN_OTHER_SITE: &str = "SeederSubnetInOtherSite";
    /// Site: the seeder Subnet declares no data half (`spec.seederNetworkRef`).
    pub const SEEDER_SUBNET_HAS_NO_DATA_HALF: &str = "SeederSubnetHasNoDataHalf";
    /// Site: `spec.tracker.ip` is outside the seeder Subnet.
    pub const TRACKER_IP_OUTSIDE_SUBNET: &str = "TrackerIPOutsideSubnet";
    /// Image: a slot's `contentRef` names another namespace than the Image's.
    pub const CONTENT_NAMESPACE_MISMATCH: &str = "ContentNamespaceMismatch";
    /// Image: a slot's `contentRef` names no PartitionContent.
    pub const CONTENT_NOT_FOUND: &str = "ContentNotFound";
    /// Image: a PartitionContent does not fit its slot.
    pub const CONTENT_DOES_NOT_FIT: &str = "ContentDoesNotFit";
    /// PostHook: a script's ConfigMap or Secret (or its key) does not exist.
    pub const SCRIPT_SOURCE_NOT_FOUND: &str = "ScriptSourceNotFound";
    /// PostHook: a script templates a param `spec.params` does not declare.
    pub const UNDECLARED_PARAM: &str = "UndeclaredParam";
    /// Machine: another Machine (named in the message as namespace/name)
    /// enrolled the same `spec.bootMACAddress` on the same Subnet first;
    /// this one gets no reservation and no answer from bootd.
    pub const DUPLICATE_BOOT_MAC: &str = "DuplicateBootMAC";
    /// Machine: `spec.subnetRef` names a Subnet of another namespace that
    /// does not list the Machine's namespace in `spec.allowedNamespaces`.
    pub const SUBNET_NOT_GRANTED: &str = "SubnetNotGranted";
    /// MachineClaim: two resolved disks of the claim are the same disk.
    pub const DUPLICATE_DISK_HINTS: &str = "DuplicateDiskHints";
    /// MachineClaim: `spec.imageRef` names an Image that is not bootable.
    pub const IMAGE_NOT_BOOTABLE: &str = "ImageNotBootable";
    /// MachineClaim: a `spec.dataImages[]` entry names a bootable Image.
    pub const DATA_IMAGE_BOOTABLE: &str = "DataImageBootable";

    // --- Bound (MachineClaim) ---
    /// Bound=True: the claim holds a Machine.
    pub const BOUND: &str = "Bound";
    /// Bound=False: no Machine matches (the message names the closest miss).
    pub const NO_MATCHING_MACHINE: &str = "NoMatchingMachine";
    /// Bound=False: `spec.machineName` names a Machine that does not exist.
    pub const MACHINE_NOT_FOUND: &str = "MachineNotFound";
    /// Bound=False: the bound Machine no longer names this claim.
    pub const MACHINE_RELEASED: &str = "MachineReleased";

    // --- Ready ---
    /// MachineClaim Ready=True: the bound Machine is Provisioned.
    pub const PROVISIONED: &str = "Provisioned";
    /// MachineClaim Ready=False: the bound Machine is not Provisioned yet.
    pub const NOT_PROVISIONED: &str = "NotProvisioned";
    /// MachineClaim Ready=False: the claim is not bound.
    pub const NOT_BOUND: &str = "NotBound";
    /// Machine Ready=False: its claim was deleted, reclaimPolicy Retain.
    pub const RELEASED: &str = "Released";
    /// Machine Ready=False: its claim was deleted, reclaimPolicy Recycle
    /// waits for the wipe.
    pub const RECYCLE_PENDING: &str = "RecyclePending";
    /// Machine Ready=False (Enrolling): the server is on and its spec does
    /// not allow a restart into inspection; nothing is done to its power.
    pub const RUNNING_AT_ENROLMENT: &str = "RunningAtEnrolment";
    /// Machine Ready=False (Enrolling, `spec.externallyProvisioned`): no
    /// claim binds it yet; nothing is done to its power.
    pub const WAITING_FOR_CLAIM: &str = "WaitingForClaim";
    /// Machine Event: an externally provisioned server became Provisioned
    /// for the claim that binds it, without a deploy.
    pub const ADOPTED_PROVISIONED_CLAIM: &str = "AdoptedProvisionedClaim";
    /// Machine Event (Warning): deleted while a claim holds it; nothing is
    /// done until the claim releases it (or `anneal.dev/force-release`).
    pub const DELETING_CLAIMED_HOST: &str = "DeletingClaimedHost";
    /// MachineClaim Event (Warning): the claim was deleted while its Machine
    /// is Parked; the release waits until it is unparked.
    pub const RELEASE_WAITS_FOR_UNPARK: &str = "ReleaseWaitsForUnpark";
    /// ReadinessRule Ready=True: every listed condition holds.
    pub const ALL_CONDITIONS_HOLD: &str = "AllConditionsHold";
    /// ReadinessRule Ready=False: some listed condition does not hold yet.
    pub const CONDITIONS_PENDING: &str = "ConditionsPending";

    // --- BMCReachable ---
    /// BMCReachable=True: the BMC answers.
    pub const CONNECTED: &str = "Connected";
    /// Connection refused/reset, no route, DNS, timeout, 502/503/504
    /// (retried every 15 s).
    pub const BMC_UNREACHABLE: &str = "BMCUnreachable";
    /// The credentials Secret is missing or lacks `username`/`password`.
    pub const CREDENTIALS_MISSING: &str = "CredentialsMissing";
    /// The BMC answered 401/403 (retried every 5 min).
    pub const CREDENTIALS_REJECTED: &str = "CredentialsRejected";
    /// The credentials Secret lists the BMC addresses it may be sent to (key
    /// `addresses`) and the Machine's is not one of them: nothing is sent
    /// (retried every 5 min; an edit retries at once).
    pub const CREDENTIALS_NOT_AUTHORIZED: &str = "CredentialsNotAuthorized";
    /// `insecureSkipVerify` together with `caBundleSecretRef`, or a CA bundle
    /// that cannot be used (retried every 5 min).
    pub const TLS_CONFIG_CONFLICT: &str = "TLSConfigConflict";
    /// Anything else: unexpected answers, TLS verification failures, no
    /// ComputerSystem (exponential 5 s … 30 min).
    pub const QUERY_FAILED: &str = "QueryFailed";
    /// `spec.bmc.credentialsSecretRef` or `caBundleSecretRef` names another
    /// namespace than the Machine's: the Secret is never read (retried every
    /// 5 min; an edit of the Machine retries at once).
    pub const CROSS_NAMESPACE_SECRET: &str = "CrossNamespaceSecret";
    /// `spec.bmc.address` is `redfish+http://` (credentials in clear) and the
    /// manager runs without `--allow-insecure-bmc` (retried every 5 min).
    pub const INSECURE_BMC_REFUSED: &str = "InsecureBMCRefused";

    // --- AgentRegistered / AgentCompatible ---
    /// AgentRegistered=True: the agent registered.
    pub const REGISTERED: &str = "Registered";
    /// AgentRegistered=False: net boot armed, waiting for the agent.
    pub const WAITING_FOR_AGENT: &str = "WaitingForAgent";
    /// AgentCompatible=True: the agent sent `Anneal-Agent-Schema: 1`.
    pub const SCHEMA_MATCHES: &str = "SchemaMatches";
    /// AgentCompatible=False: the agent's schema differs (refused with 426).
    pub const SCHEMA_MISMATCH: &str = "SchemaMismatch";

    // --- RetryHeld ---
    /// RetryHeld=True: 3 consecutive `Restart` failures in one state (also
    /// the reason of the Warning Event).
    pub const BOOT_RETRY_EXHAUSTED: &str = "BootRetryExhausted";
    /// RetryHeld=False: `anneal.dev/clear-error` applied.
    pub const CLEARED: &str = "Cleared";

    // --- DHCPReservationReady ---
    /// DHCPReservationReady=True: bootd applied the table holding the
    /// Machine's reservation.
    pub const RESERVATION_LIVE: &str = "ReservationLive";
    /// DHCPReservationReady=False: the reservation is not live in bootd yet;
    /// the Machine is not powered on.
    pub const WAITING_FOR_DHCP_RESERVATION: &str = "WaitingForDHCPReservation";

    // --- DHCPPoolExhausted (Subnet) ---
    /// DHCPPoolExhausted=False: every Machine that needs an address has one.
    pub const ADDRESSES_AVAILABLE: &str = "AddressesAvailable";
    /// DHCPPoolExhausted=True: Machines wait for an address of the leaseRange.
    pub const POOL_EXHAUSTED: &str = "PoolExhausted";
    /// DHCPPoolExhausted=False: proxy mode assigns no addresses.
    pub const PROXY_MODE: &str = "ProxyMode";

    // --- ImageImport Succeeded (failures also carry the ingest's own
    // reasons: ChecksumMismatch, SourceNotFound, HTTPError, TLSError,
    // Unreachable, SourceTooLarge, QuotaExceeded, InvalidSource,
    // ContentExists, StoreError) ---
    /// Succeeded=False: the ingest job is running (or about to).
    pub const INGESTING: &str = "Ingesting";
    /// Succeeded=True: the Image and every content exist.
    pub const IMPORTED: &str = "Imported";
    /// Succeeded=False: the Image name or a content name is taken by an
    /// object this import did not create.
    pub const NAME_TAKEN: &str = "NameTaken";
    /// Succeeded=False: the ingest job ended without a usable result.
    pub const WORKLOAD_FAILED: &str = "WorkloadFailed";
    /// Succeeded=False: the Secret of `spec.source.caBundleSecretRef` is
    /// missing or its key holds no PEM certificate (the import stays
    /// Pending and is looked at again every 5 s).
    pub const CA_BUNDLE_UNAVAILABLE: &str = "CABundleUnavailable";
    /// Succeeded=False: the namespace's bytes in the content store (its
    /// PartitionContents and staged uploads) would pass the manager's
    /// per-namespace quota; refused before the ingest starts when nothing
    /// is left, else the ingest stops when its capture passes what is left
    /// (the ingest's own reason too). The message names the namespace, the
    /// quota, what is used and the fix.
    pub const QUOTA_EXCEEDED: &str = "QuotaExceeded";

    // --- PartitionContent Ready ---
    /// Ready=False: the stored stream is being verified against its index.
    pub const PUBLISHING: &str = "Publishing";
    /// Ready=True: every piece of the stored stream matches the index.
    pub const VERIFIED: &str = "Verified";
    /// Ready=False: a piece of the stored stream does not match its hash (or
    /// the files are missing); the message names it.
    pub const VERIFICATION_FAILED: &str = "VerificationFailed";
    /// DeletionBlocked=True: Images (or active DeployRuns) reference the
    /// content; the message names them.
    pub const REFERENCED: &str = "Referenced";
    /// DeletionBlocked=False: nothing references the content any more.
    pub const UNREFERENCED: &str = "Unreferenced";

    // --- Image Valid / Ready ---
    /// Ready=False: some content is not Ready yet.
    pub const CONTENT_NOT_READY: &str = "ContentNotReady";
    /// Ready=False: a content failed.
    pub const CONTENT_FAILED: &str = "ContentFailed";
    /// Ready=True: every content is Ready.
    pub const CONTENTS_READY: &str = "ContentsReady";

    // --- Image SeederDegraded ---
    /// SeederDegraded=True: a seeder of the Image ended and is restarted;
    /// the message names it, its Site and why.
    pub const SEEDER_FAILED: &str = "SeederFailed";
    /// SeederDegraded=True: a seeder has not served its contents within two
    /// minutes of starting.
    pub const SEEDER_NOT_SERVING: &str = "SeederNotServing";
    /// SeederDegraded=False: every seeder of the Image serves (or is
    /// starting).
    pub const SEEDERS_SERVING: &str = "SeedersServing";
    /// SeederDegraded=False: no deploy of the Image is active, no seeder
    /// runs.
    pub const NO_ACTIVE_DEPLOY: &str = "NoActiveDeploy";

    // --- Subnet BootdAvailable ---
    /// BootdAvailable=True: the managed bootd runs and is ready.
    pub const BOOTD_RUNNING: &str = "BootdRunning";
    /// BootdAvailable=False: the managed bootd is starting or not ready (the
    /// message says what its workload reports).
    pub const BOOTD_STARTING: &str = "BootdStarting";
    /// BootdAvailable=False: this manager cannot run a bootd yet (no agent
    /// API URL for the boot table, or the agent API's CA Secret not written
    /// yet); the message names the flag or the Secret.
    pub const BOOTD_NOT_CONFIGURED: &str = "BootdNotConfigured";
    /// A managed bootd asked for in a namespace the administrator did not
    /// allow (`--managed-bootd-namespace`).
    pub const BOOTD_NOT_ALLOWED: &str = "BootdNotAllowed";

    // --- Machine Progressing / DeployRun Succeeded ---
    /// Progressing=False on a claimed Machine: no run can be planned (a disk
    /// hint, a missing or unready Image, content or hook); nothing is
    /// powered on; the message names the cause and the fix.
    pub const DEPLOY_PLAN_FAILED: &str = "DeployPlanFailed";
    /// Progressing=True: a DeployRun is active.
    pub const DEPLOYING: &str = "Deploying";
    /// DeployRun Succeeded=True / Machine Progressing=False: deployed.
    pub const DEPLOY_SUCCEEDED: &str = "DeploySucceeded";
    /// DeployRun Succeeded=False: the agent reported a failure (the message
    /// names the phase and the reason).
    pub const DEPLOY_FAILED: &str = "DeployFailed";
    /// Progressing=True: a released Recycle machine is being wiped.
    pub const WIPING: &str = "Wiping";
    /// Progressing=False: the agent reported the wipe done (the Machine
    /// returns to Available).
    pub const WIPED: &str = "Wiped";
    /// Progressing=False: the agent reported the wipe failed (a Restart
    /// failure; the message names the disk and the cause).
    pub const WIPE_FAILED: &str = "WipeFailed";

    // --- workload failures ---
    /// Reasons the ingest and verify workloads (the agent's `ingest` and
    /// `verify` subcommands) end with; the manager copies them into
    /// ImageImport `Succeeded=False` and PartitionContent `Ready=False`.
    pub const WORKLOAD_FAILURES: &[&str] = &[
        "ChecksumMismatch",
        "SourceNotFound",
        "HTTPError",
        "TLSError",
        "Unreachable",
        "SourceTooLarge",
        "QuotaExceeded",
        "InvalidSource",
        "ContentExists",
        "StoreError",
        "InvalidIndex",
        "Missing",
        "PieceMismatch",
    ];

    /// Every reason constant of this module (docs/troubleshooting.md has an
    /// entry for each; a unit test checks the list is complete).
    pub const ALL: &[&str] = &[
        VALID,
        GATEWAY_OUTSIDE_CIDR,
        LEASE_RANGE_INVERTED,
        LEASE_RANGE_OUTSIDE_CIDR,
        LEASE_RANGE_INCLUDES_NETWORK_OR_BROADCAST,
        SERVER_IP_IN_LEASE_RANGE,
        GATEWAY_IN_LEASE_RANGE,
        IPV6_SERVER_OUTSIDE_PREFIX,
        SEEDER_SUBNET_NOT_FOUND,
        SEEDER_SUBNET_IN_OTHER_SITE,
        SEEDER_SUBNET_HAS_NO_DATA_HALF,
        TRACKER_IP_OUTSIDE_SUBNET,
        CONTENT_NAMESPACE_MISMATCH,
        CONTENT_NOT_FOUND,
        CONTENT_DOES_NOT_FIT,
        SCRIPT_SOURCE_NOT_FOUND,
        UNDECLARED_PARAM,
        DUPLICATE_BOOT_MAC,
        SUBNET_NOT_GRANTED,
        DUPLICATE_DISK_HINTS,
        IMAGE_NOT_BOOTABLE,
        DATA_IMAGE_BOOTABLE,
        BOUND,
        NO_MATCHING_MACHINE,
        MACHINE_NOT_FOUND,
        MACHINE_RELEASED,
        PROVISIONED,
        NOT_PROVISIONED,
        NOT_BOUND,
        RELEASED,
        RECYCLE_PENDING,
        RUNNING_AT_ENROLMENT,
        WAITING_FOR_CLAIM,
        ADOPTED_PROVISIONED_CLAIM,
        DELETING_CLAIMED_HOST,
        RELEASE_WAITS_FOR_UNPARK,
        ALL_CONDITIONS_HOLD,
        CONDITIONS_PENDING,
        CONNECTED,
        BMC_UNREACHABLE,
        CREDENTIALS_MISSING,
        CREDENTIALS_REJECTED,
        CREDENTIALS_NOT_AUTHORIZED,
        TLS_CONFIG_CONFLICT,
        QUERY_FAILED,
        CROSS_NAMESPACE_SECRET,
        INSECURE_BMC_REFUSED,
        REGISTERED,
        WAITING_FOR_AGENT,
        SCHEMA_MATCHES,
        SCHEMA_MISMATCH,
        BOOT_RETRY_EXHAUSTED,
        CLEARED,
        RESERVATION_LIVE,
        WAITING_FOR_DHCP_RESERVATION,
        ADDRESSES_AVAILABLE,
        POOL_EXHAUSTED,
        PROXY_MODE,
        INGESTING,
        IMPORTED,
        NAME_TAKEN,
        WORKLOAD_FAILED,
        CA_BUNDLE_UNAVAILABLE,
        QUOTA_EXCEEDED,
        PUBLISHING,
        VERIFIED,
        VERIFICATION_FAILED,
        REFERENCED,
        UNREFERENCED,
        CONTENT_NOT_READY,
        CONTENT_FAILED,
        CONTENTS_READY,
        SEEDER_FAILED,
        SEEDER_NOT_SERVING,
        SEEDERS_SERVING,
        NO_ACTIVE_DEPLOY,
        BOOTD_RUNNING,
        BOOTD_STARTING,
        BOOTD_NOT_CONFIGURED,
        BOOTD_NOT_ALLOWED,
        DEPLOY_PLAN_FAILED,
        DEPLOYING,
        DEPLOY_SUCCEEDED,
        DEPLOY_FAILED,
        WIPING,
        WIPED,
        WIPE_FAILED,
    ];
}

/// Reasons of Events that carry no condition (state changes, BMC actions,
/// address bookkeeping). Events that go with a condition use the
/// condition's reason from [`reasons`].
pub mod events {
    /// Machine (Normal): `status.state` changed (`From → To`).
    pub const STATE_CHANGED: &str = "StateChanged";
    /// Machine (Normal): the BMC answers again after a failure (the reason
    /// is the condition type `BMCReachable`).
    pub const BMC_REACHABLE: &str = "BMCReachable";
    /// Machine (Warning): a BMC call failed; the note names the
    /// `BMCReachable` reason and the error.
    pub const BMC_UNAVAILABLE: &str = "BMCUnavailable";
    /// Machine (Normal): `anneal.dev/clear-error` reset the error fields.
    pub const ERROR_CLEARED: &str = "ErrorCleared";
    /// Machine (Normal): `anneal.dev/reboot` was carried out.
    pub const REBOOTED: &str = "Rebooted";
    /// Machine (Normal): powered on with a one-time network-boot override.
    pub const NET_BOOT_ARMED: &str = "NetBootArmed";
    /// Machine (Warning): the agent did not register before the boot token
    /// expired (a Restart failure).
    pub const INSPECTION_TIMED_OUT: &str = "InspectionTimedOut";
    /// Machine (Normal): a DeployRun started.
    pub const DEPLOY_STARTED: &str = "DeployStarted";
    /// Machine (Normal): the machine was found off without an agent and
    /// powered on again.
    pub const POWER_ON_RETRIED: &str = "PowerOnRetried";
    /// Machine (Normal): an idle machine was powered off.
    pub const POWERED_OFF: &str = "PoweredOff";
    /// Machine (Warning): bootd has not applied the DHCP table holding the
    /// Machine's reservation in time.
    pub const DHCP_RESERVATION_OVERDUE: &str = "DHCPReservationOverdue";
    /// Machine (Normal): an address of the leaseRange was reserved for it.
    pub const ADDRESS_RESERVED: &str = "AddressReserved";
    /// Subnet (Normal): a Machine's reserved address was released.
    pub const ADDRESS_RELEASED: &str = "AddressReleased";
    /// Machine (Normal): a ReadinessRule removed its taint.
    pub const TAINT_REMOVED: &str = "TaintRemoved";
    /// Machine (Normal): a ReadinessRule (Continuous) applied its taint.
    pub const TAINT_APPLIED: &str = "TaintApplied";
    /// PartitionContent (Warning): deletion waits for referrers (the reason
    /// is the condition type `DeletionBlocked`).
    pub const DELETION_BLOCKED: &str = "DeletionBlocked";

    /// Every event reason of this module.
    pub const ALL: &[&str] = &[
        STATE_CHANGED,
        BMC_REACHABLE,
        BMC_UNAVAILABLE,
        ERROR_CLEARED,
        REBOOTED,
        NET_BOOT_ARMED,
        INSPECTION_TIMED_OUT,
        DEPLOY_STARTED,
        POWER_ON_RETRIED,
        POWERED_OFF,
        DHCP_RESERVATION_OVERDUE,
        ADDRESS_RESERVED,
        ADDRESS_RELEASED,
        TAINT_REMOVED,
        TAINT_APPLIED,
        DELETION_BLOCKED,
    ];
}

#[cfg(test)]
mod tests {
    use super::{reasons, types};

    /// metav1.Condition's type and reason rule, as anneal uses it: CamelCase
    /// ASCII letters and digits, at most 316 bytes for a type and 1024 for a
    /// reason (`^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$`).
    fn is_condition_word(s: &str) -> bool {
        s.len() <= 316
            && s.bytes().next().is_some_and(|b| b.is_ascii_uppercase())
            && s.bytes().all(|b| b.is_ascii_alphanumeric())
    }

    #[test]
    fn every_constant_is_a_valid_condition_word() {
        let longest_reasons = [
            reasons::LEASE_RANGE_INCLUDES_NETWORK_OR_BROADCAST,
            reasons::TLS_CONFIG_CONFLICT,
            reasons::WAITING_FOR_DHCP_RESERVATION,
        ];
        for &s in types::ALL.iter().chain(&longest_reasons) {
            assert!(is_condition_word(s), "{s:?}");
        }
        let mut sorted = types::ALL.to_vec();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), types::ALL.len(), "a type listed twice in ALL");
    }
}

#[cfg(test)]
mod completeness {
    use super::{events, reasons};

    /// The `pub const NAME: &str` items of `pub mod <module>` in this file.
    fn constants_of(module: &str) -> Vec<String> {
        let src = include_str!("conditions.rs");
        let start = format!("pub mod {module} {{");
        let body = src.split(&start).nth(1).unwrap_or_default();
        let body = body.split("\n}\n").next().unwrap_or_default();
        body.split("pub const ")
            .skip(1)
            .filter_map(|item| item.split_once(';').map(|(decl, _)| decl))
            .filter_map(|decl| decl.split_once(": &str ="))
            .map(|(_, v)| v.trim().trim_matches('"').to_string())
            .collect()
    }

    fn assert_complete(module: &str, all: &[&str]) {
        let declared = constants_of(module);
        assert!(
            declared.len() > 10,
            "parsed only {declared:?} from {module}"
        );
        for d in &declared {
            assert!(
                all.contains(&d.as_str()),
                "{module}::{d} missing from {module}::ALL"
            );
        }
        let mut sorted = all.to_vec();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(
            sorted.len(),
            all.len(),
            "a reason listed twice in {module}::ALL"
        );
        assert_eq!(
            declared.len(),
            all.len(),
            "{module}::ALL lists a value no constant declares"
        );
    }

    #[test]
    fn reasons_all_lists_every_reason_constant() {
        assert_complete("reasons", reasons::ALL);
    }

    #[test]
    fn events_all_lists_every_event_constant() {
        assert_complete("events", events::ALL);
    }
}

#[cfg(all(test, feature = "crd"))]
mod crd_tests {
    use super::types;

    /// Every printer column that shows a condition names a type of [`types`].
    #[test]
    fn printer_columns_name_known_condition_types() {
        let mut seen = 0;
        for crd in crate::crds() {
            for v in &crd.spec.versions {
                for col in v.additional_printer_columns.iter().flatten() {
                    let Some(rest) = col.json_path.split("@.type==\"").nth(1) else {
                        continue;
                    };
                    let ty = rest.split('"').next().unwrap_or_default();
                    assert!(
                        types::ALL.contains(&ty),
                        "{} printer column {:?} shows unknown condition type {ty:?}",
                        crd.spec.names.kind,
                        col.name
                    );
                    seen += 1;
                }
            }
        }
        assert!(
            seen >= 2,
            "expected the Valid and Ready columns, saw {seen}"
        );
    }
}
