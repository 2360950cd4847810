//! Fixtures of the image tests: a GPT disk image with the partitions real
//! images have (ESP vfat, swap, ext4 with files, an unformatted partition),
//! and a small HTTP/1.1 file server on loopback that can be throttled (a
//! slow source, so progress is observable) and counts its requests.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

fn run(cmd: &mut Command) {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The swap UUID of [`gpt_disk`].
pub const SWAP_UUID: &str = "6a1c9b7e-2f4d-4e3a-9b1c-0d2e3f4a5b6c";

/// Writes `<dir>/disk.raw`: `size_mib` MiB, GPT, partition 1 ESP (vfat,
/// 32 MiB, two files), 2 swap (16 MiB, [`SWAP_UUID`]), 3 ext4 (the rest
/// minus 8 MiB, `data_mib` MiB of pseudo-random files), 4 unformatted
/// (8 MiB). Returns its path.
pub fn gpt_disk(dir: &Path, size_mib: u64, data_mib: u64) -> PathBuf {
    let raw = dir.join("disk.raw");
    std::fs::File::create(&raw)
        .unwrap()
        .set_len(size_mib << 20)
        .unwrap();
    let p3_mib = size_mib - 1 - 32 - 16 - 8 - 1;
    run(Command::new("sgdisk")
        .args([
            "-o",
            "-n",
            "1:2048:+32M",
            "-t",
            "1:ef00",
            "-n",
            "2:0:+16M",
            "-t",
            "2:8200",
        ])
        .arg(format!("-n=3:0:+{p3_mib}M"))
        .args(["-t", "3:8300", "-n", "4:0:+8M", "-t", "4:8300"])
        .arg(&raw));
    // Partition starts, in sectors: 1 at 2048, then back to back.
    let p1 = 2048u64;
    let p2 = p1 + (32 << 11);
    let p3 = p2 + (16 << 11);
    let esp_tree = dir.join("esp");
    std::fs::create_dir_all(esp_tree.join("EFI/BOOT")).unwrap();
    std::fs::write(esp_tree.join("EFI/BOOT/BOOTX64.EFI"), noise(1, 300_000)).unwrap();
    std::fs::write(
        esp_tree.join("startup.nsh"),
        b"fs0:\\EFI\\BOOT\\BOOTX64.EFI\n",
    )
    .unwrap();
    let esp = dir.join("esp.img");
    run(Command::new("mkfs.vfat")
        .args(["-C", "-n", "ESP"])
        .arg(&esp)
        .arg("32768"));
    run(Command::new("mcopy")
        .args(["-s", "-i"])
        .arg(&esp)
        .arg(esp_tree.join("EFI"))
        .arg(esp_tree.join("startup.nsh"))
        .arg("::"));
    place(&esp, &raw, p1 * 512);
    std::fs::remove_file(&esp).unwrap();
    let swap = dir.join("swap.img");
    std::fs::File::create(&swap)
        .unwrap()
        .set_len(16 << 20)
        .unwrap();
    run(Command::new("mkswap").args(["-U", SWAP_UUID]).arg(&swap));
    place(&swap, &raw, p2 * 512);
    std::fs::remove_file(&swap).unwrap();
    let tree = dir.join("root");
    std::fs::create_dir_all(tree.join("etc")).unwrap();
    std::fs::write(tree.join("etc/hostname"), b"imported\n").unwrap();
    let chunk = 4u64 << 20;
    for i in 0..data_mib.div_ceil(4) {
        std::fs::write(
            tree.join(format!("blob{i}")),
            noise(100 + i, chunk as usize),
        )
        .unwrap();
    }
    run(Command::new("mke2fs")
        .args(["-q", "-F", "-t", "ext4", "-L", "root", "-E"])
        .arg(format!("offset={}", p3 * 512))
        .arg("-d")
        .arg(&tree)
        .arg(&raw)
        .arg(format!("{p3_mib}M")));
    std::fs::remove_dir_all(&tree).unwrap();
    std::fs::remove_dir_all(&esp_tree).unwrap();
    raw
}

fn place(src: &Path, dst: &Path, offset: u64) {
    run(Command::new("dd")
        .arg(format!("if={}", src.display()))
        .arg(format!("of={}", dst.display()))
        .args([
            "bs=1M",
            "conv=notrunc,sparse",
            "status=none",
            "oflag=seek_bytes",
        ])
        .arg(format!("seek={offset}")));
}

/// Deterministic pseudo-random bytes (xorshift), so a file does not compress
/// and its blocks are all used.
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

/// SHA-256 of a file, hex.
pub fn sha256_file(path: &Path) -> String {
    let out = Command::new("sha256sum").arg(path).output().unwrap();
    assert!(out.status.success());
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .unwrap()
        .to_string()
}

/// A static file server on 127.0.0.1, or the address given
/// ([`FileServer::start_on`]) (HTTP/1.1, GET only, one request per
/// connection, whole files): 200 with Content-Length, 404 for a missing
/// file. With a rate, bodies are sent at about that many bytes per second.
/// Stops (and joins its thread) when dropped.
#[derive(Debug)]
pub struct FileServer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    requests: Arc<AtomicU64>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl FileServer {
    /// Serves `root`; `rate` bytes per second per response (`None`: as fast
    /// as possible).
    pub fn start(root: &Path, rate: Option<u64>) -> Self {
        Self::start_on(root, rate, std::net::Ipv4Addr::LOCALHOST.into())
    }

    /// [`FileServer::start`] on `ip` (any port): e.g. the test node's
    /// address, which its pods reach.
    pub fn start_on(root: &Path, rate: Option<u64>, ip: std::net::IpAddr) -> Self {
        let listener = TcpListener::bind((ip, 0)).unwrap();
        listener.set_nonblocking(true).unwrap();
        let addr = listener.local_addr().unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let requests = Arc::new(AtomicU64::new(0));
        let (root, s, r) = (root.to_path_buf(), stop.clone(), requests.clone());
        let thread = std::thread::spawn(move || {
            while !s.load(Ordering::SeqCst) {
                match listener.accept() {
                    Ok((conn, _)) => {
                        r.fetch_add(1, Ordering::SeqCst);
                        let root = root.clone();
                        let s = s.clone();
                        std::thread::spawn(move || {
                            let _ = serve_one(conn, &root, rate, &s);
                        });
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(5)),
                }
            }
        });
        Self {
            addr,
            stop,
            requests,
            thread: Some(thread),
        }
    }

    /// `http://ADDRESS:PORT/<path>`.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}/{path}", self.addr)
    }

    /// Connections accepted so far.
    pub fn requests(&self) -> u64 {
        self.requests.load(Ordering::SeqCst)
    }
}

