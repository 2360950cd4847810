//! ImageImport, PartitionContent and Image: captured disk content and the
//! layouts that bind it.

use std::collections::BTreeMap;

use kube::{CustomResource, KubeSchema};
use serde::{Deserialize, Serialize};

use super::common::{Condition, NameRef, Time};

/// Template parameters: names to string values.
pub type Params = BTreeMap<String, String>;

/// Operating-system family of an image.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema,
)]
pub enum OsFamily {
    /// Linux.
    #[default]
    Linux,
    /// Windows.
    Windows,
    /// FreeBSD.
    FreeBSD,
    /// Anything else.
    Other,
}

fn default_true() -> bool {
    true
}

/// A request to capture one source disk image into PartitionContents and an
/// Image. The whole spec is immutable.
#[derive(CustomResource, Clone, Debug, Default, PartialEq, Serialize, Deserialize, KubeSchema)]
#[kube(
    group = "anneal.dev",
    version = "v1alpha1",
    kind = "ImageImport",
    namespaced,
    status = "ImageImportStatus",
    shortname = "imp",
    category = "anneal",
    doc = "A request to capture one source disk image into PartitionContents and an Image; never overwrites existing objects.",
    printcolumn = r#"{"name":"State","type":"string","jsonPath":".status.state"}"#,
    printcolumn = r#"{"name":"Image","type":"string","jsonPath":".spec.imageName"}"#,
    printcolumn = r#"{"name":"Phase","type":"string","jsonPath":".status.progress.phase","description":"What the ingest is doing"}"#,
    printcolumn = r#"{"name":"Progress","type":"integer","jsonPath":".status.progress.percent","description":"Percent of the source fetched"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("self == oldSelf").message("spec is immutable: an ImageImport is a one-shot request"))]
pub struct ImageImportSpec {
    /// Where the source disk image comes from.
    pub source: ImportSource,
    /// Name of the Image this import creates, in its own namespace; the
    /// import fails if the name is taken.
    #[schemars(length(min = 1, max = 253))]
    pub image_name: String,
    /// Name prefix of the contents: partition N becomes `<prefix>-p<N>`.
    #[schemars(length(min = 1, max = 240))]
    pub content_prefix: String,
    /// Copied onto the Image: Linux (default), Windows, FreeBSD or Other.
    #[serde(default)]
    pub os_family: OsFamily,
    /// Copied onto the Image: whether it boots (needs an ESP). Default true.
    #[serde(default = "default_true")]
    pub bootable: bool,
    /// Copied onto the Image: template parameters of its hooks.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub params: Params,
    /// Copied onto the Image: PostHooks its content needs, in order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub post_hook_refs: Vec<NameRef>,
    /// Copied onto the Image: Day-1 defaults of its claims.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub day1_defaults: Option<Day1Defaults>,
    /// How long a finished import stays after `status.completionTime` before
    /// it is deleted; absent keeps it forever. Deleting an import never
    /// deletes what it created.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub ttl_seconds_after_finished: Option<i64>,
}

/// Format of a source disk image.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema)]
pub enum SourceFormat {
    /// A raw disk image.
    #[serde(rename = "raw")]
    Raw,
    /// A qcow2 disk image.
    #[serde(rename = "qcow2")]
    Qcow2,
    /// A Clonezilla image directory or a single partclone image.
    #[serde(rename = "partclone")]
    Partclone,
}

/// The source of an import.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("!has(self.caBundleSecretRef) || self.url.startsWith('https://')").message("spec.source.caBundleSecretRef needs an https:// spec.source.url").field_path(".caBundleSecretRef"))]
pub struct ImportSource {
    /// `http://…`, `https://…`, or `staged://NAME` for an upload.
    #[x_kube(validation = Rule::new("self.startsWith('http://') || self.startsWith('https://') || self.matches('^staged://[a-z0-9]([-a-z0-9.]*[a-z0-9])?$')").message("spec.source.url must be an http(s):// URL or staged://NAME"))]
    #[schemars(length(min = 1, max = 4096))]
    pub url: String,
    /// `sha256:<64 hex digits>`, verified before anything is published (without it the source is not hashed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self.matches('^sha256:[0-9a-f]{64}$')").message("spec.source.checksum must be sha256: followed by 64 lowercase hex digits"))]
    #[schemars(length(max = 71))]
    pub checksum: Option<String>,
    /// `raw`, `qcow2` or `partclone`; absent: detected.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub format: Option<SourceFormat>,
    /// Secret in the import's own namespace holding the PEM CA bundle that
    /// verifies an `https://` source's certificate (instead of the system
    /// roots).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_bundle_secret_ref: Option<SecretKeyRef>,
}

