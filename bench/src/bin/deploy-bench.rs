//! Deploy benchmark (docs/benchmarks.md; docs/deploy.md): the agent's HTTP
//! path, content server → verified writes, outside a VM.
//!
//! A 1 GiB GPT disk (ESP with a few files, ext4 holding `--data-mib` (384)
//! MiB of pseudo-random files: ~400 MiB of used blocks) is captured, its
//! contents published in a store and served by `anneal-agent serve`.
//!
//! - ours: `anneal-agent deploy --plan plan.json` onto a fresh sparse file
//!   (the restore `Target` writes whole aligned pieces through an `O_DIRECT`
//!   descriptor): index fetch and SHA-256 check, HTTP ranges, SHA-1 of every
//!   piece, the whole-stream SHA-256, the tables, the final fsync;
//! - reference: `curl -s <stream> | dd of=FILE oflag=direct bs=4M
//!   iflag=fullblock conv=fsync` of the same streams from the same server.
//!
//! - write rate alone: `dd if=<stream> of=FILE oflag=direct bs=4M
//!   conv=fsync` from the store (the page cache), no network, no hashing;
//!   the restore part of ours (stream bytes / seconds inside the target's
//!   writes, from the agent's `content written` lines) against it: goal
//!   >= 0.9; the whole deploy path against it is printed too.
//!
//! Throughput = stream bytes / wall time. The order alternates every round;
//! `--rounds` (3); the ratio ours / reference of each round, median printed
//! (goal >= 0.9). Writes target/bench/deploy.json. Run after building
//! release: `target/release/deploy-bench` (options: `--rounds N`,
//! `--data-mib N`, `--range-mib N` (32), `--dir DIR`
//! (/var/tmp/anneal-bench-deploy), `--keep`, `--agent PATH`).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use anneal_bench::{ChildGroup, agent_bin, median};
use anyhow::{Context as _, ensure};
use sha2_free::sha256_file;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

const NS: &str = "bench";

/// SHA-256 without a new dependency: `sha256sum`.
mod sha2_free {
    use std::path::Path;
    use std::process::Command;

    pub fn sha256_file(p: &Path) -> anyhow::Result<String> {
        let out = anneal_bench::run(Command::new("sha256sum").arg(p))?;
        out.split_whitespace()
            .next()
            .map(str::to_owned)
            .ok_or_else(|| anyhow::anyhow!("sha256sum printed nothing for {}", p.display()))
    }
}

fn mib(b: u64) -> f64 {
    b as f64 / (1u64 << 20) as f64
}

fn main() -> anyhow::Result<()> {
    let rounds: usize = anneal_bench::option_or("--rounds", 3)?;
    let data_mib: u64 = anneal_bench::option_or("--data-mib", 384)?;
    let range_mib: u64 = anneal_bench::option_or("--range-mib", 32)?;
    let dir = PathBuf::from(
        anneal_bench::option("--dir").unwrap_or_else(|| "/var/tmp/anneal-bench-deploy".into()),
    );
    let keep = anneal_bench::flag("--keep");
    let agent = agent_bin()?;
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    let res = bench(&dir, &agent, rounds, data_mib, range_mib);
    if !keep {
        let _ = std::fs::remove_dir_all(&dir);
    }
    res
}

/// The captured contents, published in the store and served on `port`.
struct Published {
    /// Each content's entry of the deploy plan.
    contents: Vec<serde_json::Value>,
    /// Each content's stream URL.
    streams: Vec<String>,
    /// Each content's stream file in the store.
    files: Vec<PathBuf>,
    /// The streams' bytes.
    total: u64,
}

/// Moves every content of the capture `cap` (its `layout`) into `store`,
/// verified, for the server on `port`.
fn publish(
    cap: &Path,
    layout: &serde_json::Value,
    store: &Path,
    port: u16,
) -> anyhow::Result<Published> {
    let mut contents = Vec::new();
    let mut streams = Vec::new();
    let mut stream_files = Vec::new();
    let mut total = 0u64;
    for s in layout["slots"].as_array().context("layout without slots")? {
        let Some(name) = s["contentRef"].as_str() else {
            continue;
        };
        let c = store.join(NS).join(name);
        std::fs::create_dir_all(&c)?;
        std::fs::rename(cap.join(format!("{name}.index")), c.join("index"))?;
        std::fs::rename(cap.join(format!("{name}.stream")), c.join("stream"))?;
        let sha = sha256_file(&c.join("stream"))?;
        std::fs::write(c.join("verified"), format!("{sha}\n"))?;
        let bytes = std::fs::metadata(c.join("stream"))?.len();
        total += bytes;
        let url = format!("http://127.0.0.1:{port}/content/{NS}/{name}/stream");
        contents.push(serde_json::json!({
            "name": name,
            "slot": s["number"],
            "indexUrl": format!("http://127.0.0.1:{port}/content/{NS}/{name}/index"),
            "streamUrl": url,
            "indexSha256": sha256_file(&c.join("index"))?,
            "streamSha256": sha,
            "streamBytes": bytes,
        }));
        streams.push(url);
        stream_files.push(c.join("stream"));
    }
    Ok(Published {
        contents,
        streams,
        files: stream_files,
        total,
    })
}

