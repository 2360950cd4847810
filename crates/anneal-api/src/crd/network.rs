//! Site and Subnet: where machines boot and where seeders live.

use kube::{CustomResource, KubeSchema};
use serde::{Deserialize, Serialize};

use super::common::{Condition, NameRef, Time};

/// A maximal routable domain: every Subnet of a Site reaches every other.
#[derive(CustomResource, Clone, Debug, Default, PartialEq, Serialize, Deserialize, KubeSchema)]
#[kube(
    group = "anneal.dev",
    version = "v1alpha1",
    kind = "Site",
    namespaced,
    status = "SiteStatus",
    shortname = "site",
    category = "anneal",
    doc = "A maximal routable domain: every Subnet of a Site reaches every other; seeders and the tracker are placed per Site.",
    printcolumn = r#"{"name":"Seeder Subnet","type":"string","jsonPath":".spec.seederSubnetRef.name","description":"The Subnet seeders and the tracker attach to"}"#,
    printcolumn = r#"{"name":"Tracker","type":"string","jsonPath":".status.trackerURL","description":"Resolved tracker announce URL"}"#,
    printcolumn = r#"{"name":"Seeder Ready","type":"boolean","jsonPath":".status.seederReady"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("!has(self.tracker) || has(self.seederSubnetRef)").message("spec.tracker needs spec.seederSubnetRef: a Site without seeders has nothing to announce").field_path(".tracker"))]
pub struct SiteSpec {
    /// The Subnet of this Site that seeder and tracker pods attach to.
    /// Absent: this Site runs no seeder and no tracker.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seeder_subnet_ref: Option<NameRef>,
    /// The BitTorrent tracker of this Site: one anneal runs at a pinned
    /// address (`ip`) or one the operator already runs (`externalURL`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tracker: Option<TrackerSpec>,
}

/// The tracker of a Site; exactly one of `ip` and `externalURL`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("has(self.ip) != has(self.externalURL)").message("spec.tracker.ip and spec.tracker.externalURL are mutually exclusive; set exactly one").field_path(".ip"))]
pub struct TrackerSpec {
    /// Pinned IPv4 address of a tracker anneal runs for this Site, on the
    /// seeder Subnet's network; written into every torrent of the Site.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("isIP(self) && ip(self).family() == 4").message("spec.tracker.ip must be an IPv4 address"))]
    #[schemars(length(max = 15))]
    pub ip: Option<String>,
    /// Announce URL of a tracker the operator already runs; anneal runs no
    /// tracker for this Site.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        rename = "externalURL"
    )]
    #[x_kube(validation = Rule::new("self.startsWith('http://') || self.startsWith('https://') || self.startsWith('udp://')").message("spec.tracker.externalURL must be an http://, https:// or udp:// URL"))]
    #[schemars(length(max = 2048))]
    pub external_url: Option<String>,
}

/// Observed state of a Site.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct SiteStatus {
    /// The Subnets of this namespace whose `spec.siteRef` names this Site.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub subnet_refs: Vec<NameRef>,
    /// Resolved announce URL; empty without a tracker.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        rename = "trackerURL"
    )]
    pub tracker_url: Option<String>,
    /// Whether the seeder placement of this Site is healthy; always false
    /// without `seederSubnetRef`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seeder_ready: Option<bool>,
    /// Conditions: Valid, Ready.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    /// The metadata.generation this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
}

