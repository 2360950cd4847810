//! Rarest-first piece selection (added by anneal, opt-in through
//! `AddTorrentOptions::rarest_first`; see NOTICE.anneal).
//!
//! Stock librqbit hands out queued pieces in file order (the first and last
//! piece of each file, then sequentially). When many leechers start together
//! from one seed, they all ask for the same pieces, hold the same pieces, and
//! have little to trade: the seed's upload is the bottleneck. With
//! rarest-first, each leecher takes the queued piece that the fewest connected
//! peers have, ties broken at random, so the swarm spreads distinct pieces
//! early and peers upload to each other (BEP 3 "rarest first").
//!
//! [`Availability`] keeps, for every piece, how many connected peers have it:
//! a peer's bitfield is added when it arrives, a HAVE increments one piece,
//! and a peer's whole bitfield is subtracted when it goes away.
//! [`choose_rarest`] picks among candidates.

/// Per-piece count of connected peers that have the piece.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Availability {
    counts: Vec<u32>,
}

impl Availability {
    /// A torrent of `pieces` pieces that no peer has yet.
    pub fn new(pieces: usize) -> Self {
        Self {
            counts: vec![0; pieces],
        }
    }

    /// Number of pieces tracked.
    pub fn len(&self) -> usize {
        self.counts.len()
    }

    /// True when the torrent has no pieces.
    pub fn is_empty(&self) -> bool {
        self.counts.is_empty()
    }

    /// How many connected peers have `piece` (0 for an index out of range).
    pub fn get(&self, piece: usize) -> u32 {
        self.counts.get(piece).copied().unwrap_or(0)
    }

    /// A peer announced `piece` (HAVE). Out-of-range indices are ignored.
    pub fn add_piece(&mut self, piece: usize) {
        if let Some(c) = self.counts.get_mut(piece) {
            *c = c.saturating_add(1);
        }
    }

    /// A peer with these pieces connected (its bitfield). Indices past the
    /// torrent's last piece (a bitfield's spare bits) are ignored.
    pub fn add_peer(&mut self, pieces: impl IntoIterator<Item = usize>) {
        for p in pieces {
            self.add_piece(p);
        }
    }

    /// A peer with these pieces went away. Counts never go below zero, so a
    /// peer that is removed without having been added cannot corrupt others'.
    pub fn remove_peer(&mut self, pieces: impl IntoIterator<Item = usize>) {
        for p in pieces {
            if let Some(c) = self.counts.get_mut(p) {
                *c = c.saturating_sub(1);
            }
        }
    }

    /// A peer's bitfield was replaced (a second BITFIELD message): `old` is
    /// subtracted, `new` added.
    pub fn replace_peer(
        &mut self,
        old: impl IntoIterator<Item = usize>,
        new: impl IntoIterator<Item = usize>,
    ) {
        self.remove_peer(old);
        self.add_peer(new);
    }
}

/// Whether a connection to a seeder (a peer with every piece) may be asked
/// for `piece`: only when no other peer has it, that is when its
/// availability is no more than the number of connected seeders. What a
/// leecher holds is fetched from that leecher, so each piece leaves the
/// seeders about once instead of once per machine (their upload is the
/// swarm's bottleneck when every machine starts empty).
pub fn seeder_may_serve(availability: &Availability, piece: usize, live_seeders: u32) -> bool {
    availability.get(piece) <= live_seeders
}

/// anneal: this leecher's share of what the seeders send (opt in with
/// `AddTorrentOptions::seeder_stripes`, on top of rarest-first). The
/// leechers connected to each other rank themselves by peer id; the one of
/// rank `index` among `count` asks the seeders only for the pieces `p` with
/// `p % count == index`, and gets the others from the leechers that hold
/// them. Every leecher computes the same split from the same set of ids, so
/// each piece leaves the seeders once instead of once per leecher that
/// happened to want it while its holder was still receiving it. A leecher
/// that leaves (or finishes and becomes a seeder) drops out of the ranking
/// and the split is recomputed, so no piece is left without a leecher to
/// fetch it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stripe {
    /// This leecher's rank.
    pub index: usize,
    /// Number of leechers in the split (this one included).
    pub count: usize,
}

impl Stripe {
    /// The stripe of the leecher `own` among itself and the connected
    /// leechers `others` (their peer ids; duplicates and `own` ignored).
    pub fn of<'a>(own: &'a [u8; 20], others: impl IntoIterator<Item = &'a [u8; 20]>) -> Self {
        let mut ids: Vec<&[u8; 20]> = others.into_iter().filter(|id| *id != own).collect();
        ids.sort_unstable();
        ids.dedup();
        let index = ids.iter().filter(|id| **id < own).count();
        Self {
            index,
            count: ids.len() + 1,
        }
    }

    /// Whether `piece` is this leecher's to fetch from the seeders.
    pub fn contains(&self, piece: usize) -> bool {
        self.count <= 1 || piece % self.count == self.index
    }

    /// anneal: whether this leecher, done with its own stripe, may ask the
    /// seeders for `piece` of another stripe: the `k`-th piece (`piece /
    /// count`) of stripe `s` is helped by the leecher of rank `(s + k) %
    /// count` (none when that is `s`, its owner), so two helpers never ask
    /// for the same piece, and the last pieces of the stripes, which lag
    /// the most, have as many different helpers as there are leechers.
    pub fn helps_with(&self, piece: usize) -> bool {
        let count = self.count.max(1);
        !self.contains(piece) && (piece % count + piece / count) % count == self.index
    }

    /// The pieces of the stripe among `total`.
    pub fn pieces(&self, total: usize) -> impl Iterator<Item = usize> {
        (self.index.min(total)..total).step_by(self.count.max(1))
    }
}

