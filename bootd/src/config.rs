//! The static YAML boot table (labs without a cluster) and its validation.
//! The watcher builds the same [`Snapshot`] from Machines and the Subnet.

use std::collections::BTreeMap;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};

pub use anneal_api::Architecture;
use anneal_dhcp::{BootFiles, BootTable, Cidr, Loader, Mac, MachineEntry, Mode};

use crate::state::{BootToken, MachineBoot, Snapshot, Token};

/// Errors of loading or validating a boot table.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("reading {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("parsing {path}")]
    Parse {
        path: PathBuf,
        #[source]
        source: Box<serde_saphyr::Error>,
    },
    #[error("invalid boot table: {0}")]
    Invalid(String),
}

fn invalid(s: impl Into<String>) -> ConfigError {
    ConfigError::Invalid(s.into())
}

/// `spec.dhcp` of a Subnet.
#[derive(Debug, Clone, serde::Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct DhcpSpec {
    pub mode: Mode,
    /// Tri-state: absent, `""`, or an address.
    #[serde(default)]
    pub gateway: Option<String>,
    #[serde(default)]
    pub lease_time: Option<String>,
    #[serde(default)]
    pub dns_servers: Vec<Ipv4Addr>,
    #[serde(default)]
    pub lease_range: Option<LeaseRange>,
}

/// `spec.dhcp.leaseRange`.
#[derive(Debug, Clone, Copy, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LeaseRange {
    pub start: Ipv4Addr,
    pub end: Ipv4Addr,
}

/// Where the agent reaches the manager (`anneal.api`, `anneal.ca`).
#[derive(Debug, Clone, Default, serde::Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ApiSpec {
    pub url: String,
    pub ca_sha256: String,
}

/// Kernel and initramfs served over HTTP (and TFTP, to network GRUB): the
/// x86_64 pair, and the arm64 pair for machines whose `spec.architecture`
/// is `aarch64`.
#[derive(Debug, Clone, serde::Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Artifacts {
    pub kernel: PathBuf,
    pub initrd: PathBuf,
    #[serde(default = "default_initrd_name")]
    pub initrd_name: String,
    /// The arm64 kernel and initramfs (`/boot/aarch64/kernel`, `…/initrd`).
    #[serde(default)]
    pub aarch64: Option<ArchArtifacts>,
}

/// The kernel and initramfs of one more architecture.
#[derive(Debug, Clone, serde::Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ArchArtifacts {
    pub kernel: PathBuf,
    pub initrd: PathBuf,
}

impl Artifacts {
    /// The kernel and initramfs for `arch`; `None` when this bootd has none
    /// for it.
    pub fn for_arch(&self, arch: Architecture) -> Option<(&Path, &Path)> {
        match arch {
            Architecture::X86_64 => Some((&self.kernel, &self.initrd)),
            Architecture::Aarch64 => self
                .aarch64
                .as_ref()
                .map(|a| (a.kernel.as_path(), a.initrd.as_path())),
        }
    }
}

/// The name of an architecture in messages and paths (`spec.architecture`'s).
pub fn arch_name(a: Architecture) -> &'static str {
    match a {
        Architecture::X86_64 => "x86_64",
        Architecture::Aarch64 => "aarch64",
    }
}

/// The path under `/boot/` (HTTP) or `boot/` (TFTP) of `arch`'s artifacts:
/// the x86_64 pair at the top, others in a directory named after the
/// architecture.
pub fn boot_prefix(arch: Architecture) -> &'static str {
    match arch {
        Architecture::X86_64 => "boot/",
        Architecture::Aarch64 => "boot/aarch64/",
    }
}

/// The architecture and file (`kernel` or `initrd`) of a `boot/…` path
/// (without the leading slash).
pub fn parse_boot_path(path: &str) -> Option<(Architecture, bool)> {
    let (arch, file) = if let Some(f) = path.strip_prefix("boot/aarch64/") {
        (Architecture::Aarch64, f)
    } else {
        (Architecture::X86_64, path.strip_prefix("boot/")?)
    };
    match file {
        "kernel" => Some((arch, true)),
        "initrd" => Some((arch, false)),
        _ => None,
    }
}

