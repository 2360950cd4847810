//! Coordinates piece download state by wrapping ChunkTracker with inflight piece tracking.
//!
//! This module provides the [`PieceTracker`] type which encapsulates the relationship between
//! queued pieces (in ChunkTracker) and in-flight pieces (being downloaded by a peer).
//!
//! The key invariant maintained is: a piece is in exactly one state at any time:
//! - HAVE (completed)
//! - QUEUED (available to download)
//! - IN_FLIGHT (currently being downloaded)
//! - NOT_NEEDED (not selected for download)

use std::{
    collections::{HashMap, HashSet},
    time::{Duration, Instant},
};

use buffers::ByteBuf;
use librqbit_core::lengths::ValidPieceIndex;
use peer_binary_protocol::Piece;

use crate::{
    chunk_tracker::{ChunkMarkingResult, ChunkTracker},
    file_info::FileInfo,
    piece_selection::{Availability, Stripe, choose_from_seeder, choose_rarest, seeder_may_serve},
    type_aliases::{FileInfos, FilePriorities, PeerHandle},
};

/// Tracks a piece currently being downloaded.
#[derive(Debug, Clone)]
pub struct InflightPiece {
    pub peer: PeerHandle,
    pub started: Instant,
}

/// Result of attempting to acquire a piece.
#[derive(Debug)]
pub enum AcquireResult {
    /// A new piece was reserved from the queue.
    Reserved(ValidPieceIndex),
    /// A piece was stolen from a slower peer.
    Stolen {
        piece: ValidPieceIndex,
        from_peer: PeerHandle,
    },
    /// No pieces are available for this peer.
    NoneAvailable,
}

/// Parameters for acquiring a piece.
pub struct AcquireRequest<'a, I, P, S>
where
    I: Iterator<Item = ValidPieceIndex>,
    P: Fn(ValidPieceIndex) -> bool,
    S: Fn(ValidPieceIndex) -> bool,
{
    /// The peer requesting a piece.
    pub peer: PeerHandle,
    /// The peer's average piece download time (for steal calculations).
    pub peer_avg_time: Option<Duration>,
    /// Priority pieces to check first (e.g., for streaming).
    pub priority_pieces: I,
    /// File download priority ordering.
    pub file_priorities: &'a FilePriorities,
    /// File metadata for iterating pieces.
    pub file_infos: &'a FileInfos,
    /// Returns true if the peer has the given piece.
    pub peer_has_piece: P,
    /// Returns true if the piece can be stolen (e.g., not locked for writing).
    pub can_steal: S,
    /// anneal: this leecher's stripe of what seeders are asked for
    /// (`piece_selection::Stripe`), when seeder stripes are on.
    pub stripe: Option<Stripe>,
    /// anneal: the peer has every piece (a seeder).
    pub peer_is_seeder: bool,
    /// anneal: connected peers that have every piece.
    pub live_seeders: u32,
}

/// anneal: the first pieces a leecher alone in its stripe split (no other
/// leecher known yet) takes from a seeder at random, not in order.
const ALONE_RANDOM_PIECES: usize = 8;

/// Coordinates piece download state.
///
/// Wraps a [`ChunkTracker`] with tracking of which pieces are currently being downloaded
/// (in-flight) and by which peer. This ensures that:
///
/// - A piece is only assigned to one peer at a time (unless stolen)
/// - Pieces are properly requeued when a peer dies
/// - State transitions maintain invariants
pub struct PieceTracker {
    chunks: ChunkTracker,
    inflight: HashMap<ValidPieceIndex, InflightPiece>,
    /// anneal: per-piece peer counts when rarest-first selection is on.
    availability: Option<Availability>,
}

impl PieceTracker {
    // === CONSTRUCTION ===

    /// Create a new PieceTracker wrapping the given ChunkTracker.
    pub fn new(chunks: ChunkTracker) -> Self {
        Self {
            chunks,
            inflight: HashMap::new(),
            availability: None,
        }
    }

    /// anneal: reserve queued pieces rarest first (fewest connected peers
    /// have them, ties at random) instead of in file order. Peers' pieces are
    /// counted from then on through `on_peer_pieces`, `on_peer_have` and
    /// `on_peer_gone`.
    pub fn with_rarest_first(mut self, enabled: bool) -> Self {
        self.availability =
            enabled.then(|| Availability::new(self.chunks.get_lengths().total_pieces() as usize));
        self
    }

    /// anneal: the per-piece peer counts, when rarest-first is on.
    #[allow(dead_code)]
    pub fn availability(&self) -> Option<&Availability> {
        self.availability.as_ref()
    }

    /// anneal: a peer's bitfield arrived, replacing `old` (empty for the
    /// first one).
    pub fn on_peer_pieces(
        &mut self,
        old: impl IntoIterator<Item = usize>,
        new: impl IntoIterator<Item = usize>,
    ) {
        if let Some(a) = self.availability.as_mut() {
            a.replace_peer(old, new);
        }
    }

    /// anneal: a peer announced one more piece.
    pub fn on_peer_have(&mut self, piece: usize) {
        if let Some(a) = self.availability.as_mut() {
            a.add_piece(piece);
        }
    }

    /// anneal: a peer holding these pieces went away.
    pub fn on_peer_gone(&mut self, pieces: impl IntoIterator<Item = usize>) {
        if let Some(a) = self.availability.as_mut() {
            a.remove_peer(pieces);
        }
    }

    /// Read-only access to the underlying ChunkTracker.
    pub fn chunks(&self) -> &ChunkTracker {
        &self.chunks
    }

