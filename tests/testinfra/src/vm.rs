//! QEMU VMs under TCG on OVMF (per-VM VARS copy) or SeaBIOS, serial console
//! captured to a file, killed by process group on drop.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use regex::Regex;

use crate::netns::Netns;
use crate::procs::ChildGroup;

/// OVMF firmware code (read-only pflash).
pub const OVMF_CODE: &str = "/usr/share/OVMF/OVMF_CODE_4M.fd";
/// OVMF variable store template, copied per VM.
pub const OVMF_VARS: &str = "/usr/share/OVMF/OVMF_VARS_4M.fd";

/// Which firmware the VM boots.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Firmware {
    /// UEFI (OVMF), with a private copy of the VARS file.
    Ovmf,
    /// Legacy BIOS (SeaBIOS, QEMU's default).
    SeaBios,
    /// UEFI with Secure Boot enforced (OVMF's `secboot` code, SMM) and the
    /// Microsoft keys enrolled (`OVMF_VARS_4M.ms.fd`): Microsoft-signed
    /// shims boot.
    OvmfSecureBootMs,
    /// UEFI with Secure Boot enforced and Debian's snakeoil key as the only
    /// db key (`OVMF_VARS_4M.snakeoil.fd`, key pair in
    /// `/usr/share/ovmf/PkKek-1-snakeoil.{key,pem}`): a site's own key.
    OvmfSecureBootSnakeoil,
    /// An arm64 machine: QEMU's `virt` board (`qemu-system-aarch64`, a
    /// Cortex-A72 under TCG) on AAVMF, EDK2's arm64 firmware (package
    /// `qemu-efi-aarch64`), with a private copy of its VARS file. The
    /// console is the PL011 UART (`ttyAMA0`); NICs get no option ROM (QEMU's
    /// are x86 code).
    Aavmf,
}

/// AAVMF firmware code (read-only pflash, 64 MiB).
pub const AAVMF_CODE: &str = "/usr/share/AAVMF/AAVMF_CODE.fd";
/// AAVMF variable store template, copied per VM.
pub const AAVMF_VARS: &str = "/usr/share/AAVMF/AAVMF_VARS.fd";

/// OVMF's Secure Boot code (needs SMM and a secure pflash).
pub const OVMF_CODE_SECBOOT: &str = "/usr/share/OVMF/OVMF_CODE_4M.secboot.fd";
/// OVMF variables with the Microsoft keys enrolled.
pub const OVMF_VARS_MS: &str = "/usr/share/OVMF/OVMF_VARS_4M.ms.fd";
/// OVMF variables with Debian's snakeoil key enrolled.
pub const OVMF_VARS_SNAKEOIL: &str = "/usr/share/OVMF/OVMF_VARS_4M.snakeoil.fd";
/// The snakeoil signing key and certificate.
pub const SNAKEOIL_KEY: &str = "/usr/share/ovmf/PkKek-1-snakeoil.key";
/// See [`SNAKEOIL_KEY`].
pub const SNAKEOIL_CERT: &str = "/usr/share/ovmf/PkKek-1-snakeoil.pem";

impl Firmware {
    /// True for the OVMF variants.
    pub fn is_uefi(self) -> bool {
        self != Firmware::SeaBios
    }

    /// The code and variables files (UEFI only).
    fn files(self) -> Option<(&'static str, &'static str)> {
        match self {
            Firmware::Ovmf => Some((OVMF_CODE, OVMF_VARS)),
            Firmware::OvmfSecureBootMs => Some((OVMF_CODE_SECBOOT, OVMF_VARS_MS)),
            Firmware::OvmfSecureBootSnakeoil => Some((OVMF_CODE_SECBOOT, OVMF_VARS_SNAKEOIL)),
            Firmware::Aavmf => Some((AAVMF_CODE, AAVMF_VARS)),
            Firmware::SeaBios => None,
        }
    }

