//! The kernel's module index as modprobe reads it: `modules.dep` (hard
//! dependencies), `modules.alias` (modalias patterns), `modules.softdep`
//! (`pre:` soft dependencies) and `modules.builtin`. Pure: parsing, glob
//! matching and load order; no I/O beyond [`ModuleIndex::load`].
#![cfg_attr(test, allow(clippy::too_many_lines))]

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::io;
use std::path::{Path, PathBuf};

/// An error reading the index.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An index file could not be read.
    #[error("cannot read {path}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
}

/// Canonical module name: file stem without `.ko*`, `-` as `_`.
pub fn module_name(path_or_name: &str) -> String {
    let base = path_or_name.rsplit('/').next().unwrap_or(path_or_name);
    let stem = base.split(".ko").next().unwrap_or(base);
    stem.replace('-', "_")
}

/// The parsed `modules.{dep,alias,softdep,builtin}` of one kernel.
#[derive(Debug, Default, Clone)]
pub struct ModuleIndex {
    /// name → (path relative to the modules dir, direct dependencies by name).
    deps: BTreeMap<String, (String, Vec<String>)>,
    /// (pattern, module name) in file order.
    aliases: Vec<(String, String)>,
    /// name → `pre:` soft dependencies (module names or aliases).
    softdeps: BTreeMap<String, Vec<String>>,
    builtin: BTreeSet<String>,
}

impl ModuleIndex {
    /// Parses the index files' contents.
    pub fn parse(dep: &str, alias: &str, softdep: &str, builtin: &str) -> Self {
        let mut idx = ModuleIndex::default();
        for line in dep.lines() {
            let Some((path, rest)) = line.split_once(':') else {
                continue;
            };
            let deps = rest.split_whitespace().map(module_name).collect();
            idx.deps
                .insert(module_name(path), (path.trim().to_string(), deps));
        }
        for line in alias.lines() {
            let mut w = line.split_whitespace();
            if let (Some("alias"), Some(pat), Some(m)) = (w.next(), w.next(), w.next()) {
                idx.aliases.push((pat.to_string(), module_name(m)));
            }
        }
        for line in softdep.lines() {
            let mut w = line.split_whitespace();
            if w.next() != Some("softdep") {
                continue;
            }
            let Some(m) = w.next() else { continue };
            let mut pre = false;
            for word in w {
                match word {
                    "pre:" => pre = true,
                    "post:" => pre = false,
                    x if pre => idx
                        .softdeps
                        .entry(module_name(m))
                        .or_default()
                        .push(x.to_string()),
                    _ => {}
                }
            }
        }
        for line in builtin.lines() {
            let line = line.trim();
            if !line.is_empty() {
                idx.builtin.insert(module_name(line));
            }
        }
        idx
    }

    /// Reads the index files from a modules directory
    /// (`/lib/modules/<release>`); softdep and builtin may be missing.
    pub fn load(dir: &Path) -> Result<Self, Error> {
        let read = |f: &str, required: bool| -> Result<String, Error> {
            let path = dir.join(f);
            match fs::read_to_string(&path) {
                Ok(s) => Ok(s),
                Err(e) if !required && e.kind() == io::ErrorKind::NotFound => Ok(String::new()),
                Err(source) => Err(Error::Read { path, source }),
            }
        };
        Ok(Self::parse(
            &read("modules.dep", true)?,
            &read("modules.alias", false)?,
            &read("modules.softdep", false)?,
            &read("modules.builtin", false)?,
        ))
    }

    /// True when the kernel has it built in.
    pub fn is_builtin(&self, name: &str) -> bool {
        self.builtin.contains(&module_name(name))
    }

    /// True when a loadable module of that name exists.
    pub fn has(&self, name: &str) -> bool {
        self.deps.contains_key(&module_name(name))
    }

    /// Every loadable module: (name, path relative to the modules dir).
    pub fn modules(&self) -> impl Iterator<Item = (&str, &str)> {
        self.deps.iter().map(|(n, (p, _))| (n.as_str(), p.as_str()))
    }

    /// Direct dependencies of a module.
    pub fn deps_of(&self, name: &str) -> &[String] {
        self.deps
            .get(&module_name(name))
            .map(|(_, d)| d.as_slice())
            .unwrap_or(&[])
    }

