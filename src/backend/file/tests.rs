//! The file backend over a temporary pool, a fake host (usage figures) and
//! a fake sysfs (loop devices): no root, no real loop device.

use super::*;
use crate::error::Kind;
use crate::exec::FakeRunner;
use crate::host::{FakeHost, FsUsage};
use crate::plugin::{AccessMode, AccessType, VolumeCapability};

struct Pool {
    dir: tempfile::TempDir,
    host: Arc<FakeHost>,
    runner: Arc<FakeRunner>,
    backend: FileBackend,
}

fn pool_with(free: u64) -> Pool {
    let dir = tempfile::tempdir().unwrap();
    let pool = dir.path().join("pool");
    let sysfs = dir.path().join("sys-block");
    std::fs::create_dir_all(&sysfs).unwrap();
    let host = Arc::new(FakeHost::new());
    // The pool's folders as the host seam sees them (the images
    // themselves are real files in the temporary folder).
    host.add_dir(&pool.join("volumes"));
    host.add_dir(&pool.join("snapshots"));
    host.set_usage(
        &pool,
        FsUsage {
            total_bytes: free * 2,
            free_bytes: free,
            available_bytes: free,
            ..Default::default()
        },
    );
    let runner = Arc::new(FakeRunner::new());
    let settings = FileSettings {
        pool,
        default_volume_size: Size(64 * MIB),
        max_volume_size: Size(1 << 30),
    };
    let backend = FileBackend::new("file", settings, runner.clone(), host.clone())
        .unwrap()
        .with_loops(LoopDevices::with_sysfs(
            Arc::new(crate::host::loopdev::FakeLoops::new(&sysfs, 50)),
            &sysfs,
        ));
    Pool {
        dir,
        host,
        runner,
        backend,
    }
}

fn pool() -> Pool {
    pool_with(10 << 30)
}

fn req(name: &str, required: u64, limit: u64) -> CreateVolume {
    CreateVolume {
        name: name.into(),
        required_bytes: required,
        limit_bytes: limit,
        capabilities: vec![VolumeCapability {
            access: AccessType::Block,
            mode: AccessMode::SingleNodeWriter,
        }],
        parameters: BTreeMap::new(),
        metadata: BTreeMap::new(),
        source: None,
        secrets: Secrets::default(),
    }
}

#[tokio::test]
async fn creates_sparse_images_in_whole_mib_and_answers_retries() {
    let p = pool();
    let v = p
        .backend
        .create_volume(&req("pvc-1", 5 * MIB + 1, 0))
        .await
        .unwrap();
    assert_eq!(v.id.to_string(), "file:pvc-1");
    assert_eq!(v.capacity_bytes, 6 * MIB);
    let image = p.dir.path().join("pool/volumes/pvc-1.img");
    assert_eq!(std::fs::metadata(&image).unwrap().len(), 6 * MIB);
    // A retry with a range the volume fits: the same volume.
    let again = p
        .backend
        .create_volume(&req("pvc-1", 6 * MIB, 8 * MIB))
        .await
        .unwrap();
    assert_eq!(again, v);
    // One it does not fit: ALREADY_EXISTS, and nothing changed.
    let err = p
        .backend
        .create_volume(&req("pvc-1", 7 * MIB, 0))
        .await
        .unwrap_err();
    assert_eq!(err.kind, Kind::AlreadyExists);
    assert_eq!(std::fs::metadata(&image).unwrap().len(), 6 * MIB);
    // No size named: the pool's default.
    let d = p
        .backend
        .create_volume(&req("pvc-default", 0, 0))
        .await
        .unwrap();
    assert_eq!(d.capacity_bytes, 64 * MIB);
}