    /// Consume the PieceTracker, requeuing any in-flight pieces.
    ///
    /// This is used when pausing a torrent - any pieces that were being downloaded
    /// need to be put back in the queue so they can be re-downloaded on resume.
    pub fn into_chunks(mut self) -> ChunkTracker {
        // Requeue all in-flight pieces so they'll be re-downloaded on resume
        for piece in self.inflight.into_keys() {
            self.chunks.mark_piece_broken_if_not_have(piece);
        }
        self.chunks
    }

    // === PIECE ACQUISITION ===

    /// Attempt to acquire a piece for the requesting peer.
    ///
    /// The acquisition strategy is:
    /// 1. Try to steal a piece from a peer that's 10x slower
    /// 2. Try to reserve a piece from the queue (priority pieces first)
    /// 3. Try to steal a piece from a peer that's 3x slower
    ///
    /// If `Stolen` is returned, the caller MUST call `peers.on_steal()` to notify
    /// the old peer and update counters.
    pub fn acquire_piece<I, P, S>(&mut self, mut req: AcquireRequest<I, P, S>) -> AcquireResult
    where
        I: Iterator<Item = ValidPieceIndex>,
        P: Fn(ValidPieceIndex) -> bool,
        S: Fn(ValidPieceIndex) -> bool,
    {
        // 1. Try steal with 10x threshold (very slow peer). anneal: not
        // with rarest-first, where a piece is stolen only when this peer
        // has nothing to reserve (step 3): in a swarm whose links are full,
        // every uploader serves several peers at once and a piece takes
        // many times a fast peer's average, so the early steal fired all
        // the time, and each steal re-fetched chunks already on their way.
        if self.availability.is_none()
            && let Some(result) = self.try_steal(&req, 10.0)
        {
            return result;
        }

        // 2. Try reserve from priority_pieces then queued pieces
        // First check priority pieces that aren't already downloaded or in-flight
        for piece in &mut req.priority_pieces {
            if !self.chunks.is_piece_have(piece)
                && !self.inflight.contains_key(&piece)
                && (req.peer_has_piece)(piece)
            {
                return self.reserve_piece(piece, req.peer);
            }
        }

        // Then check naturally ordered queued pieces
        // Note: iter_queued_pieces only returns pieces in queue_pieces (not in-flight)
        let queued: Vec<_> = self
            .chunks
            .iter_queued_pieces(req.file_priorities, req.file_infos)
            .collect();

        // anneal: nothing left to reserve from any peer: the endgame.
        let endgame = queued.is_empty();
        if let Some(availability) = self.availability.as_ref() {
            // anneal: rarest first among the queued pieces this peer has.
            // A seeder is asked only for pieces no other peer has: what a
            // leecher holds comes from that leecher, so the seeder's upload
            // goes to pieces the swarm lacks (each piece leaves the seeder
            // about once instead of once per machine).
            let lengths = *self.chunks.get_lengths();
            let seeders = req.live_seeders;
            // anneal: seeder stripes: a seeder is asked for this leecher's
            // stripe in order, then for the tails of lagging stripes
            // (piece_selection::choose_from_seeder).
            let candidates = queued
                .iter()
                .filter(|p| (req.peer_has_piece)(**p))
                .map(|p| p.get_usize())
                .filter(|p| !req.peer_is_seeder || seeder_may_serve(availability, *p, seeders));
            // Pieces reserved or received so far.
            let started = lengths.total_pieces() as usize - queued.len();
            let rarest = match req.stripe.filter(|_| req.peer_is_seeder) {
                // anneal: a leecher that knows no other leecher yet (it has
                // just started, as others may have) takes its first pieces
                // at random: in order, every leecher starting at once asked
                // the seeder for piece 0 (sent 9 times at 16 leechers).
                Some(st) if st.count <= 1 && started < ALONE_RANDOM_PIECES => {
                    choose_rarest(candidates, availability, rand::random::<u64>)
                }
                Some(st) => {
                    let starved = queued
                        .iter()
                        .all(|p| availability.get(p.get_usize()) <= seeders);
                    choose_from_seeder(candidates, st, starved, rand::random::<u64>)
                }
                None => choose_rarest(candidates, availability, rand::random::<u64>),
            }
            .and_then(|p| lengths.validate_piece_index(p as u32));
            if let Some(piece) = rarest {
                return self.reserve_piece(piece, req.peer);
            }
        } else {
            for piece in queued {
                if (req.peer_has_piece)(piece) {
                    return self.reserve_piece(piece, req.peer);
                }
            }
        }

        // 3. Try steal with 3x threshold (moderately slow peer). anneal:
        // with rarest-first, only in the endgame. Before it, a peer with
        // nothing for this one leaves this connection idle while the others
        // fill the link; a steal then cost half a piece, the chunks already
        // on their way from the first peer arriving twice (16 leechers at
        // 100 Mbit/s: 33-79 steals each, 6-15 % of what they received).
        if self.availability.is_some() && !endgame {
            return AcquireResult::NoneAvailable;
        }
        if let Some(result) = self.try_steal(&req, 3.0) {
            return result;
        }

        AcquireResult::NoneAvailable
    }

    /// Reserve a piece: remove from queue, add to inflight.
    fn reserve_piece(&mut self, piece: ValidPieceIndex, peer: PeerHandle) -> AcquireResult {
        self.chunks.reserve_needed_piece(piece);
        self.inflight.insert(
            piece,
            InflightPiece {
                peer,
                started: Instant::now(),
            },
        );
        AcquireResult::Reserved(piece)
    }

