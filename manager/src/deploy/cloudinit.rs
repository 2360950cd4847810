//! Day-1 configuration (docs/deploy.md, "Day-1 configuration (cloud-init)"):
//! the cloud-init NoCloud config drive of a claim. Pure: the caller reads the
//! Secrets, the Machine's inventory and its Subnet, and hands in the bytes;
//! this renders `user-data` (as given), `network-config` (a Secret's as given,
//! or generated and checked) and `meta-data`, and the digest that makes a
//! change a new intent.
//!
//! No value read from a Secret ever reaches an error message: errors name
//! fields, Secrets and keys only.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, Ipv4Addr};

use anneal_api::agent::{PlannedConfigDrive, SecretBytes};
use anneal_api::{
    HardwareNic, Image, MachineClaim, NetAddressing, NetworkData, SecretDataRef, Subnet,
};
use serde_json::{Map, Value, json};
use sha2::{Digest, Sha256};

/// The config drive's file system label (NoCloud).
pub const LABEL: &str = "CIDATA";
/// Size of the config drive partition.
pub const SIZE_BYTES: u64 = 16 << 20;
/// The most user data a claim may carry (the plan travels in one agent API
/// response of at most 1 MiB, base64 inside JSON).
pub const MAX_USER_DATA: usize = 256 << 10;
/// The most network data from a Secret.
pub const MAX_NETWORK_DATA: usize = 64 << 10;
/// Default Secret keys.
pub const USER_DATA_KEY: &str = "userData";
/// Default key of `networkData.secretRef`.
pub const NETWORK_DATA_KEY: &str = "networkData";
/// Default key of `metaData.publicKeysSecretRef`.
pub const PUBLIC_KEYS_KEY: &str = "authorized_keys";
/// Placeholder replaced by the run's name once it is known.
const INSTANCE_ID: &str = "instance-id";

/// `claim` with the Day-1 defaults of its OS Image (`image`) filled into
/// the fields it leaves unset: `spec.userData` and
/// `spec.metaData.publicKeysSecretRef`. Borrowed unchanged when there is
/// nothing to fill.
pub fn with_image_defaults<'c>(
    claim: &'c MachineClaim,
    image: Option<&Image>,
) -> std::borrow::Cow<'c, MachineClaim> {
    let Some(d) = image.and_then(|i| i.spec.day1_defaults.as_ref()) else {
        return std::borrow::Cow::Borrowed(claim);
    };
    let s = &claim.spec;
    let fill_user = s.user_data.is_none() && d.user_data.is_some();
    let fill_keys = s
        .meta_data
        .as_ref()
        .is_none_or(|m| m.public_keys_secret_ref.is_none())
        && d.public_keys_secret_ref.is_some();
    if !fill_user && !fill_keys {
        return std::borrow::Cow::Borrowed(claim);
    }
    let mut c = claim.clone();
    if fill_user {
        c.spec.user_data.clone_from(&d.user_data);
    }
    if fill_keys {
        c.spec
            .meta_data
            .get_or_insert_with(Default::default)
            .public_keys_secret_ref
            .clone_from(&d.public_keys_secret_ref);
    }
    std::borrow::Cow::Owned(c)
}

/// The key a reference reads.
pub fn key_of<'a>(r: &'a SecretDataRef, default: &'a str) -> &'a str {
    r.key.as_deref().unwrap_or(default)
}

/// `secret/<name>/<key>` of a reference (how [`Day1`] indexes Secret data).
pub fn secret_key(r: &SecretDataRef, default: &str) -> String {
    format!("secret/{}/{}", r.name, key_of(r, default))
}

/// Every Secret key a claim's Day-1 data reads, by [`secret_key`].
pub fn wanted_secrets(claim: &MachineClaim) -> Vec<(String, String)> {
    let s = &claim.spec;
    let mut out = Vec::new();
    if let Some(r) = &s.user_data {
        out.push((r.name.clone(), key_of(r, USER_DATA_KEY).to_string()));
    }
    if let Some(r) = s.network_data.as_ref().and_then(|n| n.secret_ref.as_ref()) {
        out.push((r.name.clone(), key_of(r, NETWORK_DATA_KEY).to_string()));
    }
    if let Some(r) = s
        .meta_data
        .as_ref()
        .and_then(|m| m.public_keys_secret_ref.as_ref())
    {
        out.push((r.name.clone(), key_of(r, PUBLIC_KEYS_KEY).to_string()));
    }
    out
}

/// Whether a claim asks for a config drive.
pub fn wanted(claim: &MachineClaim) -> bool {
    let s = &claim.spec;
    s.user_data.is_some() || s.network_data.is_some() || s.meta_data.is_some()
}

