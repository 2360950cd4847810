//! An IPMI BMC for tests (qemu/README.md, "BMCs"): Debian's `ipmi_sim`
//! (openipmi) with a LAN channel on one UDP address, one administrator, and
//! its chassis power and boot device handled by
//! `qemu/ipmi-sim/chassis-control.sh`, which keeps them in a state directory
//! and, given a VM's QMP socket, drives that VM through
//! `qemu/ipmi-sim/qmp-hook.py`.
//!
//! The process is killed by its PID when the handle drops.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

/// Errors starting the simulator.
#[derive(Debug, thiserror::Error)]
pub enum IpmiSimError {
    /// A file of its configuration cannot be written.
    #[error("cannot write {path}")]
    Write {
        /// the file
        path: PathBuf,
        /// cause
        #[source]
        source: std::io::Error,
    },
    /// `ipmi_sim` cannot be started (is openipmi installed? tests/setup.sh
    /// installs it).
    #[error("cannot start ipmi_sim (apt-get install openipmi)")]
    Spawn(#[source] std::io::Error),
}

/// What to simulate.
#[derive(Debug, Clone)]
pub struct IpmiSimConfig {
    /// The UDP address of the LAN channel.
    pub listen: SocketAddr,
    /// The administrator's user name.
    pub username: String,
    /// Their password.
    pub password: String,
    /// Where the configuration, the persisted state and the chassis state
    /// (`state/power`, `state/boot`, `state/calls`) go.
    pub dir: PathBuf,
    /// The QMP socket of a VM (started with `-S -no-shutdown`) that the
    /// chassis powers, resets and stops.
    pub qmp: Option<PathBuf>,
}

/// A running `ipmi_sim`.
#[derive(Debug)]
pub struct RunningIpmiSim {
    child: Child,
    state: PathBuf,
    log: PathBuf,
}

/// The chassis-control script of the repository.
pub fn chassis_control_script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../ipmi-sim/chassis-control.sh")
}

/// The hook driving a VM over QMP.
pub fn qmp_hook() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../ipmi-sim/qmp-hook.py")
}

/// The emulator command file of the repository (one BMC at 0x20).
pub fn emu_file() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../ipmi-sim/sim.emu")
}

fn write(path: &Path, text: &str) -> Result<(), IpmiSimError> {
    std::fs::write(path, text).map_err(|source| IpmiSimError::Write {
        path: path.to_path_buf(),
        source,
    })
}

fn mkdir(path: &Path) -> Result<(), IpmiSimError> {
    std::fs::create_dir_all(path).map_err(|source| IpmiSimError::Write {
        path: path.to_path_buf(),
        source,
    })
}

/// Writes the configuration and starts `ipmi_sim` (powered off, boot
/// device "default"). It answers once its socket is bound: callers wait
/// for a first answer.
pub fn start(cfg: &IpmiSimConfig) -> Result<RunningIpmiSim, IpmiSimError> {
    let state = cfg.dir.join("state");
    let persist = cfg.dir.join("persist");
    mkdir(&state)?;
    mkdir(&persist)?;
    write(&state.join("power"), "0\n")?;
    write(&state.join("boot"), "default\n")?;
    if let Some(qmp) = &cfg.qmp {
        for (target, link) in [(qmp.clone(), "qmp"), (qmp_hook(), "hook")] {
            std::os::unix::fs::symlink(&target, state.join(link)).map_err(|source| {
                IpmiSimError::Write {
                    path: state.join(link),
                    source,
                }
            })?;
        }
    }
    let conf = cfg.dir.join("lan.conf");
    write(
        &conf,
        &format!(
            r#"name "anneal"
set_working_mc 0x20
  startlan 1
    addr {ip} {port}
    priv_limit admin
    allowed_auths_callback md5
    allowed_auths_user md5
    allowed_auths_operator md5
    allowed_auths_admin md5
    guid a123456789abcdefa123456789abcdef
  endlan
  chassis_control "{script} {state}"
  user 2 true "{user}" "{password}" admin 10 md5
"#,
            ip = cfg.listen.ip(),
            port = cfg.listen.port(),
            script = chassis_control_script().display(),
            state = state.display(),
            user = cfg.username,
            password = cfg.password,
        ),
    )?;
    let log = cfg.dir.join("ipmi_sim.log");
    let out = std::fs::File::create(&log).map_err(|source| IpmiSimError::Write {
        path: log.clone(),
        source,
    })?;
    let err = out.try_clone().map_err(|source| IpmiSimError::Write {
        path: log.clone(),
        source,
    })?;
    let child = Command::new("ipmi_sim")
        .arg("-c")
        .arg(&conf)
        .arg("-f")
        .arg(emu_file())
        .arg("-s")
        .arg(&persist)
        .arg("-n")
        .current_dir(&cfg.dir)
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .spawn()
        .map_err(IpmiSimError::Spawn)?;
    Ok(RunningIpmiSim { child, state, log })
}

impl RunningIpmiSim {
    /// Its PID.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The chassis sets so far, one per line ("set power 1").
    pub fn calls(&self) -> Vec<String> {
        std::fs::read_to_string(self.state.join("calls"))
            .unwrap_or_default()
            .lines()
            .map(str::to_string)
            .collect()
    }

    /// The boot device ipmi_sim last passed ("pxe", "default", "none").
    pub fn boot_device(&self) -> String {
        std::fs::read_to_string(self.state.join("boot"))
            .unwrap_or_default()
            .trim()
            .to_string()
    }

    /// Whether the chassis is powered on.
    pub fn powered_on(&self) -> bool {
        std::fs::read_to_string(self.state.join("power")).is_ok_and(|s| s.trim() == "1")
    }

    /// What it printed.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Kills it (by PID) and reaps it.
    pub fn stop(mut self) {
        self.kill();
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for RunningIpmiSim {
    fn drop(&mut self) {
        self.kill();
    }
}