/// One broadcast domain: a boot half (bootd + DHCP), a data half (seeder
/// network), or both.
#[derive(CustomResource, Clone, Debug, Default, PartialEq, Serialize, Deserialize, KubeSchema)]
#[kube(
    group = "anneal.dev",
    version = "v1alpha1",
    kind = "Subnet",
    namespaced,
    status = "SubnetStatus",
    shortname = "sn",
    category = "anneal",
    doc = "One broadcast domain: a boot half (bootd and DHCP) where machines network boot, a data half (seeder network), or both.",
    printcolumn = r#"{"name":"Site","type":"string","jsonPath":".spec.siteRef.name"}"#,
    printcolumn = r#"{"name":"CIDR","type":"string","jsonPath":".spec.cidr"}"#,
    printcolumn = r#"{"name":"Bootd","type":"string","jsonPath":".spec.bootd.mode","description":"Managed or External boot half"}"#,
    printcolumn = r#"{"name":"DHCP","type":"string","jsonPath":".spec.dhcp.mode","description":"proxy or lease"}"#,
    printcolumn = r#"{"name":"Server","type":"string","jsonPath":".spec.bootd.serverIP","priority":1}"#,
    printcolumn = r#"{"name":"Reservations","type":"integer","jsonPath":".status.reservationCount","description":"Lease-mode addresses reserved for net-booting or deployed Machines"}"#,
    printcolumn = r#"{"name":"Bootd Ready","type":"boolean","jsonPath":".status.bootdReady","description":"bootd has made the current reservation table live (lease mode)"}"#,
    printcolumn = r#"{"name":"Pool Exhausted","type":"string","jsonPath":".status.conditions[?(@.type==\"DHCPPoolExhausted\")].status","description":"Machines wait for an address of the lease range"}"#,
    printcolumn = r#"{"name":"Applied","type":"string","jsonPath":".status.dhcp.appliedRevision","priority":1,"description":"DHCP table revision bootd has made live"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("has(self.bootd) == has(self.dhcp)").message("spec.bootd and spec.dhcp form the boot half: set both or neither").field_path(".dhcp"))]
#[x_kube(validation = Rule::new("has(self.bootd) || has(self.seederNetworkRef)").message("a Subnet needs a boot half (spec.bootd and spec.dhcp) or a data half (spec.seederNetworkRef)").field_path(".seederNetworkRef"))]
#[x_kube(validation = Rule::new("!has(self.bootd) || !isCIDR(self.cidr) || !isIP(self.bootd.serverIP) || cidr(self.cidr).containsIP(self.bootd.serverIP)").message("spec.bootd.serverIP must lie inside spec.cidr").field_path(".bootd.serverIP"))]
#[x_kube(validation = Rule::new("!has(self.ipv6) || has(self.bootd)").message("spec.ipv6 needs the boot half (spec.bootd and spec.dhcp): bootd serves DHCPv6").field_path(".ipv6"))]
#[x_kube(validation = Rule::new("!has(self.ipv6) || !has(self.dhcp) || self.dhcp.mode != 'lease' || has(self.ipv6.leaseRange)").message("spec.ipv6.leaseRange is required in lease mode: the manager reserves each Machine's IPv6 address from it").field_path(".ipv6.leaseRange"))]
#[x_kube(validation = Rule::new("!has(self.ipv6) || !has(self.dhcp) || self.dhcp.mode != 'proxy' || !has(self.ipv6.leaseRange)").message("spec.ipv6.leaseRange must be absent in proxy mode: the segment's DHCPv6 server owns addresses").field_path(".ipv6.leaseRange"))]
pub struct SubnetSpec {
    /// The Site this Subnet belongs to. Required.
    pub site_ref: NameRef,
    /// The IPv4 network of this Subnet, for example `192.0.2.0/24`.
    #[x_kube(validation = Rule::new("isCIDR(self) && cidr(self).ip().family() == 4 && cidr(self) == cidr(self).masked()").message("spec.cidr must be an IPv4 network in CIDR notation with no host bits, like 192.0.2.0/24"))]
    #[schemars(length(max = 18))]
    pub cidr: String,
    /// bootd on this segment (boot half, together with `dhcp`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bootd: Option<BootdSpec>,
    /// DHCP behaviour of bootd on this segment (boot half, together with
    /// `bootd`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dhcp: Option<DhcpSpec>,
    /// The data half: the Multus NetworkAttachmentDefinition seeder and
    /// tracker pods attach through when this is its Site's seeder Subnet.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seeder_network_ref: Option<NameRef>,
    /// Disables the MAC gate: bootd answers every machine, not only enrolled
    /// MACs (inventory labs only).
    #[serde(default)]
    pub answer_all: bool,
    /// Namespaces other than the Subnet's own whose Machines may name this
    /// Subnet in `spec.subnetRef`. A Machine of a namespace not listed gets
    /// `Valid=False` (reason `SubnetNotGranted`), no reservation and no
    /// answer from bootd. Empty: only the Subnet's own namespace.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[x_kube(validation = Rule::new("self.all(n, n.matches('^[a-z0-9]([-a-z0-9]*[a-z0-9])?$'))").message("spec.allowedNamespaces must be namespace names (lowercase letters, digits and '-')"))]
    #[schemars(length(max = 64), inner(length(min = 1, max = 63)))]
    pub allowed_namespaces: Vec<NamespaceName>,
    /// IPv6 on the boot half: bootd answers DHCPv6 (and, with
    /// `routerAdvertisements`, sends router advertisements) on this
    /// segment; in lease mode the manager reserves each Machine an IPv6
    /// address from `leaseRange` beside its IPv4 one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ipv6: Option<Ipv6Spec>,
}

