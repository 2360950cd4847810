//! Small pure helpers of the Machine controller: condition lookup, boot
//! tokens and durations (conditions are set by [`crate::conditions`],
//! merge patches built by [`crate::patch`]).

use anneal_api::agent::Token;
use anneal_api::{Condition, Time};
use k8s_openapi::jiff::Timestamp;
use rand::RngCore;
use sha2::{Digest, Sha256};

/// Lowercase hex SHA-256 of a secret.
pub fn token_hash(secret: &str) -> String {
    hex::encode(Sha256::digest(secret.as_bytes()))
}

/// Mints a token from 32 random bytes (lowercase hex, 64 characters).
pub fn mint_token() -> Token {
    let mut bytes = [0u8; 32];
    rand::rng().fill_bytes(&mut bytes);
    let t = Token::new(hex::encode(bytes));
    bytes.fill(0);
    std::hint::black_box(&bytes);
    t
}

/// `now + secs` as a metav1.Time.
pub fn time_in(now: Timestamp, millis: i64) -> Time {
    Time(Timestamp::from_millisecond(now.as_millisecond().saturating_add(millis)).unwrap_or(now))
}

/// The status of a condition, if present.
pub fn condition<'a>(conditions: &'a [Condition], type_: &str) -> Option<&'a Condition> {
    conditions.iter().find(|c| c.type_ == type_)
}

/// Parses a Go-style duration (`90s`, `20m`, `1h30m`, `1.5h`) into
/// milliseconds.
pub fn parse_duration_ms(s: &str) -> Option<i64> {
    let mut total = 0f64;
    let mut rest = s.trim();
    if rest.is_empty() {
        return None;
    }
    while !rest.is_empty() {
        let num_end = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        let (num, tail) = rest.split_at(num_end);
        let value: f64 = num.parse().ok()?;
        let unit_end = tail
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(tail.len());
        let (unit, tail) = tail.split_at(unit_end);
        let factor = match unit {
            "ns" => 1e-6,
            "us" | "µs" => 1e-3,
            "ms" => 1.0,
            "s" => 1e3,
            "m" => 60e3,
            "h" => 3600e3,
            _ => return None,
        };
        total += value * factor;
        rest = tail;
    }
    if (0.0..1e15).contains(&total) {
        Some(total as i64)
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_32_random_bytes_and_hash_is_sha256() {
        let a = mint_token();
        let b = mint_token();
        assert_eq!(a.len(), 64);
        assert_ne!(a.expose(), b.expose());
        assert_eq!(
            token_hash("abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration_ms("20m"), Some(1_200_000));
        assert_eq!(parse_duration_ms("1h30m"), Some(5_400_000));
        assert_eq!(parse_duration_ms("1.5s"), Some(1500));
        assert_eq!(parse_duration_ms("5"), None);
        assert_eq!(parse_duration_ms("3d"), None);
    }
}
