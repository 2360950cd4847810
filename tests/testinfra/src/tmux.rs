//! A real terminal for tests of full-screen output: a tmux server on its
//! own socket (`-S`, never the user's), one detached session of a fixed
//! size running a command; its screen is read with `capture-pane -p`. The
//! server is killed by its socket when the guard drops.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// A tmux server with one session; killed on drop.
#[derive(Debug)]
pub struct Tmux {
    socket: PathBuf,
}

impl Tmux {
    /// Starts `command` (run by tmux's shell) in a detached 160x40 session,
    /// the server's socket in `dir`.
    pub fn start(dir: &Path, command: &str) -> anyhow::Result<Self> {
        let socket = dir.join("tmux.sock");
        let st = Command::new("tmux")
            .arg("-S")
            .arg(&socket)
            .args([
                "-f",
                "/dev/null",
                "new-session",
                "-d",
                "-x",
                "160",
                "-y",
                "40",
            ])
            .args(["-s", "t"])
            .arg(command)
            .status()?;
        anyhow::ensure!(
            st.success(),
            "tmux new-session failed ({st}); is tmux installed (tests/setup.sh)?"
        );
        Ok(Self { socket })
    }

    /// The screen now.
    pub fn capture(&self) -> String {
        Command::new("tmux")
            .arg("-S")
            .arg(&self.socket)
            .args(["capture-pane", "-p", "-t", "t"])
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default()
    }

    /// The screen once it shows `want`: the terminal is sampled every
    /// 100 ms (what it shows is the event waited for); an error with the
    /// last screen after `deadline`.
    pub async fn until(&self, want: &str, deadline: Duration) -> anyhow::Result<String> {
        let end = Instant::now() + deadline;
        loop {
            let s = self.capture();
            if s.contains(want) {
                return Ok(s);
            }
            anyhow::ensure!(
                Instant::now() < end,
                "the terminal did not show {want:?} within {deadline:?}:\n{s}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = Command::new("tmux")
            .arg("-S")
            .arg(&self.socket)
            .arg("kill-server")
            .status();
    }
}
