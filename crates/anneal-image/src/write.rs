//! The one content write pipeline (docs/content-format.md, "Writing a
//! content"). Every source of pieces (a content's stream file, HTTP ranges,
//! BitTorrent) verifies each piece against the index's SHA-1
//! ([`piece_matches`]) and hands it to a [`SlotWriter`], the only code that
//! writes content bytes to a target:
//!
//! 1. the slot is checked before any byte is written: the content fits
//!    the slot and the slot the target ([`check_slot`]);
//! 2. the ranges between the extents are zeroed when the content's flags
//!    say so (`FLAG_GAPS_ZERO`: a raw capture, whose gaps hold zeros the
//!    stream left out), so the old bytes of the disk never show through;
//! 3. each piece's disk ranges go to `slot + disk offset`, a run of
//!    pieces contiguous on the disk as one vectored write, `O_DIRECT`
//!    where the target allows ([`Target`]);
//! 4. the pieces written are recorded (each counted once, whichever source
//!    brought it) for progress and for whoever waits on a piece;
//! 5. [`SlotWriter::sync`] flushes the target.
//!
//! The sources that deliver pieces in stream order (the stream file, HTTP
//! ranges) share the rest of the pipeline too: [`pump`] reads them into
//! aligned buffers, verifies, restores the order, retries, and feeds the
//! writer. BitTorrent delivers verified pieces in any order and calls the
//! writer from its storage.

use std::borrow::Borrow;
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::Duration;

use sha1::Digest as _;

use crate::format::{ContentIndex, FLAG_GAPS_ZERO, extent_starts, ranges_in};
use crate::restore::Target;

mod pump;
pub use pump::{PieceSource, PumpError, PumpOptions, Pumped, pump};

/// Where a content goes on its target: `size` bytes from `offset`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotRange {
    /// First byte of the slot on the target.
    pub offset: u64,
    /// Bytes in the slot.
    pub size: u64,
}

/// Errors of writing a content onto its slot.
#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    /// The content's partition does not fit its slot.
    #[error(
        "content {content} ({partition_size} bytes) is larger than its slot ({slot_size} bytes): give it a slot of at least {partition_size} bytes"
    )]
    TooLarge {
        /// content name
        content: String,
        /// the content's partition size
        partition_size: u64,
        /// the slot's size
        slot_size: u64,
    },
    /// The slot does not fit the target.
    #[error(
        "the slot of content {content} ({size} bytes at offset {offset}) ends past the end of the target ({target_size} bytes): place the slot inside the target"
    )]
    PastEnd {
        /// content name
        content: String,
        /// slot offset
        offset: u64,
        /// slot size
        size: u64,
        /// target size
        target_size: u64,
    },
    /// A piece index the content does not have.
    #[error(
        "content {content} has {pieces} pieces, not a piece {piece}: the source sent a piece of another content"
    )]
    NoSuchPiece {
        /// content name
        content: String,
        /// piece index given
        piece: u64,
        /// pieces of the content
        pieces: u64,
    },
    /// A piece buffer shorter than the piece.
    #[error("piece {piece} of content {content} has {have} bytes, the index says {need}")]
    ShortPiece {
        /// content name
        content: String,
        /// piece index
        piece: u64,
        /// bytes given
        have: usize,
        /// the piece's length
        need: u64,
    },
    /// Zeroing a gap between extents failed.
    #[error("zeroing target bytes {start}..{end} between the extents of content {content}")]
    Zero {
        /// content name
        content: String,
        /// first target byte
        start: u64,
        /// end of the gap on the target
        end: u64,
        /// cause
        #[source]
        source: io::Error,
    },
    /// Writing pieces failed.
    #[error("writing {pieces} of content {content} at target offset {offset} ({len} bytes)")]
    Write {
        /// content name
        content: String,
        /// `piece 3` or `pieces 3..=5`
        pieces: String,
        /// target offset
        offset: u64,
        /// bytes
        len: u64,
        /// cause
        #[source]
        source: io::Error,
    },
    /// The flush after the last piece failed.
    #[error("flushing content {content} to the target")]
    Sync {
        /// content name
        content: String,
        /// cause
        #[source]
        source: io::Error,
    },
}

