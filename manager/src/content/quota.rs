//! The content store's per-namespace byte quota (docs/images.md, "Store
//! quota"): what a namespace holds is the stored bytes of its
//! PartitionContents (`spec.usedBytes`, what the stream files hold) plus its
//! staged uploads not yet consumed (finished ones and those still
//! arriving). A staged upload is admitted only while it fits; an import
//! starts only while something is left, and its ingest may capture at most
//! what is left.
//!
//! The decisions ([`usage`], [`admit`], [`budget`]) are pure functions over
//! a snapshot; [`staged_files`] and [`namespace_usage`] read the snapshot.

use std::collections::BTreeMap;
use std::path::Path;

use anneal_api::PartitionContent;
use kube::ResourceExt;

/// The quota: bytes per namespace, with per-namespace overrides set by the
/// administrator (manager flags, never anything a tenant writes).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StoreQuota {
    /// Bytes every namespace may hold; 0: unlimited (the default of this
    /// type; the manager's `--store-quota-bytes-per-namespace` defaults
    /// to 200 GiB).
    pub per_namespace: u64,
    /// Namespaces with their own quota (`--store-quota-namespace NS=BYTES`;
    /// 0: unlimited).
    pub overrides: BTreeMap<String, u64>,
}

impl StoreQuota {
    /// The quota of `ns`; `None`: unlimited.
    pub fn limit(&self, ns: &str) -> Option<u64> {
        let l = self
            .overrides
            .get(ns)
            .copied()
            .unwrap_or(self.per_namespace);
        (l > 0).then_some(l)
    }

    /// Parses one `NS=BYTES` override.
    pub fn parse_override(s: &str) -> Result<(String, u64), String> {
        let (ns, bytes) = s
            .split_once('=')
            .ok_or_else(|| format!("{s:?}: expected NAMESPACE=BYTES"))?;
        if !super::upload::valid_name(ns) || ns.len() > 63 {
            return Err(format!("{ns:?} is not a namespace name"));
        }
        let bytes = bytes
            .parse::<u64>()
            .map_err(|e| format!("{bytes:?}: {e}"))?;
        Ok((ns.to_string(), bytes))
    }
}

/// One file under `<store>/<namespace>/.staged/` (a finished upload, or the
/// temporary file of one still arriving).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StagedFile {
    /// The file name (`<name>`, or `.<name>.part-<random>` while arriving).
    pub name: String,
    /// Its size.
    pub bytes: u64,
}

/// What a namespace holds in the store.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    /// Stored bytes of its PartitionContents.
    pub contents: u64,
    /// Bytes of its staged uploads.
    pub staged: u64,
}

impl Usage {
    /// Everything counted against the quota.
    pub fn total(&self) -> u64 {
        self.contents.saturating_add(self.staged)
    }
}

/// What namespace `ns` holds: the stored bytes of its PartitionContents in
/// `contents` (other namespaces' are skipped) and its staged files, except
/// the upload named `consumed` (an import of `staged://NAME`: the file goes
/// once the import succeeded, so its contents replace it).
pub fn usage(
    ns: &str,
    contents: &[PartitionContent],
    staged: &[StagedFile],
    consumed: Option<&str>,
) -> Usage {
    let contents = contents
        .iter()
        .filter(|pc| pc.namespace().as_deref() == Some(ns))
        .map(|pc| u64::try_from(pc.spec.used_bytes).unwrap_or(0))
        .fold(0u64, u64::saturating_add);
    let staged = staged
        .iter()
        .filter(|f| Some(f.name.as_str()) != consumed)
        .map(|f| f.bytes)
        .fold(0u64, u64::saturating_add);
    Usage { contents, staged }
}

