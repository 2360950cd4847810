//! Reproducible newc ("070701") cpio archive writer.
//!
//! Entries are kept in a sorted map, so the archive does not depend on the
//! order of insertion; mtimes, uid and gid are fixed and inode numbers are
//! assigned in output order. The same entries always give the same bytes.
#![cfg_attr(test, allow(clippy::too_many_lines))]

use std::collections::BTreeMap;

/// An error building an archive.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A path that is empty, absolute after normalisation, or has `..`.
    #[error("invalid archive path {0:?}")]
    InvalidPath(String),
    /// A file too large for the 32-bit newc size field.
    #[error("entry {0:?} is larger than 4 GiB")]
    TooLarge(String),
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Kind {
    Dir,
    File(Vec<u8>),
    Symlink(String),
    CharDev { major: u32, minor: u32 },
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Entry {
    mode: u32,
    kind: Kind,
}

/// An archive under construction.
#[derive(Debug, Default, Clone)]
pub struct Archive {
    entries: BTreeMap<String, Entry>,
}

const S_IFDIR: u32 = 0o040000;
const S_IFREG: u32 = 0o100000;
const S_IFLNK: u32 = 0o120000;
const S_IFCHR: u32 = 0o020000;

fn normalize(path: &str) -> Result<String, Error> {
    let trimmed = path.trim_start_matches('/').trim_end_matches('/');
    if trimmed.is_empty()
        || trimmed
            .split('/')
            .any(|c| c.is_empty() || c == "." || c == "..")
    {
        return Err(Error::InvalidPath(path.to_string()));
    }
    Ok(trimmed.to_string())
}

impl Archive {
    /// An empty archive.
    pub fn new() -> Self {
        Self::default()
    }

    fn insert(&mut self, path: &str, entry: Entry) -> Result<(), Error> {
        let path = normalize(path)?;
        // Parent directories are implied; add them with mode 0755.
        let mut parent = String::new();
        let parts: Vec<&str> = path.split('/').collect();
        for part in &parts[..parts.len() - 1] {
            if !parent.is_empty() {
                parent.push('/');
            }
            parent.push_str(part);
            self.entries.entry(parent.clone()).or_insert(Entry {
                mode: 0o755,
                kind: Kind::Dir,
            });
        }
        self.entries.insert(path, entry);
        Ok(())
    }

    /// Adds a directory (and its parents).
    pub fn dir(&mut self, path: &str, mode: u32) -> Result<(), Error> {
        self.insert(
            path,
            Entry {
                mode,
                kind: Kind::Dir,
            },
        )
    }

    /// Adds a regular file (and its parents).
    pub fn file(&mut self, path: &str, mode: u32, data: Vec<u8>) -> Result<(), Error> {
        if u32::try_from(data.len()).is_err() {
            return Err(Error::TooLarge(path.to_string()));
        }
        self.insert(
            path,
            Entry {
                mode,
                kind: Kind::File(data),
            },
        )
    }

    /// Adds a symbolic link.
    pub fn symlink(&mut self, path: &str, target: &str) -> Result<(), Error> {
        self.insert(
            path,
            Entry {
                mode: 0o777,
                kind: Kind::Symlink(target.to_string()),
            },
        )
    }

    /// Adds a character device node.
    pub fn char_device(
        &mut self,
        path: &str,
        mode: u32,
        major: u32,
        minor: u32,
    ) -> Result<(), Error> {
        self.insert(
            path,
            Entry {
                mode,
                kind: Kind::CharDev { major, minor },
            },
        )
    }

    /// Number of entries, implied directories included.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True when nothing was added.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Serialises the archive, trailer included.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::new();
        for (ino, (path, entry)) in self.entries.iter().enumerate() {
            let (mode, data, rdev): (u32, &[u8], (u32, u32)) = match &entry.kind {
                Kind::Dir => (S_IFDIR | entry.mode, &[], (0, 0)),
                Kind::File(d) => (S_IFREG | entry.mode, d, (0, 0)),
                Kind::Symlink(t) => (S_IFLNK | entry.mode, t.as_bytes(), (0, 0)),
                Kind::CharDev { major, minor } => (S_IFCHR | entry.mode, &[], (*major, *minor)),
            };
            let nlink = if matches!(entry.kind, Kind::Dir) {
                2
            } else {
                1
            };
            // ino starts at 1 to stay away from 0, which some readers treat specially.
            write_entry(&mut out, path, (ino as u32) + 1, mode, nlink, data, rdev);
        }
        write_entry(&mut out, "TRAILER!!!", 0, 0, 1, &[], (0, 0));
        out
    }
}

