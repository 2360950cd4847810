//! Content index parser, piece mapping and re-serialisation.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    check(data);
    // with a valid digest trailer, so the field checks behind it are reached
    check(&anneal_image::format::reseal(data.to_vec()));
});

fn check(data: &[u8]) {
    if let Ok(idx) = anneal_image::ContentIndex::parse(data) {
        // accepted input round-trips exactly
        let again = idx.build().expect("valid index builds");
        assert_eq!(again, data);
        let mut total = 0u64;
        for ranges in idx.piece_map() {
            for r in ranges {
                assert!(r.disk_offset + r.len <= idx.header.partition_size);
                total += r.len;
            }
        }
        assert_eq!(total, idx.header.used_bytes);
    }
}
