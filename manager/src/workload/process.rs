//! The `process` executor: workloads as child processes on the manager's
//! host (a single-host appliance, the demo, the tests).
//!
//! Each workload has a state directory `<store>/.workloads/<ns>/<name>/`:
//! `out` (the program's stdout, the JSON-lines protocol), `err` (its
//! stderr), `pid` and, once the child has been reaped, `exit` (its exit
//! code). The state survives a manager restart: a finished job's result is
//! read back from `out`, a job still running is adopted by PID (checked
//! against the `ANNEAL_WORKLOAD` variable in its environment, so a reused PID
//! is never mistaken for it), and a job whose process vanished without a
//! result is reported failed rather than started twice. Scratch volumes are
//! `<store>/.scratch/<ns>/<name>/` (the store's file system, so a rename
//! into the store is atomic), removed with the workload.

use std::collections::BTreeMap;
use std::fs;
use std::io::{Read, Seek, SeekFrom};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use tracing::{info, warn};

use super::{
    Kind, Observation, Phase, VolumeSource, WorkloadError, WorkloadSpec, finished_phase,
    scan_output,
};

/// The environment variable that names a workload in its own process.
pub const WORKLOAD_ENV: &str = "ANNEAL_WORKLOAD";
/// How much of a program's stdout is read back (its tail).
const OUT_TAIL: u64 = 256 * 1024;

/// Runs workloads as supervised child processes.
#[derive(Clone, Debug)]
pub struct ProcessExecutor {
    bin_dir: PathBuf,
    store: PathBuf,
    /// PIDs this process started, by workload key (for `remove`).
    started: Arc<Mutex<BTreeMap<String, u32>>>,
}

fn io_err(spec: &WorkloadSpec, what: &str, e: impl std::fmt::Display) -> WorkloadError {
    WorkloadError::Process {
        name: format!("{}/{}", spec.namespace, spec.name),
        message: format!("{what}: {e}"),
    }
}

impl ProcessExecutor {
    /// Programs are found in `bin_dir`; the content store is `store`.
    pub fn new(bin_dir: impl Into<PathBuf>, store: impl Into<PathBuf>) -> Self {
        Self {
            bin_dir: bin_dir.into(),
            store: store.into(),
            started: Arc::default(),
        }
    }

    /// The content store directory.
    pub fn store_dir(&self) -> &Path {
        &self.store
    }

    fn state_dir(&self, spec: &WorkloadSpec) -> PathBuf {
        self.store
            .join(".workloads")
            .join(&spec.namespace)
            .join(&spec.name)
    }

    fn scratch_dir(&self, spec: &WorkloadSpec) -> PathBuf {
        self.store
            .join(".scratch")
            .join(&spec.namespace)
            .join(&spec.name)
    }

    fn tag(spec: &WorkloadSpec) -> String {
        format!("{}/{}", spec.namespace, spec.name)
    }