/// Checks that `index`'s content fits `slot` and `slot` a target of
/// `target_size` bytes; writes nothing (for checking every content of a
/// disk before the first write).
pub fn check_slot(
    content: &str,
    index: &ContentIndex,
    slot: SlotRange,
    target_size: u64,
) -> Result<(), WriteError> {
    let partition_size = index.header.partition_size;
    if partition_size > slot.size {
        return Err(WriteError::TooLarge {
            content: content.to_string(),
            partition_size,
            slot_size: slot.size,
        });
    }
    if slot
        .offset
        .checked_add(slot.size)
        .is_none_or(|e| e > target_size)
    {
        return Err(WriteError::PastEnd {
            content: content.to_string(),
            offset: slot.offset,
            size: slot.size,
            target_size,
        });
    }
    Ok(())
}

/// Whether `data` is piece `i` of `index` (its SHA-1 and its length).
pub fn piece_matches(index: &ContentIndex, i: u64, data: &[u8]) -> bool {
    let Some(want) = usize::try_from(i)
        .ok()
        .and_then(|i| index.piece_hashes.get(i))
    else {
        return false;
    };
    data.len() as u64 == index.piece_len(i) && sha1::Sha1::digest(data).as_slice() == want
}

/// Pieces and stream bytes written so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Progress {
    /// Pieces written (each once).
    pub pieces: u64,
    /// Stream bytes of those pieces.
    pub bytes: u64,
}

/// The writer of one content onto its slot (see the module comment). `T`
/// is the target, owned or borrowed; `I` the content's index, likewise.
#[derive(Debug)]
pub struct SlotWriter<T, I> {
    target: T,
    index: I,
    slot: SlotRange,
    content: String,
    /// Stream offset of each extent.
    starts: Vec<u64>,
    written: Mutex<Vec<bool>>,
    /// Notified each time a piece is written.
    written_cv: Condvar,
    pieces: AtomicU64,
    bytes: AtomicU64,
}

impl<T: Borrow<Target>, I: Borrow<ContentIndex>> SlotWriter<T, I> {
    /// Checks the slot ([`check_slot`]) and then zeroes the gaps between
    /// the extents when the content's flags say so: the first write.
    pub fn open(target: T, slot: SlotRange, content: &str, index: I) -> Result<Self, WriteError> {
        check_slot(content, index.borrow(), slot, target.borrow().size())?;
        let ix: &ContentIndex = index.borrow();
        let starts = extent_starts(&ix.extents);
        let pieces = usize::try_from(ix.piece_count()).unwrap_or(usize::MAX);
        let w = SlotWriter {
            target,
            index,
            slot,
            content: content.to_string(),
            starts,
            written: Mutex::new(vec![false; pieces]),
            written_cv: Condvar::new(),
            pieces: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
        };
        w.zero_gaps()?;
        Ok(w)
    }

    /// The target.
    pub fn target(&self) -> &Target {
        self.target.borrow()
    }

    /// The content's index.
    pub fn index(&self) -> &ContentIndex {
        self.index.borrow()
    }

    /// The slot.
    pub fn slot(&self) -> SlotRange {
        self.slot
    }

    /// The content's name.
    pub fn content(&self) -> &str {
        &self.content
    }

    /// Pieces and bytes written so far.
    pub fn progress(&self) -> Progress {
        Progress {
            pieces: self.pieces.load(Ordering::Relaxed),
            bytes: self.bytes.load(Ordering::Relaxed),
        }
    }

    /// Whether piece `i` has been written.
    pub fn is_written(&self, i: u64) -> bool {
        self.written
            .lock()
            .is_ok_and(|w| usize::try_from(i).ok().and_then(|i| w.get(i)) == Some(&true))
    }

