//! The Day-1 cloud OS (docs/deploy.md, "Day-1 configuration (cloud-init)"): a
//! plain Debian 12 cloud image built by `tests/setup.d/cloudos.sh`
//! (debootstrap from Debian's packages, with cloud-init and openssh-server,
//! nothing anneal-specific), as a raw GPT disk: p1 an ESP holding a UKI at
//! `\EFI\debian\linuxx64.efi`, p2 an ext4 root with a fixed UUID, unallocated
//! space after it. Plus what a test needs around it: an SSH key pair, `ssh`
//! into a namespace, and a NoCloud seed (a vfat filesystem labelled `CIDATA`)
//! built with the host's mtools.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::Context as _;
use sha2::Digest as _;

/// The built image, as `tests/setup.d/cloudos.sh` left it in
/// `$ANNEAL_CACHE/cloudos/<recipe hash>/`.
#[derive(Debug, Clone)]
pub struct CloudOs {
    /// The cache directory of this recipe.
    pub dir: PathBuf,
    /// The raw GPT disk image (sparse; copy it before booting it).
    pub disk: PathBuf,
    /// Its size in bytes.
    pub disk_bytes: u64,
    /// The root filesystem's UUID (ext4), also on the kernel command line.
    pub root_uuid: String,
    /// Partition numbers (1-based): the ESP and the root.
    pub esp_partition: u32,
    /// See [`CloudOs::esp_partition`].
    pub root_partition: u32,
    /// Byte offsets of the ESP and of the root in the disk.
    pub esp_offset: u64,
    /// See [`CloudOs::esp_offset`].
    pub root_offset: u64,
    /// End of the last partition in bytes: the space after it is free.
    pub partitions_end: u64,
    /// The loader on the ESP (`EFI/debian/linuxx64.efi`).
    pub loader: String,
    /// The kernel release inside (`6.1.0-…-cloud-amd64`).
    pub kernel: String,
    /// Debian package versions (cloud-init, openssh-server, the kernel
    /// metapackage, netplan.io, systemd).
    pub packages: BTreeMap<String, String>,
    /// `info.json` as written by the set-up script.
    pub info: serde_json::Value,
}

/// The setup script (its hash names the cache directory).
fn recipe_script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("setup.d/cloudos.sh")
}

/// Locates the cached image of the current recipe; an error names
/// `tests/setup.sh` when it is missing or stale.
pub fn cloud_os() -> anyhow::Result<CloudOs> {
    let script = recipe_script();
    let text = std::fs::read(&script).with_context(|| format!("reading {}", script.display()))?;
    let hash = hex::encode(sha2::Sha256::digest(&text));
    let dir = anneal_testinfra::cache_dir()
        .join("cloudos")
        .join(&hash[..16]);
    let disk = dir.join("disk.raw");
    let info_path = dir.join("info.json");
    if !disk.is_file() || !info_path.is_file() {
        anyhow::bail!(
            "the Debian 12 cloud image of this recipe is not built ({} missing): run tests/setup.sh as root \
             (or `. tests/setup.d/cloudos.sh` with ANNEAL_CACHE set)",
            disk.display()
        );
    }
    let info: serde_json::Value = serde_json::from_slice(&std::fs::read(&info_path)?)
        .with_context(|| format!("parsing {}", info_path.display()))?;
    let s = |v: &serde_json::Value| -> anyhow::Result<String> {
        v.as_str()
            .map(str::to_owned)
            .with_context(|| format!("{} lacks a string at {v}", info_path.display()))
    };
    let n = |v: &serde_json::Value| -> anyhow::Result<u64> {
        v.as_u64()
            .with_context(|| format!("{} lacks a number", info_path.display()))
    };
    let root = &info["root"];
    let root_offset = n(&root["start_sector"])? * 512;
    let partitions_end = root_offset + n(&root["bytes"])?;
    let packages = info["packages"]
        .as_object()
        .context("info.json: no packages")?
        .iter()
        .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_owned()))
        .collect();
    Ok(CloudOs {
        disk_bytes: std::fs::metadata(&disk)?.len(),
        root_uuid: s(&root["uuid"])?,
        esp_partition: u32::try_from(n(&info["esp"]["partition"])?)?,
        root_partition: u32::try_from(n(&root["partition"])?)?,
        esp_offset: n(&info["esp"]["start_sector"])? * 512,
        root_offset,
        partitions_end,
        loader: s(&info["loader"])?,
        kernel: s(&info["kernel"])?,
        packages,
        dir,
        disk,
        info,
    })
}

/// An ed25519 key pair in a private temporary directory (removed on drop).
#[derive(Debug)]
pub struct SshKey {
    _dir: tempfile::TempDir,
    /// The private key file (mode 0600, for `ssh -i`).
    pub private: PathBuf,
    /// The public key line (`ssh-ed25519 AAAA… comment`).
    pub public: String,
}

/// Generates an ed25519 key pair with the host's `ssh-keygen` (package
/// openssh-client), no passphrase.
pub fn ssh_keygen(comment: &str) -> anyhow::Result<SshKey> {
    let dir = tempfile::Builder::new().prefix("anneal-ssh-").tempdir()?;
    let private = dir.path().join("id_ed25519");
    anneal_testinfra::run(
        Command::new("ssh-keygen")
            .args(["-q", "-t", "ed25519", "-N", "", "-C", comment, "-f"])
            .arg(&private),
    )
    .context("ssh-keygen (package openssh-client)")?;
    let public = std::fs::read_to_string(private.with_extension("pub"))?
        .trim()
        .to_owned();
    Ok(SshKey {
        _dir: dir,
        private,
        public,
    })
}

