//! `manager run` refuses a configuration that cannot provision
//! (docs/lifecycle.md, "Start-up checks"): the real binary prints one line per
//! missing or contradictory setting, each naming its flag, and exits non-zero
//! before it connects anywhere (the kubeconfig here does not exist: a run that
//! got past the check fails connecting instead). The shipped
//! deploy/base/manager.yaml passes.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::Path;
use std::process::Output;

fn manager(args: &[&str]) -> Output {
    anneal_testinfra::manager_without_cluster(Path::new(env!("CARGO_BIN_EXE_manager")), args)
        .unwrap()
}

/// stderr's lines that name a flag (`--flag: why`).
fn refusals(out: &Output) -> Vec<String> {
    String::from_utf8_lossy(&out.stderr)
        .lines()
        .filter(|l| l.starts_with("--"))
        .map(str::to_string)
        .collect()
}

fn flags(lines: &[String]) -> Vec<&str> {
    lines.iter().map(|l| l.split(':').next().unwrap()).collect()
}

#[test]
fn a_configuration_that_cannot_provision_is_refused_with_one_line_per_flag() {
    // the kubernetes executor on every address, nothing else set
    let out = manager(&[
        "--workload-executor=kubernetes",
        "--workload-image=registry.example/anneal/agent:1",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    let lines = refusals(&out);
    assert_eq!(
        flags(&lines),
        ["--agent-api-name", "--bootd-api-url", "--content-url"],
        "{stderr}"
    );
    assert!(lines[0].contains("listens on 0.0.0.0:8443"), "{stderr}");
    assert!(
        stderr.contains("refusing to start: 3 setting(s)"),
        "{stderr}"
    );
    assert!(!stderr.contains("connecting to the cluster"), "{stderr}");
}

#[test]
fn a_content_store_that_is_not_writable_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("a-file");
    std::fs::write(&file, b"x").unwrap();
    let store = file.join("store");
    let out = manager(&[
        "--no-lifecycle",
        "--workload-executor=process",
        &format!("--content-dir={}", store.display()),
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    let lines = refusals(&out);
    assert_eq!(flags(&lines), ["--content-dir"], "{stderr}");
    assert!(
        lines[0].contains(&format!("{} is not writable", store.display())),
        "{stderr}"
    );
}

#[test]
fn the_shipped_base_passes_the_check() {
    let yaml = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/base/manager.yaml"),
    )
    .unwrap();
    // the manager container's args: `- ` items after `args:` up to `env:`
    let mut args = Vec::new();
    let mut inside = false;
    for line in yaml.lines().map(str::trim) {
        match line {
            "args:" => inside = true,
            "env:" => inside = false,
            l if inside && l.starts_with("- ") => args.push(l[2..].to_string()),
            _ => {}
        }
    }
    assert_eq!(args.first().map(String::as_str), Some("run"), "{args:?}");
    assert!(
        args.iter().any(|a| a.starts_with("--agent-api-name=")),
        "{args:?}"
    );
    let rest: Vec<&str> = args[1..].iter().map(String::as_str).collect();
    let out = manager(&rest);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(refusals(&out).is_empty(), "{stderr}");
    assert!(!stderr.contains("refusing to start"), "{stderr}");
    // past the check, it stops at the cluster this test does not have
    assert!(stderr.contains("connecting to the cluster"), "{stderr}");
    // and an overlay's appended --content-url replaces the base's
    let mut patched = rest.clone();
    patched.push("--content-url=http://10.0.0.2:8088");
    let out = manager(&patched);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("connecting to the cluster"), "{stderr}");
}
