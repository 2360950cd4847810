//! Hardware inventory from `/sys`, `/proc` and `/dev`, relative to a root so
//! captured fixture trees test the same code the live agent runs.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use anneal_api::agent::{
    Cpu, Disk, Firmware, FirmwareMode, HardwareReport, Nic, Partition, SystemInfo,
};

pub mod lldp;
mod slots;
use slots::Slots;

/// An error collecting the inventory.
#[derive(Debug, thiserror::Error)]
pub enum InventoryError {
    /// A directory every Linux system has could not be listed.
    #[error("cannot list {path}")]
    List {
        /// The directory.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
}

/// Where to read from (`/` live, a fixture directory in tests).
#[derive(Debug, Clone)]
pub struct Root(PathBuf);

/// Options of the inventory.
#[derive(Debug, Clone, Copy, Default)]
pub struct Options {
    /// Keep removable and USB disks (excluded by default).
    pub include_removable: bool,
    /// Probe partitions for filesystems (reads `/dev/<partition>`).
    pub probe_filesystems: bool,
}

const EFI_GLOBAL: &str = "8be4df61-93ca-11d2-aa0d-00e098032b8c";

impl Root {
    /// A root directory.
    pub fn new(path: impl Into<PathBuf>) -> Self {
        Self(path.into())
    }

    fn p(&self, rel: &str) -> PathBuf {
        self.0.join(rel.trim_start_matches('/'))
    }

    fn read(&self, rel: impl AsRef<Path>) -> Option<String> {
        let path = self
            .0
            .join(rel.as_ref().strip_prefix("/").unwrap_or(rel.as_ref()));
        let raw = fs::read(path).ok()?;
        let s = String::from_utf8_lossy(&raw).trim().to_string();
        Some(s)
    }

    /// The whole report.
    pub fn collect(&self, opts: Options) -> Result<HardwareReport, InventoryError> {
        Ok(HardwareReport {
            disks: self.disks(opts)?,
            nics: self.nics()?,
            memory_bytes: self.memory_bytes(),
            cpu: self.cpu(),
            firmware: self.firmware(),
            system: self.system(),
        })
    }

    /// Logical CPUs and the model of the first.
    pub fn cpu(&self) -> Cpu {
        let info = self.read("proc/cpuinfo").unwrap_or_default();
        let mut count = 0u32;
        let mut model = None;
        let (mut implementer, mut part) = (None, None);
        for line in info.lines() {
            let Some((k, v)) = line.split_once(':') else {
                continue;
            };
            match k.trim() {
                "processor" => count += 1,
                "model name" if model.is_none() => model = Some(v.trim().to_string()),
                "CPU implementer" if implementer.is_none() => implementer = parse_hex(v),
                "CPU part" if part.is_none() => part = parse_hex(v),
                _ => {}
            }
        }
        // arm64 names no model: the first CPU's MIDR implementer and part do
        if model.is_none()
            && let (Some(i), Some(p)) = (implementer, part)
        {
            model = Some(arm_cpu_model(i, p));
        }
        if count == 0 {
            count = self
                .read("sys/devices/system/cpu/online")
                .map(|s| count_cpu_list(&s))
                .unwrap_or(0);
        }
        Cpu {
            count,
            model,
            // the agent is a native static binary: its architecture is the
            // machine's
            architecture: Some(std::env::consts::ARCH.to_string()),
        }
    }

