//! Reads the live variables out of an OVMF VARS file (the firmware volume
//! holding the authenticated variable store) after a VM ran: a test checks
//! the boot entries the agent wrote through efivarfs as the firmware kept
//! them, not as the guest saw them.

/// `EFI_GLOBAL_VARIABLE` (Boot####, BootOrder).
pub const GLOBAL: [u8; 16] = [
    0x61, 0xdf, 0xe4, 0x8b, 0xca, 0x93, 0xd2, 0x11, 0xaa, 0x0d, 0x00, 0xe0, 0x98, 0x03, 0x2b, 0x8c,
];
const START_ID: u16 = 0x55aa;
const HEADER: usize = 60;

/// One live variable.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Var {
    /// Its name.
    pub name: String,
    /// Vendor GUID as stored.
    pub guid: [u8; 16],
    /// Attributes.
    pub attributes: u32,
    /// The value.
    pub data: Vec<u8>,
}

fn u16_at(b: &[u8], o: usize) -> Option<u16> {
    Some(u16::from_le_bytes(b.get(o..o + 2)?.try_into().ok()?))
}

fn u32_at(b: &[u8], o: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(o..o + 4)?.try_into().ok()?))
}

fn ucs2(b: &[u8]) -> String {
    let units: Vec<u16> = b
        .chunks_exact(2)
        .map(|c| u16::from_le_bytes([c[0], c[1]]))
        .take_while(|&u| u != 0)
        .collect();
    String::from_utf16_lossy(&units)
}

/// The live (added, not deleted) variables of an OVMF VARS image.
pub fn variables(fd: &[u8]) -> anyhow::Result<Vec<Var>> {
    anyhow::ensure!(fd.get(40..44) == Some(b"_FVH"), "not a firmware volume");
    let fv_header = usize::from(u16_at(fd, 0x30).unwrap_or(0));
    let store = fv_header;
    let size = u32_at(fd, store + 16).unwrap_or(0) as usize;
    let end = (store + size).min(fd.len());
    let mut o = store + 28;
    let mut out = Vec::new();
    while o + HEADER <= end {
        if u16_at(fd, o) != Some(START_ID) {
            break;
        }
        let state = fd[o + 2];
        let attributes = u32_at(fd, o + 4).unwrap_or(0);
        let name_size = u32_at(fd, o + 36).unwrap_or(0) as usize;
        let data_size = u32_at(fd, o + 40).unwrap_or(0) as usize;
        let mut guid = [0u8; 16];
        guid.copy_from_slice(&fd[o + 44..o + 60]);
        let name_at = o + HEADER;
        let data_at = name_at + name_size;
        anyhow::ensure!(
            data_at + data_size <= end,
            "variable at {o:#x} overruns the store"
        );
        if state == 0x3f || state == 0x3e {
            out.push(Var {
                name: ucs2(&fd[name_at..data_at]),
                guid,
                attributes,
                data: fd[data_at..data_at + data_size].to_vec(),
            });
        }
        o = (data_at + data_size + 3) & !3;
    }
    Ok(out)
}

/// A decoded `Boot####` load option: its number, description and the
/// file path node's path (`\EFI\BOOT\BOOTX64.EFI`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BootEntry {
    /// `####`.
    pub number: u16,
    /// The description.
    pub description: String,
    /// The media file path node, when there is one.
    pub file: Option<String>,
    /// The partition GUID of the hard drive node, when there is one
    /// (mixed-endian bytes as stored).
    pub part_guid: Option<[u8; 16]>,
}

