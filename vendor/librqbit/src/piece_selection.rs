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

    /// The pieces of the stripe among `total`.
    pub fn pieces(&self, total: usize) -> impl Iterator<Item = usize> {
        (self.index.min(total)..total).step_by(self.count.max(1))
    }
}

/// anneal: whether a seeder may be asked for `piece` by the leecher of
/// `stripe`: a piece of its stripe, or any piece no leecher has once the
/// stripe is complete (`stripe_done`) and no leecher has a piece this one
/// still needs (`starved`): the leecher that owns it may be gone or stuck,
/// and the seeders have little else to send by then.
pub fn stripe_allows(stripe: Option<Stripe>, piece: usize, stripe_done: bool, starved: bool) -> bool {
    match stripe {
        None => true,
        Some(s) => s.contains(piece) || (stripe_done && starved),
    }
}

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
    fn off_stripe_pieces_only_when_done_and_starved() {
        let s = Some(Stripe { index: 1, count: 3 });
        assert!(stripe_allows(s, 4, false, false));
        assert!(!stripe_allows(s, 3, false, false));
        assert!(!stripe_allows(s, 3, true, false));
        assert!(!stripe_allows(s, 3, false, true));
        assert!(stripe_allows(s, 3, true, true));
        assert!(stripe_allows(None, 3, false, false));
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
