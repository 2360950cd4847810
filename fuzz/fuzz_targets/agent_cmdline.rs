//! The kernel command line parser: never panics, and a parsed boot token
//! never appears in the redacted view or in an error message.
#![no_main]

use anneal_agent::cmdline::BootParams;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    match BootParams::parse(data) {
        Ok(p) => {
            let view = p.redacted_json().to_string();
            if let Some(t) = &p.token {
                assert!(!view.contains(t.expose()));
            }
            let _ = p.registration();
        }
        Err(e) => {
            let _ = e.to_string();
        }
    }
});
