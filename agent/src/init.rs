//! PID 1 of the live environment.
//!
//! PID 1 mounts the pseudo filesystems, then runs the agent proper as a child
//! process (the *worker*, the same binary) and reaps every process for the
//! rest of the boot: orphans of scripts and shells are collected, and the
//! worker's own children stay waitable by the worker. PID 1 never exits: if
//! the worker dies it prints why, opens a debug shell (`anneal.debug=shell`)
//! or reboots after a delay.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anneal_api::agent::{
    AfterDeploy, HardwareReport, NextAction, Outcome, RegisterRequest, ResultRequest,
};
use anneal_api::error_chain;
use nix::mount::{MsFlags, mount};
use nix::sys::reboot::{RebootMode, reboot};
use nix::sys::wait::{WaitStatus, waitpid};
use nix::unistd::Pid;

use crate::client::{AgentClient, Backoff, ClientError};
use crate::cmdline::{BootParams, DebugMode};
use crate::inventory::{self, Root};
use crate::modules::{self, ModuleIndex};
use crate::net;
use crate::say;

/// Environment variable carrying the uptime (ms) at which `/init` started.
pub const INIT_START_ENV: &str = "ANNEAL_INIT_START_MS";
/// Seconds before rebooting after a failure without a debug shell.
pub const REBOOT_DELAY: Duration = Duration::from_secs(30);

fn try_mount(src: &str, target: &str, fstype: &str, flags: MsFlags, data: Option<&str>) {
    let _ = fs::create_dir_all(target);
    if let Err(e) = mount(Some(src), target, Some(fstype), flags, data) {
        // EBUSY: already mounted (e.g. devtmpfs automount).
        if e != nix::errno::Errno::EBUSY {
            say!("warning: mounting {fstype} on {target} failed: {e}");
        }
    }
}

/// Mounts proc, sys, devtmpfs, devpts and a tmpfs /run and /tmp.
pub fn mount_basics() {
    let nosuid = MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC;
    try_mount("proc", "/proc", "proc", nosuid, None);
    try_mount("sysfs", "/sys", "sysfs", nosuid, None);
    try_mount(
        "devtmpfs",
        "/dev",
        "devtmpfs",
        MsFlags::MS_NOSUID,
        Some("mode=0755"),
    );
    try_mount(
        "devpts",
        "/dev/pts",
        "devpts",
        MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC,
        Some("gid=5,mode=0620,ptmxmode=0666"),
    );
    // The boot token arrives in the initramfs at /run/anneal/token (bootd's
    // second initrd, docs/api.md "Boot parameters"); the tmpfs mounted over
    // /run would hide it, so it is carried across in memory (never printed).
    let token = take_token_file();
    try_mount(
        "tmpfs",
        "/run",
        "tmpfs",
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
        Some("mode=0755"),
    );
    if let Some(t) = token {
        restore_token_file(t);
    }
    try_mount(
        "tmpfs",
        "/tmp",
        "tmpfs",
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
        Some("mode=1777"),
    );
    say!("mounted proc, sys, devtmpfs, devpts, /run and /tmp");
}

/// Reads and removes the token file of the initramfs (rootfs), if any.
fn take_token_file() -> Option<zeroize::Zeroizing<Vec<u8>>> {
    let path = Path::new(crate::cmdline::TOKEN_FILE);
    let bytes = zeroize::Zeroizing::new(fs::read(path).ok()?);
    let _ = fs::remove_file(path);
    Some(bytes)
}

/// Writes the token file again, mode 0600 in a 0700 directory, on /run.
fn restore_token_file(token: zeroize::Zeroizing<Vec<u8>>) {
    use std::io::Write;
    use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
    let path = Path::new(crate::cmdline::TOKEN_FILE);
    if let Some(dir) = path.parent() {
        let _ = fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir);
    }
    let written = fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .and_then(|mut f| f.write_all(&token));
    if let Err(e) = written {
        say!("warning: the boot token file could not be kept on /run: {e}");
    }
}