    /// Installed memory: the sum of the DMI memory devices (type 17), which is
    /// what was configured or fitted; the kernel's MemTotal (which excludes
    /// firmware and kernel reservations) when DMI has none.
    pub fn memory_bytes(&self) -> u64 {
        let dmi = self.dmi_memory_bytes();
        if dmi > 0 {
            return dmi;
        }
        let info = self.read("proc/meminfo").unwrap_or_default();
        info.lines()
            .find_map(|l| l.strip_prefix("MemTotal:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .map(|kib| kib * 1024)
            .unwrap_or(0)
    }

    fn dmi_memory_bytes(&self) -> u64 {
        let Ok(entries) = fs::read_dir(self.p("sys/firmware/dmi/entries")) else {
            return 0;
        };
        let mut total = 0u64;
        for e in entries.flatten() {
            if !e.file_name().to_string_lossy().starts_with("17-") {
                continue;
            }
            if let Ok(raw) = fs::read(e.path().join("raw")) {
                total += dmi_memory_device_bytes(&raw);
            }
        }
        total
    }

    /// UEFI or BIOS, and Secure Boot from efivarfs.
    pub fn firmware(&self) -> Firmware {
        if !self.p("sys/firmware/efi").is_dir() {
            return Firmware {
                mode: FirmwareMode::Bios,
                secure_boot: false,
            };
        }
        let var = self.p(&format!("sys/firmware/efi/efivars/SecureBoot-{EFI_GLOBAL}"));
        // efivarfs files are 4 bytes of attributes followed by the value.
        let secure_boot = fs::read(var).ok().and_then(|v| v.get(4).copied()) == Some(1);
        Firmware {
            mode: FirmwareMode::Uefi,
            secure_boot,
        }
    }

    /// DMI system identity.
    pub fn system(&self) -> SystemInfo {
        let get = |f: &str| {
            self.read(format!("sys/class/dmi/id/{f}"))
                .and_then(dmi_value)
        };
        SystemInfo {
            vendor: get("sys_vendor"),
            product: get("product_name"),
            serial: get("product_serial"),
            uuid: get("product_uuid").map(|u| u.to_ascii_lowercase()),
        }
    }

    /// Physical NICs (those with a backing device), sorted by name.
    pub fn nics(&self) -> Result<Vec<Nic>, InventoryError> {
        let dir = self.p("sys/class/net");
        let entries = fs::read_dir(&dir).map_err(|source| InventoryError::List {
            path: dir.clone(),
            source,
        })?;
        let mut out = Vec::new();
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().to_string();
            let base = format!("sys/class/net/{name}");
            if !self.p(&format!("{base}/device")).exists() {
                continue; // lo, bridges, veth, tun: no device
            }
            if self.read(format!("{base}/type")).as_deref() != Some("1") {
                continue; // not Ethernet
            }
            let mac = self.read(format!("{base}/address")).unwrap_or_default();
            let speed_mbps = self
                .read(format!("{base}/speed"))
                .and_then(|s| s.parse::<i64>().ok())
                .filter(|&s| s > 0)
                .and_then(|s| u32::try_from(s).ok());
            let driver = fs::read_link(self.p(&format!("{base}/device/driver")))
                .ok()
                .and_then(|l| l.file_name().map(|n| n.to_string_lossy().to_string()));
            let pci_address = fs::canonicalize(self.p(&format!("{base}/device")))
                .ok()
                .and_then(|p| nearest_pci(&p));
            let link = self.read(format!("{base}/carrier")).as_deref() == Some("1");
            out.push(Nic {
                name,
                mac: mac.to_ascii_lowercase(),
                speed_mbps,
                driver,
                pci_address,
                link,
                lldp: None,
            });
        }
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }

    /// Disks from `/sys/block`, sorted by name.
    pub fn disks(&self, opts: Options) -> Result<Vec<Disk>, InventoryError> {
        let dir = self.p("sys/block");
        let entries = fs::read_dir(&dir).map_err(|source| InventoryError::List {
            path: dir.clone(),
            source,
        })?;
        let slots = Slots::read(&self.0);
        let mut out = Vec::new();
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().to_string();
            if let Some(d) = self.disk(&name, opts, &slots) {
                out.push(d);
            }
        }
        out.sort_by(|a, b| a.device_name.cmp(&b.device_name));
        Ok(out)
    }

