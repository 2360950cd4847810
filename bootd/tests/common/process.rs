//! A `bootd` process of a test: its log lines forwarded (and kept for
//! [`BootdProcess::wait_lines`]), started once it printed "bootd serving",
//! killed by its PID on drop.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// A running bootd.
pub struct BootdProcess {
    pub child: Child,
    /// The "bootd serving" line (its addresses).
    pub serving: String,
    /// bootd's log lines after it.
    pub lines: mpsc::Receiver<String>,
}

impl BootdProcess {
    /// Spawns `cmd` (bootd's command line; stderr is taken) with
    /// `RUST_LOG=info` and waits up to 60 s for its "bootd serving" line.
    pub fn spawn(cmd: &mut Command) -> BootdProcess {
        let mut child = cmd
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stderr = child.stderr.take().unwrap();
        let (tx, rx) = mpsc::channel::<String>();
        // Forwards every line (and keeps the pipe drained after the start).
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                eprintln!("bootd: {line}");
                let _ = tx.send(line);
            }
        });
        let deadline = Instant::now() + Duration::from_secs(60);
        let serving = loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok(l) if l.contains("bootd serving") => break l,
                Ok(_) => {}
                Err(e) => {
                    let _ = child.kill();
                    let _ = child.wait();
                    panic!("bootd did not print \"bootd serving\" ({e}): see its lines above");
                }
            }
        };
        BootdProcess {
            child,
            serving,
            lines: rx,
        }
    }

    /// bootd's peak resident set (VmHWM), bytes.
    pub fn peak_rss(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap();
        let kib: u64 = status
            .lines()
            .find_map(|l| l.strip_prefix("VmHWM:"))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap();
        kib * 1024
    }

    /// Waits (up to 30 s) for `n` log lines containing every one of `words`.
    pub fn wait_lines(&self, words: &[&str], n: usize) {
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut seen = 0;
        while seen < n {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = self
                .lines
                .recv_timeout(left)
                .unwrap_or_else(|e| panic!("no log line with {words:?} ({e}), {seen} of {n}"));
            if words.iter().all(|w| line.contains(w)) {
                seen += 1;
            }
        }
    }
}

impl Drop for BootdProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
