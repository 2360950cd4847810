//! Child processes in their own process group, killed (the whole group) on drop.

use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};

use nix::sys::signal::{Signal, kill, killpg};
use nix::unistd::Pid;

/// A child started as the leader of a new process group. Dropping it kills
/// the group with SIGKILL and reaps the child.
#[derive(Debug)]
pub struct ChildGroup {
    name: String,
    child: Option<Child>,
}

impl ChildGroup {
    /// Spawns `cmd` as a new process-group leader.
    pub fn spawn(name: &str, cmd: &mut Command) -> anyhow::Result<Self> {
        cmd.process_group(0);
        let child = cmd
            .spawn()
            .map_err(|e| anyhow::anyhow!("cannot start {name} ({cmd:?}): {e}"))?;
        Ok(Self {
            name: name.to_string(),
            child: Some(child),
        })
    }

    /// Like [`ChildGroup::spawn`], with stdin from `/dev/null` and stdout and
    /// stderr written to `log` (created, or truncated when it exists).
    pub fn spawn_logged(name: &str, cmd: &mut Command, log: &Path) -> anyhow::Result<Self> {
        let out = std::fs::File::create(log)
            .map_err(|e| anyhow::anyhow!("cannot create {name}'s log {}: {e}", log.display()))?;
        let err = out
            .try_clone()
            .map_err(|e| anyhow::anyhow!("cannot share {name}'s log {}: {e}", log.display()))?;
        Self::spawn(name, cmd.stdin(Stdio::null()).stdout(out).stderr(err))
    }

    /// The leader's PID (also the process group id).
    pub fn pid(&self) -> u32 {
        self.child.as_ref().map(Child::id).unwrap_or(0)
    }

    /// The exit status if the leader has exited.
    pub fn try_exit(&mut self) -> Option<std::process::ExitStatus> {
        self.child
            .as_mut()
            .and_then(|c| c.try_wait().ok().flatten())
    }

    /// Sends a signal to the whole group.
    pub fn signal(&self, sig: Signal) -> anyhow::Result<()> {
        killpg(Pid::from_raw(self.pid() as i32), sig)
            .map_err(|e| anyhow::anyhow!("cannot signal {}: {e}", self.name))
    }

    /// Kills the group and reaps the leader.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = killpg(Pid::from_raw(child.id() as i32), Signal::SIGKILL);
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for ChildGroup {
    fn drop(&mut self) {
        self.kill();
    }
}

/// True while a process with this PID exists (and is not a zombie).
pub fn process_alive(pid: u32) -> bool {
    if kill(Pid::from_raw(pid as i32), None).is_err() {
        return false;
    }
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => !stat
            .rsplit(')')
            .next()
            .unwrap_or("")
            .trim_start()
            .starts_with('Z'),
        Err(_) => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spawn_logged_writes_both_streams_to_the_log() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("sh.log");
        let mut child = ChildGroup::spawn_logged(
            "sh",
            Command::new("sh").args(["-c", "echo to-stdout; echo to-stderr >&2"]),
            &log,
        )
        .unwrap();
        // Poll for the exit (a state reached), bounded.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        let status = loop {
            if let Some(s) = child.try_exit() {
                break s;
            }
            assert!(std::time::Instant::now() < deadline, "sh did not exit");
            std::thread::sleep(std::time::Duration::from_millis(5));
        };
        assert!(status.success());
        let text = std::fs::read_to_string(&log).unwrap();
        assert!(
            text.contains("to-stdout") && text.contains("to-stderr"),
            "{text}"
        );
    }
}
