//! Contents whose plan entry has a swarm (docs/distribution.md, "The agent
//! deploys from the swarm"): fetched over
//! BitTorrent from the Site's seeder and the run's other machines
//! ([`crate::swarm`]), each piece checked against the index before it is
//! written at its slot, HTTP ranges of the content server after a stall.
//! Every content fetched keeps being served to the other machines until
//! the run's seed policy ends it, before the post-install steps.

use std::fs::File;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anneal_api::agent::{PlannedContent, PlannedSwarm, SeedPolicy, SwarmTransfer};
use anneal_image::format::ContentIndex;
use anneal_image::torrent::Metainfo;
use anneal_image::write::SlotRange;

use super::{DeployError, Reporter};
use crate::swarm::{Seeding, SwarmConfig, SwarmError, SwarmStats, fetch_file_to_slot};

/// The run's swarms: the contents fetched so far (still serving) and their
/// figures.
#[derive(Default)]
pub(super) struct Swarms {
    seeding: Vec<Seeding>,
    fallback_reason: Option<String>,
}

impl Swarms {
    /// True when a content was fetched over BitTorrent.
    pub(super) fn any(&self) -> bool {
        !self.seeding.is_empty()
    }

    /// The run's figures: every finished content's (uploads still growing).
    fn transfer(&self) -> SwarmTransfer {
        transfer_of(&self.seeding, self.fallback_reason.as_ref(), None)
    }