    fn disk(&self, name: &str, opts: Options, slots: &Slots) -> Option<Disk> {
        let base = format!("sys/block/{name}");
        let real = fs::canonicalize(self.p(&base)).ok()?;
        // Judge the path below the root only (a fixture directory's own name
        // must not look like a bus).
        let real_s = match fs::canonicalize(&self.0) {
            Ok(root) => format!("/{}", real.strip_prefix(&root).unwrap_or(&real).display()),
            Err(_) => real.to_string_lossy().to_string(),
        };
        // NVMe namespaces under native multipath hang off a virtual
        // nvme-subsystem device; every other virtual block device (loop,
        // ram, zram, dm, md) is not a disk.
        let nvme_head = real_s.contains("/nvme-subsystem/");
        if real_s.contains("/devices/virtual/") && !nvme_head {
            return None;
        }
        let size_bytes = self.read(format!("{base}/size"))?.parse::<u64>().ok()? * 512;
        if size_bytes == 0 {
            return None; // empty card reader, ejected media
        }
        let dev_type = self.read(format!("{base}/device/type"));
        if dev_type.as_deref() == Some("5") {
            return None; // SCSI CD/DVD
        }
        let bus = bus_of(&real_s);
        let removable = self.read(format!("{base}/removable")).as_deref() == Some("1")
            || matches!(bus, Some("usb") | Some("mmc"));
        if removable && !opts.include_removable {
            return None;
        }
        let sector = |f: &str| {
            self.read(format!("{base}/queue/{f}"))
                .and_then(|s| s.parse::<u32>().ok())
                .unwrap_or(512)
        };
        let attr = |f: &str| self.read(format!("{base}/{f}")).and_then(non_empty);
        let serial_number = attr("device/serial")
            .or_else(|| attr("serial"))
            .or_else(|| {
                fs::read(self.p(&format!("{base}/device/vpd_pg80")))
                    .ok()
                    .and_then(|v| vpd_pg80_serial(&v))
            });
        let wwn = attr("wwid")
            .or_else(|| attr("device/wwid"))
            .and_then(|w| normalize_wwn(&w));
        // the SCSI device (H:C:T:L) the block device hangs off
        let scsi_device = fs::canonicalize(self.p(&format!("{base}/device")))
            .ok()
            .filter(|p| p.file_name().is_some_and(|n| is_hctl(&n.to_string_lossy())));
        let hctl = if matches!(bus, Some("scsi") | Some("ata") | Some("usb")) {
            scsi_device
                .as_ref()
                .and_then(|p| p.file_name().map(|n| n.to_string_lossy().to_string()))
        } else {
            None
        };
        let pcie_path = if nvme_head {
            self.nvme_subsystem_pci(&base)
        } else {
            nearest_pci(&real)
        };
        let slot_number = slots.of(scsi_device.as_deref(), pcie_path.as_deref());
        let partitions = self.partitions(name, &base, opts);
        Some(Disk {
            device_name: name.to_string(),
            size_bytes,
            logical_sector_size: sector("logical_block_size"),
            physical_sector_size: sector("physical_block_size"),
            rotational: self.read(format!("{base}/queue/rotational")).as_deref() == Some("1"),
            removable,
            model: attr("device/model"),
            // virtio's `vendor` is the PCI vendor id (0x1af4), not a name.
            vendor: attr("device/vendor").filter(|v| !v.starts_with("0x")),
            serial_number,
            wwn,
            hctl,
            pcie_path,
            slot_number,
            bus: bus.map(str::to_string),
            partitions,
        })
    }

    /// The PCI address of the first controller of a multipath NVMe head
    /// (the subsystem links its controllers as `nvmeN`).
    fn nvme_subsystem_pci(&self, base: &str) -> Option<String> {
        let mut ctrls: Vec<PathBuf> = fs::read_dir(self.p(&format!("{base}/device")))
            .ok()?
            .flatten()
            .filter(|e| {
                let n = e.file_name().to_string_lossy().to_string();
                n.strip_prefix("nvme")
                    .is_some_and(|r| !r.is_empty() && r.bytes().all(|b| b.is_ascii_digit()))
            })
            .map(|e| e.path())
            .collect();
        ctrls.sort();
        ctrls
            .iter()
            .find_map(|c| fs::canonicalize(c).ok().and_then(|p| nearest_pci(&p)))
    }

    fn partitions(&self, disk: &str, base: &str, opts: Options) -> Vec<Partition> {
        let Ok(entries) = fs::read_dir(self.p(base)) else {
            return Vec::new();
        };
        let mut out = Vec::new();
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().to_string();
            if !name.starts_with(disk) {
                continue;
            }
            let pbase = format!("{base}/{name}");
            let Some(number) = self
                .read(format!("{pbase}/partition"))
                .and_then(|s| s.parse::<u32>().ok())
            else {
                continue;
            };
            let size_bytes = self
                .read(format!("{pbase}/size"))
                .and_then(|s| s.parse::<u64>().ok())
                .unwrap_or(0)
                * 512;
            let mut part = Partition {
                name: name.clone(),
                number,
                size_bytes,
                ..Partition::default()
            };
            if opts.probe_filesystems
                && let Ok(f) = fs::File::open(self.p(&format!("dev/{name}")))
                && let Ok(region) = anneal_image::fs::FileRegion::whole(&f)
                && let Ok(Some(fs)) = anneal_image::fs::identify(&region)
            {
                part.fs_type = Some(fs.fs_type.to_string());
                part.uuid = fs.uuid;
                part.label = fs.label;
            }
            out.push(part);
        }
        out.sort_by_key(|p| p.number);
        out
    }
}

fn non_empty(s: String) -> Option<String> {
    let t = s.trim();
    if t.is_empty() {
        None
    } else {
        Some(t.to_string())
    }
}

fn dmi_value(s: String) -> Option<String> {
    let t = s.trim();
    const PLACEHOLDERS: [&str; 6] = [
        "",
        "Not Specified",
        "To be filled by O.E.M.",
        "Default string",
        "System Serial Number",
        "None",
    ];
    if PLACEHOLDERS.contains(&t) {
        None
    } else {
        Some(t.to_string())
    }
}