/// IPv6 on one segment: DHCPv6 and router advertisements by bootd.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("!isCIDR(self.prefix) || !isIP(self.serverAddress) || cidr(self.prefix).containsIP(self.serverAddress)").message("spec.ipv6.serverAddress must lie inside spec.ipv6.prefix").field_path(".serverAddress"))]
#[x_kube(validation = Rule::new("!has(self.leaseRange) || !isCIDR(self.prefix) || !isIP(self.leaseRange.start) || !isIP(self.leaseRange.end) || (cidr(self.prefix).containsIP(self.leaseRange.start) && cidr(self.prefix).containsIP(self.leaseRange.end))").message("spec.ipv6.leaseRange must lie inside spec.ipv6.prefix").field_path(".leaseRange"))]
pub struct Ipv6Spec {
    /// The segment's on-link IPv6 prefix, /64 or longer, no host bits, for
    /// example `2001:db8:77::/64`.
    #[x_kube(validation = Rule::new("isCIDR(self) && cidr(self).ip().family() == 6 && cidr(self) == cidr(self).masked() && cidr(self).prefixLength() >= 64").message("spec.ipv6.prefix must be an IPv6 network of /64 or longer in CIDR notation with no host bits, like 2001:db8:77::/64"))]
    #[schemars(length(max = 43))]
    pub prefix: String,
    /// bootd's IPv6 address on the segment, inside `prefix`: the DHCPv6
    /// server, and the host of the IPv6 boot URLs (TFTP and HTTP).
    #[x_kube(validation = Rule::new("isIP(self) && ip(self).family() == 6").message("spec.ipv6.serverAddress must be an IPv6 address"))]
    #[schemars(length(max = 39))]
    pub server_address: String,
    /// The pool IPv6 reservations are made from (inclusive, inside
    /// `prefix`). Required in lease mode, rejected in proxy mode.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease_range: Option<LeaseRange6>,
    /// DNS servers handed out over DHCPv6, IPv6 addresses.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[x_kube(validation = Rule::new("self.all(a, isIP(a) && ip(a).family() == 6)").message("spec.ipv6.dnsServers must be IPv6 addresses"))]
    #[schemars(length(max = 8), inner(length(max = 39)))]
    pub dns_servers: Vec<Ipv6String>,
    /// bootd sends ICMPv6 router advertisements for `prefix` with the
    /// managed and other-configuration flags set (clients take their
    /// address over DHCPv6) and answers router solicitations. Leave false
    /// where the segment's router already advertises.
    #[serde(default)]
    pub router_advertisements: bool,
}

/// An IPv6 address.
pub type Ipv6String = String;

/// An inclusive range of IPv6 addresses.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct LeaseRange6 {
    /// First address of the pool.
    #[x_kube(validation = Rule::new("isIP(self) && ip(self).family() == 6").message("spec.ipv6.leaseRange.start must be an IPv6 address"))]
    #[schemars(length(max = 39))]
    pub start: String,
    /// Last address of the pool.
    #[x_kube(validation = Rule::new("isIP(self) && ip(self).family() == 6").message("spec.ipv6.leaseRange.end must be an IPv6 address"))]
    #[schemars(length(max = 39))]
    pub end: String,
}