    /// The alias lines (pattern, module).
    pub fn aliases(&self) -> &[(String, String)] {
        &self.aliases
    }

    /// The `pre:` soft dependencies of a module.
    pub fn softdeps_of(&self, name: &str) -> &[String] {
        self.softdeps
            .get(&module_name(name))
            .map(Vec::as_slice)
            .unwrap_or(&[])
    }

    /// The path (relative to the modules dir) of a module.
    pub fn path_of(&self, name: &str) -> Option<&str> {
        self.deps.get(&module_name(name)).map(|(p, _)| p.as_str())
    }

    /// Modules whose alias pattern matches a modalias (or that are named so).
    pub fn resolve(&self, modalias: &str) -> Vec<String> {
        let mut out: Vec<String> = Vec::new();
        if self.has(modalias) || self.is_builtin(modalias) {
            out.push(module_name(modalias));
        }
        for (pat, m) in &self.aliases {
            if glob_match(pat.as_bytes(), modalias.as_bytes()) && !out.contains(m) {
                out.push(m.clone());
            }
        }
        out
    }

    /// The modules to load, in order, so that `names` are loaded with every
    /// hard and `pre:` soft dependency before them. Built-in and unknown
    /// names are left out (unknown ones are returned separately).
    pub fn load_order(&self, names: &[String]) -> (Vec<String>, Vec<String>) {
        let mut order = Vec::new();
        let mut seen = BTreeSet::new();
        let mut unknown = Vec::new();
        for n in names {
            self.visit(&module_name(n), &mut order, &mut seen, &mut unknown, 0);
        }
        (order, unknown)
    }

    fn visit(
        &self,
        name: &str,
        order: &mut Vec<String>,
        seen: &mut BTreeSet<String>,
        unknown: &mut Vec<String>,
        depth: usize,
    ) {
        if depth > 64 || !seen.insert(name.to_string()) {
            return;
        }
        if let Some(pre) = self.softdeps.get(name) {
            for s in pre {
                // A soft dependency may name an alias (`crypto-crc32c`); it is
                // satisfied by whatever of its providers is present.
                for m in self.resolve(s) {
                    if !self.is_builtin(&m) {
                        self.visit(&m, order, seen, &mut Vec::new(), depth + 1);
                    }
                }
            }
        }
        let Some((_, deps)) = self.deps.get(name) else {
            if !self.is_builtin(name) {
                unknown.push(name.to_string());
            }
            return;
        };
        for d in deps.iter().rev() {
            self.visit(d, order, seen, unknown, depth + 1);
        }
        order.push(name.to_string());
    }
}

/// fnmatch-style matching as kmod does for aliases: `*`, `?`, `[...]`
/// (with ranges and `!`/`^` negation).
pub fn glob_match(pat: &[u8], s: &[u8]) -> bool {
    let (mut p, mut i) = (0usize, 0usize);
    let (mut star_p, mut star_i) = (usize::MAX, 0usize);
    while i < s.len() {
        if p < pat.len() {
            match pat[p] {
                b'*' => {
                    star_p = p;
                    star_i = i;
                    p += 1;
                    continue;
                }
                b'?' => {
                    p += 1;
                    i += 1;
                    continue;
                }
                b'[' => {
                    if let Some((matched, next)) = class_match(pat, p, s[i]) {
                        if matched {
                            p = next;
                            i += 1;
                            continue;
                        }
                    } else if s[i] == b'[' {
                        p += 1;
                        i += 1;
                        continue;
                    }
                }
                c if c == s[i] => {
                    p += 1;
                    i += 1;
                    continue;
                }
                _ => {}
            }
        }
        if star_p != usize::MAX {
            p = star_p + 1;
            star_i += 1;
            i = star_i;
            continue;
        }
        return false;
    }
    while p < pat.len() && pat[p] == b'*' {
        p += 1;
    }
    p == pat.len()
}

