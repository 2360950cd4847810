//! BitTorrent v1 metainfo for a content stream, made from its index alone
//! (BEP 3), and the bencoding it needs.
//!
//! The content format's pieces are the torrent's pieces: the index holds the
//! piece length, the stream length and one SHA-1 per piece in order, which
//! is everything a single-file v1 `info` dictionary has besides its `name`.
//! So the torrent (and its info hash) follows from the index, with no read
//! of the stream: the content store, the verify workload and a seeder all
//! make the same bytes.
//!
//! - `info` = `{length, name, piece length, pieces}` (keys in raw byte
//!   order, as bencoding requires); `name` is [`torrent_name`] of the
//!   content; nothing else (no `private`: DHT and local discovery are
//!   switched off by the clients we run, not by the torrent).
//! - the info hash is the SHA-1 of the bencoded `info` dictionary.
//! - `announce` is present only when a tracker URL is given; it is outside
//!   `info`, so the info hash does not depend on it.
//!
//! [`decode`] reads bencoding strictly (canonical integers, sorted unique
//! keys, bounded depth, no trailing bytes): it serves the tests and the
//! tracker, never untrusted input larger than its caller bounds.

use std::collections::BTreeMap;

use sha1::{Digest as _, Sha1};

use crate::format::{ContentIndex, PIECE_HASH_LEN};

/// Deepest nesting of lists and dictionaries [`decode`] accepts.
pub const MAX_DEPTH: usize = 32;

/// A bencoded value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Value {
    /// `i<n>e`
    Int(i64),
    /// `<len>:<bytes>`
    Bytes(Vec<u8>),
    /// `l…e`
    List(Vec<Value>),
    /// `d…e`, keys in raw byte order.
    Dict(BTreeMap<Vec<u8>, Value>),
}

impl Value {
    /// A byte string from text.
    pub fn str(s: &str) -> Self {
        Self::Bytes(s.as_bytes().to_vec())
    }

    /// A dictionary from `(key, value)` pairs.
    pub fn dict<'a>(pairs: impl IntoIterator<Item = (&'a str, Value)>) -> Self {
        Self::Dict(
            pairs
                .into_iter()
                .map(|(k, v)| (k.as_bytes().to_vec(), v))
                .collect(),
        )
    }

    /// The value under `key` of a dictionary.
    pub fn get(&self, key: &str) -> Option<&Value> {
        match self {
            Self::Dict(d) => d.get(key.as_bytes()),
            _ => None,
        }
    }

    /// The integer, if this is one.
    pub fn as_int(&self) -> Option<i64> {
        match self {
            Self::Int(i) => Some(*i),
            _ => None,
        }
    }

    /// The bytes, if this is a byte string.
    pub fn as_bytes(&self) -> Option<&[u8]> {
        match self {
            Self::Bytes(b) => Some(b),
            _ => None,
        }
    }

    /// The bencoding of this value.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        self.encode_into(&mut out);
        out
    }

    /// Appends the bencoding of this value to `out`.
    pub fn encode_into(&self, out: &mut Vec<u8>) {
        match self {
            Self::Int(i) => {
                out.push(b'i');
                out.extend_from_slice(i.to_string().as_bytes());
                out.push(b'e');
            }
            Self::Bytes(b) => {
                out.extend_from_slice(b.len().to_string().as_bytes());
                out.push(b':');
                out.extend_from_slice(b);
            }
            Self::List(l) => {
                out.push(b'l');
                for v in l {
                    v.encode_into(out);
                }
                out.push(b'e');
            }
            Self::Dict(d) => {
                out.push(b'd');
                for (k, v) in d {
                    out.extend_from_slice(k.len().to_string().as_bytes());
                    out.push(b':');
                    out.extend_from_slice(k);
                    v.encode_into(out);
                }
                out.push(b'e');
            }
        }
    }
}