/// The name of a namespace.
pub type NamespaceName = String;

impl Subnet {
    /// Whether Machines of namespace `ns` may name this Subnet: its own
    /// namespace, or one listed in `spec.allowedNamespaces`.
    pub fn grants(&self, ns: &str) -> bool {
        self.metadata.namespace.as_deref() == Some(ns)
            || self.spec.allowed_namespaces.iter().any(|a| a == ns)
    }
}

/// Who runs bootd for a Subnet.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema,
)]
pub enum BootdMode {
    /// The manager runs a bootd Deployment: on the host's network, or
    /// attached through `networkRef`.
    #[default]
    Managed,
    /// An operator runs `bootd --subnet NS/NAME` on a host of the segment.
    External,
}

/// bootd on one segment.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct BootdSpec {
    /// The pinned IPv4 address of bootd on this segment: the PXE boot server
    /// and TFTP next-server.
    #[serde(rename = "serverIP")]
    #[x_kube(validation = Rule::new("isIP(self) && ip(self).family() == 4").message("spec.bootd.serverIP must be an IPv4 address"))]
    #[schemars(length(max = 15))]
    pub server_ip: String,
    /// `Managed`: the manager runs a bootd Deployment (owned by the Subnet)
    /// on the host's network of a node that holds `serverIP`, or attached
    /// through `networkRef`. `External`: an operator runs
    /// `bootd --subnet NS/NAME`.
    pub mode: BootdMode,
    /// The Multus NetworkAttachmentDefinition a Managed bootd attaches
    /// through (its IPAM gives bootd `serverIP`); absent: the host's
    /// network.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network_ref: Option<NameRef>,
}

/// Whether bootd owns the segment's addresses.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema,
)]
pub enum DhcpMode {
    /// The segment's DHCP server owns addresses; bootd answers only the PXE
    /// part.
    #[default]
    #[serde(rename = "proxy")]
    Proxy,
    /// bootd is the lease authority of the segment.
    #[serde(rename = "lease")]
    Lease,
}

/// DHCP behaviour of bootd on one segment.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("self.mode != 'lease' || has(self.gateway)").message("spec.dhcp.gateway is required in lease mode: an address, or \"\" for no router option").field_path(".gateway"))]
#[x_kube(validation = Rule::new("self.mode != 'proxy' || !has(self.gateway) || self.gateway == ''").message("spec.dhcp.gateway must be absent or \"\" in proxy mode: the segment's DHCP server owns the router option").field_path(".gateway"))]
#[x_kube(validation = Rule::new("self.mode != 'lease' || has(self.leaseRange)").message("spec.dhcp.leaseRange is required in lease mode").field_path(".leaseRange"))]
pub struct DhcpSpec {
    /// `proxy`: the segment's DHCP server owns leases, bootd answers only the
    /// PXE part. `lease`: bootd is the lease authority.
    pub mode: DhcpMode,
    /// Router option (DHCP option 3). Absent: rejected in lease mode,
    /// accepted in proxy mode. `""`: no router option. An IPv4 address:
    /// handed out as the router; rejected in proxy mode.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self == '' || (isIP(self) && ip(self).family() == 4)").message("spec.dhcp.gateway must be an IPv4 address or \"\""))]
    #[schemars(length(max = 15))]
    pub gateway: Option<String>,
    /// The address pool of lease mode, inclusive.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease_range: Option<LeaseRange>,
    /// Lease duration handed out in lease mode, for example `30m` or `1h`;
    /// at least `2m`.
    #[serde(default = "default_lease_time")]
    #[x_kube(validation = Rule::new("self.matches('^([0-9]+(\\\\.[0-9]+)?(ns|us|ms|s|m|h))+$') && duration(self) >= duration('2m')").message("spec.dhcp.leaseTime must be a duration of at least 2m, like 30m"))]
    #[schemars(length(max = 32))]
    pub lease_time: String,
    /// DNS servers handed out (option 6), IPv4 addresses.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[x_kube(validation = Rule::new("self.all(a, isIP(a) && ip(a).family() == 4)").message("spec.dhcp.dnsServers must be IPv4 addresses"))]
    #[schemars(length(max = 8))]
    pub dns_servers: Vec<Ipv4String>,
}