/// Matches `c` against the class starting at `pat[start] == b'['`; returns
/// (matched, index after `]`), or None for an unterminated class.
fn class_match(pat: &[u8], start: usize, c: u8) -> Option<(bool, usize)> {
    let mut j = start + 1;
    let negate = matches!(pat.get(j), Some(b'!') | Some(b'^'));
    if negate {
        j += 1;
    }
    let mut matched = false;
    let mut first = true;
    while j < pat.len() {
        let lo = pat[j];
        if lo == b']' && !first {
            return Some((matched != negate, j + 1));
        }
        first = false;
        if pat.get(j + 1) == Some(&b'-') && pat.get(j + 2).is_some_and(|&h| h != b']') {
            let hi = pat[j + 2];
            if lo <= c && c <= hi {
                matched = true;
            }
            j += 3;
        } else {
            if lo == c {
                matched = true;
            }
            j += 1;
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    const DEP: &str = "\
kernel/drivers/net/virtio_net.ko: kernel/drivers/net/net_failover.ko kernel/net/core/failover.ko kernel/drivers/virtio/virtio.ko kernel/drivers/virtio/virtio_ring.ko
kernel/drivers/net/net_failover.ko: kernel/net/core/failover.ko
kernel/net/core/failover.ko:
kernel/drivers/virtio/virtio.ko:
kernel/drivers/virtio/virtio_ring.ko:
kernel/fs/ext4/ext4.ko: kernel/lib/crc16.ko kernel/fs/mbcache.ko kernel/fs/jbd2/jbd2.ko
kernel/lib/crc16.ko:
kernel/fs/mbcache.ko:
kernel/fs/jbd2/jbd2.ko:
kernel/crypto/crc32c_generic.ko:
kernel/drivers/nvme/host/nvme-core.ko:
kernel/drivers/nvme/host/nvme.ko: kernel/drivers/nvme/host/nvme-core.ko
";
    const ALIAS: &str = "\
alias virtio:d00000001v* virtio_net
alias pci:v*d*sv*sd*bc01sc08i02* nvme
alias crypto-crc32c crc32c_generic
alias pci:v00008086d000010D3sv*sd*bc*sc*i* e1000e
";

    fn idx() -> ModuleIndex {
        ModuleIndex::parse(
            DEP,
            ALIAS,
            "softdep ext4 pre: crypto-crc32c\n",
            "kernel/drivers/block/loop.ko\n",
        )
    }

    #[test]
    fn deps_come_first_softdeps_too() {
        let (order, unknown) = idx().load_order(&["virtio_net".into(), "ext4".into()]);
        let pos = |n: &str| order.iter().position(|m| m == n).unwrap();
        assert!(pos("virtio") < pos("virtio_net"));
        assert!(pos("failover") < pos("net_failover"));
        assert!(pos("net_failover") < pos("virtio_net"));
        assert!(pos("crc32c_generic") < pos("ext4"));
        assert!(pos("jbd2") < pos("ext4"));
        assert!(unknown.is_empty());
        assert_eq!(order.len(), 10);
        let (order, unknown) = idx().load_order(&["loop".into(), "nope".into()]);
        assert!(order.is_empty());
        assert_eq!(unknown, ["nope"]);
    }

    #[test]
    fn modalias_resolution() {
        let i = idx();
        assert_eq!(i.resolve("virtio:d00000001v00001AF4"), ["virtio_net"]);
        assert_eq!(
            i.resolve("pci:v00001B36d00000010sv00001AF4sd00001100bc01sc08i02"),
            ["nvme"]
        );
        assert_eq!(
            i.resolve("pci:v00008086d000010D3sv00008086sd00000000bc02sc00i00"),
            ["e1000e"]
        );
        assert!(
            i.resolve("pci:v00001234d00001111sv00001AF4sd00001100bc03sc00i00")
                .is_empty()
        );
        assert_eq!(
            module_name("kernel/drivers/nvme/host/nvme-core.ko"),
            "nvme_core"
        );
        assert_eq!(module_name("x/crc32c-intel.ko.zst"), "crc32c_intel");
    }

    #[test]
    fn globbing() {
        assert!(glob_match(b"a*b?c", b"axxbyc"));
        assert!(glob_match(b"*", b""));
        assert!(!glob_match(b"a*b", b"ac"));
        assert!(glob_match(
            b"usb:v*p*d*dc*dsc*dp*ic08isc0[1-6]ip50in*",
            b"usb:v0781p5581d0100dc00dsc00dp00ic08isc06ip50in00"
        ));
        assert!(!glob_match(b"x[!0-9]", b"x5"));
        assert!(glob_match(b"x[!0-9]", b"xa"));
        assert!(glob_match(b"x[", b"x["));
    }
}