/// What the Day-1 data is made from.
#[derive(Debug, Default)]
pub struct Day1<'a> {
    /// Secret data by `secret/<name>/<key>` (absent key: not there).
    pub secrets: BTreeMap<String, Vec<u8>>,
    /// The Machine's namespace, name and labels.
    pub namespace: &'a str,
    /// The Machine's name.
    pub machine: &'a str,
    /// The Machine's labels.
    pub labels: BTreeMap<String, String>,
    /// `spec.bootMACAddress`.
    pub boot_mac: Option<&'a str>,
    /// The inventory's NICs.
    pub nics: &'a [HardwareNic],
    /// The Machine's Subnet (None: not found).
    pub subnet: Option<Subnet>,
    /// The Subnet's `Reservation.machine` key of this Machine.
    pub reservation_key: String,
}

/// The rendered drive (instance id still to stamp) and its digest.
#[derive(Debug)]
pub struct Rendered {
    /// The drive.
    pub drive: PlannedConfigDrive,
    /// Digest of the files (meta-data without the instance id), salted.
    pub hash: String,
}

/// Renders the config drive of `claim` as partition `partition`, or says
/// which field is wrong.
pub fn render(
    claim: &MachineClaim,
    d: &Day1<'_>,
    partition: u32,
    salt: &str,
) -> Result<Rendered, String> {
    let s = &claim.spec;
    let mut files = BTreeMap::new();
    if let Some(r) = &s.user_data {
        let body = secret(d, r, USER_DATA_KEY, "spec.userData")?;
        if body.len() > MAX_USER_DATA {
            return Err(format!(
                "spec.userData: Secret {} key {} holds {} bytes, more than the {MAX_USER_DATA} a config drive takes (gzip it: cloud-init reads gzip-compressed user data)",
                r.name,
                key_of(r, USER_DATA_KEY),
                body.len()
            ));
        }
        files.insert("user-data".to_string(), body.to_vec());
    }
    if let Some(n) = &s.network_data {
        let body = match &n.secret_ref {
            Some(r) => {
                let b = secret(d, r, NETWORK_DATA_KEY, "spec.networkData.secretRef")?;
                if b.len() > MAX_NETWORK_DATA {
                    return Err(format!(
                        "spec.networkData.secretRef: Secret {} key {} holds {} bytes, more than {MAX_NETWORK_DATA}",
                        r.name,
                        key_of(r, NETWORK_DATA_KEY),
                        b.len()
                    ));
                }
                b.to_vec()
            }
            None => network_config(n, d)?.to_string().into_bytes(),
        };
        files.insert("network-config".to_string(), body);
    }
    let meta = meta_data(claim, d)?;
    files.insert("meta-data".to_string(), meta.to_string().into_bytes());
    let mut h = Sha256::new();
    h.update(salt.as_bytes());
    // the intent: what the claim says (the Machine's labels, also in the
    // meta-data, are not: relabelling a Machine never redeploys it)
    let intent =
        json!({"local-hostname": meta["local-hostname"], "public-keys": meta["public-keys"]});
    let hashed = files.iter().map(|(k, v)| {
        (
            k.as_str(),
            if k == "meta-data" {
                intent.to_string().into_bytes()
            } else {
                v.clone()
            },
        )
    });
    for (name, body) in hashed {
        h.update((name.len() as u64).to_le_bytes());
        h.update(name.as_bytes());
        h.update((body.len() as u64).to_le_bytes());
        h.update(body);
    }
    let hash = hex::encode(&h.finalize()[..8]);
    let drive = PlannedConfigDrive {
        partition,
        size_bytes: SIZE_BYTES,
        label: LABEL.into(),
        files: files
            .into_iter()
            .map(|(k, v)| (k, SecretBytes::new(v)))
            .collect(),
    };
    Ok(Rendered { drive, hash })
}

/// Stamps the run's name as the meta-data's `instance-id` (stable per claim
/// and run: cloud-init runs its per-instance modules once per deploy).
pub fn stamp_instance_id(drive: &mut PlannedConfigDrive, run: &str) {
    let Some(meta) = drive.files.get("meta-data") else {
        return;
    };
    let mut v: Value = serde_json::from_slice(meta.expose()).unwrap_or_else(|_| json!({}));
    v[INSTANCE_ID] = Value::String(run.to_string());
    drive.files.insert(
        "meta-data".into(),
        SecretBytes::new(v.to_string().into_bytes()),
    );
}

