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

/// Sends SIGKILL to process group `pgid` (a process started as the leader
/// of its own group, by PID); a group that is gone is no error.
pub fn kill_process_group(pgid: u32) {
    if pgid > 1 {
        let _ = killpg(Pid::from_raw(pgid as i32), Signal::SIGKILL);
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

/// How long a server took over its first ten retries of a failed accept:
/// the span between the first and the eleventh log line containing
/// `marker` (each must name EMFILE; the timestamp the process logged comes
/// first on the line, as the pipe may deliver lines in bursts). `next`
/// yields the next log line, `None` when there is none in time. With a
/// back-off after each failure ten retries take at least nine pauses; a
/// spinning loop takes microseconds.
pub fn accept_failure_span(
    mut next: impl FnMut() -> Option<String>,
    marker: &str,
) -> Result<std::time::Duration, String> {
    let mut seen: Vec<k8s_openapi::jiff::Timestamp> = Vec::new();
    while seen.len() < 11 {
        let line = next().ok_or_else(|| {
            format!(
                "the server logged {} lines with {marker:?}, not 11",
                seen.len()
            )
        })?;
        if !line.contains(marker) {
            continue;
        }
        if !(line.contains("Too many open files") || line.contains("os error 24")) {
            return Err(format!("an accept failure other than EMFILE: {line}"));
        }
        let at = line
            .split_whitespace()
            .next()
            .and_then(|t| t.parse().ok())
            .ok_or_else(|| format!("no timestamp first in {line:?}"))?;
        seen.push(at);
    }
    let micros = seen[10].as_microsecond() - seen[0].as_microsecond();
    Ok(std::time::Duration::from_micros(
        u64::try_from(micros).unwrap_or(0),
    ))
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