/// An IPv4 address in dotted-quad notation.
pub type Ipv4String = String;

fn default_lease_time() -> String {
    "30m".to_string()
}

/// An inclusive range of IPv4 addresses.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct LeaseRange {
    /// First address of the pool.
    #[x_kube(validation = Rule::new("isIP(self) && ip(self).family() == 4").message("spec.dhcp.leaseRange.start must be an IPv4 address"))]
    #[schemars(length(max = 15))]
    pub start: String,
    /// Last address of the pool.
    #[x_kube(validation = Rule::new("isIP(self) && ip(self).family() == 4").message("spec.dhcp.leaseRange.end must be an IPv4 address"))]
    #[schemars(length(max = 15))]
    pub end: String,
}

/// One boot-scoped address reservation.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct Reservation {
    /// The reserved IPv4 address.
    pub address: String,
    /// The reserved IPv6 address (from `spec.ipv6.leaseRange`), when the
    /// Subnet has `spec.ipv6`; held and released with the IPv4 one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ipv6_address: Option<String>,
    /// Name of the Machine holding it.
    pub machine: String,
    /// The Machine's boot MAC.
    pub mac: String,
    /// When the reservation was made.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub since: Option<Time>,
}

/// `status.dhcp.revision` of a reservation table: the [`crate::digest`] of
/// the table sorted by address (numerically), one `address mac machine` line
/// per entry (`address mac machine ipv6Address` when the entry has an IPv6
/// address), MACs lowercase. `since` is not part of it (an entry's `since`
/// never changes while the entry exists). The manager writes it; anyone
/// holding a table can check it against the revision it came with.
pub fn reservations_revision(reservations: &[Reservation]) -> String {
    let mut rows: Vec<(u64, String)> = reservations
        .iter()
        .map(|r| {
            let key = r
                .address
                .parse::<std::net::Ipv4Addr>()
                .map_or(u64::MAX, |a| u64::from(u32::from(a)));
            let v6 = r
                .ipv6_address
                .as_deref()
                .map(|a| format!(" {a}"))
                .unwrap_or_default();
            (
                key,
                format!(
                    "{} {} {}{v6}\n",
                    r.address,
                    r.mac.to_ascii_lowercase(),
                    r.machine
                ),
            )
        })
        .collect();
    rows.sort();
    let text: String = rows.into_iter().map(|(_, line)| line).collect();
    crate::digest(&text)
}

/// DHCP state of a lease-mode Subnet.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct SubnetDhcpStatus {
    /// Reservations of Machines currently net-booting or deployed.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub reservations: Vec<Reservation>,
    /// Digest of the sorted reservation table.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revision: Option<String>,
    /// The revision bootd has made live; written by bootd only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub applied_revision: Option<String>,
}

/// Observed state of a Subnet.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct SubnetStatus {
    /// Lease-mode reservation table and its revisions.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dhcp: Option<SubnetDhcpStatus>,
    /// Number of entries in `dhcp.reservations` (lease mode; absent in
    /// proxy mode): a printer column cannot count a list.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reservation_count: Option<i32>,
    /// Lease mode: true when bootd has made the current reservation table
    /// live (`dhcp.appliedRevision` equals `dhcp.revision`), false while it
    /// has not (no bootd running for the Subnet, or it is catching up).
    /// Absent in proxy mode, where bootd reports nothing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bootd_ready: Option<bool>,
    /// Conditions: Valid, Ready, DHCPPoolExhausted.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    /// The metadata.generation this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
}
