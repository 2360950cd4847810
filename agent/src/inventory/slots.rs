//! Physical slot numbers of disks: the SES enclosure slot a SCSI disk sits
//! in, else the numbered PCIe slot of the disk's PCI device.

use std::fs;
use std::path::{Path, PathBuf};

/// The slots of one root, read once per inventory.
#[derive(Debug, Default)]
pub(super) struct Slots {
    /// Enclosure components with a device: (resolved SCSI device, slot).
    enclosure: Vec<(PathBuf, u32)>,
    /// Numbered PCI slots: (lower-case `dddd:bb:dd`, slot number).
    pci: Vec<(String, u32)>,
}

impl Slots {
    /// Reads `<root>/sys/class/enclosure` and `<root>/sys/bus/pci/slots`;
    /// missing directories mean no slots of that kind.
    pub(super) fn read(root: &Path) -> Self {
        Self {
            enclosure: enclosure_slots(&root.join("sys/class/enclosure")),
            pci: pci_slots(&root.join("sys/bus/pci/slots")),
        }
    }

    /// The slot of a disk: the enclosure component whose `device` is the
    /// disk's resolved SCSI device, else the PCI slot whose address is the
    /// domain:bus:device of the disk's PCI device (`dddd:bb:dd.f`).
    pub(super) fn of(&self, scsi_device: Option<&Path>, pci: Option<&str>) -> Option<u32> {
        if let Some(dev) = scsi_device
            && let Some((_, slot)) = self.enclosure.iter().find(|(d, _)| d == dev)
        {
            return Some(*slot);
        }
        let (dbd, _function) = pci?.rsplit_once('.')?;
        let dbd = dbd.to_ascii_lowercase();
        self.pci.iter().find(|(a, _)| *a == dbd).map(|(_, s)| *s)
    }
}

/// `<enclosure>/<component>/{slot,device}` of every enclosure, sorted by
/// enclosure and component name. Components are real directories (the
/// enclosure's own `device` and `subsystem` are links, `power` has no
/// `slot`); an empty bay has no `device`.
fn enclosure_slots(class: &Path) -> Vec<(PathBuf, u32)> {
    let mut out = Vec::new();
    for enclosure in sorted_entries(class) {
        for component in sorted_entries(&enclosure) {
            if !fs::symlink_metadata(&component).is_ok_and(|m| m.is_dir()) {
                continue;
            }
            let Some(slot) = read_trimmed(&component.join("slot")).and_then(|s| number(&s)) else {
                continue;
            };
            if let Ok(dev) = fs::canonicalize(component.join("device")) {
                out.push((dev, slot));
            }
        }
    }
    out
}

/// `<slot>/address` of every slot whose name is a number, sorted by name.
/// The kernel writes `dddd:bb:dd`, or `dddd:bb` for a slot with no device
/// number, which no device matches.
fn pci_slots(dir: &Path) -> Vec<(String, u32)> {
    sorted_entries(dir)
        .into_iter()
        .filter_map(|slot| {
            let n = number(&slot.file_name()?.to_string_lossy())?;
            let address = read_trimmed(&slot.join("address"))?;
            Some((address.to_ascii_lowercase(), n))
        })
        .collect()
}

fn sorted_entries(dir: &Path) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = fs::read_dir(dir)
        .map(|entries| entries.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    out.sort();
    out
}

fn read_trimmed(path: &Path) -> Option<String> {
    fs::read_to_string(path).ok().map(|s| s.trim().to_string())
}

/// A non-negative decimal number that fits the API's `int32`: `12`, not
/// `-1`, `+3`, `12-1` or `CPU1 SLOT6`.
fn number(s: &str) -> Option<u32> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse::<u32>().ok().filter(|&n| i32::try_from(n).is_ok())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    fn w(root: &Path, rel: &str, content: &str) {
        let p = root.join(rel);
        fs::create_dir_all(p.parent().unwrap()).unwrap();
        fs::write(p, content).unwrap();
    }

    fn l(root: &Path, rel: &str, target: &str) {
        let p = root.join(rel);
        fs::create_dir_all(p.parent().unwrap()).unwrap();
        symlink(target, p).unwrap();
    }

    #[test]
    fn slot_names_are_numbers() {
        assert_eq!(number("12"), Some(12));
        assert_eq!(number("0"), Some(0));
        assert_eq!(number("007"), Some(7));
        for bad in [
            "",
            "-1",
            "+3",
            "12-1",
            "CPU1 SLOT6",
            "4294967295",
            "2147483648",
        ] {
            assert_eq!(number(bad), None, "{bad}");
        }
    }

    #[test]
    fn enclosure_first_then_numbered_pci_slots() {
        let t = tempfile::tempdir().unwrap();
        let r = t.path();
        let hba = "sys/devices/pci0000:00/0000:00:1c.4/0000:05:00.0";
        let disk = format!("{hba}/host7/target7:0:1/7:0:1:0");
        let other = format!("{hba}/host7/target7:0:3/7:0:3:0");
        w(r, &format!("{disk}/type"), "0\n");
        w(r, &format!("{other}/type"), "0\n");
        let enc = format!("{hba}/host7/target7:0:2/7:0:2:0/enclosure/7:0:2:0");
        w(r, &format!("{enc}/components"), "12\n");
        l(r, &format!("{enc}/device"), "../..");
        w(r, &format!("{enc}/power/control"), "auto\n");
        w(r, &format!("{enc}/Slot07/slot"), "7\n");
        l(
            r,
            &format!("{enc}/Slot07/device"),
            "../../../../../target7:0:1/7:0:1:0",
        );
        w(r, &format!("{enc}/Slot08/slot"), "8\n"); // an empty bay
        l(
            r,
            "sys/class/enclosure/7:0:2:0",
            &format!("../../{}", enc.trim_start_matches("sys/")),
        );
        w(r, "sys/bus/pci/slots/3/address", "0000:05:00\n");
        w(r, "sys/bus/pci/slots/12/address", "0000:3B:00\n");
        w(r, "sys/bus/pci/slots/CPU1 SLOT6/address", "0000:5e:00\n");
        w(r, "sys/bus/pci/slots/9/address", "0000:6f\n");

        let slots = Slots::read(r);
        let real = |p: &str| fs::canonicalize(r.join(p)).unwrap();
        // the enclosure slot wins over the HBA's PCI slot
        assert_eq!(slots.of(Some(&real(&disk)), Some("0000:05:00.0")), Some(7));
        // a disk on the same HBA in no bay: the HBA's slot
        assert_eq!(slots.of(Some(&real(&other)), Some("0000:05:00.0")), Some(3));
        // NVMe: the controller's slot, whatever its function; hex case
        assert_eq!(slots.of(None, Some("0000:3b:00.1")), Some(12));
        // a slot named by no number, a slot with no device number, no slot
        assert_eq!(slots.of(None, Some("0000:5e:00.0")), None);
        assert_eq!(slots.of(None, Some("0000:6f:00.0")), None);
        assert_eq!(slots.of(None, Some("0000:00:17.0")), None);
        assert_eq!(slots.of(None, None), None);
        assert_eq!(
            Slots::read(&r.join("nowhere")).of(None, Some("0000:3b:00.0")),
            None
        );
    }
}
