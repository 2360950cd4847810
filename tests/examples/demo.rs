//! The QEMU demo (`bash qemu/demo.sh`): the whole job, shown to an operator.
//!
//! 1. The test OS image (`anneal_tests::testos`, docs/testos.md) is built (or
//!    taken from the cache), served over HTTP on host loopback and imported
//!    through an ImageImport, followed to Succeeded with its progress; its
//!    PartitionContents and Image are shown Ready.
//! 2. A Machine is enrolled; the manager powers its VM on through the QEMU
//!    BMC with a one-time PXE override, the VM network-boots through bootd
//!    (PXE → iPXE → HTTP script → kernel and initramfs), the agent inspects
//!    it and the Machine becomes Available, then is powered off.
//! 3. A MachineClaim binds it to the Image: the manager plans a DeployRun and
//!    powers the VM on; the agent streams the contents onto the disk, runs
//!    the default post-install steps (mkswap, removable fallback, efibootmgr)
//!    and reboots; OVMF boots the entry the agent wrote and the test OS
//!    prints its marker lines (highlighted). A live progress line (phase,
//!    percent, MiB/s from the DeployRun's status) runs meanwhile.
//! 4. The summary: `kubectl get deployruns`, the run's phase timings, the
//!    UEFI boot entry in the VM's VARS store, and the time from the claim's
//!    power-on to the deployed OS's marker.
//!
//! The serial console is shown as it grows and `kubectl get machines` at each
//! state change. `--inspect-only` stops after step 2 (the short demo). Same
//! set-up as the e2e_inspect and e2e_deploy tests (`anneal_tests::e2e`,
//! `tests/src/e2e.rs`).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{IsTerminal, Write};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anneal_api::RunPhase;
use anneal_tests::bmc::now_ms;
use anneal_tests::e2e::{self, Lab, LabOptions, MAC, MACHINE};
use anneal_tests::images::{FileServer, sha256_file};
use anyhow::Context as _;

const USAGE: &str = "usage: bash qemu/demo.sh [--inspect-only]

  (no flag)       the whole job: build and import the test OS image, enrol a
                  VM, inspect it, claim it, deploy it and boot the deployed OS
                  (~5 min under TCG on 2 cores once built)
  --inspect-only  enrol and inspect only: the VM ends Available, powered off
  -h, --help      this text";

/// The Image (and ImageImport, content prefix) the demo deploys.
const IMAGE: &str = "testos";
/// The MachineClaim.
const CLAIM: &str = "demo";
/// How often a progress line is printed when stdout is not a terminal.
const PLAIN_EVERY: Duration = Duration::from_secs(5);
/// A console line held back this long (a prompt, a line being drawn) is
/// printed as it is.
const HOLD: Duration = Duration::from_secs(1);
/// The live line is cut to this many characters so that it never wraps.
const LIVE_WIDTH: usize = 79;

struct Opts {
    inspect_only: bool,
}

/// `None`: help was asked for and printed.
fn parse_args() -> anyhow::Result<Option<Opts>> {
    let mut opts = Opts {
        inspect_only: false,
    };
    for a in std::env::args().skip(1) {
        match a.as_str() {
            "--inspect-only" => opts.inspect_only = true,
            "-h" | "--help" => {
                println!("{USAGE}");
                return Ok(None);
            }
            other => anyhow::bail!("unknown argument {other:?}\n{USAGE}"),
        }
    }
    Ok(Some(opts))
}

/// What is on the operator's screen: the serial console (whole lines,
/// the deployed OS's marker lines highlighted), `anneal demo:` lines, blocks
/// (kubectl) and the progress line.
struct Screen {
    tty: bool,
    st: Mutex<ScreenState>,
}

struct ScreenState {
    /// Console text not printed yet (an incomplete line) and since when.
    held: String,
    held_since: Instant,
    /// A partial console line was printed: the cursor is not at column 0.
    mid_line: bool,
    /// The live line is drawn (terminal only).
    live_drawn: bool,
    /// The last plain progress line's key (phase) and when it was printed.
    last_plain: Option<(String, Instant)>,
}

impl ScreenState {
    fn out(s: &str) {
        let mut o = std::io::stdout().lock();
        let _ = o.write_all(s.as_bytes());
        let _ = o.flush();
    }