#[tokio::test]
async fn sizes_the_pool_cannot_hold_are_refused_before_anything_is_written() {
    let p = pool_with(100 * MIB);
    let err = p
        .backend
        .create_volume(&req("big", 200 * MIB, 0))
        .await
        .unwrap_err();
    assert_eq!(err.kind, Kind::ResourceExhausted, "{}", err.message);
    let err = p
        .backend
        .create_volume(&req("huge", 2 << 30, 0))
        .await
        .unwrap_err();
    assert_eq!(err.kind, Kind::OutOfRange, "{}", err.message);
    assert_eq!(
        std::fs::read_dir(p.dir.path().join("pool/volumes"))
            .unwrap()
            .count(),
        0
    );
    let c = p.backend.capacity(&BTreeMap::new()).await.unwrap();
    assert_eq!(c.available_bytes, 100 * MIB);
    assert_eq!(c.maximum_volume_bytes, Some(100 * MIB));
    assert_eq!(c.minimum_volume_bytes, Some(MIB));
}

#[tokio::test]
async fn expansion_grows_the_image_and_checks_space() {
    let p = pool_with(100 * MIB);
    let v = p
        .backend
        .create_volume(&req("pvc-1", 10 * MIB, 0))
        .await
        .unwrap();
    let none = Secrets::default();
    assert_eq!(
        p.backend
            .expand_volume(&v.id, 20 * MIB + 1, 0, &none)
            .await
            .unwrap(),
        21 * MIB
    );
    assert_eq!(
        std::fs::metadata(p.dir.path().join("pool/volumes/pvc-1.img"))
            .unwrap()
            .len(),
        21 * MIB
    );
    // Asking for less is a no-op, never a shrink.
    assert_eq!(
        p.backend.expand_volume(&v.id, MIB, 0, &none).await.unwrap(),
        21 * MIB
    );
    // More than is free now may work later (transient); more than the
    // whole pool never will (final: the CO lets the user ask for less).
    assert_eq!(
        p.backend
            .expand_volume(&v.id, 150 * MIB, 0, &none)
            .await
            .unwrap_err()
            .kind,
        Kind::ResourceExhausted
    );
    assert_eq!(
        p.backend
            .expand_volume(&v.id, 500 * MIB, 0, &none)
            .await
            .unwrap_err()
            .kind,
        Kind::OutOfRange
    );
    assert_eq!(
        p.backend
            .expand_volume(&v.id, 30 * MIB, 25 * MIB, &none)
            .await
            .unwrap_err()
            .kind,
        Kind::OutOfRange
    );
    let missing = VolumeId::parse("file:nope").unwrap();
    assert_eq!(
        p.backend
            .expand_volume(&missing, MIB, 0, &none)
            .await
            .unwrap_err()
            .kind,
        Kind::NotFound
    );
}

#[tokio::test]
async fn pages_read_only_their_entries_and_follow_creates_and_deletes() {
    let p = pool();
    for i in 0..7 {
        p.backend
            .create_volume(&req(&format!("v{i}"), MIB, 0))
            .await
            .unwrap();
    }
    let page = |after: Option<&str>, limit| Page {
        after: after.map(str::to_string),
        limit,
    };
    let ids = |v: Vec<VolumeInfo>| {
        v.into_iter()
            .map(|v| v.id.locator().to_string())
            .collect::<Vec<_>>()
    };
    assert_eq!(
        ids(p.backend.list_volumes(&page(None, 3)).await.unwrap()),
        ["v0", "v1", "v2"]
    );
    assert_eq!(
        ids(p.backend.list_volumes(&page(Some("v2"), 3)).await.unwrap()),
        ["v3", "v4", "v5"]
    );
    p.backend
        .delete_volume(&VolumeId::parse("file:v3").unwrap(), &Secrets::default())
        .await
        .unwrap();
    p.backend.create_volume(&req("v2a", MIB, 0)).await.unwrap();
    assert_eq!(
        ids(p.backend.list_volumes(&page(Some("v2"), 10)).await.unwrap()),
        ["v2a", "v4", "v5", "v6"]
    );
    // A restarted backend finds the same pool.
    let sysfs = p.dir.path().join("sys-block");
    let runner = Arc::new(FakeRunner::new());
    let again = FileBackend::new(
        "file",
        p.backend.settings.clone(),
        runner.clone(),
        p.host.clone(),
    )
    .unwrap()
    .with_loops(LoopDevices::with_sysfs(
        Arc::new(crate::host::loopdev::FakeLoops::new(&sysfs, 50)),
        &sysfs,
    ));
    assert_eq!(
        ids(again.list_volumes(&Page::all()).await.unwrap()).len(),
        7
    );
}

