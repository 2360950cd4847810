//! The lease file: a snapshot plus an append-only journal next to it.
//!
//! The snapshot (`PATH`) is compact JSON, replaced atomically (temp file, fsync,
//! rename, fsync of the directory), so a crash leaves the old or the new
//! file, never a torn one. It is the format older bootd wrote (`version`,
//! `leases`) plus a `generation`; a file without one still loads.
//!
//! The journal (`PATH.journal`) holds the changes since the snapshot: a
//! header line naming the snapshot's generation, then one compact JSON line
//! per change (`{"set":LEASE}` or `{"del":"MAC"}`), appended in batches with
//! one fsync each, so a write costs O(changes), not O(leases). The file is
//! kept zero-filled ahead of its records ([`PREALLOC`] at a time, the zeros
//! written, not fallocated), so a batch overwrites blocks the filesystem has
//! already allocated and its `fdatasync` flushes data only, not the inode's
//! size and extents; the records end at the first NUL byte. It is folded
//! into a new snapshot (compaction) at start-up and whenever it outgrows the
//! snapshot (and [`COMPACT_MIN`]). Loading is the snapshot, then the
//! journal's records in order; a journal of another generation (a crash
//! between the two renames of a compaction) is stale and skipped, and a torn
//! or unreadable record ends the replay with a log line, never an error.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use anneal_dhcp::{Lease, Mac};

/// The journal is compacted once it is larger than the snapshot and than
/// this many bytes.
pub const COMPACT_MIN: u64 = 4 << 20;

/// The journal grows by this many zero bytes at a time.
pub const PREALLOC: u64 = 1 << 20;

/// Errors of reading or writing the lease file.
#[derive(Debug, thiserror::Error)]
pub enum LeaseFileError {
    #[error("reading lease file {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("lease file {path} does not parse")]
    Parse {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("writing lease file {path}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct Snapshot {
    version: u32,
    /// The generation of the journal that applies on top (absent in files
    /// older bootd wrote: 0).
    #[serde(default)]
    generation: u64,
    leases: Vec<Lease>,
}

#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct Header {
    journal: u32,
    generation: u64,
}

/// One journal record.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
enum Record {
    /// The MAC holds this lease.
    Set(Lease),
    /// The MAC holds no lease.
    Del(Mac),
}

/// `PATH.journal`.
pub fn journal_path(path: &Path) -> PathBuf {
    let mut j = path.as_os_str().to_owned();
    j.push(".journal");
    PathBuf::from(j)
}

fn dir_of(path: &Path) -> &Path {
    path.parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."))
}

/// Writes `body` to `path` atomically (temp file, fsync, rename, directory
/// fsync).
fn replace(path: &Path, body: &[u8]) -> std::io::Result<()> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    {
        let mut f = File::create(&tmp)?;
        f.write_all(body)?;
        f.sync_all()?;
    }
    std::fs::rename(&tmp, path)?;
    File::open(dir_of(path)).and_then(|d| d.sync_all())
}

/// A generation no earlier journal of this file has: the clock in
/// nanoseconds, and above `after`.
fn next_generation(after: u64) -> u64 {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX));
    now.max(after.saturating_add(1))
}

fn read_snapshot(path: &Path) -> Result<Option<(Snapshot, u64)>, LeaseFileError> {
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => {
            return Err(LeaseFileError::Read {
                path: path.into(),
                source,
            });
        }
    };
    let s: Snapshot = serde_json::from_slice(&bytes).map_err(|source| LeaseFileError::Parse {
        path: path.into(),
        source,
    })?;
    Ok(Some((s, bytes.len() as u64)))
}