    /// Fetches content `c` onto `at` (the target and the slot) from its
    /// swarm; reports progress through row `row` of `rep`. False
    /// when the swarm could not start and the plan allows the HTTP
    /// fallback: the caller writes the content over HTTP ranges.
    pub(super) fn fetch(
        &mut self,
        at: (&File, SlotRange),
        c: &PlannedContent,
        sw: &PlannedSwarm,
        index: &ContentIndex,
        rep: &mut Reporter<'_>,
        row: usize,
    ) -> Result<bool, DeployError> {
        let fail = |source: SwarmError| DeployError::Swarm {
            content: c.name.clone(),
            source,
        };
        let meta = Metainfo::from_index(index, &c.name, sw.trackers.first().map(String::as_str));
        let hash = meta.info_hash_hex();
        if !hash.eq_ignore_ascii_case(&sw.info_hash) {
            return Err(DeployError::Plan(format!(
                "content {}: the torrent made from its index has info hash {hash}, the plan says {} (PartitionContent status.infoHash)",
                c.name, sw.info_hash
            )));
        }
        // One port per content: the contents fetched before this one are
        // still served on theirs.
        let port = if sw.listen_port == 0 {
            0
        } else {
            sw.listen_port
                .saturating_add(u16::try_from(self.seeding.len()).unwrap_or(u16::MAX))
        };
        let seeders: Vec<SocketAddr> = sw
            .seeder_hosts
            .iter()
            .filter_map(|h| h.parse::<IpAddr>().ok())
            .map(|ip| SocketAddr::new(ip, 0))
            .collect();
        let cfg = SwarmConfig {
            listen: SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), port),
            peers: Vec::new(),
            seeders,
            trackers: sw.trackers.clone(),
            rarest_first: true,
            // Stripes wait for the leecher holding a piece; with upload
            // slots that holder may keep us choked, so the claim's
            // maxUploads turns them off.
            seeder_stripes: sw.max_uploads.is_none(),
            stall_timeout: Duration::from_secs(u64::from(sw.stall_timeout_seconds.max(1))),
            http_fallback: sw.http_fallback.then(|| c.stream_url.clone()),
            // The claim's spec.transfer.
            piece_cache: sw.cache_size_mb.map(|m| u64::from(m) << 20),
            peer_limit: sw.max_connections.and_then(|n| usize::try_from(n).ok()),
            max_uploads: sw.max_uploads.and_then(|n| usize::try_from(n).ok()),
            request_window: None,
        };
        let (file, slot) = at;
        let target = file.try_clone().map_err(|e| {
            fail(SwarmError::Io(format!(
                "duplicating the target's descriptor: {e}"
            )))
        })?;
        tracing::info!(content = %c.name, info_hash = %hash, trackers = ?sw.trackers, %port, "fetching over BitTorrent");
        let mut abort = None;
        let (seeding, reason) = (&self.seeding, self.fallback_reason.as_ref());
        // Pieces fetched over HTTP ranges count in the run's httpBytes.
        let mut http_seen = 0u64;
        let mut progress = |s: &SwarmStats| {
            if let Some(p) = rep.progress.partitions.get_mut(row) {
                p.bytes_done = s.bytes_written;
            }
            rep.counters.http_bytes.fetch_add(
                s.bytes_over_http.saturating_sub(http_seen),
                Ordering::Relaxed,
            );
            http_seen = http_seen.max(s.bytes_over_http);
            rep.progress.transfer = Some(transfer_of(seeding, reason, Some(s)));
            match rep.send(false) {
                Ok(()) => true,
                Err(e) => {
                    abort = Some(e);
                    false
                }
            }
        };
        let res = fetch_file_to_slot(&meta.to_bytes(), index, target, slot, &cfg, &mut progress);
        let leeched = match res {
            Ok(l) => l,
            // A swarm that cannot start at all (no socket, no session) is
            // a stall from the first byte: the whole content comes over
            // HTTP when the plan allows it.
            Err(SwarmError::Start(e)) if abort.is_none() && sw.http_fallback => {
                let reason = format!("the BitTorrent session did not start: {e:#}");
                let line = format!("content {}: HTTP fallback: {reason}", c.name);
                tracing::warn!(line = %line, "deploy");
                rep.progress.log_lines.push(line);
                self.fallback_reason.get_or_insert(reason);
                rep.progress.transfer = Some(self.transfer());
                return Ok(false);
            }
            Err(e) => return Err(abort.take().unwrap_or_else(|| fail(e))),
        };
        if let Some(r) = &leeched.stats.fallback_reason {
            let line = format!("content {}: HTTP fallback after a stall: {r}", c.name);
            tracing::warn!(line = %line, "deploy");
            rep.progress.log_lines.push(line);
            self.fallback_reason.get_or_insert_with(|| r.clone());
        }
        let s = &leeched.stats;
        rep.counters.http_bytes.fetch_add(
            s.bytes_over_http.saturating_sub(http_seen),
            Ordering::Relaxed,
        );
        tracing::info!(
            content = %c.name,
            seconds = s.seconds,
            from_peers = s.bytes_from_peers,
            from_seeders = s.bytes_from_seeders,
            over_http = s.bytes_over_http,
            "content written from the swarm"
        );
        if let Some(p) = rep.progress.partitions.get_mut(row) {
            p.bytes_done = s.bytes_written;
        }
        self.seeding.push(leeched.seeding);
        rep.progress.transfer = Some(self.transfer());
        rep.send(true).map(|()| true)
    }

    /// Serves what was fetched to the run's other machines until nothing
    /// was uploaded for `policy.idle_seconds` (at most `policy.max_seconds`),
    /// reporting as it goes; then stops every session.
    pub(super) fn linger(
        &mut self,
        policy: Option<SeedPolicy>,
        rep: &mut Reporter<'_>,
    ) -> Result<(), DeployError> {
        if let Some(policy) = policy.filter(|_| self.any()) {
            let start = Instant::now();
            let idle = Duration::from_secs(u64::from(policy.idle_seconds));
            let max = Duration::from_secs(u64::from(policy.max_seconds));
            let mut last = (self.transfer().uploaded_bytes, Instant::now());
            let line = format!(
                "seeding to the run's other machines (until {} s without upload, at most {} s)",
                policy.idle_seconds, policy.max_seconds
            );
            tracing::info!(line = %line, "deploy");
            rep.progress.log_lines.push(line);
            loop {
                let t = self.transfer();
                if t.uploaded_bytes != last.0 {
                    last = (t.uploaded_bytes, Instant::now());
                }
                rep.progress.transfer = Some(t);
                rep.send(false)?;
                if last.1.elapsed() >= idle || start.elapsed() >= max {
                    break;
                }
                std::thread::sleep(Duration::from_millis(200));
            }
            let t = self.transfer();
            let line = format!(
                "seeding stopped after {:.0} s: {} bytes uploaded in this run",
                start.elapsed().as_secs_f64(),
                t.uploaded_bytes
            );
            tracing::info!(line = %line, "deploy");
            rep.progress.log_lines.push(line);
            rep.progress.transfer = Some(t);
        }
        self.seeding.clear();
        Ok(())
    }
}

/// The figures of the contents in `seeding` plus `current`'s (the one
/// being fetched).
fn transfer_of(
    seeding: &[Seeding],
    reason: Option<&String>,
    current: Option<&SwarmStats>,
) -> SwarmTransfer {
    let mut t = SwarmTransfer {
        fallback_reason: reason.cloned(),
        ..SwarmTransfer::default()
    };
    let now: Vec<SwarmStats> = seeding.iter().map(Seeding::stats).collect();
    for s in now.iter().chain(current) {
        t.peers = t.peers.max(u32::try_from(s.peers).unwrap_or(u32::MAX));
        t.peer_bytes += s.bytes_from_peers;
        t.seeder_bytes += s.bytes_from_seeders;
        t.uploaded_bytes += s.bytes_uploaded;
        if t.fallback_reason.is_none() {
            t.fallback_reason.clone_from(&s.fallback_reason);
        }
    }
    t
}
