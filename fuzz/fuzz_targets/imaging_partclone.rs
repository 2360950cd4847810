//! partclone 0002 reader: header, bitmap, checksummed blocks; and the
//! used-block detectors over the same bytes as a partition.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok((h, extents, blocks)) = anneal_image::partclone::read_all(data) {
        // whatever is accepted is self-consistent
        assert_eq!(blocks.len() as u64, h.used_blocks * u64::from(h.block_size));
        let mut prev = 0u64;
        for e in &extents {
            assert!(e.len > 0 && e.offset >= prev && e.end() <= h.device_size);
            prev = e.end();
        }
    }
    let part = data.to_vec();
    let info = anneal_image::fs::probe(&part);
    let _ = anneal_image::fs::used_extents(&part, &info);
});