/// Applies the journal at `jpath` of `generation` to `table`; its length in
/// bytes if it applied.
fn replay(
    jpath: &Path,
    generation: u64,
    table: &mut BTreeMap<Mac, Lease>,
) -> Result<Option<u64>, LeaseFileError> {
    let bytes = match std::fs::read(jpath) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => {
            return Err(LeaseFileError::Read {
                path: jpath.into(),
                source,
            });
        }
    };
    // the records end where the zeros kept ahead of them begin
    let used = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
    let bytes = &bytes[..used];
    let hl = bytes
        .iter()
        .position(|&b| b == b'\n')
        .map_or(bytes.len(), |i| i + 1);
    let header = bytes[..hl]
        .strip_suffix(b"\n")
        .and_then(|l| serde_json::from_slice::<Header>(l).ok());
    match header {
        Some(h) if h.generation == generation => {}
        Some(h) => {
            tracing::warn!(path = %jpath.display(), journal = h.generation, snapshot = generation,
                "lease journal is of another snapshot (a compaction was interrupted): skipped");
            return Ok(None);
        }
        None => {
            tracing::warn!(path = %jpath.display(), "lease journal has no complete header: skipped");
            return Ok(None);
        }
    }
    let (mut applied, mut pos) = (0usize, hl);
    for line in bytes[hl..].split_inclusive(|&b| b == b'\n') {
        let rec = line
            .strip_suffix(b"\n")
            .and_then(|l| serde_json::from_slice::<Record>(l).ok());
        let Some(rec) = rec else { break };
        match rec {
            Record::Set(l) => {
                table.insert(l.mac, l);
            }
            Record::Del(m) => {
                table.remove(&m);
            }
        }
        applied += 1;
        pos += line.len();
    }
    if pos < bytes.len() {
        tracing::warn!(path = %jpath.display(), applied, ignored_bytes = bytes.len() - pos,
            "lease journal ends in a torn or unreadable record (a crash while appending?): the rest is ignored");
    }
    Ok(Some(bytes.len() as u64))
}
/// The lease file of a running bootd: the snapshot and its open journal.
#[derive(Debug)]
pub struct LeaseStore {
    path: PathBuf,
    journal_path: PathBuf,
    generation: u64,
    /// Open for writing; `None` after a failed write (the next write is
    /// then a compaction, which supersedes whatever got half-written).
    journal: Option<File>,
    /// Bytes of header and records: where the next batch is written.
    journal_len: u64,
    /// The file's size: records, then zeros up to here.
    journal_cap: u64,
    snapshot_len: u64,
}

impl LeaseStore {
    /// Loads the snapshot and replays its journal (a missing file is an
    /// empty table). Write nothing before [`LeaseStore::compact`].
    pub fn open(path: &Path) -> Result<(LeaseStore, Vec<Lease>), LeaseFileError> {
        let journal_path = journal_path(path);
        let (snap, snapshot_len) = match read_snapshot(path)? {
            Some(x) => x,
            None => (
                Snapshot {
                    version: 1,
                    generation: 0,
                    leases: Vec::new(),
                },
                0,
            ),
        };
        let mut table = BTreeMap::new();
        for l in snap.leases {
            table.insert(l.mac, l);
        }
        let journal_len = replay(&journal_path, snap.generation, &mut table)?.unwrap_or(0);
        let store = LeaseStore {
            path: path.into(),
            journal_path,
            generation: snap.generation,
            journal: None,
            journal_len,
            journal_cap: 0,
            snapshot_len,
        };
        Ok((store, table.into_values().collect()))
    }

    /// True when the next write should be a compaction: the journal
    /// outgrew the snapshot (and [`COMPACT_MIN`]), or is not open.
    pub fn wants_compaction(&self) -> bool {
        self.journal.is_none() || self.journal_len > self.snapshot_len.max(COMPACT_MIN)
    }

    /// Writes `leases` as the new snapshot (a new generation) and starts
    /// an empty journal for it.
    pub fn compact(&mut self, leases: &[Lease]) -> Result<(), LeaseFileError> {
        self.journal = None;
        let generation = next_generation(self.generation);
        let err = |path: &Path| {
            let path = path.to_owned();
            move |source| LeaseFileError::Write { path, source }
        };
        let body = serde_json::to_vec(&Snapshot {
            version: 1,
            generation,
            leases: leases.to_vec(),
        })
        .map_err(|e| err(&self.path)(std::io::Error::other(e)))?;
        // Snapshot first: a crash before the journal's rename leaves a
        // journal of the old generation, which loading then skips (all of
        // it is in the new snapshot).
        replace(&self.path, &body).map_err(err(&self.path))?;
        self.generation = generation;
        self.snapshot_len = body.len() as u64;
        let mut header = serde_json::to_vec(&Header {
            journal: 1,
            generation,
        })
        .map_err(|e| err(&self.journal_path)(std::io::Error::other(e)))?;
        header.push(b'\n');
        let header_len = header.len() as u64;
        let cap = header_len.max(PREALLOC);
        header.resize(usize::try_from(cap).unwrap_or(usize::MAX), 0);
        replace(&self.journal_path, &header).map_err(err(&self.journal_path))?;
        let f = OpenOptions::new()
            .write(true)
            .open(&self.journal_path)
            .map_err(err(&self.journal_path))?;
        self.journal = Some(f);
        self.journal_len = header_len;
        self.journal_cap = cap;
        Ok(())
    }