    /// True for the arm64 firmware (`qemu-system-aarch64`).
    pub fn is_arm64(self) -> bool {
        self == Firmware::Aavmf
    }
}

/// A NIC attached to a tap of the VM's namespace.
#[derive(Debug, Clone)]
pub struct NicConfig {
    /// Tap name inside the namespace (from [`Netns::add_tap`]).
    pub tap: String,
    /// MAC address, `52:54:00:..`.
    pub mac: String,
    /// Keep QEMU's iPXE option ROM (false: `romfile=`, the firmware's own PXE).
    pub option_rom: bool,
    /// QEMU device model (default `virtio-net-pci`).
    pub model: String,
    /// `bootindex` of the NIC, if any.
    pub bootindex: Option<u32>,
}

impl NicConfig {
    /// A virtio-net NIC on `tap` with the iPXE option ROM and bootindex 1.
    pub fn virtio(tap: &str, mac: &str) -> Self {
        Self {
            tap: tap.to_string(),
            mac: mac.to_string(),
            option_rom: true,
            model: "virtio-net-pci".to_string(),
            bootindex: Some(1),
        }
    }
}

/// Disk bus.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DiskBus {
    /// virtio-blk-pci.
    VirtioBlk,
    /// An NVMe controller with one namespace.
    Nvme,
}

/// A disk backed by an image file.
#[derive(Debug, Clone)]
pub struct DiskConfig {
    /// Image file.
    pub path: PathBuf,
    /// `raw` or `qcow2`.
    pub format: String,
    /// Bus.
    pub bus: DiskBus,
    /// Serial number the guest sees.
    pub serial: String,
}

/// How to start a VM.
#[derive(Debug, Clone)]
pub struct VmConfig {
    /// Firmware.
    pub firmware: Firmware,
    /// Memory in MiB.
    pub memory_mib: u32,
    /// vCPUs.
    pub cpus: u32,
    /// NICs (need a namespace).
    pub nics: Vec<NicConfig>,
    /// Disks.
    pub disks: Vec<DiskConfig>,
    /// Direct kernel boot: kernel image.
    pub kernel: Option<PathBuf>,
    /// Direct kernel boot: initramfs.
    pub initrd: Option<PathBuf>,
    /// Direct kernel boot: command line.
    pub append: Option<String>,
    /// Extra QEMU arguments.
    pub extra_args: Vec<String>,
    /// Exit QEMU instead of rebooting the guest.
    pub no_reboot: bool,
    /// The serial console also takes input ([`Vm::send_serial`]): a socket
    /// chardev whose output is logged to the same file.
    pub serial_input: bool,
}

impl Default for VmConfig {
    fn default() -> Self {
        Self {
            firmware: Firmware::Ovmf,
            memory_mib: 1024,
            cpus: 2,
            nics: Vec::new(),
            disks: Vec::new(),
            kernel: None,
            initrd: None,
            append: None,
            extra_args: Vec::new(),
            no_reboot: true,
            serial_input: false,
        }
    }
}

/// A running QEMU VM.
#[derive(Debug)]
pub struct Vm {
    child: ChildGroup,
    dir: tempfile::TempDir,
    serial: PathBuf,
    qmp: PathBuf,
    started: Instant,
    /// The serial socket's connection, kept open: QEMU drops what it has
    /// not yet handed to the UART when the client hangs up.
    serial_in: std::sync::Mutex<Option<std::os::unix::net::UnixStream>>,
}

