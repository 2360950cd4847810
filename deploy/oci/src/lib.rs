//! Reproducible FROM-scratch OCI images (docs/kubernetes.md, "Images: FROM
//! scratch, reproducible").
//!
//! An image is one layer holding static binaries and a few files (CA roots,
//! `/etc/passwd`), written as an OCI image layout (`oci-layout`,
//! `index.json`, `blobs/sha256/…`) inside a tar archive, the form `ctr
//! images import`, `skopeo` (`oci-archive:`) and `podman load` read.
//!
//! Reproducible by construction: every tar entry has mtime 0, uid and gid
//! 0, no user or group name, a fixed mode, and the entries are sorted by
//! path; the gzip stream has no name and mtime 0; the config's `created` is
//! the epoch and carries no host detail. The same inputs give the same
//! bytes, so the same manifest digest.
#![cfg_attr(test, allow(clippy::too_many_lines))]

use std::collections::BTreeMap;
use std::io::Write as _;

use serde_json::{Value, json};
use sha2::{Digest as _, Sha256};

/// A media type of the OCI image spec.
pub const MANIFEST_MEDIA_TYPE: &str = "application/vnd.oci.image.manifest.v1+json";
/// The config's media type.
pub const CONFIG_MEDIA_TYPE: &str = "application/vnd.oci.image.config.v1+json";
/// The layer's media type (gzip-compressed tar).
pub const LAYER_MEDIA_TYPE: &str = "application/vnd.oci.image.layer.v1.tar+gzip";

/// Why an image cannot be built.
#[derive(Debug, thiserror::Error)]
pub enum OciError {
    /// A path that is not a plain relative path inside the image.
    #[error(
        "image path {0:?}: expected a relative path of plain names (no `.`, `..` or empty parts)"
    )]
    BadPath(String),
    /// A path longer than a ustar header holds.
    #[error("image path {0:?}: longer than 255 bytes, or a name longer than 100")]
    PathTooLong(String),
    /// Two files at one path.
    #[error("image path {0:?} given twice")]
    Duplicate(String),
    /// A file larger than a ustar header's size field holds (8 GiB).
    #[error("image path {0:?}: {1} bytes is larger than a tar entry holds")]
    TooLarge(String, u64),
    /// The image name or tag is not a valid reference part.
    #[error("{0}")]
    BadReference(String),
    /// An I/O error of the compressor (in memory: not expected).
    #[error("compressing the layer: {0}")]
    Io(#[from] std::io::Error),
}

/// One file of the layer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct File {
    /// Its path in the image, relative to `/` (e.g. `manager`, `etc/passwd`).
    pub path: String,
    /// Its bytes.
    pub data: Vec<u8>,
    /// Its permission bits (e.g. `0o755`).
    pub mode: u32,
}

/// What to build.
#[derive(Clone, Debug, Default)]
pub struct ImageSpec {
    /// The repository, e.g. `anneal/manager` (lowercase).
    pub name: String,
    /// The tag, e.g. `dev`.
    pub tag: String,
    /// The OCI architecture (`amd64`, `arm64`).
    pub architecture: String,
    /// The entrypoint (absolute paths in the image).
    pub entrypoint: Vec<String>,
    /// The default arguments.
    pub cmd: Vec<String>,
    /// `KEY=value` pairs.
    pub env: Vec<String>,
    /// `uid:gid` (numeric, so `runAsNonRoot` can check it), or empty for root.
    pub user: String,
    /// The config's labels (e.g. `org.opencontainers.image.source`).
    pub labels: BTreeMap<String, String>,
    /// The layer's files; their parent directories are added (mode 0755).
    pub files: Vec<File>,
}

/// A built image.
#[derive(Clone, Debug)]
pub struct Built {
    /// `docker.io/<name>:<tag>`, the name containerd gives it on import.
    pub reference: String,
    /// The manifest's digest (`sha256:…`): the image's identity.
    pub manifest_digest: String,
    /// The config's digest.
    pub config_digest: String,
    /// The compressed layer's digest.
    pub layer_digest: String,
    /// The uncompressed layer's digest (the config's `diff_ids`).
    pub diff_id: String,
    /// The compressed layer's size in bytes.
    pub layer_size: u64,
    /// The image's size as a registry counts it: manifest, config and
    /// compressed layer.
    pub size: u64,
    /// The OCI layout as a tar archive.
    pub archive: Vec<u8>,
}