    /// Appends `changes` (each MAC with its lease now, `None`: removed) to
    /// the journal as one batch, with one fsync.
    pub fn append(&mut self, changes: &[(Mac, Option<Lease>)]) -> Result<(), LeaseFileError> {
        if changes.is_empty() {
            return Ok(());
        }
        let err = |source| LeaseFileError::Write {
            path: self.journal_path.clone(),
            source,
        };
        let mut buf = Vec::with_capacity(changes.len() * 80);
        for (mac, lease) in changes {
            let rec = match lease {
                Some(l) => Record::Set(*l),
                None => Record::Del(*mac),
            };
            serde_json::to_writer(&mut buf, &rec).map_err(|e| err(std::io::Error::other(e)))?;
            buf.push(b'\n');
        }
        let Some(f) = &mut self.journal else {
            return Err(err(std::io::Error::other(
                "journal not open (compaction pending)",
            )));
        };
        let end = self.journal_len + buf.len() as u64;
        let mut cap = self.journal_cap;
        if end > cap {
            // the batch and the next PREALLOC of zeros, in one write and
            // the same fdatasync (which then carries the new size)
            cap = end + PREALLOC;
            buf.resize(
                usize::try_from(cap - self.journal_len).unwrap_or(usize::MAX),
                0,
            );
        }
        let r = f
            .write_all_at(&buf, self.journal_len)
            .and_then(|()| f.sync_data());
        if let Err(e) = r {
            self.journal = None;
            return Err(err(e));
        }
        self.journal_len = end;
        self.journal_cap = cap;
        Ok(())
    }

    /// Closes the journal, as a failed write does (the next write compacts).
    #[cfg(test)]
    pub(crate) fn close_journal(&mut self) {
        self.journal = None;
    }

    /// Bytes of the journal's header and records (not the zeros after).
    pub fn journal_len(&self) -> u64 {
        self.journal_len
    }
}

/// Reads leases: the snapshot, then its journal (a missing file is an
/// empty table).
pub fn load(path: &Path) -> Result<Vec<Lease>, LeaseFileError> {
    LeaseStore::open(path).map(|(_, leases)| leases)
}

