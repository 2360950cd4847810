//! metav1.Condition bookkeeping shared by the controllers.

use anneal_api::{Condition, Time};
use k8s_openapi::jiff::Timestamp;

/// Sets condition `type_` in `conditions` at the current time; see
/// [`set_at`].
pub fn set(
    conditions: &mut Vec<Condition>,
    type_: &str,
    status: bool,
    reason: &str,
    message: impl Into<String>,
    generation: Option<i64>,
) -> bool {
    set_at(
        conditions,
        type_,
        status,
        reason,
        message,
        generation,
        Timestamp::now(),
    )
}

/// Sets condition `type_` in `conditions`, `now` being the clock. The one
/// change rule of every controller: a change is reported when the status,
/// reason, message or observedGeneration changed; `lastTransitionTime`
/// moves (to `now`) only when the status changes, or when the condition is
/// new. Returns whether anything changed.
pub fn set_at(
    conditions: &mut Vec<Condition>,
    type_: &str,
    status: bool,
    reason: &str,
    message: impl Into<String>,
    generation: Option<i64>,
    now: Timestamp,
) -> bool {
    let status = if status { "True" } else { "False" };
    let message = message.into();
    if let Some(c) = conditions.iter_mut().find(|c| c.type_ == type_) {
        let changed = c.status != status
            || c.reason != reason
            || c.message != message
            || c.observed_generation != generation;
        if c.status != status {
            c.last_transition_time = Time(now);
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
        last_transition_time: Time(now),
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
    use anneal_api::conditions::{reasons, types};

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

    #[test]
    fn every_field_counts_but_only_status_moves_the_time() {
        let t0 = Timestamp::from_second(1_000).unwrap();
        let t1 = Timestamp::from_second(2_000).unwrap();
        let mut c = Vec::new();
        assert!(set_at(
            &mut c,
            types::BMC_REACHABLE,
            true,
            reasons::CONNECTED,
            "",
            Some(1),
            t0
        ));
        assert_eq!(c[0].last_transition_time, Time(t0));
        // message and generation changes are changes, at the same time
        assert!(set_at(
            &mut c,
            types::BMC_REACHABLE,
            true,
            reasons::CONNECTED,
            "x",
            Some(1),
            t1
        ));
        assert!(set_at(
            &mut c,
            types::BMC_REACHABLE,
            true,
            reasons::CONNECTED,
            "x",
            Some(2),
            t1
        ));
        assert!(!set_at(
            &mut c,
            types::BMC_REACHABLE,
            true,
            reasons::CONNECTED,
            "x",
            Some(2),
            t1
        ));
        assert_eq!(c[0].last_transition_time, Time(t0));
        assert!(set_at(
            &mut c,
            types::BMC_REACHABLE,
            false,
            reasons::BMC_UNREACHABLE,
            "",
            Some(2),
            t1
        ));
        assert_eq!(c[0].last_transition_time, Time(t1));
        assert_eq!(status(&c, types::BMC_REACHABLE), Some("False"));
    }
}
