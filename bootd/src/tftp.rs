//! Read-only TFTP of the configured first-stage files only (async-tftp:
//! blksize, tsize, timeout, windowsize).

use std::net::SocketAddr;
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use async_tftp::packet;
use async_tftp::server::{Handler, TftpServerBuilder};
use futures::io::{AsyncRead, Cursor};

use crate::metrics::ReasonLabels;
use crate::state::Shared;

/// Errors of starting the TFTP server.
#[derive(Debug, thiserror::Error)]
pub enum TftpError {
    #[error("starting the tftp server")]
    Start(#[source] async_tftp::Error),
}

/// A file in memory whose reads are counted.
#[derive(Debug)]
pub struct CountingReader {
    inner: Cursor<Vec<u8>>,
    shared: Arc<Shared>,
}

impl AsyncRead for CountingReader {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut [u8],
    ) -> Poll<std::io::Result<usize>> {
        let p = Pin::new(&mut self.inner).poll_read(cx, buf);
        if let Poll::Ready(Ok(n)) = &p {
            self.shared.metrics.tftp_bytes.inc_by(*n as u64);
        }
        p
    }
}

/// Serves only names listed in the snapshot's `files`.
#[derive(Debug)]
pub struct FilesHandler {
    shared: Arc<Shared>,
}

fn count(shared: &Shared, reason: &str) {
    shared
        .metrics
        .tftp_requests
        .get_or_create(&ReasonLabels {
            reason: reason.into(),
        })
        .inc();
}

impl Handler for FilesHandler {
    type Reader = CountingReader;
    type Writer = futures::io::Sink;

    async fn read_req_open(
        &mut self,
        client: &SocketAddr,
        path: &Path,
    ) -> Result<(Self::Reader, Option<u64>), packet::Error> {
        let name = path.to_string_lossy();
        let name = name.trim_start_matches('/');
        let snap = self.shared.snapshot();
        let Some(file) = snap.files.get(name) else {
            let why = if name.contains("..") {
                "path traversal refused"
            } else {
                "not a configured first-stage file"
            };
            count(&self.shared, "refused");
            tracing::info!(%client, file = %name, why, "tftp read refused");
            return Err(packet::Error::FileNotFound);
        };
        match std::fs::read(file) {
            Ok(bytes) => {
                count(&self.shared, "served");
                let len = bytes.len() as u64;
                tracing::info!(%client, file = %name, bytes = len, "tftp read");
                Ok((
                    CountingReader {
                        inner: Cursor::new(bytes),
                        shared: self.shared.clone(),
                    },
                    Some(len),
                ))
            }
            Err(e) => {
                count(&self.shared, "error");
                tracing::warn!(%client, file = %name, error = %e, "tftp file unreadable");
                Err(packet::Error::FileNotFound)
            }
        }
    }

    async fn write_req_open(
        &mut self,
        client: &SocketAddr,
        path: &Path,
        _size: Option<u64>,
    ) -> Result<Self::Writer, packet::Error> {
        count(&self.shared, "write_refused");
        tracing::info!(%client, file = %path.display(), why = "read-only server", "tftp write refused");
        Err(packet::Error::IllegalOperation)
    }
}

/// Builds a server on an already bound socket.
pub async fn server(
    shared: Arc<Shared>,
    socket: std::net::UdpSocket,
) -> Result<async_tftp::server::TftpServer<FilesHandler>, TftpError> {
    TftpServerBuilder::with_handler(FilesHandler { shared })
        .std_socket(socket)
        .map_err(TftpError::Start)?
        .block_size_limit(1468)
        .window_size_limit(64)
        .build()
        .await
        .map_err(TftpError::Start)
}