#[tokio::test]
async fn delete_is_idempotent_and_refuses_an_attached_image() {
    let p = pool();
    let v = p
        .backend
        .create_volume(&req("pvc-1", MIB, 0))
        .await
        .unwrap();
    // The image is attached on this node (a loop device backs it).
    let lo = p.dir.path().join("sys-block/loop3/loop");
    std::fs::create_dir_all(&lo).unwrap();
    let image = p.dir.path().join("pool/volumes/pvc-1.img");
    std::fs::write(lo.join("backing_file"), format!("{}\n", image.display())).unwrap();
    let none = Secrets::default();
    assert_eq!(
        p.backend
            .delete_volume(&v.id, &none)
            .await
            .unwrap_err()
            .kind,
        Kind::FailedPrecondition
    );
    std::fs::remove_file(lo.join("backing_file")).unwrap();
    p.backend.delete_volume(&v.id, &none).await.unwrap();
    p.backend.delete_volume(&v.id, &none).await.unwrap();
    assert!(p
        .backend
        .get_volume(&v.id, &Secrets::default())
        .await
        .unwrap()
        .is_none());
}

#[tokio::test]
async fn sources_of_other_backends_or_missing_ones_are_not_found() {
    let p = pool();
    let mut r = req("clone", MIB, 0);
    r.source = Some(ContentSource::Volume(
        VolumeId::parse("lvm:fast.fv-a").unwrap(),
    ));
    assert_eq!(
        p.backend.create_volume(&r).await.unwrap_err().kind,
        Kind::NotFound
    );
    r.source = Some(ContentSource::Snapshot(
        SnapshotId::parse("file:none").unwrap(),
    ));
    assert_eq!(
        p.backend.create_volume(&r).await.unwrap_err().kind,
        Kind::NotFound
    );
    assert!(p
        .backend
        .get_snapshot(
            &SnapshotId::parse("file:none").unwrap(),
            &Secrets::default()
        )
        .await
        .unwrap()
        .is_none());
}

#[tokio::test]
async fn health_needs_a_writable_pool() {
    let p = pool();
    p.backend.health().await.unwrap();
    p.host.set_read_only(&p.dir.path().join("pool"));
    assert_eq!(
        p.backend.health().await.unwrap_err().kind,
        Kind::FailedPrecondition
    );
}

/// A snapshot copy that fails is RESOURCE_EXHAUSTED when the pool has less
/// room than the source's blocks take, whatever cp printed; another
/// failure stays what it is, whatever its words (it was decided by
/// looking for "No space left" in the message).
#[tokio::test]
async fn a_failed_snapshot_copy_is_out_of_space_only_when_the_pool_is() {
    use crate::exec::Reply;
    let p = pool();
    let v = p
        .backend
        .create_volume(&req("pvc-s", 4 * MIB, 0))
        .await
        .unwrap();
    let image = p
        .dir
        .path()
        .join("pool/volumes")
        .join(format!("{}.img", v.id.locator()));
    std::fs::write(&image, vec![7u8; 1 << 20]).unwrap();
    let snap = |name: &str| CreateSnapshot {
        source: v.id.clone(),
        name: name.into(),
        parameters: BTreeMap::new(),
        metadata: BTreeMap::new(),
        secrets: Secrets::default(),
    };
    // Room enough: the failure is the copy's own, though it says "No
    // space left".
    p.runner.expect(
        "cp",
        Reply::Fail(1, "cp: error writing 'x': No space left on device".into()),
    );
    let e = p.backend.create_snapshot(&snap("s1")).await.unwrap_err();
    assert_eq!(e.kind, Kind::Internal, "{e}");
    // The pool is full: out of space, whatever cp said.
    let pool_dir = p.dir.path().join("pool");
    p.host.set_usage(
        &pool_dir,
        FsUsage {
            total_bytes: 1 << 30,
            free_bytes: 4096,
            available_bytes: 4096,
            ..Default::default()
        },
    );
    p.runner.expect(
        "cp",
        Reply::Fail(1, "cp: write error: Input/output error".into()),
    );
    let e = p.backend.create_snapshot(&snap("s2")).await.unwrap_err();
    assert_eq!(e.kind, Kind::ResourceExhausted, "{e}");
    assert!(p
        .backend
        .list_snapshots(None, &Page::all())
        .await
        .unwrap()
        .is_empty());
}