fn default_initrd_name() -> String {
    "initrd.img".into()
}

/// One machine of the static table.
#[derive(Debug, Clone, serde::Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct StaticMachine {
    /// `namespace/name`.
    pub name: String,
    pub mac: Mac,
    #[serde(default)]
    pub address: Option<Ipv4Addr>,
    #[serde(default)]
    pub console: Vec<String>,
    #[serde(default)]
    pub token: Option<String>,
    /// Chain `undionly.kpxe` from a NIC ROM iPXE before booting (legacy BIOS).
    #[serde(default)]
    pub chain_undionly: bool,
    /// `ipxe` (default) or `shim` (Machine `spec.bootLoader`).
    #[serde(default)]
    pub boot_loader: Loader,
    /// `x86_64` (default) or `aarch64` (Machine `spec.architecture`): which
    /// kernel and initramfs the machine boots.
    #[serde(default)]
    pub architecture: Architecture,
    #[serde(default)]
    pub debug_shell: bool,
}

/// The whole static file.
#[derive(Debug, Clone, serde::Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct StaticConfig {
    #[serde(default)]
    pub subnet: Option<String>,
    #[serde(rename = "serverIP")]
    pub server_ip: Ipv4Addr,
    pub cidr: Cidr,
    pub dhcp: DhcpSpec,
    #[serde(default)]
    pub answer_all: bool,
    #[serde(default)]
    pub boot_files: BootFiles,
    /// Defaults to `http://<serverIP>:<http port>`.
    #[serde(default)]
    pub http_base: Option<String>,
    #[serde(default)]
    pub api: ApiSpec,
    #[serde(default)]
    pub artifacts: Option<Artifacts>,
    /// First-stage files by name (served over TFTP and under `/files/`).
    #[serde(default)]
    pub files: BTreeMap<String, PathBuf>,
    /// A directory whose regular files are all served by their names, as
    /// if listed in `files` (a name listed there wins); read when the
    /// configuration is loaded. A managed bootd gets the content store's
    /// `boot/files` here.
    #[serde(default)]
    pub files_dir: Option<PathBuf>,
    #[serde(default)]
    pub machines: Vec<StaticMachine>,
}

/// Parses `30m`, `1h`, `90s`, `3600` into seconds.
pub fn parse_duration(s: &str) -> Result<u32, ConfigError> {
    let s = s.trim();
    let (num, mult) = match s.char_indices().last() {
        Some((i, 's')) => (&s[..i], 1),
        Some((i, 'm')) => (&s[..i], 60),
        Some((i, 'h')) => (&s[..i], 3600),
        Some((i, 'd')) => (&s[..i], 86400),
        _ => (s, 1),
    };
    num.parse::<u32>()
        .ok()
        .and_then(|n| n.checked_mul(mult))
        .ok_or_else(|| invalid(format!("bad duration {s:?}")))
}

/// The pieces of a Subnet a boot table needs, shared by the file and the watcher.
#[derive(Debug, Clone)]
pub struct SubnetInput {
    pub server_ip: Ipv4Addr,
    pub cidr: Cidr,
    pub dhcp: DhcpSpec,
    pub answer_all: bool,
    pub boot_files: BootFiles,
    pub http_base: String,
    pub revision: String,
}