/// Replaces the lease file with `leases` (a new snapshot and an empty
/// journal). Not while a bootd runs on the same file.
pub fn store(path: &Path, leases: &[Lease]) -> Result<(), LeaseFileError> {
    // a fresh generation, so whatever journal is there no longer applies
    LeaseStore {
        path: path.into(),
        journal_path: journal_path(path),
        generation: 0,
        journal: None,
        journal_len: 0,
        journal_cap: 0,
        snapshot_len: 0,
    }
    .compact(leases)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use anneal_dhcp::{LeaseEffect, Leases};

    fn lease(i: u8, expires: u64) -> Lease {
        Lease {
            mac: Mac([2, 0, 0, 0, 0, i]),
            address: std::net::Ipv4Addr::new(10, 0, 0, i),
            expires,
        }
    }

    fn all(l: &Leases) -> Vec<Lease> {
        l.iter().copied().collect()
    }

    #[test]
    fn round_trip_and_missing() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("leases.json");
        assert!(load(&p).unwrap().is_empty());
        let l = lease(5, 42);
        store(&p, &[l]).unwrap();
        assert_eq!(load(&p).unwrap(), vec![l]);
        assert!(!d.path().join("leases.json.tmp").exists());
        assert!(!d.path().join("leases.json.journal.tmp").exists());
        std::fs::write(&p, b"{not json").unwrap();
        assert!(matches!(load(&p), Err(LeaseFileError::Parse { .. })));
    }

    /// A file as older bootd wrote it (no generation, no journal) loads,
    /// and a journal started on it applies.
    #[test]
    fn old_format_loads() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("leases.json");
        std::fs::write(
            &p,
            br#"{
  "version": 1,
  "leases": [
    {
      "mac": "02:00:00:00:00:05",
      "address": "10.0.0.5",
      "expires": 42
    },
    {
      "mac": "02:00:00:00:00:06",
      "address": "10.0.0.6",
      "expires": 43
    }
  ]
}"#,
        )
        .unwrap();
        let (mut s, got) = LeaseStore::open(&p).unwrap();
        assert_eq!(got, vec![lease(5, 42), lease(6, 43)]);
        assert!(s.wants_compaction());
        s.compact(&got).unwrap();
        s.append(&[
            (lease(5, 0).mac, None),
            (lease(7, 1).mac, Some(lease(7, 1))),
        ])
        .unwrap();
        assert_eq!(load(&p).unwrap(), vec![lease(6, 43), lease(7, 1)]);
    }

    /// After random binds, releases, removals and filters, persisted in
    /// batches of the tracked changes with compactions in between, loading
    /// gives back exactly the in-memory table.
    #[test]
    fn replay_equals_the_table() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("leases.json");
        let mut x: u64 = 0x2545_f491_4f6c_dd1d;
        let mut next = |n: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % n
        };
        let (mut s, loaded) = LeaseStore::open(&p).unwrap();
        let mut table = Leases::from_leases(loaded);
        s.compact(&all(&table)).unwrap();
        table.track_changes();
        for step in 0..3000u64 {
            let i = next(40) as u8;
            match next(8) {
                0..=3 => table.apply(LeaseEffect::Bind(lease(i, step)), step),
                4 => {
                    let address = table
                        .get(&lease(i, 0).mac)
                        .map_or(lease(i, 0).address, |l| l.address);
                    table.apply(
                        LeaseEffect::Release {
                            mac: lease(i, 0).mac,
                            address,
                        },
                        step,
                    );
                }
                5 => {
                    table.remove(&lease(i, 0).mac);
                }
                6 => {
                    let cut = next(step + 1);
                    table.retain(|l| l.expires >= cut);
                }
                _ => {
                    // a batch: usually appended, sometimes a compaction
                    if next(10) == 0 {
                        table.take_changes();
                        s.compact(&all(&table)).unwrap();
                    } else {
                        s.append(&table.take_changes()).unwrap();
                    }
                    assert_eq!(load(&p).unwrap(), all(&table), "step {step}");
                }
            }
        }
        s.append(&table.take_changes()).unwrap();
        assert!(s.journal_len() > 0);
        assert_eq!(load(&p).unwrap(), all(&table));
    }

    /// A crash in the middle of an append leaves a torn last record: it is
    /// ignored (with what came before kept), and so is anything after an
    /// unreadable record.
    #[test]
    fn torn_tail_is_ignored() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("leases.json");
        let j = journal_path(&p);
        let (mut s, _) = LeaseStore::open(&p).unwrap();
        s.compact(&[lease(1, 10)]).unwrap();
        s.append(&[(lease(2, 0).mac, Some(lease(2, 20)))]).unwrap();
        s.append(&[(lease(1, 0).mac, None)]).unwrap();
        let good = std::fs::read(&j).unwrap();
        let good = good[..usize::try_from(s.journal_len()).unwrap()].to_vec();
        s.append(&[(lease(3, 0).mac, Some(lease(3, 30)))]).unwrap();
        let full = std::fs::read(&j).unwrap();
        assert_eq!(full.len() as u64, PREALLOC, "the records go into the zeros");
        let full = full[..usize::try_from(s.journal_len()).unwrap()].to_vec();
        for cut in good.len()..full.len() {
            std::fs::write(&j, &full[..cut]).unwrap();
            assert_eq!(load(&p).unwrap(), vec![lease(2, 20)], "cut at {cut}");
        }
        // zeros where the last record should be (a torn extending write)
        let mut zeros = good.clone();
        zeros.extend_from_slice(&[0; 40]);
        std::fs::write(&j, &zeros).unwrap();
        assert_eq!(load(&p).unwrap(), vec![lease(2, 20)]);
        // a bad record in the middle ends the replay there
        let mut mid = good.clone();
        mid.extend_from_slice(b"{\"set\":{\"mac\":\"zz\"}}\n");
        mid.extend_from_slice(&full[good.len()..]);
        std::fs::write(&j, &mid).unwrap();
        assert_eq!(load(&p).unwrap(), vec![lease(2, 20)]);
        // a journal without a complete header is skipped
        std::fs::write(&j, &full[..5]).unwrap();
        assert_eq!(load(&p).unwrap(), vec![lease(1, 10)]);
    }

    /// The journal is zero-filled ahead of its records and grows by
    /// PREALLOC when a batch passes the end; every record written before
    /// and after a growth replays.
    #[test]
    fn the_journal_grows_in_zeroed_steps_and_replays_across_them() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("leases.json");
        let j = journal_path(&p);
        let (mut s, _) = LeaseStore::open(&p).unwrap();
        s.compact(&[]).unwrap();
        assert_eq!(std::fs::metadata(&j).unwrap().len(), PREALLOC);
        let mut want = BTreeMap::new();
        let mut i: u32 = 0;
        while s.journal_len() < 2 * PREALLOC + 100 {
            let batch: Vec<_> = (0..50)
                .map(|k| {
                    i += 1;
                    let l = Lease {
                        mac: Mac([2, 1, (i >> 16) as u8, (i >> 8) as u8, i as u8, k]),
                        address: std::net::Ipv4Addr::from(0x0a00_0000 + i),
                        expires: u64::from(i),
                    };
                    want.insert(l.mac, l);
                    (l.mac, Some(l))
                })
                .collect();
            s.append(&batch).unwrap();
            let len = std::fs::metadata(&j).unwrap().len();
            assert!(len > s.journal_len(), "zeros stay ahead of the records");
            assert!(len <= s.journal_len() + PREALLOC + 50 * 120);
        }
        let got = load(&p).unwrap();
        assert_eq!(got, want.into_values().collect::<Vec<_>>());
        // reopening finds where the records end
        let (s2, _) = LeaseStore::open(&p).unwrap();
        assert_eq!(s2.journal_len(), s.journal_len());
    }

    /// Compaction keeps the content: the journal folds into the snapshot
    /// and starts empty; a stale journal (crash between the snapshot's and
    /// the journal's rename) is skipped, not replayed over newer state.
    #[test]
    fn compaction_keeps_content() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("leases.json");
        let j = journal_path(&p);
        let (mut s, _) = LeaseStore::open(&p).unwrap();
        s.compact(&[]).unwrap();
        let header_len = s.journal_len();
        let mut table = Leases::default();
        table.track_changes();
        for i in 1..=20 {
            table.apply(LeaseEffect::Bind(lease(i, u64::from(i))), 0);
        }
        table.remove(&lease(3, 0).mac);
        s.append(&table.take_changes()).unwrap();
        let before = load(&p).unwrap();
        assert_eq!(before, all(&table));
        let stale = std::fs::read(&j).unwrap();
        // lease 4 changes after the stale journal was written
        table.apply(LeaseEffect::Bind(lease(4, 99)), 0);
        table.take_changes();
        s.compact(&all(&table)).unwrap();
        assert_eq!(s.journal_len(), header_len);
        // the header, then nothing but zeros
        let fresh = std::fs::read(&j).unwrap();
        assert_eq!(fresh.len() as u64, PREALLOC);
        let header_len = usize::try_from(header_len).unwrap();
        assert!(fresh[header_len - 1] == b'\n' && fresh[header_len..].iter().all(|&b| b == 0));
        assert_eq!(load(&p).unwrap(), all(&table));
        std::fs::write(&j, &stale).unwrap();
        assert_eq!(load(&p).unwrap(), all(&table));
        // and a store() replaces the file whole, journal included
        store(&p, &[lease(9, 9)]).unwrap();
        assert_eq!(load(&p).unwrap(), vec![lease(9, 9)]);
    }
}