fn read_cmdline() -> Vec<u8> {
    fs::read("/proc/cmdline").unwrap_or_default()
}

/// The PID-1 loop. Never returns.
pub fn pid1() -> ! {
    let start = crate::console::uptime();
    say!(
        "anneal-agent {} starting as PID 1",
        env!("CARGO_PKG_VERSION")
    );
    mount_basics();
    let debug = BootParams::parse(&read_cmdline())
        .map(|p| p.debug)
        .unwrap_or(DebugMode::Off);
    let exe = std::env::current_exe().unwrap_or_else(|_| PathBuf::from("/init"));
    loop {
        let child = Command::new(&exe)
            .arg("init-worker")
            .env(INIT_START_ENV, start.as_millis().to_string())
            .env("PATH", "/bin:/sbin:/usr/bin:/usr/sbin")
            .spawn();
        let worker = match child {
            Ok(c) => Pid::from_raw(c.id() as i32),
            Err(e) => {
                say!("FAILED: cannot start the agent worker: {e}");
                after_failure(debug);
                continue;
            }
        };
        // Reap everything; stop when the worker itself is gone.
        loop {
            match waitpid(None, None) {
                Ok(WaitStatus::Exited(pid, code)) if pid == worker => {
                    say!("agent worker exited with status {code}");
                    break;
                }
                Ok(WaitStatus::Signaled(pid, sig, _)) if pid == worker => {
                    say!("agent worker killed by {sig:?}");
                    break;
                }
                Ok(_) => {}
                Err(nix::errno::Errno::ECHILD) => break,
                Err(_) => std::thread::sleep(Duration::from_millis(100)),
            }
        }
        after_failure(debug);
    }
}

/// Shell (debug) or delayed reboot.
fn after_failure(debug: DebugMode) {
    if debug == DebugMode::Shell {
        run_shell();
        say!("debug shell exited; rebooting");
        reboot_now(RebootMode::RB_AUTOBOOT);
    } else {
        say!(
            "rebooting in {} s (boot with anneal.debug=shell to get a shell instead)",
            REBOOT_DELAY.as_secs()
        );
        std::thread::sleep(REBOOT_DELAY);
        reboot_now(RebootMode::RB_AUTOBOOT);
    }
}

/// A shell on the console, with a controlling terminal when busybox is there.
pub fn run_shell() {
    let busybox = Path::new("/bin/busybox");
    let mut cmd = if busybox.exists() {
        let mut c = Command::new(busybox);
        c.args(["setsid", "-c", "/bin/sh", "-l"]);
        c
    } else if Path::new("/bin/sh").exists() {
        Command::new("/bin/sh")
    } else {
        say!("no shell in this initramfs (build it with --busybox)");
        std::thread::sleep(REBOOT_DELAY);
        return;
    };
    say!("starting a debug shell on the console; exit it to reboot");
    match cmd.env("PS1", "anneal# ").spawn() {
        Ok(mut c) => {
            let _ = c.wait();
        }
        Err(e) => say!("cannot start the shell: {e}"),
    }
}

fn reboot_now(mode: RebootMode) {
    nix::unistd::sync();
    if std::process::id() == 1 || is_worker() {
        let _ = reboot(mode);
    }
    // Not PID 1 (tests) or reboot refused: park.
    loop {
        std::thread::sleep(Duration::from_secs(3600));
    }
}

fn is_worker() -> bool {
    std::env::var_os(INIT_START_ENV).is_some()
}

/// The one console line for a failed step: what failed, why, what to check.
pub fn failure_line(step: &str, err: &dyn std::error::Error, check: &str) -> String {
    format!("FAILED: {step}: {}; check: {check}", error_chain(err))
}

/// A failure of one step: what failed and what to check, on one line.
fn fail(step: &str, err: &dyn std::error::Error, check: &str) -> ! {
    stop(&failure_line(step, err, check))
}

/// Prints the one failure line and ends the worker: PID 1 then decides
/// between a shell and a delayed reboot. Nothing is retried after it.
fn stop(line: &str) -> ! {
    crate::console::say(line);
    std::process::exit(1)
}

