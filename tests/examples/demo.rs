//! The QEMU demo (`bash qemu/demo.sh`): a Machine is enrolled, the manager
//! powers its VM on through the QEMU BMC with a one-time PXE override, the
//! VM network-boots through bootd (PXE → iPXE → HTTP script → kernel and
//! initramfs) and the agent inspects it. The serial console is shown as it
//! grows, `kubectl get machines` at each state change, and the
//! MachineHardware summary at the end. Same set-up as the e2e_inspect test
//! (`anneal_tests::e2e`, `tests/src/e2e.rs`).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use anneal_tests::e2e;

use std::io::Write;
use std::time::Duration;

use e2e::{Lab, MAC, MACHINE, Progress};

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let say = |s: &str| println!("\x1b[1manneal demo:\x1b[0m {s}");
    let mut lab = Lab::start(&say).await?;
    lab.launch_vm().await?;
    say(&format!(
        "VM launched powered off (QEMU pid {}, MAC {MAC}, BMC {})",
        lab.vm.as_ref().map_or(0, |v| v.pid()),
        lab.bmc_address()
    ));
    lab.enrol().await?;
    say(&format!(
        "Machine default/{MACHINE} enrolled; the serial console follows\n"
    ));
    let kubectl = |lab: &Lab| lab.kubectl_get_machines().unwrap_or_else(|e| e.to_string());
    let mut out = std::io::stdout();
    let elapsed = lab
        .wait_available(Duration::from_secs(300), &mut |p| match p {
            Progress::Console(text) => {
                let _ = out.write_all(text.as_bytes());
                let _ = out.flush();
            }
            Progress::State("", _) => {}
            Progress::State(state, t) => {
                println!(
                    "\n\x1b[1m--- {MACHINE} is {state} ({:.1} s after QEMU's launch) ---\x1b[0m\n{}",
                    t.as_secs_f64(),
                    kubectl(&lab)
                );
            }
        })
        .await?;
    // An unclaimed Available machine is shut down: the agent's long-poll
    // answers poweroff and the manager powers off through the BMC.
    let mut shown = lab.console().len();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while std::time::Instant::now() < deadline {
        let console = lab.console();
        if console.len() > shown {
            print!("{}", &console[shown..]);
            std::io::stdout().flush()?;
            shown = console.len();
        }
        if lab.powered_on().await? == Some(false) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    println!();
    say(&format!(
        "Machine Available {:.1} s after QEMU's launch, then powered off",
        elapsed.as_secs_f64()
    ));
    print!("{}", kubectl(&lab));
    if let Some((init, net, _)) = e2e::registration_times(&lab.console()) {
        say(&format!(
            "agent: /init → registration {init:.1} s ({net:.1} s after the DHCP lease)"
        ));
    }
    if let Some(hw) = lab.hardware().await? {
        say("MachineHardware:");
        print!("{}", e2e::summary(&hw));
    }
    say(&format!(
        "logs in {} (lab.log: manager and bootd); cleaning up",
        lab.dir.display()
    ));
    Ok(())
}