/// A refusal: what would pass the quota.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "namespace {namespace} is at its content store quota: {quota} bytes, {used} used ({contents} by PartitionContents, {staged} by staged uploads){need}; {fix}",
    used = .used.total(),
    contents = .used.contents,
    staged = .used.staged,
    need = match .incoming {
        Some(n) => format!(", {n} more asked for"),
        None => String::new(),
    },
    fix = fix(.namespace),
)]
pub struct Refusal {
    /// The namespace.
    pub namespace: String,
    /// Its quota.
    pub quota: u64,
    /// What it holds.
    pub used: Usage,
    /// What was asked for, when known.
    pub incoming: Option<u64>,
}

/// What to do about a full quota (also the tail of the ingest's
/// `QuotaExceeded` message).
pub fn fix(ns: &str) -> String {
    format!(
        "delete Images and their PartitionContents (or unused staged uploads) in namespace {ns}, or ask the administrator to raise the manager's --store-quota-bytes-per-namespace (or set --store-quota-namespace {ns}=BYTES)"
    )
}

/// A staged upload of `incoming` bytes into `ns` holding `used`: admitted
/// when it fits the quota.
pub fn admit(quota: &StoreQuota, ns: &str, used: Usage, incoming: u64) -> Result<(), Refusal> {
    let Some(limit) = quota.limit(ns) else {
        return Ok(());
    };
    if used.total().saturating_add(incoming) > limit {
        return Err(Refusal {
            namespace: ns.to_string(),
            quota: limit,
            used,
            incoming: Some(incoming),
        });
    }
    Ok(())
}

/// What an import into `ns` holding `used` may still store: `Ok(None)`
/// unlimited, `Ok(Some(bytes))` what is left; refused when nothing is.
pub fn budget(quota: &StoreQuota, ns: &str, used: Usage) -> Result<Option<u64>, Refusal> {
    let Some(limit) = quota.limit(ns) else {
        return Ok(None);
    };
    if used.total() >= limit {
        return Err(Refusal {
            namespace: ns.to_string(),
            quota: limit,
            used,
            incoming: None,
        });
    }
    Ok(Some(limit - used.total()))
}

/// The files under `<store>/<ns>/.staged/` (none when it does not exist).
pub fn staged_files(store: &Path, ns: &str) -> Vec<StagedFile> {
    let Ok(rd) = std::fs::read_dir(store.join(ns).join(".staged")) else {
        return Vec::new();
    };
    rd.filter_map(Result::ok)
        .filter_map(|e| {
            let m = e.metadata().ok()?;
            m.is_file().then(|| StagedFile {
                name: e.file_name().to_string_lossy().into_owned(),
                bytes: m.len(),
            })
        })
        .collect()
}

/// What `ns` holds now: its PartitionContents from the API server, its
/// staged files from `store` (the local store; `None` with the kubernetes
/// executor, which takes no staged uploads).
pub async fn namespace_usage(
    client: &kube::Client,
    store: Option<&Path>,
    ns: &str,
    consumed: Option<&str>,
) -> Result<Usage, kube::Error> {
    let api: kube::Api<PartitionContent> = kube::Api::namespaced(client.clone(), ns);
    let contents = api.list(&kube::api::ListParams::default()).await?.items;
    let staged = store.map(|s| staged_files(s, ns)).unwrap_or_default();
    Ok(usage(ns, &contents, &staged, consumed))
}

