//! Imaging benchmark: a 4 GiB ext4 with ~1.5 GiB of files, captured with
//! anneal and `partclone.ext4 -c`, restored to a file on the same disk with
//! anneal, `partclone.restore` and `dd iflag=direct oflag=direct bs=4M` of
//! the same bytes. Page cache dropped before every contender; every time
//! includes the final flush. Prints ratios, writes target/bench/imaging.json.
//!
//! Run as root: `cargo run --release -p anneal-bench --bin imaging-bench`
//! (options: `--runs N`, `--used-mib N`, `--keep`).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use anneal_bench::median;
use anneal_image::capture::{self, Options};
use anneal_image::restore::{self, Content, Target};
use anyhow::bail;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

const SCRATCH: &str = "/var/tmp/anneal-bench";
const FS_SIZE: u64 = 4 << 30;

/// Runs `cmd` to completion (the error carries its stderr).
fn run(cmd: &mut Command) -> anyhow::Result<()> {
    anneal_bench::run(cmd).map(drop)
}

/// Pause after dropping caches, before each timed contender.
const SETTLE_SECS: u64 = 3;

fn drop_caches() {
    let _ = Command::new("sync").status();
    if let Err(e) = std::fs::write("/proc/sys/vm/drop_caches", "3\n") {
        eprintln!("warning: cannot drop caches: {e}");
    }
}

fn fresh(p: &Path) {
    let _ = std::fs::remove_file(p);
}

/// Fills a 4 GiB ext4 image with `used_mib` of pseudo-random files.
fn build_fs(dir: &Path, used_mib: u64) -> anyhow::Result<PathBuf> {
    let img = dir.join("fs.img");
    let f = std::fs::File::create(&img)?;
    f.set_len(FS_SIZE)?;
    drop(f);
    run(Command::new("mkfs.ext4").args(["-q", "-F"]).arg(&img))?;
    let mnt = dir.join("mnt");
    std::fs::create_dir_all(&mnt)?;
    run(Command::new("mount")
        .args(["-o", "loop"])
        .arg(&img)
        .arg(&mnt))?;
    let fill = || -> anyhow::Result<()> {
        let mut x: u64 = 0x2545_F491_4F6C_DD1D;
        let mut buf = vec![0u8; 8 << 20];
        let mut left = used_mib << 20;
        let mut n = 0;
        while left > 0 {
            // files from 64 KiB to 40 MiB
            let size = (((n * 7919) % 640 + 1) << 16).min(left);
            let sub = mnt.join(format!("d{}", n % 16));
            std::fs::create_dir_all(&sub)?;
            let mut f = std::fs::File::create(sub.join(format!("f{n}.bin")))?;
            let mut w = 0u64;
            while w < size {
                let k = (size - w).min(buf.len() as u64) as usize;
                for c in buf[..k].chunks_exact_mut(8) {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    c.copy_from_slice(&x.to_le_bytes());
                }
                f.write_all(&buf[..k])?;
                w += k as u64;
            }
            left -= size;
            n += 1;
        }
        Ok(())
    };
    let r = fill();
    run(Command::new("umount").arg(&mnt))?;
    r?;
    Ok(img)
}

fn time(f: impl FnOnce() -> anyhow::Result<()>) -> anyhow::Result<f64> {
    drop_caches();
    // let the previous contender's write-back drain below the guest (the
    // virtual disk's host cache), so nobody starts on a busy disk
    std::thread::sleep(std::time::Duration::from_secs(SETTLE_SECS));
    let t = Instant::now();
    f()?;
    Ok(t.elapsed().as_secs_f64())
}

/// `partclone.ext4 -c` of `img` into `pc_img`, synced.
fn partclone_capture(log: &Path, img: &Path, pc_img: &Path) -> anyhow::Result<()> {
    run(Command::new("partclone.ext4")
        .args(["-c", "-q", "-L"])
        .arg(log)
        .arg("-s")
        .arg(img)
        .arg("-o")
        .arg(pc_img))?;
    run(&mut Command::new("sync"))
}