/// Why bencoded bytes were refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BencodeError {
    /// The input ended inside a value.
    #[error("bencoding ends inside a value at byte {0}")]
    Truncated(usize),
    /// A byte that starts no value, or a malformed integer or length.
    #[error("malformed bencoding at byte {0}")]
    Malformed(usize),
    /// Dictionary keys out of order or repeated.
    #[error("dictionary key at byte {0} is not greater than the previous one")]
    KeyOrder(usize),
    /// Nesting deeper than [`MAX_DEPTH`].
    #[error("bencoding nested deeper than {MAX_DEPTH} at byte {0}")]
    TooDeep(usize),
    /// Bytes after the top-level value.
    #[error("{0} trailing bytes after the value")]
    Trailing(usize),
}

/// Decodes exactly one value filling `b`.
pub fn decode(b: &[u8]) -> Result<Value, BencodeError> {
    let (v, end) = decode_at(b, 0, 0)?;
    if end != b.len() {
        return Err(BencodeError::Trailing(b.len() - end));
    }
    Ok(v)
}

/// Decodes one value starting at `pos`; returns it and the offset after it.
pub fn decode_at(b: &[u8], pos: usize, depth: usize) -> Result<(Value, usize), BencodeError> {
    match b.get(pos) {
        None => Err(BencodeError::Truncated(pos)),
        Some(b'i') => {
            let end = find(b, pos + 1, b'e')?;
            let n = canonical_int(&b[pos + 1..end]).ok_or(BencodeError::Malformed(pos))?;
            Ok((Value::Int(n), end + 1))
        }
        Some(b'0'..=b'9') => {
            let (s, end) = bytes_at(b, pos)?;
            Ok((Value::Bytes(s.to_vec()), end))
        }
        Some(b'l') => {
            if depth >= MAX_DEPTH {
                return Err(BencodeError::TooDeep(pos));
            }
            let mut items = Vec::new();
            let mut at = pos + 1;
            loop {
                match b.get(at) {
                    None => return Err(BencodeError::Truncated(at)),
                    Some(b'e') => return Ok((Value::List(items), at + 1)),
                    Some(_) => {
                        let (v, next) = decode_at(b, at, depth + 1)?;
                        items.push(v);
                        at = next;
                    }
                }
            }
        }
        Some(b'd') => {
            if depth >= MAX_DEPTH {
                return Err(BencodeError::TooDeep(pos));
            }
            let mut map = BTreeMap::new();
            let mut last: Option<Vec<u8>> = None;
            let mut at = pos + 1;
            loop {
                match b.get(at) {
                    None => return Err(BencodeError::Truncated(at)),
                    Some(b'e') => return Ok((Value::Dict(map), at + 1)),
                    Some(_) => {
                        let (k, next) = bytes_at(b, at)?;
                        if last.as_deref().is_some_and(|l| l >= k) {
                            return Err(BencodeError::KeyOrder(at));
                        }
                        let (v, after) = decode_at(b, next, depth + 1)?;
                        last = Some(k.to_vec());
                        map.insert(k.to_vec(), v);
                        at = after;
                    }
                }
            }
        }
        Some(_) => Err(BencodeError::Malformed(pos)),
    }
}

fn find(b: &[u8], from: usize, byte: u8) -> Result<usize, BencodeError> {
    b.get(from..)
        .and_then(|rest| rest.iter().position(|&c| c == byte))
        .map(|i| from + i)
        .ok_or(BencodeError::Truncated(b.len()))
}

/// `i…e` digits: no leading zeros, no `-0`, no empty number.
fn canonical_int(s: &[u8]) -> Option<i64> {
    let digits = s.strip_prefix(b"-").unwrap_or(s);
    if digits.is_empty()
        || !digits.iter().all(u8::is_ascii_digit)
        || (digits.len() > 1 && digits[0] == b'0')
        || (s[0] == b'-' && digits == b"0")
    {
        return None;
    }
    std::str::from_utf8(s).ok()?.parse().ok()
}

