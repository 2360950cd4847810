//! Post-install steps of a deploy: the builtins (`mkswap`,
//! `install-removable-fallback`, `efibootmgr`, `growLastPartition`) and script
//! steps, run in the live environment after the contents are written.
//!
//! The builtins work at byte offsets of the target (a block device or, in
//! tests, a regular file), so they need no partition device nodes. See
//! docs/posthooks.md for what each step does and what scripts see.

pub mod efi;
pub mod fat;
pub mod grow;
pub mod script;
pub mod swap;

use anneal_api::agent::PlannedStep;
use anneal_image::layout::{Layout, Slot};
use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};

/// Where efivarfs is mounted in the live environment.
pub const DEFAULT_EFIVARS: &str = "/sys/firmware/efi/efivars";

/// What the post-install steps act on.
#[derive(Debug, Clone)]
pub struct Context {
    /// The OS disk (`/dev/sda`, or a regular file in tests).
    pub os_disk: PathBuf,
    /// The OS disk's layout as written (final sizes, saved UUIDs).
    pub layout: Layout,
    /// Data disks, in the order of the claim's `dataImages`.
    pub data_disks: Vec<PathBuf>,
    /// `x86_64` or `aarch64`.
    pub architecture: String,
    /// The Machine, `namespace/name`.
    pub machine: String,
    /// The OS Image's name.
    pub image: String,
    /// The efivarfs directory (`/sys/firmware/efi/efivars`).
    pub efivars: PathBuf,
    /// Directories searched for the external tools of `growLastPartition`
    /// (`e2fsck`, `resize2fs`) and the script shell's `PATH`; empty means the
    /// agent's own `PATH`.
    pub tool_path: Option<String>,
    /// The partition number of the cloud-init config drive the plan put at
    /// the end of the OS disk (`growLastPartition` stops before it).
    pub config_drive: Option<u32>,
}

impl Context {
    /// A context with the default efivarfs directory and the agent's `PATH`.
    pub fn new(os_disk: PathBuf, layout: Layout, architecture: &str, machine: &str) -> Self {
        Context {
            os_disk,
            layout,
            data_disks: Vec::new(),
            architecture: architecture.to_string(),
            machine: machine.to_string(),
            image: String::new(),
            efivars: PathBuf::from(DEFAULT_EFIVARS),
            tool_path: None,
            config_drive: None,
        }
    }

    /// Device path of partition `number` of the OS disk.
    pub fn partition_path(&self, number: u32) -> PathBuf {
        partition_path(&self.os_disk, number)
    }

    /// The layout slot with partition number `number`.
    pub fn slot(&self, number: u32) -> Option<&Slot> {
        self.layout.slots.iter().find(|s| s.number == number)
    }
}

/// Device path of partition `number` of `disk`: `/dev/sda` → `/dev/sda1`,
/// `/dev/nvme0n1` → `/dev/nvme0n1p1` (a `p` when the disk name ends in a digit,
/// as the kernel names them).
pub fn partition_path(disk: &Path, number: u32) -> PathBuf {
    let mut s = disk.as_os_str().to_os_string();
    if disk
        .to_string_lossy()
        .chars()
        .last()
        .is_some_and(|c| c.is_ascii_digit())
    {
        s.push("p");
    }
    s.push(number.to_string());
    PathBuf::from(s)
}