    /// Try to steal a piece from a slower peer.
    fn try_steal<I, P, S>(
        &mut self,
        req: &AcquireRequest<I, P, S>,
        threshold: f64,
    ) -> Option<AcquireResult>
    where
        I: Iterator<Item = ValidPieceIndex>,
        P: Fn(ValidPieceIndex) -> bool,
        S: Fn(ValidPieceIndex) -> bool,
    {
        let my_avg = req.peer_avg_time?;
        let min_elapsed = Duration::from_secs_f64(my_avg.as_secs_f64() * threshold);

        // Find the slowest piece from another peer that exceeds threshold
        // and that the stealing peer actually has (can download)
        let (piece, old_peer, _) = self
            .inflight
            .iter()
            .filter(|(_, info)| info.peer != req.peer)
            .filter(|(p, _)| (req.peer_has_piece)(**p))
            .map(|(p, info)| (*p, info.peer, info.started.elapsed()))
            .filter(|(_, _, elapsed)| *elapsed >= min_elapsed)
            .max_by_key(|(_, _, elapsed)| *elapsed)?;

        // Check can_steal (e.g., per_piece_lock)
        if !(req.can_steal)(piece) {
            return None;
        }

        // Update ownership (piece stays in inflight, just changes owner)
        let info = self.inflight.get_mut(&piece)?;
        info.peer = req.peer;
        info.started = Instant::now();

        Some(AcquireResult::Stolen {
            piece,
            from_peer: old_peer,
        })
    }

    // === PIECE COMPLETION ===

    /// Remove piece from inflight tracking (e.g., after all chunks received).
    ///
    /// Returns download duration if piece was in-flight.
    /// Note: Does NOT mark the piece as downloaded - caller should do hash check
    /// and then call `mark_piece_hash_ok` or `mark_piece_hash_failed`.
    pub fn take_inflight(&mut self, piece: ValidPieceIndex) -> Option<Duration> {
        let inflight = self.inflight.remove(&piece)?;
        Some(inflight.started.elapsed())
    }

    /// Mark piece as downloaded after successful hash verification.
    pub fn mark_piece_hash_ok(&mut self, piece: ValidPieceIndex) {
        self.chunks.mark_piece_downloaded(piece);
    }

    /// Mark piece as failed after hash verification failure - requeues the piece.
    pub fn mark_piece_hash_failed(&mut self, piece: ValidPieceIndex) {
        self.chunks.mark_piece_broken_if_not_have(piece);
    }

    /// Release all pieces owned by a peer (on peer death).
    ///
    /// Moves all pieces owned by the peer from IN_FLIGHT back to QUEUED.
    /// Returns the number of pieces released.
    pub fn release_pieces_owned_by(&mut self, peer: PeerHandle) -> usize {
        // Collect pieces to release (can't modify while iterating)
        let pieces_to_release: Vec<_> = self
            .inflight
            .iter()
            .filter(|(_, info)| info.peer == peer)
            .map(|(p, _)| *p)
            .collect();

        let count = pieces_to_release.len();
        for piece in pieces_to_release {
            self.inflight.remove(&piece);
            self.chunks.mark_piece_broken_if_not_have(piece);
        }
        count
    }

    // === QUERIES ===

    /// Get the inflight info for a piece, if it's currently being downloaded.
    pub fn get_inflight(&self, piece: ValidPieceIndex) -> Option<&InflightPiece> {
        self.inflight.get(&piece)
    }

    /// Check if a piece is currently in-flight.
    #[allow(dead_code)]
    pub fn is_inflight(&self, piece: ValidPieceIndex) -> bool {
        self.inflight.contains_key(&piece)
    }

    /// Get the number of pieces currently in-flight.
    #[allow(dead_code)]
    pub fn inflight_count(&self) -> usize {
        self.inflight.len()
    }

    // === PASS-THROUGH METHODS ===

    /// Mark a chunk as downloaded. Returns the result indicating if the piece is complete.
    pub fn mark_chunk_downloaded(
        &mut self,
        piece: &Piece<ByteBuf<'_>>,
    ) -> Option<ChunkMarkingResult> {
        self.chunks.mark_chunk_downloaded(piece)
    }

    /// Update which files are selected for download.
    pub fn update_only_files(
        &mut self,
        file_infos: &FileInfos,
        new_only_files: &HashSet<usize>,
    ) -> anyhow::Result<crate::chunk_tracker::HaveNeededSelected> {
        self.chunks.update_only_files(file_infos, new_only_files)
    }

    /// Update per-file have bytes when a piece completes. Returns remaining bytes for the file.
    pub fn update_file_have_on_piece_completed(
        &mut self,
        piece_id: ValidPieceIndex,
        file_id: usize,
        file_info: &FileInfo,
    ) -> u64 {
        self.chunks
            .update_file_have_on_piece_completed(piece_id, file_id, file_info)
    }