/// A byte string at `pos`: its bytes and the offset after it.
fn bytes_at(b: &[u8], pos: usize) -> Result<(&[u8], usize), BencodeError> {
    let colon = find(b, pos, b':')?;
    let len_s = &b[pos..colon];
    if len_s.is_empty()
        || !len_s.iter().all(u8::is_ascii_digit)
        || (len_s.len() > 1 && len_s[0] == b'0')
    {
        return Err(BencodeError::Malformed(pos));
    }
    let len: usize = std::str::from_utf8(len_s)
        .ok()
        .and_then(|s| s.parse().ok())
        .ok_or(BencodeError::Malformed(pos))?;
    let start = colon + 1;
    let end = start
        .checked_add(len)
        .filter(|&e| e <= b.len())
        .ok_or(BencodeError::Truncated(b.len()))?;
    Ok((&b[start..end], end))
}

/// The torrent `name` of content `content`: `<content>.stream` (the file a
/// BitTorrent client writes, and the file a seeder reads, in its directory).
pub fn torrent_name(content: &str) -> String {
    format!("{content}.stream")
}

/// Why a metainfo was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TorrentError {
    /// Not bencoding.
    #[error("metainfo is not valid bencoding")]
    Bencode(#[source] BencodeError),
    /// A required key is missing or has the wrong type.
    #[error("metainfo has no valid {0:?}")]
    Field(&'static str),
    /// The piece hashes do not match the length and piece length.
    #[error("metainfo has {got} piece hashes for {length} bytes in pieces of {piece_length}")]
    Pieces {
        /// Hashes present.
        got: usize,
        /// `length`.
        length: u64,
        /// `piece length`.
        piece_length: u64,
    },
}

/// A single-file BitTorrent v1 metainfo.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Metainfo {
    /// The tracker's announce URL, if any.
    pub announce: Option<String>,
    /// `info.name`.
    pub name: String,
    /// `info.length`: bytes of the file (the content stream).
    pub length: u64,
    /// `info.piece length`.
    pub piece_length: u64,
    /// `info.pieces`, one SHA-1 per piece.
    pub pieces: Vec<[u8; PIECE_HASH_LEN]>,
}

impl Metainfo {
    /// The torrent of content `content` described by `index` (its stream is
    /// the torrent's single file).
    pub fn from_index(index: &ContentIndex, content: &str, announce: Option<&str>) -> Self {
        Self {
            announce: announce.map(str::to_string),
            name: torrent_name(content),
            length: index.header.used_bytes,
            piece_length: u64::from(index.header.piece_length),
            pieces: index.piece_hashes.clone(),
        }
    }

    /// The `info` dictionary.
    pub fn info(&self) -> Value {
        let pieces: Vec<u8> = self.pieces.iter().flatten().copied().collect();
        Value::dict([
            ("length", Value::Int(clamp(self.length))),
            ("name", Value::str(&self.name)),
            ("piece length", Value::Int(clamp(self.piece_length))),
            ("pieces", Value::Bytes(pieces)),
        ])
    }

    /// The bencoded `info` dictionary (what the info hash is taken over).
    pub fn info_bytes(&self) -> Vec<u8> {
        self.info().encode()
    }

    /// The info hash: SHA-1 of the bencoded `info` dictionary.
    pub fn info_hash(&self) -> [u8; 20] {
        Sha1::digest(self.info_bytes()).into()
    }

    /// The info hash, lowercase hex (`status.infoHash`).
    pub fn info_hash_hex(&self) -> String {
        hex::encode(self.info_hash())
    }