    /// The PID in the state directory, if that process is alive and is this
    /// workload.
    fn live_pid(&self, spec: &WorkloadSpec) -> Option<u32> {
        let pid: u32 = fs::read_to_string(self.state_dir(spec).join("pid"))
            .ok()?
            .trim()
            .parse()
            .ok()?;
        let want = format!("{WORKLOAD_ENV}={}", Self::tag(spec));
        // A process in the middle of an exec (or a zombie) shows an empty
        // environment for a moment: look again unless it is a zombie.
        for _ in 0..100 {
            let environ = fs::read(format!("/proc/{pid}/environ")).ok()?;
            if !environ.is_empty() {
                return environ
                    .split(|b| *b == 0)
                    .any(|kv| kv == want.as_bytes())
                    .then_some(pid);
            }
            let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
            if stat
                .rsplit_once(')')
                .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z'))
            {
                return None;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        None
    }

    /// Whether this process started the workload and has not reaped it yet.
    fn reaping(&self, spec: &WorkloadSpec) -> bool {
        self.started
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains_key(&Self::tag(spec))
    }

    /// Starts the workload unless it runs or has run.
    pub fn ensure(&self, spec: &WorkloadSpec) -> Result<(), WorkloadError> {
        let dir = self.state_dir(spec);
        if dir.join("pid").exists() {
            // Running, finished, or vanished: never start a second copy;
            // `observe` tells which, `remove` clears it.
            return Ok(());
        }
        fs::create_dir_all(&dir).map_err(|e| io_err(spec, "creating the state directory", e))?;
        let bin = self.bin_dir.join(spec.program.binary());
        let scratch = self.scratch_dir(spec);
        let store = self.store.clone();
        let args = spec.resolved_args(|v| match v.source {
            VolumeSource::ContentStore => store.display().to_string(),
            VolumeSource::Scratch => scratch.display().to_string(),
            VolumeSource::Files(_) => dir.join(&v.name).display().to_string(),
        });
        for v in &spec.volumes {
            if let VolumeSource::Files(files) = &v.source {
                write_files(&dir.join(&v.name), files)
                    .map_err(|e| io_err(spec, &format!("writing volume {}", v.name), e))?;
            }
        }
        if spec
            .volumes
            .iter()
            .any(|v| v.source == VolumeSource::Scratch)
        {
            fs::create_dir_all(&scratch).map_err(|e| io_err(spec, "creating scratch", e))?;
        }
        let out = fs::File::create(dir.join("out")).map_err(|e| io_err(spec, "stdout file", e))?;
        let err = fs::File::create(dir.join("err")).map_err(|e| io_err(spec, "stderr file", e))?;
        let mut cmd = Command::new(&bin);
        cmd.args(&args)
            .envs(&spec.env)
            .env(WORKLOAD_ENV, Self::tag(spec))
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .process_group(0);
        let mut child = cmd
            .spawn()
            .map_err(|e| io_err(spec, &format!("starting {}", bin.display()), e))?;
        let pid = child.id();
        fs::write(dir.join("pid"), format!("{pid}\n")).map_err(|e| io_err(spec, "pid file", e))?;
        self.started
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(Self::tag(spec), pid);
        info!(workload = %Self::tag(spec), pid, program = spec.program.binary(), ?args, "workload started");
        let exit_file = dir.join("exit");
        let tag = Self::tag(spec);
        let started = self.started.clone();
        std::thread::Builder::new()
            .name(format!("reap-{pid}"))
            .spawn(move || {
                let code = match child.wait() {
                    Ok(s) => s.code().unwrap_or(128 + 9),
                    Err(_) => 255,
                };
                // Written after the child is gone: `exit` present means
                // `out` is complete.
                if let Err(e) = fs::write(&exit_file, format!("{code}\n")) {
                    warn!(workload = %tag, error = %e, "cannot record the exit code");
                }
                started
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .remove(&tag);
                info!(workload = %tag, pid, code, "workload exited");
            })
            .map_err(|e| io_err(spec, "reaper thread", e))?;
        Ok(())
    }

    /// What the workload is doing, from its state directory.
    pub fn observe(&self, spec: &WorkloadSpec) -> Result<Observation, WorkloadError> {
        let dir = self.state_dir(spec);
        if !dir.join("pid").exists() {
            return Ok(Observation::absent());
        }
        let text = read_tail(&dir.join("out"), OUT_TAIL).unwrap_or_default();
        let (progress, outcome) = scan_output(&text);
        let exit: Option<i32> = fs::read_to_string(dir.join("exit"))
            .ok()
            .and_then(|s| s.trim().parse().ok());
        let stderr_tail = || {
            let t = read_tail(&dir.join("err"), 2048).unwrap_or_default();
            t.lines().last().unwrap_or_default().to_string()
        };
        let (phase, detail) = match exit {
            Some(code) => {
                let phase = finished_phase(outcome.as_ref(), code == 0);
                let detail = if phase == Phase::Failed && outcome.is_none() {
                    format!(
                        "{} exited with code {code} without a result; last stderr line: {}",
                        spec.program.binary(),
                        stderr_tail()
                    )
                } else {
                    String::new()
                };
                (phase, detail)
            }
            // Our own child that just ended: the reaper writes `exit` next.
            None if self.reaping(spec) || self.live_pid(spec).is_some() => {
                (Phase::Running, String::new())
            }
            None => match &outcome {
                // The manager restarted after the program finished.
                Some(o) => (finished_phase(Some(o), true), String::new()),
                None if spec.kind == Kind::Server => {
                    (Phase::Failed, "the server process is gone".to_string())
                }
                None => (
                    Phase::Failed,
                    format!(
                        "{} ended while the manager was not watching, without a result; last stderr line: {}",
                        spec.program.binary(),
                        stderr_tail()
                    ),
                ),
            },
        };
        Ok(Observation {
            phase,
            progress,
            outcome,
            detail,
        })
    }

    /// Stops the process group (SIGTERM, then SIGKILL after 5 s) and removes
    /// the state and scratch directories.
    pub fn remove(&self, spec: &WorkloadSpec) -> Result<(), WorkloadError> {
        if let Some(pid) = self.live_pid(spec) {
            let pgid = Pid::from_raw(pid as i32);
            let _ = killpg(pgid, Signal::SIGTERM);
            let deadline = Instant::now() + Duration::from_secs(5);
            while self.live_pid(spec).is_some() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            if self.live_pid(spec).is_some() {
                let _ = killpg(pgid, Signal::SIGKILL);
            }
        }
        // Our own child: its reaper writes `exit` into the state directory
        // once the child is gone. Removing the directory before that raced
        // with the write ("Directory not empty"), and a start right after
        // could get the old run's exit code in its new directory.
        let deadline = Instant::now() + Duration::from_secs(5);
        while self.reaping(spec) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        for dir in [self.state_dir(spec), self.scratch_dir(spec)] {
            match fs::remove_dir_all(&dir) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(io_err(spec, &format!("removing {}", dir.display()), e)),
            }
        }
        Ok(())
    }
}

/// Writes `files` into a new directory `dir` (mode 0700), each file with
/// mode 0600 (created so, never readable by others even for a moment).
fn write_files(dir: &Path, files: &BTreeMap<String, Vec<u8>>) -> std::io::Result<()> {
    use std::io::Write as _;
    use std::os::unix::fs::{DirBuilderExt as _, OpenOptionsExt as _};
    // left over from a start that failed half-way (no process has it)
    match fs::remove_dir_all(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    fs::DirBuilder::new().mode(0o700).create(dir)?;
    for (name, data) in files {
        if name.is_empty() || name.contains('/') || name == "." || name == ".." {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("file name {name:?} is not a plain file name"),
            ));
        }
        let mut f = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(dir.join(name))?;
        f.write_all(data)?;
    }
    Ok(())
}

