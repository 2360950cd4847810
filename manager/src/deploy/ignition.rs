//! Ignition (docs/deploy.md, "Day-1 over the network"): a claim's Day-1 data
//! for CoreOS-family Images (Fedora CoreOS, Flatcar), which boot with
//! Ignition, not cloud-init.
//!
//! Delivery: the manager's metadata endpoint serves this config at
//! `/ignition/config.ign` to the machine that holds the request's source
//! address. The Image boots with
//! `ignition.config.url=http://<endpoint>/ignition/config.ign` on its kernel
//! command line, and Ignition fetches and applies it from the initramfs on
//! the first boot.
//!
//! Pure: [`render`] turns the NoCloud files of
//! [`super::cloudinit::render`] (`meta-data`, optional `user-data` and
//! `network-config`) into one Ignition config of spec 3.4.0 with the same
//! intent: `/etc/hostname`, the `core` user's SSH keys, systemd-networkd
//! units under `/etc/systemd/network/`, and the user's own Ignition config
//! merged in.
//!
//! No value read from a Secret ever reaches an error message: errors name
//! files, keys and link names only.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use base64::prelude::{BASE64_STANDARD, Engine as _};
use serde_json::{Map, Value, json};

/// The Ignition config spec version rendered.
pub const SPEC_VERSION: &str = "3.4.0";
/// The user the SSH keys are given to (Fedora CoreOS and Flatcar).
pub const USER: &str = "core";
/// Where the systemd-networkd units go.
pub const NETWORK_DIR: &str = "/etc/systemd/network";

const CLOUD_USER_DATA: &str = "spec.userData: the Image boots with Ignition, which cannot run cloud-init user data (#cloud-config/script); give an Ignition config (JSON with ignition.version 3.x)";
const GZIP_USER_DATA: &str = "spec.userData: the Image boots with Ignition and gzip-compressed user data cannot be read here; give the Ignition config (JSON with ignition.version 3.x) uncompressed";
const OLD_IGNITION: &str = "spec.userData: the Ignition config's ignition.version is not 3.x (spec 2 and older configs cannot be merged into a spec 3 config); give an Ignition config of spec version 3.x";

/// The keys a link may have besides its kind's own.
const ADDRESSING: &[&str] = &[
    "dhcp4",
    "addresses",
    "gateway4",
    "gateway6",
    "routes",
    "nameservers",
    "mtu",
];

const BOND_MODES: &[&str] = &[
    "balance-rr",
    "active-backup",
    "balance-xor",
    "broadcast",
    "802.3ad",
    "balance-tlb",
    "balance-alb",
];

/// Renders the Ignition config (JSON) of a claim's NoCloud files
/// (`meta-data` required; `user-data` and `network-config` optional), or
/// says which file, field or key the Image cannot be given.
///
/// - `meta-data` `local-hostname` → `/etc/hostname` (0644, overwritten);
///   `public-keys` → `passwd.users[core].sshAuthorizedKeys`.
/// - `network-config` (version 2 with the keys anneal generates) →
///   systemd-networkd `.link`, `.netdev` and `.network` files.
/// - `user-data` (an Ignition 3.x config) → `ignition.config.merge`.
pub fn render(files: &BTreeMap<String, Vec<u8>>) -> Result<Vec<u8>, String> {
    let (hostname, keys) = meta_data(files.get("meta-data"))?;
    let mut written = vec![file("/etc/hostname", &format!("{hostname}\n"))];
    if let Some(body) = files.get("network-config") {
        for (name, text) in networkd(body)? {
            written.push(file(&format!("{NETWORK_DIR}/{name}"), &text));
        }
    }
    let mut ignition = Map::new();
    ignition.insert("version".into(), json!(SPEC_VERSION));
    if let Some(source) = user_data(files.get("user-data"))? {
        ignition.insert("config".into(), json!({"merge": [{"source": source}]}));
    }
    let mut config = Map::new();
    config.insert("ignition".into(), Value::Object(ignition));
    if !keys.is_empty() {
        config.insert(
            "passwd".into(),
            json!({"users": [{"name": USER, "sshAuthorizedKeys": keys}]}),
        );
    }
    config.insert("storage".into(), json!({ "files": written }));
    serde_json::to_vec(&Value::Object(config))
        .map_err(|e| format!("ignition: cannot encode the config: {e}"))
}

/// The host name and SSH keys of the meta-data.
fn meta_data(body: Option<&Vec<u8>>) -> Result<(String, Vec<String>), String> {
    let body = body.ok_or("meta-data: missing")?;
    let Ok(Value::Object(v)) = serde_json::from_slice::<Value>(body) else {
        return Err("meta-data: not a JSON object".into());
    };
    let hostname = v
        .get("local-hostname")
        .and_then(Value::as_str)
        .ok_or("meta-data: local-hostname is missing or not a string")?;
    if !valid_hostname(hostname) {
        return Err(
            "meta-data: local-hostname is not a host name (letters, digits, '-' and '.', at most 63)"
                .into(),
        );
    }
    let keys = match v.get("public-keys") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(a)) => {
            let mut keys = Vec::new();
            for (i, k) in a.iter().enumerate() {
                let Some(k) = k.as_str() else {
                    return Err(format!("meta-data: public-keys[{i}] is not a string"));
                };
                if k.contains(['\n', '\r']) {
                    return Err(format!(
                        "meta-data: public-keys[{i}] spans lines (one OpenSSH public key each)"
                    ));
                }
                let k = k.trim();
                if !k.is_empty() {
                    keys.push(k.to_string());
                }
            }
            keys
        }
        Some(_) => return Err("meta-data: public-keys is not an array".into()),
    };
    Ok((hostname.to_string(), keys))
}