/// Counts a CPU list like `0-3,8,10-11`.
pub fn count_cpu_list(s: &str) -> u32 {
    s.trim()
        .split(',')
        .filter(|p| !p.is_empty())
        .map(|p| match p.split_once('-') {
            Some((a, b)) => match (a.parse::<u32>(), b.parse::<u32>()) {
                (Ok(a), Ok(b)) if b >= a => b - a + 1,
                _ => 0,
            },
            None => u32::from(p.parse::<u32>().is_ok()),
        })
        .sum()
}

/// The size of one SMBIOS type 17 (Memory Device) structure, in bytes.
pub fn dmi_memory_device_bytes(raw: &[u8]) -> u64 {
    if raw.first() != Some(&17) || raw.len() < 0x0E {
        return 0;
    }
    let size = u16::from_le_bytes([raw[0x0C], raw[0x0D]]);
    match size {
        0 | 0xFFFF => 0,
        0x7FFF => raw
            .get(0x1C..0x20)
            .map(|b| u64::from(u32::from_le_bytes([b[0], b[1], b[2], b[3]]) & 0x7FFF_FFFF))
            .map(|mib| mib << 20)
            .unwrap_or(0),
        s if s & 0x8000 != 0 => u64::from(s & 0x7FFF) << 10,
        s => u64::from(s) << 20,
    }
}

fn is_pci_address(s: &str) -> bool {
    // dddd:bb:dd.f
    let b = s.as_bytes();
    b.len() == 12
        && b[4] == b':'
        && b[7] == b':'
        && b[10] == b'.'
        && s.chars()
            .enumerate()
            .all(|(i, c)| matches!(i, 4 | 7 | 10) || c.is_ascii_hexdigit())
}

/// The last PCI address on a resolved sysfs device path (the controller).
pub fn nearest_pci(path: &Path) -> Option<String> {
    path.components()
        .filter_map(|c| c.as_os_str().to_str())
        .rfind(|c| is_pci_address(c))
        .map(str::to_string)
}

fn is_hctl(s: &str) -> bool {
    let parts: Vec<&str> = s.split(':').collect();
    parts.len() == 4
        && parts
            .iter()
            .all(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))
}

fn bus_of(real: &str) -> Option<&'static str> {
    if real.contains("/usb") {
        Some("usb")
    } else if real.contains("/mmc_host/") || real.contains("/mmc") {
        Some("mmc")
    } else if real.contains("/nvme/") || real.contains("/nvme-subsystem/") {
        Some("nvme")
    } else if real.contains("/virtio") && !real.contains("/target") {
        Some("virtio")
    } else if real.contains("/ata") {
        Some("ata")
    } else if real.contains("/target") {
        Some("scsi")
    } else {
        None
    }
}

/// The serial from a SCSI VPD page 0x80 (Unit Serial Number).
pub fn vpd_pg80_serial(v: &[u8]) -> Option<String> {
    if v.len() < 4 || v[1] != 0x80 {
        return None;
    }
    let len = usize::from(u16::from_be_bytes([v[2], v[3]]));
    let body = v.get(4..4 + len.min(v.len() - 4))?;
    non_empty(String::from_utf8_lossy(body).to_string())
}

/// Reports a kernel `wwid` the way udev's `ID_WWN` does for NAA (`0x…`);
/// EUI-64/NGUID and NVMe forms are kept as the kernel prints them; T10
/// vendor IDs (not world-wide names) are dropped.
pub fn normalize_wwn(w: &str) -> Option<String> {
    let w = w.trim();
    if let Some(naa) = w.strip_prefix("naa.") {
        return Some(format!("0x{}", naa.to_ascii_lowercase()));
    }
    if w.starts_with("t10.") || w.is_empty() {
        return None;
    }
    Some(w.to_string())
}

/// `0x41` → 0x41.
fn parse_hex(v: &str) -> Option<u32> {
    u32::from_str_radix(v.trim().trim_start_matches("0x"), 16).ok()
}