impl Drop for FileServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn serve_one(
    conn: TcpStream,
    root: &Path,
    rate: Option<u64>,
    stop: &AtomicBool,
) -> std::io::Result<()> {
    conn.set_nonblocking(false)?;
    conn.set_read_timeout(Some(Duration::from_secs(10)))?;
    let mut reader = BufReader::new(conn.try_clone()?);
    let mut line = String::new();
    reader.read_line(&mut line)?;
    loop {
        let mut h = String::new();
        if reader.read_line(&mut h)? == 0 || h == "\r\n" || h == "\n" {
            break;
        }
    }
    let path = line
        .split_whitespace()
        .nth(1)
        .unwrap_or("/")
        .trim_start_matches('/');
    let mut conn = conn;
    let file = if path.contains("..") {
        None
    } else {
        std::fs::File::open(root.join(path)).ok()
    };
    let Some(mut file) = file else {
        conn.write_all(
            b"HTTP/1.1 404 Not Found\r\nContent-Length: 9\r\nConnection: close\r\n\r\nnot found",
        )?;
        return Ok(());
    };
    let len = file.metadata()?.len();
    write!(
        conn,
        "HTTP/1.1 200 OK\r\nContent-Length: {len}\r\nContent-Type: application/octet-stream\r\nConnection: close\r\n\r\n"
    )?;
    let start = Instant::now();
    let mut sent = 0u64;
    let mut buf = vec![0u8; 256 * 1024];
    loop {
        if stop.load(Ordering::SeqCst) {
            return Ok(());
        }
        let n = file.read(&mut buf)?;
        if n == 0 {
            return Ok(());
        }
        conn.write_all(&buf[..n])?;
        sent += n as u64;
        if let Some(rate) = rate {
            // Pace the body: a slow source, not synchronisation.
            let due = Duration::from_secs_f64(sent as f64 / rate as f64);
            if let Some(wait) = due.checked_sub(start.elapsed()) {
                std::thread::sleep(wait);
            }
        }
    }
}

