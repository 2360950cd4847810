//! The start-up check of `manager run` (docs/lifecycle.md, "Start-up checks"):
//! a configuration that cannot provision is refused before the manager
//! connects anywhere. Each missing or contradictory setting is one line that
//! names the flag to set and why; `main` prints every line and exits non-zero.
//!
//! The rules keep deliberately partial roles working: a replica with
//! `--no-lifecycle`, one without `--workload-executor` (no image
//! controllers), or an agent API listening on a loopback address (only this
//! host's agents reach it: tests, benchmarks) is not asked for what its role
//! does not use. docs/lifecycle.md ("Start-up checks") lists the rules.

use std::net::{IpAddr, SocketAddr};
use std::path::Path;

/// Where workloads run (`--workload-executor`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Executor {
    /// Child processes on this host, over `--content-dir`.
    Process,
    /// Jobs and Deployments from `--workload-image`.
    Kubernetes,
}

/// The settings the check reads, as `manager run` was given them.
#[derive(Debug, Clone)]
pub struct Settings<'a> {
    /// The Machine controller and the agent API run (no `--no-lifecycle`).
    pub lifecycle: bool,
    /// `--agent-api-listen`.
    pub agent_api_listen: SocketAddr,
    /// `--agent-api-name` (the defaults included).
    pub agent_api_names: &'a [String],
    /// `--workload-executor` (None: no image controllers, no managed bootd).
    pub executor: Option<Executor>,
    /// `--content-dir`.
    pub content_dir: Option<&'a Path>,
    /// What probing `--content-dir` for a write gave ([`probe_writable`]),
    /// None when it was not probed.
    pub content_dir_probe: Option<Result<(), String>>,
    /// `--workload-image`.
    pub workload_image: Option<&'a str>,
    /// `--content-url`.
    pub content_url: Option<&'a str>,
    /// `--content-listen`.
    pub content_listen: Option<&'a str>,
    /// `--bootd-api-url`.
    pub bootd_api_url: Option<&'a str>,
    /// `--upload-listen`.
    pub upload_listen: Option<SocketAddr>,
}

/// Whether a certificate name or URL host names this host only.
pub fn is_loopback_name(name: &str) -> bool {
    let bare = name.trim_start_matches('[').trim_end_matches(']');
    match bare.parse::<IpAddr>() {
        Ok(ip) => ip.is_loopback(),
        Err(_) => {
            let lower = bare.to_ascii_lowercase();
            lower == "localhost" || lower.ends_with(".localhost")
        }
    }
}

/// One line per setting that keeps this configuration from provisioning,
/// each starting with the flag to set; empty when it can start.
pub fn problems(s: &Settings<'_>) -> Vec<String> {
    let mut out = Vec::new();
    let routable_name = s.agent_api_names.iter().find(|n| !is_loopback_name(n));
    let listen = s.agent_api_listen;
    if s.lifecycle && !listen.ip().is_loopback() && routable_name.is_none() {
        out.push(format!(
            "--agent-api-name: the agent API listens on {listen} but its certificate names only \
             {}: set --agent-api-name to the address or DNS name booted machines reach it at \
             (repeat the flag for several)",
            s.agent_api_names.join(", ")
        ));
    }
    match s.executor {
        Some(Executor::Process) => match (s.content_dir, &s.content_dir_probe) {
            (None, _) => out.push(
                "--content-dir: the process executor keeps the content store in a directory of \
                 this host: set --content-dir DIR"
                    .into(),
            ),
            (Some(dir), Some(Err(e))) => out.push(format!(
                "--content-dir: the content store {} is not writable ({e}): give the manager's \
                 user write access or set --content-dir to a writable directory",
                dir.display()
            )),
            (Some(_), _) => {}
        },
        Some(Executor::Kubernetes) => {
            if s.workload_image.is_none() {
                out.push(
                    "--workload-image: the kubernetes executor runs ingest Jobs, content servers \
                     and seeders from this image: set --workload-image REGISTRY/anneal/agent:TAG"
                        .into(),
                );
            }
            if s.upload_listen.is_some() {
                out.push(
                    "--upload-listen: uploads are written into a local content store, which \
                     only the process executor has: remove --upload-listen (import from a URL \
                     or registry instead) or use --workload-executor process"
                        .into(),
                );
            }
            if s.bootd_api_url.is_none() && routable_name.is_none() {
                out.push(
                    "--bootd-api-url: a managed bootd writes the agent API's URL into the boot \
                     scripts and no --agent-api-name other than a loopback one gives it: set \
                     --bootd-api-url https://ADDRESS:PORT (or --agent-api-name ADDRESS)"
                        .into(),
                );
            }
        }
        None => {}
    }
    if s.lifecycle && s.executor.is_some() {
        out.extend(content_url_problem(s));
    }
    out
}