/// Builds a validated [`BootTable`] (docs/api.md rules for gateway, lease time,
/// reservations).
pub fn build_table(
    s: &SubnetInput,
    machines: BTreeMap<Mac, MachineEntry>,
) -> Result<BootTable, ConfigError> {
    let router = match (&s.dhcp.gateway, s.dhcp.mode) {
        (None, Mode::Lease) => {
            return Err(invalid(
                "dhcp.gateway is required in lease mode (\"\" for no router)",
            ));
        }
        (None, Mode::Proxy) => None,
        (Some(g), _) if g.is_empty() => None,
        (Some(_), Mode::Proxy) => {
            return Err(invalid("dhcp.gateway must be empty in proxy mode"));
        }
        (Some(g), Mode::Lease) => Some(
            g.parse::<Ipv4Addr>()
                .map_err(|_| invalid(format!("bad gateway {g:?}")))?,
        ),
    };
    let lease_time = match &s.dhcp.lease_time {
        Some(t) => parse_duration(t)?,
        None => 1800,
    };
    if lease_time < 120 {
        return Err(invalid("dhcp.leaseTime must be at least 2m"));
    }
    // serverIP may lie outside the cidr: a relayed segment reaches bootd
    // through a router.
    let mut seen = BTreeMap::new();
    for (mac, m) in &machines {
        if let Some(a) = m.address {
            if !s.cidr.contains(a) {
                return Err(invalid(format!(
                    "reservation {a} of {mac} is outside {}",
                    s.cidr
                )));
            }
            if let Some(other) = seen.insert(a, *mac) {
                return Err(invalid(format!(
                    "address {a} reserved for both {other} and {mac}"
                )));
            }
        }
    }
    let lease_range = s.dhcp.lease_range.map(|r| (r.start, r.end));
    Ok(BootTable {
        mode: s.dhcp.mode,
        server_ip: s.server_ip,
        cidr: s.cidr,
        router,
        dns: s.dhcp.dns_servers.clone(),
        lease_time,
        lease_range,
        answer_all: s.answer_all,
        boot_files: s.boot_files.clone(),
        http_base: s.http_base.clone(),
        machines,
        revision: s.revision.clone(),
    })
}

/// A stable digest of a string (FNV-1a 64), for revisions of static tables;
/// the same function the manager's reservation revisions use.
pub use anneal_api::digest;

