//! The bencode reader and the metainfo reader: never panic; whatever the
//! strict reader accepts re-encodes to the same bytes (it takes canonical
//! bencoding only), and an accepted metainfo re-encodes to a metainfo with
//! the same fields.
#![no_main]

use anneal_image::torrent::{Metainfo, decode};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(v) = decode(data) {
        assert_eq!(v.encode(), data);
    }
    if let Ok(m) = Metainfo::parse(data) {
        assert_eq!(Metainfo::parse(&m.to_bytes()).ok(), Some(m));
    }
});
