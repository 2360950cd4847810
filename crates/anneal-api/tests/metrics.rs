//! docs/metrics.md lists every metric the code registers, and no other; the
//! Grafana dashboard docs/grafana/anneal.json is valid JSON whose every
//! query names metrics of that page.
//!
//! The metrics come from a scan of the manager, bootd and agent sources: a
//! file that makes a `Registry::with_prefix("P")` registers `P_N` for every
//! `register("N", …)` in it. (The unit tests beside each registry,
//! `anneal_manager::metrics` and `anneal_bootd::metrics`, render the real
//! registry and check the names and types too.)
#![allow(clippy::expect_used, clippy::panic)]
#![allow(clippy::too_many_lines)]

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use regex::Regex;

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn read(rel: &str) -> String {
    let path = repo_root().join(rel);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

/// The metrics of the page: the first cell of every table row that is a
/// code span naming a metric, as queried (counters with `_total`).
fn documented() -> BTreeSet<String> {
    let row =
        Regex::new(r"^\| `((?:anneal_manager|bootd|anneal)_[a-z0-9_]+)` \|").expect("pattern");
    read("docs/metrics.md")
        .lines()
        .filter_map(|l| row.captures(l).map(|c| c[1].to_string()))
        .collect()
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let entries =
        std::fs::read_dir(dir).unwrap_or_else(|e| panic!("listing {}: {e}", dir.display()));
    for entry in entries {
        let path = entry.expect("directory entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|x| x == "rs") {
            out.push(path);
        }
    }
}

/// `(prefix_name, file)` of every registration in the non-test sources.
fn registered() -> BTreeSet<(String, String)> {
    let prefix = Regex::new(r#"Registry::with_prefix\(\s*"([a-z0-9_]+)"\s*\)"#).expect("pattern");
    let register = Regex::new(r#"\.register\(\s*"([a-z0-9_]+)""#).expect("pattern");
    let any_registry = Regex::new(r"Registry::(default|new|with_prefix)").expect("pattern");
    let root = repo_root();
    let mut files = Vec::new();
    for dir in ["manager/src", "bootd/src", "agent/src"] {
        rust_files(&root.join(dir), &mut files);
    }
    assert!(files.len() > 20, "found only {} source files", files.len());
    let mut out = BTreeSet::new();
    for f in files {
        let text = std::fs::read_to_string(&f).expect("source file");
        let code = text.split("#[cfg(test)]").next().unwrap_or_default();
        let rel = f.strip_prefix(&root).unwrap_or(&f).display().to_string();
        if !any_registry.is_match(code) {
            continue;
        }
        let prefixes: Vec<&str> = prefix
            .captures_iter(code)
            .filter_map(|c| c.get(1).map(|m| m.as_str()))
            .collect();
        assert_eq!(
            prefixes.len(),
            1,
            "{rel}: a metrics registry without exactly one Registry::with_prefix(\"…\") \
             (found {prefixes:?}); this test needs the prefix to name the metrics"
        );
        for c in register.captures_iter(code) {
            out.insert((format!("{}_{}", prefixes[0], &c[1]), rel.clone()));
        }
    }
    out
}

/// A documented name without the counter suffix.
fn base(name: &str) -> &str {
    name.strip_suffix("_total").unwrap_or(name)
}

#[test]
fn every_registered_metric_is_documented_and_no_other() {
    let docs = documented();
    let code = registered();
    assert!(
        code.len() >= 20,
        "the scan found only {} registrations: {code:?}",
        code.len()
    );
    let doc_bases: BTreeSet<&str> = docs.iter().map(|d| base(d)).collect();
    let missing: Vec<String> = code
        .iter()
        .filter(|(name, _)| !doc_bases.contains(name.as_str()))
        .map(|(name, file)| format!("{name} (registered in {file})"))
        .collect();
    assert!(
        missing.is_empty(),
        "docs/metrics.md has no row for: {missing:?}; add a row `| \\`NAME\\` | type | labels | meaning |` \
         (a counter is listed with its _total suffix)"
    );
    let code_names: BTreeSet<&str> = code.iter().map(|(n, _)| n.as_str()).collect();
    let stale: Vec<&String> = docs
        .iter()
        .filter(|d| !code_names.contains(base(d)))
        .collect();
    assert!(
        stale.is_empty(),
        "docs/metrics.md lists metrics the code no longer registers: {stale:?}"
    );
}

#[test]
fn the_grafana_dashboard_queries_only_documented_metrics() {
    let text = read("docs/grafana/anneal.json");
    let dash: serde_json::Value = serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("docs/grafana/anneal.json is not valid JSON: {e}"));
    assert!(
        dash.get("title").and_then(|t| t.as_str()).is_some(),
        "the dashboard has no title"
    );
    let mut exprs = Vec::new();
    collect_exprs(&dash, &mut exprs);
    assert!(
        exprs.len() >= 10,
        "only {} queries in the dashboard",
        exprs.len()
    );
    let docs = documented();
    let metric = Regex::new(r"\b((?:anneal_manager|bootd)_[a-z0-9_]+)\b").expect("pattern");
    let mut used = BTreeSet::new();
    for e in &exprs {
        let names: Vec<&str> = metric
            .captures_iter(e)
            .filter_map(|c| c.get(1).map(|m| m.as_str()))
            .collect();
        assert!(!names.is_empty(), "query {e:?} names no anneal metric");
        for n in names {
            assert!(
                docs.contains(n),
                "query {e:?} names {n}, which docs/metrics.md does not list (as queried: counters end in _total)"
            );
            used.insert(n.to_string());
        }
    }
    // Both components are on the dashboard.
    assert!(
        used.iter().any(|n| n.starts_with("anneal_manager_")),
        "{used:?}"
    );
    assert!(used.iter().any(|n| n.starts_with("bootd_")), "{used:?}");
}

fn collect_exprs(v: &serde_json::Value, out: &mut Vec<String>) {
    match v {
        serde_json::Value::Object(m) => {
            for (k, x) in m {
                match (k.as_str(), x) {
                    ("expr", serde_json::Value::String(s)) => out.push(s.clone()),
                    _ => collect_exprs(x, out),
                }
            }
        }
        serde_json::Value::Array(a) => a.iter().for_each(|x| collect_exprs(x, out)),
        _ => {}
    }
}