/// The one console line a failed registration stops with. A rejected boot
/// token (HTTP 401) is named as such: retrying cannot help, only a fresh
/// token (bootd's script after the Machine is re-armed) can.
pub fn registration_failure(e: &ClientError) -> String {
    let step = match e {
        ClientError::Status { status: 401, .. } => "registration: boot token rejected",
        _ => "registration",
    };
    failure_line(step, e, &registration_hint(e))
}

fn modules_dir() -> Option<PathBuf> {
    let release = nix::sys::utsname::uname()
        .ok()
        .map(|u| u.release().to_string_lossy().to_string());
    if let Some(r) = release {
        let p = PathBuf::from("/lib/modules").join(r);
        if p.join("modules.dep").exists() {
            return Some(p);
        }
    }
    fs::read_dir("/lib/modules")
        .ok()?
        .flatten()
        .map(|e| e.path())
        .find(|p| p.join("modules.dep").exists())
}

fn load_drivers() {
    let Some(dir) = modules_dir() else {
        say!("no /lib/modules/<release>/modules.dep: using built-in drivers only");
        return;
    };
    let index = match ModuleIndex::load(&dir) {
        Ok(i) => i,
        Err(e) => {
            say!("warning: module index unreadable: {}", error_chain(&e));
            return;
        }
    };
    let extra: Vec<String> = fs::read_to_string("/etc/anneal/modules.load")
        .unwrap_or_default()
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(str::to_string)
        .collect();
    let started = Instant::now();
    let result =
        modules::coldplug(
            &index,
            &dir,
            Path::new("/sys/devices"),
            &extra,
            |m, err| match err {
                None => say!("driver loaded: {m}"),
                Some(e) => say!("driver {m} failed to load: {}", error_chain(e)),
            },
        );
    say!(
        "{} drivers loaded in {:.1} s ({} failed)",
        result.loaded.len(),
        started.elapsed().as_secs_f64(),
        result.failed.len()
    );
}

fn mount_efivarfs() {
    let target = "/sys/firmware/efi/efivars";
    if Path::new("/sys/firmware/efi").is_dir() {
        match mount(
            Some("efivarfs"),
            target,
            Some("efivarfs"),
            MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
            None::<&str>,
        ) {
            Ok(()) => say!("mounted efivarfs (UEFI boot)"),
            Err(nix::errno::Errno::EBUSY) => {}
            Err(e) => say!("warning: mounting efivarfs failed: {e}"),
        }
    } else {
        say!("legacy BIOS boot (no /sys/firmware/efi)");
    }
}

/// Waits until the set of block devices stops changing (drivers probe
/// asynchronously), at most `max`.
fn settle_block_devices(max: Duration) {
    let list = || -> Vec<String> {
        let mut v: Vec<String> = fs::read_dir("/sys/block")
            .map(|d| {
                d.flatten()
                    .map(|e| e.file_name().to_string_lossy().to_string())
                    .collect()
            })
            .unwrap_or_default();
        v.sort();
        v
    };
    let start = Instant::now();
    let mut last = list();
    let mut stable_since = Instant::now();
    while start.elapsed() < max {
        std::thread::sleep(Duration::from_millis(100));
        let now = list();
        if now != last {
            last = now;
            stable_since = Instant::now();
        } else if stable_since.elapsed() >= Duration::from_millis(700) {
            break;
        }
    }
}

fn since_init() -> Option<Duration> {
    let ms: u64 = std::env::var(INIT_START_ENV).ok()?.parse().ok()?;
    Some(crate::console::uptime().saturating_sub(Duration::from_millis(ms)))
}

fn human_bytes(b: u64) -> String {
    const G: f64 = (1u64 << 30) as f64;
    if b >= 1 << 30 {
        format!("{:.1} GiB", b as f64 / G)
    } else {
        format!("{} MiB", b >> 20)
    }
}

