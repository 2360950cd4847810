//! The OpenStack metadata layout of a claim's Day-1 data (docs/deploy.md
//! "Day-1 over the network"): pure conversions from the NoCloud files that
//! [`crate::deploy::cloudinit::render`] makes (`meta-data` JSON,
//! `network-config` version 2) into `meta_data.json` and
//! `network_data.json`, and the version listing cloud-init's OpenStack
//! reader asks for first.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use serde_json::{Map, Value, json};

/// The metadata versions listed at `/openstack/` (cloud-init picks the
/// newest it knows; every one serves the same files). `network_data.json`
/// exists from 2015-10-15 on.
pub const VERSIONS: &[&str] = &[
    "2012-08-10",
    "2013-04-04",
    "2013-10-17",
    "2015-10-15",
    "2016-06-30",
    "2016-10-06",
    "2017-02-22",
    "2018-08-27",
];

/// Whether `v` is a version this layout answers (`latest` or one listed).
pub fn known_version(v: &str) -> bool {
    v == "latest" || VERSIONS.contains(&v)
}

/// The body of `/openstack/`: one version per line, `latest` last.
pub fn listing() -> String {
    let mut s = VERSIONS.join("\n");
    s.push_str("\nlatest");
    s
}

/// `meta_data.json` from the NoCloud `meta-data` document: `uuid` is the
/// instance id, `hostname`/`name` the local host name, `public_keys` the
/// keys (`key-0`, `key-1`, …), `meta` the Machine's labels and its
/// namespace, name and claim (strings only, as OpenStack's `meta` is).
pub fn meta_data(nocloud: &Value) -> Value {
    let host = nocloud["local-hostname"].as_str().unwrap_or_default();
    let mut keys = Map::new();
    let mut key_list = Vec::new();
    for (i, k) in nocloud["public-keys"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default()
        .iter()
        .filter_map(Value::as_str)
        .enumerate()
    {
        let name = format!("key-{i}");
        keys.insert(name.clone(), json!(k));
        key_list.push(json!({"name": name, "type": "ssh", "data": k}));
    }
    let a = &nocloud["anneal"];
    let mut meta: BTreeMap<String, String> = a["labels"]
        .as_object()
        .map(|m| {
            m.iter()
                .filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_string())))
                .collect()
        })
        .unwrap_or_default();
    for (k, field) in [
        ("anneal.dev/machine", "machine"),
        ("anneal.dev/namespace", "namespace"),
        ("anneal.dev/claim", "claim"),
    ] {
        if let Some(v) = a[field].as_str() {
            meta.insert(k.to_string(), v.to_string());
        }
    }
    json!({
        "uuid": nocloud["instance-id"],
        "hostname": host,
        "name": host,
        "public_keys": keys,
        "keys": key_list,
        "meta": meta,
        "project_id": a["namespace"],
        "launch_index": 0,
        "availability_zone": "",
    })
}

/// `network_data.json` from a network-config version 2 document with the
/// keys anneal generates (ethernets matched by MAC, bonds, VLANs, static
/// addresses, DHCPv4, gateway, DNS, MTU). Anything else (version 1, other
/// keys): `Err` naming it, and the endpoint serves no network data (the
/// config drive still carries the document as given).
pub fn network_data(v2: &Value) -> Result<Value, String> {
    if v2["version"] != json!(2) {
        return Err("network-config is not version 2".into());
    }
    let top = v2
        .as_object()
        .ok_or_else(|| "network-config is not a mapping".to_string())?;
    if let Some(k) = top
        .keys()
        .find(|k| !["version", "ethernets", "bonds", "vlans"].contains(&k.as_str()))
    {
        return Err(format!("network-config key {k:?} has no OpenStack form"));
    }
    let mut out = Out::default();
    let empty = Map::new();
    let section = |k: &str| v2[k].as_object().unwrap_or(&empty).clone();
    let (ethernets, bonds, vlans) = (section("ethernets"), section("bonds"), section("vlans"));
    for (name, e) in &ethernets {
        let mac = e["match"]["macaddress"]
            .as_str()
            .ok_or_else(|| format!("ethernet {name} has no match.macaddress"))?;
        out.macs.insert(name.clone(), mac.to_string());
        out.link(
            name,
            json!({"id": name, "name": name, "type": "phy", "ethernet_mac_address": mac}),
            e,
        )?;
    }
    for (name, b) in &bonds {
        let members: Vec<String> = b["interfaces"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|m| m.as_str().map(str::to_string))
                    .collect()
            })
            .unwrap_or_default();
        let mac = members
            .first()
            .and_then(|m| out.macs.get(m))
            .cloned()
            .ok_or_else(|| format!("bond {name} has no member ethernet"))?;
        out.macs.insert(name.clone(), mac.clone());
        let mode = b["parameters"]["mode"].as_str().unwrap_or("active-backup");
        out.link(
            name,
            json!({"id": name, "name": name, "type": "bond", "bond_links": members,
                   "bond_mode": mode, "ethernet_mac_address": mac}),
            b,
        )?;
    }
    for (name, l) in &vlans {
        let parent = l["link"].as_str().unwrap_or_default();
        let mac =
            out.macs.get(parent).cloned().ok_or_else(|| {
                format!("vlan {name} is on {parent:?}, not a link of the document")
            })?;
        out.link(
            name,
            json!({"id": name, "name": name, "type": "vlan", "vlan_link": parent,
                   "vlan_id": l["id"], "vlan_mac_address": mac}),
            l,
        )?;
    }
    let services: Vec<Value> = out
        .dns
        .iter()
        .map(|a| json!({"type": "dns", "address": a}))
        .collect();
    Ok(json!({"links": out.links, "networks": out.networks, "services": services}))
}