fn sha256(data: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(data)))
}

fn check_path(p: &str) -> Result<(), OciError> {
    if p.is_empty()
        || p.starts_with('/')
        || p.split('/').any(|c| c.is_empty() || c == "." || c == "..")
    {
        return Err(OciError::BadPath(p.to_string()));
    }
    Ok(())
}

fn check_reference(name: &str, tag: &str) -> Result<(), OciError> {
    let name_ok = !name.is_empty()
        && name.split('/').all(|c| {
            !c.is_empty()
                && c.bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"._-".contains(&b))
                && c.as_bytes()[0].is_ascii_alphanumeric()
        });
    if !name_ok {
        return Err(OciError::BadReference(format!(
            "image name {name:?}: expected lowercase path components ([a-z0-9._-], starting with a letter or digit) separated by /"
        )));
    }
    let tag_ok = !tag.is_empty()
        && tag.len() <= 128
        && tag.as_bytes()[0] != b'.'
        && tag.as_bytes()[0] != b'-'
        && tag
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
    if !tag_ok {
        return Err(OciError::BadReference(format!(
            "image tag {tag:?}: expected up to 128 of [A-Za-z0-9._-], not starting with . or -"
        )));
    }
    Ok(())
}

/// A reproducible ustar archive writer (entries in the order given).
#[derive(Debug, Default)]
pub struct Tar {
    out: Vec<u8>,
}

impl Tar {
    /// A directory entry (`path` without the trailing slash).
    pub fn dir(&mut self, path: &str, mode: u32) -> Result<(), OciError> {
        self.entry(&format!("{path}/"), b'5', mode, &[])
    }

    /// A regular file.
    pub fn file(&mut self, path: &str, mode: u32, data: &[u8]) -> Result<(), OciError> {
        self.entry(path, b'0', mode, data)
    }

    fn entry(&mut self, path: &str, kind: u8, mode: u32, data: &[u8]) -> Result<(), OciError> {
        let mut h = [0u8; 512];
        let bytes = path.as_bytes();
        // ustar: `prefix` (155) + '/' + `name` (100)
        let (prefix, name) = if bytes.len() <= 100 {
            (&[][..], bytes)
        } else {
            let cut = bytes[..bytes.len().min(156)]
                .iter()
                .rposition(|b| *b == b'/')
                .filter(|i| bytes.len() - i - 1 <= 100 && *i > 0)
                .ok_or_else(|| OciError::PathTooLong(path.to_string()))?;
            (&bytes[..cut], &bytes[cut + 1..])
        };
        if name.is_empty() && kind != b'5' {
            return Err(OciError::PathTooLong(path.to_string()));
        }
        let size = data.len() as u64;
        if size >= 8 << 30 {
            return Err(OciError::TooLarge(path.to_string(), size));
        }
        h[..name.len()].copy_from_slice(name);
        octal(&mut h[100..108], u64::from(mode & 0o7777));
        octal(&mut h[108..116], 0);
        octal(&mut h[116..124], 0);
        octal(&mut h[124..136], size);
        octal(&mut h[136..148], 0);
        h[148..156].fill(b' ');
        h[156] = kind;
        h[257..263].copy_from_slice(b"ustar\0");
        h[263..265].copy_from_slice(b"00");
        h[345..345 + prefix.len()].copy_from_slice(prefix);
        let sum: u32 = h.iter().map(|b| u32::from(*b)).sum();
        octal(&mut h[148..155], u64::from(sum));
        h[155] = 0;
        self.out.extend_from_slice(&h);
        self.out.extend_from_slice(data);
        let pad = (512 - data.len() % 512) % 512;
        self.out.extend(std::iter::repeat_n(0u8, pad));
        Ok(())
    }

    /// The archive, with its two zero end blocks.
    pub fn finish(mut self) -> Vec<u8> {
        self.out.extend(std::iter::repeat_n(0u8, 1024));
        self.out
    }
}