/// `anneal-agent deploy` of `plan` onto a fresh `target`: (wall seconds,
/// seconds inside the target's writes summed over the `contents`: from the
/// agent's `content written` lines).
fn deploy_ours(
    agent: &Path,
    plan: &Path,
    target: &Path,
    range_mib: u64,
    contents: usize,
) -> anyhow::Result<(f64, f64)> {
    let _ = std::fs::remove_file(target);
    let t = Instant::now();
    let out = Command::new(agent)
        .arg("deploy")
        .arg("--plan")
        .arg(plan)
        .args(["--range-mib", &range_mib.to_string()])
        .output()?;
    let secs = t.elapsed().as_secs_f64();
    ensure!(
        out.status.success(),
        "anneal-agent deploy failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // a slow round must not hide a retry: say so
    let stdout = String::from_utf8_lossy(&out.stdout);
    let retries = stdout.matches("retry:").count();
    if retries > 0 {
        eprintln!("ours: {retries} range retries in this round");
    }
    let stderr = String::from_utf8_lossy(&out.stderr);
    let writing: Vec<f64> = stdout
        .lines()
        .chain(stderr.lines())
        .filter(|l| l.contains("content written"))
        .filter_map(|l| {
            let v = l.split("write_seconds=").nth(1)?;
            v.split(|c: char| c.is_whitespace() || c == ',')
                .next()?
                .parse()
                .ok()
        })
        .collect();
    ensure!(
        writing.len() == contents,
        "anneal-agent deploy logged {} 'content written' lines for {} contents",
        writing.len(),
        contents
    );
    Ok((secs, writing.iter().sum()))
}

/// The reference: `curl | dd oflag=direct` of every stream into a file of
/// `dir`; its wall seconds.
fn curl_dd(dir: &Path, streams: &[String]) -> anyhow::Result<f64> {
    let mut script = String::from("set -e -o pipefail\n");
    for (i, url) in streams.iter().enumerate() {
        let f = dir.join(format!("ref{i}.img"));
        let _ = std::fs::remove_file(&f);
        script.push_str(&format!(
            "curl -sf '{url}' | dd of='{}' oflag=direct bs=4M iflag=fullblock conv=fsync status=none\n",
            f.display()
        ));
    }
    let t = Instant::now();
    anneal_bench::run(Command::new("bash").arg("-c").arg(&script))?;
    Ok(t.elapsed().as_secs_f64())
}

/// `dd oflag=direct` of every stream `files` (in the page cache) into a
/// file of `dir`; its wall seconds.
fn dd_from_cache(dir: &Path, files: &[PathBuf]) -> anyhow::Result<f64> {
    let mut script = String::from("set -e\n");
    for (i, f) in files.iter().enumerate() {
        let out = dir.join(format!("dd{i}.img"));
        let _ = std::fs::remove_file(&out);
        script.push_str(&format!(
            "dd if='{}' of='{}' oflag=direct bs=4M conv=fsync status=none\n",
            f.display(),
            out.display()
        ));
    }
    let t = Instant::now();
    anneal_bench::run(Command::new("bash").arg("-c").arg(&script))?;
    Ok(t.elapsed().as_secs_f64())
}

fn bench(
    dir: &Path,
    agent: &Path,
    rounds: usize,
    data_mib: u64,
    range_mib: u64,
) -> anyhow::Result<()> {
    let raw = anneal_bench::gpt_disk(dir, 1024, data_mib)?;
    let cap = dir.join("cap");
    anneal_bench::run(
        Command::new(agent)
            .arg("capture")
            .arg(&raw)
            .arg("--out")
            .arg(&cap),
    )?;
    std::fs::remove_file(&raw)?;
    let layout: serde_json::Value =
        serde_json::from_slice(&std::fs::read(cap.join("layout.json"))?)?;
    let store = dir.join("store");
    let port = anneal_bench::free_port()?;
    let Published {
        contents,
        streams,
        files: stream_files,
        total,
    } = publish(&cap, &layout, &store, port)?;
    eprintln!(
        "{} contents, {:.1} MiB of used blocks",
        contents.len(),
        mib(total)
    );
    let target = dir.join("target.img");
    let plan = serde_json::json!({
        "runId": "bench-run",
        "disks": [{
            "image": "bench",
            "os": true,
            "deviceName": target,
            "layout": layout,
            "contents": contents,
        }],
        "afterDeploy": "PowerOff",
        "progressIntervalSeconds": 2,
        "architecture": "x86_64",
    });
    let plan_path = dir.join("plan.json");
    std::fs::write(&plan_path, serde_json::to_vec(&plan)?)?;
    let logs = dir.join("logs");
    std::fs::create_dir_all(&logs)?;
    let _serve = ChildGroup::spawn_logged(
        "anneal-agent serve",
        Command::new(agent)
            .arg("serve")
            .arg("--content-dir")
            .arg(&store)
            .arg("--listen")
            .arg(format!("127.0.0.1:{port}")),
        &logs.join("serve.log"),
    )?;
    anneal_bench::wait_listening(port, 10)?;

    let ours = || deploy_ours(agent, &plan_path, &target, range_mib, streams.len());
    let reference = || curl_dd(dir, &streams);
    // The write rate alone: dd direct from the streams in the page cache
    // (no network, no hashing). The whole deploy path against it bounds
    // the restore part of the deploy from below.
    let dd_direct = || dd_from_cache(dir, &stream_files);
    // warm-up: the streams into the server's page cache, all paths once
    reference()?;
    ours()?;
    dd_direct()?;
    let (mut o, mut r, mut d, mut ratios, mut write_ratios) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let (mut w, mut restore_ratios) = (Vec::new(), Vec::new());
    for round in 0..rounds {
        // ours and dd direct back to back (their ratio is the noisier
        // one: the disk's rate drifts between rounds), order alternating
        let rs = reference()?;
        let ((os, ws), ds) = if round % 2 == 0 {
            let a = ours()?;
            (a, dd_direct()?)
        } else {
            let c = dd_direct()?;
            (ours()?, c)
        };
        let (ot, rt, dt) = (mib(total) / os, mib(total) / rs, mib(total) / ds);
        let wt = mib(total) / ws;
        eprintln!(
            "round {}: ours {os:.2} s ({ot:.0} MiB/s; its writes {ws:.2} s, {wt:.0} MiB/s), curl|dd {rs:.2} s ({rt:.0} MiB/s), ratio {:.3}; dd direct from the page cache {ds:.2} s ({dt:.0} MiB/s), ours / it {:.3}, our writes / it {:.3}",
            round + 1,
            ot / rt,
            ot / dt,
            wt / dt
        );
        w.push(wt);
        restore_ratios.push(wt / dt);
        o.push(ot);
        r.push(rt);
        d.push(dt);
        ratios.push(ot / rt);
        write_ratios.push(ot / dt);
    }
    let (om, rm, dm, ratio, write_ratio) = (
        median(&mut o.clone()),
        median(&mut r.clone()),
        median(&mut d.clone()),
        median(&mut ratios.clone()),
        median(&mut write_ratios.clone()),
    );
    let (wm, restore_ratio) = (median(&mut w.clone()), median(&mut restore_ratios.clone()));
    let load = anneal_bench::load_average();
    println!(
        "deploy throughput: ours {om:.0} MiB/s / curl|dd oflag=direct {rm:.0} MiB/s = {ratio:.3} (goal >= 0.9, median of {rounds} rounds, load {})",
        load.as_deref().unwrap_or("?")
    );
    println!(
        "restore part of the deploy: its writes {wm:.0} MiB/s / dd oflag=direct from the page cache {dm:.0} MiB/s = {restore_ratio:.3} (goal >= 0.9); the whole deploy path (fetch, verify, write) / dd direct = {write_ratio:.3}"
    );
    anneal_bench::write_json(
        "deploy",
        &serde_json::json!({
            "streamBytes": total,
            "rangeMiB": range_mib,
            "rounds": rounds,
            "oursMiBps": o,
            "referenceMiBps": r,
            "ratios": ratios,
            "medianOursMiBps": om,
            "medianReferenceMiBps": rm,
            "medianRatio": ratio,
            "goal": 0.9,
            "oursWriteMiBps (stream bytes / seconds inside the target's writes)": w,
            "medianOursWriteMiBps": wm,
            "restoreRatios (our writes / dd direct)": restore_ratios,
            "medianRestoreRatio": restore_ratio,
            "ddDirectMiBps": d,
            "medianDdDirectMiBps": dm,
            "writeRatios (ours / dd direct from the page cache)": write_ratios,
            "medianWriteRatio": write_ratio,
            "writeGoal": 0.9,
            "loadAverage": load,
        }),
    )?;
    Ok(())
}
