//! What the benchmark programs share: where results go, how a ratio against
//! a reference measured in the same run is computed, medians, command-line
//! options, and the network-namespace and process-group code of the tests
//! (re-exported from `anneal-testinfra`, so a benchmark and a test set up
//! namespaces and daemons the same way and clean them up the same way).
//!
//! Every program writes `target/bench/<name>.json` at the workspace root and
//! prints each ratio as `name: ours / reference = ratio`.

use std::path::PathBuf;

pub use anneal_testinfra::{ChildGroup, Netns, run};

/// `target/bench` of the workspace (created when missing).
pub fn out_dir() -> std::io::Result<PathBuf> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/bench");
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

/// Writes `value` as pretty JSON to `target/bench/<name>.json` and says so.
pub fn write_json(name: &str, value: &serde_json::Value) -> anyhow::Result<PathBuf> {
    let path = out_dir()?.join(format!("{name}.json"));
    std::fs::write(&path, serde_json::to_vec_pretty(value)?)?;
    println!("wrote {}", path.display());
    Ok(path)
}

/// `ours / reference`, or `None` when the reference is not a positive time.
pub fn ratio(ours: f64, reference: f64) -> Option<f64> {
    (reference > 0.0 && ours.is_finite() && reference.is_finite()).then(|| ours / reference)
}

/// The load average of the machine, for the record of a run.
pub fn load_average() -> Option<String> {
    let l = std::fs::read_to_string("/proc/loadavg").ok()?;
    Some(l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
}

/// The median of `v` (sorted in place); NaN when `v` is empty.
pub fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// Whether the program was started with `--name`.
pub fn flag(name: &str) -> bool {
    std::env::args().skip(1).any(|a| a == name)
}

/// The value of option `--name`, given as `--name=value` or `--name value`.
pub fn option(name: &str) -> Option<String> {
    option_in(std::env::args().skip(1), name)
}

fn option_in(mut args: impl Iterator<Item = String>, name: &str) -> Option<String> {
    while let Some(a) = args.next() {
        if a == name {
            return args.next();
        }
        if let Some(v) = a.strip_prefix(name).and_then(|r| r.strip_prefix('=')) {
            return Some(v.to_owned());
        }
    }
    None
}

/// The value of option `--name` parsed, `default` when absent; a value that
/// does not parse is an error naming the option.
pub fn option_or<T: std::str::FromStr>(name: &str, default: T) -> anyhow::Result<T>
where
    T::Err: std::fmt::Display,
{
    match option(name) {
        None => Ok(default),
        Some(v) => v.parse().map_err(|e| anyhow::anyhow!("{name} {v:?}: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ratio_needs_a_positive_reference() {
        assert_eq!(ratio(2.0, 4.0), Some(0.5));
        assert_eq!(ratio(2.0, 0.0), None);
        assert_eq!(ratio(f64::NAN, 1.0), None);
    }

    #[test]
    fn median_of_odd_even_and_empty() {
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut [4.0, 1.0, 3.0, 2.0]), 3.0);
        assert!(median(&mut []).is_nan());
    }

    #[test]
    fn options_in_both_spellings() {
        let args = |v: &[&str]| {
            v.iter()
                .map(|s| (*s).to_owned())
                .collect::<Vec<_>>()
                .into_iter()
        };
        assert_eq!(
            option_in(args(&["--runs=3"]), "--runs").as_deref(),
            Some("3")
        );
        assert_eq!(
            option_in(args(&["--quick", "--runs", "4"]), "--runs").as_deref(),
            Some("4")
        );
        assert_eq!(option_in(args(&["--runsx=3", "--runs"]), "--runs"), None);
        assert_eq!(option_in(args(&["--only=tftp"]), "--runs"), None);
    }
}
