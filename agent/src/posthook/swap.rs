//! `mkswap`: a swap header on every swap slot, with the slot's saved UUID (so
//! an fstab naming it by UUID keeps working) and label.

use super::Context;
use anneal_image::layout::Role;
use std::io;
use std::os::unix::fs::FileExt as _;
use std::path::PathBuf;

/// Errors of `mkswap`.
#[derive(Debug, thiserror::Error)]
pub enum SwapError {
    /// The target could not be opened or written.
    #[error("cannot write the swap header of slot {slot} on {disk}")]
    Io {
        /// slot number
        slot: u32,
        /// target
        disk: PathBuf,
        /// cause
        #[source]
        source: io::Error,
    },
    /// The saved UUID is not 16 hex bytes.
    #[error(
        "slot {slot}: saved swap UUID {uuid:?} is not a UUID (fix the Image's layout slot uuid)"
    )]
    BadUuid {
        /// slot number
        slot: u32,
        /// the value
        uuid: String,
    },
    /// A swap slot smaller than two pages.
    #[error("slot {slot}: {size} bytes is too small for swap (at least 8192)")]
    TooSmall {
        /// slot number
        slot: u32,
        /// size in bytes
        size: u64,
    },
}

/// Parses a UUID string (`0d5f…-…`) into its 16 bytes, in string order (the
/// byte order of the swap header and of ext4's superblock).
pub fn uuid_bytes(s: &str) -> Option<[u8; 16]> {
    let h: String = s.chars().filter(|c| *c != '-').collect();
    let v = hex::decode(h).ok()?;
    v.try_into().ok()
}

/// Writes the swap headers; a layout without swap slots is a no-op.
pub fn run(ctx: &Context, log: &mut dyn FnMut(&str)) -> Result<(), SwapError> {
    let slots: Vec<_> = ctx
        .layout
        .slots
        .iter()
        .filter(|s| s.role == Role::Swap)
        .collect();
    if slots.is_empty() {
        log("mkswap: no swap slot in the layout, nothing to do");
        return Ok(());
    }
    let disk = super::open_rw(&ctx.os_disk).map_err(|source| SwapError::Io {
        slot: slots[0].number,
        disk: ctx.os_disk.clone(),
        source,
    })?;
    for s in slots {
        if s.size_bytes < 8192 {
            return Err(SwapError::TooSmall {
                slot: s.number,
                size: s.size_bytes,
            });
        }
        let uuid = match &s.uuid {
            Some(u) => uuid_bytes(u).ok_or_else(|| SwapError::BadUuid {
                slot: s.number,
                uuid: u.clone(),
            })?,
            None => {
                let mut u: [u8; 16] = rand::random();
                u[6] = (u[6] & 0x0f) | 0x40; // version 4
                u[8] = (u[8] & 0x3f) | 0x80; // variant 1
                u
            }
        };
        let label = s.label.as_deref().unwrap_or("");
        let page = anneal_image::fs::swap_header(s.size_bytes, &uuid, label);
        let io_err = |source| SwapError::Io {
            slot: s.number,
            disk: ctx.os_disk.clone(),
            source,
        };
        disk.write_all_at(&page, s.start_bytes).map_err(io_err)?;
        log(&format!(
            "mkswap: slot {} ({} bytes) uuid {}",
            s.number,
            s.size_bytes,
            format_uuid(&uuid)
        ));
    }
    disk.sync_all().map_err(|source| SwapError::Io {
        slot: 0,
        disk: ctx.os_disk.clone(),
        source,
    })
}

/// `xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx` of 16 bytes in string order.
pub fn format_uuid(u: &[u8; 16]) -> String {
    let h = hex::encode(u);
    format!(
        "{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuid_round_trip() {
        let s = "0d5f5a4e-3c1b-4c2a-9e1f-112233445566";
        let b = uuid_bytes(s).unwrap();
        assert_eq!(b[0], 0x0d);
        assert_eq!(format_uuid(&b), s);
        assert!(uuid_bytes("nope").is_none());
        assert!(uuid_bytes("0d5f5a4e").is_none());
    }
}
