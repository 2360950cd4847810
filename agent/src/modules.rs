//! Kernel modules the way udev and modprobe would load them: every
//! `/sys/**/modalias` matched against `modules.alias`, dependencies from
//! `modules.dep` (and `pre:` soft dependencies from `modules.softdep`) loaded
//! first, built-in modules skipped.
//!
//! The index ([`ModuleIndex`]) and the load order are pure; [`load_file`] and
//! [`coldplug`] are the thin shell that calls `finit_module(2)`.

use std::collections::BTreeSet;
use std::fs;
use std::io;
use std::path::Path;

use anneal_api::error_chain;

pub use anneal_kmod::{ModuleIndex, glob_match, module_name};

/// An error reading the module index or loading a module.
#[derive(Debug, thiserror::Error)]
pub enum ModuleError {
    /// The index could not be read.
    #[error("module index")]
    Index(#[from] anneal_kmod::Error),
    /// A module name that is neither in modules.dep nor built in.
    #[error("module {0} is not in this initramfs")]
    Unknown(String),
    /// `finit_module` failed.
    #[error("loading {name} failed")]
    Load {
        /// The module.
        name: String,
        /// The cause.
        #[source]
        source: io::Error,
    },
}

/// Every `modalias` under `sys_devices` (symlinks not followed), sorted.
pub fn scan_modaliases(sys_devices: &Path) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut stack = vec![sys_devices.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let Ok(entries) = fs::read_dir(&dir) else {
            continue;
        };
        for e in entries.flatten() {
            let Ok(ft) = e.file_type() else { continue };
            if ft.is_dir() {
                stack.push(e.path());
            } else if ft.is_file()
                && e.file_name() == "modalias"
                && let Ok(s) = fs::read_to_string(e.path())
                && !s.trim().is_empty()
            {
                out.insert(s.trim().to_string());
            }
        }
    }
    out
}

/// Loads one module file with `finit_module(2)`; "already loaded" is success.
pub fn load_file(name: &str, path: &Path) -> Result<bool, ModuleError> {
    use nix::errno::Errno;
    use nix::kmod::{ModuleInitFlags, finit_module};
    let err = |source: io::Error| ModuleError::Load {
        name: name.to_string(),
        source,
    };
    let file = fs::File::open(path).map_err(err)?;
    match finit_module(&file, c"", ModuleInitFlags::empty()) {
        Ok(()) => Ok(true),
        Err(Errno::EEXIST) => Ok(false),
        Err(e) => Err(err(io::Error::from(e))),
    }
}

/// The outcome of a coldplug run.
#[derive(Debug, Default, Clone)]
pub struct Coldplug {
    /// Modules loaded, in order.
    pub loaded: Vec<String>,
    /// Modules that failed, with the reason.
    pub failed: Vec<(String, String)>,
}

/// Loads drivers for every device present, repeating while loading drivers
/// makes new devices appear (a PCI transport exposes virtio devices, a HBA
/// its disks). `on_loaded` is called for each module as it loads.
pub fn coldplug(
    index: &ModuleIndex,
    modules_dir: &Path,
    sys_devices: &Path,
    extra: &[String],
    mut on_event: impl FnMut(&str, Option<&ModuleError>),
) -> Coldplug {
    let mut result = Coldplug::default();
    let mut tried: BTreeSet<String> = BTreeSet::new();
    let mut seen_aliases: BTreeSet<String> = BTreeSet::new();
    for pass in 0..8 {
        let aliases = scan_modaliases(sys_devices);
        let new: Vec<&String> = aliases.difference(&seen_aliases).collect();
        let mut wanted: Vec<String> = Vec::new();
        for a in &new {
            for m in index.resolve(a) {
                if !tried.contains(&m) && !wanted.contains(&m) {
                    wanted.push(m);
                }
            }
        }
        if pass == 0 {
            for m in extra {
                let m = module_name(m);
                if !wanted.contains(&m) {
                    wanted.push(m);
                }
            }
        }
        seen_aliases.extend(aliases);
        let (order, _unknown) = index.load_order(&wanted);
        let order: Vec<String> = order.into_iter().filter(|m| !tried.contains(m)).collect();
        if order.is_empty() && pass > 0 {
            break;
        }
        for m in order {
            tried.insert(m.clone());
            let Some(rel) = index.path_of(&m) else {
                continue;
            };
            match load_file(&m, &modules_dir.join(rel)) {
                Ok(true) => {
                    on_event(&m, None);
                    result.loaded.push(m);
                }
                Ok(false) => {}
                Err(e) => {
                    on_event(&m, Some(&e));
                    result.failed.push((m, error_chain(&e)));
                }
            }
        }
        // Give the drivers' asynchronous probes a moment to add devices.
        std::thread::sleep(std::time::Duration::from_millis(150));
    }
    result
}