fn default_ca_key() -> String {
    "ca.crt".into()
}

/// A key of a Secret in the namespace of the object holding the reference.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("!has(self.namespace)").message("spec.source.caBundleSecretRef.namespace must be left out: the Secret is read from the ImageImport's own namespace").field_path(".namespace"))]
pub struct SecretKeyRef {
    /// Name of the Secret.
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
    /// The key holding the PEM bundle.
    #[serde(default = "default_ca_key")]
    #[x_kube(validation = Rule::new("self.matches('^[-._a-zA-Z0-9]+$')").message("spec.source.caBundleSecretRef.key must be a Secret key (letters, digits, '-', '_', '.')"))]
    #[schemars(length(min = 1, max = 253))]
    pub key: String,
    /// Not allowed (refused at admission): only a Secret in the holder's
    /// own namespace may be referenced.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 63))]
    pub namespace: Option<String>,
}

/// Progress of an import or of one partition's transfer.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct ByteProgress {
    /// Bytes done so far.
    #[serde(default)]
    pub bytes_done: i64,
    /// Bytes in total.
    #[serde(default)]
    pub bytes_total: i64,
    /// Whole percent done, 0 to 100.
    #[serde(default)]
    pub percent: i32,
    /// What is being done: `Fetching`, `Capturing`, `Publishing` (imports).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 32))]
    pub phase: Option<String>,
    /// Bytes of content streams written so far (imports).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes_captured: Option<i64>,
}

/// Lifecycle state of an import.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema)]
pub enum ImportState {
    /// Not started.
    Pending,
    /// The ingest Job is capturing.
    Ingesting,
    /// The Image and every content exist.
    Succeeded,
    /// Failed; see conditions.
    Failed,
}

/// Observed state of an ImageImport.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct ImageImportStatus {
    /// Pending, Ingesting, Succeeded or Failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<ImportState>,
    /// The Image this import created.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_ref: Option<NameRef>,
    /// Every PartitionContent this import created, in partition order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub content_refs: Vec<NameRef>,
    /// When the import first reached Succeeded or Failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completion_time: Option<Time>,
    /// Bytes of the source captured so far.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub progress: Option<ByteProgress>,
    /// Conditions: Valid, Succeeded.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    /// The metadata.generation this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
}

/// The immutable record of one partition's data (used blocks only).
#[derive(CustomResource, Clone, Debug, Default, PartialEq, Serialize, Deserialize, KubeSchema)]
#[kube(
    group = "anneal.dev",
    version = "v1alpha1",
    kind = "PartitionContent",
    namespaced,
    status = "PartitionContentStatus",
    shortname = "pcontent",
    category = "anneal",
    doc = "The immutable record of one partition's data (used blocks only), published as a torrent.",
    printcolumn = r#"{"name":"State","type":"string","jsonPath":".status.state"}"#,
    printcolumn = r#"{"name":"FS","type":"string","jsonPath":".spec.fsType"}"#,
    printcolumn = r#"{"name":"Used","type":"integer","jsonPath":".spec.usedBytes"}"#,
    printcolumn = r#"{"name":"Size","type":"integer","jsonPath":".spec.sizeBytes"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("self == oldSelf").message("spec is immutable: a PartitionContent's bytes never change"))]
#[x_kube(validation = Rule::new("self.usedBytes <= self.sizeBytes").message("spec.usedBytes must not exceed spec.sizeBytes").field_path(".usedBytes"))]
#[x_kube(validation = Rule::new("self.lastExtentEnd <= self.sizeBytes").message("spec.lastExtentEnd must not exceed spec.sizeBytes").field_path(".lastExtentEnd"))]
pub struct PartitionContentSpec {
    /// File system of the partition (for example `ext4`); empty when
    /// partclone recognises none. Audit only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 32))]
    pub fs_type: Option<String>,
    /// Bytes of real data in the partition, measured at capture.
    #[schemars(range(min = 0))]
    pub used_bytes: i64,
    /// Size of the partition at capture, in bytes.
    #[schemars(range(min = 0))]
    pub size_bytes: i64,
    /// End offset of the highest extent written; a target partition must be
    /// at least this large.
    #[schemars(range(min = 0))]
    pub last_extent_end: i64,
    /// File-system block size the used-block map is expressed in, in bytes.
    #[schemars(range(min = 512))]
    pub block_size: i64,
    /// BitTorrent piece length of this content, in bytes.
    #[schemars(range(min = 16384))]
    pub piece_length: i64,
    /// Where the content was captured.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<ContentSource>,
}