#[cfg(test)]
mod tests {
    use super::*;
    use anneal_api::PartitionContentSpec;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    fn pc(ns: &str, name: &str, used: i64) -> PartitionContent {
        PartitionContent {
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some(ns.into()),
                ..ObjectMeta::default()
            },
            spec: PartitionContentSpec {
                fs_type: None,
                used_bytes: used,
                size_bytes: used * 4,
                last_extent_end: used,
                block_size: 4096,
                piece_length: 1 << 20,
                source: None,
            },
            status: None,
        }
    }

    fn staged(name: &str, bytes: u64) -> StagedFile {
        StagedFile {
            name: name.into(),
            bytes,
        }
    }

    fn quota(per_namespace: u64) -> StoreQuota {
        StoreQuota {
            per_namespace,
            overrides: BTreeMap::new(),
        }
    }

    #[test]
    fn usage_counts_a_namespaces_contents_and_staged_uploads_only() {
        let contents = [
            pc("a", "x-p1", 100),
            pc("a", "x-p2", 50),
            pc("b", "y-p1", 7000),
        ];
        let files = [staged("up", 30), staged(".big.part-00ff", 5)];
        let u = usage("a", &contents, &files, None);
        assert_eq!(
            u,
            Usage {
                contents: 150,
                staged: 35
            }
        );
        assert_eq!(u.total(), 185);
        // an import consuming staged://up: its contents replace the file
        assert_eq!(usage("a", &contents, &files, Some("up")).staged, 5);
        // a negative usedBytes (a hand-written object) counts as nothing
        assert_eq!(usage("c", &[pc("c", "z", -5)], &[], None).total(), 0);
    }

    #[test]
    fn a_staged_upload_is_admitted_only_while_it_fits() {
        let used = Usage {
            contents: 60,
            staged: 30,
        };
        assert_eq!(admit(&quota(100), "a", used, 10), Ok(()));
        let r = admit(&quota(100), "a", used, 11).unwrap_err();
        assert_eq!(r.quota, 100);
        let msg = r.to_string();
        for part in [
            "namespace a is at its content store quota: 100 bytes, 90 used (60 by PartitionContents, 30 by staged uploads), 11 more asked for",
            "delete Images and their PartitionContents",
            "--store-quota-bytes-per-namespace",
            "--store-quota-namespace a=BYTES",
        ] {
            assert!(msg.contains(part), "{msg}");
        }
        // 0: unlimited
        assert_eq!(admit(&quota(0), "a", used, u64::MAX), Ok(()));
    }

    #[test]
    fn an_import_gets_what_is_left_and_is_refused_when_nothing_is() {
        let q = quota(100);
        assert_eq!(
            budget(
                &q,
                "a",
                Usage {
                    contents: 40,
                    staged: 20
                }
            ),
            Ok(Some(40))
        );
        let r = budget(
            &q,
            "a",
            Usage {
                contents: 80,
                staged: 20,
            },
        )
        .unwrap_err();
        assert!(r.to_string().contains("100 bytes, 100 used"), "{r}");
        assert!(!r.to_string().contains("more asked for"), "{r}");
        assert_eq!(
            budget(
                &quota(0),
                "a",
                Usage {
                    contents: 1 << 50,
                    staged: 0
                }
            ),
            Ok(None)
        );
    }

    #[test]
    fn overrides_replace_the_default_per_namespace() {
        let q = StoreQuota {
            per_namespace: 100,
            overrides: [("big".to_string(), 1000), ("free".to_string(), 0)].into(),
        };
        assert_eq!(q.limit("a"), Some(100));
        assert_eq!(q.limit("big"), Some(1000));
        assert_eq!(q.limit("free"), None);
        assert_eq!(
            StoreQuota::parse_override("big=1000"),
            Ok(("big".to_string(), 1000))
        );
        assert!(StoreQuota::parse_override("big").is_err());
        assert!(StoreQuota::parse_override("Big=1").is_err());
        assert!(StoreQuota::parse_override("big=-1").is_err());
    }

    #[test]
    fn staged_files_are_read_from_the_store() {
        let dir = tempfile::tempdir().expect("tempdir");
        assert!(staged_files(dir.path(), "a").is_empty());
        let staged_dir = dir.path().join("a/.staged");
        std::fs::create_dir_all(&staged_dir).expect("mkdir");
        std::fs::write(staged_dir.join("up"), vec![0u8; 12]).expect("write");
        std::fs::write(staged_dir.join(".next.part-01"), vec![0u8; 3]).expect("write");
        let mut files = staged_files(dir.path(), "a");
        files.sort_by(|a, b| a.name.cmp(&b.name));
        assert_eq!(files, vec![staged(".next.part-01", 3), staged("up", 12)]);
    }
}
