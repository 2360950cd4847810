//! Partition content format: capture used blocks, publish as pieces, restore
//! at disk offsets.
//!
//! A partition's content is a *stream* (its used extents concatenated in disk
//! order) and an *index* (header, extent list, SHA-1 per fixed-length piece,
//! SHA-256 of the stream). The stream is a BitTorrent v1 payload and can be
//! served over HTTP ranges as is; the index maps every piece to disk ranges.
//! Byte layout: docs/content-format.md.
#![cfg_attr(test, allow(clippy::too_many_lines))]

pub mod capture;
pub mod extents;
pub mod format;
pub mod fs;
pub mod layout;
pub mod partclone;
pub mod qcow2;
pub mod restore;
pub mod source;
pub mod torrent;
pub mod write;

pub use format::{CONTRACT_VERSION, ContentIndex, PieceRange};
