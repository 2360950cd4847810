//! In-memory lease state (pure; the shell persists it).

use std::collections::{BTreeMap, BTreeSet};
use std::net::Ipv4Addr;

use crate::Mac;

/// How long an address a client declined (found in use) is withheld, seconds.
pub const DECLINE_HOLD_SECS: u64 = 600;

/// One lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Lease {
    pub mac: Mac,
    pub address: Ipv4Addr,
    /// Unix seconds.
    pub expires: u64,
}

/// A change to the lease state decided for one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseEffect {
    /// ACK: the client holds `lease`.
    Bind(Lease),
    /// RELEASE: the client gave the address back.
    Release { mac: Mac, address: Ipv4Addr },
    /// DECLINE: the address is in use by someone else.
    Decline { mac: Mac, address: Ipv4Addr },
}

/// All leases of one Subnet, plus declined addresses.
#[derive(Debug, Clone, Default)]
pub struct Leases {
    by_mac: BTreeMap<Mac, Lease>,
    /// Index of `by_mac` by address (every MAC with a lease on it, expired
    /// or not), so that `holder` is not a scan of every lease.
    by_addr: BTreeMap<Ipv4Addr, BTreeSet<Mac>>,
    /// Index of `by_mac` by expiry, so that `collect_expired` removes the
    /// expired leases in O(expired · log n), never a scan of all.
    by_expiry: BTreeSet<(u64, Mac)>,
    /// The keys of `by_addr` as maximal runs of consecutive addresses
    /// (first → last, inclusive), so that the next address nobody holds
    /// is found in O(log n) however full the pool is.
    runs: BTreeMap<u32, u32>,
    declined: BTreeMap<Ipv4Addr, u64>,
    /// MACs whose lease was set or removed since the last `take_changes`,
    /// while change tracking is on (`None`: off), so that a persister
    /// writes only what changed.
    changed: Option<BTreeSet<Mac>>,
}

/// Equal leases and declined addresses (change tracking is not content).
impl PartialEq for Leases {
    fn eq(&self, other: &Self) -> bool {
        self.by_mac == other.by_mac && self.declined == other.declined
    }
}

impl Eq for Leases {}

impl Leases {
    /// From persisted leases (later duplicates for one MAC win).
    pub fn from_leases(iter: impl IntoIterator<Item = Lease>) -> Self {
        let mut leases = Leases::default();
        for l in iter {
            leases.insert(l);
        }
        leases
    }

    fn insert(&mut self, l: Lease) {
        if let Some(old) = self.by_mac.insert(l.mac, l) {
            self.unindex(&old);
        }
        let macs = self.by_addr.entry(l.address).or_default();
        let new = macs.is_empty();
        macs.insert(l.mac);
        if new {
            self.run_add(u32::from(l.address));
        }
        self.by_expiry.insert((l.expires, l.mac));
        self.mark(l.mac);
    }

    fn mark(&mut self, mac: Mac) {
        if let Some(c) = &mut self.changed {
            c.insert(mac);
        }
    }

    /// Starts recording which MACs change (see [`Leases::take_changes`]).
    pub fn track_changes(&mut self) {
        self.changed.get_or_insert_with(BTreeSet::new);
    }

    /// The MACs changed since the last call, each with its lease now
    /// (`None`: removed), in MAC order; empty while tracking is off.
    /// Costs O(changes), not O(leases).
    pub fn take_changes(&mut self) -> Vec<(Mac, Option<Lease>)> {
        let Some(c) = &mut self.changed else {
            return Vec::new();
        };
        std::mem::take(c)
            .into_iter()
            .map(|m| (m, self.by_mac.get(&m).copied()))
            .collect()
    }

    fn unindex(&mut self, l: &Lease) {
        self.by_expiry.remove(&(l.expires, l.mac));
        if let Some(macs) = self.by_addr.get_mut(&l.address) {
            macs.remove(&l.mac);
            if macs.is_empty() {
                self.by_addr.remove(&l.address);
                self.run_remove(u32::from(l.address));
            }
        }
    }

    /// `a` became held: joins the runs ending just below and starting
    /// just above it.
    fn run_add(&mut self, a: u32) {
        let mut first = a;
        if let Some((&s, &e)) = self.runs.range(..a).next_back()
            && e.checked_add(1) == Some(a)
        {
            first = s;
        }
        let mut last = a;
        if let Some(next) = a.checked_add(1)
            && let Some(e) = self.runs.remove(&next)
        {
            last = e;
        }
        self.runs.insert(first, last);
    }

