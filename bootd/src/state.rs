//! What bootd serves from: one snapshot of the boot table, swapped whole.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, RwLock};

use anneal_dhcp::{BootTable, Leases, Mac};
use tokio::sync::{Notify, watch};

use crate::config::{ApiSpec, Artifacts};
use crate::durable::{Commit, LeaseLog};
use crate::metrics::Metrics;

/// A boot token: zeroized on drop, never printed.
#[derive(Clone, PartialEq, Eq, zeroize::ZeroizeOnDrop)]
pub struct Token(String);

impl Token {
    /// Wraps a plaintext token.
    pub fn new(s: String) -> Token {
        Token(s)
    }

    /// The plaintext, for the per-boot token cpio only.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Token(<redacted>)")
    }
}

/// Where a machine's boot token stands, as far as bootd knows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BootToken {
    /// No token configured (a static lab table without one): the script is
    /// served without a token.
    None,
    /// A token no agent registered with yet: served in the token cpio.
    Unused(Token),
    /// The cluster holds no unused token for the machine: its agent
    /// registered (the hash left `status.netBoot`), or no boot is armed.
    /// Neither the script nor the token is served.
    Spent,
}

impl BootToken {
    /// The unused token, if any.
    pub fn unused(&self) -> Option<&Token> {
        match self {
            BootToken::Unused(t) => Some(t),
            BootToken::None | BootToken::Spent => None,
        }
    }
}

/// Per-machine facts the HTTP side needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MachineBoot {
    /// `namespace/name`.
    pub name: String,
    pub console: Vec<String>,
    pub token: BootToken,
    pub chain_undionly: bool,
    pub debug_shell: bool,
    /// Which kernel and initramfs it boots (`spec.architecture`).
    pub architecture: crate::config::Architecture,
    /// Its IPv6 reservation (`ipv6Address` of its entry in
    /// `status.dhcp.reservations`): what DHCPv6 hands it in lease mode.
    pub ipv6_address: Option<std::net::Ipv6Addr>,
}

/// One consistent view of a Subnet's boot table.
#[derive(Debug, Clone)]
pub struct Snapshot {
    pub table: BootTable,
    pub machines: BTreeMap<Mac, MachineBoot>,
    pub api: ApiSpec,
    pub artifacts: Option<Artifacts>,
    pub files: BTreeMap<String, PathBuf>,
}

/// State shared by every server task.
#[derive(Debug)]
pub struct Shared {
    snapshot: RwLock<Arc<Snapshot>>,
    pub leases: Mutex<Leases>,
    pub metrics: Metrics,
    /// Woken when leases changed and must be persisted.
    pub lease_dirty: Notify,
    /// The revision that is live (answers come from it).
    pub live_revision: watch::Sender<String>,
    /// The boot script template.
    pub template: String,
    /// The lease file, when there is one (see [`Shared::commit_leases`]).
    pub lease_log: Option<LeaseLog>,
    /// DHCPv6 leases (in memory): the boot script gate accepts the IPv6
    /// address leased to a MAC as it accepts the IPv4 one.
    pub leases6: Mutex<anneal_dhcp::v6::Leases6>,
    /// bootd's HTTP base on its IPv6 address (`http://[addr]:port`), once
    /// DHCPv6 serves: the URLs of a script fetched over IPv6.
    pub http_base6: std::sync::OnceLock<String>,
    /// Proxy mode: the host that did the last PXE exchange of each
    /// enrolled MAC ([`Shared::record_pxe_exchange`],
    /// [`Shared::bind_pxe_host`]).
    pxe_hosts: Mutex<HashMap<Mac, Option<IpAddr>>>,
}

/// Why [`Shared::bind_pxe_host`] refused an address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PxeHostRefusal {
    /// This bootd answered no PXE exchange for the MAC (since it started).
    NoExchange,
    /// Another host did the exchange (or fetched first after it).
    Other(IpAddr),
}

