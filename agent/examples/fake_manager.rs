//! The agent-protocol test server as a program, for VM tests that run it
//! inside a network namespace:
//! `fake_manager LISTEN_ADDR TOKEN NAMESPACE/NAME OUT_DIR [poweroff|reboot|wait]`.
//! Writes OUT_DIR/ca.sha256 at start, then hardware.json and events.log.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "../tests/support/fake_manager.rs"]
mod fake_manager;

use anneal_api::agent::NextAction;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [listen, token, machine, out, rest @ ..] = args.as_slice() else {
        panic!(
            "usage: fake_manager LISTEN_ADDR TOKEN NAMESPACE/NAME OUT_DIR [poweroff|reboot|wait]"
        );
    };
    let (ns, name) = machine.split_once('/').expect("NAMESPACE/NAME");
    let next = match rest.first().map(String::as_str) {
        Some("reboot") => vec![NextAction::Reboot],
        Some("wait") => vec![],
        _ => vec![NextAction::PowerOff],
    };
    let listener = std::net::TcpListener::bind(listen).unwrap();
    let ip = listener.local_addr().unwrap().ip().to_string();
    let _server = fake_manager::start(
        listener,
        fake_manager::Config {
            boot_token: token.clone(),
            next,
            send_ca: true,
            sans: vec![ip],
            machine: (ns.to_string(), name.to_string()),
            out_dir: Some(out.into()),
        },
    );
    loop {
        std::thread::sleep(std::time::Duration::from_secs(3600));
    }
}