/// The agent proper, as a child of PID 1. Never returns: it reboots, powers
/// off, or exits with a failure line for PID 1 to handle.
pub fn worker() -> ! {
    let params = match BootParams::parse(&read_cmdline()) {
        Ok(p) => p,
        Err(e) => fail(
            "kernel command line",
            &e,
            "the boot parameters bootd's iPXE script wrote",
        ),
    };
    for k in &params.unknown {
        say!("warning: unknown boot parameter {k} ignored");
    }
    load_drivers();
    mount_efivarfs();
    settle_block_devices(Duration::from_secs(5));

    let mut params = params;
    match crate::cmdline::read_token_file(Path::new(crate::cmdline::TOKEN_FILE)) {
        // bootd's token file wins over a lab's `anneal.token=`
        Ok(Some(t)) => params.token = Some(t),
        Ok(None) => {}
        Err(e) => fail(
            "boot token file",
            &e,
            "the token cpio bootd's iPXE script adds as the second initrd",
        ),
    }
    let reg = match params.registration() {
        Ok(r) => r,
        Err(e) => fail(
            "boot parameters",
            &e,
            "that the machine was booted by bootd (anneal.api, anneal.ca and anneal.token)",
        ),
    };
    // an agent API at an IPv6 address: the boot network is IPv6 (DHCPv6)
    let family = match reg.api.host {
        crate::cmdline::Host::Ipv6(_) => net::Family::V6,
        _ => net::Family::V4,
    };
    // listening from before the boot network comes up: a switch sends a
    // frame when a link comes up (docs/api.md, MachineHardware)
    let lldp_wait = params.lldp.map_or(inventory::lldp::DEFAULT_WAIT, |s| {
        Duration::from_secs(u64::from(s))
    });
    let lldp = (!lldp_wait.is_zero()).then(|| {
        let links = inventory::lldp::links(Path::new("/sys/class/net"));
        let (l, errors) = inventory::lldp::Listener::start(&links, lldp_wait);
        for e in errors {
            say!("warning: {}", error_chain(&e));
        }
        l
    });
    let netcfg = match net::bring_up(params.bootif, params.ip, family, net::Timeouts::default()) {
        Ok(c) => c,
        Err(e) => fail(
            "network",
            &e,
            "the NIC's driver, cabling, and that a DHCP server answers this MAC",
        ),
    };
    let lease_at = netcfg.at;
    let mut client = match AgentClient::new(reg.api.clone(), reg.ca) {
        Ok(c) => c,
        Err(e) => fail("TLS set-up", &e, "this agent build"),
    };
    say!(
        "registering with {} (CA pinned to sha256 {}…)",
        reg.api,
        &reg.ca.to_hex()[..16]
    );
    let request = RegisterRequest {
        boot_token: reg.token.clone(),
        boot_mac: netcfg.iface.mac.to_string(),
        agent_version: env!("CARGO_PKG_VERSION").to_string(),
        machine: params.machine.as_ref().map(ToString::to_string),
    };
    let resp = retry("registration", Duration::from_secs(300), || {
        client.register(&request)
    });
    let resp = match resp {
        Ok(r) => r,
        Err(e) => stop(&registration_failure(&e)),
    };
    let _ = MACHINE.set(format!("{}/{}", resp.machine.namespace, resp.machine.name));
    say!(
        "registered as {}/{} ({:.1} s after /init, {:.1} s after the network was up)",
        resp.machine.namespace,
        resp.machine.name,
        since_init().unwrap_or_default().as_secs_f64(),
        lease_at.elapsed().as_secs_f64()
    );

    let mut hw = match Root::new("/").collect(inventory::Options {
        include_removable: false,
        probe_filesystems: true,
    }) {
        Ok(h) => h,
        Err(e) => fail("inventory", &e, "that /sys is mounted"),
    };
    if let Some(l) = lldp {
        inventory::lldp::annotate(&mut hw.nics, &l.finish());
    }
    say_inventory(&hw);
    if let Err(e) = retry("hardware report", Duration::from_secs(300), || {
        client.put_hardware(&hw)
    }) {
        fail(
            "hardware report",
            &e,
            "the manager's logs for the rejected field",
        );
    }
    say!("hardware sent");
    say!("waiting for the next action");
    serve_actions(&client)
}