fn pad4(out: &mut Vec<u8>) {
    while !out.len().is_multiple_of(4) {
        out.push(0);
    }
}

fn write_entry(
    out: &mut Vec<u8>,
    name: &str,
    ino: u32,
    mode: u32,
    nlink: u32,
    data: &[u8],
    rdev: (u32, u32),
) {
    let fields = [
        ino,
        mode,
        0, // uid
        0, // gid
        nlink,
        0, // mtime: fixed for reproducibility
        data.len() as u32,
        0, // devmajor
        0, // devminor
        rdev.0,
        rdev.1,
        (name.len() + 1) as u32,
        0, // check
    ];
    out.extend_from_slice(b"070701");
    for f in fields {
        out.extend_from_slice(format!("{f:08X}").as_bytes());
    }
    out.extend_from_slice(name.as_bytes());
    out.push(0);
    pad4(out);
    out.extend_from_slice(data);
    pad4(out);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_entries_in_any_order_give_same_bytes() {
        let mut a = Archive::new();
        a.file("bin/busybox", 0o755, b"x".to_vec()).unwrap();
        a.file("init", 0o755, b"#!/bin/sh\n".to_vec()).unwrap();
        let mut b = Archive::new();
        b.file("init", 0o755, b"#!/bin/sh\n".to_vec()).unwrap();
        b.file("/bin/busybox", 0o755, b"x".to_vec()).unwrap();
        assert_eq!(a.to_bytes(), b.to_bytes());
        assert_eq!(a.len(), 3, "bin is implied");
    }

    #[test]
    fn header_layout_is_newc() {
        let mut a = Archive::new();
        a.file("a", 0o644, b"hello".to_vec()).unwrap();
        let bytes = a.to_bytes();
        assert_eq!(&bytes[..6], b"070701");
        // header 110 bytes + "a\0" = 112, already aligned; then 5 data bytes padded to 8.
        assert_eq!(&bytes[110..112], b"a\0");
        assert_eq!(&bytes[112..117], b"hello");
        assert_eq!(&bytes[117..120], &[0, 0, 0]);
        assert_eq!(&bytes[120..126], b"070701");
        assert!(bytes.windows(10).any(|w| w == b"TRAILER!!!"));
        assert!(bytes.len().is_multiple_of(4));
    }

    #[test]
    fn hostile_paths_are_refused() {
        let mut a = Archive::new();
        for p in ["", "/", "../etc/passwd", "a/../b", "a//b", "./x"] {
            assert!(a.file(p, 0o644, vec![]).is_err(), "{p:?} accepted");
        }
    }

    #[test]
    fn readable_by_gnu_cpio() {
        let mut a = Archive::new();
        a.file("dir/file", 0o644, b"content\n".to_vec()).unwrap();
        a.symlink("link", "dir/file").unwrap();
        let tmp = std::env::temp_dir().join(format!("anneal-cpio-{}", std::process::id()));
        std::fs::create_dir_all(&tmp).unwrap();
        let archive = tmp.join("a.cpio");
        std::fs::write(&archive, a.to_bytes()).unwrap();
        let Ok(out) = std::process::Command::new("cpio")
            .arg("-t")
            .arg("-F")
            .arg(&archive)
            .output()
        else {
            panic!("cpio is installed by the set-up; run tests/run.sh");
        };
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let listing = String::from_utf8_lossy(&out.stdout);
        let names: Vec<&str> = listing.lines().collect();
        assert_eq!(names, ["dir", "dir/file", "link"]);
        std::fs::remove_dir_all(&tmp).unwrap();
    }
}