/// Provenance of a content.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct ContentSource {
    /// The ImageImport that captured this content.
    pub import_name: String,
    /// The partition of the source disk (1-based). Audit only.
    #[schemars(range(min = 1))]
    pub partition_number: i32,
}

/// Lifecycle state of a content.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema)]
pub enum ContentState {
    /// Not yet published.
    Pending,
    /// Being published.
    Publishing,
    /// Torrent exists and the content is seedable.
    Ready,
    /// Publishing failed.
    Failed,
}

/// Seeders of a content at one Site.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct SeederStatus {
    /// The Site.
    pub site: String,
    /// Machines of that Site deploying an Image that references the content.
    #[serde(default)]
    pub machines: i32,
}

/// Observed state of a PartitionContent.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct PartitionContentStatus {
    /// Pending, Publishing, Ready or Failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<ContentState>,
    /// BitTorrent v1 info hash, lowercase hex.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub info_hash: Option<String>,
    /// SHA-256 of the canonical content stream, lowercase hex.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sha256: Option<String>,
    /// SHA-256 of the content's index (header, extents, piece hashes),
    /// lowercase hex: a deploy refuses an index that differs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub index_sha256: Option<String>,
    /// The volume holding the bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub storage_ref: Option<NameRef>,
    /// One entry per Site with an available seeder.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub seeders: Vec<SeederStatus>,
    /// Conditions: Ready, Valid, SeederDegraded, DeletionBlocked.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    /// The metadata.generation this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
}

/// A disk layout bound to an ordered list of slots; created complete,
/// immutable.
#[derive(CustomResource, Clone, Debug, Default, PartialEq, Serialize, Deserialize, KubeSchema)]
#[kube(
    group = "anneal.dev",
    version = "v1alpha1",
    kind = "Image",
    namespaced,
    status = "ImageStatus",
    shortname = "img",
    category = "anneal",
    doc = "A disk layout bound to an ordered list of slots (PartitionContents or blank file systems); created complete, immutable.",
    printcolumn = r#"{"name":"State","type":"string","jsonPath":".status.state"}"#,
    printcolumn = r#"{"name":"OS","type":"string","jsonPath":".spec.osFamily"}"#,
    printcolumn = r#"{"name":"Bootable","type":"boolean","jsonPath":".spec.bootable"}"#,
    printcolumn = r#"{"name":"Slots","type":"integer","jsonPath":".status.slots","description":"Partitions in the layout"}"#,
    printcolumn = r#"{"name":"Size","type":"integer","jsonPath":".status.sizeBytes","description":"Disk space the layout takes, in bytes"}"#,
    printcolumn = r#"{"name":"Used","type":"integer","jsonPath":".status.usedBytes","priority":1,"description":"Bytes a deploy writes"}"#,
    printcolumn = r#"{"name":"Table","type":"string","jsonPath":".spec.layout.partitionTable","priority":1}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("self == oldSelf").message("spec is immutable: create an Image with a new name instead"))]
#[x_kube(validation = Rule::new("!self.bootable || self.layout.slots.exists(s, s.role == 'esp')").message("spec.bootable needs an esp slot in spec.layout.slots").field_path(".layout.slots"))]
pub struct ImageSpec {
    /// Linux (default), Windows, FreeBSD or Other; gates OS-specific
    /// validation and builtins.
    #[serde(default)]
    pub os_family: OsFamily,
    /// Whether this image boots (default true); a bootable image needs an
    /// `esp` slot.
    #[serde(default = "default_true")]
    pub bootable: bool,
    /// Partition table and slots.
    pub layout: Layout,
    /// Template parameters of the hooks (override hook defaults, overridden
    /// by claim params).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub params: Params,
    /// PostHooks this image's content needs, run before the claim's.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub post_hook_refs: Vec<NameRef>,
    /// Day-1 defaults for the claims of this Image that do not set their
    /// own (Secrets of the Image's namespace, which is the claim's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub day1_defaults: Option<Day1Defaults>,
}