/// The `ignition.config.merge` source of the user data: None without user
/// data (or empty user data).
fn user_data(body: Option<&Vec<u8>>) -> Result<Option<String>, String> {
    let Some(body) = body else {
        return Ok(None);
    };
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(None);
    }
    // flate2 is not a dependency of the manager: gzip is refused, not read
    if body.starts_with(&[0x1f, 0x8b]) {
        return Err(GZIP_USER_DATA.into());
    }
    let Ok(Value::Object(o)) = serde_json::from_slice::<Value>(body) else {
        return Err(CLOUD_USER_DATA.into());
    };
    match o
        .get("ignition")
        .and_then(|i| i.get("version"))
        .and_then(Value::as_str)
    {
        Some(v) if v.starts_with("3.") => Ok(Some(format!(
            "data:;base64,{}",
            BASE64_STANDARD.encode(body)
        ))),
        Some(_) => Err(OLD_IGNITION.into()),
        None => Err(CLOUD_USER_DATA.into()),
    }
}

/// A `storage.files` entry: `text` at `path`, mode 0644, overwritten.
fn file(path: &str, text: &str) -> Value {
    json!({
        "path": path,
        "mode": 0o644,
        "overwrite": true,
        "contents": { "source": data_url(text) },
    })
}

/// `text` as a `data:,` URL, every byte but the unreserved ones
/// percent-encoded.
fn data_url(text: &str) -> String {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    let mut s = String::from("data:,");
    for b in text.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            s.push(char::from(b));
        } else {
            s.push('%');
            s.push(char::from(HEX[usize::from(b >> 4)]));
            s.push(char::from(HEX[usize::from(b & 0xf)]));
        }
    }
    s
}

fn valid_hostname(h: &str) -> bool {
    !h.is_empty()
        && h.len() <= 63
        && !h.starts_with(['-', '.'])
        && !h.ends_with(['-', '.'])
        && h.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.')
}

fn valid_ifname(n: &str) -> bool {
    !n.is_empty()
        && n.len() <= 15
        && n != "."
        && n != ".."
        && n.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
}

fn valid_domain(d: &str) -> bool {
    !d.is_empty()
        && d.len() <= 253
        && d.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
}

/// A key of a Secret's document as it may appear in an error: short names
/// only.
fn shown(k: &str) -> &str {
    if !k.is_empty()
        && k.len() <= 32
        && k.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
    {
        k
    } else {
        "(a key not shown)"
    }
}

/// One link of the network-config.
#[derive(Debug)]
struct Link {
    kind: Kind,
    addr: Addressing,
}

#[derive(Debug)]
enum Kind {
    Ethernet {
        mac: Option<String>,
        set_name: Option<String>,
    },
    Bond {
        members: Vec<String>,
        mode: Option<String>,
    },
    Vlan {
        id: u64,
        link: String,
    },
}

#[derive(Debug, Default)]
struct Addressing {
    dhcp4: Option<bool>,
    addresses: Vec<String>,
    gateways: Vec<String>,
    routes: Vec<Route>,
    dns: Vec<String>,
    domains: Vec<String>,
    mtu: Option<u64>,
}

impl Addressing {
    /// Whether the link has layer-3 configuration of its own.
    fn has_l3(&self) -> bool {
        self.dhcp4 == Some(true)
            || !self.addresses.is_empty()
            || !self.gateways.is_empty()
            || !self.routes.is_empty()
            || !self.dns.is_empty()
            || !self.domains.is_empty()
    }
}

#[derive(Debug)]
struct Route {
    to: String,
    via: String,
    metric: Option<u64>,
}

/// The systemd-networkd units (file name → text) of a network-config.
fn networkd(body: &[u8]) -> Result<BTreeMap<String, String>, String> {
    let doc = document(body)?;
    let links = parse_links(&doc)?;
    check(&links)?;
    Ok(units(&links))
}

/// The network-config's version 2 mapping (a top-level `network:` unwrapped).
fn document(body: &[u8]) -> Result<Map<String, Value>, String> {
    // parser errors quote the input: they are dropped
    let v: Value = match serde_json::from_slice(body) {
        Ok(v) => v,
        Err(_) => serde_saphyr::from_slice(body)
            .map_err(|_| "network-config: not a YAML or JSON document".to_string())?,
    };
    let Value::Object(mut m) = v else {
        return Err(
            "network-config: not a mapping (version 2: version, ethernets, bonds, vlans)".into(),
        );
    };
    if m.len() == 1
        && let Some(Value::Object(inner)) = m.remove("network")
    {
        m = inner;
    }
    let version = m.get("version").and_then(|v| match v {
        Value::Number(n) => n.as_u64(),
        Value::String(s) => s.parse().ok(),
        _ => None,
    });
    match version {
        Some(2) => {}
        Some(1) => {
            return Err("network-config: version 1 is not supported for an Image that boots with Ignition; give network-config version 2 (ethernets, bonds, vlans)".into());
        }
        _ => {
            return Err("network-config: version is missing or not 2; an Image that boots with Ignition takes network-config version 2 (ethernets, bonds, vlans)".into());
        }
    }
    only("", &m, &["version", "ethernets", "bonds", "vlans"], false)?;
    Ok(m)
}

/// Refuses a key of `o` outside `keys` (and the addressing keys when
/// `addressing`).
fn only(path: &str, o: &Map<String, Value>, keys: &[&str], addressing: bool) -> Result<(), String> {
    let allowed = || keys.iter().chain(if addressing { ADDRESSING } else { &[] });
    for k in o.keys() {
        if !allowed().any(|a| a == k) {
            let at = if path.is_empty() {
                String::new()
            } else {
                format!("{path}: ")
            };
            let list: Vec<&str> = allowed().copied().collect();
            return Err(format!(
                "network-config: {at}key {} is not supported for an Image that boots with Ignition (supported here: {})",
                shown(k),
                list.join(", ")
            ));
        }
    }
    Ok(())
}

