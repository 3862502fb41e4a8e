//! Raw block volumes and changed block tracking across backends: helpers
//! the backends' files share, and the file, iscsi and nvmf backup test.

use super::*;

/// A block volume of `class`, staged and published; returns its id and
/// the device path the pod sees.
pub(crate) async fn block_volume(
    h: &Harness,
    name: &str,
    class: &str,
    size: i64,
) -> (String, std::path::PathBuf) {
    let cap = block_cap(SNW);
    let mut req = create_req(name, size, cap.clone());
    req.parameters.insert("deviceClass".into(), class.into());
    let vol = h.create(req).await;
    let staging = h.path(&format!("kubelet/staging/{name}"));
    std::fs::create_dir_all(&staging).unwrap();
    h.node()
        .node_stage_volume(stage_req(&vol.volume_id, &staging, cap.clone()))
        .await
        .unwrap();
    let target = h.path(&format!("kubelet/pods/{name}"));
    h.node()
        .node_publish_volume(publish_req(&vol.volume_id, &staging, &target, cap, false))
        .await
        .unwrap();
    (vol.volume_id, target)
}

/// Unpublishes, unstages and deletes a volume made by [`block_volume`].
pub(crate) async fn drop_block_volume(h: &Harness, name: &str, id: &str) {
    let (mut c, mut n) = (h.controller(), h.node());
    n.node_unpublish_volume(unpublish_req(id, &h.path(&format!("kubelet/pods/{name}"))))
        .await
        .unwrap();
    n.node_unstage_volume(unstage_req(id, &h.path(&format!("kubelet/staging/{name}"))))
        .await
        .unwrap();
    c.delete_volume(pb::DeleteVolumeRequest {
        volume_id: id.into(),
        ..Default::default()
    })
    .await
    .unwrap();
}

/// Writes `byte` over `len` bytes of a device from `offset`, synced.
pub(crate) fn fill(dev: &std::path::Path, offset: u64, len: usize, byte: u8) {
    use std::io::{Seek, Write};
    let mut f = std::fs::OpenOptions::new().write(true).open(dev).unwrap();
    f.seek(std::io::SeekFrom::Start(offset)).unwrap();
    let chunk = vec![byte; len.min(1 << 20)];
    let mut left = len;
    while left > 0 {
        let n = left.min(chunk.len());
        f.write_all(&chunk[..n]).unwrap();
        left -= n;
    }
    f.sync_all().unwrap();
}

/// How many bytes of the device read back as one of `bytes`.
pub(crate) fn count_bytes(dev: &std::path::Path, bytes: &[u8]) -> usize {
    std::fs::read(dev)
        .unwrap()
        .iter()
        .filter(|b| bytes.contains(b))
        .count()
}

/// Stages (`stage`) and publishes at `target` a volume that grew while
/// unused, and has the node grow its filesystem to `bytes`; returns the
/// filesystem's size.
pub(crate) async fn stage_grown(
    h: &Harness,
    stage: pb::NodeStageVolumeRequest,
    target: &std::path::Path,
    cap: &pb::VolumeCapability,
    bytes: i64,
) -> i64 {
    let id = stage.volume_id.clone();
    let staging = std::path::PathBuf::from(&stage.staging_target_path);
    h.node().node_stage_volume(stage).await.unwrap();
    h.node()
        .node_publish_volume(publish_req(&id, &staging, target, cap.clone(), false))
        .await
        .unwrap();
    h.grow_staged(&id, target, Some((&staging, cap)), &HashMap::new(), bytes)
        .await;
    h.total_bytes(&id, target).await
}

/// What a backend reports for [`changed_blocks_backup`]'s writes, at its
/// granularity: the first snapshot's allocated ranges, and the two
/// rewritten blocks' ranges in the delta.
pub(crate) struct Expected {
    pub(crate) allocated: Vec<(u64, u64)>,
    pub(crate) delta: Vec<(u64, u64)>,
}