impl Vm {
    /// Starts QEMU under TCG, inside `netns` when given (required for NICs).
    pub fn launch(cfg: &VmConfig, netns: Option<&Netns>) -> anyhow::Result<Self> {
        if !cfg.nics.is_empty() && netns.is_none() {
            anyhow::bail!("a VM with NICs must run inside a test namespace");
        }
        let dir = tempfile::Builder::new().prefix("anneal-vm-").tempdir()?;
        let serial = dir.path().join("serial.log");
        let qmp = dir.path().join("qmp.sock");
        let secure = matches!(
            cfg.firmware,
            Firmware::OvmfSecureBootMs | Firmware::OvmfSecureBootSnakeoil
        );
        let arm64 = cfg.firmware.is_arm64();
        let mut args: Vec<String> = vec![
            "-machine".into(),
            if arm64 {
                "virt,accel=tcg".into()
            } else if secure {
                "q35,accel=tcg,smm=on".into()
            } else {
                "q35,accel=tcg".into()
            },
            "-cpu".into(),
            // `max` on arm64 emulates pointer authentication's QARMA, slowly
            if arm64 { "cortex-a72" } else { "max" }.into(),
            "-smp".into(),
            cfg.cpus.to_string(),
            "-m".into(),
            cfg.memory_mib.to_string(),
            "-display".into(),
            "none".into(),
            "-monitor".into(),
            "none".into(),
            "-qmp".into(),
            format!("unix:{},server=on,wait=off", qmp.display()),
        ];
        if cfg.serial_input {
            // Output is logged whether or not a client is connected.
            args.push("-chardev".into());
            args.push(format!(
                "socket,id=ser0,path={},server=on,wait=off,logfile={}",
                dir.path().join("serial.sock").display(),
                serial.display()
            ));
            args.push("-serial".into());
            args.push("chardev:ser0".into());
        } else {
            args.push("-serial".into());
            args.push(format!("file:{}", serial.display()));
        }
        if cfg.no_reboot {
            args.push("-no-reboot".into());
        }
        if let Some((code, vars_src)) = cfg.firmware.files() {
            let vars = dir.path().join("OVMF_VARS.fd");
            std::fs::copy(vars_src, &vars).map_err(|e| {
                let pkg = if arm64 { "qemu-efi-aarch64" } else { "ovmf" };
                anyhow::anyhow!("{vars_src} (package {pkg}): {e}")
            })?;
            if secure {
                args.push("-global".into());
                args.push("driver=cfi.pflash01,property=secure,value=on".into());
            }
            args.push("-drive".into());
            args.push(format!(
                "if=pflash,format=raw,unit=0,readonly=on,file={code}"
            ));
            args.push("-drive".into());
            args.push(format!(
                "if=pflash,format=raw,unit=1,file={}",
                vars.display()
            ));
        }
        for (i, nic) in cfg.nics.iter().enumerate() {
            args.push("-netdev".into());
            args.push(format!(
                "tap,id=net{i},ifname={},script=no,downscript=no",
                nic.tap
            ));
            let mut dev = format!("{},netdev=net{i},mac={}", nic.model, nic.mac);
            if !nic.option_rom || arm64 {
                dev.push_str(",romfile=");
            }
            if let Some(b) = nic.bootindex {
                dev.push_str(&format!(",bootindex={b}"));
            }
            args.push("-device".into());
            args.push(dev);
        }
        for (i, disk) in cfg.disks.iter().enumerate() {
            args.push("-drive".into());
            args.push(format!(
                "file={},if=none,id=disk{i},format={},cache=unsafe",
                disk.path.display(),
                disk.format
            ));
            args.push("-device".into());
            args.push(match disk.bus {
                DiskBus::VirtioBlk => {
                    format!("virtio-blk-pci,drive=disk{i},serial={}", disk.serial)
                }
                DiskBus::Nvme => format!("nvme,drive=disk{i},serial={}", disk.serial),
            });
        }
        if let Some(k) = &cfg.kernel {
            args.push("-kernel".into());
            args.push(k.display().to_string());
        }
        if let Some(i) = &cfg.initrd {
            args.push("-initrd".into());
            args.push(i.display().to_string());
        }
        if let Some(a) = &cfg.append {
            args.push("-append".into());
            args.push(a.clone());
        }
        args.extend(cfg.extra_args.iter().cloned());

        let qemu = if arm64 {
            "qemu-system-aarch64"
        } else {
            "qemu-system-x86_64"
        };
        let mut cmd = match netns {
            Some(ns) => ns.exec(qemu),
            None => Command::new(qemu),
        };
        cmd.args(&args)
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(dir.path().join("qemu.out"))?)
            .stderr(std::fs::File::create(dir.path().join("qemu.err"))?);
        std::fs::write(dir.path().join("cmdline"), format!("{cmd:?}"))?;
        let child = ChildGroup::spawn("qemu", &mut cmd)?;
        Ok(Self {
            child,
            dir,
            serial,
            qmp,
            started: Instant::now(),
            serial_in: std::sync::Mutex::new(None),
        })
    }

    /// QEMU's PID (the process group leader).
    pub fn pid(&self) -> u32 {
        self.child.pid()
    }

    /// The serial console log file.
    pub fn serial_path(&self) -> &Path {
        &self.serial
    }

    /// The VM's private OVMF VARS copy (UEFI variables as the firmware
    /// keeps them).
    pub fn vars_path(&self) -> PathBuf {
        self.dir.path().join("OVMF_VARS.fd")
    }

    /// The QMP socket.
    pub fn qmp_path(&self) -> &Path {
        &self.qmp
    }

    /// Types `text` on the serial console (a VM launched with
    /// `serial_input`).
    pub fn send_serial(&self, text: &str) -> anyhow::Result<()> {
        use std::io::Write as _;
        let mut conn = self
            .serial_in
            .lock()
            .map_err(|_| anyhow::anyhow!("serial connection lock poisoned"))?;
        if conn.is_none() {
            let sock = self.dir.path().join("serial.sock");
            *conn = Some(
                std::os::unix::net::UnixStream::connect(&sock)
                    .map_err(|e| anyhow::anyhow!("serial socket {}: {e}", sock.display()))?,
            );
        }
        let s = conn
            .as_mut()
            .ok_or_else(|| anyhow::anyhow!("serial connection"))?;
        // QEMU reads the socket only as fast as the guest's UART takes it;
        // the connection stays open so nothing unread is dropped.
        s.write_all(text.as_bytes())?;
        s.flush()?;
        Ok(())
    }

    /// Everything the guest printed on the serial console so far.
    pub fn serial_text(&self) -> String {
        String::from_utf8_lossy(&std::fs::read(&self.serial).unwrap_or_default()).into_owned()
    }

    /// Time since launch.
    pub fn uptime(&self) -> Duration {
        self.started.elapsed()
    }

    /// Waits until a serial line matches `pattern`; returns the line. On
    /// timeout or QEMU exit the error carries the console's last lines.
    pub async fn wait_for_line(
        &mut self,
        pattern: &str,
        timeout: Duration,
    ) -> anyhow::Result<String> {
        let re = Regex::new(pattern)?;
        let deadline = Instant::now() + timeout;
        loop {
            let text = self.serial_text();
            if let Some(line) = text.lines().find(|l| re.is_match(l)) {
                return Ok(line.trim_end_matches('\r').to_string());
            }
            let exited = self.child.try_exit();
            if exited.is_some() || Instant::now() > deadline {
                let lines: Vec<&str> = text.lines().collect();
                let qemu_err =
                    std::fs::read_to_string(self.dir.path().join("qemu.err")).unwrap_or_default();
                anyhow::bail!(
                    "{} waiting for /{pattern}/ after {:.1} s; last console lines:\n{}\nqemu stderr: {}",
                    if let Some(status) = exited {
                        format!("QEMU exited ({status})")
                    } else {
                        "timed out".into()
                    },
                    self.started.elapsed().as_secs_f64(),
                    lines[lines.len().saturating_sub(40)..].join("\n"),
                    qemu_err.trim()
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Kills QEMU (its whole process group).
    pub fn kill(&mut self) {
        self.child.kill();
    }
}
