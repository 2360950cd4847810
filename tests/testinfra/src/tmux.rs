//! A real terminal for tests of full-screen output: a tmux server on its
//! own socket (`-S`, never the user's), one detached session of a fixed
//! size running a command; its screen is read with `capture-pane -p`. When
//! the guard drops, the server is told to exit through its socket (which
//! hangs up the pane's processes) and is then killed by its PID if it is
//! still there.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

/// A tmux server with one session; killed on drop.
#[derive(Debug)]
pub struct Tmux {
    socket: PathBuf,
    server_pid: Option<u32>,
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
        let mut t = Self {
            socket,
            server_pid: None,
        };
        t.server_pid = t
            .tmux(&["display-message", "-p", "-t", "t", "#{pid}"])
            .trim()
            .parse()
            .ok();
        anyhow::ensure!(
            t.server_pid.is_some(),
            "tmux started but its server does not tell its PID"
        );
        Ok(t)
    }

    fn tmux(&self, args: &[&str]) -> String {
        Command::new("tmux")
            .arg("-S")
            .arg(&self.socket)
            .args(args)
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default()
    }

    /// The screen now.
    pub fn capture(&self) -> String {
        self.tmux(&["capture-pane", "-p", "-t", "t"])
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
        if let Some(pid) = self.server_pid {
            // kill-server returns before the server has exited: give it a
            // moment, then make sure.
            let end = Instant::now() + Duration::from_secs(2);
            while crate::process_alive(pid) && Instant::now() < end {
                std::thread::sleep(Duration::from_millis(20));
            }
            if crate::process_alive(pid) {
                let _ = kill(Pid::from_raw(pid as i32), Signal::SIGKILL);
            }
        }
    }
}