/// The boot entries and the BootOrder of a VARS image.
pub fn boot_entries(fd: &[u8]) -> anyhow::Result<(Vec<BootEntry>, Vec<u16>)> {
    let vars = variables(fd)?;
    let mut entries = Vec::new();
    let mut order = Vec::new();
    for v in vars.iter().filter(|v| v.guid == GLOBAL) {
        if v.name == "BootOrder" {
            order = v
                .data
                .chunks_exact(2)
                .map(|c| u16::from_le_bytes([c[0], c[1]]))
                .collect();
        } else if let Some(hex) = v.name.strip_prefix("Boot")
            && hex.len() == 4
            && let Ok(number) = u16::from_str_radix(hex, 16)
        {
            let d = &v.data;
            let fpl = usize::from(u16_at(d, 4).unwrap_or(0));
            let mut i = 6;
            while i + 1 < d.len() && (d[i] != 0 || d[i + 1] != 0) {
                i += 2;
            }
            let description = ucs2(&d[6..i]);
            let mut p = i + 2;
            let stop = (p + fpl).min(d.len());
            let mut file = None;
            let mut part_guid = None;
            while p + 4 <= stop {
                let (t, st) = (d[p], d[p + 1]);
                let len = usize::from(u16_at(d, p + 2).unwrap_or(0));
                if len < 4 || p + len > stop {
                    break;
                }
                match (t, st) {
                    (4, 1) if len >= 42 => {
                        let mut g = [0u8; 16];
                        g.copy_from_slice(&d[p + 24..p + 40]);
                        part_guid = Some(g);
                    }
                    (4, 4) => file = Some(ucs2(&d[p + 4..p + len])),
                    (0x7f, 0xff) => break,
                    _ => {}
                }
                p += len;
            }
            entries.push(BootEntry {
                number,
                description,
                file,
                part_guid,
            });
        }
    }
    entries.sort_by_key(|e| e.number);
    Ok((entries, order))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn var(state: u8, name: &str, data: &[u8]) -> Vec<u8> {
        let name: Vec<u8> = name
            .encode_utf16()
            .chain([0])
            .flat_map(u16::to_le_bytes)
            .collect();
        let mut v = Vec::new();
        v.extend(START_ID.to_le_bytes());
        v.extend([state, 0]);
        v.extend(7u32.to_le_bytes());
        v.extend([0u8; 8 + 16 + 4]);
        v.extend(u32::try_from(name.len()).unwrap_or(0).to_le_bytes());
        v.extend(u32::try_from(data.len()).unwrap_or(0).to_le_bytes());
        v.extend(GLOBAL);
        v.extend(name);
        v.extend(data);
        while v.len() % 4 != 0 {
            v.push(0xff);
        }
        v
    }

    fn load_option(desc: &str, file: &str) -> Vec<u8> {
        let mut path = Vec::new();
        // HD(1,GPT,…): type 4 subtype 1, 42 bytes.
        path.extend([4u8, 1, 42, 0]);
        path.extend(1u32.to_le_bytes());
        path.extend(2048u64.to_le_bytes());
        path.extend(131_072u64.to_le_bytes());
        path.extend([0xab; 16]);
        path.extend([2u8, 2]);
        let f: Vec<u8> = file
            .encode_utf16()
            .chain([0])
            .flat_map(u16::to_le_bytes)
            .collect();
        path.extend([4u8, 4]);
        path.extend(u16::try_from(f.len() + 4).unwrap_or(0).to_le_bytes());
        path.extend(f);
        path.extend([0x7f, 0xff, 4, 0]);
        let mut o = Vec::new();
        o.extend(1u32.to_le_bytes());
        o.extend(u16::try_from(path.len()).unwrap_or(0).to_le_bytes());
        o.extend(desc.encode_utf16().chain([0]).flat_map(u16::to_le_bytes));
        o.extend(path);
        o
    }

    #[test]
    #[allow(clippy::unwrap_used)]
    fn live_variables_and_boot_entries_are_read_deleted_ones_skipped() {
        let mut fd = vec![0u8; 0x48];
        fd[40..44].copy_from_slice(b"_FVH");
        fd[0x30..0x32].copy_from_slice(&0x48u16.to_le_bytes());
        let mut store = vec![0u8; 28];
        store.extend(var(
            0x3c,
            "Boot0001",
            &load_option("anneal old", r"\EFI\BOOT\BOOTX64.EFI"),
        ));
        store.extend(var(
            0x3f,
            "Boot0002",
            &load_option("anneal m1", r"\EFI\BOOT\BOOTX64.EFI"),
        ));
        store.extend(var(0x3f, "BootOrder", &[2, 0, 0, 0]));
        store.extend([0xff; 64]);
        let size = u32::try_from(store.len()).unwrap();
        store[16..20].copy_from_slice(&size.to_le_bytes());
        fd.extend(store);
        let vars = variables(&fd).unwrap();
        assert_eq!(vars.len(), 2, "the deleted Boot0001 is skipped");
        let (entries, order) = boot_entries(&fd).unwrap();
        assert_eq!(order, [2, 0]);
        assert_eq!(entries.len(), 1);
        assert_eq!(entries[0].number, 2);
        assert_eq!(entries[0].description, "anneal m1");
        assert_eq!(entries[0].file.as_deref(), Some(r"\EFI\BOOT\BOOTX64.EFI"));
        assert_eq!(entries[0].part_guid, Some([0xab; 16]));
        assert!(variables(&[0u8; 16]).is_err());
    }
}
