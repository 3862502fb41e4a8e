//! Changed block tracking through the binary on the host, with the file
//! backend: a raw block volume written block by block between two
//! snapshots; GetMetadataAllocated names every block written, and
//! GetMetadataDelta exactly those whose bytes changed (a block written
//! again with the same bytes is not one), in pages as small as the client
//! asks; the base snapshot's bytes with the delta's ranges copied in from
//! the target equal the target. Needs root (loop devices).

mod common;

use common::*;
use ferrovol::proto as pb;
use std::os::unix::fs::FileExt;

const MIB: i64 = 1 << 20;
const B: u64 = 4096;

/// Writes `byte` over block `n` of the device at `path`, synced.
fn write_block(path: &std::path::Path, n: u64, byte: u8) {
    let f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    f.write_all_at(&vec![byte; B as usize], n * B).unwrap();
    f.sync_all().unwrap();
}

async fn allocated(
    h: &Harness,
    snapshot: &str,
    start: i64,
    max: i32,
) -> Vec<pb::GetMetadataAllocatedResponse> {
    let mut stream = h
        .metadata()
        .get_metadata_allocated(pb::GetMetadataAllocatedRequest {
            snapshot_id: snapshot.into(),
            starting_offset: start,
            max_results: max,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let mut out = Vec::new();
    while let Some(m) = stream.message().await.unwrap() {
        out.push(m);
    }
    out
}

async fn delta(
    h: &Harness,
    base: &str,
    target: &str,
    start: i64,
    max: i32,
) -> Result<Vec<pb::GetMetadataDeltaResponse>, tonic::Status> {
    let mut stream = h
        .metadata()
        .get_metadata_delta(pb::GetMetadataDeltaRequest {
            base_snapshot_id: base.into(),
            target_snapshot_id: target.into(),
            starting_offset: start,
            max_results: max,
            ..Default::default()
        })
        .await?
        .into_inner();
    let mut out = Vec::new();
    while let Some(m) = stream.message().await? {
        out.push(m);
    }
    Ok(out)
}

fn ranges<'a>(blocks: impl Iterator<Item = &'a pb::BlockMetadata>) -> Vec<(u64, u64)> {
    blocks
        .map(|b| (b.byte_offset as u64, b.size_bytes as u64))
        .collect()
}

#[tokio::test]
async fn changed_blocks_are_exactly_the_blocks_written_between_two_snapshots() {
    require_root();
    let h = Harness::start().await;
    let caps = h
        .identity()
        .get_plugin_capabilities(pb::GetPluginCapabilitiesRequest {})
        .await
        .unwrap()
        .into_inner();
    assert!(
        format!("{caps:?}").contains("SnapshotMetadataService"),
        "{caps:?}"
    );
    let vol = h.provision("cbt", 16 * MIB, block_cap(SNW)).await;
    let device = vol.target.clone();
    for (n, byte) in [(0, 1), (10, 2), (11, 3), (1000, 4)] {
        write_block(&device, n, byte);
    }
    let s1 = h.snapshot("cbt-1", &vol.id).await;
    // Block 10 changed, 500 and 2000 new, 1000 written with its own bytes.
    for (n, byte) in [(10, 9), (500, 5), (2000, 6), (1000, 4)] {
        write_block(&device, n, byte);
    }
    let s2 = h.snapshot("cbt-2", &vol.id).await;

    // Allocated: every block written, and not much else (the pool's
    // filesystem allocates what is written).
    let pages = allocated(&h, &s1, 0, 0).await;
    assert!(!pages.is_empty());
    for p in &pages {
        assert_eq!(p.volume_capacity_bytes, 16 * MIB);
        assert_eq!(
            p.block_metadata_type,
            pb::BlockMetadataType::VariableLength as i32
        );
    }
    let all = ranges(pages.iter().flat_map(|p| &p.block_metadata));
    for n in [0u64, 10, 11, 1000] {
        assert!(
            all.iter().any(|(o, l)| *o <= n * B && n * B + B <= o + l),
            "block {n} is not in {all:?}"
        );
    }
    let total: u64 = all.iter().map(|(_, l)| l).sum();
    assert!(
        total <= 4 * B + (1 << 20),
        "{total} bytes allocated for 4 blocks: {all:?}"
    );

    // The delta: exactly blocks 10, 500, 2000.
    let want = vec![(10 * B, B), (500 * B, B), (2000 * B, B)];
    let pages = delta(&h, &s1, &s2, 0, 0).await.unwrap();
    assert_eq!(ranges(pages.iter().flat_map(|p| &p.block_metadata)), want);
    // One range per message when the client asks for one: three messages.
    let pages = delta(&h, &s1, &s2, 0, 1).await.unwrap();
    assert_eq!(pages.len(), 3, "{pages:?}");
    assert!(pages.iter().all(|p| p.block_metadata.len() == 1));
    assert_eq!(ranges(pages.iter().flat_map(|p| &p.block_metadata)), want);
    // From an offset: what lies at or after it.
    let pages = delta(&h, &s1, &s2, (500 * B) as i64, 0).await.unwrap();
    assert_eq!(
        ranges(pages.iter().flat_map(|p| &p.block_metadata)),
        want[1..].to_vec()
    );

    // The proof: the base's bytes, with the delta's ranges taken from the
    // target, are the target's bytes.
    let images = h.state_dir().join("pool/snapshots");
    let image = |id: &str| {
        let locator = id.rsplit(':').next().unwrap();
        std::fs::read(images.join(format!("{locator}.img"))).unwrap()
    };
    let (mut rebuilt, target) = (image(&s1), image(&s2));
    assert_ne!(rebuilt, target);
    for (o, l) in &want {
        let (o, l) = (*o as usize, *l as usize);
        rebuilt[o..o + l].copy_from_slice(&target[o..o + l]);
    }
    assert!(rebuilt == target, "base + delta is not the target");

    // The same through the client, as a backup tool would: each snapshot
    // restored to a raw block volume, a full image of the first from its
    // allocated ranges, the second's delta written over it: the image is
    // the second snapshot, byte for byte.
    let restore = |name: &'static str, snapshot: String| {
        let mut req = create_req(name, 16 * MIB, block_cap(SNW));
        req.volume_content_source = Some(snapshot_source(&snapshot));
        h.provision_req(req)
    };
    let (r1, r2) = (
        restore("cbt-r1", s1.clone()).await,
        restore("cbt-r2", s2.clone()).await,
    );
    let backup = h.path("backup.img");
    let client = |args: &[&str]| h.client_json(args);
    let b = backup.to_str().unwrap();
    let full = client(&[
        "backup",
        &s1,
        "--data",
        r1.target.to_str().unwrap(),
        "--out",
        b,
    ]);
    assert_eq!(full["image_bytes"], 16 * MIB);
    let inc = client(&[
        "backup",
        &s2,
        "--base",
        &s1,
        "--data",
        r2.target.to_str().unwrap(),
        "--out",
        b,
    ]);
    assert_eq!(inc["ranges"], 3, "{inc}");
    assert_eq!(inc["bytes_copied"], 3 * B, "{inc}");
    assert!(
        std::fs::read(&backup).unwrap() == target,
        "full + delta is not the second snapshot"
    );
    let listed = client(&["delta", &s1, &s2, "--max-results", "2"]);
    assert_eq!(listed["messages"], 2, "{listed}");
    assert_eq!(listed["ranges"].as_array().unwrap().len(), 3, "{listed}");

    // Errors the spec names.
    let err = |r: Result<Vec<pb::GetMetadataDeltaResponse>, tonic::Status>| r.unwrap_err().code();
    assert_eq!(
        err(delta(&h, &s1, &s2, 16 * MIB, 0).await),
        tonic::Code::OutOfRange
    );
    assert_eq!(
        err(delta(&h, &s1, "file:nosuch", 0, 0).await),
        tonic::Code::NotFound
    );
    assert_eq!(
        err(delta(&h, &s1, &s2, 0, -1).await),
        tonic::Code::InvalidArgument
    );
    assert_eq!(
        err(delta(&h, "", &s2, 0, 0).await),
        tonic::Code::InvalidArgument
    );
    let other = h.provision("cbt-other", 16 * MIB, block_cap(SNW)).await;
    let s3 = h.snapshot("cbt-other-1", &other.id).await;
    assert_eq!(
        err(delta(&h, &s1, &s3, 0, 0).await),
        tonic::Code::InvalidArgument
    );

    for p in [&vol, &other, &r1, &r2] {
        h.teardown(p).await;
    }
}
