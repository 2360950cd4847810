//! Durable leases: the lease file written before an ACK leaves.
//!
//! One [`LeaseLog`] owns the [`LeaseStore`] behind a lock. [`LeaseLog::commit`]
//! takes every lease change made so far (under the leases lock, while
//! holding the store's) and appends it to the journal with one
//! `fdatasync`, or compacts when the journal is due or unusable. The DHCP
//! loop calls it once per batch of datagrams it has read (group commit) and
//! sends the batch's ACKs only after it returned [`Commit::Durable`]; the
//! persister calls it for the other changes (RELEASE, DECLINE, collection,
//! a new table) and as the retry timer.
//!
//! A failed write leaves the journal closed: the next attempt is a
//! compaction of the whole table (which supersedes whatever got half
//! written), made at most once per retry interval. Until one succeeds,
//! ACKs are withheld ([`Commit::Failed`]: the client retries), except when
//! no write has succeeded since start-up: then bootd serves from memory
//! ([`Commit::MemoryOnly`]) rather than keep DHCP down.

use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anneal_api::error_chain;
use anneal_dhcp::Leases;

use crate::leasefile::LeaseStore;
use crate::metrics::Metrics;

/// How often a lease file that failed to write is tried again.
pub const RETRY: Duration = Duration::from_secs(1);

/// What a commit achieved for the changes made before it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Commit {
    /// Written and synced: an ACK for them may leave.
    Durable,
    /// Not written, and nothing was since start-up: bootd serves from
    /// memory (ACKs leave, counted in `bootd_dhcp_acks_not_durable_total`).
    MemoryOnly,
    /// Not written although the file worked before: ACKs are withheld
    /// (`drop_not_durable`) until a retry succeeds.
    Failed,
}

#[derive(Debug)]
struct Inner {
    store: LeaseStore,
    /// When the last attempt failed (`None`: the last one succeeded).
    failed_at: Option<Instant>,
    /// A write succeeded since start-up.
    written: bool,
}

/// The lease file of a running bootd, written through [`LeaseLog::commit`].
#[derive(Debug)]
pub struct LeaseLog {
    path: PathBuf,
    retry: Duration,
    inner: Mutex<Inner>,
}

impl LeaseLog {
    /// Wraps an opened store (its first commit is a compaction).
    pub fn new(path: &Path, store: LeaseStore) -> LeaseLog {
        LeaseLog::with_retry(path, store, RETRY)
    }

    /// Like [`LeaseLog::new`] with another retry interval (tests).
    pub fn with_retry(path: &Path, store: LeaseStore, retry: Duration) -> LeaseLog {
        LeaseLog {
            path: path.into(),
            retry,
            inner: Mutex::new(Inner {
                store,
                failed_at: None,
                written: false,
            }),
        }
    }

    /// The lease file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// True while the last write failed (the persister then retries every
    /// retry interval).
    pub fn failing(&self) -> bool {
        self.lock().failed_at.is_some()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // a panic mid-write leaves the journal unknown: the store then has
        // no open journal and the next write compacts
        match self.inner.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }

    /// Makes every change made to `leases` before this call durable: one
    /// journal append with one `fdatasync`, or a compaction. Blocking I/O.
    pub fn commit(&self, leases: &Mutex<Leases>, metrics: &Metrics) -> Commit {
        let mut g = self.lock();
        let not_written = |g: &Inner| {
            if g.written {
                Commit::Failed
            } else {
                Commit::MemoryOnly
            }
        };
        if let Some(at) = g.failed_at
            && at.elapsed() < self.retry
        {
            return not_written(&g);
        }
        let full = g.store.wants_compaction();
        let (changes, all) = {
            let mut l = match leases.lock() {
                Ok(l) => l,
                Err(p) => p.into_inner(),
            };
            let changes = l.take_changes();
            let all: Option<Vec<_>> = full.then(|| l.iter().copied().collect());
            (changes, all)
        };
        let r = match &all {
            Some(all) => g.store.compact(all),
            None => g.store.append(&changes),
        };
        match r {
            Ok(()) => {
                if g.failed_at.take().is_some() {
                    tracing::info!(path = %self.path.display(), "lease file written again: ACKs are durable");
                }
                g.written = true;
                metrics.lease_file_durable.set(1);
                Commit::Durable
            }
            Err(e) => {
                g.failed_at = Some(Instant::now());
                metrics.lease_write_failures.inc();
                metrics.lease_file_durable.set(0);
                let outcome = not_written(&g);
                let then = if outcome == Commit::MemoryOnly {
                    "serving leases from memory (ACKs are not durable)"
                } else {
                    "ACKs are withheld until it is written"
                };
                tracing::warn!(
                    path = %self.path.display(),
                    error = %error_chain(&e),
                    retry_secs = self.retry.as_secs_f64(),
                    "lease file not written: {then}; free space or fix the file's directory, it is retried"
                );
                outcome
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use std::net::Ipv4Addr;

    use anneal_dhcp::{Lease, LeaseEffect, Mac};

    use super::*;
    use crate::leasefile;

    fn lease(i: u8) -> Lease {
        Lease {
            mac: Mac([2, 0, 0, 0, 0, i]),
            address: Ipv4Addr::new(10, 0, 0, i),
            expires: 1000,
        }
    }

    /// A store that cannot be written at start-up serves from memory; once
    /// it works every lease is written; a later failure withholds; the
    /// retry interval gates attempts; failures are counted.
    #[test]
    fn memory_only_then_durable_then_failed() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("leases.json");
        // `leases.json.tmp` a non-empty directory: every compaction fails
        let obstacle = d.path().join("leases.json.tmp");
        std::fs::create_dir(&obstacle).unwrap();
        std::fs::write(obstacle.join("x"), b"x").unwrap();
        let (store, _) = LeaseStore::open(&p).unwrap();
        let log = LeaseLog::with_retry(&p, store, Duration::from_secs(3600));
        let metrics = Metrics::default();
        let mut table = Leases::default();
        table.track_changes();
        let leases = Mutex::new(table);
        leases.lock().unwrap().apply(LeaseEffect::Bind(lease(1)), 0);
        assert_eq!(log.commit(&leases, &metrics), Commit::MemoryOnly);
        assert!(log.failing());
        // within the retry interval: no attempt (not counted again)
        assert_eq!(log.commit(&leases, &metrics), Commit::MemoryOnly);
        let text = metrics.render();
        assert!(
            text.contains("bootd_lease_file_write_failures_total 1"),
            "{text}"
        );
        assert!(text.contains("bootd_lease_file_durable 0"), "{text}");
        std::fs::remove_dir_all(&obstacle).unwrap();
        log.lock().failed_at = Some(Instant::now() - Duration::from_secs(3601));
        assert_eq!(log.commit(&leases, &metrics), Commit::Durable);
        assert!(!log.failing());
        assert_eq!(leasefile::load(&p).unwrap(), vec![lease(1)]);
        leases.lock().unwrap().apply(LeaseEffect::Bind(lease(2)), 0);
        assert_eq!(log.commit(&leases, &metrics), Commit::Durable);
        assert_eq!(leasefile::load(&p).unwrap(), vec![lease(1), lease(2)]);
        // a failure after the file worked: withheld, and the retry
        // (a compaction) writes what the failed one lost
        std::fs::create_dir(&obstacle).unwrap();
        std::fs::write(obstacle.join("x"), b"x").unwrap();
        log.lock().store.close_journal();
        leases.lock().unwrap().apply(LeaseEffect::Bind(lease(3)), 0);
        assert_eq!(log.commit(&leases, &metrics), Commit::Failed);
        assert_eq!(log.commit(&leases, &metrics), Commit::Failed);
        assert!(
            metrics
                .render()
                .contains("bootd_lease_file_write_failures_total 2")
        );
        std::fs::remove_dir_all(&obstacle).unwrap();
        log.lock().failed_at = Some(Instant::now() - Duration::from_secs(3601));
        assert_eq!(log.commit(&leases, &metrics), Commit::Durable);
        assert_eq!(
            leasefile::load(&p).unwrap(),
            vec![lease(1), lease(2), lease(3)]
        );
        assert!(metrics.render().contains("bootd_lease_file_durable 1"));
    }
}
