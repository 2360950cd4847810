//! Images (docs/kubernetes.md, "Images: FROM scratch, reproducible"):
//! `anneal-oci` (the builder of `deploy/images`) makes a FROM-scratch image of
//! the static musl agent (the binary the machines boot, and the workloads'
//! image). Two builds give the same bytes and digest; skopeo, a real OCI
//! client, reads the archive, copies it (checking every blob's digest) and
//! reports our manifest digest, the architecture and the entrypoint; the layer
//! holds the binary byte for byte, owned by root with mtime 0, and the CA
//! roots; the image is under 30 MiB; a limit under its size is refused with
//! the size named.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::Path;
use std::process::Command;

use serde_json::Value;

fn build(oci: &Path, agent: &Path, out: &Path, extra: &[&str]) -> std::process::Output {
    Command::new(oci)
        .args(["build", "--name", "anneal/agent", "--tag", "test"])
        .args(["--entrypoint", "/anneal-agent"])
        .arg(format!("--file=anneal-agent={}", agent.display()))
        .args(["--ca-roots", "/etc/ssl/certs/ca-certificates.crt"])
        .args(extra)
        .arg("--out")
        .arg(out)
        .output()
        .unwrap()
}

fn run_json(cmd: &mut Command) -> Value {
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{cmd:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn the_agent_image_is_reproducible_and_skopeo_reads_it() {
    let agent = anneal_tests::artifacts::agent_musl();
    let oci = anneal_tests::artifacts::oci_tool();
    let w = tempfile::tempdir().unwrap();
    let (a, b) = (w.path().join("a.tar"), w.path().join("b.tar"));
    let first = build(&oci, &agent, &a, &[]);
    assert!(
        first.status.success(),
        "{}",
        String::from_utf8_lossy(&first.stderr)
    );
    let second = build(&oci, &agent, &b, &[]);
    assert!(second.status.success());
    let one: Value = serde_json::from_slice(&first.stdout).unwrap();
    let two: Value = serde_json::from_slice(&second.stdout).unwrap();
    assert_eq!(one["digest"], two["digest"]);
    assert_eq!(std::fs::read(&a).unwrap(), std::fs::read(&b).unwrap());
    let size = one["size"].as_u64().unwrap();
    println!("anneal/agent: {} {size} bytes", one["digest"]);
    assert!(size < 30 << 20, "{size}");

    // skopeo: the manifest digest, the platform, the entrypoint
    let archive = format!("oci-archive:{}", a.display());
    let inspect = run_json(Command::new("skopeo").args(["inspect", &archive]));
    assert_eq!(inspect["Digest"], one["digest"]);
    assert_eq!(inspect["Architecture"], "amd64");
    assert_eq!(inspect["Os"], "linux");
    assert_eq!(inspect["Layers"].as_array().unwrap().len(), 1);
    assert_eq!(inspect["Layers"][0], one["layer"]);
    let config = run_json(Command::new("skopeo").args(["inspect", "--config", &archive]));
    assert_eq!(
        config["config"]["Entrypoint"],
        serde_json::json!(["/anneal-agent"])
    );
    assert_eq!(config["config"]["User"], "65532:65532");
    assert_eq!(config["rootfs"]["diff_ids"].as_array().unwrap().len(), 1);

    // a copy checks every blob against its digest
    let dir = w.path().join("copied");
    let out = Command::new("skopeo")
        .args(["copy", &archive])
        .arg(format!("dir:{}", dir.display()))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let layer = dir.join(one["layer"].as_str().unwrap().trim_start_matches("sha256:"));
    let listing = Command::new("tar")
        .arg("-tvzf")
        .arg(&layer)
        .output()
        .unwrap();
    assert!(listing.status.success());
    let listing = String::from_utf8(listing.stdout).unwrap();
    let agent_line = listing
        .lines()
        .find(|l| l.ends_with(" anneal-agent"))
        .unwrap_or_else(|| panic!("{listing}"));
    assert!(
        agent_line.starts_with("-rwxr-xr-x 0/0") && agent_line.contains("1970-01-01 00:00"),
        "{agent_line}"
    );
    assert!(
        listing.contains("etc/ssl/certs/ca-certificates.crt"),
        "{listing}"
    );
    let unpacked = w.path().join("rootfs");
    std::fs::create_dir_all(&unpacked).unwrap();
    let st = Command::new("tar")
        .arg("-xzf")
        .arg(&layer)
        .arg("-C")
        .arg(&unpacked)
        .status()
        .unwrap();
    assert!(st.success());
    assert!(
        std::fs::read(unpacked.join("anneal-agent")).unwrap() == std::fs::read(&agent).unwrap(),
        "the layer's binary differs from the agent"
    );

    // a size limit below the image's is refused, naming both
    let c = w.path().join("c.tar");
    let refused = build(&oci, &agent, &c, &["--max-size-mib", "1"]);
    assert!(!refused.status.success());
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(
        err.contains("docker.io/anneal/agent:test") && err.contains("--max-size-mib 1"),
        "{err}"
    );
    assert!(!c.exists());
}