/// The `ssh` command (BatchMode, no host key checks or records, a short
/// connect timeout) for `user@addr` with `key`, run inside network namespace
/// `netns` (`ip netns exec`) when given.
pub fn ssh_command(netns: Option<&str>, addr: &str, user: &str, key: &Path) -> Command {
    let mut cmd = match netns {
        Some(ns) => {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", ns, "ssh"]);
            c
        }
        None => Command::new("ssh"),
    };
    cmd.args([
        "-o",
        "BatchMode=yes",
        "-o",
        "StrictHostKeyChecking=no",
        "-o",
        "UserKnownHostsFile=/dev/null",
        "-o",
        "GlobalKnownHostsFile=/dev/null",
        "-o",
        "LogLevel=ERROR",
        "-o",
        "ConnectTimeout=10",
        "-o",
        "ServerAliveInterval=10",
        "-o",
        "ServerAliveCountMax=3",
        "-o",
        "IdentitiesOnly=yes",
        "-F",
        "/dev/null",
        "-i",
    ])
    .arg(key)
    .arg(format!("{user}@{addr}"))
    .stdin(std::process::Stdio::null());
    cmd
}

/// Runs `cmd` on `user@addr` over SSH (see [`ssh_command`]); its stdout on
/// success, an error with the exit status and stderr otherwise.
pub fn ssh_run(
    netns: Option<&str>,
    addr: &str,
    user: &str,
    key: &Path,
    cmd: &str,
) -> anyhow::Result<String> {
    let out = ssh_command(netns, addr, user, key)
        .arg("--")
        .arg(cmd)
        .output()
        .context("running ssh (package openssh-client)")?;
    if !out.status.success() {
        anyhow::bail!(
            "ssh {user}@{addr} {cmd:?}: {}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The three files of a NoCloud seed.
#[derive(Debug, Clone)]
pub struct NoCloudSeed {
    /// `user-data` (`#cloud-config` …).
    pub user_data: String,
    /// `meta-data` (`instance-id`, `local-hostname`).
    pub meta_data: String,
    /// `network-config` (version 2), if any.
    pub network_config: Option<String>,
}

/// `meta-data` with an instance id and a hostname.
pub fn meta_data(instance_id: &str, hostname: &str) -> String {
    format!("instance-id: {instance_id}\nlocal-hostname: {hostname}\n")
}

/// `#cloud-config` creating `user` (passwordless sudo, no password login)
/// with `authorized_key`, then running each of `runcmd` (a shell line each).
pub fn user_data(user: &str, authorized_key: &str, runcmd: &[&str]) -> String {
    let mut s = format!(
        "#cloud-config\nusers:\n  - name: {user}\n    shell: /bin/bash\n    sudo: ALL=(ALL) NOPASSWD:ALL\n    lock_passwd: true\n    ssh_authorized_keys:\n      - {}\n",
        yaml_quote(authorized_key)
    );
    if !runcmd.is_empty() {
        s.push_str("runcmd:\n");
        for c in runcmd {
            s.push_str(&format!("  - [ sh, -c, {} ]\n", yaml_quote(c)));
        }
    }
    s
}

/// Network config version 2: the NIC with `mac` (matched by MAC, named
/// `name`) gets the static `cidr` (`10.77.0.50/24`), with a default route via
/// `gateway` when given.
pub fn static_network_config(name: &str, mac: &str, cidr: &str, gateway: Option<&str>) -> String {
    let mut s = format!(
        "version: 2\nethernets:\n  {name}:\n    match:\n      macaddress: \"{}\"\n    set-name: {name}\n    dhcp4: false\n    dhcp6: false\n    addresses:\n      - {cidr}\n",
        mac.to_ascii_lowercase()
    );
    if let Some(gw) = gateway {
        s.push_str(&format!(
            "    routes:\n      - to: 0.0.0.0/0\n        via: {gw}\n"
        ));
    }
    s
}

/// A double-quoted YAML scalar.
fn yaml_quote(s: &str) -> String {
    format!("\"{}\"", s.replace('\\', "\\\\").replace('"', "\\\""))
}

/// Writes a NoCloud seed image at `out`: a `size_mib` vfat filesystem
/// labelled `CIDATA` holding `user-data`, `meta-data` and `network-config`
/// (host tools: `mkfs.vfat` of dosfstools, `mcopy` of mtools). Only for the
/// tests' own VMs: the product writes its own seed.
pub fn nocloud_vfat(out: &Path, seed: &NoCloudSeed, size_mib: u32) -> anyhow::Result<()> {
    let dir = tempfile::Builder::new().prefix("anneal-seed-").tempdir()?;
    let mut files = vec![
        ("user-data", seed.user_data.as_str()),
        ("meta-data", seed.meta_data.as_str()),
    ];
    if let Some(n) = &seed.network_config {
        files.push(("network-config", n.as_str()));
    }
    if out.exists() {
        std::fs::remove_file(out)?;
    }
    anneal_testinfra::run(
        Command::new("mkfs.vfat")
            .args(["-n", "CIDATA", "-C"])
            .arg(out)
            .arg((u64::from(size_mib) * 1024).to_string()),
    )
    .context("mkfs.vfat (package dosfstools)")?;
    for (name, text) in files {
        let p = dir.path().join(name);
        std::fs::write(&p, text)?;
        anneal_testinfra::run(
            Command::new("mcopy")
                .env("MTOOLS_SKIP_CHECK", "1")
                .arg("-i")
                .arg(out)
                .arg(&p)
                .arg(format!("::/{name}")),
        )
        .context("mcopy (package mtools)")?;
    }
    Ok(())
}