    /// Waits at most `timeout` for piece `i` to be written; whether it is.
    pub fn wait_written(&self, i: u64, timeout: Duration) -> bool {
        let Ok(i) = usize::try_from(i) else {
            return false;
        };
        let Ok(w) = self.written.lock() else {
            return false;
        };
        self.written_cv
            .wait_timeout_while(w, timeout, |w| w.get(i) == Some(&false))
            .is_ok_and(|(w, _)| w.get(i) == Some(&true))
    }

    /// Makes the ranges of the slot outside the extents read as zero when
    /// the content has `FLAG_GAPS_ZERO` (up to the content's partition
    /// size; a larger slot's tail is the filesystem's business).
    fn zero_gaps(&self) -> Result<(), WriteError> {
        let ix = self.index();
        if ix.header.flags & FLAG_GAPS_ZERO == 0 {
            return Ok(());
        }
        let base = self.slot.offset;
        let mut pos = 0u64;
        let ends = ix.extents.iter().map(|e| (e.offset, e.end()));
        for (start, end) in ends.chain([(ix.header.partition_size, 0)]) {
            if start > pos {
                self.target()
                    .zero_range(base + pos, start - pos)
                    .map_err(|source| WriteError::Zero {
                        content: self.content.clone(),
                        start: base + pos,
                        end: base + start,
                        source,
                    })?;
            }
            pos = end;
        }
        Ok(())
    }

    /// The first `piece_len(i)` bytes of `buf`, piece `i` of the content.
    fn piece_data<'b>(&self, i: u64, buf: &'b [u8]) -> Result<&'b [u8], WriteError> {
        let ix = self.index();
        if i >= ix.piece_count() {
            return Err(WriteError::NoSuchPiece {
                content: self.content.clone(),
                piece: i,
                pieces: ix.piece_count(),
            });
        }
        let need = ix.piece_len(i);
        buf.get(..need as usize)
            .ok_or_else(|| WriteError::ShortPiece {
                content: self.content.clone(),
                piece: i,
                have: buf.len(),
                need,
            })
    }

    /// Writes verified pieces `first, first+1, …` (`bufs`, each at least
    /// its piece's length: an aligned buffer may be longer) at their disk
    /// ranges, each stretch contiguous on the disk as one write, and
    /// records them as written.
    pub fn write_pieces(&self, first: u64, bufs: &[&[u8]]) -> Result<(), WriteError> {
        let ix = self.index();
        let pl = u64::from(ix.header.piece_length);
        let mut seg = Segment::default();
        for (i, buf) in (first..).zip(bufs) {
            let data = self.piece_data(i, buf)?;
            let start = i * pl;
            let ranges = ranges_in(&ix.extents, &self.starts, start, start + data.len() as u64);
            for r in ranges {
                let a = (r.stream_offset - start) as usize;
                let at = self.slot.offset + r.disk_offset;
                if !seg.bufs.is_empty() && at != seg.end {
                    self.write_segment(&seg)?;
                    seg.bufs.clear();
                }
                if seg.bufs.is_empty() {
                    (seg.at, seg.end, seg.first) = (at, at, i);
                }
                seg.bufs.push(&data[a..a + r.len as usize]);
                seg.end += r.len;
                seg.last = i;
            }
        }
        if !seg.bufs.is_empty() {
            self.write_segment(&seg)?;
        }
        self.mark_written(first, bufs.len() as u64);
        Ok(())
    }

    /// Writes verified piece `i` unless it is already written (a piece
    /// brought by two sources is written once).
    pub fn write_piece(&self, i: u64, buf: &[u8]) -> Result<(), WriteError> {
        if self.is_written(i) {
            return Ok(());
        }
        self.write_pieces(i, &[buf])
    }

    fn write_segment(&self, seg: &Segment<'_>) -> Result<(), WriteError> {
        let res = if seg.end > self.slot.offset + self.slot.size {
            Err(io::Error::other("the write would end past the slot"))
        } else {
            self.target().write_vectored_at(&seg.bufs, seg.at)
        };
        res.map_err(|source| WriteError::Write {
            content: self.content.clone(),
            pieces: if seg.first == seg.last {
                format!("piece {}", seg.first)
            } else {
                format!("pieces {}..={}", seg.first, seg.last)
            },
            offset: seg.at,
            len: seg.end - seg.at,
            source,
        })
    }

    /// Records pieces `first..first+n` as written, each counted once.
    fn mark_written(&self, first: u64, n: u64) {
        let ix = self.index();
        let (mut pieces, mut bytes) = (0u64, 0u64);
        if let Ok(mut w) = self.written.lock() {
            for i in first..first + n {
                if let Some(slot) = usize::try_from(i).ok().and_then(|i| w.get_mut(i))
                    && !*slot
                {
                    *slot = true;
                    pieces += 1;
                    bytes += ix.piece_len(i);
                }
            }
        }
        self.pieces.fetch_add(pieces, Ordering::Relaxed);
        self.bytes.fetch_add(bytes, Ordering::Relaxed);
        self.written_cv.notify_all();
    }

    /// Reads stream bytes `[offset, offset + buf.len())` back from the
    /// slot (what was written there).
    pub fn read_stream(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        let ix = self.index();
        let end = offset + buf.len() as u64;
        for r in ranges_in(&ix.extents, &self.starts, offset, end) {
            let at = (r.stream_offset - offset) as usize;
            self.target().read_exact_at(
                &mut buf[at..at + r.len as usize],
                self.slot.offset + r.disk_offset,
            )?;
        }
        Ok(())
    }

    /// Flushes the target (both descriptors).
    pub fn sync(&self) -> Result<(), WriteError> {
        self.target().sync().map_err(|source| WriteError::Sync {
            content: self.content.clone(),
            source,
        })
    }
}