/// Changed block tracking through a raw block volume of 16 MiB staged
/// here (`bring_up(name, snapshot to restore)`): 4 KiB written at 0 and at
/// 1 MiB, a snapshot; 1 MiB and 5 MiB rewritten, a second one. What the
/// first holds (the blocks at 0 and 1 MiB; on lvm the whole first MiB,
/// which its node wipes at first attach; on rbd the object from its start
/// to its last write) and the delta (the two blocks rewritten) are
/// exactly what the backend's granularity makes of them (`expected`),
/// paged as asked and from an offset; a backup image made by the client
/// from the first snapshot's ranges, then the delta over it, equals the
/// second snapshot restored. The restores are torn down; the volume and
/// both snapshots are the caller's, with what the backup copied.
pub(crate) async fn changed_blocks_backup<F, Fut>(
    h: &Harness,
    name: &str,
    expected: Expected,
    bring_up: F,
) -> (Published, Vec<String>, u64)
where
    F: Fn(String, Option<String>) -> Fut,
    Fut: std::future::Future<Output = Published>,
{
    let write = |dev: &std::path::Path, offset: u64, byte: u8| {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new().write(true).open(dev).unwrap();
        f.write_all_at(&vec![byte; 4096], offset).unwrap();
        f.sync_all().unwrap();
    };
    let m = MIB as u64;
    let vol = bring_up(name.into(), None).await;
    write(&vol.target, 0, 1);
    write(&vol.target, m, 2);
    let s1 = h.snapshot(&format!("{name}-1"), &vol.id).await;
    write(&vol.target, m, 3);
    write(&vol.target, 5 * m, 4);
    let s2 = h.snapshot(&format!("{name}-2"), &vol.id).await;

    let ranges = |v: &serde_json::Value| -> Vec<(u64, u64)> {
        v["ranges"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| (r[0].as_u64().unwrap(), r[1].as_u64().unwrap()))
            .collect()
    };
    let client = |args: &[&str]| h.client_json(args);
    let allocated = client(&["allocated", &s1]);
    assert_eq!(allocated["volume_capacity_bytes"], 16 * MIB);
    assert_eq!(
        ranges(&allocated),
        expected.allocated,
        "{name}: {allocated}"
    );
    // Each rewritten block is in the delta.
    for at in [m, 5 * m] {
        assert!(
            expected
                .delta
                .iter()
                .any(|(o, l)| *o <= at && at + 4096 <= o + l),
            "{name}: the block at {at} is not in the expected delta"
        );
    }
    let delta = client(&["delta", &s1, &s2, "--max-results", "1"]);
    assert_eq!(ranges(&delta), expected.delta, "{name}: {delta}");
    assert_eq!(delta["messages"], 2, "{delta}");
    let later = client(&["delta", &s1, &s2, "--starting-offset", &(2 * m).to_string()]);
    let tail: Vec<(u64, u64)> = expected
        .delta
        .iter()
        .filter(|(o, l)| o + l > 2 * m)
        .map(|(o, l)| ((*o).max(2 * m), o + l - (*o).max(2 * m)))
        .collect();
    assert_eq!(ranges(&later), tail, "{later}");

    // A backup: the first snapshot's ranges, then the delta, each read
    // from the snapshot restored; the image is the second snapshot.
    let (r1, r2) = (
        bring_up(format!("{name}-r1"), Some(s1.clone())).await,
        bring_up(format!("{name}-r2"), Some(s2.clone())).await,
    );
    let image = h.path(&format!("{name}-backup.img"));
    let b = image.to_str().unwrap();
    let full = client(&[
        "backup",
        &s1,
        "--data",
        r1.target.to_str().unwrap(),
        "--out",
        b,
    ]);
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
    let delta_bytes: u64 = expected.delta.iter().map(|(_, l)| l).sum();
    assert_eq!(inc["bytes_copied"], delta_bytes, "{inc}");
    let restored = {
        use std::io::Read;
        let mut all = vec![0u8; 16 * MIB as usize];
        std::fs::File::open(&r2.target)
            .unwrap()
            .read_exact(&mut all)
            .unwrap();
        all
    };
    assert!(
        std::fs::read(&image).unwrap() == restored,
        "{name}: full + delta is not the second snapshot"
    );
    for p in [&r1, &r2] {
        h.teardown(p).await;
    }
    let copied = full["bytes_copied"].as_u64().unwrap() + inc["bytes_copied"].as_u64().unwrap();
    (vol, vec![s1, s2], copied)
}

/// Changed block tracking of the file backend, and of iscsi and nvmf over
/// file stores (the LUN or namespace written through the node's
/// connection), in the guest (see [`changed_blocks_backup`]): exact at
/// 4 KiB, the delta only the blocks whose bytes changed.
#[tokio::test]
#[ignore = "needs the real-kernel guest: run tests/guest/suite"]
async fn guest_file_iscsi_and_nvmf_changed_blocks() {
    require_guest();
    let tgtd = Tgtd::new();
    let _iscsid = Iscsid::new();
    let nvmet = NvmetPort::new("nqn.2026-12.io.ferrovol.cbt");
    let config = format!(
        "[[backend]]\ntype = \"file\"\npool = \"@DIR@/file-pool\"\n{}{}",
        tgtd.file_store_config("iqn.2026-11.io.ferrovol.cbt"),
        nvmet.file_store_config()
    );
    let h = Harness::start_with(Some(&config)).await;
    let m = MIB as u64;
    for (backend, attach) in [("file", false), ("iscsi", true), ("nvmf", true)] {
        let bring_up = |name: String, from: Option<String>| {
            let mut req = create_req(&format!("{backend}-{name}"), 16 * MIB, block_cap(SNW));
            req.parameters.insert("backend".into(), backend.into());
            req.volume_content_source = from.as_deref().map(snapshot_source);
            let h = &h;
            async move {
                match attach {
                    true => h.provision_attached(req).await,
                    false => h.provision_req(req).await,
                }
            }
        };
        let expected = Expected {
            allocated: vec![(0, 4096), (m, 4096)],
            delta: vec![(m, 4096), (5 * m, 4096)],
        };
        let (vol, snaps, copied) =
            changed_blocks_backup(&h, &format!("cbt-{backend}"), expected, bring_up).await;
        eprintln!("{backend}: the backup copied {copied} bytes");
        for s in snaps {
            h.delete_snapshot(&s).await;
        }
        h.teardown(&vol).await;
    }
    assert!(h.mounts().is_empty(), "{:?}", h.mounts());
}