fn secret<'d>(
    d: &'d Day1<'_>,
    r: &SecretDataRef,
    default: &str,
    field: &str,
) -> Result<&'d [u8], String> {
    d.secrets
        .get(&secret_key(r, default))
        .map(Vec::as_slice)
        .ok_or_else(|| {
            format!(
                "{field}: Secret {} has no key {} in namespace {} (create it, or set {field}.key)",
                r.name,
                key_of(r, default),
                d.namespace
            )
        })
}

fn meta_data(claim: &MachineClaim, d: &Day1<'_>) -> Result<Value, String> {
    let hostname = claim
        .spec
        .meta_data
        .as_ref()
        .and_then(|m| m.hostname.clone())
        .unwrap_or_else(|| d.machine.to_string());
    if !valid_hostname(&hostname) {
        return Err(format!(
            "spec.metaData.hostname: {hostname:?} is not a host name (letters, digits and '-', at most 63, not starting or ending with '-'); set spec.metaData.hostname"
        ));
    }
    let mut keys = Vec::new();
    if let Some(r) = claim
        .spec
        .meta_data
        .as_ref()
        .and_then(|m| m.public_keys_secret_ref.as_ref())
    {
        let body = secret(d, r, PUBLIC_KEYS_KEY, "spec.metaData.publicKeysSecretRef")?;
        let text = std::str::from_utf8(body).map_err(|_| {
            format!(
                "spec.metaData.publicKeysSecretRef: Secret {} key {} is not UTF-8 text (one OpenSSH public key per line)",
                r.name,
                key_of(r, PUBLIC_KEYS_KEY)
            )
        })?;
        keys = text
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty() && !l.starts_with('#'))
            .map(str::to_string)
            .collect();
    }
    Ok(json!({
        "local-hostname": hostname,
        "public-keys": keys,
        "anneal": {
            "machine": d.machine,
            "namespace": d.namespace,
            "labels": d.labels,
            "claim": claim.metadata.name,
        },
    }))
}

fn valid_hostname(h: &str) -> bool {
    !h.is_empty()
        && h.len() <= 63
        && !h.starts_with('-')
        && !h.ends_with('-')
        && h.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
}

fn valid_ifname(n: &str) -> bool {
    !n.is_empty()
        && n.len() <= 15
        && n != "."
        && n != ".."
        && n.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
}

const BOND_MODES: &[&str] = &[
    "balance-rr",
    "active-backup",
    "balance-xor",
    "broadcast",
    "802.3ad",
    "balance-tlb",
    "balance-alb",
];