/// The last `max` bytes of a file, from a line start.
fn read_tail(path: &Path, max: u64) -> std::io::Result<String> {
    let mut f = fs::File::open(path)?;
    let len = f.metadata()?.len();
    let start = len.saturating_sub(max);
    f.seek(SeekFrom::Start(start))?;
    let mut buf = Vec::with_capacity((len - start) as usize);
    f.take(max).read_to_end(&mut buf)?;
    let text = String::from_utf8_lossy(&buf).into_owned();
    Ok(if start > 0 {
        text.split_once('\n')
            .map(|(_, r)| r.to_string())
            .unwrap_or_default()
    } else {
        text
    })
}

#[cfg(test)]
mod tests {
    use super::super::{Program, Volume};
    use super::*;

    fn spec(name: &str, args: &[&str]) -> WorkloadSpec {
        WorkloadSpec {
            namespace: "ns".into(),
            name: name.into(),
            kind: Kind::Job,
            program: Program::Agent,
            args: args.iter().map(|s| s.to_string()).collect(),
            volumes: vec![Volume {
                name: "scratch".into(),
                mount_path: "/scratch".into(),
                source: VolumeSource::Scratch,
            }],
            env: BTreeMap::new(),
            labels: BTreeMap::new(),
            owner: None,
            deadline_secs: None,
            access: Default::default(),
        }
    }

