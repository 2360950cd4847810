//! Script steps: `/bin/sh -c <body>` in its own process group, with the
//! `ANNEAL_*` environment of docs/api.md (and docs/posthooks.md), stdout and
//! stderr merged, every line passed to the log, the last 64 KiB kept for the
//! failure reason, and the whole group killed at the timeout.

use super::{Context, StepError};
use anneal_api::agent::PlannedStep;
use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use std::collections::VecDeque;
use std::io::Read;
use std::os::unix::process::{CommandExt as _, ExitStatusExt as _};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// The shell scripts run with.
pub const SHELL: &str = "/bin/sh";
/// Output kept for the failure reason.
pub const TAIL_BYTES: usize = 64 * 1024;
/// Lines of output in the failure reason.
pub const TAIL_LINES: usize = 20;
/// A line longer than this is passed to the log in pieces.
const MAX_LINE: usize = 4096;
/// How long output is still read after the script exited (a descendant that
/// left the process group may hold the pipe open).
const DRAIN: Duration = Duration::from_secs(2);

pub use anneal_api::agent::param_var;

/// The environment a script of `step` sees (besides `PATH` and `HOME`).
pub fn environment(ctx: &Context, step: &PlannedStep) -> Vec<(String, String)> {
    let mut env = vec![
        (
            "ANNEAL_TARGET_DISK".to_string(),
            ctx.os_disk.display().to_string(),
        ),
        ("ANNEAL_MACHINE".into(), ctx.machine.clone()),
        ("ANNEAL_IMAGE".into(), ctx.image.clone()),
        ("ANNEAL_ARCHITECTURE".into(), ctx.architecture.clone()),
        ("ANNEAL_HOOK".into(), step.hook.clone()),
        ("ANNEAL_STEP".into(), step.step.clone()),
    ];
    let parts: Vec<String> = ctx
        .layout
        .slots
        .iter()
        .map(|s| {
            let p = ctx.partition_path(s.number).display().to_string();
            env.push((format!("ANNEAL_PART_{}", s.number), p.clone()));
            p
        })
        .collect();
    env.push(("ANNEAL_PARTITIONS".into(), parts.join(" ")));
    let data: Vec<String> = ctx
        .data_disks
        .iter()
        .enumerate()
        .map(|(i, d)| {
            let p = d.display().to_string();
            env.push((format!("ANNEAL_DATA_DISK_{i}"), p.clone()));
            p
        })
        .collect();
    env.push(("ANNEAL_DATA_DISKS".into(), data.join(" ")));
    for (k, v) in &step.params {
        env.push((param_var(k), v.clone()));
    }
    env
}

enum Msg {
    Line(String),
    Eof,
    Exit(std::io::Result<ExitStatus>),
}

/// The last lines of output, bounded in bytes.
#[derive(Debug, Default)]
struct Tail {
    lines: VecDeque<String>,
    bytes: usize,
}

impl Tail {
    fn push(&mut self, l: String) {
        self.bytes += l.len() + 1;
        self.lines.push_back(l);
        while self.bytes > TAIL_BYTES {
            match self.lines.pop_front() {
                Some(old) => self.bytes -= old.len() + 1,
                None => break,
            }
        }
    }
    fn render(&self) -> String {
        let skip = self.lines.len().saturating_sub(TAIL_LINES);
        let v: Vec<&str> = self.lines.iter().skip(skip).map(String::as_str).collect();
        if v.is_empty() {
            "(no output)".into()
        } else {
            v.join("\n")
        }
    }
}

fn reader(mut r: impl Read, tx: mpsc::Sender<Msg>) {
    let mut buf = [0u8; 8192];
    let mut line: Vec<u8> = Vec::new();
    loop {
        let n = match r.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        for &b in &buf[..n] {
            if b == b'\n' || line.len() >= MAX_LINE {
                let s = String::from_utf8_lossy(&line)
                    .trim_end_matches('\r')
                    .to_string();
                line.clear();
                if tx.send(Msg::Line(s)).is_err() {
                    return;
                }
                if b == b'\n' {
                    continue;
                }
            }
            line.push(b);
        }
    }
    if !line.is_empty() {
        let _ = tx.send(Msg::Line(String::from_utf8_lossy(&line).to_string()));
    }
    let _ = tx.send(Msg::Eof);
}

