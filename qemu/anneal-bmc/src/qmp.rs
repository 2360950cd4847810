//! A minimal QMP client: one connection per command sequence, greeting and
//! capabilities negotiation, asynchronous events skipped.

use std::path::{Path, PathBuf};

use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixStream;
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};

/// QMP failures.
#[derive(Debug, thiserror::Error)]
pub enum QmpError {
    /// The socket cannot be reached or broke.
    #[error("qmp socket {path} failed")]
    Io {
        /// socket path
        path: PathBuf,
        /// cause
        #[source]
        source: std::io::Error,
    },
    /// QEMU closed the connection.
    #[error("qmp connection closed")]
    Closed,
    /// A line that is not JSON.
    #[error("qmp sent invalid json")]
    Json(#[source] serde_json::Error),
    /// QEMU refused a command.
    #[error("qmp command {command} failed: {desc}")]
    Command {
        /// command
        command: String,
        /// QEMU's description
        desc: String,
    },
}

/// An open, negotiated QMP session.
#[derive(Debug)]
pub struct Qmp {
    path: PathBuf,
    reader: BufReader<OwnedReadHalf>,
    writer: OwnedWriteHalf,
}

impl Qmp {
    /// Connects and negotiates capabilities.
    pub async fn connect(path: &Path) -> Result<Self, QmpError> {
        let io = |source| QmpError::Io {
            path: path.to_path_buf(),
            source,
        };
        let stream = UnixStream::connect(path).await.map_err(io)?;
        let (r, w) = stream.into_split();
        let mut qmp = Self {
            path: path.to_path_buf(),
            reader: BufReader::new(r),
            writer: w,
        };
        let greeting = qmp.read_message().await?;
        if greeting.get("QMP").is_none() {
            return Err(QmpError::Closed);
        }
        qmp.execute("qmp_capabilities", None).await?;
        Ok(qmp)
    }

    async fn read_message(&mut self) -> Result<Value, QmpError> {
        let mut line = String::new();
        let n = self
            .reader
            .read_line(&mut line)
            .await
            .map_err(|source| QmpError::Io {
                path: self.path.clone(),
                source,
            })?;
        if n == 0 {
            return Err(QmpError::Closed);
        }
        serde_json::from_str(&line).map_err(QmpError::Json)
    }

    /// Runs one command and returns its `return` value.
    pub async fn execute(&mut self, command: &str, args: Option<Value>) -> Result<Value, QmpError> {
        let mut msg = json!({"execute": command});
        if let Some(a) = args {
            msg["arguments"] = a;
        }
        let mut bytes = msg.to_string().into_bytes();
        bytes.push(b'\n');
        self.writer
            .write_all(&bytes)
            .await
            .map_err(|source| QmpError::Io {
                path: self.path.clone(),
                source,
            })?;
        loop {
            let v = self.read_message().await?;
            if let Some(r) = v.get("return") {
                return Ok(r.clone());
            }
            if let Some(e) = v.get("error") {
                return Err(QmpError::Command {
                    command: command.to_string(),
                    desc: e["desc"].as_str().unwrap_or("unknown").to_string(),
                });
            }
            // an asynchronous event: skip
        }
    }

    /// `query-status`: true when the guest CPUs run.
    pub async fn running(&mut self) -> Result<bool, QmpError> {
        let st = self.execute("query-status", None).await?;
        Ok(st["running"].as_bool().unwrap_or(false))
    }

    /// The QOM paths of devices with a `bootindex` property, as
    /// `(path, is_network)`.
    pub async fn boot_devices(&mut self) -> Result<Vec<(String, bool)>, QmpError> {
        let mut out = Vec::new();
        for parent in ["/machine/peripheral", "/machine/peripheral-anon"] {
            let Ok(children) = self
                .execute("qom-list", Some(json!({"path": parent})))
                .await
            else {
                continue;
            };
            for child in children.as_array().into_iter().flatten() {
                let ty = child["type"].as_str().unwrap_or_default();
                let Some(kind) = ty.strip_prefix("child<").and_then(|t| t.strip_suffix('>')) else {
                    continue;
                };
                let is_net = kind.contains("net") || kind.starts_with("e1000") || kind == "rtl8139";
                let is_disk = kind.contains("blk")
                    || kind == "nvme"
                    || kind.contains("scsi-hd")
                    || kind == "ide-hd";
                if !is_net && !is_disk {
                    continue;
                }
                let name = child["name"].as_str().unwrap_or_default();
                out.push((format!("{parent}/{name}"), is_net));
            }
        }
        out.sort();
        Ok(out)
    }

    /// Sets `bootindex` of one device.
    pub async fn set_bootindex(&mut self, path: &str, index: i64) -> Result<(), QmpError> {
        self.execute(
            "qom-set",
            Some(json!({"path": path, "property": "bootindex", "value": index})),
        )
        .await
        .map(|_| ())
    }
}