    /// `a` is no longer held: splits the run holding it.
    fn run_remove(&mut self, a: u32) {
        let Some((&s, &e)) = self.runs.range(..=a).next_back() else {
            return;
        };
        if e < a {
            return;
        }
        self.runs.remove(&s);
        if s < a {
            self.runs.insert(s, a - 1);
        }
        if a < e {
            self.runs.insert(a + 1, e);
        }
    }

    /// The first address in `from..=to` that no lease is on, expired or
    /// not. O(log n).
    pub fn next_unheld(&self, from: Ipv4Addr, to: Ipv4Addr) -> Option<Ipv4Addr> {
        let f = u32::from(from);
        let c = match self.runs.range(..=f).next_back() {
            Some((_, &e)) if e >= f => e.checked_add(1)?,
            _ => f,
        };
        (c <= u32::from(to)).then(|| Ipv4Addr::from(c))
    }

    /// The leases expired at `now` (`expires <= now`) and not yet
    /// collected, the longest expired first.
    pub fn expired(&self, now: u64) -> impl Iterator<Item = &Lease> {
        self.by_expiry
            .iter()
            .take_while(move |(e, _)| *e <= now)
            .filter_map(|(_, m)| self.by_mac.get(m))
    }

    fn remove_mac(&mut self, mac: &Mac) -> Option<Lease> {
        let l = self.by_mac.remove(mac)?;
        self.unindex(&l);
        self.mark(l.mac);
        Some(l)
    }

    /// The lease of `mac`, expired or not.
    pub fn get(&self, mac: &Mac) -> Option<&Lease> {
        self.by_mac.get(mac)
    }

    /// Which MAC holds `addr` with an unexpired lease.
    pub fn holder(&self, addr: Ipv4Addr, now: u64) -> Option<Mac> {
        // the first such MAC in MAC order, as a scan of `by_mac` would find
        self.by_addr
            .get(&addr)?
            .iter()
            .find(|m| self.by_mac.get(m).is_some_and(|l| l.expires > now))
            .copied()
    }

    /// True while a DECLINE withholds `addr`.
    pub fn is_declined(&self, addr: Ipv4Addr, now: u64) -> bool {
        self.declined.get(&addr).is_some_and(|&until| until > now)
    }

    /// Applies one effect.
    pub fn apply(&mut self, effect: LeaseEffect, now: u64) {
        match effect {
            LeaseEffect::Bind(l) => self.insert(l),
            LeaseEffect::Release { mac, address } => {
                if self.by_mac.get(&mac).is_some_and(|l| l.address == address) {
                    self.remove_mac(&mac);
                }
            }
            LeaseEffect::Decline { mac, address } => {
                if self.by_mac.get(&mac).is_some_and(|l| l.address == address) {
                    self.remove_mac(&mac);
                }
                self.declined.insert(address, now + DECLINE_HOLD_SECS);
            }
        }
        self.declined.retain(|_, until| *until > now);
    }

    /// Removes a MAC's lease (active release); returns it.
    pub fn remove(&mut self, mac: &Mac) -> Option<Lease> {
        self.remove_mac(mac)
    }

    /// Keeps only leases for which `keep` holds; returns the removed ones.
    pub fn retain(&mut self, mut keep: impl FnMut(&Lease) -> bool) -> Vec<Lease> {
        let mut gone = Vec::new();
        self.by_mac.retain(|_, l| {
            let k = keep(l);
            if !k {
                gone.push(*l);
            }
            k
        });
        for l in &gone {
            self.unindex(l);
            self.mark(l.mac);
        }
        gone
    }

    /// Removes every lease expired at `now` (`expires <= now`) and every
    /// DECLINE hold that ended; returns the removed leases (marked changed,
    /// so the persister deletes them). Costs O(expired · log n): the
    /// leases are indexed by expiry. bootd calls it on a timer and before
    /// it reports [`Leases::active`].
    pub fn collect_expired(&mut self, now: u64) -> Vec<Lease> {
        let mut gone = Vec::new();
        while let Some(&(expires, mac)) = self.by_expiry.first()
            && expires <= now
        {
            match self.remove_mac(&mac) {
                Some(l) => gone.push(l),
                // an index entry without its lease: drop it, never loop
                None => {
                    self.by_expiry.remove(&(expires, mac));
                }
            }
        }
        self.declined.retain(|_, until| *until > now);
        gone
    }

    /// Number of leases held: O(1), the map's length kept by every insert
    /// and removal. Unexpired leases only once [`Leases::collect_expired`]
    /// ran for the current time.
    pub fn active(&self) -> usize {
        self.by_mac.len()
    }