/// Prints the inventory on the console: totals, then one line per disk
/// and per NIC.
fn say_inventory(hw: &HardwareReport) {
    say!(
        "inventory: {} CPUs, {} memory, {} firmware{}, {} disks, {} NICs",
        hw.cpu.count,
        human_bytes(hw.memory_bytes),
        match hw.firmware.mode {
            anneal_api::agent::FirmwareMode::Uefi => "UEFI",
            anneal_api::agent::FirmwareMode::Bios => "BIOS",
        },
        if hw.firmware.secure_boot {
            " (Secure Boot)"
        } else {
            ""
        },
        hw.disks.len(),
        hw.nics.len()
    );
    for d in &hw.disks {
        say!(
            "disk {}: {} {} serial={} model={}",
            d.device_name,
            human_bytes(d.size_bytes),
            d.bus.as_deref().unwrap_or("?"),
            d.serial_number.as_deref().unwrap_or("-"),
            d.model.as_deref().unwrap_or("-")
        );
    }
    for n in &hw.nics {
        say!(
            "nic {}: {} driver={} link={} lldp={}",
            n.name,
            n.mac,
            n.driver.as_deref().unwrap_or("-"),
            if n.link { "up" } else { "down" },
            n.lldp.as_ref().map_or("-".to_string(), |l| format!(
                "{} port {}",
                l.system_name.as_deref().unwrap_or(&l.chassis_id),
                l.port_id
            ))
        );
    }
}

/// Runs the manager's next actions, one after the other, forever.
fn serve_actions(client: &AgentClient) -> ! {
    let mut backoff = Backoff::new(Duration::from_secs(1), Duration::from_secs(30));
    loop {
        match client.next(Duration::from_secs(60)) {
            Ok(action) => {
                backoff = Backoff::new(Duration::from_secs(1), Duration::from_secs(30));
                handle(client, action);
            }
            Err(e) if e.is_permanent() => fail(
                "waiting for the next action",
                &e,
                "the Machine's state in the manager (session expired or revoked)",
            ),
            Err(e) => {
                let d = backoff.next_delay();
                say!(
                    "next: {}; retrying in {:.1} s",
                    error_chain(&e),
                    d.as_secs_f64()
                );
                std::thread::sleep(d);
            }
        }
    }
}

/// The Machine this agent registered as (`namespace/name`).
static MACHINE: std::sync::OnceLock<String> = std::sync::OnceLock::new();

fn handle(client: &AgentClient, action: NextAction) {
    match action {
        NextAction::Wait {
            retry_after_seconds,
        } => {
            std::thread::sleep(Duration::from_secs(u64::from(
                retry_after_seconds.clamp(1, 300),
            )));
        }
        NextAction::Reboot => {
            say!("rebooting (asked by the manager)");
            reboot_now(RebootMode::RB_AUTOBOOT);
        }
        NextAction::PowerOff => {
            say!("powering off (asked by the manager)");
            reboot_now(RebootMode::RB_POWER_OFF);
        }
        NextAction::Wipe { id, disks } => {
            let mut failures = Vec::new();
            for d in &disks {
                say!("wiping {d}");
                match crate::deploy::wipe(std::path::Path::new(d)) {
                    Ok(r) => say!("wiped {d}: {r:?}"),
                    Err(e) => {
                        say!("wiping {d} failed: {}", error_chain(&e));
                        failures.push(format!("{d}: {}", error_chain(&e)));
                    }
                }
            }
            nix::unistd::sync();
            let outcome = if failures.is_empty() {
                Outcome::Succeeded
            } else {
                Outcome::Failed {
                    reason: failures.join("; "),
                    phase: Some("Wiping".into()),
                }
            };
            let res = client.result(&ResultRequest {
                run_id: id,
                outcome,
            });
            if let Err(e) = res {
                say!("reporting the wipe result failed: {}", error_chain(&e));
            }
        }
        NextAction::Shell => {
            run_shell();
        }
        NextAction::Deploy { plan } => {
            let machine = MACHINE.get().cloned().unwrap_or_default();
            let mut hooks = crate::posthook::runner(&plan.architecture, &machine, &plan);
            match crate::deploy::agent::run(client, &plan, &mut hooks) {
                Ok(()) if plan.after_deploy == AfterDeploy::PowerOff => {
                    say!("deploy done; powering off");
                    reboot_now(RebootMode::RB_POWER_OFF);
                }
                Ok(()) => {
                    say!("deploy done; rebooting into the deployed OS");
                    reboot_now(RebootMode::RB_AUTOBOOT);
                }
                // PID 1 then opens the debug shell (anneal.debug=shell) or
                // reboots after its delay
                Err(line) => stop(&line),
            }
        }
    }
}

