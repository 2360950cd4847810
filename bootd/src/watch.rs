//! The cluster source of truth: Machines (by `subnetRef`), the Subnet and
//! Secret `anneal-boot-tokens` of the Subnet's namespace (the only Secret
//! bootd reads, by name: the manager writes there the boot token of every
//! Machine booting from a Subnet of that namespace, one key per Machine),
//! watched on the API server and rebuilt into one
//! [`Snapshot`]. `status.dhcp.appliedRevision` is written only after the
//! table built from that revision is live.

use std::collections::BTreeMap;
use std::net::Ipv4Addr;
use std::sync::Arc;
use std::time::Duration;

use anneal_api::{DhcpMode, Machine, Subnet, error_chain};
use anneal_dhcp::{Cidr, Mac, MachineEntry, Mode};
use futures::StreamExt;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, ListParams, Patch, PatchParams};
use kube::runtime::watcher;

/// A Machine annotation: its agent boots with `anneal.debug=shell`.
pub const DEBUG_SHELL_ANNOTATION: &str = "anneal.dev/debug-shell";
use tokio_util::sync::CancellationToken;

use crate::config::{self, ConfigError, DhcpSpec, LeaseRange, StaticConfig, SubnetInput};
use crate::state::{BootToken, MachineBoot, Shared, Snapshot, Token};

pub use anneal_api::tenancy::{BOOT_TOKEN_KEY, BOOT_TOKEN_LABEL, BOOT_TOKENS_SECRET};
/// Field manager of bootd's status writes.
pub const FIELD_MANAGER: &str = "anneal-bootd";

