//! The tracker's announce parser: never panics on any query string, and an
//! accepted announce has 20-byte ids and a non-zero port.
#![no_main]

use anneal_agent::tracker::parse_announce;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(q) = std::str::from_utf8(data)
        && let Ok(a) = parse_announce(q)
    {
        assert_ne!(a.port, 0);
    }
});
