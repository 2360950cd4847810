//! metav1.Condition bookkeeping shared by the controllers.

use anneal_api::{Condition, Time};
use k8s_openapi::jiff::Timestamp;

/// Sets condition `type_` in `conditions`, keeping `lastTransitionTime` when
/// the status does not change. Returns whether anything changed.
pub fn set(
    conditions: &mut Vec<Condition>,
    type_: &str,
    status: bool,
    reason: &str,
    message: impl Into<String>,
    generation: Option<i64>,
) -> bool {
    let status = if status { "True" } else { "False" };
    let message = message.into();
    if let Some(c) = conditions.iter_mut().find(|c| c.type_ == type_) {
        let changed = c.status != status
            || c.reason != reason
            || c.message != message
            || c.observed_generation != generation;
        if c.status != status {
            c.last_transition_time = Time(Timestamp::now());
        }
        c.status = status.to_string();
        c.reason = reason.to_string();
        c.message = message;
        c.observed_generation = generation;
        return changed;
    }
    conditions.push(Condition {
        type_: type_.to_string(),
        status: status.to_string(),
        reason: reason.to_string(),
        message,
        observed_generation: generation,
        last_transition_time: Time(Timestamp::now()),
    });
    true
}

/// The status of condition `type_`, if present.
pub fn status<'a>(conditions: &'a [Condition], type_: &str) -> Option<&'a str> {
    conditions
        .iter()
        .find(|c| c.type_ == type_)
        .map(|c| c.status.as_str())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn transition_time_kept_when_status_unchanged() {
        let mut c = Vec::new();
        assert!(set(&mut c, "Bound", false, "Pending", "waiting", Some(1)));
        let t0 = c[0].last_transition_time.clone();
        assert!(set(&mut c, "Bound", false, "NoMatch", "none", Some(1)));
        assert_eq!(c[0].last_transition_time, t0);
        assert!(!set(&mut c, "Bound", false, "NoMatch", "none", Some(1)));
        assert!(set(&mut c, "Bound", true, "Bound", "ok", Some(1)));
        assert_eq!(status(&c, "Bound"), Some("True"));
        assert_eq!(c.len(), 1);
    }
}