impl StaticConfig {
    /// Reads and parses a YAML file.
    pub fn load(path: &Path) -> Result<(StaticConfig, String), ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.into(),
            source,
        })?;
        let mut cfg: StaticConfig =
            serde_saphyr::from_str(&text).map_err(|source| ConfigError::Parse {
                path: path.into(),
                source: Box::new(source),
            })?;
        cfg.read_files_dir()?;
        Ok((cfg, digest(&text)))
    }

    /// Parses YAML text.
    pub fn from_yaml(text: &str) -> Result<StaticConfig, ConfigError> {
        let mut cfg: StaticConfig =
            serde_saphyr::from_str(text).map_err(|source| ConfigError::Parse {
                path: PathBuf::from("<inline>"),
                source: Box::new(source),
            })?;
        cfg.read_files_dir()?;
        Ok(cfg)
    }

    /// Takes the boot files from one directory (bootd `--boot-dir`):
    /// `vmlinuz`, `initrd.img` and every file of `files/`; each must exist
    /// (the error lists what is missing and where it belongs).
    pub fn use_boot_dir(&mut self, dir: &Path) -> Result<(), ConfigError> {
        let kernel = dir.join("vmlinuz");
        let initrd = dir.join("initrd.img");
        let files = dir.join("files");
        let missing: Vec<String> = [
            (&kernel, "the kernel"),
            (&initrd, "the agent's initramfs"),
            (
                &files,
                "a directory of first stages: snponly.efi, undionly.kpxe, …",
            ),
        ]
        .iter()
        .filter(|(p, _)| !p.exists())
        .map(|(p, what)| format!("{} ({what})", p.display()))
        .collect();
        if !missing.is_empty() {
            return Err(invalid(format!(
                "boot directory {}: missing {}",
                dir.display(),
                missing.join(", ")
            )));
        }
        // arm64 machines' pair, when the directory has one
        let arm = dir.join("aarch64");
        let aarch64 = match (arm.join("vmlinuz"), arm.join("initrd.img")) {
            (k, i) if k.is_file() && i.is_file() => Some(ArchArtifacts {
                kernel: k,
                initrd: i,
            }),
            (k, i) if k.exists() || i.exists() => {
                return Err(invalid(format!(
                    "boot directory {}: aarch64/ needs both vmlinuz and initrd.img",
                    dir.display()
                )));
            }
            _ => None,
        };
        self.artifacts = Some(Artifacts {
            kernel,
            initrd,
            initrd_name: self
                .artifacts
                .as_ref()
                .map_or_else(default_initrd_name, |a| a.initrd_name.clone()),
            aarch64,
        });
        self.files_dir = Some(files);
        self.read_files_dir()
    }

    /// Adds every regular file of `filesDir` to `files` under its name
    /// (names already listed keep their path).
    fn read_files_dir(&mut self) -> Result<(), ConfigError> {
        let Some(dir) = &self.files_dir else {
            return Ok(());
        };
        let read_err = |source| ConfigError::Read {
            path: dir.clone(),
            source,
        };
        for entry in std::fs::read_dir(dir).map_err(read_err)? {
            let entry = entry.map_err(read_err)?;
            // follows symbolic links: a volume's files often are links
            let Ok(meta) = std::fs::metadata(entry.path()) else {
                continue;
            };
            let Some(name) = entry.file_name().to_str().map(str::to_string) else {
                continue;
            };
            if meta.is_file() && !name.starts_with('.') {
                self.files.entry(name).or_insert_with(|| entry.path());
            }
        }
        Ok(())
    }

    /// Builds the snapshot bootd serves from.
    pub fn snapshot(&self, http_port: u16, revision: String) -> Result<Snapshot, ConfigError> {
        let http_base = self
            .http_base
            .clone()
            .unwrap_or_else(|| format!("http://{}:{http_port}", self.server_ip));
        let mut entries = BTreeMap::new();
        let mut boots = BTreeMap::new();
        for m in &self.machines {
            if !m.name.contains('/') {
                return Err(invalid(format!(
                    "machine name {:?} is not namespace/name",
                    m.name
                )));
            }
            if m.console.len() > 4 {
                return Err(invalid(format!(
                    "machine {} has more than 4 consoles",
                    m.name
                )));
            }
            let entry = MachineEntry {
                name: m.name.clone(),
                address: m.address,
                loader: m.boot_loader,
            };
            if entries.insert(m.mac, entry).is_some() {
                return Err(invalid(format!("mac {} listed twice", m.mac)));
            }
            boots.insert(
                m.mac,
                MachineBoot {
                    name: m.name.clone(),
                    console: m.console.clone(),
                    token: m
                        .token
                        .clone()
                        .map_or(BootToken::None, |t| BootToken::Unused(Token::new(t))),
                    chain_undionly: m.chain_undionly,
                    debug_shell: m.debug_shell,
                    architecture: m.architecture,
                    ipv6_address: None,
                },
            );
        }
        let input = SubnetInput {
            server_ip: self.server_ip,
            cidr: self.cidr,
            dhcp: self.dhcp.clone(),
            answer_all: self.answer_all,
            boot_files: self.boot_files.clone(),
            http_base,
            revision,
        };
        let table = build_table(&input, entries)?;
        for name in self.files.keys() {
            if name.is_empty() || name.contains('/') || name.contains("..") {
                return Err(invalid(format!("file name {name:?} must be a plain name")));
            }
        }
        Ok(Snapshot {
            table,
            machines: boots,
            api: self.api.clone(),
            artifacts: self.artifacts.clone(),
            files: self.files.clone(),
        })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    const YAML: &str = r#"
subnet: lab/seg1
serverIP: 10.77.0.2
cidr: 10.77.0.0/24
dhcp:
  mode: lease
  gateway: ""
  leaseTime: 10m
machines:
  - name: lab/m1
    mac: "52:54:00:00:00:01"
    address: 10.77.0.50
    console: ["ttyS0,115200"]
"#;

    #[test]
    fn parses_and_validates() {
        let cfg: StaticConfig = serde_saphyr::from_str(YAML).unwrap();
        let s = cfg.snapshot(8080, "r".into()).unwrap();
        assert_eq!(s.table.lease_time, 600);
        assert_eq!(s.table.router, None);
        assert_eq!(s.table.http_base, "http://10.77.0.2:8080");
        assert_eq!(s.table.machines.len(), 1);

        let no_gw = YAML.replace("  gateway: \"\"\n", "");
        let cfg: StaticConfig = serde_saphyr::from_str(&no_gw).unwrap();
        assert!(cfg.snapshot(8080, "r".into()).is_err());

        let short = YAML.replace("10m", "1m");
        let cfg: StaticConfig = serde_saphyr::from_str(&short).unwrap();
        assert!(cfg.snapshot(8080, "r".into()).is_err());

        let proxy_gw = YAML
            .replace("mode: lease", "mode: proxy")
            .replace("gateway: \"\"", "gateway: 10.77.0.1");
        let cfg: StaticConfig = serde_saphyr::from_str(&proxy_gw).unwrap();
        assert!(cfg.snapshot(8080, "r".into()).is_err());

        let outside = YAML.replace("10.77.0.50", "10.78.0.50");
        let cfg: StaticConfig = serde_saphyr::from_str(&outside).unwrap();
        assert!(cfg.snapshot(8080, "r".into()).is_err());
    }

    #[test]
    fn a_files_directory_serves_its_files_and_listed_names_win() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("snponly.efi"), b"efi").unwrap();
        std::fs::write(dir.path().join("undionly.kpxe"), b"kpxe").unwrap();
        std::fs::write(dir.path().join(".hidden"), b"x").unwrap();
        std::fs::create_dir(dir.path().join("sub")).unwrap();
        let yaml = format!(
            "{YAML}files: {{undionly.kpxe: /elsewhere/undionly.kpxe}}\nfilesDir: {}\n",
            dir.path().display()
        );
        let cfg = StaticConfig::from_yaml(&yaml).unwrap();
        assert_eq!(
            cfg.files.keys().collect::<Vec<_>>(),
            ["snponly.efi", "undionly.kpxe"]
        );
        assert_eq!(cfg.files["snponly.efi"], dir.path().join("snponly.efi"));
        assert_eq!(
            cfg.files["undionly.kpxe"],
            PathBuf::from("/elsewhere/undionly.kpxe")
        );
        // a boot directory: kernel, initramfs, first stages
        let boot = tempfile::tempdir().unwrap();
        let mut cfg = StaticConfig::from_yaml(YAML).unwrap();
        let e = cfg.use_boot_dir(boot.path()).unwrap_err().to_string();
        assert!(
            e.contains("vmlinuz (the kernel)") && e.contains("initrd.img") && e.contains("files"),
            "{e}"
        );
        std::fs::write(boot.path().join("vmlinuz"), b"k").unwrap();
        std::fs::write(boot.path().join("initrd.img"), b"i").unwrap();
        std::fs::create_dir(boot.path().join("files")).unwrap();
        std::fs::write(boot.path().join("files/snponly.efi"), b"e").unwrap();
        cfg.use_boot_dir(boot.path()).unwrap();
        let a = cfg.artifacts.as_ref().unwrap();
        assert_eq!(a.kernel, boot.path().join("vmlinuz"));
        assert_eq!(a.initrd_name, "initrd.img");
        assert_eq!(
            cfg.files["snponly.efi"],
            boot.path().join("files/snponly.efi")
        );
        assert!(a.aarch64.is_none());
        // the arm64 pair: both files or neither
        std::fs::create_dir(boot.path().join("aarch64")).unwrap();
        std::fs::write(boot.path().join("aarch64/vmlinuz"), b"k").unwrap();
        let e = cfg.use_boot_dir(boot.path()).unwrap_err().to_string();
        assert!(
            e.contains("aarch64/ needs both vmlinuz and initrd.img"),
            "{e}"
        );
        std::fs::write(boot.path().join("aarch64/initrd.img"), b"i").unwrap();
        cfg.use_boot_dir(boot.path()).unwrap();
        let a = cfg.artifacts.as_ref().unwrap();
        assert_eq!(
            a.for_arch(Architecture::Aarch64),
            Some((
                boot.path().join("aarch64/vmlinuz").as_path(),
                boot.path().join("aarch64/initrd.img").as_path()
            ))
        );
        // a missing directory names itself
        let missing = format!("{YAML}filesDir: /nonexistent/anneal-files\n");
        let e = StaticConfig::from_yaml(&missing).unwrap_err();
        assert!(format!("{e}").contains("/nonexistent/anneal-files"), "{e}");
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("30m").unwrap(), 1800);
        assert_eq!(parse_duration("1h").unwrap(), 3600);
        assert_eq!(parse_duration("90s").unwrap(), 90);
        assert_eq!(parse_duration("120").unwrap(), 120);
        assert!(parse_duration("x").is_err());
    }
}