/// The generated network-config (version 2) of `n`, checked against the
/// Machine's NICs and Subnet.
pub fn network_config(n: &NetworkData, d: &Day1<'_>) -> Result<Value, String> {
    let mut names = BTreeSet::new();
    let mut macs = BTreeMap::new();
    let mut on_boot = BTreeSet::new();
    let boot = d.boot_mac.and_then(crate::ipam::canonical_mac);
    let mut ethernets = Map::new();
    for (i, e) in n.ethernets.iter().enumerate() {
        let f = format!("spec.networkData.ethernets[{i}]");
        link_name(&f, &e.name, &mut names)?;
        let mac = resolve_nic(&format!("{f}.nic"), &e.nic, d)?;
        if let Some(other) = macs.insert(mac.clone(), e.name.clone()) {
            return Err(format!("{f}.nic: NIC {mac} is already ethernet {other}"));
        }
        let subnet_checked = boot.as_deref() == Some(mac.as_str());
        if subnet_checked {
            on_boot.insert(e.name.clone());
        }
        let mut v = addressing(
            &f,
            &e.addressing,
            subnet_checked
                .then_some(d)
                .and_then(|d| d.subnet.as_ref().map(|s| (s, d))),
        )?;
        v.insert("match".into(), json!({ "macaddress": mac }));
        v.insert("set-name".into(), json!(e.name));
        ethernets.insert(e.name.clone(), Value::Object(v));
    }
    let mut bonded = BTreeSet::new();
    let mut bonds = Map::new();
    for (i, b) in n.bonds.iter().enumerate() {
        let f = format!("spec.networkData.bonds[{i}]");
        link_name(&f, &b.name, &mut names)?;
        for (j, member) in b.interfaces.iter().enumerate() {
            let Some(Value::Object(eth)) = ethernets.get(member) else {
                return Err(format!(
                    "{f}.interfaces[{j}]: {member:?} is not an ethernet of spec.networkData.ethernets"
                ));
            };
            if !bonded.insert(member.clone()) {
                return Err(format!(
                    "{f}.interfaces[{j}]: ethernet {member} is in another bond already"
                ));
            }
            if eth.contains_key("addresses") || eth.contains_key("dhcp4") {
                return Err(format!(
                    "{f}.interfaces[{j}]: ethernet {member} is bonded: move its addresses and dhcp4 to the bond"
                ));
            }
        }
        let mode = b.mode.as_deref().unwrap_or("active-backup");
        if !BOND_MODES.contains(&mode) {
            return Err(format!(
                "{f}.mode: {mode:?} is not a bonding mode (one of {})",
                BOND_MODES.join(", ")
            ));
        }
        let checked = b.interfaces.iter().any(|m| on_boot.contains(m));
        if checked {
            on_boot.insert(b.name.clone());
        }
        let mut v = addressing(
            &f,
            &b.addressing,
            checked
                .then_some(d)
                .and_then(|d| d.subnet.as_ref().map(|s| (s, d))),
        )?;
        v.insert("interfaces".into(), json!(b.interfaces));
        v.insert("parameters".into(), json!({ "mode": mode }));
        bonds.insert(b.name.clone(), Value::Object(v));
    }
    let mut vlans = Map::new();
    for (i, l) in n.vlans.iter().enumerate() {
        let f = format!("spec.networkData.vlans[{i}]");
        link_name(&f, &l.name, &mut names)?;
        if !ethernets.contains_key(&l.link) && !bonds.contains_key(&l.link) {
            return Err(format!(
                "{f}.link: {:?} is not an ethernet or a bond of spec.networkData",
                l.link
            ));
        }
        let mut v = addressing(&f, &l.addressing, None)?;
        v.insert("id".into(), json!(l.id));
        v.insert("link".into(), json!(l.link));
        vlans.insert(l.name.clone(), Value::Object(v));
    }
    let mut out = Map::new();
    out.insert("version".into(), json!(2));
    for (k, m) in [("ethernets", ethernets), ("bonds", bonds), ("vlans", vlans)] {
        if !m.is_empty() {
            out.insert(k.into(), Value::Object(m));
        }
    }
    Ok(Value::Object(out))
}

fn link_name(field: &str, name: &str, names: &mut BTreeSet<String>) -> Result<(), String> {
    if !valid_ifname(name) {
        return Err(format!(
            "{field}.name: {name:?} is not an interface name (letters, digits, '-', '_', '.', at most 15)"
        ));
    }
    if !names.insert(name.to_string()) {
        return Err(format!(
            "{field}.name: {name} is used by another link of spec.networkData"
        ));
    }
    Ok(())
}

/// The MAC of a NIC role: `boot`, a MAC of the inventory, or an inventory
/// NIC's name.
fn resolve_nic(field: &str, nic: &str, d: &Day1<'_>) -> Result<String, String> {
    let known = || {
        let list: Vec<String> = d
            .nics
            .iter()
            .map(|n| format!("{} {}", n.name, n.mac))
            .collect();
        if list.is_empty() {
            "the Machine has no MachineHardware NICs yet".to_string()
        } else {
            format!("or one of: {}", list.join(", "))
        }
    };
    if nic == "boot" {
        return d.boot_mac.and_then(crate::ipam::canonical_mac).ok_or_else(|| {
            format!(
                "{field}: boot names the Machine's spec.bootMACAddress, which Machine {}/{} does not set (set it, or name the NIC by MAC {})",
                d.namespace,
                d.machine,
                known()
            )
        });
    }
    if let Some(mac) = crate::ipam::canonical_mac(nic) {
        if d.nics
            .iter()
            .any(|n| crate::ipam::canonical_mac(&n.mac).as_deref() == Some(mac.as_str()))
        {
            return Ok(mac);
        }
    } else if let Some(n) = d.nics.iter().find(|n| n.name == nic)
        && let Some(mac) = crate::ipam::canonical_mac(&n.mac)
    {
        return Ok(mac);
    }
    Err(format!(
        "{field}: {nic:?} is not a NIC of Machine {}/{} (use boot, {})",
        d.namespace,
        d.machine,
        known()
    ))
}