/// The content URL deploys are planned with: needed once the lifecycle and
/// the image controllers both run, and reachable from the machines.
fn content_url_problem(s: &Settings<'_>) -> Option<String> {
    let Some(url) = s.content_url else {
        let server = s.content_listen.map_or_else(
            || "run a content server with --content-listen ADDRESS:PORT and set".to_string(),
            |l| format!("the content server listens on {l}: set"),
        );
        return Some(format!(
            "--content-url: no deploy can be planned without the URL agents fetch contents \
             from; {server} --content-url http://ADDRESS:PORT as booted machines reach it"
        ));
    };
    let host = url
        .parse::<hyper::Uri>()
        .ok()
        .filter(|u| matches!(u.scheme_str(), Some("http" | "https")))
        .and_then(|u| u.host().map(str::to_string));
    let Some(host) = host else {
        return Some(format!(
            "--content-url: {url:?} is not an http:// or https:// URL with a host: set it to the \
             content server's URL as booted machines reach it"
        ));
    };
    (is_loopback_name(&host) && !s.agent_api_listen.ip().is_loopback()).then(|| {
        format!(
            "--content-url: {url} names this host only while the agent API listens on {} for \
             other machines: set --content-url to an address booted machines reach",
            s.agent_api_listen
        )
    })
}