/// An arm64 CPU's name from its MIDR implementer and part numbers (as
/// `/proc/cpuinfo` gives them): the common server and board cores by name,
/// any other by its numbers.
fn arm_cpu_model(implementer: u32, part: u32) -> String {
    let name = match (implementer, part) {
        (0x41, 0xd03) => Some("ARM Cortex-A53"),
        (0x41, 0xd07) => Some("ARM Cortex-A57"),
        (0x41, 0xd08) => Some("ARM Cortex-A72"),
        (0x41, 0xd0b) => Some("ARM Cortex-A76"),
        (0x41, 0xd0c) => Some("ARM Neoverse-N1"),
        (0x41, 0xd40) => Some("ARM Neoverse-V1"),
        (0x41, 0xd49) => Some("ARM Neoverse-N2"),
        (0x41, 0xd4f) => Some("ARM Neoverse-V2"),
        (0x43, 0x0af) => Some("Cavium ThunderX2"),
        (0x46, 0x001) => Some("Fujitsu A64FX"),
        (0x48, 0xd01) => Some("HiSilicon TaiShan v110"),
        (0xc0, 0xac3) => Some("Ampere-1"),
        (0xc0, 0xac4) => Some("Ampere-1a"),
        _ => None,
    };
    name.map_or_else(
        || format!("arm64 implementer {implementer:#04x} part {part:#05x}"),
        str::to_string,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_arm64_cpu_is_named_from_its_midr() {
        // /proc/cpuinfo of a Cortex-A72 (two CPUs), as arm64 kernels print it
        let root = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(root.path().join("proc")).unwrap();
        let one = "processor\t: {n}\nBogoMIPS\t: 125.00\nFeatures\t: fp asimd evtstrm crc32 cpuid\n\
                   CPU implementer\t: 0x41\nCPU architecture: 8\nCPU variant\t: 0x0\n\
                   CPU part\t: 0xd08\nCPU revision\t: 3\n\n";
        let info = one.replace("{n}", "0") + &one.replace("{n}", "1");
        std::fs::write(root.path().join("proc/cpuinfo"), info).unwrap();
        let cpu = Root::new(root.path()).cpu();
        assert_eq!(cpu.count, 2);
        assert_eq!(cpu.model.as_deref(), Some("ARM Cortex-A72"));
        assert_eq!(arm_cpu_model(0x41, 0xd0c), "ARM Neoverse-N1");
        assert_eq!(
            arm_cpu_model(0x99, 0x123),
            "arm64 implementer 0x99 part 0x123"
        );
        // x86's model name wins over anything else
        std::fs::write(
            root.path().join("proc/cpuinfo"),
            "processor\t: 0\nmodel name\t: QEMU Virtual CPU version 2.5+\n",
        )
        .unwrap();
        let cpu = Root::new(root.path()).cpu();
        assert_eq!(cpu.model.as_deref(), Some("QEMU Virtual CPU version 2.5+"));
    }

    #[test]
    fn cpu_lists() {
        assert_eq!(count_cpu_list("0-3,8,10-11\n"), 7);
        assert_eq!(count_cpu_list("0"), 1);
        assert_eq!(count_cpu_list("3-1,x"), 0);
    }

    #[test]
    fn dmi_memory_sizes() {
        let mut raw = vec![0u8; 0x28];
        raw[0] = 17;
        raw[0x0C..0x0E].copy_from_slice(&1024u16.to_le_bytes());
        assert_eq!(dmi_memory_device_bytes(&raw), 1 << 30);
        raw[0x0C..0x0E].copy_from_slice(&0x7FFFu16.to_le_bytes());
        raw[0x1C..0x20].copy_from_slice(&65536u32.to_le_bytes());
        assert_eq!(dmi_memory_device_bytes(&raw), 64 << 30);
        raw[0x0C..0x0E].copy_from_slice(&(0x8000u16 | 512).to_le_bytes());
        assert_eq!(dmi_memory_device_bytes(&raw), 512 << 10);
        assert_eq!(dmi_memory_device_bytes(&raw[..4]), 0);
    }

    #[test]
    fn pci_paths_and_wwns() {
        let p = Path::new("/sys/devices/pci0000:00/0000:00:1c.0/0000:03:00.0/nvme/nvme0/nvme0n1");
        assert_eq!(nearest_pci(p).as_deref(), Some("0000:03:00.0"));
        assert_eq!(
            nearest_pci(Path::new("/sys/devices/virtual/block/loop0")),
            None
        );
        assert_eq!(
            normalize_wwn("naa.5000C500A1B2C3D4").as_deref(),
            Some("0x5000c500a1b2c3d4")
        );
        assert_eq!(normalize_wwn("t10.ATA     QEMU HARDDISK"), None);
        assert_eq!(
            normalize_wwn("eui.0025388b71b04ec1").as_deref(),
            Some("eui.0025388b71b04ec1")
        );
        let mut pg80 = vec![0, 0x80, 0, 8];
        pg80.extend_from_slice(b"  S3Z9NB");
        assert_eq!(vpd_pg80_serial(&pg80).as_deref(), Some("S3Z9NB"));
        assert_eq!(vpd_pg80_serial(&[0, 0x80, 0xff, 0xff]), None);
    }
}