/// Why a builtin failed.
#[derive(Debug, thiserror::Error)]
pub enum BuiltinError {
    /// `mkswap`.
    #[error(transparent)]
    Swap(#[from] swap::SwapError),
    /// `install-removable-fallback`.
    #[error(transparent)]
    Fallback(#[from] fat::FallbackError),
    /// `efibootmgr`.
    #[error(transparent)]
    Efi(#[from] efi::EfiError),
    /// `growLastPartition`.
    #[error(transparent)]
    Grow(#[from] grow::GrowError),
}

/// A post-install step that failed; every variant names the hook and the
/// step. [`StepError::reason`] renders the whole chain for the run's result.
#[derive(Debug, thiserror::Error)]
pub enum StepError {
    /// The step names no known builtin.
    #[error(
        "post-install hook {hook}, step {step}: unknown builtin {builtin:?} (known: mkswap, install-removable-fallback, efibootmgr, growLastPartition)"
    )]
    UnknownBuiltin {
        /// hook
        hook: String,
        /// step
        step: String,
        /// the name given
        builtin: String,
    },
    /// The step has both or neither of `builtin` and `script`.
    #[error(
        "post-install hook {hook}, step {step}: a step needs exactly one of builtin and script"
    )]
    Malformed {
        /// hook
        hook: String,
        /// step
        step: String,
    },
    /// A builtin failed.
    #[error("post-install hook {hook}, step {step}: builtin {builtin} failed")]
    Builtin {
        /// hook
        hook: String,
        /// step
        step: String,
        /// builtin name
        builtin: String,
        /// what went wrong
        #[source]
        source: Box<BuiltinError>,
    },
    /// A script could not be started or watched.
    #[error("post-install hook {hook}, step {step}: script could not run")]
    ScriptSpawn {
        /// hook
        hook: String,
        /// step
        step: String,
        /// what went wrong
        #[source]
        source: io::Error,
    },
    /// A script exited non-zero (or was killed by a signal).
    #[error("post-install hook {hook}, step {step}: script {status}; output tail:\n{tail}")]
    ScriptFailed {
        /// hook
        hook: String,
        /// step
        step: String,
        /// `exited with code 3` or `killed by signal 9`
        status: String,
        /// exit code, when it exited
        code: Option<i32>,
        /// last lines of its output
        tail: String,
    },
    /// A script ran past its timeout; its process group was killed.
    #[error(
        "post-install hook {hook}, step {step}: script exceeded its timeout of {seconds} s and was killed (raise the step's timeoutSeconds if it needs longer); output tail:\n{tail}"
    )]
    ScriptTimeout {
        /// hook
        hook: String,
        /// step
        step: String,
        /// the timeout
        seconds: u32,
        /// last lines of its output
        tail: String,
    },
}

impl StepError {
    /// The message with its causes (`a: b: c`), for the run's failure reason.
    pub fn reason(&self) -> String {
        let mut s = self.to_string();
        let mut cur: Option<&dyn std::error::Error> = std::error::Error::source(self);
        while let Some(e) = cur {
            s.push_str(": ");
            s.push_str(&e.to_string());
            cur = e.source();
        }
        s
    }
}

/// Runs `steps` in order against `ctx`; the first failure stops the run.
/// Every line of progress and script output goes to `log`.
pub fn run_steps(
    ctx: &Context,
    steps: &[PlannedStep],
    log: &mut dyn FnMut(&str),
) -> Result<(), StepError> {
    for st in steps {
        match (&st.builtin, &st.script) {
            (Some(b), None) => {
                log(&format!("posthook {}/{}: builtin {b}", st.hook, st.step));
                let wrap = |source: BuiltinError| StepError::Builtin {
                    hook: st.hook.clone(),
                    step: st.step.clone(),
                    builtin: b.clone(),
                    source: Box::new(source),
                };
                let mut slog = |l: &str| log(&format!("posthook {}/{}: {l}", st.hook, st.step));
                match b.as_str() {
                    "mkswap" => swap::run(ctx, &mut slog).map_err(|e| wrap(e.into()))?,
                    "install-removable-fallback" => {
                        fat::run(ctx, &st.params, &mut slog).map_err(|e| wrap(e.into()))?
                    }
                    "efibootmgr" => efi::run(ctx, &mut slog).map_err(|e| wrap(e.into()))?,
                    "growLastPartition" => grow::run(ctx, &mut slog).map_err(|e| wrap(e.into()))?,
                    _ => {
                        return Err(StepError::UnknownBuiltin {
                            hook: st.hook.clone(),
                            step: st.step.clone(),
                            builtin: b.clone(),
                        });
                    }
                }
            }
            (None, Some(body)) => {
                log(&format!(
                    "posthook {}/{}: script (timeout {} s)",
                    st.hook, st.step, st.timeout_seconds
                ));
                script::run(ctx, st, body, log)?;
            }
            _ => {
                return Err(StepError::Malformed {
                    hook: st.hook.clone(),
                    step: st.step.clone(),
                });
            }
        }
        log(&format!("posthook {}/{}: done", st.hook, st.step));
    }
    Ok(())
}

