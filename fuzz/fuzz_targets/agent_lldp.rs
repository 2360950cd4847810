//! The LLDP frame parser: never panics, and what it renders stays within
//! the bounds of the frame it came from.
#![no_main]

use anneal_agent::net::lldp;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    match lldp::parse(data) {
        Ok(n) => {
            // an ID is at most 255 bytes, rendered as hex at most 3 chars a byte
            assert!(n.chassis_id.len() <= 255 * 3);
            assert!(n.port_id.len() <= 255 * 3);
            // a text TLV is at most 511 bytes; each byte becomes at most
            // one replacement character (3 bytes of UTF-8)
            for t in [&n.port_description, &n.system_name].into_iter().flatten() {
                assert!(t.len() <= 511 * 3);
            }
        }
        Err(e) => {
            let _ = e.to_string();
        }
    }
});