    /// A fake `anneal-agent`: a shell script that prints protocol lines.
    fn executor(script: &str) -> (tempfile::TempDir, ProcessExecutor) {
        let dir = tempfile::tempdir().expect("tempdir");
        let bin = dir.path().join("bin");
        fs::create_dir_all(&bin).expect("bin dir");
        let path = bin.join("anneal-agent");
        fs::write(&path, format!("#!/bin/sh\n{script}\n")).expect("script");
        use std::os::unix::fs::PermissionsExt;
        fs::set_permissions(&path, fs::Permissions::from_mode(0o755)).expect("chmod");
        let store = dir.path().join("store");
        fs::create_dir_all(&store).expect("store");
        (dir, ProcessExecutor::new(bin, store))
    }

    fn wait_done(ex: &ProcessExecutor, s: &WorkloadSpec) -> Observation {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let o = ex.observe(s).expect("observe");
            if matches!(o.phase, Phase::Succeeded | Phase::Failed) {
                return o;
            }
            assert!(Instant::now() < deadline, "workload did not finish: {o:?}");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    #[test]
    fn runs_once_reads_the_result_and_substitutes_volumes() {
        let (_d, ex) = executor(
            r#"echo '{"event":"progress","bytesFetched":5}'; echo "{\"event\":\"result\",\"arg\":\"$1\",\"who\":\"$ANNEAL_WORKLOAD\"}""#,
        );
        let s = spec("ok", &["${volume:scratch}"]);
        assert_eq!(ex.observe(&s).expect("observe").phase, Phase::Absent);
        ex.ensure(&s).expect("ensure");
        let o = wait_done(&ex, &s);
        assert_eq!(o.phase, Phase::Succeeded, "{o:?}");
        let out = o.outcome.expect("outcome");
        assert_eq!(out["who"], "ns/ok");
        let scratch = ex.store_dir().join(".scratch/ns/ok");
        assert_eq!(out["arg"], scratch.display().to_string());
        assert!(scratch.is_dir());
        assert_eq!(o.progress.expect("progress")["bytesFetched"], 5);
        // ensure again: not started a second time (the out file keeps one result).
        ex.ensure(&s).expect("ensure again");
        let text = fs::read_to_string(ex.store_dir().join(".workloads/ns/ok/out")).expect("out");
        assert_eq!(text.matches("result").count(), 1);
        ex.remove(&s).expect("remove");
        assert!(!scratch.exists());
        assert_eq!(ex.observe(&s).expect("observe").phase, Phase::Absent);
    }

    /// A files volume: written 0600 in a 0700 directory of the state
    /// directory before the program starts, its path substituted, removed
    /// with the workload.
    #[test]
    fn files_volumes_are_private_files_removed_with_the_workload() {
        use std::os::unix::fs::PermissionsExt as _;
        let (_d, ex) = executor(
            r#"echo "{\"event\":\"result\",\"ca\":\"$(cat "$1")\",\"mode\":\"$(stat -c %a "$1")\"}""#,
        );
        let mut s = spec("files", &["${volume:ca}/ca.crt"]);
        s.volumes.push(Volume {
            name: "ca".into(),
            mount_path: "/ca".into(),
            source: VolumeSource::Files(BTreeMap::from([("ca.crt".to_string(), b"PEM".to_vec())])),
        });
        ex.ensure(&s).expect("ensure");
        let o = wait_done(&ex, &s);
        assert_eq!(o.phase, Phase::Succeeded, "{o:?}");
        let out = o.outcome.expect("outcome");
        assert_eq!(
            (out["ca"].as_str(), out["mode"].as_str()),
            (Some("PEM"), Some("600"))
        );
        let dir = ex.store_dir().join(".workloads/ns/files/ca");
        let mode = fs::metadata(&dir).expect("ca dir").permissions().mode() & 0o777;
        assert_eq!(mode, 0o700);
        ex.remove(&s).expect("remove");
        assert!(!dir.exists());
        // a file name that is not plain is refused before anything starts
        let mut bad = spec("bad-files", &[]);
        bad.volumes.push(Volume {
            name: "ca".into(),
            mount_path: "/ca".into(),
            source: VolumeSource::Files(BTreeMap::from([("../x".to_string(), Vec::new())])),
        });
        let e = ex.ensure(&bad).expect_err("a path as a file name");
        assert!(e.to_string().contains("../x"), "{e}");
    }

    #[test]
    fn error_lines_and_silent_exits_are_failures() {
        let (_d, ex) = executor(
            r#"if [ "$1" = err ]; then echo '{"event":"error","reason":"ChecksumMismatch","message":"expected a, got b"}'; exit 1; fi; echo boom >&2; exit 3"#,
        );
        let e = spec("err", &["err"]);
        ex.ensure(&e).expect("ensure");
        let o = wait_done(&ex, &e);
        assert_eq!(o.phase, Phase::Failed);
        assert_eq!(
            o.failure(),
            ("ChecksumMismatch".into(), "expected a, got b".into())
        );
        let s = spec("silent", &["x"]);
        ex.ensure(&s).expect("ensure");
        let o = wait_done(&ex, &s);
        assert_eq!(o.phase, Phase::Failed);
        assert!(
            o.detail.contains("code 3") && o.detail.contains("boom"),
            "{}",
            o.detail
        );
    }

    /// Remove then ensure at once (what a controller does to restart a
    /// workload): the new run never carries the old one's exit code, and
    /// removing never trips over the old run's reaper.
    #[test]
    fn a_workload_removed_and_started_again_runs_clean() {
        let (_d, ex) = executor("echo '{\"event\":\"progress\"}'; exec sleep 600");
        let s = spec("again", &[]);
        for round in 0..50 {
            ex.ensure(&s).expect("ensure");
            let deadline = Instant::now() + Duration::from_secs(30);
            loop {
                let o = ex.observe(&s).expect("observe");
                assert_eq!(o.phase, Phase::Running, "round {round}: {o:?}");
                if o.progress.is_some() {
                    break;
                }
                assert!(Instant::now() < deadline, "round {round}: no progress");
                std::thread::sleep(Duration::from_millis(5));
            }
            ex.remove(&s).expect("remove");
            // no reaper of the old run is left to write into a new run's
            // directory
            assert!(!ex.reaping(&s), "round {round}: removed while reaping");
            assert_eq!(ex.observe(&s).expect("observe").phase, Phase::Absent);
        }
    }

    #[test]
    fn a_restarted_manager_adopts_and_stops_a_running_job() {
        let (_d, ex) = executor("echo '{\"event\":\"progress\"}'; exec sleep 600");
        let s = spec("long", &[]);
        ex.ensure(&s).expect("ensure");
        // Wait for the first protocol line: the process is up.
        let deadline = Instant::now() + Duration::from_secs(30);
        while ex.observe(&s).expect("observe").progress.is_none() {
            assert!(Instant::now() < deadline, "no progress line");
            std::thread::sleep(Duration::from_millis(10));
        }
        // A second executor over the same store (the manager restarted).
        let again = ProcessExecutor::new(ex.bin_dir.clone(), ex.store.clone());
        let o = again.observe(&s).expect("observe");
        assert_eq!(
            o.phase,
            Phase::Running,
            "{o:?} {:?}",
            fs::read_dir(again.state_dir(&s))
                .map(|d| d.flatten().map(|e| e.file_name()).collect::<Vec<_>>())
        );
        let pid = again.live_pid(&s).expect("adopted pid");
        again
            .ensure(&s)
            .expect("ensure does not start a second copy");
        assert_eq!(again.live_pid(&s), Some(pid));
        again.remove(&s).expect("remove");
        let deadline = Instant::now() + Duration::from_secs(10);
        while Path::new(&format!("/proc/{pid}")).exists()
            && fs::read_to_string(format!("/proc/{pid}/stat"))
                .map(|s| !s.contains(") Z "))
                .unwrap_or(false)
        {
            assert!(Instant::now() < deadline, "process {pid} still alive");
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}