/// Runs one script step.
pub fn run(
    ctx: &Context,
    st: &PlannedStep,
    body: &str,
    log: &mut dyn FnMut(&str),
) -> Result<(), StepError> {
    let spawn_err = |source| StepError::ScriptSpawn {
        hook: st.hook.clone(),
        step: st.step.clone(),
        source,
    };
    let (r, w) = std::io::pipe().map_err(spawn_err)?;
    let path = ctx
        .tool_path
        .clone()
        .or_else(|| std::env::var("PATH").ok())
        .unwrap_or_else(|| "/usr/sbin:/usr/bin:/sbin:/bin".into());
    let mut child = {
        let mut cmd = Command::new(SHELL);
        cmd.arg("-c")
            .arg(body)
            .env_clear()
            .env("PATH", &path)
            .env("HOME", "/")
            .envs(environment(ctx, st))
            .current_dir("/")
            .stdin(Stdio::null())
            .stdout(w.try_clone().map_err(spawn_err)?)
            .stderr(w)
            .process_group(0);
        cmd.spawn().map_err(spawn_err)?
        // `cmd` (holding the pipe's write end) drops here: EOF comes when
        // the script and its descendants are gone.
    };
    let pgid = Pid::from_raw(i32::try_from(child.id()).unwrap_or(i32::MAX));
    let (tx, rx) = mpsc::channel();
    let tx2 = tx.clone();
    let rd = std::thread::Builder::new()
        .name("posthook-out".into())
        .spawn(move || reader(r, tx2));
    let wt = std::thread::Builder::new()
        .name("posthook-wait".into())
        .spawn(move || {
            let _ = tx.send(Msg::Exit(child.wait()));
        });
    if let Err(e) = rd.as_ref().and(wt.as_ref()) {
        let _ = killpg(pgid, Signal::SIGKILL);
        return Err(spawn_err(std::io::Error::new(e.kind(), e.to_string())));
    }
    let seconds = st.timeout_seconds.max(1);
    let mut deadline = Instant::now() + Duration::from_secs(u64::from(seconds));
    let mut tail = Tail::default();
    let mut exit: Option<std::io::Result<ExitStatus>> = None;
    let mut eof = false;
    let mut timed_out = false;
    while exit.is_none() || !eof {
        match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
            Ok(Msg::Line(l)) => {
                log(&format!("posthook {}/{}: {l}", st.hook, st.step));
                tail.push(l);
            }
            Ok(Msg::Eof) => eof = true,
            Ok(Msg::Exit(s)) => {
                exit = Some(s);
                // Leftover background processes of the script go with it, so
                // the pipe closes and nothing outlives the step.
                let _ = killpg(pgid, Signal::SIGKILL);
                deadline = Instant::now() + DRAIN;
            }
            Err(mpsc::RecvTimeoutError::Timeout) if exit.is_none() && !timed_out => {
                timed_out = true;
                log(&format!(
                    "posthook {}/{}: timeout of {seconds} s reached, killing the script's process group",
                    st.hook, st.step
                ));
                let _ = killpg(pgid, Signal::SIGKILL);
                deadline = Instant::now() + DRAIN + Duration::from_secs(5);
            }
            Err(_) => break,
        }
    }
    if timed_out {
        return Err(StepError::ScriptTimeout {
            hook: st.hook.clone(),
            step: st.step.clone(),
            seconds,
            tail: tail.render(),
        });
    }
    let status = match exit {
        Some(Ok(s)) => s,
        Some(Err(e)) => return Err(spawn_err(e)),
        None => {
            return Err(spawn_err(std::io::Error::other(
                "the script's exit status was not collected",
            )));
        }
    };
    if status.success() {
        return Ok(());
    }
    let (code, text) = match (status.code(), status.signal()) {
        (Some(c), _) => (Some(c), format!("exited with code {c}")),
        (None, Some(s)) => (None, format!("was killed by signal {s}")),
        (None, None) => (None, status.to_string()),
    };
    Err(StepError::ScriptFailed {
        hook: st.hook.clone(),
        step: st.step.clone(),
        status: text,
        code,
        tail: tail.render(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn param_names() {
        assert_eq!(param_var("rootSize"), "ANNEAL_PARAM_ROOTSIZE");
        assert_eq!(param_var("a-b.c"), "ANNEAL_PARAM_A_B_C");
    }

    #[test]
    fn tail_is_bounded() {
        let mut t = Tail::default();
        for i in 0..100_000 {
            t.push(format!("line {i}"));
        }
        assert!(t.bytes <= TAIL_BYTES);
        let r = t.render();
        assert_eq!(r.lines().count(), TAIL_LINES);
        assert!(r.ends_with("line 99999"));
    }
}
