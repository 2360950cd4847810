//! The agent's HTTP/1.1 response parser and the DHCP reply parser: never
//! panic on hostile bytes.
#![no_main]

use anneal_agent::client::parse_response;
use anneal_agent::cmdline::Mac;
use anneal_agent::net::dhcp::parse_reply;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = parse_response(data);
    let _ = parse_reply(data, 0x1234_5678, Mac([0x52, 0x54, 0, 0x12, 0x34, 0x56]));
});