/// Errors of building a table from the cluster.
#[derive(Debug, thiserror::Error)]
pub enum WatchError {
    #[error("api request")]
    Kube(#[from] kube::Error),
    #[error("subnet {0} has no boot half (spec.bootd and spec.dhcp)")]
    NoBootHalf(String),
    #[error("subnet field {field} is invalid: {value:?}")]
    BadField { field: &'static str, value: String },
    #[error("boot table")]
    Config(#[from] ConfigError),
}

/// What the watcher needs besides the cluster.
#[derive(Debug, Clone)]
pub struct WatchConfig {
    pub namespace: String,
    pub subnet: String,
    /// Artifacts, first-stage files, API URL and boot file names (the parts
    /// the Subnet does not carry); its subnet/dhcp/machines are ignored.
    pub base: StaticConfig,
    pub http_port: u16,
}

fn bad(field: &'static str, value: &str) -> WatchError {
    WatchError::BadField {
        field,
        value: value.to_owned(),
    }
}

/// Lowercase hex SHA-256 of a token (what `status.netBoot.tokenHash` holds).
pub fn token_hash(token: &Token) -> String {
    use sha2::Digest;
    hex::encode(sha2::Sha256::digest(token.expose().as_bytes()))
}

/// A Machine's token as bootd may serve it: unused only while the Secret's
/// token is the one whose hash `status.netBoot.tokenHash` records. The
/// manager removes that hash in the status write of a successful
/// registration, so from then on (and for a Secret left over from an
/// earlier boot, or none at all) the token is spent.
pub fn token_state(secret: Option<Token>, armed_hash: Option<&str>) -> BootToken {
    match (secret, armed_hash) {
        (Some(t), Some(h)) if anneal_api::agent::ct_eq(token_hash(&t).as_bytes(), h.as_bytes()) => {
            BootToken::Unused(t)
        }
        _ => BootToken::Spent,
    }
}

/// The field selector of the Machines a bootd of Subnet `name` reads: those
/// whose `spec.subnetRef.name` is `name` (a selectable field of the Machine
/// CRD), so a write to another Subnet's Machine reaches no other bootd.
/// Those naming a Subnet of that name in another namespace still come and
/// are dropped by [`anneal_api::tenancy::boot_mac_holders`].
pub fn machine_selector(subnet: &str) -> String {
    format!("spec.subnetRef.name={subnet}")
}

/// The boot tokens of Secret `anneal-boot-tokens` (key to token).
fn tokens_of(secret: Option<&Secret>) -> BTreeMap<String, Token> {
    secret
        .and_then(|s| s.data.as_ref())
        .map(|d| {
            d.iter()
                .filter_map(|(key, b)| {
                    Some((
                        key.clone(),
                        Token::new(String::from_utf8(b.0.clone()).ok()?),
                    ))
                })
                .collect()
        })
        .unwrap_or_default()
}

/// Reads the Subnet, its Machines (by [`machine_selector`]) and the tokens
/// once and builds the snapshot (start-up); see [`assemble`].
pub async fn build(
    client: &kube::Client,
    cfg: &WatchConfig,
) -> Result<(Snapshot, Option<String>, Option<String>), WatchError> {
    let subnets: Api<Subnet> = Api::namespaced(client.clone(), &cfg.namespace);
    let subnet = subnets.get(&cfg.subnet).await?;
    let machines: Api<Machine> = Api::all(client.clone());
    let listed = machines
        .list(&ListParams::default().fields(&machine_selector(&cfg.subnet)))
        .await?
        .items;
    // the boot tokens: one Secret of the Subnet's namespace, read by name
    // (bootd's Role allows no other Secret, and no list)
    let secrets: Api<Secret> = Api::namespaced(client.clone(), &cfg.namespace);
    let tokens = tokens_of(secrets.get_opt(BOOT_TOKENS_SECRET).await?.as_ref());
    assemble(cfg, &subnet, listed.iter(), &tokens)
}

/// Builds the snapshot from the Subnet, the Machines that may name it and
/// the boot tokens; returns it with the Subnet's `status.dhcp.revision`
/// (if any) and `appliedRevision`. No API call: the watch feeds it from its
/// caches, so a Machine write costs bootd no read.
pub fn assemble<'a>(
    cfg: &WatchConfig,
    subnet: &Subnet,
    listed: impl IntoIterator<Item = &'a Machine>,
    tokens: &BTreeMap<String, Token>,
) -> Result<(Snapshot, Option<String>, Option<String>), WatchError> {
    let key = format!("{}/{}", cfg.namespace, cfg.subnet);
    let (Some(bootd), Some(dhcp)) = (&subnet.spec.bootd, &subnet.spec.dhcp) else {
        return Err(WatchError::NoBootHalf(key));
    };
    let server_ip: Ipv4Addr = bootd
        .server_ip
        .parse()
        .map_err(|_| bad("spec.bootd.serverIP", &bootd.server_ip))?;
    let cidr: Cidr = subnet
        .spec
        .cidr
        .parse()
        .map_err(|_| bad("spec.cidr", &subnet.spec.cidr))?;
    let mut dns = Vec::new();
    for d in &dhcp.dns_servers {
        dns.push(d.parse().map_err(|_| bad("spec.dhcp.dnsServers", d))?);
    }
    let lease_range = match &dhcp.lease_range {
        Some(r) => Some(LeaseRange {
            start: r
                .start
                .parse()
                .map_err(|_| bad("spec.dhcp.leaseRange.start", &r.start))?,
            end: r
                .end
                .parse()
                .map_err(|_| bad("spec.dhcp.leaseRange.end", &r.end))?,
        }),
        None => None,
    };
    let status = subnet.status.as_ref().and_then(|s| s.dhcp.as_ref());
    let mut reserved: BTreeMap<Mac, Ipv4Addr> = BTreeMap::new();
    let mut reserved6: BTreeMap<Mac, std::net::Ipv6Addr> = BTreeMap::new();
    for r in status
        .map(|s| s.reservations.as_slice())
        .unwrap_or_default()
    {
        if let (Ok(mac), Ok(addr)) = (r.mac.parse::<Mac>(), r.address.parse::<Ipv4Addr>()) {
            reserved.insert(mac, addr);
            // the IPv6 address of the same entry (the manager writes it
            // when the Subnet has spec.ipv6)
            if let Some(a6) = r.ipv6_address.as_deref().and_then(|a| a.parse().ok()) {
                reserved6.insert(mac, a6);
            }
        }
    }
    let revision = status.and_then(|s| s.revision.clone());
    let applied = status.and_then(|s| s.applied_revision.clone());

    let mut entries = BTreeMap::new();
    let mut boots = BTreeMap::new();
    // One Machine per boot MAC: the first enrolled on this Subnet from a
    // namespace it grants (the manager's reservations follow the same
    // rule); a later Machine claiming the MAC, from any namespace, never
    // gets this MAC's answer, its token or its address.
    let holders = anneal_api::tenancy::boot_mac_holders(subnet, listed);
    for (mac, m) in holders {
        if m.metadata.deletion_timestamp.is_some() {
            continue;
        }
        let ns = m.metadata.namespace.clone().unwrap_or_default();
        let name = m.metadata.name.clone().unwrap_or_default();
        let token = tokens
            .get(&anneal_api::tenancy::boot_token_secret(
                &ns,
                &name,
                &cfg.namespace,
            ))
            .cloned();
        let armed = m
            .status
            .as_ref()
            .and_then(|s| s.net_boot.as_ref())
            .and_then(|n| n.token_hash.as_deref());
        let token = token_state(token, armed);
        let full = format!("{ns}/{name}");
        entries.insert(
            mac,
            MachineEntry {
                name: full.clone(),
                address: reserved.get(&mac).copied(),
                loader: m.spec.boot_loader,
            },
        );
        boots.insert(
            mac,
            MachineBoot {
                name: full,
                console: m.spec.console.clone(),
                token,
                chain_undionly: false,
                architecture: m.spec.architecture,
                ipv6_address: reserved6.get(&mac).copied(),
                // `anneal.dev/debug-shell`: the agent opens a shell on the
                // console when it fails instead of rebooting
                debug_shell: m
                    .metadata
                    .annotations
                    .as_ref()
                    .is_some_and(|a| a.contains_key(DEBUG_SHELL_ANNOTATION)),
            },
        );
    }
    let http_base = cfg
        .base
        .http_base
        .clone()
        .unwrap_or_else(|| format!("http://{server_ip}:{}", cfg.http_port));
    let input = SubnetInput {
        server_ip,
        cidr,
        dhcp: DhcpSpec {
            mode: match dhcp.mode {
                DhcpMode::Proxy => Mode::Proxy,
                DhcpMode::Lease => Mode::Lease,
            },
            gateway: dhcp.gateway.clone(),
            lease_time: Some(dhcp.lease_time.clone()),
            dns_servers: dns,
            lease_range,
        },
        answer_all: subnet.spec.answer_all,
        boot_files: cfg.base.boot_files.clone(),
        http_base,
        revision: String::new(),
    };
    let mut table = config::build_table(&input, entries)?;
    // the revision this table answers from: the Subnet's, or (proxy mode,
    // no reservation table) a digest of what bootd built
    table.revision = revision
        .clone()
        .unwrap_or_else(|| config::digest(&format!("{:?}", table.machines)));
    Ok((
        Snapshot {
            table,
            machines: boots,
            api: cfg.base.api.clone(),
            artifacts: cfg.base.artifacts.clone(),
            files: cfg.base.files.clone(),
        },
        revision,
        applied,
    ))
}

/// Rebuilds on every change of a Machine naming the Subnet, the Subnet or
/// Secret `anneal-boot-tokens` (and every 30 s), installs the table, then
/// writes `appliedRevision`. The three are watched into caches (reflector
/// stores) and the table assembled from them: a Machine write costs this
/// bootd one watch event, not a re-list of every Machine.
pub async fn run(
    client: kube::Client,
    cfg: WatchConfig,
    shared: Arc<Shared>,
    cancel: CancellationToken,
) {
    use kube::runtime::WatchStreamExt as _;
    use kube::runtime::reflector;
    let machines: Api<Machine> = Api::all(client.clone());
    let subnets: Api<Subnet> = Api::namespaced(client.clone(), &cfg.namespace);
    let secrets: Api<Secret> = Api::namespaced(client.clone(), &cfg.namespace);
    let (machine_store, mw) = reflector::store();
    let (subnet_store, sw) = reflector::store();
    let (token_store, tw) = reflector::store();
    let m = reflector(
        mw,
        watcher(
            machines,
            watcher::Config::default().fields(&machine_selector(&cfg.subnet)),
        ),
    )
    .default_backoff()
    .map(|_| ());
    let s = reflector(
        sw,
        watcher(
            subnets.clone(),
            watcher::Config::default().fields(&format!("metadata.name={}", cfg.subnet)),
        ),
    )
    .default_backoff()
    .map(|_| ());
    // by name: RBAC's resourceNames authorises a list or watch only with
    // this field selector
    let t = reflector(
        tw,
        watcher(
            secrets,
            watcher::Config::default().fields(&format!("metadata.name={BOOT_TOKENS_SECRET}")),
        ),
    )
    .default_backoff()
    .map(|_| ());
    let mut events = std::pin::pin!(futures::stream::select(futures::stream::select(m, s), t));
    // Nothing is assembled from a cache before its first full list: an
    // empty Machine cache would drop every reservation. The events are
    // polled meanwhile (that is what fills the caches).
    let ready = async {
        let _ = tokio::join!(
            machine_store.wait_until_ready(),
            subnet_store.wait_until_ready(),
            token_store.wait_until_ready()
        );
    };
    tokio::pin!(ready);
    loop {
        tokio::select! {
            () = cancel.cancelled() => return,
            () = &mut ready => break,
            e = events.next() => if e.is_none() { return },
        }
    }
    let mut tick = tokio::time::interval(Duration::from_secs(30));
    loop {
        tokio::select! {
            () = cancel.cancelled() => return,
            e = events.next() => if e.is_none() { return },
            _ = tick.tick() => {}
        }
        // coalesce a burst of events into one rebuild
        tokio::time::sleep(Duration::from_millis(20)).await;
        while let Some(Some(())) = futures::FutureExt::now_or_never(events.next()) {}
        let Some(subnet) = subnet_store.state().into_iter().next() else {
            tracing::warn!(subnet = %cfg.subnet, "subnet not found; keeping the live boot table");
            continue;
        };
        let listed = machine_store.state();
        let tokens = tokens_of(token_store.state().first().map(AsRef::as_ref));
        let built = assemble(&cfg, &subnet, listed.iter().map(AsRef::as_ref), &tokens);
        match built {
            Ok((snap, revision, applied)) => {
                let changed = {
                    let live = shared.snapshot();
                    live.table != snap.table || live.machines != snap.machines
                };
                if changed {
                    tracing::info!(revision = %snap.table.revision, machines = snap.table.machines.len(), "boot table live");
                    shared.install(snap);
                }
                // written only now: the table built from `revision` is live
                if let Some(rev) = revision
                    && applied.as_deref() != Some(rev.as_str())
                {
                    let patch = serde_json::json!({"status": {"dhcp": {"appliedRevision": rev}}});
                    match subnets
                        .patch_status(
                            &cfg.subnet,
                            &PatchParams::apply(FIELD_MANAGER),
                            &Patch::Merge(&patch),
                        )
                        .await
                    {
                        Ok(_) => tracing::info!(revision = %rev, "appliedRevision written"),
                        Err(e) => {
                            tracing::warn!(error = %error_chain(&e), "appliedRevision not written")
                        }
                    }
                }
            }
            Err(e) => {
                tracing::warn!(error = %error_chain(&e), "boot table not rebuilt; keeping the live one")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// A token is unused only while `status.netBoot.tokenHash` is its hash:
    /// the registration removes the hash, a re-arm replaces it.
    #[test]
    fn token_state_follows_the_armed_hash() {
        let t = || Token::new("ab".repeat(32));
        let armed = token_hash(&t());
        assert_eq!(armed.len(), 64);
        assert!(
            armed
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        );
        assert_eq!(token_state(Some(t()), Some(&armed)), BootToken::Unused(t()));
        // registered: the hash left status (the Secret may linger a moment)
        assert_eq!(token_state(Some(t()), None), BootToken::Spent);
        // a Secret of an earlier boot, a newer hash
        assert_eq!(
            token_state(Some(t()), Some(&token_hash(&Token::new("cd".repeat(32))))),
            BootToken::Spent
        );
        // no Secret at all
        assert_eq!(token_state(None, Some(&armed)), BootToken::Spent);
        assert_eq!(token_state(None, None), BootToken::Spent);
    }
}