    /// Flush the have pieces bitfield to disk.
    pub fn flush_have_pieces(&mut self, flush_async: bool) -> anyhow::Result<()> {
        self.chunks.get_have_pieces_mut().flush(flush_async)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{bitv::BitV as BitVTrait, type_aliases::BF};
    use librqbit_core::lengths::Lengths;
    use std::net::{IpAddr, Ipv4Addr, SocketAddr};

    fn peer(id: u8) -> PeerHandle {
        SocketAddr::new(IpAddr::V4(Ipv4Addr::new(127, 0, 0, id)), 6881)
    }

    /// Create a simple ChunkTracker for testing.
    /// Creates a torrent with the specified number of pieces, all selected.
    fn make_test_chunk_tracker(num_pieces: u32) -> ChunkTracker {
        // Create a simple single-file torrent
        let piece_length = 16384u32; // 16KB pieces
        let total_length = piece_length as u64 * num_pieces as u64;

        let lengths = Lengths::new(total_length, piece_length).unwrap();

        let bf_len = lengths.piece_bitfield_bytes();

        // No pieces downloaded yet (empty have)
        let have = BF::from_boxed_slice(vec![0u8; bf_len].into_boxed_slice());

        // All pieces selected
        let mut selected = BF::from_boxed_slice(vec![0u8; bf_len].into_boxed_slice());
        for i in 0..num_pieces as usize {
            selected.set(i, true);
        }

        // Single file spanning all pieces
        let file_infos = vec![crate::file_info::FileInfo {
            relative_filename: "test.dat".into(),
            offset_in_torrent: 0,
            len: total_length,
            piece_range: 0..num_pieces,
            attrs: Default::default(),
        }];

        ChunkTracker::new(have.into_dyn(), selected, lengths, &file_infos).unwrap()
    }

    fn make_test_file_infos(num_pieces: u32) -> FileInfos {
        let piece_length = 16384u64;
        vec![crate::file_info::FileInfo {
            relative_filename: "test.dat".into(),
            offset_in_torrent: 0,
            len: piece_length * num_pieces as u64,
            piece_range: 0..num_pieces,
            attrs: Default::default(),
        }]
    }

    fn make_default_file_priorities(file_infos: &FileInfos) -> FilePriorities {
        (0..file_infos.len()).collect()
    }

    #[test]
    fn test_new_piece_tracker() {
        let chunks = make_test_chunk_tracker(10);
        let tracker = PieceTracker::new(chunks);
        assert_eq!(tracker.inflight_count(), 0);
    }

    #[test]
    fn test_reserve_piece_from_queue() {
        let chunks = make_test_chunk_tracker(5);
        let mut tracker = PieceTracker::new(chunks);

        let file_infos = make_test_file_infos(5);
        let file_priorities = make_default_file_priorities(&file_infos);

        let result = tracker.acquire_piece(AcquireRequest {
            peer: peer(1),
            peer_avg_time: None,
            priority_pieces: std::iter::empty(),
            file_priorities: &file_priorities,
            file_infos: &file_infos,
            peer_has_piece: |_| true, // Peer has all pieces
            can_steal: |_| true,
            peer_is_seeder: false,
            live_seeders: 0,
            stripe: None,
        });

        // Should reserve piece 0 (first in queue)
        match result {
            AcquireResult::Reserved(piece) => {
                assert_eq!(piece.get(), 0);
                assert!(tracker.is_inflight(piece));
                assert_eq!(tracker.inflight_count(), 1);
            }
            _ => panic!("Expected Reserved, got {:?}", result),
        }
    }

    #[test]
    fn test_reserve_filters_by_peer_has_piece() {
        let chunks = make_test_chunk_tracker(5);
        let mut tracker = PieceTracker::new(chunks);

        let file_infos = make_test_file_infos(5);
        let file_priorities = make_default_file_priorities(&file_infos);

        // Peer only has piece 2 and later
        // Note: iter_queued_pieces iterates in order: first, last, middle
        // So for 0..5: 0, 4, 1, 2, 3
        // With filter >= 2, we get 4 first (skips 0, takes 4)
        let result = tracker.acquire_piece(AcquireRequest {
            peer: peer(1),
            peer_avg_time: None,
            priority_pieces: std::iter::empty(),
            file_priorities: &file_priorities,
            file_infos: &file_infos,
            peer_has_piece: |p| p.get() >= 2,
            can_steal: |_| true,
            peer_is_seeder: false,
            live_seeders: 0,
            stripe: None,
        });

        match result {
            AcquireResult::Reserved(piece) => {
                // Got piece 4 (first one peer has in iteration order)
                assert!(piece.get() >= 2, "Should have gotten a piece >= 2");
            }
            _ => panic!("Expected Reserved, got {:?}", result),
        }
    }

    #[test]
    fn test_complete_piece() {
        let chunks = make_test_chunk_tracker(5);
        let mut tracker = PieceTracker::new(chunks);

        let file_infos = make_test_file_infos(5);
        let file_priorities = make_default_file_priorities(&file_infos);

        // Reserve a piece first
        let result = tracker.acquire_piece(AcquireRequest {
            peer: peer(1),
            peer_avg_time: None,
            priority_pieces: std::iter::empty(),
            file_priorities: &file_priorities,
            file_infos: &file_infos,
            peer_has_piece: |_| true,
            can_steal: |_| true,
            peer_is_seeder: false,
            live_seeders: 0,
            stripe: None,
        });

        let piece = match result {
            AcquireResult::Reserved(p) => p,
            _ => panic!("Expected Reserved"),
        };

        // Complete the piece (take_inflight + hash check + mark_piece_hash_ok)
        let duration = tracker.take_inflight(piece);
        assert!(duration.is_some());
        assert!(!tracker.is_inflight(piece));
        // Simulate successful hash check
        tracker.mark_piece_hash_ok(piece);
        assert!(tracker.chunks().is_piece_have(piece));
    }

    #[test]
    fn test_fail_piece_requeues() {
        let chunks = make_test_chunk_tracker(5);
        let mut tracker = PieceTracker::new(chunks);

        let file_infos = make_test_file_infos(5);
        let file_priorities = make_default_file_priorities(&file_infos);

        // Reserve piece 0
        let result = tracker.acquire_piece(AcquireRequest {
            peer: peer(1),
            peer_avg_time: None,
            priority_pieces: std::iter::empty(),
            file_priorities: &file_priorities,
            file_infos: &file_infos,
            peer_has_piece: |_| true,
            can_steal: |_| true,
            peer_is_seeder: false,
            live_seeders: 0,
            stripe: None,
        });

        let piece = match result {
            AcquireResult::Reserved(p) => p,
            _ => panic!("Expected Reserved"),
        };

        assert!(tracker.is_inflight(piece));

        // Fail the piece (take_inflight + hash check fails + mark_piece_hash_failed)
        let duration = tracker.take_inflight(piece);
        assert!(duration.is_some());
        // Simulate failed hash check
        tracker.mark_piece_hash_failed(piece);

        // Should no longer be in-flight
        assert!(!tracker.is_inflight(piece));
        // Should not be in have
        assert!(!tracker.chunks().is_piece_have(piece));
        // Should be back in queue - verify by trying to reserve it again
        let result2 = tracker.acquire_piece(AcquireRequest {
            peer: peer(2),
            peer_avg_time: None,
            priority_pieces: std::iter::empty(),
            file_priorities: &file_priorities,
            file_infos: &file_infos,
            peer_has_piece: |p| p == piece, // Only has the failed piece
            can_steal: |_| true,
            peer_is_seeder: false,
            live_seeders: 0,
            stripe: None,
        });

        match result2 {
            AcquireResult::Reserved(p) => assert_eq!(p, piece),
            _ => panic!("Expected piece to be re-reservable after fail"),
        }
    }

    #[test]
    fn test_release_pieces_owned_by_peer() {
        let chunks = make_test_chunk_tracker(5);
        let mut tracker = PieceTracker::new(chunks);

        let file_infos = make_test_file_infos(5);
        let file_priorities = make_default_file_priorities(&file_infos);

        let peer_a = peer(1);
        let peer_b = peer(2);

        // Peer A reserves first two pieces (order: 0, 4, 1, 2, 3)
        // So peer A gets pieces 0 and 4
        let piece_a1 = match tracker.acquire_piece(AcquireRequest {
            peer: peer_a,
            peer_avg_time: None,
            priority_pieces: std::iter::empty(),
            file_priorities: &file_priorities,
            file_infos: &file_infos,
            peer_has_piece: |_| true,
            can_steal: |_| true,
            peer_is_seeder: false,
            live_seeders: 0,
            stripe: None,
        }) {
            AcquireResult::Reserved(p) => p,
            _ => panic!("Expected Reserved"),
        };
        let piece_a2 = match tracker.acquire_piece(AcquireRequest {
            peer: peer_a,
            peer_avg_time: None,
            priority_pieces: std::iter::empty(),
            file_priorities: &file_priorities,
            file_infos: &file_infos,
            peer_has_piece: |_| true,
            can_steal: |_| true,
            peer_is_seeder: false,
            live_seeders: 0,
            stripe: None,
        }) {
            AcquireResult::Reserved(p) => p,
            _ => panic!("Expected Reserved"),
        };

        // Peer B reserves next piece
        let piece_b = match tracker.acquire_piece(AcquireRequest {
            peer: peer_b,
            peer_avg_time: None,
            priority_pieces: std::iter::empty(),
            file_priorities: &file_priorities,
            file_infos: &file_infos,
            peer_has_piece: |_| true,
            can_steal: |_| true,
            peer_is_seeder: false,
            live_seeders: 0,
            stripe: None,
        }) {
            AcquireResult::Reserved(p) => p,
            _ => panic!("Expected Reserved"),
        };

        assert_eq!(tracker.inflight_count(), 3);
        assert!(tracker.is_inflight(piece_a1));
        assert!(tracker.is_inflight(piece_a2));
        assert!(tracker.is_inflight(piece_b));

        // Peer A dies
        let released = tracker.release_pieces_owned_by(peer_a);
        assert_eq!(released, 2);
        assert_eq!(tracker.inflight_count(), 1); // Only peer B's piece remains

        // Verify peer B's piece is still in-flight
        assert!(tracker.is_inflight(piece_b));
        // Verify peer A's pieces are no longer in-flight
        assert!(!tracker.is_inflight(piece_a1));
        assert!(!tracker.is_inflight(piece_a2));
    }

    #[test]
    fn test_into_chunks_requeues_inflight() {
        let chunks = make_test_chunk_tracker(5);
        let mut tracker = PieceTracker::new(chunks);

        let file_infos = make_test_file_infos(5);
        let file_priorities = make_default_file_priorities(&file_infos);

        // Reserve pieces 0 and 1
        tracker.acquire_piece(AcquireRequest {
            peer: peer(1),
            peer_avg_time: None,
            priority_pieces: std::iter::empty(),
            file_priorities: &file_priorities,
            file_infos: &file_infos,
            peer_has_piece: |_| true,
            can_steal: |_| true,
            peer_is_seeder: false,
            live_seeders: 0,
            stripe: None,
        });
        tracker.acquire_piece(AcquireRequest {
            peer: peer(1),
            peer_avg_time: None,
            priority_pieces: std::iter::empty(),
            file_priorities: &file_priorities,
            file_infos: &file_infos,
            peer_has_piece: |_| true,
            can_steal: |_| true,
            peer_is_seeder: false,
            live_seeders: 0,
            stripe: None,
        });

        assert_eq!(tracker.inflight_count(), 2);

        // Convert back to chunks (simulates pause)
        let chunks = tracker.into_chunks();

        // Create a new tracker and verify pieces are back in queue
        let mut new_tracker = PieceTracker::new(chunks);
        let result = new_tracker.acquire_piece(AcquireRequest {
            peer: peer(2),
            peer_avg_time: None,
            priority_pieces: std::iter::empty(),
            file_priorities: &file_priorities,
            file_infos: &file_infos,
            peer_has_piece: |_| true,
            can_steal: |_| true,
            peer_is_seeder: false,
            live_seeders: 0,
            stripe: None,
        });

        // Should get piece 0 again (was requeued)
        match result {
            AcquireResult::Reserved(p) => assert_eq!(p.get(), 0),
            _ => panic!("Expected to reserve piece 0 after into_chunks"),
        }
    }

    #[test]
    fn test_priority_pieces_checked_first() {
        let chunks = make_test_chunk_tracker(5);
        let mut tracker = PieceTracker::new(chunks);

        let file_infos = make_test_file_infos(5);
        let file_priorities = make_default_file_priorities(&file_infos);

        // Priority pieces: piece 3, then piece 2
        let piece3 = tracker
            .chunks()
            .get_lengths()
            .validate_piece_index(3)
            .unwrap();
        let piece2 = tracker
            .chunks()
            .get_lengths()
            .validate_piece_index(2)
            .unwrap();
        let priority = vec![piece3, piece2];

        let result = tracker.acquire_piece(AcquireRequest {
            peer: peer(1),
            peer_avg_time: None,
            priority_pieces: priority.into_iter(),
            file_priorities: &file_priorities,
            file_infos: &file_infos,
            peer_has_piece: |_| true,
            can_steal: |_| true,
            peer_is_seeder: false,
            live_seeders: 0,
            stripe: None,
        });

        // Should get piece 3 (first priority piece)
        match result {
            AcquireResult::Reserved(p) => assert_eq!(p.get(), 3),
            _ => panic!("Expected Reserved(3), got {:?}", result),
        }
    }

    #[test]
    fn test_none_available_when_no_pieces() {
        let chunks = make_test_chunk_tracker(5);
        let mut tracker = PieceTracker::new(chunks);

        let file_infos = make_test_file_infos(5);
        let file_priorities = make_default_file_priorities(&file_infos);

        // Peer has no pieces
        let result = tracker.acquire_piece(AcquireRequest {
            peer: peer(1),
            peer_avg_time: None,
            priority_pieces: std::iter::empty(),
            file_priorities: &file_priorities,
            file_infos: &file_infos,
            peer_has_piece: |_| false, // Peer has nothing
            can_steal: |_| true,
            peer_is_seeder: false,
            live_seeders: 0,
            stripe: None,
        });

        match result {
            AcquireResult::NoneAvailable => {}
            _ => panic!("Expected NoneAvailable, got {:?}", result),
        }
    }

    #[test]
    fn rarest_first_reserves_the_least_available_piece() {
        let file_infos = make_test_file_infos(5);
        let file_priorities = make_default_file_priorities(&file_infos);
        let mut tracker = PieceTracker::new(make_test_chunk_tracker(5)).with_rarest_first(true);
        tracker.on_peer_pieces([], [0, 1, 2, 3, 4]);
        tracker.on_peer_pieces([], [0, 1, 3, 4]);
        tracker.on_peer_have(2);
        tracker.on_peer_have(4);
        // Availability: 0:2 1:2 2:2 3:2 4:3; a third peer holding only 1 and 4.
        tracker.on_peer_pieces([], [1, 4]);
        tracker.on_peer_have(0);
        tracker.on_peer_have(0);
        // Now 0:4 1:3 2:2 3:2 4:4: the rarest this peer has are 2 and 3.
        let mut got = Vec::new();
        for _ in 0..2 {
            match tracker.acquire_piece(AcquireRequest {
                peer: peer(9),
                peer_avg_time: None,
                priority_pieces: std::iter::empty(),
                file_priorities: &file_priorities,
                file_infos: &file_infos,
                peer_has_piece: |p| p.get() != 1,
                can_steal: |_| false,
                peer_is_seeder: false,
                live_seeders: 0,
                stripe: None,
            }) {
                AcquireResult::Reserved(p) => got.push(p.get()),
                r => panic!("expected Reserved, got {r:?}"),
            }
        }
        got.sort();
        assert_eq!(got, [2, 3]);
        // A peer leaving lowers the counts: 4 becomes rarer than 0.
        tracker.on_peer_gone([1, 4]);
        tracker.on_peer_gone([0, 1, 3, 4]);
        let a = tracker.availability().unwrap();
        assert_eq!((0..5).map(|p| a.get(p)).collect::<Vec<_>>(), [3, 1, 2, 1, 2]);
    }

    #[test]
    fn a_seeder_is_asked_for_the_stripe_in_order_then_for_lagging_stripes_tails() {
        let file_infos = make_test_file_infos(21);
        let file_priorities = make_default_file_priorities(&file_infos);
        let mut tracker = PieceTracker::new(make_test_chunk_tracker(21)).with_rarest_first(true);
        // The seeder holds everything; a leecher holds piece 0.
        tracker.on_peer_pieces([], 0..21);
        tracker.on_peer_pieces([], [0]);
        let stripe = Some(Stripe { index: 1, count: 3 });
        let ask = |tracker: &mut PieceTracker| {
            match tracker.acquire_piece(AcquireRequest {
                peer: peer(9),
                peer_avg_time: None,
                priority_pieces: std::iter::empty(),
                file_priorities: &file_priorities,
                file_infos: &file_infos,
                peer_has_piece: |_| true,
                can_steal: |_| false,
                peer_is_seeder: true,
                live_seeders: 1,
                stripe,
            }) {
                AcquireResult::Reserved(p) => Some(p.get()),
                AcquireResult::NoneAvailable => None,
                r => panic!("expected Reserved or NoneAvailable, got {r:?}"),
            }
        };
        let done = |tracker: &mut PieceTracker, pieces: &[u32]| {
            for p in pieces {
                let v = tracker.chunks().get_lengths().validate_piece_index(*p).unwrap();
                tracker.take_inflight(v);
                tracker.mark_piece_hash_ok(v);
            }
        };
        // The stripe in order.
        let stripe_pieces: Vec<u32> = (0..7).map(|_| ask(&mut tracker).unwrap()).collect();
        assert_eq!(stripe_pieces, [1, 4, 7, 10, 13, 16, 19]);
        // Nothing of it left to ask for (in flight or done): 0 comes from
        // the leecher that has it. Of the other stripes this leecher helps
        // with 3, 8, 12 and 17; 3 is among the two lowest left in stripe 0,
        // left to its owner.
        let mut helped: Vec<u32> = (0..3).map(|_| ask(&mut tracker).unwrap()).collect();
        helped.sort();
        assert_eq!(helped, [8, 12, 17]);
        assert_eq!(ask(&mut tracker), None);
        done(&mut tracker, &stripe_pieces);
        assert_eq!(ask(&mut tracker), None);
        // The leecher leaves: starved, the seeder serves everything left.
        tracker.on_peer_gone([0]);
        let mut rest: Vec<u32> = std::iter::from_fn(|| ask(&mut tracker)).collect();
        rest.sort();
        assert_eq!(rest, [0, 2, 3, 5, 6, 9, 11, 14, 15, 18, 20]);
    }

    #[test]
    fn a_leecher_alone_takes_its_first_pieces_at_random_then_in_order() {
        let file_infos = make_test_file_infos(40);
        let file_priorities = make_default_file_priorities(&file_infos);
        let mut tracker = PieceTracker::new(make_test_chunk_tracker(40)).with_rarest_first(true);
        tracker.on_peer_pieces([], 0..40);
        let mut ask = || match tracker.acquire_piece(AcquireRequest {
            peer: peer(9),
            peer_avg_time: None,
            priority_pieces: std::iter::empty(),
            file_priorities: &file_priorities,
            file_infos: &file_infos,
            peer_has_piece: |_| true,
            can_steal: |_| false,
            peer_is_seeder: true,
            live_seeders: 1,
            stripe: Some(Stripe { index: 0, count: 1 }),
        }) {
            AcquireResult::Reserved(p) => p.get(),
            r => panic!("expected Reserved, got {r:?}"),
        };
        let first: Vec<u32> = (0..ALONE_RANDOM_PIECES).map(|_| ask()).collect();
        // In order they would be 0..8: at random, that is one draw in 40!/32!.
        assert_ne!(first, (0..ALONE_RANDOM_PIECES as u32).collect::<Vec<_>>());
        // Then the lowest left, in order.
        let lowest: Vec<u32> = (0..40).filter(|p| !first.contains(p)).take(4).collect();
        let next: Vec<u32> = (0..4).map(|_| ask()).collect();
        assert_eq!(next, lowest);
    }

    // anneal: with rarest-first, a piece in flight from a slow peer is not
    // stolen while the asking peer can reserve a queued piece; once nothing
    // is left to reserve, it is (the 3x rule). The stock tracker steals at
    // once (the 10x rule).
    #[test]
    fn anneal_rarest_first_steals_only_when_nothing_is_queued() {
        let file_infos = make_test_file_infos(2);
        let file_priorities = make_default_file_priorities(&file_infos);
        let ask = |tracker: &mut PieceTracker, who: PeerHandle, avg: Option<Duration>| {
            tracker.acquire_piece(AcquireRequest {
                peer: who,
                peer_avg_time: avg,
                priority_pieces: std::iter::empty(),
                file_priorities: &file_priorities,
                file_infos: &file_infos,
                peer_has_piece: |_| true,
                can_steal: |_| true,
                peer_is_seeder: false,
                live_seeders: 0,
                stripe: None,
            })
        };
        let fast = Some(Duration::from_micros(100));
        for rarest in [true, false] {
            let mut tracker =
                PieceTracker::new(make_test_chunk_tracker(2)).with_rarest_first(rarest);
            tracker.on_peer_pieces([], [0, 1]);
            let slow = match ask(&mut tracker, peer(1), None) {
                AcquireResult::Reserved(p) => p,
                r => panic!("expected Reserved, got {r:?}"),
            };
            // the slow peer's piece has been in flight for more than 10x
            // the fast peer's average
            std::thread::sleep(Duration::from_millis(5));
            match (rarest, ask(&mut tracker, peer(2), fast)) {
                (true, AcquireResult::Reserved(p)) => {
                    assert_ne!(p, slow);
                    match ask(&mut tracker, peer(2), fast) {
                        AcquireResult::Stolen { piece, from_peer } => {
                            assert_eq!((piece, from_peer), (slow, peer(1)));
                        }
                        r => panic!("nothing queued: expected Stolen, got {r:?}"),
                    }
                }
                (false, AcquireResult::Stolen { piece, .. }) => assert_eq!(piece, slow),
                (_, r) => panic!("rarest-first {rarest}: unexpected {r:?}"),
            }
        }
        // Rarest-first: a peer with nothing left for us takes over no piece
        // while another peer's piece is still queued, then does once none is.
        let file_infos = make_test_file_infos(3);
        let file_priorities = make_default_file_priorities(&file_infos);
        let ask = |tracker: &mut PieceTracker, who: PeerHandle, has: &[u32]| {
            tracker.acquire_piece(AcquireRequest {
                peer: who,
                peer_avg_time: fast,
                priority_pieces: std::iter::empty(),
                file_priorities: &file_priorities,
                file_infos: &file_infos,
                peer_has_piece: |p| has.contains(&p.get()),
                can_steal: |_| true,
                peer_is_seeder: false,
                live_seeders: 0,
                stripe: None,
            })
        };
        let mut tracker = PieceTracker::new(make_test_chunk_tracker(3)).with_rarest_first(true);
        tracker.on_peer_pieces([], [0]);
        tracker.on_peer_pieces([], [0, 1]);
        tracker.on_peer_pieces([], [2]);
        assert!(matches!(ask(&mut tracker, peer(1), &[0]), AcquireResult::Reserved(p) if p.get() == 0));
        assert!(matches!(ask(&mut tracker, peer(2), &[0, 1]), AcquireResult::Reserved(p) if p.get() == 1));
        std::thread::sleep(Duration::from_millis(5));
        assert!(matches!(ask(&mut tracker, peer(2), &[0, 1]), AcquireResult::NoneAvailable));
        assert!(matches!(ask(&mut tracker, peer(3), &[2]), AcquireResult::Reserved(p) if p.get() == 2));
        match ask(&mut tracker, peer(2), &[0, 1]) {
            AcquireResult::Stolen { piece, from_peer } => {
                assert_eq!((piece.get(), from_peer), (0, peer(1)));
            }
            r => panic!("endgame: expected Stolen, got {r:?}"),
        }
    }

    #[test]
    fn stock_order_without_rarest_first() {
        let file_infos = make_test_file_infos(5);
        let file_priorities = make_default_file_priorities(&file_infos);
        let mut tracker = PieceTracker::new(make_test_chunk_tracker(5));
        tracker.on_peer_pieces([], [1, 2, 3, 4]);
        assert!(tracker.availability().is_none());
        match tracker.acquire_piece(AcquireRequest {
            peer: peer(1),
            peer_avg_time: None,
            priority_pieces: std::iter::empty(),
            file_priorities: &file_priorities,
            file_infos: &file_infos,
            peer_has_piece: |_| true,
            can_steal: |_| false,
            peer_is_seeder: false,
            live_seeders: 0,
            stripe: None,
        }) {
            AcquireResult::Reserved(p) => assert_eq!(p.get(), 0),
            r => panic!("expected Reserved(0), got {r:?}"),
        }
    }

    #[test]
    fn test_take_inflight_nonexistent_piece_returns_none() {
        let chunks = make_test_chunk_tracker(5);
        let mut tracker = PieceTracker::new(chunks);
        let piece = tracker
            .chunks()
            .get_lengths()
            .validate_piece_index(0)
            .unwrap();

        // Try to take a piece that's not in-flight
        let result = tracker.take_inflight(piece);
        assert!(result.is_none());
    }

    #[test]
    fn test_steal_only_pieces_peer_has() {
        // This test verifies the fix for a bug where try_steal didn't check
        // if the stealing peer actually has the piece in their bitfield.
        // Without this check, a peer could "steal" a piece they can't download,
        // leaving it stuck in inflight forever.

        let chunks = make_test_chunk_tracker(5);
        let mut tracker = PieceTracker::new(chunks);

        let file_infos = make_test_file_infos(5);
        let file_priorities = make_default_file_priorities(&file_infos);

        let peer_a = peer(1);
        let peer_b = peer(2);

        // Peer A reserves pieces 0 and 4 (first two in iteration order)
        let piece_0 = match tracker.acquire_piece(AcquireRequest {
            peer: peer_a,
            peer_avg_time: None,
            priority_pieces: std::iter::empty(),
            file_priorities: &file_priorities,
            file_infos: &file_infos,
            peer_has_piece: |_| true,
            can_steal: |_| true,
            peer_is_seeder: false,
            live_seeders: 0,
            stripe: None,
        }) {
            AcquireResult::Reserved(p) => {
                assert_eq!(p.get(), 0);
                p
            }
            _ => panic!("Expected Reserved"),
        };

        let piece_4 = match tracker.acquire_piece(AcquireRequest {
            peer: peer_a,
            peer_avg_time: None,
            priority_pieces: std::iter::empty(),
            file_priorities: &file_priorities,
            file_infos: &file_infos,
            peer_has_piece: |_| true,
            can_steal: |_| true,
            peer_is_seeder: false,
            live_seeders: 0,
            stripe: None,
        }) {
            AcquireResult::Reserved(p) => {
                assert_eq!(p.get(), 4);
                p
            }
            _ => panic!("Expected Reserved"),
        };

        // Sleep briefly so pieces become stealable
        std::thread::sleep(Duration::from_millis(5));

        // Peer B tries to acquire with:
        // - Very short avg_time (1ms) so 3x threshold = 3ms < 5ms elapsed
        // - peer_has_piece returns true ONLY for piece 4, NOT piece 0
        let result = tracker.acquire_piece(AcquireRequest {
            peer: peer_b,
            peer_avg_time: Some(Duration::from_millis(1)),
            priority_pieces: std::iter::empty(),
            file_priorities: &file_priorities,
            file_infos: &file_infos,
            peer_has_piece: |p| p.get() == 4, // Peer B only has piece 4
            can_steal: |_| true,
            peer_is_seeder: false,
            live_seeders: 0,
            stripe: None,
        });

        // Should steal piece 4 (which peer B has), NOT piece 0 (which peer B doesn't have)
        match result {
            AcquireResult::Stolen { piece, from_peer } => {
                assert_eq!(piece, piece_4, "Should steal piece 4 (the one peer B has)");
                assert_eq!(from_peer, peer_a);
                // Verify piece 0 is still owned by peer A (wasn't stolen)
                assert_eq!(tracker.get_inflight(piece_0).unwrap().peer, peer_a);
            }
            _ => panic!("Expected Stolen, got {:?}", result),
        }
    }
}