/// What to check after a failed registration.
pub fn registration_hint(e: &ClientError) -> String {
    use anneal_api::agent::ErrorCode;
    match e {
        ClientError::CaMismatch { .. } => {
            "anneal.ca against the manager's CA: the SHA-256 of the CA certificate in DER form, not of its PEM text (ConfigMap anneal-agent-api-ca, key ca.crt), and that the manager sends the CA in its chain".into()
        }
        ClientError::Status { code: Some(ErrorCode::UsedToken), .. } => {
            "the boot token was already used: re-arm the Machine's net boot for a fresh token".into()
        }
        ClientError::Status { code: Some(ErrorCode::ExpiredToken), .. } => {
            "the boot token expired: re-arm the Machine's net boot (or raise spec.bootTimeout)".into()
        }
        ClientError::Status { status: 401, .. } => {
            "the Machine must be armed for net boot and anneal.token must be its current token; a boot token is single use, so a reused one is refused too: re-arm the Machine's net boot for a fresh one".into()
        }
        ClientError::Status { status: 426, .. } => {
            "the agent and manager versions (Anneal-Agent-Schema differs)".into()
        }
        _ => "that anneal.api is reachable from this network and the manager is running".into(),
    }
}

/// Retries transient failures with backoff until `budget` is spent; stops at
/// once on a permanent one.
fn retry<T>(
    what: &str,
    budget: Duration,
    mut f: impl FnMut() -> Result<T, ClientError>,
) -> Result<T, ClientError> {
    let start = Instant::now();
    let mut backoff = Backoff::new(Duration::from_secs(1), Duration::from_secs(30));
    let mut attempt = 1u32;
    loop {
        match f() {
            Ok(v) => return Ok(v),
            Err(e) if e.is_permanent() => return Err(e),
            Err(e) => {
                let d = backoff.next_delay();
                if start.elapsed() + d > budget {
                    return Err(e);
                }
                say!(
                    "{what} attempt {attempt} failed: {}; retrying in {:.1} s",
                    error_chain(&e),
                    d.as_secs_f64()
                );
                std::thread::sleep(d);
                attempt += 1;
            }
        }
    }
}

/// True when this process is the initramfs's init: PID 1 started as
/// `/init` (what the kernel runs; then it is init whatever its arguments).
/// PID 1 under another name is the agent as a container's only process
/// (`/anneal-agent <subcommand>`, the manager's workloads): not init.
pub fn is_pid1() -> bool {
    std::process::id() == 1 && is_init_name(std::env::args_os().next().as_deref())
}

/// Whether `argv0` names the initramfs's init (`/init`, or `init`).
fn is_init_name(argv0: Option<&std::ffi::OsStr>) -> bool {
    argv0
        .map(std::path::Path::new)
        .and_then(std::path::Path::file_name)
        .is_some_and(|n| n == "init")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_init_by_name_is_the_initramfs_init() {
        use std::ffi::OsStr;
        assert!(is_init_name(Some(OsStr::new("/init"))));
        assert!(is_init_name(Some(OsStr::new("init"))));
        // a container's only process: PID 1, not init
        assert!(!is_init_name(Some(OsStr::new("/anneal-agent"))));
        assert!(!is_init_name(Some(OsStr::new("/usr/sbin/initx"))));
        assert!(!is_init_name(None));
    }
}
