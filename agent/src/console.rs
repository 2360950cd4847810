//! Timestamped, human-readable console lines: one per step, stamped with the
//! seconds since the kernel booted (the clock dmesg uses), so a serial log
//! reads as a timeline from firmware to registration.

use std::io::Write;
use std::time::Duration;

use nix::time::{ClockId, clock_gettime};

/// Time since boot (CLOCK_BOOTTIME), zero if the clock is unavailable.
pub fn uptime() -> Duration {
    clock_gettime(ClockId::CLOCK_BOOTTIME)
        .map(Duration::from)
        .unwrap_or_default()
}

/// Formats one console line (pure, for tests).
pub fn format_line(at: Duration, msg: &str) -> String {
    format!(
        "[{:>4}.{:03}] anneal: {msg}",
        at.as_secs(),
        at.subsec_millis()
    )
}

/// Writes one line to stderr (the console when running as PID 1).
pub fn say(msg: &str) {
    let line = format_line(uptime(), msg);
    let mut err = std::io::stderr().lock();
    // A console that cannot be written to leaves nothing better to do.
    let _ = writeln!(err, "{line}");
    let _ = err.flush();
}

/// `say!("driver loaded: {}", name)`.
#[macro_export]
macro_rules! say {
    ($($arg:tt)*) => { $crate::console::say(&format!($($arg)*)) };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn line_format() {
        assert_eq!(
            format_line(Duration::from_millis(21_437), "link up on eth0"),
            "[  21.437] anneal: link up on eth0"
        );
        assert_eq!(
            format_line(Duration::from_millis(12_345_678), "x"),
            "[12345.678] anneal: x"
        );
    }
}