#[derive(Default)]
struct Out {
    links: Vec<Value>,
    networks: Vec<Value>,
    dns: Vec<String>,
    macs: BTreeMap<String, String>,
}

impl Out {
    /// Adds one link and the networks its addressing keys describe.
    fn link(&mut self, name: &str, mut link: Value, v: &Value) -> Result<(), String> {
        const KNOWN: &[&str] = &[
            "match",
            "set-name",
            "interfaces",
            "parameters",
            "id",
            "link",
            "dhcp4",
            "addresses",
            "gateway4",
            "nameservers",
            "mtu",
        ];
        if let Some(k) = v
            .as_object()
            .and_then(|o| o.keys().find(|k| !KNOWN.contains(&k.as_str())))
        {
            return Err(format!("key {k:?} of link {name} has no OpenStack form"));
        }
        if let Some(mtu) = v["mtu"].as_i64() {
            link["mtu"] = json!(mtu);
        }
        self.links.push(link);
        let routes = match v["gateway4"].as_str() {
            Some(gw) => vec![json!({"network": "0.0.0.0", "netmask": "0.0.0.0", "gateway": gw})],
            None => Vec::new(),
        };
        let mut gw_used = false;
        for a in v["addresses"]
            .as_array()
            .map(Vec::as_slice)
            .unwrap_or_default()
        {
            let a = a.as_str().unwrap_or_default();
            let (ip, len) = a
                .split_once('/')
                .and_then(|(ip, l)| Some((ip.parse::<IpAddr>().ok()?, l.parse::<u8>().ok()?)))
                .ok_or_else(|| format!("address {a:?} of link {name} is not in CIDR form"))?;
            let (kind, netmask) = match ip {
                IpAddr::V4(_) => ("ipv4", netmask_v4(len).to_string()),
                IpAddr::V6(_) => ("ipv6", netmask_v6(len).to_string()),
            };
            let mut n = json!({"id": format!("network{}", self.networks.len()), "type": kind,
                               "link": name, "ip_address": ip.to_string(), "netmask": netmask});
            if ip.is_ipv4() && !gw_used {
                n["routes"] = json!(routes);
                gw_used = true;
            }
            self.networks.push(n);
        }
        if v["dhcp4"] == json!(true) {
            self.networks
                .push(json!({"id": format!("network{}", self.networks.len()),
                                      "type": "ipv4_dhcp", "link": name}));
        }
        for d in v["nameservers"]["addresses"]
            .as_array()
            .map(Vec::as_slice)
            .unwrap_or_default()
            .iter()
            .filter_map(Value::as_str)
        {
            if !self.dns.iter().any(|x| x == d) {
                self.dns.push(d.to_string());
            }
        }
        Ok(())
    }
}

fn netmask_v4(len: u8) -> Ipv4Addr {
    let bits = u32::MAX
        .checked_shl(32 - u32::from(len.min(32)))
        .unwrap_or(0);
    Ipv4Addr::from(bits)
}