/// anneal: the piece a leecher of `stripe` asks a seeder for, among
/// `candidates` (queued pieces the seeder has and no leecher has):
/// - the lowest piece of its own stripe: a stripe is fetched in order, so
///   the pieces its owner has in flight are the lowest of what is left;
/// - when none is left to ask for (the rest is in flight or done), a piece
///   of another stripe that this leecher helps with ([`Stripe::helps_with`]: one piece in
///   `count` of each stripe, a different one for each leecher, so helpers
///   never ask for the same piece) and that is not among the [`HELP_SKIP`]
///   lowest left in its stripe (which its owner is receiving or about to),
///   at random. A stripe's owner receives from the seeders only its share
///   of a downlink full of other peers' pieces, so the last stripes lag; the
///   seeders' upload they cannot take goes to leechers done with their own,
///   which pass the pieces on;
/// - when no leecher holds a piece this one still needs (`starved`: an
///   owner may be gone or stuck), any piece.
///
/// `random` must return uniformly distributed values.
pub fn choose_from_seeder(
    candidates: impl IntoIterator<Item = usize>,
    stripe: Stripe,
    starved: bool,
    mut random: impl FnMut() -> u64,
) -> Option<usize> {
    let mut candidates: Vec<usize> = candidates.into_iter().collect();
    candidates.sort_unstable();
    candidates.dedup();
    if let Some(own) = candidates.iter().copied().find(|p| stripe.contains(*p)) {
        return Some(own);
    }
    // Each candidate's rank among the candidates of its stripe, lowest first.
    let count = stripe.count.max(1);
    let mut seen = std::collections::HashMap::<usize, usize>::new();
    let helped: Vec<usize> = candidates
        .iter()
        .filter(|p| {
            let r = seen.entry(*p % count).or_default();
            *r += 1;
            *r > HELP_SKIP && stripe.helps_with(**p)
        })
        .copied()
        .collect();
    let pool = if !helped.is_empty() {
        helped
    } else if starved {
        candidates
    } else {
        return None;
    };
    (!pool.is_empty()).then(|| pool[(random() % pool.len() as u64) as usize])
}

/// anneal: the lowest pieces left in another leecher's stripe that a leecher
/// done with its own leaves to that owner ([`choose_from_seeder`]): what
/// the owner has in flight (a piece being received and the next one
/// requested).
pub const HELP_SKIP: usize = 2;

