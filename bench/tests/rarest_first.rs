//! The rarest-first bookkeeping and choice added to the vendored librqbit
//! (vendor/librqbit/NOTICE.anneal), through its public API.
#![allow(clippy::too_many_lines)]

use librqbit::piece_selection::{Availability, Stripe, choose_from_seeder, choose_rarest};

fn counts(a: &Availability) -> Vec<u32> {
    (0..a.len()).map(|p| a.get(p)).collect()
}

/// xorshift64: a deterministic stand-in for the random tie-break.
fn xorshift(seed: u64) -> impl FnMut() -> u64 {
    let mut x = seed;
    move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    }
}

#[test]
fn counts_follow_bitfields_haves_and_departures() {
    let mut a = Availability::new(5);
    a.add_peer([0, 1, 2, 3, 4]); // the seed
    a.add_peer([]); // a leecher with nothing yet
    assert_eq!(counts(&a), [1, 1, 1, 1, 1]);
    a.add_piece(3); // the leecher got piece 3
    a.add_piece(3); // and a second leecher too
    assert_eq!(counts(&a), [1, 1, 1, 3, 1]);
    // A peer sending a second bitfield replaces its first one.
    a.replace_peer([], [1, 3]);
    assert_eq!(counts(&a), [1, 2, 1, 4, 1]);
    a.remove_peer([1, 3]);
    a.remove_peer([0, 1, 2, 3, 4]); // the seed leaves
    assert_eq!(counts(&a), [0, 0, 0, 2, 0]);
    // Never below zero, whatever a buggy caller removes; spare bitfield bits
    // past the last piece are ignored.
    a.remove_peer([0, 0, 9]);
    a.add_peer([5, 6, 7]);
    assert_eq!(counts(&a), [0, 0, 0, 2, 0]);
    assert_eq!(a.get(99), 0);
}

#[test]
fn the_least_available_candidate_is_chosen() {
    let mut a = Availability::new(8);
    a.add_peer(0..8);
    a.add_peer(0..6);
    a.add_peer([0, 1, 2, 3, 7]);
    // counts: 3 3 3 3 2 2 1 2
    assert_eq!(choose_rarest(0..8, &a, xorshift(1)), Some(6));
    // Only candidates count: without 6, the rarest are 4, 5 and 7.
    for seed in 1..50 {
        let pick = choose_rarest([0, 1, 4, 5, 7], &a, xorshift(seed));
        assert!(matches!(pick, Some(4 | 5 | 7)), "{pick:?}");
    }
    assert_eq!(choose_rarest([2], &a, xorshift(3)), Some(2));
    assert_eq!(choose_rarest(std::iter::empty(), &a, xorshift(3)), None);
}

#[test]
fn ties_are_broken_uniformly() {
    // 64 leechers that all see the same counts must not all pick the same
    // piece: every one of the 16 equally rare pieces is chosen about as often.
    let mut a = Availability::new(32);
    a.add_peer(0..32);
    a.add_peer(16..32);
    let mut seen = [0u32; 32];
    let mut rng = xorshift(0x2545_f491_4f6c_dd1d);
    for _ in 0..16_000 {
        let pick = choose_rarest(0..32, &a, &mut rng).expect("a candidate");
        seen[pick] += 1;
    }
    assert!(seen[16..].iter().all(|&n| n == 0), "{seen:?}");
    for &n in &seen[..16] {
        assert!((800..1200).contains(&n), "uneven tie-break: {seen:?}");
    }
}

#[test]
fn a_seeder_is_asked_only_for_pieces_no_leecher_has() {
    // Two seeders (the seeder and a finished leecher) and a leecher holding
    // pieces 1 and 2.
    let mut a = Availability::new(4);
    a.add_peer(0..4);
    a.add_peer(0..4);
    a.add_peer([1, 2]);
    let seeders = 2;
    let may: Vec<bool> = (0..4)
        .map(|p| librqbit::piece_selection::seeder_may_serve(&a, p, seeders))
        .collect();
    assert_eq!(may, [true, false, false, true]);
    // The leecher leaves: the seeders serve everything again.
    a.remove_peer([1, 2]);
    assert!((0..4).all(|p| librqbit::piece_selection::seeder_may_serve(&a, p, seeders)));
}

#[test]
fn seeder_stripes_give_each_piece_to_one_leecher() {
    // 16 leechers with distinct ids, each seeing the 15 others.
    let ids: Vec<[u8; 20]> = (0..16u8)
        .map(|i| {
            let mut id = [0u8; 20];
            id[0] = i.wrapping_mul(97);
            id[19] = i;
            id
        })
        .collect();
    let stripes: Vec<Stripe> = ids.iter().map(|own| Stripe::of(own, ids.iter())).collect();
    let mut ranks: Vec<usize> = stripes.iter().map(|s| s.index).collect();
    ranks.sort_unstable();
    assert_eq!(ranks, (0..16).collect::<Vec<_>>());
    for p in 0..64 {
        assert_eq!(
            stripes.iter().filter(|s| s.contains(p)).count(),
            1,
            "piece {p}"
        );
    }
    // One leecher gone: the 15 left re-split every piece among themselves.
    let left: Vec<Stripe> = ids[1..]
        .iter()
        .map(|own| Stripe::of(own, ids[1..].iter()))
        .collect();
    for p in 0..64 {
        assert_eq!(
            left.iter().filter(|s| s.contains(p)).count(),
            1,
            "piece {p}"
        );
    }
    // From a seeder: the own stripe in order; once none of it is left to
    // ask for, not the lowest pieces left in another stripe, and only those
    // this leecher helps with. The leecher of rank 3 helps with one piece of
    // each other stripe.
    let s = *stripes.iter().find(|s| s.index == 3).unwrap();
    let mine: Vec<usize> = s.pieces(64).collect();
    let others: Vec<usize> = (0..64).filter(|p| !s.contains(*p)).collect();
    assert_eq!(
        choose_from_seeder((0..64).rev(), s, false, xorshift(5)),
        Some(mine[0])
    );
    // Only the owners' two lowest left: nothing, unless starved.
    let lowest: Vec<usize> = others.iter().copied().filter(|p| *p < 32).collect();
    assert_eq!(
        choose_from_seeder(lowest.clone(), s, false, xorshift(5)),
        None
    );
    assert!(choose_from_seeder(lowest, s, true, xorshift(5)).is_some_and(|p| p < 32));
    let mut rng = xorshift(9);
    for _ in 0..100 {
        let p = choose_from_seeder(others.clone(), s, false, &mut rng).expect("a piece");
        // 64 pieces in 16 stripes: each stripe has 4; the first two of each
        // are left to its owner, and each other piece has one helper.
        assert!(p >= 32, "piece {p} is among its stripe's two lowest");
        assert!(
            s.helps_with(p),
            "piece {p} is another leecher's to help with"
        );
    }
    // The helpers of a piece: one leecher, never its owner.
    for p in 32..64 {
        let helpers = stripes.iter().filter(|t| t.helps_with(p)).count();
        assert!(helpers <= 1, "piece {p} has {helpers} helpers");
        assert!(!stripes.iter().any(|t| t.contains(p) && t.helps_with(p)));
    }
}