impl Shared {
    pub fn new(snapshot: Snapshot, leases: Leases, template: String) -> Shared {
        let rev = snapshot.table.revision.clone();
        Shared {
            snapshot: RwLock::new(Arc::new(snapshot)),
            leases: Mutex::new(leases),
            metrics: Metrics::default(),
            lease_dirty: Notify::new(),
            live_revision: watch::Sender::new(rev),
            template,
            lease_log: None,
            leases6: Mutex::new(anneal_dhcp::v6::Leases6::default()),
            http_base6: std::sync::OnceLock::new(),
            pxe_hosts: Mutex::new(HashMap::new()),
        }
    }

    /// Proxy mode: bootd answered a PXE exchange (a proxyDHCP OFFER or
    /// ACK, a port 4011 ACK, a DHCPv6 proxy answer) for `mac`. `host` is
    /// the client's address when the exchange named one (the source of a
    /// datagram sent from an address, or its `ciaddr` through a relay);
    /// `None` for a client without one yet (a DISCOVER from 0.0.0.0,
    /// DHCPv6 from a link-local address): then the first address to fetch
    /// the MAC's script or token is bound ([`Shared::bind_pxe_host`]). A
    /// new exchange replaces the previous binding (a rebooted machine may
    /// hold another address). Kept for enrolled MACs only (one entry per
    /// Machine at most).
    pub fn record_pxe_exchange(&self, mac: Mac, host: Option<IpAddr>) {
        let snap = self.snapshot();
        if !snap.machines.contains_key(&mac) {
            return;
        }
        let mut hosts = self
            .pxe_hosts
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        // a new MAC with the map as large as the table: some entry is a MAC
        // that left it, and those go
        if !hosts.contains_key(&mac) && hosts.len() >= snap.machines.len() {
            hosts.retain(|m, _| snap.machines.contains_key(m));
        }
        hosts.insert(mac, host.map(|h| h.to_canonical()));
    }

    /// Proxy mode's gate on a MAC's unused token (docs/api.md, Boot token delivery): `peer` may
    /// fetch it only if it is the host of the MAC's last PXE exchange, or
    /// the exchange named no address and `peer` is the first to ask after
    /// it (it is then bound: every other address is refused until the next
    /// exchange).
    pub fn bind_pxe_host(&self, mac: Mac, peer: IpAddr) -> Result<(), PxeHostRefusal> {
        let peer = peer.to_canonical();
        let mut hosts = self
            .pxe_hosts
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        match hosts.get_mut(&mac) {
            None => Err(PxeHostRefusal::NoExchange),
            Some(Some(h)) if *h == peer => Ok(()),
            Some(Some(h)) => Err(PxeHostRefusal::Other(*h)),
            Some(bound @ None) => {
                *bound = Some(peer);
                tracing::info!(%mac, host = %peer, "boot token bound to the first host asking after the PXE exchange");
                Ok(())
            }
        }
    }

    /// With a lease file: ACKs then leave only once their lease is written.
    pub fn with_lease_log(mut self, log: Option<LeaseLog>) -> Shared {
        self.lease_log = log;
        self
    }

    /// Writes every lease change made so far to the lease file (blocking
    /// I/O; see [`LeaseLog::commit`]). Without a lease file leases live in
    /// memory by configuration: [`Commit::Durable`].
    pub fn commit_leases(&self) -> Commit {
        match &self.lease_log {
            Some(log) => log.commit(&self.leases, &self.metrics),
            None => Commit::Durable,
        }
    }

    /// The current snapshot.
    pub fn snapshot(&self) -> Arc<Snapshot> {
        match self.snapshot.read() {
            Ok(g) => g.clone(),
            Err(p) => p.into_inner().clone(),
        }
    }

