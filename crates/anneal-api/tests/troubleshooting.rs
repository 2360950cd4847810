//! docs/troubleshooting.md has an entry (`### \`Reason\``) for every
//! condition and Event reason the code can write, and none for a reason the
//! code no longer has.
//!
//! The reasons come from two places: the lists in
//! `anneal_api::conditions` (`reasons::ALL`, `reasons::WORKLOAD_FAILURES`,
//! `events::ALL`; a unit test there checks the lists are complete), and a scan
//! of the manager, agent and bootd sources for reason literals written in
//! place (`reason: "X"`, `Failure::new("X", …)`, `event(EventType::…, "X", …)`,
//! `let reason = … "X" …;`, the arms of a `fn reason(`), so a new literal
//! reason fails this test until the page explains it.
#![allow(clippy::expect_used, clippy::panic)]
#![allow(clippy::too_many_lines)]

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use anneal_api::conditions::{events, reasons};
use regex::Regex;

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The reasons documented on the page: every `### \`Reason\`` heading.
fn documented() -> BTreeSet<String> {
    let path = repo_root().join("docs/troubleshooting.md");
    let page = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    page.lines()
        .filter_map(|l| l.strip_prefix("### `"))
        .filter_map(|l| l.split('`').next())
        .map(str::to_string)
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

/// Reason literals written in place in the non-test part of the sources.
fn scanned() -> BTreeSet<(String, String)> {
    let word = r#""([A-Z][A-Za-z0-9]+)""#;
    let direct: Vec<Regex> = [
        format!(r"reason:\s*{word}"),
        format!(r#""reason":\s*{word}"#),
        format!(r"Failure::new\(\s*{word}"),
        format!(r"EventType::\w+,\s*{word}"),
        format!(r"\(\s*{word},\s*format!"),
    ]
    .iter()
    .map(|p| Regex::new(p).expect("pattern"))
    .collect();
    // Statements and functions whose every literal is a reason.
    let blocks = [
        Regex::new(r"(?s)let reason = (?:if|match)\b.*?;\n").expect("pattern"),
        Regex::new(r"(?s)fn reason\(self\) -> &'static str \{.*?\n    \}\n").expect("pattern"),
    ];
    let literal = Regex::new(word).expect("pattern");

    let root = repo_root();
    let mut files = Vec::new();
    for dir in ["manager/src", "agent/src", "bootd/src"] {
        rust_files(&root.join(dir), &mut files);
    }
    assert!(files.len() > 20, "found only {} source files", files.len());
    let mut out = BTreeSet::new();
    for f in files {
        let text = std::fs::read_to_string(&f).expect("source file");
        let code = text.split("#[cfg(test)]").next().unwrap_or_default();
        let rel = f.strip_prefix(&root).unwrap_or(&f).display().to_string();
        for re in &direct {
            for c in re.captures_iter(code) {
                out.insert((c[1].to_string(), rel.clone()));
            }
        }
        for re in &blocks {
            for m in re.find_iter(code) {
                for c in literal.captures_iter(m.as_str()) {
                    out.insert((c[1].to_string(), rel.clone()));
                }
            }
        }
    }
    out
}

#[test]
fn every_reason_in_the_code_has_an_entry_and_every_entry_a_reason() {
    let page = documented();
    let mut code: BTreeSet<String> = reasons::ALL
        .iter()
        .chain(reasons::WORKLOAD_FAILURES)
        .chain(events::ALL)
        .map(|s| s.to_string())
        .collect();
    let found = scanned();
    // The scan must see the literals this test was written against.
    for known in [
        "MachineCordoned",
        "HTTPError",
        "TaintApplied",
        "InspectionTimedOut",
    ] {
        assert!(
            found.iter().any(|(r, _)| r == known),
            "the source scan no longer finds {known}: fix the patterns of this test"
        );
    }
    let mut missing = Vec::new();
    for (reason, file) in &found {
        if !page.contains(reason) {
            missing.push(format!("{reason} (written in {file})"));
        }
        code.insert(reason.clone());
    }
    for r in &code {
        if !page.contains(r) && !missing.iter().any(|m| m.starts_with(&format!("{r} "))) {
            missing.push(format!("{r} (anneal_api::conditions)"));
        }
    }
    assert!(
        missing.is_empty(),
        "docs/troubleshooting.md has no `### `Reason`` entry for:\n  {}\nadd one (what it means, what to check, what to do)",
        missing.join("\n  ")
    );
    let stale: Vec<_> = page.difference(&code).collect();
    assert!(
        stale.is_empty(),
        "docs/troubleshooting.md documents reasons the code no longer writes: {stale:?} (remove the entries or the reason was renamed)"
    );
}