/// Blocks the image holds on disk.
fn allocated(p: &Pool, name: &str) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(p.dir.path().join(format!("pool/volumes/{name}.img")))
        .unwrap()
        .blocks()
        * 512
}

#[tokio::test]
async fn preallocate_allocates_the_image_and_its_growth_or_changes_nothing() {
    let p = pool_with(100 * MIB);
    let none = Secrets::default();
    let v = p
        .backend
        .create_volume(&req("pvc-1", 8 * MIB, 0))
        .await
        .unwrap();
    assert!(allocated(&p, "pvc-1") < MIB, "a new image is sparse");
    let set = |v: &str| BTreeMap::from([(PREALLOCATE.to_string(), v.to_string())]);
    // A value that is not one is refused before anything changes.
    let e = p.backend.check_mutable(&set("yes")).unwrap_err();
    assert_eq!(e.kind, Kind::InvalidArgument);
    assert!(e.message.contains("preallocate"), "{}", e.message);

    p.backend
        .modify_volume(&v.id, &set("true"), &none)
        .await
        .unwrap();
    assert_eq!(allocated(&p, "pvc-1"), 8 * MIB);
    // Again: no change. Growth is allocated too.
    p.backend
        .modify_volume(&v.id, &set("true"), &none)
        .await
        .unwrap();
    p.backend
        .expand_volume(&v.id, 12 * MIB, 0, &none)
        .await
        .unwrap();
    assert_eq!(allocated(&p, "pvc-1"), 12 * MIB);
    // Back to false: recorded, nothing freed; growth stays sparse.
    p.backend
        .modify_volume(&v.id, &set("false"), &none)
        .await
        .unwrap();
    p.backend
        .expand_volume(&v.id, 16 * MIB, 0, &none)
        .await
        .unwrap();
    assert_eq!(allocated(&p, "pvc-1"), 12 * MIB);

    // A pool without the room: refused, naming the key, nothing allocated
    // and the record unchanged.
    let big = p
        .backend
        .create_volume(&req("pvc-2", 90 * MIB, 0))
        .await
        .unwrap();
    p.host.set_usage(
        &p.dir.path().join("pool"),
        FsUsage {
            total_bytes: 200 * MIB,
            free_bytes: 50 * MIB,
            available_bytes: 50 * MIB,
            ..Default::default()
        },
    );
    let e = p
        .backend
        .modify_volume(&big.id, &set("true"), &none)
        .await
        .unwrap_err();
    assert_eq!(e.kind, Kind::InvalidArgument);
    assert!(
        e.message.contains("preallocate") && e.message.contains("nothing was changed"),
        "{}",
        e.message
    );
    assert!(allocated(&p, "pvc-2") < MIB);
    let (meta, _) = p.backend.load_volume("pvc-2").unwrap().unwrap();
    assert!(!meta.preallocated);
    let missing = VolumeId::parse("file:nope").unwrap();
    assert_eq!(
        p.backend
            .modify_volume(&missing, &set("true"), &none)
            .await
            .unwrap_err()
            .kind,
        Kind::NotFound
    );
}