/// Writes `v` as zero-padded octal filling `field` but its last byte (NUL).
fn octal(field: &mut [u8], v: u64) {
    let n = field.len() - 1;
    let s = format!("{v:0n$o}");
    field[..n].copy_from_slice(&s.as_bytes()[s.len() - n..]);
    field[n] = 0;
}

/// The layer: the files and their parent directories, sorted by path.
fn layer_tar(files: &[File]) -> Result<Vec<u8>, OciError> {
    let mut entries: BTreeMap<String, Option<&File>> = BTreeMap::new();
    for f in files {
        check_path(&f.path)?;
        if entries
            .insert(f.path.clone(), Some(f))
            .is_some_and(|e| e.is_some())
        {
            return Err(OciError::Duplicate(f.path.clone()));
        }
        let mut at = f.path.as_str();
        while let Some((parent, _)) = at.rsplit_once('/') {
            if let Some(Some(_)) = entries.get(parent) {
                return Err(OciError::BadPath(format!(
                    "{parent} is a file and a directory"
                )));
            }
            entries.entry(parent.to_string()).or_insert(None);
            at = parent;
        }
    }
    let mut tar = Tar::default();
    for (path, f) in &entries {
        match f {
            Some(f) => tar.file(path, f.mode, &f.data)?,
            None => tar.dir(path, 0o755)?,
        }
    }
    Ok(tar.finish())
}

fn gzip(data: &[u8]) -> Result<Vec<u8>, OciError> {
    let mut enc = flate2::GzBuilder::new()
        .mtime(0)
        .operating_system(255)
        .write(Vec::new(), flate2::Compression::default());
    enc.write_all(data)?;
    Ok(enc.finish()?)
}

/// Canonical JSON bytes (serde_json sorts object keys: `preserve_order` is
/// off in this workspace).
fn json_bytes(v: &Value) -> Vec<u8> {
    v.to_string().into_bytes()
}

