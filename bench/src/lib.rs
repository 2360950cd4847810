//! What the benchmark programs share: where results go and how a ratio
//! against a reference measured in the same run is printed.
//!
//! Every program writes `target/bench/<name>.json` at the workspace root and
//! prints each ratio as `name: ours / reference = ratio`.

use std::path::PathBuf;

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ratio_needs_a_positive_reference() {
        assert_eq!(ratio(2.0, 4.0), Some(0.5));
        assert_eq!(ratio(2.0, 0.0), None);
        assert_eq!(ratio(f64::NAN, 1.0), None);
    }
}