    /// All leases, by MAC.
    pub fn iter(&self) -> impl Iterator<Item = &Lease> {
        self.by_mac.values()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bind_release_decline() {
        let a = Mac([2, 0, 0, 0, 0, 1]);
        let ip = Ipv4Addr::new(10, 0, 0, 5);
        let mut l = Leases::default();
        l.apply(
            LeaseEffect::Bind(Lease {
                mac: a,
                address: ip,
                expires: 100,
            }),
            0,
        );
        assert_eq!(l.holder(ip, 50), Some(a));
        assert_eq!(l.holder(ip, 100), None);
        assert_eq!(l.active(), 1);
        // release for another address is ignored
        l.apply(
            LeaseEffect::Release {
                mac: a,
                address: Ipv4Addr::new(10, 0, 0, 6),
            },
            1,
        );
        assert!(l.get(&a).is_some());
        l.apply(
            LeaseEffect::Decline {
                mac: a,
                address: ip,
            },
            10,
        );
        assert!(l.get(&a).is_none());
        assert!(l.is_declined(ip, 10 + DECLINE_HOLD_SECS - 1));
        assert!(!l.is_declined(ip, 10 + DECLINE_HOLD_SECS));
    }

    /// Tracked changes name exactly the MACs set or removed, with their
    /// lease now; nothing is recorded while tracking is off.
    #[test]
    fn changes_are_tracked() {
        let (a, b, c) = (
            Mac([2, 0, 0, 0, 0, 1]),
            Mac([2, 0, 0, 0, 0, 2]),
            Mac([2, 0, 0, 0, 0, 3]),
        );
        let lease = |mac, last, expires| Lease {
            mac,
            address: Ipv4Addr::new(10, 0, 0, last),
            expires,
        };
        let mut l = Leases::from_leases([lease(a, 1, 100), lease(b, 2, 100)]);
        assert!(l.take_changes().is_empty());
        l.track_changes();
        assert!(l.take_changes().is_empty());
        l.apply(LeaseEffect::Bind(lease(c, 3, 200)), 0);
        l.apply(LeaseEffect::Bind(lease(c, 3, 300)), 0);
        l.apply(
            LeaseEffect::Release {
                mac: a,
                address: Ipv4Addr::new(10, 0, 0, 1),
            },
            0,
        );
        // a release for another address changes nothing
        l.apply(
            LeaseEffect::Release {
                mac: b,
                address: Ipv4Addr::new(10, 0, 0, 9),
            },
            0,
        );
        assert_eq!(
            l.take_changes(),
            vec![(a, None), (c, Some(lease(c, 3, 300)))]
        );
        assert!(l.take_changes().is_empty());
        l.retain(|x| x.mac != b);
        assert_eq!(l.remove(&c), Some(lease(c, 3, 300)));
        assert_eq!(l.take_changes(), vec![(b, None), (c, None)]);
    }

    /// `holder` through the address index answers as a scan of every lease.
    #[test]
    fn holder_index_matches_a_scan() {
        let scan = |l: &Leases, a: Ipv4Addr, now: u64| {
            l.iter()
                .find(|x| x.address == a && x.expires > now)
                .map(|x| x.mac)
        };
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = |n: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % n
        };
        let mac = |i: u64| Mac([2, 0, 0, 0, 0, i as u8]);
        let ip = |i: u64| Ipv4Addr::new(10, 0, 0, i as u8);
        let mut l = Leases::from_leases([
            Lease {
                mac: mac(1),
                address: ip(1),
                expires: 50,
            },
            Lease {
                mac: mac(2),
                address: ip(1),
                expires: 80,
            },
            Lease {
                mac: mac(1),
                address: ip(2),
                expires: 90,
            },
        ]);
        for step in 0..5000u64 {
            let (m, a, t) = (mac(next(12)), ip(next(8)), next(200));
            match next(5) {
                0 | 1 => l.apply(
                    LeaseEffect::Bind(Lease {
                        mac: m,
                        address: a,
                        expires: t,
                    }),
                    step,
                ),
                2 => l.apply(LeaseEffect::Release { mac: m, address: a }, step),
                3 => {
                    l.remove(&m);
                }
                _ => {
                    l.retain(|x| x.expires > t);
                }
            }
            for i in 0..8 {
                for now in [0, 60, 120, 199] {
                    assert_eq!(l.holder(ip(i), now), scan(&l, ip(i), now), "step {step}");
                }
            }
            let indexed: usize = l.by_addr.values().map(BTreeSet::len).sum();
            assert_eq!(indexed, l.by_mac.len(), "step {step}");
            // the runs index finds what a scan of the held addresses finds
            for from in 0..9 {
                for to in from..9 {
                    let want = (from..=to)
                        .map(ip)
                        .find(|a| !l.by_mac.values().any(|x| x.address == *a));
                    assert_eq!(
                        l.next_unheld(ip(from), ip(to)),
                        want,
                        "step {step}: {from}..={to}"
                    );
                }
            }
        }
    }

