//! Runs post-install builtins on a disk and prints the boot variables after:
//! the in-VM half of agent/tests/posthook_vm.rs (real efivarfs on OVMF).
//!
//! `posthook_run <disk> <machine> <efivars dir> <builtin>...`
//! prints the step log, then `BOOTORDER <hex,...>` and one
//! `BOOTVAR <num> <description>\t<device path>` line per Boot#### variable,
//! then `POSTHOOK-RUN-DONE` (or `POSTHOOK-RUN-FAILED <reason>`).

use anneal_agent::posthook::{self, Context, efi};
use anneal_api::agent::PlannedStep;
use std::path::PathBuf;

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [disk, machine, efivars, builtins @ ..] = args.as_slice() else {
        anyhow::bail!("usage: posthook_run <disk> <machine> <efivars dir> <builtin>...");
    };
    let mut f = std::fs::File::open(disk)?;
    let layout = anneal_image::layout::read_layout(&mut f)?;
    let mut ctx = Context::new(PathBuf::from(disk), layout, "x86_64", machine);
    ctx.efivars = PathBuf::from(efivars);
    let steps: Vec<PlannedStep> = builtins
        .iter()
        .map(|b| PlannedStep {
            hook: "vm".into(),
            step: b.clone(),
            builtin: Some(b.clone()),
            script: None,
            timeout_seconds: 60,
            params: Default::default(),
        })
        .collect();
    match posthook::run_steps(&ctx, &steps, &mut |l| println!("{l}")) {
        Ok(()) => {}
        Err(e) => {
            println!("POSTHOOK-RUN-FAILED {}", e.reason());
            return Ok(());
        }
    }
    let store = efi::VarStore::open(&ctx.efivars)?;
    let order = match store.read(&efi::boot_order_name())? {
        Some((_, d)) => efi::decode_boot_order(&d)?,
        None => Vec::new(),
    };
    let order: Vec<String> = order.iter().map(|n| format!("{n:04X}")).collect();
    println!("BOOTORDER {}", order.join(","));
    for n in store.boot_entries()? {
        if let Some((_, d)) = store.read(&efi::boot_var_name(n))? {
            let o = efi::decode(&d)?;
            let path =
                efi::device_path_text(&o.file_path_list).unwrap_or_else(|e| format!("<{e}>"));
            println!("BOOTVAR {n:04X} {}\t{path}", o.description);
        }
    }
    println!("POSTHOOK-RUN-DONE");
    Ok(())
}