/// Sector ranges (start, count) of the ESP and the ext4 partition of
/// [`gpt_disk`] with `size_mib`.
pub fn gpt_disk_parts(size_mib: u64) -> [(u64, u64); 2] {
    let p3_mib = size_mib - 1 - 32 - 16 - 8 - 1;
    [(2048, 32 << 11), (2048 + (48 << 11), p3_mib << 11)]
}

fn sh(script: &str) {
    run(Command::new("sh").args(["-c", script]));
}

/// A single partclone image (`partclone.ext4 -c`) of the ext4 partition of
/// a [`gpt_disk`] of `size_mib`: `<dir>/root.pcl`.
pub fn partclone_of_root(dir: &Path, disk: &Path, size_mib: u64) -> PathBuf {
    let (skip, count) = gpt_disk_parts(size_mib)[1];
    let part = dir.join("root.part");
    let out = dir.join("root.pcl");
    sh(&format!(
        "dd if={} of={} bs=512 skip={skip} count={count} status=none && partclone.ext4 -c -q -L {}/pcl.log -s {} -o {} && rm {}",
        disk.display(),
        part.display(),
        dir.display(),
        part.display(),
        out.display(),
        part.display()
    ));
    out
}

/// A Clonezilla image directory of a [`gpt_disk`] of `size_mib` (sfdisk
/// dump, the ESP as gzip'd partclone.vfat, the root as zstd'd
/// partclone.ext4 split in two parts, the swap's info), and the same as a
/// tar: returns (directory, tar).
pub fn clonezilla_of(dir: &Path, disk: &Path, size_mib: u64) -> (PathBuf, PathBuf) {
    let name = "2026-12-01-img";
    let cz = dir.join(name);
    std::fs::create_dir_all(&cz).unwrap();
    sh(&format!(
        "sfdisk -d {disk} | sed -E 's#^[^ ]*raw([0-9]+) :#/dev/sda\\1 :#' > {cz}/sda-pt.sf && echo sda > {cz}/disk && echo 'sda1 sda2 sda3 sda4' > {cz}/parts",
        disk = disk.display(),
        cz = cz.display()
    ));
    let [esp, root] = gpt_disk_parts(size_mib);
    for (n, tool, comp, (skip, count)) in [(1, "vfat", "gz", esp), (3, "ext4", "zst", root)] {
        let part = dir.join(format!("p{n}.part"));
        let compress = if comp == "gz" {
            "gzip -c"
        } else {
            "zstd -q -c"
        };
        sh(&format!(
            "dd if={disk} of={part} bs=512 skip={skip} count={count} status=none && \
             partclone.{tool} -c -q -L {d}/pc.log -s {part} -o - | {compress} > {d}/cz.tmp && \
             split -n 2 {d}/cz.tmp {cz}/sda{n}.{tool}-ptcl-img.{comp}. && rm {d}/cz.tmp {part}",
            disk = disk.display(),
            part = part.display(),
            d = dir.display(),
            cz = cz.display()
        ));
    }
    std::fs::write(
        cz.join("swappt-sda2.info"),
        format!("UUID=\"{SWAP_UUID}\"\nLABEL=\"\"\n"),
    )
    .unwrap();
    let tar = dir.join("cz.tar");
    sh(&format!("cd {} && tar -cf cz.tar {name}", dir.display()));
    (cz, tar)
}