    fn erase_live(&mut self) {
        if self.live_drawn {
            Self::out("\r\x1b[K");
            self.live_drawn = false;
        }
    }

    /// Puts the cursor at column 0 of a fresh line.
    fn break_line(&mut self) {
        self.erase_live();
        if self.mid_line {
            Self::out("\n");
            self.mid_line = false;
        }
    }
}

impl Screen {
    fn new() -> Self {
        Self {
            tty: std::io::stdout().is_terminal(),
            st: Mutex::new(ScreenState {
                held: String::new(),
                held_since: Instant::now(),
                mid_line: false,
                live_drawn: false,
                last_plain: None,
            }),
        }
    }

    fn st(&self) -> std::sync::MutexGuard<'_, ScreenState> {
        self.st
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn bold(&self, s: &str) -> String {
        if self.tty {
            format!("\x1b[1m{s}\x1b[0m")
        } else {
            s.to_string()
        }
    }

    /// An `anneal demo:` line.
    fn say(&self, s: &str) {
        let line = format!("{} {s}\n", self.bold("anneal demo:"));
        let mut st = self.st();
        st.break_line();
        ScreenState::out(&line);
    }

    /// A block of lines (kubectl output, a summary).
    fn block(&self, text: &str) {
        let mut st = self.st();
        st.break_line();
        ScreenState::out(text);
        if !text.ends_with('\n') {
            ScreenState::out("\n");
        }
    }

    /// New console text: whole lines are printed at once, an incomplete one
    /// is held back (see [`Screen::flush_held`]).
    fn console(&self, text: &str) {
        let mut st = self.st();
        if st.held.is_empty() {
            st.held_since = Instant::now();
        }
        st.held.push_str(text);
        let Some(end) = st.held.rfind('\n') else {
            return;
        };
        let lines: String = st.held.drain(..=end).collect();
        st.held_since = Instant::now();
        st.erase_live();
        let mut buf = String::with_capacity(lines.len());
        for line in lines.split_inclusive('\n') {
            if !st.mid_line && line.contains("ANNEAL-") {
                let line = line.trim_end_matches(['\r', '\n']);
                if self.tty {
                    buf.push_str(&format!("\x1b[1;32m{line}\x1b[0m\n"));
                } else {
                    buf.push_str(&format!(">>> {line}\n"));
                }
            } else {
                buf.push_str(line);
            }
            st.mid_line = false;
        }
        ScreenState::out(&buf);
    }

    /// Prints a held incomplete console line once it is [`HOLD`] old.
    fn flush_held(&self) {
        let mut st = self.st();
        if !st.held.is_empty() && st.held_since.elapsed() >= HOLD {
            st.erase_live();
            let text = std::mem::take(&mut st.held);
            ScreenState::out(&text);
            st.mid_line = true;
        }
    }

    /// The progress line. On a terminal it is rewritten in place, and only
    /// drawn while the console is at the start of a line; otherwise it is
    /// printed as a line of its own when `key` changes or every
    /// [`PLAIN_EVERY`].
    fn progress(&self, key: &str, line: &str) {
        let mut st = self.st();
        if self.tty {
            if st.mid_line {
                return;
            }
            let cut: String = line.chars().take(LIVE_WIDTH).collect();
            ScreenState::out(&format!("\r\x1b[K\x1b[7m{cut}\x1b[0m"));
            st.live_drawn = true;
        } else {
            let due = st
                .last_plain
                .as_ref()
                .is_none_or(|(k, t)| k != key || t.elapsed() >= PLAIN_EVERY);
            if due {
                st.break_line();
                ScreenState::out(&format!("anneal demo: {line}\n"));
                st.last_plain = Some((key.to_string(), Instant::now()));
            }
        }
    }

    /// Ends a run of progress lines (erases the live line).
    fn end_progress(&self) {
        let mut st = self.st();
        st.erase_live();
        st.last_plain = None;
    }
}

/// Follows the console and the Machine's state: what has been shown.
struct Follow {
    shown: usize,
    state: String,
}

impl Follow {
    fn new() -> Self {
        Self {
            shown: 0,
            state: String::from("?"),
        }
    }

