//! What the benchmark programs share: where results go, how a ratio against
//! a reference measured in the same run is computed, medians, command-line
//! options, and the network-namespace and process-group code of the tests
//! (re-exported from `anneal-testinfra`, so a benchmark and a test set up
//! namespaces and daemons the same way and clean them up the same way).
//!
//! Every program writes `target/bench/<name>.json` at the workspace root and
//! prints each ratio as `name: ours / reference = ratio`.
#![cfg_attr(test, allow(clippy::too_many_lines))]

use std::path::{Path, PathBuf};
use std::process::Command;

pub use anneal_testinfra::{ChildGroup, Netns, run};

/// `target/bench` of the workspace (created when missing).
pub fn out_dir() -> std::io::Result<PathBuf> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/bench");
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

/// Writes `value` as pretty JSON to `target/bench/<name>.json` and says so.
pub fn write_json(name: &str, value: &serde_json::Value) -> anyhow::Result<PathBuf> {
    let path = out_dir()?.join(format!("{name}.json"));
    std::fs::write(&path, serde_json::to_vec_pretty(value)?)?;
    println!("wrote {}", path.display());
    Ok(path)
}

/// `ours / reference`, or `None` when the reference is not a positive time.
pub fn ratio(ours: f64, reference: f64) -> Option<f64> {
    (reference > 0.0 && ours.is_finite() && reference.is_finite()).then(|| ours / reference)
}

/// The load average of the machine, for the record of a run.
pub fn load_average() -> Option<String> {
    let l = std::fs::read_to_string("/proc/loadavg").ok()?;
    Some(l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
}

/// The median of `v` (sorted in place); NaN when `v` is empty.
pub fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// Whether the program was started with `--name`.
pub fn flag(name: &str) -> bool {
    std::env::args().skip(1).any(|a| a == name)
}

/// The value of option `--name`, given as `--name=value` or `--name value`.
pub fn option(name: &str) -> Option<String> {
    option_in(std::env::args().skip(1), name)
}

fn option_in(mut args: impl Iterator<Item = String>, name: &str) -> Option<String> {
    while let Some(a) = args.next() {
        if a == name {
            return args.next();
        }
        if let Some(v) = a.strip_prefix(name).and_then(|r| r.strip_prefix('=')) {
            return Some(v.to_owned());
        }
    }
    None
}

/// The value of option `--name` parsed, `default` when absent; a value that
/// does not parse is an error naming the option.
pub fn option_or<T: std::str::FromStr>(name: &str, default: T) -> anyhow::Result<T>
where
    T::Err: std::fmt::Display,
{
    match option(name) {
        None => Ok(default),
        Some(v) => v.parse().map_err(|e| anyhow::anyhow!("{name} {v:?}: {e}")),
    }
}

/// A binary under test: the path given with `flag` (`--agent`,
/// `--bootd`, ...), else `name` built next to this benchmark
/// (`target/release/NAME` when the bench runs from `target/release`); the
/// error says how to build it (`cargo build --release -p PACKAGE --bin NAME`).
pub fn sibling_bin(name: &str, flag: &str, package: &str) -> anyhow::Result<PathBuf> {
    if let Some(p) = option(flag) {
        return Ok(PathBuf::from(p));
    }
    let exe = std::env::current_exe()?;
    let p = exe
        .parent()
        .map(|d| d.join(name))
        .ok_or_else(|| anyhow::anyhow!("no directory for {}", exe.display()))?;
    anyhow::ensure!(
        p.is_file(),
        "{} is missing: build it with `cargo build --release -p {package} --bin {name}` (or pass {flag} PATH)",
        p.display()
    );
    Ok(p)
}

/// The `anneal-agent` binary under test (`--agent PATH` or the sibling).
pub fn agent_bin() -> anyhow::Result<PathBuf> {
    sibling_bin("anneal-agent", "--agent", "anneal-agent")
}

/// A process's peak resident set (VmHWM of /proc/PID/status), MiB.
pub fn peak_rss_mib(pid: u32) -> anyhow::Result<f64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let kib: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| anyhow::anyhow!("no VmHWM in /proc/{pid}/status"))?;
    Ok(kib / 1024.0)
}