/// The v2 addressing keys of a link; with a Subnet, its addresses and
/// gateway are checked against it.
fn addressing(
    field: &str,
    a: &NetAddressing,
    subnet: Option<(&Subnet, &Day1<'_>)>,
) -> Result<Map<String, Value>, String> {
    let mut v = Map::new();
    if let Some(dhcp) = a.dhcp4 {
        v.insert("dhcp4".into(), json!(dhcp));
    }
    for (i, addr) in a.addresses.iter().enumerate() {
        let f = format!("{field}.addresses[{i}]");
        let (ip, len) = parse_address(addr).ok_or_else(|| {
            format!("{f}: {addr:?} is not an address in CIDR form (10.0.0.50/24 or 2001:db8::5/64)")
        })?;
        if let (Some((s, d)), IpAddr::V4(v4)) = (subnet, ip) {
            in_subnet(&f, v4, len, s, d)?;
        }
    }
    if !a.addresses.is_empty() {
        v.insert("addresses".into(), json!(a.addresses));
    }
    if let Some(gw) = &a.gateway4 {
        let ip: Ipv4Addr = gw
            .parse()
            .map_err(|_| format!("{field}.gateway4: {gw:?} is not an IPv4 address"))?;
        if let Some((s, _)) = subnet
            && let Some((net, mask)) = crate::validity::parse_cidr(&s.spec.cidr)
            && u32::from(ip) & mask != net
        {
            return Err(format!(
                "{field}.gateway4: {gw} is outside Subnet {} ({})",
                s.metadata.name.as_deref().unwrap_or_default(),
                s.spec.cidr
            ));
        }
        v.insert("gateway4".into(), json!(gw));
    }
    for (i, ns) in a.nameservers.iter().enumerate() {
        if ns.parse::<IpAddr>().is_err() {
            return Err(format!(
                "{field}.nameservers[{i}]: {ns:?} is not an IP address"
            ));
        }
    }
    if !a.nameservers.is_empty() || !a.search.is_empty() {
        let mut n = Map::new();
        if !a.nameservers.is_empty() {
            n.insert("addresses".into(), json!(a.nameservers));
        }
        if !a.search.is_empty() {
            n.insert("search".into(), json!(a.search));
        }
        v.insert("nameservers".into(), Value::Object(n));
    }
    if let Some(mtu) = a.mtu {
        v.insert("mtu".into(), json!(mtu));
    }
    Ok(v)
}

fn parse_address(s: &str) -> Option<(IpAddr, u8)> {
    let (a, l) = s.split_once('/')?;
    let ip: IpAddr = a.parse().ok()?;
    let len: u8 = l.parse().ok()?;
    let max = if ip.is_ipv4() { 32 } else { 128 };
    (len <= max).then_some((ip, len))
}

/// A static address on the boot network: inside the Subnet with its prefix,
/// not its network, broadcast, bootd or gateway address, outside the lease
/// range, and not reserved for another Machine.
fn in_subnet(f: &str, ip: Ipv4Addr, len: u8, s: &Subnet, d: &Day1<'_>) -> Result<(), String> {
    let name = s.metadata.name.as_deref().unwrap_or_default();
    let cidr = &s.spec.cidr;
    let Some((net, mask)) = crate::validity::parse_cidr(cidr) else {
        return Err(format!(
            "{f}: Subnet {name} has no valid cidr ({cidr:?}) to check the address against"
        ));
    };
    let a = u32::from(ip);
    let own = s
        .status
        .as_ref()
        .and_then(|st| st.dhcp.as_ref())
        .is_some_and(|dh| {
            dh.reservations
                .iter()
                .any(|r| r.address == ip.to_string() && r.machine == d.reservation_key)
        });
    if own {
        // the Machine's own reservation: its DHCP lease, made static
        return Ok(());
    }
    if a & mask != net {
        return Err(format!(
            "{f}: {ip} is outside Subnet {name} ({cidr}); use an address of {cidr}"
        ));
    }
    let want = cidr.split_once('/').map(|(_, l)| l).unwrap_or_default();
    if want != len.to_string() {
        return Err(format!(
            "{f}: prefix /{len} differs from Subnet {name} ({cidr}); write {ip}/{want}"
        ));
    }
    if mask != u32::MAX && (a == net || a == net | !mask) {
        return Err(format!(
            "{f}: {ip} is the network or broadcast address of {cidr}"
        ));
    }
    let taken_by = |what: &str| {
        Err(format!(
            "{f}: {ip} is the {what} of Subnet {name}; choose another address"
        ))
    };
    if s.spec
        .bootd
        .as_ref()
        .is_some_and(|b| b.server_ip == ip.to_string())
    {
        return taken_by("bootd serverIP");
    }
    let reserved = s
        .status
        .as_ref()
        .and_then(|st| st.dhcp.as_ref())
        .and_then(|dh| {
            dh.reservations
                .iter()
                .find(|r| r.address == ip.to_string() && r.machine != d.reservation_key)
        });
    if let Some(r) = reserved {
        return Err(format!(
            "{f}: {ip} is reserved for Machine {} in Subnet {name}",
            r.machine
        ));
    }
    if let Some(dhcp) = &s.spec.dhcp {
        if dhcp.gateway.as_deref() == Some(ip.to_string().as_str()) {
            return taken_by("gateway");
        }
        if let Some(r) = &dhcp.lease_range
            && let (Ok(lo), Ok(hi)) = (r.start.parse::<Ipv4Addr>(), r.end.parse::<Ipv4Addr>())
            && (u32::from(lo)..=u32::from(hi)).contains(&a)
        {
            return Err(format!(
                "{f}: {ip} is inside the lease range {}-{} of Subnet {name} (bootd may lease it to another machine); choose an address outside it",
                r.start, r.end
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_images_day1_defaults_fill_only_what_the_claim_leaves_unset() {
        let image: Image = serde_json::from_value(json!({
            "apiVersion": "anneal.dev/v1alpha1", "kind": "Image",
            "metadata": {"name": "os", "namespace": "ns"},
            "spec": {"layout": {"partitionTable": "gpt", "slots": []},
                     "day1Defaults": {"userData": {"name": "base"},
                                      "publicKeysSecretRef": {"name": "ops", "key": "k"}}}}))
        .unwrap();
        let claim = |spec: Value| -> MachineClaim {
            serde_json::from_value(json!({"apiVersion": "anneal.dev/v1alpha1",
                "kind": "MachineClaim", "metadata": {"name": "c", "namespace": "ns"},
                "spec": spec}))
            .unwrap()
        };
        let bare = claim(json!({"imageRef": {"name": "os"}}));
        assert!(!wanted(&bare));
        let filled = with_image_defaults(&bare, Some(&image));
        assert!(wanted(&filled));
        assert_eq!(filled.spec.user_data.as_ref().unwrap().name, "base");
        assert_eq!(
            wanted_secrets(&filled),
            [
                ("base".into(), "userData".into()),
                ("ops".into(), "k".into())
            ]
        );
        // the claim's own fields win; its hostname stays beside the keys
        let own = claim(
            json!({"imageRef": {"name": "os"}, "userData": {"name": "mine"},
            "metaData": {"hostname": "h1"}}),
        );
        let filled = with_image_defaults(&own, Some(&image));
        assert_eq!(filled.spec.user_data.as_ref().unwrap().name, "mine");
        let md = filled.spec.meta_data.as_ref().unwrap();
        assert_eq!(md.hostname.as_deref(), Some("h1"));
        assert_eq!(md.public_keys_secret_ref.as_ref().unwrap().name, "ops");
        // no Image or no defaults: the claim as it is
        assert!(matches!(
            with_image_defaults(&own, None),
            std::borrow::Cow::Borrowed(_)
        ));
    }

    fn subnet() -> Subnet {
        serde_json::from_value(json!({
            "apiVersion": "anneal.dev/v1alpha1", "kind": "Subnet",
            "metadata": {"name": "lab", "namespace": "ns"},
            "spec": {"siteRef": {"name": "s"}, "cidr": "10.0.0.0/24",
                "bootd": {"serverIP": "10.0.0.1", "mode": "External"},
                "dhcp": {"mode": "lease", "gateway": "10.0.0.254",
                    "leaseRange": {"start": "10.0.0.100", "end": "10.0.0.150"}}},
            "status": {"dhcp": {"reservations": [
                {"address": "10.0.0.100", "machine": "m1", "mac": "52:54:00:00:00:01"},
                {"address": "10.0.0.101", "machine": "other", "mac": "52:54:00:00:00:09"}]}}
        }))
        .unwrap()
    }

    fn nics() -> Vec<HardwareNic> {
        serde_json::from_value(json!([
            {"name": "eth0", "mac": "52:54:00:00:00:01"},
            {"name": "eth1", "mac": "52:54:00:00:00:02"},
            {"name": "eth2", "mac": "52:54:00:00:00:03"}
        ]))
        .unwrap()
    }

    fn day1(nics: &[HardwareNic]) -> Day1<'_> {
        Day1 {
            namespace: "ns",
            machine: "m1",
            boot_mac: Some("52-54-00-00-00-01"),
            nics,
            subnet: Some(subnet()),
            reservation_key: "m1".into(),
            ..Day1::default()
        }
    }

    fn net(v: Value) -> NetworkData {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn generated_links_render_as_network_config_v2() {
        let n = nics();
        let got = network_config(
            &net(json!({
                "ethernets": [
                    {"name": "prov0", "nic": "boot", "addresses": ["10.0.0.50/24"],
                     "gateway4": "10.0.0.254", "nameservers": ["10.0.0.53"], "search": ["lab"]},
                    {"name": "d1", "nic": "eth1"},
                    {"name": "d2", "nic": "52:54:00:00:00:03"}],
                "bonds": [{"name": "bond0", "interfaces": ["d1", "d2"], "mode": "802.3ad", "mtu": 9000}],
                "vlans": [{"name": "bond0.100", "id": 100, "link": "bond0", "addresses": ["192.168.7.5/24"]}]
            })),
            &day1(&n),
        )
        .unwrap();
        assert_eq!(
            got,
            json!({"version": 2,
                "ethernets": {
                    "prov0": {"match": {"macaddress": "52:54:00:00:00:01"}, "set-name": "prov0",
                        "addresses": ["10.0.0.50/24"], "gateway4": "10.0.0.254",
                        "nameservers": {"addresses": ["10.0.0.53"], "search": ["lab"]}},
                    "d1": {"match": {"macaddress": "52:54:00:00:00:02"}, "set-name": "d1"},
                    "d2": {"match": {"macaddress": "52:54:00:00:00:03"}, "set-name": "d2"}},
                "bonds": {"bond0": {"interfaces": ["d1", "d2"], "parameters": {"mode": "802.3ad"}, "mtu": 9000}},
                "vlans": {"bond0.100": {"id": 100, "link": "bond0", "addresses": ["192.168.7.5/24"]}}})
        );
        // the Machine's own reservation may be made static
        let own = net(
            json!({"ethernets": [{"name": "p", "nic": "boot", "addresses": ["10.0.0.100/24"]}]}),
        );
        assert!(network_config(&own, &day1(&n)).is_ok());
    }

    #[test]
    fn malformed_links_are_refused_naming_the_field() {
        let n = nics();
        let d = day1(&n);
        let refused = |v: Value| network_config(&net(v), &d).unwrap_err();
        let cases = [
            (
                json!({"ethernets": [{"name": "p", "nic": "storage"}]}),
                "spec.networkData.ethernets[0].nic: \"storage\" is not a NIC of Machine ns/m1",
            ),
            (
                json!({"ethernets": [{"name": "p", "nic": "boot", "addresses": ["10.9.0.5/24"]}]}),
                "spec.networkData.ethernets[0].addresses[0]: 10.9.0.5 is outside Subnet lab (10.0.0.0/24)",
            ),
            (
                json!({"ethernets": [{"name": "p", "nic": "boot", "addresses": ["10.0.0.120/24"]}]}),
                "spec.networkData.ethernets[0].addresses[0]: 10.0.0.120 is inside the lease range",
            ),
            (
                json!({"ethernets": [{"name": "p", "nic": "boot", "addresses": ["10.0.0.101/24"]}]}),
                "reserved for Machine other",
            ),
            (
                json!({"ethernets": [{"name": "p", "nic": "boot", "addresses": ["10.0.0.1/24"]}]}),
                "bootd serverIP",
            ),
            (
                json!({"ethernets": [{"name": "p", "nic": "boot", "addresses": ["10.0.0.50/16"]}]}),
                "prefix /16 differs",
            ),
            (
                json!({"ethernets": [{"name": "p", "nic": "boot", "addresses": ["10.0.0.50"]}]}),
                "is not an address in CIDR form",
            ),
            (
                json!({"ethernets": [{"name": "p", "nic": "boot", "gateway4": "10.1.0.1"}]}),
                "spec.networkData.ethernets[0].gateway4: 10.1.0.1 is outside Subnet lab",
            ),
            (
                json!({"ethernets": [{"name": "p", "nic": "eth1"}, {"name": "q", "nic": "eth1"}]}),
                "spec.networkData.ethernets[1].nic: NIC 52:54:00:00:00:02 is already ethernet p",
            ),
            (
                json!({"ethernets": [{"name": "p", "nic": "eth1"}, {"name": "p", "nic": "eth2"}]}),
                "spec.networkData.ethernets[1].name: p is used",
            ),
            (
                json!({"ethernets": [{"name": "a/b", "nic": "eth1"}]}),
                "is not an interface name",
            ),
            (
                json!({"bonds": [{"name": "b", "interfaces": ["x"]}]}),
                "spec.networkData.bonds[0].interfaces[0]: \"x\" is not an ethernet",
            ),
            (
                json!({"ethernets": [{"name": "p", "nic": "eth1"}], "bonds": [{"name": "b", "interfaces": ["p"], "mode": "fast"}]}),
                "spec.networkData.bonds[0].mode: \"fast\" is not a bonding mode",
            ),
            (
                json!({"ethernets": [{"name": "p", "nic": "eth1", "dhcp4": true}], "bonds": [{"name": "b", "interfaces": ["p"]}]}),
                "ethernet p is bonded",
            ),
            (
                json!({"vlans": [{"name": "v", "id": 5, "link": "nope"}]}),
                "spec.networkData.vlans[0].link",
            ),
        ];
        for (v, want) in cases {
            let got = refused(v.clone());
            assert!(got.contains(want), "{v}: {got}");
        }
        // an address on a bond of the boot NIC is checked too
        let bond = net(
            json!({"ethernets": [{"name": "p", "nic": "boot"}, {"name": "q", "nic": "eth1"}],
            "bonds": [{"name": "b", "interfaces": ["p", "q"], "addresses": ["10.7.0.2/24"]}]}),
        );
        assert!(
            network_config(&bond, &d)
                .unwrap_err()
                .contains("spec.networkData.bonds[0].addresses[0]")
        );
        // boot without a bootMACAddress names the fix
        let mut nb = day1(&n);
        nb.boot_mac = None;
        let e = network_config(
            &net(json!({"ethernets": [{"name": "p", "nic": "boot"}]})),
            &nb,
        )
        .unwrap_err();
        assert!(
            e.contains("spec.bootMACAddress") && e.contains("eth0 52:54:00:00:00:01"),
            "{e}"
        );
    }

    #[test]
    fn secrets_pass_as_is_and_never_reach_an_error_or_the_hash_input_in_clear() {
        let claim: MachineClaim = serde_json::from_value(json!({
            "apiVersion": "anneal.dev/v1alpha1", "kind": "MachineClaim",
            "metadata": {"name": "c1", "namespace": "ns", "uid": "u1"},
            "spec": {"machineName": "m1", "imageRef": {"name": "os"},
                "userData": {"name": "ud", "key": "cfg"},
                "networkData": {"secretRef": {"name": "nd"}},
                "metaData": {"hostname": "web-1"}}
        }))
        .unwrap();
        let n = nics();
        let mut d = day1(&n);
        d.labels.insert("rack".into(), "r7".into());
        let ud = b"\x1f\x8bbinary-gzip-s3cr3t".to_vec();
        d.secrets.insert("secret/ud/cfg".into(), ud.clone());
        d.secrets
            .insert("secret/nd/networkData".into(), b"version: 2\n".to_vec());
        let r = render(&claim, &d, 4, "u1").unwrap();
        assert_eq!(r.drive.files["user-data"].expose(), &ud[..]);
        assert_eq!(r.drive.files["network-config"].expose(), b"version: 2\n");
        let mut drive = r.drive.clone();
        stamp_instance_id(&mut drive, "m1-0a1b2c3d-1");
        let meta: Value = serde_json::from_slice(drive.files["meta-data"].expose()).unwrap();
        assert_eq!(meta["instance-id"], "m1-0a1b2c3d-1");
        assert_eq!(meta["local-hostname"], "web-1");
        assert_eq!(meta["anneal"]["labels"]["rack"], "r7");
        assert_eq!(meta["anneal"]["namespace"], "ns");
        assert!(!r.hash.contains("s3cr3t"));
        // relabelling the Machine is not a new intent; a new hostname is
        let mut relabelled = day1(&n);
        relabelled.secrets = d.secrets.clone();
        assert_eq!(render(&claim, &relabelled, 4, "u1").unwrap().hash, r.hash);
        let mut renamed = claim.clone();
        renamed.spec.meta_data.as_mut().unwrap().hostname = Some("web-2".into());
        assert_ne!(render(&renamed, &d, 4, "u1").unwrap().hash, r.hash);
        // too large: the message gives the size, not the bytes
        d.secrets
            .insert("secret/ud/cfg".into(), vec![b's'; MAX_USER_DATA + 1]);
        let e = render(&claim, &d, 4, "u1").unwrap_err();
        assert!(
            e.contains("spec.userData: Secret ud key cfg holds 262145 bytes"),
            "{e}"
        );
        let bad_host: MachineClaim = serde_json::from_value(json!({
            "apiVersion": "anneal.dev/v1alpha1", "kind": "MachineClaim",
            "metadata": {"name": "c1", "namespace": "ns"},
            "spec": {"machineName": "m1", "metaData": {"hostname": "web_1"}}
        }))
        .unwrap();
        assert!(
            render(&bad_host, &d, 4, "u1")
                .unwrap_err()
                .contains("spec.metaData.hostname")
        );
    }
}