/// `partclone.restore` of `pc_img` onto a fresh `target`, synced.
fn partclone_restore(log: &Path, pc_img: &Path, target: &Path) -> anyhow::Result<()> {
    std::fs::File::create(target)?.set_len(FS_SIZE)?;
    run(Command::new("partclone.restore")
        .args(["-q", "-C", "-L"])
        .arg(log)
        .arg("-s")
        .arg(pc_img)
        .arg("-O")
        .arg(target))?;
    run(&mut Command::new("sync"))
}

/// Whether `a` and `b` hold the same bytes in a sample of the content's
/// used extents (every seventh, its first MiB).
fn same_used_blocks(a: &Path, b: &Path, content: &Content) -> anyhow::Result<bool> {
    use std::os::unix::fs::FileExt as _;
    let a = std::fs::File::open(a)?;
    let b = std::fs::File::open(b)?;
    let mut ok = true;
    for e in content.index.extents.iter().step_by(7) {
        let n = e.len.min(1 << 20) as usize;
        let (mut x, mut y) = (vec![0u8; n], vec![0u8; n]);
        a.read_exact_at(&mut x, e.offset)?;
        b.read_exact_at(&mut y, e.offset)?;
        ok &= x == y;
    }
    Ok(ok)
}

fn main() -> anyhow::Result<()> {
    let runs: usize = anneal_bench::option_or("--runs", 5)?;
    let used_mib: u64 = anneal_bench::option_or("--used-mib", 1536)?;
    let keep = anneal_bench::flag("--keep");
    let dir = PathBuf::from(SCRATCH);
    std::fs::create_dir_all(&dir)?;
    let log = dir.join("partclone.log");
    let img = if dir.join("fs.img").exists() && keep {
        dir.join("fs.img")
    } else {
        eprintln!("building a 4 GiB ext4 with {used_mib} MiB of files...");
        build_fs(&dir, used_mib)?
    };
    let out = dir.join("content");
    std::fs::create_dir_all(&out)?;
    let (idx_path, stream_path) = capture::content_paths(&out, "p1");
    let pc_img = dir.join("partclone.img");
    let (mut cap_anneal, mut cap_pc) = (Vec::new(), Vec::new());
    let (mut rs_anneal, mut rs_pc, mut rs_dd) = (Vec::new(), Vec::new(), Vec::new());
    let t1 = dir.join("t-anneal.img");
    let t2 = dir.join("t-partclone.img");
    let t3 = dir.join("t-dd.img");
    for run_no in 0..runs {
        // capture
        fresh(&pc_img);
        cap_pc.push(time(|| partclone_capture(&log, &img, &pc_img))?);
        fresh(&idx_path);
        fresh(&stream_path);
        cap_anneal.push(time(|| {
            let f = std::fs::File::open(&img)?;
            capture::capture_region(&f, 0, FS_SIZE, &idx_path, &stream_path, Options::default())?;
            Ok(())
        })?);
        // restore
        let content = Content::load("p1", &idx_path, &stream_path)?;
        let used = content.index.header.used_bytes;
        for t in [&t1, &t2, &t3] {
            fresh(t);
        }
        rs_pc.push(time(|| partclone_restore(&log, &pc_img, &t2))?);
        // anneal and dd alternate which goes first, so neither always
        // inherits the other's write-back or the disk cache's state
        let anneal = || {
            time(|| {
                let mut t = Target::open(&t1, Some(FS_SIZE))?;
                restore::restore_partition(&mut t, 0, &content)?;
                Ok(())
            })
        };
        let dd = || {
            time(|| {
                run(Command::new("dd")
                    .arg(format!("if={}", stream_path.display()))
                    .arg(format!("of={}", t3.display()))
                    .args([
                        "iflag=direct",
                        "oflag=direct",
                        "bs=4M",
                        "conv=fsync",
                        "status=none",
                    ]))
            })
        };
        if run_no % 2 == 0 {
            rs_anneal.push(anneal()?);
            rs_dd.push(dd()?);
        } else {
            rs_dd.push(dd()?);
            rs_anneal.push(anneal()?);
        }
        eprintln!(
            "run {run_no}: capture anneal {:.2}s partclone {:.2}s | restore anneal {:.2}s partclone {:.2}s dd {:.2}s ({} MiB used)",
            cap_anneal[run_no],
            cap_pc[run_no],
            rs_anneal[run_no],
            rs_pc[run_no],
            rs_dd[run_no],
            used >> 20
        );
    }
    // the anneal result is a clean filesystem identical to partclone's
    run(Command::new("e2fsck").arg("-fn").arg(&t1))?;
    let content = Content::load("p1", &idx_path, &stream_path)?;
    let same = same_used_blocks(&t1, &t2, &content)?;
    if !same {
        bail!("anneal and partclone.restore outputs differ in used blocks");
    }
    let used = content.index.header.used_bytes;
    // ratios per run (contenders of one run share the machine's load), then
    // the median over runs
    let per_run =
        |a: &[f64], b: &[f64]| -> Vec<f64> { a.iter().zip(b).map(|(x, y)| x / y).collect() };
    let r_pc = median(&mut per_run(&rs_pc, &rs_anneal));
    let r_dd = median(&mut per_run(&rs_dd, &rs_anneal));
    let r_cap = median(&mut per_run(&cap_pc, &cap_anneal));
    let (ca, cp) = (median(&mut cap_anneal.clone()), median(&mut cap_pc.clone()));
    let (ra, rp, rd) = (
        median(&mut rs_anneal.clone()),
        median(&mut rs_pc.clone()),
        median(&mut rs_dd.clone()),
    );
    let mib = used as f64 / f64::from(1u32 << 20);
    let report = serde_json::json!({
        "benchmark": "imaging",
        "fsSizeBytes": FS_SIZE,
        "usedBytes": used,
        "runs": runs,
        "seconds": {
            "captureAnneal": ca, "capturePartclone": cp,
            "restoreAnneal": ra, "restorePartclone": rp, "ddDirect": rd,
        },
        "mibPerSecond": {
            "restoreAnneal": mib / ra, "restorePartclone": mib / rp, "ddDirect": mib / rd,
            "captureAnneal": mib / ca, "capturePartclone": mib / cp,
        },
        "ratios (median of per-run ratios)": {
            "restoreVsPartclone": r_pc,
            "restoreVsDdDirect": r_dd,
            "captureVsPartclone": r_cap,
        },
        "goals": {
            "restoreVsPartclone": 1.2, "restoreVsDdDirect": 0.9, "captureVsPartclone": 1.0,
        },
        "allRuns": {
            "captureAnneal": cap_anneal, "capturePartclone": cap_pc,
            "restoreAnneal": rs_anneal, "restorePartclone": rs_pc, "ddDirect": rs_dd,
        },
    });
    println!(
        "used {:.0} MiB of 4 GiB ext4, median of {runs} runs (page cache dropped, flush included)",
        mib
    );
    println!(
        "restore: anneal {ra:.2}s ({:.0} MiB/s), partclone.restore {rp:.2}s, dd direct {rd:.2}s",
        mib / ra
    );
    println!(
        "  ratio vs partclone.restore: {r_pc:.2}x (goal >= 1.2x); share of dd direct rate: {:.0}% (goal >= 90%) [medians of per-run ratios]",
        100.0 * r_dd
    );
    println!(
        "capture: anneal {ca:.2}s, partclone.ext4 -c {cp:.2}s, ratio {r_cap:.2}x (goal >= 1.0x)"
    );
    anneal_bench::write_json("imaging", &report)?;
    if !keep {
        std::fs::remove_dir_all(&dir)?;
    } else {
        for t in [&t1, &t2, &t3] {
            fresh(t);
        }
    }
    Ok(())
}