fn parse_links(doc: &Map<String, Value>) -> Result<BTreeMap<String, Link>, String> {
    let empty = Map::new();
    let mut links = BTreeMap::new();
    for section in ["ethernets", "bonds", "vlans"] {
        let m = match doc.get(section) {
            None | Some(Value::Null) => continue,
            Some(Value::Object(m)) => m,
            Some(_) => {
                return Err(format!(
                    "network-config: {section} is not a mapping of links"
                ));
            }
        };
        for (id, body) in m {
            if !valid_ifname(id) {
                return Err(format!(
                    "network-config: {section}: a link name is not an interface name (letters, digits, '-', '_', '.', at most 15)"
                ));
            }
            let path = format!("{section}.{id}");
            let o = match body {
                Value::Object(o) => o,
                Value::Null => &empty,
                _ => return Err(format!("network-config: {path}: not a mapping")),
            };
            let link = match section {
                "ethernets" => ethernet(&path, o)?,
                "bonds" => bond(&path, o)?,
                _ => vlan(&path, o)?,
            };
            if links.insert(id.clone(), link).is_some() {
                return Err(format!(
                    "network-config: {path}: {id} is the name of another link"
                ));
            }
        }
    }
    Ok(links)
}

fn ethernet(path: &str, o: &Map<String, Value>) -> Result<Link, String> {
    only(path, o, &["match", "set-name"], true)?;
    let mac = match o.get("match") {
        None => None,
        Some(Value::Object(m)) => {
            only(&format!("{path}.match"), m, &["macaddress"], false)?;
            let mac = m
                .get("macaddress")
                .and_then(Value::as_str)
                .and_then(crate::ipam::canonical_mac)
                .ok_or_else(|| {
                    format!("network-config: {path}.match.macaddress: missing or not a MAC address")
                })?;
            Some(mac)
        }
        Some(_) => return Err(format!("network-config: {path}.match: not a mapping")),
    };
    let set_name = match o.get("set-name") {
        None => None,
        Some(Value::String(s)) if valid_ifname(s) => Some(s.clone()),
        Some(_) => {
            return Err(format!(
                "network-config: {path}.set-name: not an interface name (letters, digits, '-', '_', '.', at most 15)"
            ));
        }
    };
    if set_name.is_some() && mac.is_none() {
        return Err(format!(
            "network-config: {path}.set-name: needs match.macaddress (the NIC is named by its MAC)"
        ));
    }
    Ok(Link {
        kind: Kind::Ethernet { mac, set_name },
        addr: addressing(path, o)?,
    })
}

fn bond(path: &str, o: &Map<String, Value>) -> Result<Link, String> {
    only(path, o, &["interfaces", "parameters"], true)?;
    let members = match o.get("interfaces") {
        None => Vec::new(),
        Some(v) => strings(&format!("{path}.interfaces"), v)?,
    };
    let mode = match o.get("parameters") {
        None => None,
        Some(Value::Object(p)) => {
            only(&format!("{path}.parameters"), p, &["mode"], false)?;
            match p.get("mode") {
                None => None,
                Some(Value::String(m)) if BOND_MODES.contains(&m.as_str()) => Some(m.clone()),
                Some(_) => {
                    return Err(format!(
                        "network-config: {path}.parameters.mode: not a bonding mode (one of {})",
                        BOND_MODES.join(", ")
                    ));
                }
            }
        }
        Some(_) => {
            return Err(format!("network-config: {path}.parameters: not a mapping"));
        }
    };
    Ok(Link {
        kind: Kind::Bond { members, mode },
        addr: addressing(path, o)?,
    })
}

fn vlan(path: &str, o: &Map<String, Value>) -> Result<Link, String> {
    only(path, o, &["id", "link"], true)?;
    let id = o
        .get("id")
        .and_then(Value::as_u64)
        .filter(|id| *id <= 4094)
        .ok_or_else(|| format!("network-config: {path}.id: missing or not a VLAN id (0-4094)"))?;
    let link = o
        .get("link")
        .and_then(Value::as_str)
        .ok_or_else(|| format!("network-config: {path}.link: missing or not a link name"))?
        .to_string();
    Ok(Link {
        kind: Kind::Vlan { id, link },
        addr: addressing(path, o)?,
    })
}

/// An array of strings.
fn strings(field: &str, v: &Value) -> Result<Vec<String>, String> {
    let Value::Array(a) = v else {
        return Err(format!("network-config: {field}: not a list"));
    };
    a.iter()
        .enumerate()
        .map(|(i, s)| {
            s.as_str()
                .map(str::to_string)
                .ok_or_else(|| format!("network-config: {field}[{i}]: not a string"))
        })
        .collect()
}