/// Whether the manager can write into the content store `dir`: creates it
/// if missing, then creates and removes a probe file.
///
/// # Errors
/// The directory cannot be created, or a file in it cannot be created,
/// written or removed.
pub fn probe_writable(dir: &Path) -> std::io::Result<()> {
    use std::io::Write;
    std::fs::create_dir_all(dir)?;
    let probe = dir.join(format!(".anneal-write-probe-{}", std::process::id()));
    let written = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&probe)
        .and_then(|mut f| f.write_all(b"probe").and_then(|()| f.sync_all()));
    let removed = std::fs::remove_file(&probe);
    written?;
    removed
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn names(n: &[&str]) -> Vec<String> {
        n.iter().map(|s| (*s).to_string()).collect()
    }

    /// The configuration deploy/base/manager.yaml gives (kubernetes
    /// executor, the agent API on every address): it starts.
    fn base(names: &[String]) -> Settings<'_> {
        Settings {
            lifecycle: true,
            agent_api_listen: "0.0.0.0:8443".parse().unwrap(),
            agent_api_names: names,
            executor: Some(Executor::Kubernetes),
            content_dir: None,
            content_dir_probe: None,
            workload_image: Some("registry.example/anneal/agent:1"),
            content_url: Some("http://10.0.0.2:8088"),
            content_listen: Some("0.0.0.0:8088"),
            bootd_api_url: None,
            upload_listen: None,
        }
    }

    fn one_line(p: &[String], flag: &str) {
        assert_eq!(p.len(), 1, "{p:#?}");
        assert!(p[0].starts_with(&format!("{flag}: ")), "{p:#?}");
        assert!(!p[0].contains('\n'), "{p:#?}");
    }

    #[test]
    fn a_complete_configuration_starts() {
        let n = names(&["localhost", "127.0.0.1", "10.0.0.2"]);
        assert_eq!(problems(&base(&n)), Vec::<String>::new());
    }

    #[test]
    fn an_agent_api_on_the_network_needs_a_name_machines_reach() {
        let n = names(&["localhost", "127.0.0.1"]);
        let s = Settings {
            bootd_api_url: Some("https://10.0.0.2:8443"),
            ..base(&n)
        };
        let p = problems(&s);
        one_line(&p, "--agent-api-name");
        assert!(p[0].contains("0.0.0.0:8443"), "{p:?}");
        assert!(p[0].contains("localhost, 127.0.0.1"), "{p:?}");
    }

    #[test]
    fn partial_roles_are_not_asked_for_what_they_do_not_run() {
        let n = names(&["localhost", "127.0.0.1"]);
        // the claim half alone (manager_leader, manager-scale)
        let claims_only = Settings {
            lifecycle: false,
            executor: None,
            content_url: None,
            ..base(&n)
        };
        assert!(problems(&claims_only).is_empty());
        // the lifecycle on a loopback agent API (agentapi_bounds,
        // manager_leader_lifecycle, agentapi-load)
        let local = Settings {
            agent_api_listen: "127.0.0.1:0".parse().unwrap(),
            executor: None,
            content_url: None,
            ..base(&n)
        };
        assert!(problems(&local).is_empty());
    }

    #[test]
    fn deploys_need_a_content_url() {
        let n = names(&["10.0.0.2"]);
        let p = problems(&Settings {
            content_url: None,
            ..base(&n)
        });
        one_line(&p, "--content-url");
        assert!(p[0].contains("listens on 0.0.0.0:8088"), "{p:?}");
        let p = problems(&Settings {
            content_url: None,
            content_listen: None,
            ..base(&n)
        });
        one_line(&p, "--content-url");
        assert!(p[0].contains("--content-listen"), "{p:?}");
    }

    #[test]
    fn a_content_url_machines_cannot_reach_is_refused() {
        let n = names(&["10.0.0.2"]);
        for url in [
            "http://127.0.0.1:8088",
            "http://localhost:8088",
            "10.0.0.2:8088",
        ] {
            let p = problems(&Settings {
                content_url: Some(url),
                ..base(&n)
            });
            one_line(&p, "--content-url");
        }
    }

    #[test]
    fn a_managed_bootd_needs_the_agent_api_url() {
        let n = names(&["localhost", "127.0.0.1"]);
        // the lifecycle runs elsewhere (--no-lifecycle): only the bootd
        // half is missing
        let p = problems(&Settings {
            lifecycle: false,
            ..base(&n)
        });
        one_line(&p, "--bootd-api-url");
        let p = problems(&Settings {
            lifecycle: false,
            bootd_api_url: Some("https://api.lab:8443"),
            ..base(&n)
        });
        assert!(p.is_empty(), "{p:?}");
    }

    #[test]
    fn the_kubernetes_executor_needs_a_workload_image() {
        let n = names(&["10.0.0.2"]);
        let p = problems(&Settings {
            workload_image: None,
            ..base(&n)
        });
        one_line(&p, "--workload-image");
    }

    #[test]
    fn uploads_need_the_process_executor() {
        let n = names(&["10.0.0.2"]);
        let p = problems(&Settings {
            upload_listen: Some("10.0.0.2:8444".parse().unwrap()),
            ..base(&n)
        });
        one_line(&p, "--upload-listen");
    }

    #[test]
    fn the_process_executor_needs_a_writable_content_dir() {
        let n = names(&["10.0.0.2"]);
        let process = Settings {
            executor: Some(Executor::Process),
            workload_image: None,
            ..base(&n)
        };
        one_line(&problems(&process), "--content-dir");
        let dir = Path::new("/var/lib/anneal/content");
        let p = problems(&Settings {
            content_dir: Some(dir),
            content_dir_probe: Some(Err("permission denied".into())),
            ..process.clone()
        });
        one_line(&p, "--content-dir");
        assert!(
            p[0].contains("/var/lib/anneal/content is not writable"),
            "{p:?}"
        );
        let ok = Settings {
            content_dir: Some(dir),
            content_dir_probe: Some(Ok(())),
            ..process
        };
        assert!(problems(&ok).is_empty());
    }

    #[test]
    fn every_problem_is_listed_at_once() {
        let n = names(&["localhost"]);
        let p = problems(&Settings {
            workload_image: None,
            content_url: None,
            ..base(&n)
        });
        let flags: Vec<&str> = p.iter().map(|l| l.split(':').next().unwrap()).collect();
        assert_eq!(
            flags,
            [
                "--agent-api-name",
                "--workload-image",
                "--bootd-api-url",
                "--content-url"
            ]
        );
    }

    #[test]
    fn loopback_names() {
        for n in [
            "localhost",
            "LOCALHOST",
            "a.localhost",
            "127.0.0.1",
            "127.1.2.3",
            "::1",
            "[::1]",
        ] {
            assert!(is_loopback_name(n), "{n}");
        }
        for n in ["10.0.0.2", "anneal.example", "fd00::2", "0.0.0.0"] {
            assert!(!is_loopback_name(n), "{n}");
        }
    }

    #[test]
    fn a_probe_finds_a_store_writable_and_leaves_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let store = dir.path().join("store");
        probe_writable(&store).unwrap();
        assert_eq!(std::fs::read_dir(&store).unwrap().count(), 0);
        // a store under a regular file cannot be created
        let file = dir.path().join("file");
        std::fs::write(&file, b"x").unwrap();
        assert!(probe_writable(&file.join("store")).is_err());
    }
}