/// The candidate with the lowest availability; among equally rare candidates
/// each is chosen with the same probability (reservoir sampling driven by
/// `random`, which must return uniformly distributed values). `None` when
/// there is no candidate.
pub fn choose_rarest(
    candidates: impl IntoIterator<Item = usize>,
    availability: &Availability,
    mut random: impl FnMut() -> u64,
) -> Option<usize> {
    let mut best: Option<(usize, u32)> = None;
    let mut ties: u64 = 0;
    for piece in candidates {
        let count = availability.get(piece);
        match best {
            Some((_, c)) if count > c => {}
            Some((_, c)) if count == c => {
                ties += 1;
                // Keep each of the `ties` equally rare candidates with
                // probability 1/ties.
                if random() % ties == 0 {
                    best = Some((piece, count));
                }
            }
            _ => {
                best = Some((piece, count));
                ties = 1;
            }
        }
    }
    best.map(|(p, _)| p)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bookkeeping_follows_peers() {
        let mut a = Availability::new(4);
        a.add_peer([0, 1, 2, 3]);
        a.add_peer([1, 3]);
        a.add_piece(2);
        assert_eq!((0..4).map(|p| a.get(p)).collect::<Vec<_>>(), [1, 2, 2, 2]);
        a.remove_peer([1, 3]);
        assert_eq!((0..4).map(|p| a.get(p)).collect::<Vec<_>>(), [1, 1, 2, 1]);
        a.remove_peer([0, 0, 0]);
        assert_eq!(a.get(0), 0);
        a.add_peer([7, 9]);
        assert_eq!(a.len(), 4);
    }

    #[test]
    fn stripes_split_every_piece_once_among_the_leechers() {
        let ids: Vec<[u8; 20]> = [7u8, 3, 250, 42, 9].iter().map(|b| [*b; 20]).collect();
        let stripes: Vec<Stripe> = ids
            .iter()
            .map(|own| Stripe::of(own, ids.iter()))
            .collect();
        // ranks by id: 3, 7, 9, 42, 250
        let idx: Vec<usize> = stripes.iter().map(|s| s.index).collect();
        assert_eq!(idx, [1, 0, 4, 3, 2]);
        assert!(stripes.iter().all(|s| s.count == 5));
        // every piece of 23 belongs to exactly one stripe
        for p in 0..23 {
            assert_eq!(stripes.iter().filter(|s| s.contains(p)).count(), 1, "piece {p}");
        }
        let mut all: Vec<usize> = stripes.iter().flat_map(|s| s.pieces(23)).collect();
        all.sort_unstable();
        assert_eq!(all, (0..23).collect::<Vec<_>>());
        // alone: everything; a duplicate id or our own counts once
        let alone = Stripe::of(&ids[0], [&ids[0], &ids[0]]);
        assert_eq!(alone, Stripe { index: 0, count: 1 });
        assert!((0..10).all(|p| alone.contains(p)));
        // more leechers than pieces: the high ranks have none
        let s = Stripe { index: 6, count: 8 };
        assert_eq!(s.pieces(4).count(), 0);
    }

    #[test]
    fn a_seeder_serves_the_stripe_in_order_then_the_lagging_stripes_tails() {
        let s = Stripe { index: 1, count: 3 };
        let never = || -> u64 { panic!("no random choice expected") };
        // Own stripe first, lowest first, whatever else is there.
        assert_eq!(choose_from_seeder([9, 7, 4, 0, 2], s, false, never), Some(4));
        // Nothing of its own to ask for, and of the others only what their
        // owners are receiving or about to: nothing.
        assert_eq!(choose_from_seeder([0, 2, 3], s, false, never), None);
        // Leecher 1 of 3 helps with the pieces of stripe 0 whose k (piece /
        // 3) is 1, 4, 7 and those of stripe 2 whose k is 2, 5, 8.
        let helps: Vec<usize> = (0..27).filter(|p| s.helps_with(*p)).collect();
        assert_eq!(helps, [3, 8, 12, 17, 21, 26]);
        // None of its own: stripe 0 has 0, 3, 6, 9, 12, 15, 18, 21 left, stripe 2
        // has 2, 5, 8. Past the two lowest of its stripe and helped by
        // this leecher: 8, 12 and 21.
        let mut x = 0u64;
        let mut picks = std::collections::BTreeSet::new();
        for _ in 0..200 {
            let pick = choose_from_seeder([0, 2, 3, 5, 6, 8, 9, 12, 15, 18, 21], s, false, || {
                x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                x >> 33
            });
            picks.insert(pick.unwrap());
        }
        assert_eq!(picks.into_iter().collect::<Vec<_>>(), [8, 12, 21]);
        // Only the owners' next pieces (and others' helpers' pieces) left:
        // nothing unless starved, then anything.
        assert_eq!(choose_from_seeder([0, 3, 2, 5, 6], s, false, || 0), None);
        assert_eq!(choose_from_seeder([0, 3, 2, 5, 6], s, true, || 1), Some(2));
        assert_eq!(choose_from_seeder(std::iter::empty(), s, true, never), None);
        // Alone: every piece is the stripe's, in order.
        let alone = Stripe { index: 0, count: 1 };
        assert_eq!(choose_from_seeder([5, 3, 8], alone, false, never), Some(3));
        assert!(!alone.helps_with(3));
    }

    #[test]
    fn every_piece_but_the_owners_has_one_helper() {
        for count in 1..7 {
            let stripes: Vec<Stripe> = (0..count).map(|index| Stripe { index, count }).collect();
            for p in 0..100 {
                let helpers = stripes.iter().filter(|s| s.helps_with(p)).count();
                let owner_helps = stripes[p % count].helps_with(p);
                assert!(!owner_helps);
                // The k-th piece of a stripe has no helper when k is a
                // multiple of the count (the helper would be the owner);
                // every other piece has exactly one.
                let expect = usize::from((p / count) % count != 0);
                assert_eq!(helpers, expect, "piece {p} of {count} stripes");
            }
        }
    }

    #[test]
    fn rarest_wins_and_ties_are_spread() {
        let mut a = Availability::new(6);
        a.add_peer([0, 1, 2, 3, 4, 5]);
        a.add_peer([0, 1, 2]);
        // 3, 4, 5 are held by one peer, 0..3 by two.
        let mut seen = [0u32; 6];
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        for _ in 0..3000 {
            let pick = choose_rarest(0..6, &a, || {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x
            })
            .unwrap();
            seen[pick] += 1;
        }
        assert_eq!(&seen[..3], &[0, 0, 0]);
        for s in &seen[3..] {
            assert!((800..1200).contains(s), "uneven tie-break: {seen:?}");
        }
        assert_eq!(choose_rarest(std::iter::empty(), &a, || 0), None);
    }
}