/// A free TCP port on 127.0.0.1 (bound, read, released).
pub fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// Waits until something accepts connections on `127.0.0.1:port`, or fails
/// after `secs` seconds.
pub fn wait_listening(port: u16, secs: u64) -> anyhow::Result<()> {
    let until = std::time::Instant::now() + std::time::Duration::from_secs(secs);
    loop {
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return Ok(());
        }
        anyhow::ensure!(
            std::time::Instant::now() < until,
            "nothing listens on 127.0.0.1:{port} after {secs}s"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// Deterministic pseudo-random bytes (xorshift, as the tests' fixtures), so
/// a file does not compress and all its blocks are used.
pub fn noise(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(len);
    out
}

/// Writes `<dir>/disk.raw` as the image tests' `gpt_disk` does: `size_mib`
/// MiB, GPT, partition 1 ESP (vfat, 32 MiB, a few files), 2 ext4 (the rest
/// minus 1 MiB for the backup table) holding `data_mib` MiB of pseudo-random
/// 4 MiB files. Needs sgdisk, mkfs.vfat, mcopy, mke2fs. Returns its path.
pub fn gpt_disk(dir: &Path, size_mib: u64, data_mib: u64) -> anyhow::Result<PathBuf> {
    let raw = dir.join("disk.raw");
    std::fs::File::create(&raw)?.set_len(size_mib << 20)?;
    let p2_mib = size_mib - 1 - 32 - 1;
    run(Command::new("sgdisk")
        .args(["-o", "-n", "1:2048:+32M", "-t", "1:ef00"])
        .arg(format!("-n=2:0:+{p2_mib}M"))
        .args(["-t", "2:8300"])
        .arg(&raw))?;
    let p1 = 2048u64;
    let p2 = p1 + (32 << 11);
    let esp_tree = dir.join("esp");
    std::fs::create_dir_all(esp_tree.join("EFI/BOOT"))?;
    std::fs::write(esp_tree.join("EFI/BOOT/BOOTX64.EFI"), noise(1, 300_000))?;
    std::fs::write(esp_tree.join("EFI/BOOT/grub.cfg"), noise(2, 20_000))?;
    std::fs::write(
        esp_tree.join("startup.nsh"),
        b"fs0:\\EFI\\BOOT\\BOOTX64.EFI\n",
    )?;
    let esp = dir.join("esp.img");
    let _ = std::fs::remove_file(&esp);
    run(Command::new("mkfs.vfat")
        .args(["-C", "-n", "ESP"])
        .arg(&esp)
        .arg("32768"))?;
    run(Command::new("mcopy")
        .args(["-s", "-i"])
        .arg(&esp)
        .arg(esp_tree.join("EFI"))
        .arg(esp_tree.join("startup.nsh"))
        .arg("::"))?;
    run(Command::new("dd")
        .arg(format!("if={}", esp.display()))
        .arg(format!("of={}", raw.display()))
        .args([
            "bs=1M",
            "conv=notrunc,sparse",
            "status=none",
            "oflag=seek_bytes",
        ])
        .arg(format!("seek={}", p1 * 512)))?;
    std::fs::remove_file(&esp)?;
    let tree = dir.join("root");
    std::fs::create_dir_all(tree.join("etc"))?;
    std::fs::write(tree.join("etc/hostname"), b"bench\n")?;
    for i in 0..data_mib.div_ceil(4) {
        std::fs::write(tree.join(format!("blob{i}")), noise(100 + i, 4 << 20))?;
    }
    run(Command::new("mke2fs")
        .args(["-q", "-F", "-t", "ext4", "-L", "root", "-E"])
        .arg(format!("offset={}", p2 * 512))
        .arg("-d")
        .arg(&tree)
        .arg(&raw)
        .arg(format!("{p2_mib}M")))?;
    std::fs::remove_dir_all(&tree)?;
    std::fs::remove_dir_all(&esp_tree)?;
    Ok(raw)
}

/// An nginx of our own (not the system service): `nginx -c CONF -p PREFIX -g
/// 'daemon off;'` as a child process group with its config, pid file and
/// logs in `dir`, serving `root` on 127.0.0.1:`port` with sendfile. Stopped
/// (the group killed and reaped) when dropped.
#[derive(Debug)]
pub struct Nginx {
    /// The port it listens on.
    pub port: u16,
    child: ChildGroup,
}

impl Nginx {
    /// Starts nginx with `workers` worker processes. With `alias` set,
    /// `location /<alias>/` maps to `root` (so `/content/<ns>/<c>/stream`
    /// is `<root>/<ns>/<c>/stream`, the content server's path); without,
    /// `root` is the document root.
    pub fn start(
        dir: &Path,
        root: &Path,
        workers: u32,
        alias: Option<&str>,
    ) -> anyhow::Result<Self> {
        let nginx = ["/usr/sbin/nginx", "/usr/bin/nginx"]
            .into_iter()
            .find(|p| Path::new(p).is_file())
            .ok_or_else(|| anyhow::anyhow!("nginx not installed: run bench/setup.sh"))?;
        std::fs::create_dir_all(dir.join("logs"))?;
        let port = free_port()?;
        let d = dir.display();
        let r = root.display();
        let location = match alias {
            Some(a) => format!("location /{a}/ {{ alias {r}/; }}"),
            None => format!("root {r};"),
        };
        let conf = format!(
            "worker_processes {workers};\n\
             pid {d}/nginx.pid;\n\
             error_log {d}/logs/error.log warn;\n\
             events {{ worker_connections 1024; }}\n\
             http {{\n\
             \x20 access_log off;\n\
             \x20 sendfile on;\n\
             \x20 tcp_nopush on;\n\
             \x20 keepalive_requests 100000;\n\
             \x20 default_type application/octet-stream;\n\
             \x20 client_body_temp_path {d}/tmp-body;\n\
             \x20 proxy_temp_path {d}/tmp-proxy;\n\
             \x20 fastcgi_temp_path {d}/tmp-fastcgi;\n\
             \x20 uwsgi_temp_path {d}/tmp-uwsgi;\n\
             \x20 scgi_temp_path {d}/tmp-scgi;\n\
             \x20 server {{\n\
             \x20   listen 127.0.0.1:{port};\n\
             \x20   {location}\n\
             \x20 }}\n\
             }}\n"
        );
        let conf_path = dir.join("nginx.conf");
        std::fs::write(&conf_path, conf)?;
        let child = ChildGroup::spawn_logged(
            "nginx",
            Command::new(nginx)
                .arg("-c")
                .arg(&conf_path)
                .arg("-p")
                .arg(dir)
                .args(["-g", "daemon off;"]),
            &dir.join("logs/stdout.log"),
        )?;
        wait_listening(port, 10).map_err(|e| anyhow::anyhow!("{e} (see {}/logs/error.log)", d))?;
        Ok(Self { port, child })
    }
}

impl Drop for Nginx {
    /// Fast shutdown of the master by PID (it stops and reaps its workers),
    /// then the group is killed and the master reaped (`ChildGroup`'s drop),
    /// so no worker is left behind for init to reap.
    fn drop(&mut self) {
        let pid = self.child.pid();
        if pid != 0 {
            let _ = Command::new("kill")
                .args(["-TERM", &pid.to_string()])
                .status();
            let until = std::time::Instant::now() + std::time::Duration::from_secs(5);
            while self.child.try_exit().is_none() && std::time::Instant::now() < until {
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
        }
    }
}

/// Runs `f` and returns its wall time in seconds.
pub fn timed(f: impl FnOnce() -> anyhow::Result<()>) -> anyhow::Result<f64> {
    let t = std::time::Instant::now();
    f()?;
    Ok(t.elapsed().as_secs_f64())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ratio_needs_a_positive_reference() {
        assert_eq!(ratio(2.0, 4.0), Some(0.5));
        assert_eq!(ratio(2.0, 0.0), None);
        assert_eq!(ratio(f64::NAN, 1.0), None);
    }

    #[test]
    fn median_of_odd_even_and_empty() {
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut [4.0, 1.0, 3.0, 2.0]), 3.0);
        assert!(median(&mut []).is_nan());
    }

    #[test]
    fn options_in_both_spellings() {
        let args = |v: &[&str]| {
            v.iter()
                .map(|s| (*s).to_owned())
                .collect::<Vec<_>>()
                .into_iter()
        };
        assert_eq!(
            option_in(args(&["--runs=3"]), "--runs").as_deref(),
            Some("3")
        );
        assert_eq!(
            option_in(args(&["--quick", "--runs", "4"]), "--runs").as_deref(),
            Some("4")
        );
        assert_eq!(option_in(args(&["--runsx=3", "--runs"]), "--runs"), None);
        assert_eq!(option_in(args(&["--only=tftp"]), "--runs"), None);
    }
}