    /// The `.torrent` file.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut top = BTreeMap::new();
        if let Some(a) = &self.announce {
            top.insert(b"announce".to_vec(), Value::str(a));
        }
        top.insert(b"info".to_vec(), self.info());
        Value::Dict(top).encode()
    }

    /// Reads a single-file v1 `.torrent` (the form [`Metainfo::to_bytes`]
    /// writes; other keys are ignored).
    pub fn parse(b: &[u8]) -> Result<Self, TorrentError> {
        let top = decode(b).map_err(TorrentError::Bencode)?;
        let announce = match top.get("announce") {
            None => None,
            Some(v) => Some(
                v.as_bytes()
                    .and_then(|s| std::str::from_utf8(s).ok())
                    .ok_or(TorrentError::Field("announce"))?
                    .to_string(),
            ),
        };
        let info = top.get("info").ok_or(TorrentError::Field("info"))?;
        let name = info
            .get("name")
            .and_then(Value::as_bytes)
            .and_then(|s| std::str::from_utf8(s).ok())
            .ok_or(TorrentError::Field("name"))?
            .to_string();
        let uint = |k: &'static str| {
            info.get(k)
                .and_then(Value::as_int)
                .and_then(|i| u64::try_from(i).ok())
                .ok_or(TorrentError::Field(k))
        };
        let length = uint("length")?;
        let piece_length = uint("piece length")?;
        if piece_length == 0 {
            return Err(TorrentError::Field("piece length"));
        }
        let raw = info
            .get("pieces")
            .and_then(Value::as_bytes)
            .ok_or(TorrentError::Field("pieces"))?;
        let chunks = raw.chunks_exact(PIECE_HASH_LEN);
        if !chunks.remainder().is_empty() || chunks.len() as u64 != length.div_ceil(piece_length) {
            return Err(TorrentError::Pieces {
                got: raw.len() / PIECE_HASH_LEN,
                length,
                piece_length,
            });
        }
        let pieces = chunks
            .map(|c| {
                let mut h = [0u8; PIECE_HASH_LEN];
                h.copy_from_slice(c);
                h
            })
            .collect();
        Ok(Self {
            announce,
            name,
            length,
            piece_length,
            pieces,
        })
    }
}