/// Opens the target for reading and writing.
pub(crate) fn open_rw(p: &Path) -> io::Result<File> {
    std::fs::OpenOptions::new().read(true).write(true).open(p)
}

/// The deploy path's hook runner ([`crate::deploy::HookRunner`]) over
/// [`run_steps`]: the context from the written disks, every step's output
/// on the console, a failure as the step error's whole message.
pub fn runner<'p>(
    architecture: &'p str,
    machine: &'p str,
    plan: &'p anneal_api::agent::DeployPlan,
) -> impl FnMut(&crate::deploy::HookContext, &[PlannedStep]) -> Result<(), String> + 'p {
    move |hc, steps| {
        if steps.is_empty() {
            return Ok(());
        }
        let (Some(disk), Some(layout)) = (hc.os_disk.clone(), hc.os_layout.clone()) else {
            return Err(format!(
                "hook {} step {}: the plan writes no OS disk for post-install steps to act on",
                steps[0].hook, steps[0].step
            ));
        };
        let mut ctx = Context::new(disk, layout, architecture, machine);
        ctx.data_disks = hc.data_disks.clone();
        ctx.image = plan
            .disks
            .iter()
            .find(|d| d.os)
            .map(|d| d.image.clone())
            .unwrap_or_default();
        ctx.config_drive = plan.config_drive.as_ref().map(|c| c.partition);
        let mut log = |line: &str| crate::say!("{line}");
        run_steps(&ctx, steps, &mut log).map_err(|e| e.reason())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partition_paths_follow_kernel_naming() {
        assert_eq!(
            partition_path(Path::new("/dev/sda"), 1),
            PathBuf::from("/dev/sda1")
        );
        assert_eq!(
            partition_path(Path::new("/dev/nvme0n1"), 2),
            PathBuf::from("/dev/nvme0n1p2")
        );
        assert_eq!(
            partition_path(Path::new("/dev/mmcblk0"), 3),
            PathBuf::from("/dev/mmcblk0p3")
        );
        assert_eq!(
            partition_path(Path::new("/dev/vda"), 12),
            PathBuf::from("/dev/vda12")
        );
    }

    #[test]
    fn malformed_and_unknown_steps_name_hook_and_step() {
        let layout = Layout {
            partition_table: anneal_image::layout::TableKind::Gpt,
            sector_size: 512,
            disk_size: 1 << 20,
            disk_guid: None,
            disk_signature: None,
            slots: vec![],
        };
        let ctx = Context::new("/nonexistent".into(), layout, "x86_64", "ns/m1");
        let mut st = PlannedStep {
            hook: "h".into(),
            step: "s".into(),
            builtin: Some("frobnicate".into()),
            script: None,
            timeout_seconds: 5,
            params: Default::default(),
        };
        let e = run_steps(&ctx, std::slice::from_ref(&st), &mut |_| {}).unwrap_err();
        assert!(
            e.reason().contains("hook h, step s: unknown builtin"),
            "{e}"
        );
        st.script = Some("true".into());
        let e = run_steps(&ctx, &[st], &mut |_| {}).unwrap_err();
        assert!(matches!(e, StepError::Malformed { .. }), "{e}");
    }
}
