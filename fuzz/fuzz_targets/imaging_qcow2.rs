//! qcow2 reader: header, extensions, L1/L2 tables, compressed clusters,
//! over arbitrary bytes as an in-memory image. Whatever is accepted tiles
//! the virtual disk in order, and the conversion writes only inside it.
#![no_main]

use anneal_image::qcow2::{self, Image, WriteAt};
use libfuzzer_sys::fuzz_target;

/// Checks every write lies inside the virtual disk; keeps nothing.
struct Bounded(u64);

impl WriteAt for Bounded {
    fn write_all_at(&mut self, buf: &[u8], offset: u64) -> std::io::Result<()> {
        assert!(!buf.is_empty());
        assert!(offset + buf.len() as u64 <= self.0);
        Ok(())
    }
}

fuzz_target!(|data: &[u8]| {
    let Ok(img) = Image::open(data) else {
        return;
    };
    let size = img.virtual_size();
    assert!(size > 0 && size <= qcow2::MAX_VIRTUAL_SIZE);
    let mut next = 0u64;
    let r = img.for_each_extent(data, |e| {
        assert_eq!(e.guest, next);
        assert!(e.len > 0);
        next += e.len;
        Ok(())
    });
    if r.is_ok() {
        assert_eq!(next, size);
    }
    // Converting reads every allocated cluster: only small disks, so that a
    // run stays fast (a few KiB of input can describe terabytes).
    if size <= 64 << 20 {
        let _ = qcow2::convert(data, &mut Bounded(size));
    }
});