/// Lengths fit i64 for any stream a content index accepts.
fn clamp(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::*;

    #[test]
    fn bencode_golden() {
        // BEP 3's own examples
        assert_eq!(Value::str("spam").encode(), b"4:spam");
        assert_eq!(Value::Int(3).encode(), b"i3e");
        assert_eq!(Value::Int(-3).encode(), b"i-3e");
        assert_eq!(Value::Int(0).encode(), b"i0e");
        assert_eq!(
            Value::List(vec![Value::str("spam"), Value::str("eggs")]).encode(),
            b"l4:spam4:eggse"
        );
        assert_eq!(
            Value::dict([("cow", Value::str("moo")), ("spam", Value::str("eggs"))]).encode(),
            b"d3:cow3:moo4:spam4:eggse"
        );
        assert_eq!(
            Value::dict([("spam", Value::List(vec![Value::str("a"), Value::str("b")]))]).encode(),
            b"d4:spaml1:a1:bee"
        );
        // keys sorted as raw bytes whatever the insertion order
        assert_eq!(
            Value::dict([("piece length", Value::Int(1)), ("name", Value::str(""))]).encode(),
            b"d4:name0:12:piece lengthi1ee"
        );
        assert_eq!(Value::Bytes(vec![]).encode(), b"0:");
    }

    #[test]
    fn decode_roundtrip_and_refusals() {
        for b in [
            &b"4:spam"[..],
            b"i-42e",
            b"l4:spam4:eggse",
            b"d3:cow3:moo4:spam4:eggse",
            b"d1:ad1:bli1ei2eeee",
            b"0:",
            b"le",
            b"de",
        ] {
            assert_eq!(
                decode(b).unwrap().encode(),
                b,
                "{}",
                String::from_utf8_lossy(b)
            );
        }
        let bad: &[(&[u8], BencodeError)] = &[
            (b"", BencodeError::Truncated(0)),
            (b"i03e", BencodeError::Malformed(0)),
            (b"i-0e", BencodeError::Malformed(0)),
            (b"ie", BencodeError::Malformed(0)),
            (b"i12", BencodeError::Truncated(3)),
            (b"5:abc", BencodeError::Truncated(5)),
            (b"05:abcde", BencodeError::Malformed(0)),
            (b"d4:spam1:a3:cow1:be", BencodeError::KeyOrder(10)),
            (b"d1:a1:x1:a1:ye", BencodeError::KeyOrder(7)),
            (b"l1:a", BencodeError::Truncated(4)),
            (b"x", BencodeError::Malformed(0)),
            (b"i1ei2e", BencodeError::Trailing(3)),
            (b"99999999999999999999999:a", BencodeError::Malformed(0)),
            (b"999999:a", BencodeError::Truncated(8)),
        ];
        for (b, want) in bad {
            assert_eq!(
                decode(b).as_ref(),
                Err(want),
                "{}",
                String::from_utf8_lossy(b)
            );
        }
        let deep = [vec![b'l'; MAX_DEPTH + 1], vec![b'e'; MAX_DEPTH + 1]].concat();
        assert_eq!(decode(&deep), Err(BencodeError::TooDeep(MAX_DEPTH)));
        let ok = [vec![b'l'; MAX_DEPTH], vec![b'e'; MAX_DEPTH]].concat();
        assert!(decode(&ok).is_ok());
    }

    fn sample() -> Metainfo {
        Metainfo {
            announce: Some("http://127.0.0.1:6969/announce".into()),
            name: torrent_name("ubuntu-p1"),
            length: 40960,
            piece_length: 16384,
            pieces: vec![[0x11; 20], [0x22; 20], [0x33; 20]],
        }
    }

    /// Checked against an independent bencoder (Python, hashlib;
    /// tests/fixtures/imaging/torrent_vectors.py prints both hashes):
    ///
    /// ```python
    /// def be(v):
    ///     if isinstance(v, int): return b"i%de" % v
    ///     if isinstance(v, bytes): return b"%d:%s" % (len(v), v)
    ///     return b"d" + b"".join(be(k) + be(v[k]) for k in sorted(v)) + b"e"
    /// info = {b"length": 40960, b"name": b"ubuntu-p1.stream",
    ///         b"piece length": 16384,
    ///         b"pieces": b"\x11" * 20 + b"\x22" * 20 + b"\x33" * 20}
    /// hashlib.sha1(be(info)).hexdigest()
    /// ```
    #[test]
    fn metainfo_golden() {
        let m = sample();
        let info = m.info_bytes();
        let mut want =
            b"d6:lengthi40960e4:name16:ubuntu-p1.stream12:piece lengthi16384e6:pieces60:".to_vec();
        want.extend_from_slice(&[0x11; 20]);
        want.extend_from_slice(&[0x22; 20]);
        want.extend_from_slice(&[0x33; 20]);
        want.push(b'e');
        assert_eq!(info, want);
        assert_eq!(
            m.info_hash_hex(),
            "e16480e8a3dcd34f0f251b378d67c09e12f9f62e"
        );
        let t = m.to_bytes();
        assert!(t.starts_with(b"d8:announce30:http://127.0.0.1:6969/announce4:infod6:length"));
        assert_eq!(Metainfo::parse(&t).unwrap(), m);
        // no tracker: no announce key, same info hash
        let bare = Metainfo {
            announce: None,
            ..sample()
        };
        assert!(bare.to_bytes().starts_with(b"d4:infod"));
        assert_eq!(bare.info_hash(), m.info_hash());
        assert_eq!(Metainfo::parse(&bare.to_bytes()).unwrap(), bare);
    }

    /// The content-format golden vector's torrent (same Python bencoder,
    /// over the fixture's header fields and piece hashes).
    #[test]
    fn content_v1_fixture() {
        let b = include_bytes!("../../../tests/fixtures/imaging/content-v1.index");
        let idx = ContentIndex::parse(b).unwrap();
        let m = Metainfo::from_index(&idx, "content-v1", None);
        assert_eq!(m.name, "content-v1.stream");
        assert_eq!(
            (m.length, m.piece_length, m.pieces.len()),
            (40960, 16384, 3)
        );
        assert_eq!(
            m.info_hash_hex(),
            "34d564fc4b7ac05027d799e35bfc33e4c71c0e06"
        );
    }

    #[test]
    fn metainfo_refusals() {
        let mut m = sample();
        m.pieces.pop();
        assert_eq!(
            Metainfo::parse(&m.to_bytes()),
            Err(TorrentError::Pieces {
                got: 2,
                length: 40960,
                piece_length: 16384
            })
        );
        assert_eq!(
            Metainfo::parse(b"d4:infodee"),
            Err(TorrentError::Field("name"))
        );
        assert!(matches!(
            Metainfo::parse(b"d4:info"),
            Err(TorrentError::Bencode(_))
        ));
    }
}