fn addressing(path: &str, o: &Map<String, Value>) -> Result<Addressing, String> {
    let mut a = Addressing::default();
    if let Some(v) = o.get("dhcp4") {
        a.dhcp4 = Some(
            boolean(v).ok_or_else(|| format!("network-config: {path}.dhcp4: not true or false"))?,
        );
    }
    if let Some(v) = o.get("addresses") {
        let f = format!("{path}.addresses");
        let Value::Array(list) = v else {
            return Err(format!("network-config: {f}: not a list"));
        };
        for (i, addr) in list.iter().enumerate() {
            let ok = addr.as_str().filter(|s| parse_address(s).is_some());
            let Some(addr) = ok else {
                return Err(format!(
                    "network-config: {f}[{i}]: not an address in CIDR form (10.0.0.50/24 or 2001:db8::5/64)"
                ));
            };
            a.addresses.push(addr.to_string());
        }
    }
    for (key, v6) in [("gateway4", false), ("gateway6", true)] {
        if let Some(v) = o.get(key) {
            let gw = v.as_str().filter(|s| {
                if v6 {
                    s.parse::<Ipv6Addr>().is_ok()
                } else {
                    s.parse::<Ipv4Addr>().is_ok()
                }
            });
            let Some(gw) = gw else {
                let family = if v6 { "IPv6" } else { "IPv4" };
                return Err(format!(
                    "network-config: {path}.{key}: not an {family} address"
                ));
            };
            a.gateways.push(gw.to_string());
        }
    }
    if let Some(v) = o.get("routes") {
        a.routes = routes(&format!("{path}.routes"), v)?;
    }
    if let Some(v) = o.get("nameservers") {
        nameservers(&format!("{path}.nameservers"), v, &mut a)?;
    }
    if let Some(v) = o.get("mtu") {
        let mtu = v
            .as_u64()
            .filter(|m| (68..=65535).contains(m))
            .ok_or_else(|| format!("network-config: {path}.mtu: not an MTU (68-65535)"))?;
        a.mtu = Some(mtu);
    }
    Ok(a)
}

fn nameservers(f: &str, v: &Value, a: &mut Addressing) -> Result<(), String> {
    let Value::Object(n) = v else {
        return Err(format!("network-config: {f}: not a mapping"));
    };
    only(f, n, &["addresses", "search"], false)?;
    if let Some(v) = n.get("addresses") {
        for (i, ns) in strings(&format!("{f}.addresses"), v)?
            .into_iter()
            .enumerate()
        {
            if ns.parse::<IpAddr>().is_err() {
                return Err(format!(
                    "network-config: {f}.addresses[{i}]: not an IP address"
                ));
            }
            a.dns.push(ns);
        }
    }
    if let Some(v) = n.get("search") {
        for (i, d) in strings(&format!("{f}.search"), v)?.into_iter().enumerate() {
            if !valid_domain(&d) {
                return Err(format!(
                    "network-config: {f}.search[{i}]: not a domain name"
                ));
            }
            a.domains.push(d);
        }
    }
    Ok(())
}

fn routes(f: &str, v: &Value) -> Result<Vec<Route>, String> {
    let Value::Array(list) = v else {
        return Err(format!("network-config: {f}: not a list"));
    };
    let mut out = Vec::new();
    for (i, r) in list.iter().enumerate() {
        let f = format!("{f}[{i}]");
        let Value::Object(r) = r else {
            return Err(format!("network-config: {f}: not a mapping"));
        };
        only(&f, r, &["to", "via", "metric"], false)?;
        let via: IpAddr = r
            .get("via")
            .and_then(Value::as_str)
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| format!("network-config: {f}.via: missing or not an IP address"))?;
        let to = match r.get("to").and_then(Value::as_str) {
            Some("default") => if via.is_ipv4() { "0.0.0.0/0" } else { "::/0" }.to_string(),
            Some(s) => {
                let ip = parse_address(s)
                    .map(|(ip, _)| ip)
                    .or_else(|| s.parse::<IpAddr>().ok());
                match ip {
                    Some(ip) if ip.is_ipv4() == via.is_ipv4() => s.to_string(),
                    _ => {
                        return Err(format!(
                            "network-config: {f}.to: not default or an address of the family of via"
                        ));
                    }
                }
            }
            None => return Err(format!("network-config: {f}.to: missing or not a string")),
        };
        let metric = match r.get("metric") {
            None => None,
            Some(m) => Some(
                m.as_u64()
                    .filter(|m| *m <= u64::from(u32::MAX))
                    .ok_or_else(|| format!("network-config: {f}.metric: not a number"))?,
            ),
        };
        out.push(Route {
            to,
            via: via.to_string(),
            metric,
        });
    }
    Ok(out)
}

fn boolean(v: &Value) -> Option<bool> {
    match v {
        Value::Bool(b) => Some(*b),
        Value::String(s) => match s.to_ascii_lowercase().as_str() {
            "true" | "yes" | "on" => Some(true),
            "false" | "no" | "off" => Some(false),
            _ => None,
        },
        _ => None,
    }
}

fn parse_address(s: &str) -> Option<(IpAddr, u8)> {
    let (a, l) = s.split_once('/')?;
    let ip: IpAddr = a.parse().ok()?;
    let len: u8 = l.parse().ok()?;
    let max = if ip.is_ipv4() { 32 } else { 128 };
    (len <= max).then_some((ip, len))
}

/// Cross-link rules: bond members are ethernets without addressing of their
/// own, in one bond each; a VLAN sits on an ethernet or a bond; no two links
/// name the same interface.
fn check(links: &BTreeMap<String, Link>) -> Result<(), String> {
    let mut names = BTreeMap::new();
    for (id, l) in links {
        let name = match &l.kind {
            Kind::Ethernet {
                set_name: Some(n), ..
            } => n,
            // named by the kernel
            Kind::Ethernet { mac: Some(_), .. } => continue,
            _ => id,
        };
        if let Some(other) = names.insert(name, id) {
            return Err(format!(
                "network-config: links {other} and {id} both name interface {name}"
            ));
        }
    }
    let mut bonded = BTreeMap::new();
    for (id, l) in links {
        match &l.kind {
            Kind::Bond { members, .. } => {
                for (j, m) in members.iter().enumerate() {
                    let f = format!("bonds.{id}.interfaces[{j}]");
                    let Some(Link {
                        kind: Kind::Ethernet { .. },
                        addr,
                    }) = links.get(m)
                    else {
                        return Err(format!(
                            "network-config: {f}: not an ethernet of network-config"
                        ));
                    };
                    if addr.has_l3() {
                        return Err(format!(
                            "network-config: {f}: ethernet {m} is bonded: move its addresses, dhcp4, gateways, routes and nameservers to the bond"
                        ));
                    }
                    if let Some(other) = bonded.insert(m, id) {
                        return Err(format!(
                            "network-config: {f}: ethernet {m} is in bond {other} already"
                        ));
                    }
                }
            }
            Kind::Vlan { link, .. } => {
                if !matches!(
                    links.get(link),
                    Some(Link {
                        kind: Kind::Ethernet { .. } | Kind::Bond { .. },
                        ..
                    })
                ) {
                    return Err(format!(
                        "network-config: vlans.{id}.link: not an ethernet or a bond of network-config"
                    ));
                }
            }
            Kind::Ethernet { .. } => {}
        }
    }
    Ok(())
}