    /// Locks the leases (a poisoned lock still holds consistent data: every
    /// mutation is a single map operation).
    pub fn leases(&self) -> std::sync::MutexGuard<'_, Leases> {
        match self.leases.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }

    /// Collects the leases expired at `now` (see
    /// [`Leases::collect_expired`]), counts them in
    /// `bootd_dhcp_leases_collected_total`, wakes the persister when any
    /// went, and sets `bootd_dhcp_leases_active`. Returns how many went.
    pub fn collect_leases(&self, now: u64) -> usize {
        let (gone, active) = {
            let mut leases = self.leases();
            let gone = leases.collect_expired(now);
            (gone, leases.active())
        };
        self.metrics
            .leases_active
            .set(i64::try_from(active).unwrap_or(i64::MAX));
        if !gone.is_empty() {
            self.metrics.leases_collected.inc_by(gone.len() as u64);
            for l in &gone {
                tracing::debug!(mac = %l.mac, address = %l.address, expires = l.expires, "expired lease collected");
            }
            tracing::info!(collected = gone.len(), active, "expired leases collected");
            self.lease_dirty.notify_one();
        }
        gone.len()
    }

    /// Makes `snap` live. Leases of MACs that left the allowlist (or whose
    /// reservation moved) are released at once. Returns the released MACs.
    pub fn install(&self, snap: Snapshot) -> Vec<Mac> {
        let rev = snap.table.revision.clone();
        let released = {
            let mut leases = self.leases();
            let gone = filter_leases(&mut leases, &snap.table);
            gone.into_iter().map(|l| l.mac).collect::<Vec<_>>()
        };
        {
            let mut g = match self.snapshot.write() {
                Ok(g) => g,
                Err(p) => p.into_inner(),
            };
            *g = Arc::new(snap);
        }
        for mac in &released {
            tracing::info!(%mac, "released lease: mac left the allowlist or its reservation changed");
        }
        if !released.is_empty() {
            self.lease_dirty.notify_one();
        }
        self.live_revision.send_replace(rev);
        released
    }
}

/// Drops leases the table no longer allows: MAC not enrolled (unless the
/// Subnet answers all), or a reservation that names another address.
pub fn filter_leases(leases: &mut Leases, table: &BootTable) -> Vec<anneal_dhcp::Lease> {
    leases.retain(|l| match table.machines.get(&l.mac) {
        Some(m) => m.address.is_none_or(|a| a == l.address) && table.cidr.contains(l.address),
        None => table.answer_all && table.cidr.contains(l.address),
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use std::net::Ipv4Addr;

    use anneal_dhcp::Lease;
    use futures::FutureExt;

    use super::*;

    /// Expired leases are removed, counted, reported and persisted; the
    /// active gauge then counts only unexpired ones.
    #[test]
    fn expired_leases_are_collected_counted_and_persisted() {
        let snap = crate::StaticConfig::from_yaml(
            "serverIP: 10.77.0.2\ncidr: 10.77.0.0/24\ndhcp: {mode: lease, gateway: \"\"}\n",
        )
        .unwrap()
        .snapshot(8080, "t".into())
        .unwrap();
        let lease = |i: u8, expires| Lease {
            mac: Mac([2, 0, 0, 0, 0, i]),
            address: Ipv4Addr::new(10, 77, 0, i),
            expires,
        };
        let mut leases = Leases::from_leases([lease(1, 100), lease(2, 200), lease(3, 300)]);
        leases.track_changes();
        let shared = Shared::new(snap, leases, String::new());
        assert_eq!(shared.collect_leases(50), 0);
        assert!(shared.lease_dirty.notified().now_or_never().is_none());
        assert_eq!(shared.collect_leases(200), 2);
        assert!(
            shared.lease_dirty.notified().now_or_never().is_some(),
            "the persister is woken"
        );
        let changes = shared.leases().take_changes();
        assert_eq!(
            changes,
            vec![
                (Mac([2, 0, 0, 0, 0, 1]), None),
                (Mac([2, 0, 0, 0, 0, 2]), None)
            ]
        );
        let text = shared.metrics.render();
        assert!(
            text.contains("bootd_dhcp_leases_collected_total 2"),
            "{text}"
        );
        assert!(text.contains("bootd_dhcp_leases_active 1"), "{text}");
        assert_eq!(shared.leases().active(), 1);
    }
}
