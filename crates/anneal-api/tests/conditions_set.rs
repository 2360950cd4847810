//! Every condition type and reason declared in `anneal_api::conditions`
//! (`pub mod types`, `pub mod reasons`) is set somewhere in the code: a
//! declared constant nobody writes is a promise of docs/api.md nobody keeps.
//!
//! The declarations are parsed from `crates/anneal-api/src/conditions.rs`
//! (`pub const NAME: &str = "Value";`). The non-test Rust sources of the
//! workspace (manager, bootd, agent, cli, crates/*; each file cut at its
//! first `#[cfg(test)]`, conditions.rs itself skipped) count as a use:
//! `types::NAME` / `reasons::NAME` (also through `conditions::`), or the
//! value written as a literal where a condition or an Event is set
//! (`reason: "X"`, `type_: "X"`, `EventType::…, "X"`,
//! `conditions::set(…, "X", …)`, …). A constant referenced only from
//! tests counts as not set.
#![allow(clippy::expect_used, clippy::panic)]
#![allow(clippy::too_many_lines)]

use std::path::{Path, PathBuf};

use regex::Regex;

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// One `pub const NAME: &str = "Value";` of `pub mod <module>`.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Declared {
    module: String,
    name: String,
    value: String,
    line: usize,
}

/// The `&str` constants of `pub mod <module> { … }` in `src`.
fn declarations(src: &str, module: &str) -> Vec<Declared> {
    let start = format!("pub mod {module} {{");
    let Some(begin) = src.find(&start) else {
        return Vec::new();
    };
    let body_start = begin + start.len();
    let body_len = src[body_start..]
        .find("\n}")
        .unwrap_or(src.len() - body_start);
    let body = &src[body_start..body_start + body_len];
    let first_line = src[..body_start].lines().count();
    let decl =
        Regex::new(r#"(?s)pub const ([A-Z][A-Z0-9_]*): &str =\s*"([^"]*)";"#).expect("pattern");
    decl.captures_iter(body)
        .map(|c| {
            let at = c.get(0).map_or(0, |m| m.start());
            Declared {
                module: module.to_string(),
                name: c[1].to_string(),
                value: c[2].to_string(),
                line: first_line + body[..at].matches('\n').count(),
            }
        })
        .collect()
}

/// The patterns of which one match in a source's non-test part counts as
/// setting `d`.
fn use_patterns(d: &Declared) -> Vec<Regex> {
    // A path to the constant (`types::READY`, `conditions::reasons::BOUND`).
    let path = format!(
        r"(?:^|[^A-Za-z0-9_]){}::{}\b",
        regex::escape(&d.module),
        regex::escape(&d.name)
    );
    // The value written in place where a condition or an Event is set.
    let lit = format!(r#""{}""#, regex::escape(&d.value));
    [
        path,
        format!(r"\breason:\s*{lit}"),
        format!(r"\btype_:\s*{lit}"),
        format!(r#""(?:reason|type)":\s*{lit}"#),
        format!(r"EventType::\w+,\s*{lit}"),
        format!(r"Failure::new\(\s*{lit}"),
        // The manager's setters (`conditions::set(…, "Type", ok, "Reason", …)`)
        // and the per-kind helpers built on them.
        format!(r"(?:\bconditions::set\w*|\bset_\w*condition\w*|\bcondition\w*)\((?s:[^;]*?){lit}"),
    ]
    .iter()
    .map(|p| Regex::new(p).expect("pattern"))
    .collect()
}

/// Declared constants no source sets, as `file:line module::NAME ("Value")`.
fn unused(declared: &[Declared], sources: &[(String, String)], decl_file: &str) -> Vec<String> {
    declared
        .iter()
        .filter(|d| {
            let patterns = use_patterns(d);
            !sources
                .iter()
                .any(|(_, code)| patterns.iter().any(|p| p.is_match(code)))
        })
        .map(|d| {
            format!(
                "{decl_file}:{} {}::{} ({:?})",
                d.line, d.module, d.name, d.value
            )
        })
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

/// A source file up to its first test-only item (`#[cfg(test)]`,
/// `#[cfg(all(test, …))]`): crude, test modules come last by convention.
fn non_test_part(text: &str) -> &str {
    let cut = ["#[cfg(test)]", "#[cfg(all(test"]
        .iter()
        .filter_map(|m| text.find(m))
        .min()
        .unwrap_or(text.len());
    &text[..cut]
}

/// The non-test part of every workspace source file but conditions.rs.
fn workspace_sources() -> Vec<(String, String)> {
    let root = repo_root();
    // `<top>/src` and the `src` of the crates one level below (crates/*,
    // bootd/anneal-dhcp, …).
    let mut dirs = Vec::new();
    for top in ["manager", "bootd", "agent", "cli", "crates"] {
        let top = root.join(top);
        dirs.push(top.join("src"));
        let subs =
            std::fs::read_dir(&top).unwrap_or_else(|e| panic!("listing {}: {e}", top.display()));
        for sub in subs {
            dirs.push(sub.expect("directory entry").path().join("src"));
        }
    }
    dirs.retain(|d| d.is_dir());
    let mut files = Vec::new();
    for d in &dirs {
        rust_files(d, &mut files);
    }
    assert!(files.len() > 50, "found only {} source files", files.len());
    files
        .into_iter()
        .filter(|f| !f.ends_with("anneal-api/src/conditions.rs"))
        .map(|f| {
            let text = std::fs::read_to_string(&f)
                .unwrap_or_else(|e| panic!("reading {}: {e}", f.display()));
            let code = non_test_part(&text).to_string();
            let rel = f.strip_prefix(&root).unwrap_or(&f).display().to_string();
            (rel, code)
        })
        .collect()
}

#[test]
fn every_declared_condition_type_and_reason_is_set_somewhere() {
    let decl_file = "crates/anneal-api/src/conditions.rs";
    let src = std::fs::read_to_string(repo_root().join(decl_file)).expect("conditions.rs");
    let mut declared = declarations(&src, "types");
    let types = declared.len();
    declared.extend(declarations(&src, "reasons"));
    assert!(
        types > 5 && declared.len() - types > 20,
        "parsed only {types} types and {} reasons from {decl_file}: fix this test's parser",
        declared.len() - types
    );
    // Every constant of the ALL lists is parsed (so nothing escapes the check).
    for v in anneal_api::conditions::types::ALL
        .iter()
        .chain(anneal_api::conditions::reasons::ALL)
    {
        assert!(
            declared.iter().any(|d| d.value == *v),
            "{v:?} is in ALL but this test did not parse its declaration"
        );
    }
    let sources = workspace_sources();
    let missing = unused(&declared, &sources, decl_file);
    assert!(
        missing.is_empty(),
        "declared in {decl_file} but set nowhere in the non-test code:\n  {}\n\
         set it where docs/api.md promises, or remove it from conditions.rs and docs/api.md \
         (and its docs/troubleshooting.md entry)",
        missing.join("\n  ")
    );
}

/// The check itself can fail: a fake declaration no fake source sets is
/// reported, one that is set is not.
#[test]
fn an_unset_declaration_is_reported() {
    let src = "//! fake\n\
               pub mod types {\n\
               \x20   /// doc\n\
               \x20   pub const READY: &str = \"Ready\";\n\
               \x20   pub const NEVER: &str = \"Never\";\n\
               }\n\
               pub mod reasons {\n\
               \x20   pub const SET_BY_PATH: &str = \"SetByPath\";\n\
               \x20   pub const SET_BY_LITERAL: &str = \"SetByLiteral\";\n\
               \x20   pub const EVENT_LITERAL: &str = \"EventLiteral\";\n\
               \x20   pub const ONLY_IN_TESTS: &str = \"OnlyInTests\";\n\
               \x20   pub const LONG: &str =\n        \"LongValue\";\n\
               }\n";
    let mut declared = declarations(src, "types");
    declared.extend(declarations(src, "reasons"));
    assert_eq!(declared.len(), 7, "{declared:?}");
    assert_eq!(declared[1].name, "NEVER");
    assert_eq!(declared[1].line, 5);
    assert_eq!(declared[6].value, "LongValue");

    let file = |code: &str| {
        let code = non_test_part(code);
        ("manager/src/fake.rs".to_string(), code.to_string())
    };
    let sources = vec![
        file("set_condition(&mut c, types::READY, true, reasons::SET_BY_PATH, \"\");"),
        file(
            "conditions::set(&mut c, \"Ready\", true, \"SetByLiteral\", m, g);\n\
             recorder.event(EventType::Normal, \"EventLiteral\", note);\n\
             let x = anneal_api::conditions::reasons::LONG;\n\
             #[cfg(test)]\nmod tests { const _: &str = reasons::ONLY_IN_TESTS; }\n",
        ),
        // A bare mention of a value (a log line, another kind's field) does
        // not count; nor does a longer name with the constant as prefix.
        file("info!(\"Never mind\"); let y = \"Never\"; types::NEVER_AGAIN;"),
    ];
    let missing = unused(&declared, &sources, "conditions.rs");
    assert_eq!(
        missing,
        vec![
            "conditions.rs:5 types::NEVER (\"Never\")".to_string(),
            "conditions.rs:11 reasons::ONLY_IN_TESTS (\"OnlyInTests\")".to_string(),
        ]
    );
}