/// Appends `key=value` and a newline.
fn line(s: &mut String, key: &str, value: impl std::fmt::Display) {
    s.push_str(key);
    s.push('=');
    s.push_str(&value.to_string());
    s.push('\n');
}

/// The unit files of checked links: `10-<link>.link` names a NIC by its
/// permanent MAC (never a bond's or VLAN's borrowed one), `10-<link>.netdev`
/// creates a bond or VLAN, `10-<link>.network` configures each link.
fn units(links: &BTreeMap<String, Link>) -> BTreeMap<String, String> {
    let mut bond_of = BTreeMap::new();
    let mut vlans_on: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for (id, l) in links {
        match &l.kind {
            Kind::Bond { members, .. } => {
                for m in members {
                    bond_of.insert(m.as_str(), id.as_str());
                }
            }
            Kind::Vlan { link, .. } => vlans_on.entry(link.as_str()).or_default().push(id),
            Kind::Ethernet { .. } => {}
        }
    }
    let mut out = BTreeMap::new();
    for (id, l) in links {
        let mut netdev = String::from("[NetDev]\n");
        line(&mut netdev, "Name", id);
        match &l.kind {
            Kind::Ethernet {
                mac: Some(mac),
                set_name: Some(name),
            } => {
                let mut s = String::from("[Match]\n");
                line(&mut s, "PermanentMACAddress", mac);
                s.push_str("\n[Link]\n");
                line(&mut s, "Name", name);
                out.insert(format!("10-{id}.link"), s);
            }
            Kind::Ethernet { .. } => {}
            Kind::Bond { mode, .. } => {
                line(&mut netdev, "Kind", "bond");
                if let Some(mtu) = l.addr.mtu {
                    line(&mut netdev, "MTUBytes", mtu);
                }
                if let Some(mode) = mode {
                    netdev.push_str("\n[Bond]\n");
                    line(&mut netdev, "Mode", mode);
                }
                out.insert(format!("10-{id}.netdev"), netdev);
            }
            Kind::Vlan { id: vid, .. } => {
                line(&mut netdev, "Kind", "vlan");
                if let Some(mtu) = l.addr.mtu {
                    line(&mut netdev, "MTUBytes", mtu);
                }
                netdev.push_str("\n[VLAN]\n");
                line(&mut netdev, "Id", vid);
                out.insert(format!("10-{id}.netdev"), netdev);
            }
        }
        let vlans = vlans_on
            .get(id.as_str())
            .map(Vec::as_slice)
            .unwrap_or_default();
        out.insert(
            format!("10-{id}.network"),
            network(id, l, bond_of.get(id.as_str()).copied(), vlans),
        );
    }
    out
}