    /// Shows new console text and, on a state change, the state and
    /// `kubectl get machines`. Returns the state.
    async fn pump(&mut self, lab: &Lab, sc: &Screen) -> String {
        let console = lab.console();
        let mut from = self.shown.min(console.len());
        while !console.is_char_boundary(from) {
            from += 1;
        }
        if console.len() > from {
            sc.console(&console[from..]);
        }
        self.shown = console.len();
        sc.flush_held();
        let state = lab.state().await.unwrap_or_default();
        if state != self.state && !state.is_empty() {
            let kubectl = lab.kubectl_get_machines().unwrap_or_else(|e| e.to_string());
            sc.block(&format!(
                "\n{}\n{kubectl}",
                sc.bold(&format!(
                    "--- {MACHINE} is {state} ({:.1} s after QEMU's launch) ---",
                    lab.since_launch().as_secs_f64()
                ))
            ));
        }
        self.state = state.clone();
        state
    }
}

fn mib(bytes: i64) -> f64 {
    bytes as f64 / f64::from(1 << 20)
}

/// A partition GUID as stored in a device path (mixed-endian) in its usual
/// spelling.
fn guid(b: &[u8; 16]) -> String {
    format!(
        "{:02x}{:02x}{:02x}{:02x}-{:02x}{:02x}-{:02x}{:02x}-{:02x}{:02x}-{}",
        b[3],
        b[2],
        b[1],
        b[0],
        b[5],
        b[4],
        b[7],
        b[6],
        b[8],
        b[9],
        b[10..]
            .iter()
            .map(|x| format!("{x:02x}"))
            .collect::<String>()
    )
}

type OsBuild = tokio::task::JoinHandle<anyhow::Result<anneal_tests::testos::TestOs>>;

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let Some(opts) = parse_args()? else {
        return Ok(());
    };
    let sc = Screen::new();
    let say = |s: &str| sc.say(s);

    // The test OS builds (or comes from the cache) while the lab starts.
    let os_build =
        (!opts.inspect_only).then(|| tokio::task::spawn_blocking(anneal_tests::testos::test_os));
    let mut lab = Lab::start_with(
        &say,
        LabOptions {
            deploy: !opts.inspect_only,
            ..LabOptions::default()
        },
    )
    .await?;
    let result = demo(&mut lab, &sc, os_build).await;
    sc.end_progress();
    // The lab's directory goes with it: keep what explains the run.
    match keep_logs(&lab) {
        Ok(dir) => say(&format!(
            "logs kept in {} (lab.log: manager and bootd, console.log: the serial console, bmc-requests.jsonl); cleaning up",
            dir.display()
        )),
        Err(e) => say(&format!(
            "the logs in {} could not be kept ({e:#}); cleaning up",
            lab.dir.display()
        )),
    }
    if let Some(last) = result? {
        say(&last);
    }
    Ok(())
}

/// Copies the lab's logs and the serial console to `<target>/demo/`
/// (replacing an earlier run's) and returns that directory.
fn keep_logs(lab: &Lab) -> anyhow::Result<std::path::PathBuf> {
    let dir = anneal_tests::artifacts::target_dir().join("demo");
    if dir.exists() {
        std::fs::remove_dir_all(&dir).with_context(|| format!("remove {}", dir.display()))?;
    }
    std::fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
    for name in ["lab.log", "bmc-requests.jsonl"] {
        let from = lab.dir.join(name);
        if from.exists() {
            std::fs::copy(&from, dir.join(name))
                .with_context(|| format!("copy {} into {}", from.display(), dir.display()))?;
        }
    }
    std::fs::write(dir.join("console.log"), lab.console())
        .with_context(|| format!("write {}", dir.join("console.log").display()))?;
    Ok(dir)
}

