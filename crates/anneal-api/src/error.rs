//! One formatter for an error and its causes.

use std::error::Error;

/// `error: cause: cause…` on one line: the error's message, then each
/// [`Error::source`] in turn. For logs, console lines and status messages,
/// where the innermost cause (an errno, a TLS alert) is usually the useful part.
pub fn error_chain(e: &dyn Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    enum Outer {
        #[error("lease file {path}")]
        Write {
            path: &'static str,
            #[source]
            source: Middle,
        },
        #[error("no cause")]
        Leaf,
    }

    #[derive(Debug, thiserror::Error)]
    #[error("writing")]
    struct Middle(#[source] std::io::Error);

    #[test]
    fn joins_every_cause_in_order() {
        let e = Outer::Write {
            path: "/var/lib/leases",
            source: Middle(std::io::Error::other("disk full")),
        };
        assert_eq!(
            error_chain(&e),
            "lease file /var/lib/leases: writing: disk full"
        );
    }

    #[test]
    fn an_error_without_source_is_its_message() {
        assert_eq!(error_chain(&Outer::Leaf), "no cause");
    }
}