/// Day-1 defaults of an Image: what a claim gets when it sets none.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct Day1Defaults {
    /// User data for claims without `spec.userData` (a cloud-config every
    /// machine of this Image gets, for example).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user_data: Option<super::claim::SecretDataRef>,
    /// SSH public keys for claims without
    /// `spec.metaData.publicKeysSecretRef`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub public_keys_secret_ref: Option<super::claim::SecretDataRef>,
}

/// Partition table kind.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema,
)]
pub enum PartitionTable {
    /// GUID partition table.
    #[default]
    #[serde(rename = "gpt")]
    Gpt,
    /// MBR (DOS) partition table.
    #[serde(rename = "mbr")]
    Mbr,
}

/// The disk layout of an Image.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct Layout {
    /// `gpt` or `mbr`.
    pub partition_table: PartitionTable,
    /// Slots in partition-table order; numbers unique.
    #[x_kube(validation = Rule::new("self.all(s, self.filter(t, t.number == s.number).size() == 1)").message("spec.layout.slots[].number must be unique"))]
    #[schemars(length(min = 1, max = 128))]
    pub slots: Vec<Slot>,
}

/// Role of a slot; OS-neutral.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema,
)]
pub enum SlotRole {
    /// EFI system partition.
    #[serde(rename = "esp")]
    Esp,
    /// A data partition (root, home, …).
    #[default]
    #[serde(rename = "data")]
    Data,
    /// Swap; made by mkswap with the saved UUID.
    #[serde(rename = "swap")]
    Swap,
    /// Microsoft reserved partition.
    #[serde(rename = "msr")]
    Msr,
}

/// One partition of an Image's layout.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("!(has(self.contentRef) && has(self.fsType))").message("spec.layout.slots[].contentRef and fsType are mutually exclusive: restored content carries its own file system").field_path(".fsType"))]
pub struct Slot {
    /// Partition number, 1-based, unique in the layout.
    #[schemars(range(min = 1, max = 128))]
    pub number: i32,
    /// esp, data, swap or msr.
    pub role: SlotRole,
    /// The PartitionContent restored into this slot; absent makes a blank
    /// slot. Its namespace must equal the Image's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content_ref: Option<NameRef>,
    /// File system created at deploy time for a blank data slot.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 32))]
    pub fs_type: Option<String>,
    /// File-system UUID to restore (swap slots without content).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 64))]
    pub uuid: Option<String>,
    /// GPT partition type GUID (or MBR type as hex) written for this slot.
    #[serde(default, skip_serializing_if = "Option::is_none", rename = "typeGUID")]
    #[schemars(length(max = 36))]
    pub type_guid: Option<String>,
    /// Unique GPT partition GUID; empty for mbr.
    #[serde(default, skip_serializing_if = "Option::is_none", rename = "partUUID")]
    #[schemars(length(max = 36))]
    pub part_uuid: Option<String>,
    /// Size of the slot in bytes, when known before deploy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub size_bytes: Option<i64>,
    /// Grow this slot (the last one) to fill the target disk.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grow: Option<bool>,
}

/// Lifecycle state of an Image.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema)]
pub enum ImageState {
    /// Some content is not ready yet.
    Pending,
    /// Every content resolves and is ready.
    Ready,
    /// Invalid or a content failed.
    Failed,
}

/// Observed state of an Image.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct ImageStatus {
    /// Pending, Ready or Failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<ImageState>,
    /// Number of slots in `spec.layout.slots` (a printer column cannot count
    /// a list).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slots: Option<i32>,
    /// Disk space the layout takes, in bytes: the sum over slots of
    /// `sizeBytes`, or of the content's `spec.sizeBytes` for a content slot
    /// without one (a growing slot counts at that size). Absent while a
    /// slot's size is unknown (a blank slot without `sizeBytes`, or a
    /// content that does not exist yet).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size_bytes: Option<i64>,
    /// Bytes a deploy writes: the sum of the contents' `spec.usedBytes`.
    /// Absent while a content does not exist yet.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub used_bytes: Option<i64>,
    /// Conditions: Ready, Valid, SeederDegraded.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    /// The metadata.generation this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
}