fn netmask_v6(len: u8) -> Ipv6Addr {
    let bits = u128::MAX
        .checked_shl(128 - u32::from(len.min(128)))
        .unwrap_or(0);
    Ipv6Addr::from(bits)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn meta_data_carries_the_instance_host_keys_and_labels() {
        let m = meta_data(&json!({
            "instance-id": "web-1-abc-1", "local-hostname": "web-1",
            "public-keys": ["ssh-ed25519 AAAA a@b", "ssh-rsa BBBB c@d"],
            "anneal": {"machine": "web-1", "namespace": "team-a", "claim": "c1",
                       "labels": {"rack": "r1"}}}));
        assert_eq!(m["uuid"], "web-1-abc-1");
        assert_eq!(m["hostname"], "web-1");
        assert_eq!(m["public_keys"]["key-1"], "ssh-rsa BBBB c@d");
        assert_eq!(m["keys"][0]["data"], "ssh-ed25519 AAAA a@b");
        assert_eq!(m["meta"]["rack"], "r1");
        assert_eq!(m["meta"]["anneal.dev/namespace"], "team-a");
        assert_eq!(m["project_id"], "team-a");
    }

    #[test]
    fn a_static_boot_nic_and_a_bond_with_a_vlan_become_links_and_networks() {
        let v2 = json!({"version": 2,
            "ethernets": {
                "eno1": {"match": {"macaddress": "52:54:00:00:00:01"}, "set-name": "eno1",
                         "addresses": ["10.77.0.60/24"], "gateway4": "10.77.0.1",
                         "nameservers": {"addresses": ["10.77.0.1"]}},
                "eno2": {"match": {"macaddress": "52:54:00:00:00:02"}, "set-name": "eno2"},
                "eno3": {"match": {"macaddress": "52:54:00:00:00:03"}, "set-name": "eno3"}},
            "bonds": {"bond0": {"interfaces": ["eno2", "eno3"], "parameters": {"mode": "802.3ad"},
                                "mtu": 9000}},
            "vlans": {"v101": {"id": 101, "link": "bond0", "dhcp4": true}}});
        let n = network_data(&v2).unwrap();
        let links = n["links"].as_array().unwrap();
        assert_eq!(links.len(), 5);
        let bond = links.iter().find(|l| l["id"] == "bond0").unwrap();
        assert_eq!(bond["bond_links"], json!(["eno2", "eno3"]));
        assert_eq!(bond["ethernet_mac_address"], "52:54:00:00:00:02");
        assert_eq!(bond["mtu"], 9000);
        let vlan = links.iter().find(|l| l["id"] == "v101").unwrap();
        assert_eq!(
            (vlan["vlan_id"].clone(), vlan["vlan_link"].clone()),
            (json!(101), json!("bond0"))
        );
        let nets = n["networks"].as_array().unwrap();
        assert_eq!(nets[0]["ip_address"], "10.77.0.60");
        assert_eq!(nets[0]["netmask"], "255.255.255.0");
        assert_eq!(nets[0]["routes"][0]["gateway"], "10.77.0.1");
        assert_eq!(nets[1]["type"], "ipv4_dhcp");
        assert_eq!(nets[1]["link"], "v101");
        assert_eq!(
            n["services"],
            json!([{"type": "dns", "address": "10.77.0.1"}])
        );
    }

    #[test]
    fn what_has_no_openstack_form_is_named() {
        let e = network_data(&json!({"version": 1, "config": []})).unwrap_err();
        assert!(e.contains("version 2"), "{e}");
        let e = network_data(&json!({"version": 2, "wifis": {}})).unwrap_err();
        assert!(e.contains("wifis"), "{e}");
        let e = network_data(&json!({"version": 2, "ethernets": {"e": {
            "match": {"macaddress": "52:54:00:00:00:01"}, "routes": []}}}))
        .unwrap_err();
        assert!(e.contains("routes") && e.contains("link e"), "{e}");
    }

    #[test]
    fn netmasks() {
        assert_eq!(netmask_v4(0), Ipv4Addr::UNSPECIFIED);
        assert_eq!(netmask_v4(20).to_string(), "255.255.240.0");
        assert_eq!(netmask_v4(32).to_string(), "255.255.255.255");
        assert_eq!(netmask_v6(64).to_string(), "ffff:ffff:ffff:ffff::");
        assert!(known_version("latest") && known_version("2015-10-15"));
        assert!(!known_version("2099-01-01"));
        assert!(listing().ends_with("2018-08-27\nlatest"));
    }
}
