//! Progress display: bars redrawn in place on a terminal, plain lines
//! otherwise (a pipe, a file, CI logs).
//!
//! On a terminal a [`Board`] owns the last lines it drew and redraws them
//! (cursor up, clear line) at most every [`REDRAW`]; off a terminal the
//! callers print one line per change they consider worth a line.

use std::io::Write;
use std::time::{Duration, Instant};

/// Shortest interval between two redraws of a terminal board.
pub const REDRAW: Duration = Duration::from_millis(100);

/// Width of a bar, in cells.
pub const BAR_CELLS: usize = 30;

/// `[#########.........]` for `percent` (0..=100).
pub fn bar(percent: u64) -> String {
    let p = usize::try_from(percent.min(100)).unwrap_or(100);
    let full = p * BAR_CELLS / 100;
    format!("[{}{}]", "#".repeat(full), ".".repeat(BAR_CELLS - full))
}

/// Bytes in binary units with one decimal (`256.0 MiB`).
#[allow(clippy::cast_precision_loss)]
pub fn bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", UNITS[unit])
    }
}

/// A rate in MiB/s with one decimal.
#[allow(clippy::cast_precision_loss)]
pub fn rate(bytes: u64, elapsed: Duration) -> String {
    let secs = elapsed.as_secs_f64();
    if secs <= 0.0 {
        return "- MiB/s".into();
    }
    format!("{:.1} MiB/s", bytes as f64 / secs / f64::from(1u32 << 20))
}

/// The remaining time at the average rate so far (`ETA 1m05s`).
#[allow(
    clippy::cast_precision_loss,
    clippy::cast_possible_truncation,
    clippy::cast_sign_loss
)]
pub fn eta(done: u64, total: u64, elapsed: Duration) -> String {
    if done == 0 || done >= total {
        return if done >= total {
            "ETA 0s".into()
        } else {
            "ETA -".into()
        };
    }
    let secs = elapsed.as_secs_f64() * (total - done) as f64 / done as f64;
    format!("ETA {}", duration(Duration::from_secs(secs.ceil() as u64)))
}

/// `1h02m03s`, `2m05s`, `7s`.
pub fn duration(d: Duration) -> String {
    let s = d.as_secs();
    match (s / 3600, (s % 3600) / 60, s % 60) {
        (0, 0, s) => format!("{s}s"),
        (0, m, s) => format!("{m}m{s:02}s"),
        (h, m, s) => format!("{h}h{m:02}m{s:02}s"),
    }
}

/// Whole percent of `done` in `total` (0 when `total` is 0).
pub fn percent(done: u64, total: u64) -> u64 {
    done.min(total)
        .saturating_mul(100)
        .checked_div(total)
        .unwrap_or(0)
}

/// A block of lines redrawn in place on a terminal.
#[derive(Debug, Default)]
pub struct Board {
    drawn: usize,
    last: Option<Instant>,
}

impl Board {
    /// Redraws `lines` over what was drawn before, unless the last redraw
    /// is younger than [`REDRAW`] and `force` is false; returns whether it
    /// drew (a caller that was refused draws again on its next tick).
    pub fn draw(
        &mut self,
        out: &mut dyn Write,
        lines: &[String],
        force: bool,
    ) -> std::io::Result<bool> {
        if !force && self.last.is_some_and(|t| t.elapsed() < REDRAW) {
            return Ok(false);
        }
        self.last = Some(Instant::now());
        if self.drawn > 0 {
            write!(out, "\x1b[{}A", self.drawn)?;
        }
        for l in lines {
            write!(out, "\r\x1b[2K{l}\n")?;
        }
        // Lines left over from a taller block.
        for _ in lines.len()..self.drawn {
            write!(out, "\r\x1b[2K\n")?;
        }
        let extra = self.drawn.saturating_sub(lines.len());
        if extra > 0 {
            write!(out, "\x1b[{extra}A")?;
        }
        self.drawn = lines.len();
        out.flush()?;
        Ok(true)
    }

    /// When the board was last drawn.
    pub fn last_drawn(&self) -> Option<Instant> {
        self.last
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats() {
        assert_eq!(bytes(512), "512 B");
        assert_eq!(bytes(256 << 20), "256.0 MiB");
        assert_eq!(bytes(3 << 30), "3.0 GiB");
        assert_eq!(bar(0), format!("[{}]", ".".repeat(BAR_CELLS)));
        assert_eq!(bar(100), format!("[{}]", "#".repeat(BAR_CELLS)));
        assert_eq!(bar(50).matches('#').count(), BAR_CELLS / 2);
        assert_eq!(duration(Duration::from_secs(7)), "7s");
        assert_eq!(duration(Duration::from_secs(125)), "2m05s");
        assert_eq!(duration(Duration::from_secs(3723)), "1h02m03s");
        assert_eq!(eta(50, 100, Duration::from_secs(10)), "ETA 10s");
        assert_eq!(eta(0, 100, Duration::from_secs(10)), "ETA -");
        assert_eq!(rate(10 << 20, Duration::from_secs(2)), "5.0 MiB/s");
        assert_eq!(percent(1, 3), 33);
        assert_eq!(percent(5, 0), 0);
    }

    #[test]
    fn board_redraws_in_place() {
        let mut b = Board::default();
        let mut out = Vec::new();
        b.draw(&mut out, &["a".into(), "b".into()], true).unwrap();
        b.draw(&mut out, &["c".into()], true).unwrap();
        let s = String::from_utf8(out).unwrap();
        assert_eq!(
            s,
            "\r\x1b[2Ka\n\r\x1b[2Kb\n\x1b[2A\r\x1b[2Kc\n\r\x1b[2K\n\x1b[1A"
        );
    }
}
