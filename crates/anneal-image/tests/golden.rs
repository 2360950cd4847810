//! Golden vectors of the content format and of partclone import
//! (tests/fixtures/imaging; regenerate with tests/fixtures/imaging/regen.sh).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
#![allow(clippy::too_many_lines)]

mod common;

use anneal_image::extents::Extent;
use anneal_image::format::{self, ContentIndex, Header};
use anneal_image::restore::{self, Content, Target};
use anneal_image::{CONTRACT_VERSION, capture};
use sha1::Digest as _;
use std::io::Read as _;
use std::path::PathBuf;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/imaging")
}

fn regen() -> bool {
    std::env::var_os("ANNEAL_REGEN_FIXTURES").is_some()
}

/// Checks `bytes` against the fixture `name`, or writes it in regen mode.
fn golden(name: &str, bytes: &[u8]) {
    let p = fixtures().join(name);
    if regen() {
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(&p, bytes).unwrap();
        return;
    }
    let want = std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    assert!(want == bytes, "{name} differs from the golden vector");
}

fn sample() -> (ContentIndex, Vec<u8>) {
    let extents = vec![
        Extent {
            offset: 0,
            len: 20 << 10,
        },
        Extent {
            offset: 64 << 10,
            len: 16 << 10,
        },
        Extent {
            offset: (1 << 20) - 4096,
            len: 4096,
        },
    ];
    let used: u64 = extents.iter().map(|e| e.len).sum();
    let stream = common::noise(42, used as usize);
    let piece_length = 16u32 << 10;
    let piece_hashes = stream
        .chunks(piece_length as usize)
        .map(|c| sha1::Sha1::digest(c).into())
        .collect();
    let idx = ContentIndex {
        header: Header {
            block_size: 4096,
            piece_length,
            partition_size: 1 << 20,
            used_bytes: used,
            last_extent_end: 1 << 20,
            fs_type: "ext4".into(),
            flags: 0,
            uuid: format::parse_uuid_string("0b1c2d3e-4f50-4172-8394-a5b6c7d8e9f0").unwrap(),
            label: "golden".into(),
            stream_sha256: sha2::Sha256::digest(&stream).into(),
        },
        extents,
        piece_hashes,
    };
    (idx, stream)
}

fn redigest(mut b: Vec<u8>) -> Vec<u8> {
    let n = b.len() - 32;
    let d = sha2::Sha256::digest(&b[..n]);
    b[n..].copy_from_slice(&d);
    b
}

#[test]
fn content_v1_vectors() {
    assert_eq!(CONTRACT_VERSION, 1);
    let (idx, stream) = sample();
    let bytes = idx.build().unwrap();
    golden("content-v1.index", &bytes);
    golden("content-v1.stream", &stream);
    let map: Vec<Vec<[u64; 3]>> = idx
        .piece_map()
        .iter()
        .map(|p| {
            p.iter()
                .map(|r| [r.disk_offset, r.stream_offset, r.len])
                .collect()
        })
        .collect();
    let json = serde_json::json!({
        "contractVersion": CONTRACT_VERSION,
        "indexBytes": bytes.len(),
        "usedBytes": idx.header.used_bytes,
        "streamSha256": idx.stream_sha256_hex(),
        "pieceSha1": idx.piece_hashes.iter().map(hex::encode).collect::<Vec<_>>(),
        "pieceMap [diskOffset, streamOffset, len]": map,
    });
    golden(
        "content-v1.json",
        format!("{}\n", serde_json::to_string_pretty(&json).unwrap()).as_bytes(),
    );
    let parsed =
        ContentIndex::parse(&std::fs::read(fixtures().join("content-v1.index")).unwrap()).unwrap();
    assert_eq!(parsed, idx);
    // piece 1 spans the end of the first extent and the start of the second
    assert_eq!(map[1], vec![[16384, 16384, 4096], [65536, 20480, 12288]]);
}

#[test]
fn hostile_index_vectors_are_refused() {
    let (idx, _) = sample();
    let good = idx.build().unwrap();
    let mut cases: Vec<(&str, Vec<u8>)> = Vec::new();
    cases.push(("truncated.index", good[..good.len() - 21].to_vec()));
    let mut overlap = good.clone();
    // second extent starts inside the first
    overlap[256 + 16..256 + 24].copy_from_slice(&(4096u64).to_le_bytes());
    cases.push(("overlapping-extents.index", redigest(overlap)));
    let mut out_of_range = good.clone();
    out_of_range[256 + 32..256 + 40].copy_from_slice(&(1u64 << 20).to_le_bytes());
    cases.push(("extent-past-partition.index", redigest(out_of_range)));
    let mut lying = good.clone();
    lying[32..40].copy_from_slice(&((44u64 << 10) + 4096).to_le_bytes());
    cases.push(("used-bytes-lie.index", redigest(lying)));
    let mut piece = good.clone();
    piece[20..24].copy_from_slice(&(3000u32).to_le_bytes());
    cases.push(("piece-length-not-power-of-two.index", redigest(piece)));
    let mut digest = good.clone();
    digest[300] ^= 1;
    cases.push(("bad-digest.index", digest));
    for (name, bytes) in &cases {
        golden(&format!("hostile/{name}"), bytes);
        let b = std::fs::read(fixtures().join("hostile").join(name)).unwrap();
        assert!(ContentIndex::parse(&b).is_err(), "{name} accepted");
    }
}

#[test]
fn partclone_ext2_vector() {
    let dir = common::tmpdir();
    let d = dir.path();
    let gz = fixtures().join("partclone-ext2-256k.pcl.gz");
    let (idx, info) = capture::capture_partclone_file(
        &gz,
        d,
        "p1",
        capture::Options {
            piece_length: 16 << 10,
        },
    )
    .unwrap();
    assert_eq!(info.fs_type, "ext2");
    assert_eq!(info.label, "golden");
    let json = serde_json::json!({
        "fsType": info.fs_type,
        "uuid": idx.header.uuid_string(),
        "blockSize": idx.header.block_size,
        "partitionSize": idx.header.partition_size,
        "usedBytes": idx.header.used_bytes,
        "extents": idx.extents.iter().map(|e| [e.offset, e.len]).collect::<Vec<_>>(),
        "streamSha256": idx.stream_sha256_hex(),
    });
    golden(
        "partclone-ext2-256k.json",
        format!("{}\n", serde_json::to_string_pretty(&json).unwrap()).as_bytes(),
    );
    // restored bytes equal the original filesystem in every used block
    let target = d.join("restored.img");
    let c = Content::load("p1", &d.join("p1.index"), &d.join("p1.stream")).unwrap();
    let mut t = Target::open(&target, Some(idx.header.partition_size)).unwrap();
    restore::restore_partition(&mut t, 0, &c).unwrap();
    let mut orig = Vec::new();
    flate2::read::GzDecoder::new(std::fs::File::open(fixtures().join("ext2-256k.img.gz")).unwrap())
        .read_to_end(&mut orig)
        .unwrap();
    let got = std::fs::read(&target).unwrap();
    for e in &idx.extents {
        let r = e.offset as usize..e.end() as usize;
        assert!(got[r.clone()] == orig[r], "extent {e:?}");
    }
    assert_eq!(
        common::ext4_file(&target, "hello.txt"),
        b"golden vector for anneal-image\n"
    );
}
