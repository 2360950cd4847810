//! The vendored librqbit with rarest-first on, as a real swarm on loopback:
//! one seed whose upload is capped and three leechers that know each other.
//! Every leecher ends with the seed's bytes (librqbit checks each piece's
//! SHA-1, hashed with ring since vendor/librqbit-sha1-wrapper), and the
//! leechers upload to each other (a fifth of the bytes at least) while the
//! seed's upload is capped. `RUST_LOG=librqbit=debug` shows the swarm.
#![allow(clippy::too_many_lines)]

use std::{net::SocketAddr, num::NonZeroU32, path::Path, time::Duration};

use anyhow::{Context, Result, bail};
use librqbit::{
    AddTorrent, AddTorrentOptions, CreateTorrentOptions, ListenerMode, ListenerOptions, Session,
    SessionOptions, create_torrent, limits::LimitsConfig, spawn_utils::BlockingSpawner,
};
use sha2::{Digest, Sha256};

const CONTENT: usize = 16 << 20;
const PIECE: u32 = 64 << 10;
const LEECHERS: usize = 3;
/// The seed's upload cap: 4 MiB/s, so serving every leecher alone would take
/// 12 s while the swarm needs the content about once from the seed (4 s).
const SEED_BPS: u32 = 4 << 20;

async fn session(dir: &Path, upload_bps: Option<u32>) -> Result<std::sync::Arc<Session>> {
    Session::new_with_opts(
        dir.to_owned(),
        SessionOptions {
            dht: None,
            disable_trackers: true,
            disable_local_service_discovery: true,
            listen: Some(ListenerOptions {
                mode: ListenerMode::TcpOnly,
                listen_addr: SocketAddr::from(([127, 0, 0, 1], 0)),
                ..Default::default()
            }),
            ratelimits: LimitsConfig {
                upload_bps: upload_bps.and_then(NonZeroU32::new),
                download_bps: None,
            },
            ..Default::default()
        },
    )
    .await
    .with_context(|| format!("starting a librqbit session in {}", dir.display()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn leechers_trade_pieces_and_end_with_the_seeds_bytes() -> Result<()> {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .try_init();
    let root = tempfile::tempdir()?;
    let seed_dir = root.path().join("seed");
    std::fs::create_dir_all(&seed_dir)?;
    // Deterministic, incompressible-looking bytes.
    let data = anneal_bench::noise(0x853c_49e6_748f_ea9b, CONTENT);
    let want = Sha256::digest(&data);
    std::fs::write(seed_dir.join("content.bin"), &data)?;
    let torrent = create_torrent(
        &seed_dir.join("content.bin"),
        CreateTorrentOptions {
            piece_length: Some(PIECE),
            ..Default::default()
        },
        &BlockingSpawner::new(1),
    )
    .await?;
    let torrent = torrent.as_bytes()?;

    let seed = session(&seed_dir, Some(SEED_BPS)).await?;
    let seed_addr = seed.listen_addr().context("the seed listens")?;
    let seeding = seed
        .add_torrent(
            AddTorrent::TorrentFileBytes(torrent.clone()),
            Some(AddTorrentOptions {
                overwrite: true,
                output_folder: Some(seed_dir.display().to_string()),
                ..Default::default()
            }),
        )
        .await?
        .into_handle()
        .context("the seed's torrent")?;
    tokio::time::timeout(Duration::from_secs(60), seeding.wait_until_completed())
        .await
        .context("the seed did not finish checking its file in 60 s")??;

    let mut sessions = Vec::new();
    for i in 0..LEECHERS {
        let dir = root.path().join(format!("leecher{i}"));
        std::fs::create_dir_all(&dir)?;
        let s = session(&dir, None).await?;
        let addr = s.listen_addr().context("a leecher listens")?;
        sessions.push((dir, s, addr));
    }
    let mut handles = Vec::new();
    for (i, (dir, s, _)) in sessions.iter().enumerate() {
        let mut peers = vec![seed_addr];
        peers.extend(
            sessions
                .iter()
                .enumerate()
                .filter(|(j, _)| *j != i)
                .map(|(_, (_, _, a))| *a),
        );
        let h = s
            .add_torrent(
                AddTorrent::TorrentFileBytes(torrent.clone()),
                Some(AddTorrentOptions {
                    output_folder: Some(dir.display().to_string()),
                    initial_peers: Some(peers),
                    rarest_first: true,
                    ..Default::default()
                }),
            )
            .await?
            .into_handle()
            .context("a leecher's torrent")?;
        handles.push(h);
    }
    for (i, h) in handles.iter().enumerate() {
        tokio::time::timeout(Duration::from_secs(240), h.wait_until_completed())
            .await
            .with_context(|| format!("leecher {i} did not complete in 240 s: {}", h.stats()))??;
    }

    let mut from_leechers = 0u64;
    for (i, ((dir, _, _), h)) in sessions.iter().zip(&handles).enumerate() {
        let got = std::fs::read(dir.join("content.bin"))?;
        if Sha256::digest(&got) != want {
            bail!("leecher {i} wrote different bytes than the seed's");
        }
        from_leechers += h.stats().uploaded_bytes;
    }
    let from_seed = seeding.stats().uploaded_bytes;
    let needed = (CONTENT * LEECHERS) as u64;
    eprintln!(
        "seed uploaded {from_seed} bytes, leechers {from_leechers} bytes, of {needed} needed"
    );
    // The leechers traded. Measured on a quiet machine: 19-24 MiB of the 48
    // from leechers with rarest-first; with the stock order (the same test
    // with `rarest_first: false`) 0: every leecher asks for the same pieces.
    assert!(
        from_leechers >= needed / 5,
        "leechers uploaded only {from_leechers} of {needed} bytes (seed {from_seed})"
    );
    for (_, s, _) in &sessions {
        s.stop().await;
    }
    seed.stop().await;
    Ok(())
}