/// The `.network` of one link.
fn network(id: &str, l: &Link, bond: Option<&str>, vlans: &[&str]) -> String {
    let mut s = String::from("[Match]\n");
    match &l.kind {
        Kind::Ethernet {
            set_name: Some(n), ..
        } => line(&mut s, "Name", n),
        Kind::Ethernet {
            mac: Some(mac),
            set_name: None,
        } => line(&mut s, "PermanentMACAddress", mac),
        _ => line(&mut s, "Name", id),
    }
    let a = &l.addr;
    if let Some(mtu) = a.mtu {
        s.push_str("\n[Link]\n");
        line(&mut s, "MTUBytes", mtu);
    }
    s.push_str("\n[Network]\n");
    if a.dhcp4 == Some(true) {
        line(&mut s, "DHCP", "ipv4");
    }
    for addr in &a.addresses {
        line(&mut s, "Address", addr);
    }
    for gw in &a.gateways {
        line(&mut s, "Gateway", gw);
    }
    for ns in &a.dns {
        line(&mut s, "DNS", ns);
    }
    if !a.domains.is_empty() {
        line(&mut s, "Domains", a.domains.join(" "));
    }
    if let Some(b) = bond {
        line(&mut s, "Bond", b);
        line(&mut s, "LinkLocalAddressing", "no");
    }
    for v in vlans {
        line(&mut s, "VLAN", v);
    }
    for r in &a.routes {
        s.push_str("\n[Route]\n");
        line(&mut s, "Destination", &r.to);
        line(&mut s, "Gateway", &r.via);
        if let Some(m) = r.metric {
            line(&mut s, "Metric", m);
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::deploy::cloudinit;
    use anneal_api::{HardwareNic, MachineClaim};

    fn meta(hostname: &str, keys: &[&str]) -> Vec<u8> {
        json!({"instance-id": "m1-1", "local-hostname": hostname, "public-keys": keys,
            "anneal": {"machine": "m1", "namespace": "ns", "labels": {}, "claim": "c1"}})
        .to_string()
        .into_bytes()
    }

    fn files(entries: &[(&str, &[u8])]) -> BTreeMap<String, Vec<u8>> {
        entries
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_vec()))
            .collect()
    }

    fn undata(source: &str) -> Vec<u8> {
        if let Some(b) = source.strip_prefix("data:;base64,") {
            return BASE64_STANDARD.decode(b).unwrap();
        }
        let s = source.strip_prefix("data:,").unwrap().as_bytes();
        let mut out = Vec::new();
        let mut i = 0;
        while i < s.len() {
            if s[i] == b'%' {
                let h = std::str::from_utf8(&s[i + 1..i + 3]).unwrap();
                out.push(u8::from_str_radix(h, 16).unwrap());
                i += 3;
            } else {
                out.push(s[i]);
                i += 1;
            }
        }
        out
    }

    /// The config and its `storage.files` by path, decoded.
    fn rendered(f: &BTreeMap<String, Vec<u8>>) -> (Value, BTreeMap<String, String>) {
        let v: Value = serde_json::from_slice(&render(f).unwrap()).unwrap();
        let mut out = BTreeMap::new();
        for file in v["storage"]["files"].as_array().unwrap() {
            assert_eq!(file["mode"], 420, "{file}");
            assert_eq!(file["overwrite"], true, "{file}");
            let text = String::from_utf8(undata(file["contents"]["source"].as_str().unwrap()));
            let path = file["path"].as_str().unwrap().to_string();
            assert!(out.insert(path, text.unwrap()).is_none());
        }
        (v, out)
    }

    const IGN: &str = r#"{"ignition":{"version":"3.4.0"},"systemd":{"units":[{"name":"web.service","enabled":true}]}}"#;

    #[test]
    fn hostname_keys_and_the_user_config_merged() {
        let f = files(&[
            (
                "meta-data",
                &meta("web-1", &["ssh-ed25519 AAAA k1", " ssh-rsa BBBB k2 "]),
            ),
            ("user-data", IGN.as_bytes()),
        ]);
        let (v, written) = rendered(&f);
        assert_eq!(v["ignition"]["version"], "3.4.0");
        let merge = v["ignition"]["config"]["merge"].as_array().unwrap();
        assert_eq!(merge.len(), 1);
        let source = merge[0]["source"].as_str().unwrap();
        assert!(source.starts_with("data:;base64,"), "{source}");
        assert_eq!(undata(source), IGN.as_bytes());
        assert_eq!(
            v["passwd"],
            json!({"users": [{"name": "core", "sshAuthorizedKeys": ["ssh-ed25519 AAAA k1", "ssh-rsa BBBB k2"]}]})
        );
        let hostname = &v["storage"]["files"][0];
        assert_eq!(hostname["path"], "/etc/hostname");
        assert_eq!(hostname["contents"]["source"], "data:,web-1%0A");
        assert_eq!(written.len(), 1);
        assert_eq!(written["/etc/hostname"], "web-1\n");
        // nothing but meta-data: no merge, no user, no network
        let bare: Value =
            serde_json::from_slice(&render(&files(&[("meta-data", &meta("m1", &[]))])).unwrap())
                .unwrap();
        assert_eq!(
            bare,
            json!({"ignition": {"version": "3.4.0"}, "storage": {"files": [{"path": "/etc/hostname",
                "mode": 420, "overwrite": true, "contents": {"source": "data:,m1%0A"}}]}})
        );
        // empty user data is no user data
        let (v, _) = rendered(&files(&[
            ("meta-data", &meta("m1", &[])),
            ("user-data", b"\n"),
        ]));
        assert!(v["ignition"].get("config").is_none());
    }

    const V2: &str = r#"{"version": 2,
        "ethernets": {
            "prov0": {"match": {"macaddress": "52:54:00:00:00:01"}, "set-name": "prov0",
                "addresses": ["10.0.0.50/24"], "gateway4": "10.0.0.254",
                "nameservers": {"addresses": ["10.0.0.53"], "search": ["lab", "corp.example"]}},
            "d1": {"match": {"macaddress": "52:54:00:00:00:02"}, "set-name": "d1"},
            "d2": {"match": {"macaddress": "52:54:00:00:00:03"}, "set-name": "d2"}},
        "bonds": {"bond0": {"interfaces": ["d1", "d2"], "parameters": {"mode": "802.3ad"}, "mtu": 9000}},
        "vlans": {"bond0.100": {"id": 100, "link": "bond0", "addresses": ["192.168.7.5/24"], "dhcp4": false}}}"#;

    fn expected_units() -> BTreeMap<String, String> {
        let units = [
            (
                "10-prov0.link",
                "[Match]\nPermanentMACAddress=52:54:00:00:00:01\n\n[Link]\nName=prov0\n",
            ),
            (
                "10-prov0.network",
                "[Match]\nName=prov0\n\n[Network]\nAddress=10.0.0.50/24\nGateway=10.0.0.254\nDNS=10.0.0.53\nDomains=lab corp.example\n",
            ),
            (
                "10-d1.link",
                "[Match]\nPermanentMACAddress=52:54:00:00:00:02\n\n[Link]\nName=d1\n",
            ),
            (
                "10-d1.network",
                "[Match]\nName=d1\n\n[Network]\nBond=bond0\nLinkLocalAddressing=no\n",
            ),
            (
                "10-d2.link",
                "[Match]\nPermanentMACAddress=52:54:00:00:00:03\n\n[Link]\nName=d2\n",
            ),
            (
                "10-d2.network",
                "[Match]\nName=d2\n\n[Network]\nBond=bond0\nLinkLocalAddressing=no\n",
            ),
            (
                "10-bond0.netdev",
                "[NetDev]\nName=bond0\nKind=bond\nMTUBytes=9000\n\n[Bond]\nMode=802.3ad\n",
            ),
            (
                "10-bond0.network",
                "[Match]\nName=bond0\n\n[Link]\nMTUBytes=9000\n\n[Network]\nVLAN=bond0.100\n",
            ),
            (
                "10-bond0.100.netdev",
                "[NetDev]\nName=bond0.100\nKind=vlan\n\n[VLAN]\nId=100\n",
            ),
            (
                "10-bond0.100.network",
                "[Match]\nName=bond0.100\n\n[Network]\nAddress=192.168.7.5/24\n",
            ),
        ];
        let mut out: BTreeMap<String, String> = units
            .into_iter()
            .map(|(k, v)| (format!("/etc/systemd/network/{k}"), v.to_string()))
            .collect();
        out.insert("/etc/hostname".into(), "web-1\n".into());
        out
    }

    #[test]
    fn a_static_ethernet_and_a_vlan_on_a_bond_become_networkd_units() {
        let f = files(&[
            ("meta-data", &meta("web-1", &[])),
            ("network-config", V2.as_bytes()),
        ]);
        let (_, written) = rendered(&f);
        assert_eq!(written, expected_units());
        // the same as YAML, wrapped in network:, as a user's Secret may hold it
        let yaml = "network:\n  version: 2\n  ethernets:\n    prov0:\n      match: {macaddress: 52:54:00:00:00:01}\n      set-name: prov0\n      addresses: [10.0.0.50/24]\n      gateway4: 10.0.0.254\n      nameservers:\n        addresses: [10.0.0.53]\n        search: [lab, corp.example]\n    d1:\n      match:\n        macaddress: \"52:54:00:00:00:02\"\n      set-name: d1\n    d2:\n      match: {macaddress: 52-54-00-00-00-03}\n      set-name: d2\n  bonds:\n    bond0:\n      interfaces: [d1, d2]\n      parameters: {mode: 802.3ad}\n      mtu: 9000\n  vlans:\n    bond0.100:\n      id: 100\n      link: bond0\n      addresses: [192.168.7.5/24]\n      dhcp4: false\n";
        let f = files(&[
            ("meta-data", &meta("web-1", &[])),
            ("network-config", yaml.as_bytes()),
        ]);
        assert_eq!(rendered(&f).1, expected_units());
        // DHCP, routes, a gateway6, a NIC left its kernel name
        let other = json!({"version": 2, "ethernets": {
            "lan": {"match": {"macaddress": "52:54:00:00:00:09"}, "dhcp4": true,
                "gateway6": "2001:db8::1", "addresses": ["2001:db8::5/64"],
                "routes": [{"to": "default", "via": "10.1.0.1", "metric": 50}, {"to": "10.9.0.0/16", "via": "10.1.0.2"}]},
            "eno2": {"dhcp4": "yes"}}});
        let units = networkd(other.to_string().as_bytes()).unwrap();
        assert_eq!(
            units,
            BTreeMap::from([
                (
                    "10-eno2.network".to_string(),
                    "[Match]\nName=eno2\n\n[Network]\nDHCP=ipv4\n".to_string()
                ),
                (
                    "10-lan.network".to_string(),
                    "[Match]\nPermanentMACAddress=52:54:00:00:00:09\n\n[Network]\nDHCP=ipv4\nAddress=2001:db8::5/64\nGateway=2001:db8::1\n\n[Route]\nDestination=0.0.0.0/0\nGateway=10.1.0.1\nMetric=50\n\n[Route]\nDestination=10.9.0.0/16\nGateway=10.1.0.2\n".to_string()
                ),
            ])
        );
    }

    #[test]
    fn the_cloud_init_drive_of_a_claim_renders() {
        let claim: MachineClaim = serde_json::from_value(json!({
            "apiVersion": "anneal.dev/v1alpha1", "kind": "MachineClaim",
            "metadata": {"name": "c1", "namespace": "ns", "uid": "u1"},
            "spec": {"machineName": "m1", "imageRef": {"name": "fcos"},
                "userData": {"name": "ud"},
                "networkData": {
                    "ethernets": [
                        {"name": "prov0", "nic": "boot", "addresses": ["10.0.0.50/24"],
                         "gateway4": "10.0.0.254", "nameservers": ["10.0.0.53"], "search": ["lab", "corp.example"]},
                        {"name": "d1", "nic": "eth1"},
                        {"name": "d2", "nic": "52:54:00:00:00:03"}],
                    "bonds": [{"name": "bond0", "interfaces": ["d1", "d2"], "mode": "802.3ad", "mtu": 9000}],
                    "vlans": [{"name": "bond0.100", "id": 100, "link": "bond0", "addresses": ["192.168.7.5/24"], "dhcp4": false}]},
                "metaData": {"hostname": "web-1", "publicKeysSecretRef": {"name": "keys"}}}
        }))
        .unwrap();
        let nics: Vec<HardwareNic> = serde_json::from_value(json!([
            {"name": "eth0", "mac": "52:54:00:00:00:01"},
            {"name": "eth1", "mac": "52:54:00:00:00:02"},
            {"name": "eth2", "mac": "52:54:00:00:00:03"}
        ]))
        .unwrap();
        let mut d = cloudinit::Day1 {
            namespace: "ns",
            machine: "m1",
            boot_mac: Some("52:54:00:00:00:01"),
            nics: &nics,
            reservation_key: "m1".into(),
            ..cloudinit::Day1::default()
        };
        d.secrets
            .insert("secret/ud/userData".into(), IGN.as_bytes().to_vec());
        d.secrets.insert(
            "secret/keys/authorized_keys".into(),
            b"# ops\nssh-ed25519 AAAA ops@lab\n".to_vec(),
        );
        let mut drive = cloudinit::render(&claim, &d, 4, "u1").unwrap().drive;
        cloudinit::stamp_instance_id(&mut drive, "m1-1");
        let f: BTreeMap<String, Vec<u8>> = drive
            .files
            .iter()
            .map(|(k, v)| (k.clone(), v.expose().to_vec()))
            .collect();
        let (v, written) = rendered(&f);
        assert_eq!(written, expected_units());
        assert_eq!(
            v["passwd"]["users"][0]["sshAuthorizedKeys"],
            json!(["ssh-ed25519 AAAA ops@lab"])
        );
        assert_eq!(
            undata(
                v["ignition"]["config"]["merge"][0]["source"]
                    .as_str()
                    .unwrap()
            ),
            IGN.as_bytes()
        );
    }

    #[test]
    fn cloud_init_user_data_is_refused_without_quoting_it() {
        let m = meta("m1", &[]);
        let refused = |ud: &[u8]| {
            let e = render(&files(&[("meta-data", &m), ("user-data", ud)])).unwrap_err();
            assert!(!e.contains("s3cr3t"), "{e}");
            e
        };
        for ud in [
            &b"#cloud-config\npassword: s3cr3t\n"[..],
            b"#!/bin/sh\necho s3cr3t\n",
            b"Content-Type: multipart/mixed; boundary=\"s3cr3t\"\n",
            b"{\"users\": [\"s3cr3t\"]}",
            b"[\"s3cr3t\"]",
        ] {
            assert_eq!(refused(ud), CLOUD_USER_DATA);
        }
        assert_eq!(
            refused(b"\x1f\x8b\x08\x00s3cr3t"),
            "spec.userData: the Image boots with Ignition and gzip-compressed user data cannot be read here; give the Ignition config (JSON with ignition.version 3.x) uncompressed"
        );
        assert!(
            refused(br#"{"ignition": {"version": "2.2.0"}, "s3cr3t": 1}"#)
                .starts_with("spec.userData: the Ignition config's ignition.version is not 3.x")
        );
        assert_eq!(
            CLOUD_USER_DATA,
            "spec.userData: the Image boots with Ignition, which cannot run cloud-init user data (#cloud-config/script); give an Ignition config (JSON with ignition.version 3.x)"
        );
    }

    #[test]
    fn unsupported_network_config_is_refused_naming_what() {
        let m = meta("m1", &[]);
        let refused = |nc: &str| {
            let e = render(&files(&[
                ("meta-data", &m),
                ("network-config", nc.as_bytes()),
            ]))
            .unwrap_err();
            assert!(e.starts_with("network-config: "), "{e}");
            assert!(!e.contains("s3cr3t"), "{e}");
            e
        };
        let cases = [
            (
                r#"{"version": 2, "bridges": {"br0": {}}}"#,
                "network-config: key bridges is not supported for an Image that boots with Ignition (supported here: version, ethernets, bonds, vlans)",
            ),
            (
                r#"{"version": 2, "ethernets": {"e": {"dhcp6": true}}}"#,
                "network-config: ethernets.e: key dhcp6 is not supported",
            ),
            (
                r#"{"version": 2, "ethernets": {"e": {"match": {"name": "en*"}}}}"#,
                "network-config: ethernets.e.match: key name is not supported",
            ),
            (
                r#"{"version": 2, "ethernets": {"e": {"match": {"macaddress": "52:54:00:00:00:01"}}},
                    "bonds": {"b": {"interfaces": ["e"], "parameters": {"mode": "802.3ad", "lacp-rate": "fast"}}}}"#,
                "network-config: bonds.b.parameters: key lacp-rate is not supported",
            ),
            (
                r#"{"version": 2, "ethernets": {"e": {"routes": [{"to": "default", "via": "10.0.0.1", "on-link": true}]}}}"#,
                "network-config: ethernets.e.routes[0]: key on-link is not supported",
            ),
            (
                r#"{"version": 2, "ethernets": {"e": {"s3cr3t-looooooooooooooooooooooooooooong": 1}}}"#,
                "network-config: ethernets.e: key (a key not shown) is not supported",
            ),
            (
                "version: 1\nconfig:\n  - type: physical\n    name: s3cr3t\n",
                "network-config: version 1 is not supported",
            ),
            (
                "{version: [s3cr3t",
                "network-config: not a YAML or JSON document",
            ),
            (
                r#"{"version": 2, "ethernets": {"e": {"addresses": ["s3cr3t"]}}}"#,
                "network-config: ethernets.e.addresses[0]: not an address in CIDR form",
            ),
            (
                r#"{"version": 2, "ethernets": {"e": {"set-name": "x"}}}"#,
                "network-config: ethernets.e.set-name: needs match.macaddress",
            ),
            (
                r#"{"version": 2, "ethernets": {"e": {"dhcp4": true}}, "bonds": {"b": {"interfaces": ["e"]}}}"#,
                "network-config: bonds.b.interfaces[0]: ethernet e is bonded",
            ),
            (
                r#"{"version": 2, "bonds": {"b": {"interfaces": ["s3cr3t"]}}}"#,
                "network-config: bonds.b.interfaces[0]: not an ethernet",
            ),
            (
                r#"{"version": 2, "vlans": {"v": {"id": 5, "link": "s3cr3t"}}}"#,
                "network-config: vlans.v.link: not an ethernet or a bond",
            ),
            (
                r#"{"version": 2, "vlans": {"v": {"id": 5000, "link": "e"}}}"#,
                "network-config: vlans.v.id",
            ),
            (
                r#"{"version": 2, "ethernets": {"a": {"match": {"macaddress": "52:54:00:00:00:01"}, "set-name": "x"},
                    "b": {"match": {"macaddress": "52:54:00:00:00:02"}, "set-name": "x"}}}"#,
                "network-config: links a and b both name interface x",
            ),
            (
                r#"{"version": 2, "ethernets": {"e": {"nameservers": {"search": ["a\nDNS=s3cr3t"]}}}}"#,
                "network-config: ethernets.e.nameservers.search[0]: not a domain name",
            ),
        ];
        for (nc, want) in cases {
            let got = refused(nc);
            assert!(got.starts_with(want), "{nc}: {got}");
        }
    }
}
