//! The cloud-init NoCloud config drive (docs/deploy.md, "Day-1
//! configuration (cloud-init)"): plans with `configDrive`
//! deployed by `anneal-agent deploy` from a local content server onto a
//! regular file, checked with the host's tools (never with fatfs): `sfdisk
//! --json` for the partition at the end, `blkid -p` for `TYPE=vfat` and
//! `LABEL=CIDATA` (what cloud-init's ds-identify looks for), `mdir`/`mtype`
//! for the long file names and their exact bytes, `fsck.fat -n` on the
//! extracted partition; `growLastPartition` stops at the drive and keeps its
//! files; no user-data value reaches the logs.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
#![allow(clippy::too_many_lines)]

use std::io::{BufRead as _, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use anneal_agent::posthook::{self, Context};
use anneal_api::agent::{PlannedConfigDrive, PlannedStep, SecretBytes};
use sha2::Digest as _;

const NS: &str = "lab";
const TOOLS: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
const SECRET: &str = "s3cr3t-4f1c";
const CD_GUID: &str = "EBD0A0A2-B9E5-4433-87C0-68B6B72699C7";
/// The target's size (the plan's `diskSize`): larger than the source disk.
const TARGET: u64 = 96 << 20;

fn sh(cmd: &str) -> String {
    let out = Command::new("bash")
        .arg("-c")
        .arg(cmd)
        .env("PATH", TOOLS)
        .env("MTOOLS_SKIP_CHECK", "1")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{cmd}: {}\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn agent() -> Command {
    Command::new(env!("CARGO_BIN_EXE_anneal-agent"))
}

fn sha256_hex(p: &Path) -> String {
    hex::encode(sha2::Sha256::digest(std::fs::read(p).unwrap()))
}

/// A 32 MiB source disk: GPT with an ESP (vfat, 8 MiB at 1 MiB) and an
/// ext4 root (16 MiB) holding `marker`; or MBR with the ext4 root only.
fn make_disk(d: &Path, mbr: bool) -> PathBuf {
    let img = d.join("disk.raw");
    let i = img.display();
    let tree = d.join("tree");
    std::fs::create_dir_all(&tree).unwrap();
    std::fs::write(tree.join("marker"), b"root of the deployed OS\n").unwrap();
    if mbr {
        sh(&format!(
            "truncate -s 32M {i} && echo 'start=2048, size=32768, type=83' | sfdisk -q -X dos {i} && \
             mkfs.ext4 -q -F -L root -d {} -E offset=1048576 {i} 16M",
            tree.display()
        ));
    } else {
        sh(&format!(
            "truncate -s 32M {i} && sgdisk -o -n 1:2048:+8M -t 1:ef00 -n 2:18432:+16M -t 2:8300 {i} >/dev/null && \
             mkfs.vfat --offset 2048 {i} 8192 >/dev/null && \
             mkfs.ext4 -q -F -L root -d {} -E offset={} {i} 16M",
            tree.display(),
            18_432 * 512
        ));
    }
    img
}

struct Fixture {
    dir: tempfile::TempDir,
    cap: PathBuf,
    server: Child,
    addr: SocketAddr,
}

impl Drop for Fixture {
    fn drop(&mut self) {
        let _ = self.server.kill();
        let _ = self.server.wait();
    }
}

/// Captures a fresh source disk, publishes its contents and serves them.
fn fixture(mbr: bool) -> Fixture {
    let base = Path::new("/var/tmp/anneal-test");
    std::fs::create_dir_all(base).unwrap();
    let dir = tempfile::tempdir_in(base).unwrap();
    let d = dir.path();
    let raw = make_disk(d, mbr);
    let cap = d.join("cap");
    let out = agent()
        .arg("capture")
        .arg(&raw)
        .arg("--out")
        .arg(&cap)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let layout: serde_json::Value =
        serde_json::from_slice(&std::fs::read(cap.join("layout.json")).unwrap()).unwrap();
    let store = d.join("store");
    for s in layout["slots"].as_array().unwrap() {
        let Some(name) = s["contentRef"].as_str() else {
            continue;
        };
        let c = store.join(NS).join(name);
        std::fs::create_dir_all(&c).unwrap();
        std::fs::copy(cap.join(format!("{name}.index")), c.join("index")).unwrap();
        std::fs::copy(cap.join(format!("{name}.stream")), c.join("stream")).unwrap();
        let sum = sha256_hex(&c.join("stream"));
        std::fs::write(c.join("verified"), format!("{sum}\n")).unwrap();
    }
    let mut server = agent()
        .arg("serve")
        .arg("--content-dir")
        .arg(&store)
        .args(["--listen", "127.0.0.1:0"])
        .env("NO_COLOR", "1")
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(server.stderr.take().unwrap()).lines();
    let addr = loop {
        let line = lines.next().expect("serve ended before naming its address");
        let line = line.unwrap();
        if let Some(i) = line.find("127.0.0.1:") {
            let port: String = line[i + 10..]
                .chars()
                .take_while(char::is_ascii_digit)
                .collect();
            break SocketAddr::from(([127, 0, 0, 1], port.parse::<u16>().unwrap()));
        }
    };
    std::thread::spawn(move || for _ in lines {});
    Fixture {
        dir,
        cap,
        server,
        addr,
    }
}

fn user_data() -> String {
    format!("#cloud-config\npassword: {SECRET}\nchpasswd: {{ expire: false }}\n")
}

const META: &str = "instance-id: m1-run-1\nlocal-hostname: m1\n";
const NET: &str = "version: 2\nethernets:\n  eth0:\n    dhcp4: true\n";

/// A plan writing the capture onto `target` (`TARGET` bytes, the last slot
/// growing when `grow`), with a config drive as partition `cd` when given.
fn plan(f: &Fixture, target: &Path, grow: bool, cd: Option<u32>) -> serde_json::Value {
    let mut layout: serde_json::Value =
        serde_json::from_slice(&std::fs::read(f.cap.join("layout.json")).unwrap()).unwrap();
    layout["diskSize"] = TARGET.into();
    let slots = layout["slots"].as_array_mut().unwrap();
    slots.last_mut().unwrap()["grow"] = grow.into();
    let mut contents = Vec::new();
    for s in slots.iter() {
        let Some(name) = s["contentRef"].as_str() else {
            continue;
        };
        let stream = f.cap.join(format!("{name}.stream"));
        let url = format!("http://{}/content/{NS}/{name}", f.addr);
        contents.push(serde_json::json!({
            "name": name,
            "slot": s["number"],
            "indexUrl": format!("{url}/index"),
            "streamUrl": format!("{url}/stream"),
            "indexSha256": sha256_hex(&f.cap.join(format!("{name}.index"))),
            "streamSha256": sha256_hex(&stream),
            "streamBytes": std::fs::metadata(&stream).unwrap().len(),
        }));
    }
    let mut p = serde_json::json!({
        "runId": "m1-run-1",
        "disks": [{
            "image": "test",
            "os": true,
            "deviceName": target,
            "layout": layout,
            "contents": contents,
        }],
        "afterDeploy": "PowerOff",
        "progressIntervalSeconds": 1,
        "architecture": "x86_64",
    });
    if let Some(n) = cd {
        let files = [
            ("user-data", user_data()),
            ("meta-data", META.into()),
            ("network-config", NET.into()),
        ];
        let cd = PlannedConfigDrive {
            partition: n,
            size_bytes: 4 << 20,
            label: "CIDATA".into(),
            files: files
                .into_iter()
                .map(|(k, v)| (k.to_string(), SecretBytes::new(v)))
                .collect(),
        };
        p["configDrive"] = serde_json::to_value(&cd).unwrap();
    }
    p
}

struct Deployed {
    ok: bool,
    stdout: String,
    stderr: String,
}

fn deploy(d: &Path, plan: &serde_json::Value) -> Deployed {
    let p = d.join("plan.json");
    std::fs::write(&p, serde_json::to_vec(plan).unwrap()).unwrap();
    let out = agent()
        .arg("deploy")
        .arg("--plan")
        .arg(&p)
        .args(["--range-mib", "1"])
        .env("NO_COLOR", "1")
        .env("RUST_LOG", "debug")
        .output()
        .unwrap();
    let d = Deployed {
        ok: out.status.success(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    };
    eprintln!("{}{}", d.stdout, d.stderr);
    d
}

/// `sfdisk --json`'s partitions: (node suffix number, start, size in
/// sectors, type, name).
fn partitions(img: &Path) -> (serde_json::Value, Vec<serde_json::Value>) {
    let v: serde_json::Value =
        serde_json::from_str(&sh(&format!("sfdisk --json {}", img.display()))).unwrap();
    let parts = v["partitiontable"]["partitions"]
        .as_array()
        .unwrap()
        .clone();
    (v["partitiontable"].clone(), parts)
}

/// Checks the FAT file system at `off` (`len` bytes) of `img` with blkid,
/// mtools and fsck.fat: label, long names, exact bytes.
fn check_drive(img: &Path, off: u64, len: u64) {
    let i = img.display();
    let b = sh(&format!("blkid -p -O {off} -o export {i}"));
    assert!(b.lines().any(|l| l == "TYPE=vfat"), "{b}");
    assert!(b.lines().any(|l| l == "LABEL=CIDATA"), "{b}");
    let names = sh(&format!("mdir -b -i {i}@@{off} ::/"));
    let mut names: Vec<&str> = names.lines().map(|l| l.trim_start_matches("::/")).collect();
    names.sort_unstable();
    assert_eq!(names, ["meta-data", "network-config", "user-data"]);
    let ud = user_data();
    for (name, want) in [
        ("user-data", ud.as_str()),
        ("meta-data", META),
        ("network-config", NET),
    ] {
        let got = sh(&format!("mtype -i {i}@@{off} ::/{name}"));
        assert_eq!(got, want, "{name}");
    }
    let part = img.with_extension("cidata");
    let fsck = sh(&format!(
        "dd if={i} of={} bs=1M iflag=skip_bytes,count_bytes skip={off} count={len} status=none && fsck.fat -n {} && echo FSCK-DONE",
        part.display(),
        part.display()
    ));
    // clean: the version, the summary line and nothing else
    let lines: Vec<&str> = fsck.lines().collect();
    assert!(
        lines.len() == 3 && lines[1].contains(" files, ") && lines[2] == "FSCK-DONE",
        "{fsck}"
    );
}

/// GPT, last slot growing: the drive is partition 3 at the end (1 MiB
/// aligned, up to the last usable sector), the root stops before it; blkid
/// sees vfat CIDATA; the three files come back by their long names, byte for
/// byte; the progress names files and sizes and neither stdout nor stderr
/// carries the user-data's secret.
#[test]
fn a_gpt_deploy_writes_a_cidata_drive_at_the_end() {
    let f = fixture(false);
    let target = f.dir.path().join("target.img");
    let out = deploy(f.dir.path(), &plan(&f, &target, true, Some(3)));
    assert!(out.ok, "{}", out.stdout);
    let (table, parts) = partitions(&target);
    assert_eq!(table["label"], "gpt");
    assert_eq!(parts.len(), 3, "{parts:?}");
    let last_lba = table["lastlba"].as_u64().unwrap();
    let cd = &parts[2];
    assert!(cd["node"].as_str().unwrap().ends_with('3'));
    assert_eq!(cd["type"], CD_GUID);
    assert_eq!(cd["name"], "config-drive");
    let (start, size) = (cd["start"].as_u64().unwrap(), cd["size"].as_u64().unwrap());
    assert_eq!(start % 2048, 0, "not 1 MiB aligned");
    assert_eq!(start + size - 1, last_lba, "not at the last usable sector");
    assert!(size * 512 >= 4 << 20 && size * 512 < 5 << 20, "{size}");
    let root = &parts[1];
    let root_end = root["start"].as_u64().unwrap() + root["size"].as_u64().unwrap();
    assert_eq!(
        root_end, start,
        "the growing root does not end at the drive"
    );
    check_drive(&target, start * 512, size * 512);
    let v = sh(&format!("sgdisk -v {}", target.display()));
    assert!(v.contains("No problems found"), "{v}");
    // the progress names the drive's files and sizes, never their bytes
    let lines: Vec<String> = out
        .stdout
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|l| l["event"] == "progress")
        .flat_map(|l| l["logLines"].as_array().unwrap().clone())
        .map(|l| l.as_str().unwrap().to_string())
        .collect();
    let summary = lines
        .iter()
        .find(|l| l.starts_with("config drive: partition 3"))
        .unwrap_or_else(|| panic!("no config drive line in {lines:?}"));
    let ud_len = user_data().len();
    assert!(
        summary.contains(&format!("user-data ({ud_len} bytes)")) && summary.contains("FAT"),
        "{summary}"
    );
    assert!(out.stderr.contains("config drive"), "{}", out.stderr);
    assert!(!out.stdout.contains(SECRET), "stdout carries the secret");
    assert!(!out.stderr.contains(SECRET), "stderr carries the secret");
}

/// MBR: the drive is primary 2, type 0x0c, at the end of the disk.
#[test]
fn an_mbr_deploy_writes_a_cidata_drive_at_the_end() {
    let f = fixture(true);
    let target = f.dir.path().join("target.img");
    let out = deploy(f.dir.path(), &plan(&f, &target, true, Some(2)));
    assert!(out.ok, "{}", out.stdout);
    let (table, parts) = partitions(&target);
    assert_eq!(table["label"], "dos");
    assert_eq!(parts.len(), 2, "{parts:?}");
    let cd = &parts[1];
    assert_eq!(cd["type"], "c");
    let (start, size) = (cd["start"].as_u64().unwrap(), cd["size"].as_u64().unwrap());
    assert_eq!((start + size) * 512, TARGET);
    assert_eq!(start % 2048, 0);
    let root_end = parts[0]["start"].as_u64().unwrap() + parts[0]["size"].as_u64().unwrap();
    assert_eq!(root_end, start);
    check_drive(&target, start * 512, size * 512);
    assert!(!out.stdout.contains(SECRET) && !out.stderr.contains(SECRET));
}

/// No `configDrive`: the table has the layout's slots only, the last one
/// grown to the end of the disk as before.
#[test]
fn a_plan_without_config_drive_writes_no_extra_partition() {
    let f = fixture(false);
    let target = f.dir.path().join("target.img");
    let out = deploy(f.dir.path(), &plan(&f, &target, true, None));
    assert!(out.ok, "{}", out.stdout);
    let (table, parts) = partitions(&target);
    assert_eq!(parts.len(), 2, "{parts:?}");
    let end = parts[1]["start"].as_u64().unwrap() + parts[1]["size"].as_u64().unwrap();
    assert_eq!(end - 1, table["lastlba"].as_u64().unwrap());
    assert!(!out.stdout.contains("config drive"));
}

/// A plan whose drive does not fit after a fixed-size root fails before
/// any write, naming the sizes and the fix.
#[test]
fn a_config_drive_without_room_fails_before_any_write() {
    let f = fixture(false);
    let target = f.dir.path().join("target.img");
    let mut p = plan(&f, &target, false, Some(3));
    p["configDrive"]["sizeBytes"] = (80u64 << 20).into();
    let out = deploy(f.dir.path(), &p);
    assert!(!out.ok);
    let err: serde_json::Value = out
        .stdout
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .find(|l| l["event"] == "error")
        .unwrap();
    let msg = err["message"].as_str().unwrap();
    assert!(
        msg.contains("no room for partition 3") && msg.contains("slot 2 ends at byte"),
        "{msg}"
    );
    assert_eq!(err["diskInvalidated"], false, "{err}");
}

/// `growLastPartition` on a deployed disk with a config drive: the root
/// (ext4) grows up to the drive's start, not over it; the drive's files
/// are intact (resize2fs truncates a regular file: the agent puts the
/// drive back); the GPT is valid. On GPT the drive is found by its name
/// alone, on MBR by the plan's partition number.
#[test]
fn grow_last_partition_stops_at_the_config_drive() {
    for (mbr, cd) in [(false, 3u32), (true, 2)] {
        let f = fixture(mbr);
        let target = f.dir.path().join("target.img");
        let out = deploy(f.dir.path(), &plan(&f, &target, false, Some(cd)));
        assert!(out.ok, "{}", out.stdout);
        let (_, before) = partitions(&target);
        let drive = &before[before.len() - 1];
        let (start, size) = (
            drive["start"].as_u64().unwrap(),
            drive["size"].as_u64().unwrap(),
        );
        let root_idx = before.len() - 2;
        let root_start = before[root_idx]["start"].as_u64().unwrap();
        assert!(root_start + before[root_idx]["size"].as_u64().unwrap() < start);

        let mut file = std::fs::File::open(&target).unwrap();
        let layout = anneal_image::layout::read_layout(&mut file).unwrap();
        let mut ctx = Context::new(target.clone(), layout, "x86_64", "ns/m1");
        ctx.tool_path = Some(TOOLS.into());
        ctx.config_drive = mbr.then_some(cd);
        let step = PlannedStep {
            hook: "anneal-default-finalize".into(),
            step: "grow".into(),
            builtin: Some("growLastPartition".into()),
            script: None,
            timeout_seconds: 60,
            params: Default::default(),
        };
        let mut log = Vec::new();
        posthook::run_steps(&ctx, &[step], &mut |l| log.push(l.to_string()))
            .unwrap_or_else(|e| panic!("{}: {log:?}", e.reason()));
        assert!(
            log.iter()
                .any(|l| l.contains("stopped before the config drive")),
            "{log:?}"
        );
        assert_eq!(std::fs::metadata(&target).unwrap().len(), TARGET);
        let (_, after) = partitions(&target);
        assert_eq!(after.len(), before.len());
        assert_eq!(after[after.len() - 1], *drive, "the drive moved");
        let root_end =
            after[root_idx]["start"].as_u64().unwrap() + after[root_idx]["size"].as_u64().unwrap();
        assert_eq!(
            root_end, start,
            "mbr={mbr}: the root does not reach the drive"
        );
        let i = target.display();
        let off = root_start * 512;
        sh(&format!("e2fsck -fn '{i}?offset={off}'"));
        let blocks = sh(&format!("dumpe2fs -h '{i}?offset={off}' 2>/dev/null"));
        let count: u64 = blocks
            .lines()
            .find_map(|l| l.strip_prefix("Block count:"))
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        let bsize: u64 = blocks
            .lines()
            .find_map(|l| l.strip_prefix("Block size:"))
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        assert_eq!(count * bsize, (start - root_start) * 512, "{blocks}");
        check_drive(&target, start * 512, size * 512);
        if !mbr {
            let v = sh(&format!("sgdisk -v {i}"));
            assert!(v.contains("No problems found"), "{v}");
        }
    }
}
