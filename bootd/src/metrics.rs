//! Prometheus metrics: no per-machine labels, fixed label values.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PacketLabels {
    /// DHCP message type of the request (`discover`, `request`, ...).
    pub msg_type: String,
    /// `offer`, `ack`, `nak`, `update`, or `drop_<reason>`.
    pub outcome: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    pub reason: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct HttpLabels {
    /// `script`, `kernel`, `initrd`, `file`, `metrics`, `other`.
    pub kind: String,
    pub code: u16,
}

/// Every metric bootd exports.
#[derive(Debug, Default)]
pub struct Metrics {
    pub packets: Family<PacketLabels, Counter>,
    pub malformed: Family<ReasonLabels, Counter>,
    pub leases_active: Gauge,
    pub leases_collected: Counter,
    /// Lease file writes (journal append or compaction) that failed.
    pub lease_write_failures: Counter,
    /// 1 while the lease file is written, 0 while a write failed.
    pub lease_file_durable: Gauge,
    /// ACKs sent while serving leases from memory (the lease file could
    /// not be written since start-up).
    pub acks_not_durable: Counter,
    /// Answers broadcast although RFC 2131 4.1 unicasts them, by reason.
    pub unicast_fallback: Family<ReasonLabels, Counter>,
    pub tftp_bytes: Counter,
    pub tftp_requests: Family<ReasonLabels, Counter>,
    pub http_bytes: Counter,
    pub http_requests: Family<HttpLabels, Counter>,
    /// HTTP connections open now.
    pub http_connections: Gauge,
    /// HTTP connections closed by a deadline: `header_deadline`, `stall`.
    pub http_closed: Family<ReasonLabels, Counter>,
}

impl Metrics {
    /// Renders the text exposition format.
    pub fn render(&self) -> String {
        let mut r = Registry::with_prefix("bootd");
        r.register(
            "dhcp_packets",
            "DHCP requests by message type and outcome",
            self.packets.clone(),
        );
        r.register(
            "dhcp_malformed",
            "Datagrams dropped as malformed, by reason",
            self.malformed.clone(),
        );
        r.register(
            "dhcp_leases_active",
            "Unexpired leases",
            self.leases_active.clone(),
        );
        r.register(
            "dhcp_leases_collected",
            "Expired leases removed from the lease table",
            self.leases_collected.clone(),
        );
        r.register(
            "lease_file_write_failures",
            "Lease file writes (journal append or compaction) that failed; retried every second",
            self.lease_write_failures.clone(),
        );
        r.register(
            "lease_file_durable",
            "1 while lease changes are written before ACKs leave, 0 while the lease file fails to write",
            self.lease_file_durable.clone(),
        );
        r.register(
            "dhcp_acks_not_durable",
            "ACKs sent while serving leases from memory (lease file not writable since start-up)",
            self.acks_not_durable.clone(),
        );
        r.register(
            "dhcp_unicast_fallback",
            "OFFERs and ACKs broadcast because the client's neighbour entry could not be set",
            self.unicast_fallback.clone(),
        );
        r.register(
            "tftp_bytes",
            "Bytes served over TFTP",
            self.tftp_bytes.clone(),
        );
        r.register(
            "tftp_requests",
            "TFTP read requests by outcome",
            self.tftp_requests.clone(),
        );
        r.register(
            "http_bytes",
            "Bytes served over HTTP",
            self.http_bytes.clone(),
        );
        r.register(
            "http_requests",
            "HTTP requests by kind and status",
            self.http_requests.clone(),
        );
        r.register(
            "http_connections",
            "HTTP connections open",
            self.http_connections.clone(),
        );
        r.register(
            "http_closed",
            "HTTP connections closed by a deadline, by reason",
            self.http_closed.clone(),
        );
        let mut out = String::new();
        if prometheus_client::encoding::text::encode(&mut out, &r).is_err() {
            out.clear();
        }
        out
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::panic)]
    use super::*;

    /// Every metric bootd renders (`# TYPE NAME TYPE`) has a row in
    /// docs/metrics.md with that type (a counter as `NAME_total`).
    #[test]
    fn every_metric_is_in_docs_metrics_md_with_its_type() {
        let page = std::fs::read_to_string(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/metrics.md"),
        )
        .unwrap();
        // a family renders only once it has a sample
        let m = Metrics::default();
        let reason = || ReasonLabels { reason: "x".into() };
        m.packets
            .get_or_create(&PacketLabels {
                msg_type: "discover".into(),
                outcome: "offer".into(),
            })
            .inc();
        m.malformed.get_or_create(&reason()).inc();
        m.unicast_fallback.get_or_create(&reason()).inc();
        m.tftp_requests.get_or_create(&reason()).inc();
        m.http_closed.get_or_create(&reason()).inc();
        m.http_requests
            .get_or_create(&HttpLabels {
                kind: "script".into(),
                code: 200,
            })
            .inc();
        let text = m.render();
        let mut seen = 0;
        for line in text.lines() {
            let Some(rest) = line.strip_prefix("# TYPE ") else {
                continue;
            };
            let (name, kind) = rest.split_once(' ').unwrap();
            let queried = if kind == "counter" {
                format!("{name}_total")
            } else {
                name.to_string()
            };
            let row = format!("| `{queried}` | {kind} |");
            assert!(
                page.lines().any(|l| l.starts_with(&row)),
                "docs/metrics.md has no row starting {row:?}"
            );
            seen += 1;
        }
        assert_eq!(seen, 14, "{text}");
    }
}