/// A stretch of piece ranges contiguous on the disk: one write.
#[derive(Default)]
struct Segment<'b> {
    bufs: Vec<&'b [u8]>,
    at: u64,
    end: u64,
    first: u64,
    last: u64,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::extents::Extent;
    use crate::format::Header;

    /// A content of two extents with a gap, in 16 KiB pieces, with the
    /// given flags; returns it and its stream.
    fn content(flags: u8) -> (ContentIndex, Vec<u8>) {
        let extents = vec![
            Extent {
                offset: 4096,
                len: 20_480,
            },
            Extent {
                offset: 65_536,
                len: 16_384,
            },
        ];
        let stream: Vec<u8> = (0..36_864u32).map(|i| (i % 251) as u8 + 1).collect();
        let pl = 16_384usize;
        let piece_hashes = stream
            .chunks(pl)
            .map(|c| sha1::Sha1::digest(c).into())
            .collect();
        let index = ContentIndex {
            header: Header {
                block_size: 4096,
                piece_length: pl as u32,
                partition_size: 131_072,
                used_bytes: stream.len() as u64,
                last_extent_end: 81_920,
                fs_type: "raw".into(),
                flags,
                uuid: Vec::new(),
                label: String::new(),
                stream_sha256: [0; 32],
            },
            extents,
            piece_hashes,
        };
        index.validate().unwrap();
        (index, stream)
    }

    fn target(len: usize) -> (tempfile::TempDir, std::path::PathBuf, Target) {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("t");
        std::fs::write(&p, vec![0xFFu8; len]).unwrap();
        let t = Target::open(&p, None).unwrap();
        (d, p, t)
    }

    /// Pieces written in any order, one of them twice, onto a slot of a
    /// target full of 0xFF: the slot reads as the partition (zeros in the
    /// gaps), the bytes around it are untouched, each piece counted once.
    #[test]
    fn pieces_and_zeroed_gaps_make_the_partition() {
        let (ix, stream) = content(FLAG_GAPS_ZERO);
        let (_d, p, t) = target(4096 + 131_072 + 4096);
        let slot = SlotRange {
            offset: 4096,
            size: 131_072,
        };
        let w = SlotWriter::open(&t, slot, "c", &ix).unwrap();
        let pieces: Vec<&[u8]> = stream.chunks(16_384).collect();
        assert!(
            pieces
                .iter()
                .enumerate()
                .all(|(i, b)| piece_matches(&ix, i as u64, b))
        );
        assert!(!piece_matches(&ix, 0, pieces[1]));
        w.write_piece(2, pieces[2]).unwrap();
        w.write_pieces(0, &pieces[..2]).unwrap();
        w.write_piece(1, pieces[1]).unwrap();
        w.sync().unwrap();
        assert_eq!(
            w.progress(),
            Progress {
                pieces: 3,
                bytes: stream.len() as u64
            }
        );
        assert!(w.wait_written(2, Duration::ZERO));
        let mut back = vec![0u8; stream.len()];
        w.read_stream(0, &mut back).unwrap();
        assert!(back == stream);
        let got = std::fs::read(&p).unwrap();
        let mut want = vec![0u8; 131_072];
        want[4096..24_576].copy_from_slice(&stream[..20_480]);
        want[65_536..81_920].copy_from_slice(&stream[20_480..]);
        assert!(got[..4096].iter().all(|x| *x == 0xFF));
        assert!(got[4096..4096 + 131_072] == want[..]);
        assert!(got[4096 + 131_072..].iter().all(|x| *x == 0xFF));
    }

    /// Without the flag the gaps keep what the target held.
    #[test]
    fn without_the_flag_the_gaps_are_left_alone() {
        let (ix, stream) = content(0);
        let (_d, p, t) = target(131_072);
        let slot = SlotRange {
            offset: 0,
            size: 131_072,
        };
        let w = SlotWriter::open(&t, slot, "c", &ix).unwrap();
        let pieces: Vec<&[u8]> = stream.chunks(16_384).collect();
        w.write_pieces(0, &pieces).unwrap();
        let got = std::fs::read(&p).unwrap();
        assert!(got[..4096].iter().all(|x| *x == 0xFF));
        assert!(got[24_576..65_536].iter().all(|x| *x == 0xFF));
    }

    /// A slot smaller than the content, or past the end of the target, is
    /// refused before any write; so is a piece of another content.
    #[test]
    fn a_slot_that_does_not_fit_is_refused_before_any_write() {
        let (ix, stream) = content(FLAG_GAPS_ZERO);
        let (_d, p, t) = target(131_072 + 4096);
        let small = SlotRange {
            offset: 0,
            size: 131_072 - 4096,
        };
        let e = SlotWriter::open(&t, small, "c", &ix).unwrap_err();
        assert!(matches!(e, WriteError::TooLarge { .. }), "{e}");
        assert!(e.to_string().contains("larger than its slot"), "{e}");
        let past = SlotRange {
            offset: 8192,
            size: 131_072,
        };
        let e = SlotWriter::open(&t, past, "c", &ix).unwrap_err();
        assert!(matches!(e, WriteError::PastEnd { .. }), "{e}");
        assert!(!t.wrote());
        let got = std::fs::read(&p).unwrap();
        assert!(got.iter().all(|x| *x == 0xFF));
        let ok = SlotRange {
            offset: 0,
            size: 131_072,
        };
        let w = SlotWriter::open(&t, ok, "c", &ix).unwrap();
        let e = w.write_piece(3, &stream[..100]).unwrap_err();
        assert!(matches!(e, WriteError::NoSuchPiece { .. }), "{e}");
        let e = w.write_piece(0, &stream[..100]).unwrap_err();
        assert!(matches!(e, WriteError::ShortPiece { .. }), "{e}");
    }
}