/// Builds the image.
pub fn build(spec: &ImageSpec) -> Result<Built, OciError> {
    check_reference(&spec.name, &spec.tag)?;
    let tar = layer_tar(&spec.files)?;
    let diff_id = sha256(&tar);
    let layer = gzip(&tar)?;
    let layer_digest = sha256(&layer);
    let mut config = json!({
        "Env": spec.env,
        "Labels": spec.labels,
        "WorkingDir": "/",
    });
    if !spec.entrypoint.is_empty() {
        config["Entrypoint"] = json!(spec.entrypoint);
    }
    if !spec.cmd.is_empty() {
        config["Cmd"] = json!(spec.cmd);
    }
    if !spec.user.is_empty() {
        config["User"] = json!(spec.user);
    }
    let config = json_bytes(&json!({
        "created": "1970-01-01T00:00:00Z",
        "architecture": spec.architecture,
        "os": "linux",
        "config": config,
        "rootfs": {"type": "layers", "diff_ids": [diff_id]},
        "history": [{"created": "1970-01-01T00:00:00Z", "created_by": "anneal-oci"}],
    }));
    let config_digest = sha256(&config);
    let manifest = json_bytes(&json!({
        "schemaVersion": 2,
        "mediaType": MANIFEST_MEDIA_TYPE,
        "config": {"mediaType": CONFIG_MEDIA_TYPE, "digest": config_digest, "size": config.len()},
        "layers": [{"mediaType": LAYER_MEDIA_TYPE, "digest": layer_digest, "size": layer.len()}],
    }));
    let manifest_digest = sha256(&manifest);
    let reference = format!("docker.io/{}:{}", spec.name, spec.tag);
    let index = json_bytes(&json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [{
            "mediaType": MANIFEST_MEDIA_TYPE,
            "digest": manifest_digest,
            "size": manifest.len(),
            "platform": {"architecture": spec.architecture, "os": "linux"},
            "annotations": {
                "io.containerd.image.name": reference,
                "org.opencontainers.image.ref.name": spec.tag,
            },
        }],
    }));
    let blob = |d: &str| format!("blobs/sha256/{}", d.trim_start_matches("sha256:"));
    let mut out = Tar::default();
    out.dir("blobs", 0o755)?;
    out.dir("blobs/sha256", 0o755)?;
    let mut blobs = [
        (blob(&config_digest), &config),
        (blob(&layer_digest), &layer),
        (blob(&manifest_digest), &manifest),
    ];
    blobs.sort_by(|a, b| a.0.cmp(&b.0));
    for (path, data) in blobs {
        out.file(&path, 0o644, data)?;
    }
    out.file("index.json", 0o644, &index)?;
    out.file("oci-layout", 0o644, br#"{"imageLayoutVersion":"1.0.0"}"#)?;
    let size = (manifest.len() + config.len() + layer.len()) as u64;
    Ok(Built {
        reference,
        manifest_digest,
        config_digest,
        layer_digest,
        diff_id,
        layer_size: layer.len() as u64,
        size,
        archive: out.finish(),
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    fn spec(files: Vec<File>) -> ImageSpec {
        ImageSpec {
            name: "anneal/test".into(),
            tag: "dev".into(),
            architecture: "amd64".into(),
            entrypoint: vec!["/bin/tool".into()],
            user: "65532:65532".into(),
            files,
            ..ImageSpec::default()
        }
    }

    fn file(path: &str, data: &[u8]) -> File {
        File {
            path: path.into(),
            data: data.to_vec(),
            mode: 0o755,
        }
    }

    #[test]
    fn the_same_inputs_give_the_same_bytes() {
        let a = build(&spec(vec![
            file("bin/tool", b"x"),
            file("etc/passwd", b"y"),
        ]))
        .unwrap();
        // the order the files are given in does not matter
        let b = build(&spec(vec![
            file("etc/passwd", b"y"),
            file("bin/tool", b"x"),
        ]))
        .unwrap();
        assert_eq!(a.manifest_digest, b.manifest_digest);
        assert_eq!(a.archive, b.archive);
        let c = build(&spec(vec![
            file("bin/tool", b"z"),
            file("etc/passwd", b"y"),
        ]))
        .unwrap();
        assert_ne!(a.manifest_digest, c.manifest_digest);
        assert_eq!(a.reference, "docker.io/anneal/test:dev");
    }

    #[test]
    fn bad_paths_and_references_are_refused_by_name() {
        for p in ["/abs", "a/../b", "a//b", "", "./a"] {
            let e = build(&spec(vec![file(p, b"")])).unwrap_err();
            assert!(matches!(e, OciError::BadPath(_)), "{p}: {e}");
        }
        let e = build(&spec(vec![file("a", b""), file("a", b"")])).unwrap_err();
        assert!(e.to_string().contains("given twice"), "{e}");
        let e = build(&spec(vec![file("a", b""), file("a/b", b"")])).unwrap_err();
        assert!(e.to_string().contains("a is a file and a directory"), "{e}");
        let long = format!("{}/x", "d".repeat(120));
        assert!(build(&spec(vec![file(&long, b"")])).is_ok());
        let too_long = "n".repeat(101);
        let e = build(&spec(vec![file(&too_long, b"")])).unwrap_err();
        assert!(matches!(e, OciError::PathTooLong(_)), "{e}");
        let mut s = spec(vec![]);
        s.name = "Anneal/Manager".into();
        assert!(build(&s).unwrap_err().to_string().contains("image name"));
        let mut s = spec(vec![]);
        s.tag = "-x".into();
        assert!(build(&s).unwrap_err().to_string().contains("image tag"));
    }

    #[test]
    fn tar_headers_carry_a_valid_checksum_and_no_host_detail() {
        let mut t = Tar::default();
        t.file("a", 0o644, b"hello").unwrap();
        let out = t.finish();
        assert_eq!(out.len(), 512 + 512 + 1024);
        let h = &out[..512];
        let mut sum: u32 = h.iter().map(|b| u32::from(*b)).sum();
        sum -= h[148..156].iter().map(|b| u32::from(*b)).sum::<u32>();
        sum += 8 * u32::from(b' ');
        let field = std::str::from_utf8(&h[148..154]).unwrap();
        assert_eq!(u32::from_str_radix(field, 8).unwrap(), sum);
        assert_eq!(&h[136..147], b"00000000000"); // mtime 0
        assert!(h[265..345].iter().all(|b| *b == 0)); // no user or group name
    }
}
