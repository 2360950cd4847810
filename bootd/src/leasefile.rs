//! The lease file: JSON, replaced atomically (temp file, fsync, rename,
//! fsync of the directory), so a crash leaves the old or the new file, never
//! a torn one.

use std::io::Write;
use std::path::{Path, PathBuf};

use anneal_dhcp::Lease;

/// Errors of reading or writing the lease file.
#[derive(Debug, thiserror::Error)]
pub enum LeaseFileError {
    #[error("reading lease file {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("lease file {path} does not parse")]
    Parse {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("writing lease file {path}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct File {
    version: u32,
    leases: Vec<Lease>,
}

/// Reads leases; a missing file is an empty table.
pub fn load(path: &Path) -> Result<Vec<Lease>, LeaseFileError> {
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(source) => {
            return Err(LeaseFileError::Read {
                path: path.into(),
                source,
            });
        }
    };
    let f: File = serde_json::from_slice(&bytes).map_err(|source| LeaseFileError::Parse {
        path: path.into(),
        source,
    })?;
    Ok(f.leases)
}

/// Replaces the file atomically with `leases`.
pub fn store(path: &Path, leases: &[Lease]) -> Result<(), LeaseFileError> {
    let err = |source| LeaseFileError::Write {
        path: path.into(),
        source,
    };
    let body = serde_json::to_vec_pretty(&File {
        version: 1,
        leases: leases.to_vec(),
    })
    .map_err(|e| err(std::io::Error::other(e)))?;
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    {
        let mut f = std::fs::File::create(&tmp).map_err(err)?;
        f.write_all(&body).map_err(err)?;
        f.sync_all().map_err(err)?;
    }
    std::fs::rename(&tmp, path).map_err(err)?;
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(err)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use anneal_dhcp::Mac;

    #[test]
    fn round_trip_and_missing() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("leases.json");
        assert!(load(&p).unwrap().is_empty());
        let l = Lease {
            mac: Mac([2, 0, 0, 0, 0, 1]),
            address: "10.0.0.5".parse().unwrap(),
            expires: 42,
        };
        store(&p, &[l]).unwrap();
        assert_eq!(load(&p).unwrap(), vec![l]);
        assert!(!d.path().join("leases.json.tmp").exists());
        std::fs::write(&p, b"{not json").unwrap();
        assert!(matches!(load(&p), Err(LeaseFileError::Parse { .. })));
    }
}