    /// The runs index at the ends of the address space, and merging and
    /// splitting runs.
    #[test]
    fn runs_merge_split_and_end_at_the_last_address() {
        let at = |a: u32, i: u8| Lease {
            mac: Mac([2, 0, 0, 0, 1, i]),
            address: Ipv4Addr::from(a),
            expires: 100,
        };
        let mut l =
            Leases::from_leases([at(u32::MAX, 1), at(u32::MAX - 2, 2), at(u32::MAX - 1, 3)]);
        assert_eq!(l.runs.len(), 1);
        assert_eq!(
            l.next_unheld(Ipv4Addr::from(u32::MAX - 2), Ipv4Addr::BROADCAST),
            None
        );
        l.remove(&Mac([2, 0, 0, 0, 1, 3]));
        assert_eq!(l.runs.len(), 2);
        assert_eq!(
            l.next_unheld(Ipv4Addr::from(u32::MAX - 2), Ipv4Addr::BROADCAST),
            Some(Ipv4Addr::from(u32::MAX - 1))
        );
        let mut z = Leases::from_leases([at(0, 4)]);
        assert_eq!(
            z.next_unheld(Ipv4Addr::UNSPECIFIED, Ipv4Addr::UNSPECIFIED),
            None
        );
        assert_eq!(
            z.next_unheld(Ipv4Addr::UNSPECIFIED, Ipv4Addr::from(1)),
            Some(Ipv4Addr::from(1))
        );
        z.remove(&Mac([2, 0, 0, 0, 1, 4]));
        assert!(z.runs.is_empty());
    }

    /// Expired leases are collected (and recorded as removed), unexpired
    /// ones and their index stay; `active` then counts exactly the
    /// unexpired leases, as a scan would.
    #[test]
    fn expired_leases_are_collected() {
        let lease = |i: u8, expires| Lease {
            mac: Mac([2, 0, 0, 0, 0, i]),
            address: Ipv4Addr::new(10, 0, 0, i),
            expires,
        };
        let mut l = Leases::from_leases((1..=100).map(|i| lease(i, u64::from(i) * 10)));
        l.track_changes();
        // a renewal moves a lease's expiry: its old index entry must go
        l.apply(LeaseEffect::Bind(lease(3, 5000)), 0);
        l.apply(
            LeaseEffect::Decline {
                mac: Mac([2, 0, 0, 0, 0, 1]),
                address: Ipv4Addr::new(10, 0, 0, 200),
            },
            0,
        );
        l.take_changes();
        assert_eq!(l.active(), 100);
        let gone = l.collect_expired(500);
        // leases 1..=50 expired at 10..=500, except 3 (renewed)
        assert_eq!(gone.len(), 49);
        assert!(gone.iter().all(|g| g.expires <= 500));
        let scan = l.iter().filter(|x| x.expires > 500).count();
        assert_eq!(l.active(), scan);
        assert_eq!(l.active(), 51);
        assert_eq!(
            l.holder(Ipv4Addr::new(10, 0, 0, 3), 500),
            Some(Mac([2, 0, 0, 0, 0, 3]))
        );
        assert_eq!(
            l.holder(Ipv4Addr::new(10, 0, 0, 51), 500),
            Some(Mac([2, 0, 0, 0, 0, 51]))
        );
        assert!(l.get(&Mac([2, 0, 0, 0, 0, 50])).is_none());
        let changes = l.take_changes();
        assert_eq!(changes.len(), 49);
        assert!(changes.iter().all(|(_, now)| now.is_none()));
        // the decline hold ends with its time
        assert!(l.is_declined(Ipv4Addr::new(10, 0, 0, 200), 500));
        // leases 51..=60 expire at 510..=600
        assert_eq!(l.collect_expired(DECLINE_HOLD_SECS).len(), 10);
        assert!(l.declined.is_empty());
        // nothing left to collect: a second pass removes nothing
        assert!(l.collect_expired(DECLINE_HOLD_SECS).is_empty());
        assert_eq!(l.active(), l.by_expiry.len());
        l.collect_expired(u64::MAX);
        assert_eq!(l.active(), 0);
        assert!(l.by_addr.is_empty() && l.by_expiry.is_empty());
    }
}