/// The demo after the lab is up; returns the last line to print (the
/// deploy's time), `None` for the inspection-only demo.
async fn demo(
    lab: &mut Lab,
    sc: &Screen,
    os_build: Option<OsBuild>,
) -> anyhow::Result<Option<String>> {
    let say = |s: &str| sc.say(s);
    // 1. The image.
    let mut image = None;
    if let Some(build) = os_build {
        let os = build.await.context("the test OS build panicked")??;
        let allocated = {
            use std::os::unix::fs::MetadataExt as _;
            std::fs::metadata(&os.image).map_or(0, |m| m.blocks() * 512)
        };
        say(&format!(
            "test OS image built: {} ({:.0} MiB, {:.0} MiB allocated; GPT: ESP, swap, ext4 root with a marker of sha256 {}…)",
            os.image.display(),
            mib(i64::try_from(os.image_bytes)?),
            mib(i64::try_from(allocated)?),
            &os.marker_sha256[..12]
        ));
        let dir = os
            .image
            .parent()
            .context("the test OS image has no directory")?;
        let file = os
            .image
            .file_name()
            .and_then(|f| f.to_str())
            .context("the test OS image name is not UTF-8")?;
        let sum = sha256_file(&os.image);
        let server = FileServer::start(dir, None);
        let url = server.url(file);
        say(&format!(
            "serving it at {url} (sha256 {}…); applying ImageImport {}/{IMAGE}",
            &sum[..12],
            e2e::NAMESPACE
        ));
        let started = Instant::now();
        {
            let import = lab.import(IMAGE, &url, &sum, Duration::from_secs(900));
            tokio::pin!(import);
            let mut tick = tokio::time::interval(Duration::from_millis(500));
            loop {
                tokio::select! {
                    r = &mut import => {
                        sc.end_progress();
                        r?;
                        break;
                    }
                    _ = tick.tick() => {
                        let st = lab.import_status(IMAGE).await.ok().flatten().unwrap_or_default();
                        let state = st.state.map_or_else(|| "Pending".to_string(), |s| format!("{s:?}"));
                        let (phase, line) = match &st.progress {
                            Some(p) => {
                                let phase = p.phase.clone().unwrap_or_default();
                                (
                                    format!("{state}/{phase}"),
                                    format!(
                                        "ImageImport {IMAGE}: {state} · {phase} {:>3}% ({:.0}/{:.0} MiB) · {:.0} s",
                                        p.percent,
                                        mib(p.bytes_done),
                                        mib(p.bytes_total),
                                        started.elapsed().as_secs_f64()
                                    ),
                                )
                            }
                            None => (
                                state.clone(),
                                format!("ImageImport {IMAGE}: {state} · {:.0} s", started.elapsed().as_secs_f64()),
                            ),
                        };
                        sc.progress(&phase, &line);
                    }
                }
            }
        }
        drop(server);
        say(&format!(
            "ImageImport {IMAGE} Succeeded, Image {IMAGE} Ready ({:.1} s)",
            started.elapsed().as_secs_f64()
        ));
        sc.block(
            &lab.kubectl_get("imageimports,partitioncontents,images")
                .unwrap_or_else(|e| e.to_string()),
        );
        image = Some(os);
    }

    // 2. Enrolment and inspection.
    lab.launch_vm().await?;
    say(&format!(
        "VM launched powered off (QEMU pid {}, MAC {MAC}, BMC {})",
        lab.vm.as_ref().map_or(0, |v| v.pid()),
        lab.bmc_address()
    ));
    lab.enrol().await?;
    say(&format!(
        "Machine {}/{MACHINE} enrolled; the serial console follows\n",
        e2e::NAMESPACE
    ));
    let mut f = Follow::new();
    let timeout = Duration::from_secs(600);
    loop {
        if f.pump(lab, sc).await == "Available" {
            break;
        }
        anyhow::ensure!(
            lab.since_launch() < timeout,
            "machine {MACHINE} not Available {:.0} s after QEMU's launch (state {:?}); see the console above and {}",
            timeout.as_secs_f64(),
            f.state,
            lab.dir.join("lab.log").display()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let available = lab.since_launch();
    // An unclaimed Available machine is shut down: the agent's long-poll
    // answers poweroff and the manager powers off through the BMC.
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut off = false;
    while Instant::now() < deadline {
        f.pump(lab, sc).await;
        if lab.powered_on().await? == Some(false) {
            off = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    say(&format!(
        "Machine Available {:.1} s after QEMU's launch{}",
        available.as_secs_f64(),
        if off {
            ", then powered off"
        } else {
            " (still powered on after 60 s)"
        }
    ));
    sc.block(&lab.kubectl_get_machines().unwrap_or_else(|e| e.to_string()));
    if let Some((init, net, _)) = e2e::registration_times(&lab.console()) {
        say(&format!(
            "agent: /init → registration {init:.1} s ({net:.1} s after the DHCP lease)"
        ));
    }
    if let Some(hw) = lab.hardware().await? {
        say("MachineHardware:");
        sc.block(&e2e::summary(&hw));
    }
    let Some(os) = image else {
        return Ok(None);
    };

    // 3. The claim and the deploy.
    let claim_ms = now_ms();
    let claimed = Instant::now();
    let disk = &e2e::DEPLOY_DISKS[0];
    lab.claim(CLAIM, IMAGE, disk.1, serde_json::json!({}))
        .await?;
    say(&format!(
        "MachineClaim {}/{CLAIM} applied: Image {IMAGE} onto the disk with serial {} ({}, {} MiB)",
        e2e::NAMESPACE,
        disk.1,
        disk.3,
        disk.2
    ));
    let marker = format!("ANNEAL-MARKER {}", os.marker_sha256);
    let name = format!("ANNEAL-DEPLOYED {MACHINE}");
    let timeout = Duration::from_secs(1500);
    let mut power_on_ms = None;
    let mut last_poll: Option<Instant> = None;
    let mut run: Option<(String, anneal_api::DeployRunStatus)> = None;
    let mut run_done = false;
    let mut marker_ms = None;
    let mut marker_seen: Option<Instant> = None;
    loop {
        f.pump(lab, sc).await;
        if power_on_ms.is_none() {
            power_on_ms = lab.power_on_after(claim_ms);
            if let Some(t) = power_on_ms {
                say(&format!(
                    "the manager powered {MACHINE} on through its BMC {:.1} s after the claim",
                    t.saturating_sub(claim_ms) as f64 / 1000.0
                ));
            }
        }
        if !run_done && last_poll.is_none_or(|t| t.elapsed() >= Duration::from_secs(1)) {
            last_poll = Some(Instant::now());
            if let Some(r) = lab.deploy_run_status().await.ok().flatten() {
                if run.as_ref().is_none_or(|(n, _)| *n != r.0) {
                    sc.end_progress();
                    say(&format!(
                        "DeployRun {}/{} planned for Image {IMAGE} ({:.1} s after the claim)",
                        e2e::NAMESPACE,
                        r.0,
                        claimed.elapsed().as_secs_f64()
                    ));
                }
                run = Some(r);
            }
            let since = power_on_ms.map_or_else(
                || format!("{:.0} s after the claim", claimed.elapsed().as_secs_f64()),
                |t| {
                    format!(
                        "{:.0} s after power-on",
                        now_ms().saturating_sub(t) as f64 / 1000.0
                    )
                },
            );
            match &run {
                None => sc.progress("none", &format!("deploy: planning the DeployRun · {since}")),
                Some((rn, st)) => {
                    let phase = st.phase.unwrap_or(RunPhase::Pending);
                    match phase {
                        RunPhase::Failed => {
                            sc.end_progress();
                            anyhow::bail!(
                                "DeployRun {rn} Failed: {:?}; see the console above, `kubectl describe deployrun {rn}` and {}",
                                st.conditions,
                                lab.dir.join("lab.log").display()
                            );
                        }
                        RunPhase::Succeeded => {
                            sc.end_progress();
                            run_done = true;
                            say(&format!(
                                "DeployRun {rn} Succeeded ({since}); the machine reboots into its disk"
                            ));
                        }
                        _ => {
                            let parts: Vec<String> = st
                                .partitions
                                .iter()
                                .map(|p| format!("p{} {}%", p.number, p.percent))
                                .collect();
                            sc.progress(
                                &format!("{phase:?}"),
                                &format!(
                                    "deploy: {:<15} {:>3}% {:>3} MiB/s · {since}{}",
                                    format!("{phase:?}"),
                                    st.percent.unwrap_or(0),
                                    st.throughput_mib_ps.unwrap_or(0),
                                    if parts.is_empty() {
                                        String::new()
                                    } else {
                                        format!(" · {}", parts.join(" "))
                                    }
                                ),
                            );
                        }
                    }
                }
            }
        }
        let console = lab.console();
        if let Some(line) = console.lines().find(|l| l.contains("ANNEAL-TESTOS-ERROR")) {
            sc.end_progress();
            anyhow::bail!(
                "the deployed OS failed: {}; see the console above",
                line.trim_end()
            );
        }
        if marker_seen.is_none() && console.contains(&marker) && console.contains(&name) {
            marker_ms = Some(now_ms());
            marker_seen = Some(Instant::now());
        }
        // ANNEAL-DATA is the test OS's last line.
        let done = console
            .find("ANNEAL-DATA ")
            .is_some_and(|i| console[i..].contains('\n'));
        if let Some(seen) = marker_seen
            && (done || seen.elapsed() > Duration::from_secs(10))
        {
            f.pump(lab, sc).await;
            break;
        }
        if done && marker_seen.is_none() {
            anyhow::bail!(
                "the deployed OS did not print {marker:?} and {name:?}; see the console above"
            );
        }
        anyhow::ensure!(
            claimed.elapsed() < timeout,
            "{MACHINE} did not boot its deployed disk {:.0} s after the claim (state {:?}, run {:?}); see the console above and {}",
            timeout.as_secs_f64(),
            f.state,
            run.as_ref().map(|r| &r.0),
            lab.dir.join("lab.log").display()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    sc.end_progress();

    // 4. The summary.
    say(
        "the deployed OS printed its marker (the sha256 of /anneal-marker in the image) and the Machine's name",
    );
    sc.block(
        &lab.kubectl_get("deployruns")
            .unwrap_or_else(|e| e.to_string()),
    );
    sc.block(&lab.kubectl_get_machines().unwrap_or_else(|e| e.to_string()));
    let origin_ms = power_on_ms.unwrap_or(claim_ms);
    if let Some((rn, st)) = lab.deploy_run_status().await? {
        let mut text = format!(
            "DeployRun {rn}: {:?}, {} MiB/s (phase · start after power-on · duration)\n",
            st.phase.unwrap_or(RunPhase::Pending),
            st.throughput_mib_ps.unwrap_or_default()
        );
        for t in &st.phase_timings {
            let start = t.start.as_ref().map(|a| {
                (a.0.as_millisecond() - i64::try_from(origin_ms).unwrap_or(i64::MAX)) as f64
                    / 1000.0
            });
            let secs = match (&t.start, &t.end) {
                (Some(a), Some(b)) => format!("{:>6.1} s", b.0.duration_since(a.0).as_secs_f64()),
                _ => "      -".to_string(),
            };
            text.push_str(&format!(
                "  {:<16} {:>7} {secs}\n",
                t.phase,
                start.map_or_else(|| "-".to_string(), |s| format!("+{s:.1} s"))
            ));
        }
        say(text.trim_end());
    }
    match lab.boot_entries() {
        Ok((entries, order)) => {
            for e in entries
                .iter()
                .filter(|e| e.description.starts_with("anneal"))
            {
                say(&format!(
                    "UEFI boot entry the agent wrote: Boot{:04X} {:?} → {}{} ({} in BootOrder {})",
                    e.number,
                    e.description,
                    e.part_guid
                        .as_ref()
                        .map_or_else(String::new, |g| format!("HD(partition {})/", guid(g))),
                    e.file.as_deref().unwrap_or("-"),
                    if order.first() == Some(&e.number) {
                        "first".to_string()
                    } else {
                        format!(
                            "position {}",
                            order
                                .iter()
                                .position(|n| *n == e.number)
                                .map_or(0, |p| p + 1)
                        )
                    },
                    order
                        .iter()
                        .map(|n| format!("{n:04X}"))
                        .collect::<Vec<_>>()
                        .join(",")
                ));
            }
        }
        Err(e) => say(&format!(
            "the VM's UEFI boot entries could not be read: {e:#}"
        )),
    }
    let marker_ms = marker_ms.unwrap_or_else(now_ms);
    Ok(Some(format!(
        "{}: {:.1} s from {} to the deployed OS's marker ({:.1} s from the claim; QEMU launched {:.1} s ago)",
        sc.bold("deployed"),
        marker_ms.saturating_sub(origin_ms) as f64 / 1000.0,
        if power_on_ms.is_some() {
            "the claim's power-on"
        } else {
            "the claim (no power-on in the BMC log)"
        },
        marker_ms.saturating_sub(claim_ms) as f64 / 1000.0,
        lab.since_launch().as_secs_f64()
    )))
}
