//! Staging: formats, copies' UUIDs, failures undone, second targets, repairs, concurrency.

use super::*;

#[tokio::test]
async fn stage_formats_empty_device_and_mounts_once() {
    let f = fixture();
    f.runner.expect("blkid", Reply::Fail(2, String::new()));
    f.runner.ok("mkfs.ext4");
    f.ops
        .stage(stage_req(&f, AccessMode::SingleNodeWriter))
        .await
        .unwrap();
    assert_eq!(
        f.runner.lines(),
        vec![
            "blkid -p -o export /dev/fake0",
            "mkfs.ext4 -F -q -m 0 /dev/fake0"
        ]
    );
    let m = f.mounter.get(&f.dir.path().join("staging")).unwrap();
    assert_eq!(
        (m.source.to_str().unwrap(), m.fstype.as_str(), m.bind),
        ("/dev/fake0", "ext4", false)
    );
    // Again: idempotent, no second mount, no second format.
    f.ops
        .stage(stage_req(&f, AccessMode::SingleNodeWriter))
        .await
        .unwrap();
    assert_eq!(f.mounter.count(), 1);
    assert_eq!(f.runner.calls().len(), 2);
}

/// A copy (a restored snapshot, a clone) gets a filesystem UUID of its
/// own at its first stage, checked first, told to the backend once done;
/// staged again, it is left alone.
#[tokio::test]
async fn a_copy_gets_its_own_filesystem_uuid_at_its_first_stage() {
    let f = fixture();
    *f.backend.copy_pending.lock().unwrap() = true;
    f.runner
        .expect("blkid", Reply::Ok("TYPE=ext4\n".into()))
        .expect("blkid", Reply::Ok("1111-source\n".into()))
        .expect("e2fsck", Reply::Fail(1, "fixed".into()))
        .ok("tune2fs")
        .expect("blkid", Reply::Ok("2222-copy\n".into()))
        .expect("blkid", Reply::Ok("TYPE=ext4\n".into()));
    f.ops
        .stage(stage_req(&f, AccessMode::SingleNodeWriter))
        .await
        .unwrap();
    assert_eq!(
        f.runner.lines(),
        vec![
            "blkid -p -o export /dev/fake0",
            "blkid -p -o value -s UUID /dev/fake0",
            "e2fsck -f -y /dev/fake0",
            "tune2fs -U random /dev/fake0",
            "blkid -p -o value -s UUID /dev/fake0",
            "blkid -p -o export /dev/fake0",
        ]
    );
    assert_eq!(*f.backend.copies_done.lock().unwrap(), 1);
    assert_eq!(f.mounter.count(), 1);
    // Unstaged and staged again: the copy is its own now, nothing renewed.
    f.ops
        .unstage(&id(), &f.dir.path().join("staging"))
        .await
        .unwrap();
    f.runner.expect("blkid", Reply::Ok("TYPE=ext4\n".into()));
    f.ops
        .stage(stage_req(&f, AccessMode::SingleNodeWriter))
        .await
        .unwrap();
    assert_eq!(f.runner.calls().len(), 7);
    assert_eq!(*f.backend.copies_done.lock().unwrap(), 1);
}

/// A renewal that leaves the source's UUID in place fails the stage, which
/// is undone; the backend still counts the copy as pending.
#[tokio::test]
async fn a_uuid_renewal_that_changes_nothing_fails_the_stage() {
    let f = fixture();
    *f.backend.copy_pending.lock().unwrap() = true;
    f.runner
        .expect("blkid", Reply::Ok("TYPE=ext4\n".into()))
        .expect("blkid", Reply::Ok("1111-source\n".into()))
        .ok("e2fsck")
        .ok("tune2fs")
        .expect("blkid", Reply::Ok("1111-source\n".into()));
    let e = f
        .ops
        .stage(stage_req(&f, AccessMode::SingleNodeWriter))
        .await
        .unwrap_err();
    assert_eq!(e.kind, Kind::Internal, "{}", e.message);
    assert!(e.message.contains("source's UUID"), "{}", e.message);
    assert_eq!(*f.backend.copies_done.lock().unwrap(), 0);
    assert!(*f.backend.copy_pending.lock().unwrap());
    assert_eq!(f.mounter.count(), 0, "nothing mounted");
    assert_eq!(f.backend.detached.lock().unwrap().len(), 1, "attach undone");
    assert!(f.ops.state().stage(&id()).is_none(), "no stage recorded");
}

#[tokio::test]
async fn failed_mount_is_undone() {
    let f = fixture();
    f.runner.expect("blkid", Reply::Ok("TYPE=ext4\n".into()));
    f.mounter.fail_next(MountOp::MountFs, 1);
    let err = f
        .ops
        .stage(stage_req(&f, AccessMode::SingleNodeWriter))
        .await
        .unwrap_err();
    assert!(err.message.contains("MountFs"), "{}", err.message);
    assert_eq!(
        *f.backend.detached.lock().unwrap(),
        vec![Some(Attachment::Device {
            path: "/dev/fake0".into()
        })]
    );
    assert!(f.ops.state().stage(&id()).is_none());
    assert_eq!(f.mounter.count(), 0);
}

#[tokio::test]
async fn failed_format_and_failed_attach_leave_nothing() {
    let f = fixture();
    f.runner.expect("blkid", Reply::Fail(2, String::new()));
    f.runner.expect("mkfs.ext4", Reply::Timeout);
    let err = f
        .ops
        .stage(stage_req(&f, AccessMode::SingleNodeWriter))
        .await
        .unwrap_err();
    assert!(err.message.contains("timed out"), "{}", err.message);
    assert!(f.ops.state().stage(&id()).is_none());
    assert_eq!(f.backend.detached.lock().unwrap().len(), 1);

    *f.backend.fail_attach.lock().unwrap() = true;
    assert!(f
        .ops
        .stage(stage_req(&f, AccessMode::SingleNodeWriter))
        .await
        .is_err());
    // Nothing was attached, but detach is still asked to release whatever
    // a half-done attach may have set up.
    assert_eq!(f.backend.detached.lock().unwrap().last().unwrap(), &None);
    assert!(f.ops.state().stage(&id()).is_none());
}

/// An ext filesystem that recorded errors (its superblock says so) is
/// preened with e2fsck -p before the mount: repaired, it is mounted;
/// errors that stay refuse the stage (FAILED_PRECONDITION), nothing
/// mounted, the attach undone. One with no errors recorded is not checked.
#[tokio::test]
async fn an_ext_filesystem_that_recorded_errors_is_checked_before_the_mount() {
    let f = fixture();
    let mut sb = vec![0u8; 1024];
    sb[0x38..0x3A].copy_from_slice(&0xEF53u16.to_le_bytes());
    sb[0x3A..0x3C].copy_from_slice(&2u16.to_le_bytes());
    f.host
        .set_contents(Path::new("/dev/fake0"), 1024, sb.clone());
    f.runner
        .expect("blkid", Reply::Ok("TYPE=ext4\n".into()))
        .expect("e2fsck", Reply::Fail(4, String::new()));
    let err = f
        .ops
        .stage(stage_req(&f, AccessMode::SingleNodeWriter))
        .await
        .unwrap_err();
    assert_eq!(err.kind, Kind::FailedPrecondition, "{err:?}");
    assert!(err.message.contains("could not repair"), "{err:?}");
    assert_eq!(f.mounter.count(), 0);
    assert_eq!(f.backend.detached.lock().unwrap().len(), 1, "attach undone");
    assert!(f.ops.state().stage(&id()).is_none());
    // Repaired (exit 1): mounted.
    f.runner
        .expect("blkid", Reply::Ok("TYPE=ext4\n".into()))
        .expect("e2fsck", Reply::Fail(1, String::new()));
    f.ops
        .stage(stage_req(&f, AccessMode::SingleNodeWriter))
        .await
        .unwrap();
    assert_eq!(f.mounter.count(), 1);
    assert_eq!(
        f.runner
            .lines()
            .iter()
            .filter(|l| l.starts_with("e2fsck -p /dev/fake0"))
            .count(),
        2
    );
}

#[tokio::test]
async fn never_formats_a_device_with_another_filesystem() {
    let f = fixture();
    f.runner.expect("blkid", Reply::Ok("TYPE=xfs\n".into()));
    let err = f
        .ops
        .stage(stage_req(&f, AccessMode::SingleNodeWriter))
        .await
        .unwrap_err();
    assert_eq!(err.kind, Kind::FailedPrecondition);
    assert!(!f.runner.lines().iter().any(|l| l.starts_with("mkfs")));
}

/// A second target on the node: allowed for every pair of single-node
/// modes but where either publish is SINGLE_NODE_SINGLE_WRITER, which is
/// FAILED_PRECONDITION with nothing made at the second target; the first
/// publish gone, the second goes through.
#[tokio::test]
async fn second_targets_on_a_node_are_refused_only_for_single_writer_pods() {
    use AccessMode::*;
    let modes = [
        SingleNodeWriter,
        SingleNodeMultiWriter,
        SingleNodeSingleWriter,
        SingleNodeReaderOnly,
    ];
    let f = fixture();
    f.runner.expect("blkid", Reply::Ok("TYPE=ext4\n".into()));
    f.ops.stage(stage_req(&f, SingleNodeWriter)).await.unwrap();
    let ro = |m: AccessMode| m.is_readonly();
    for first in modes {
        for second in modes {
            let what = format!("{} then {}", first.name(), second.name());
            f.ops
                .publish(publish_req(&f, "a", first, ro(first)))
                .await
                .unwrap();
            let b = f.dir.path().join("pods/b");
            let got = f
                .ops
                .publish(publish_req(&f, "b", second, ro(second)))
                .await;
            let refused = first == SingleNodeSingleWriter || second == SingleNodeSingleWriter;
            match got {
                Ok(()) => assert!(!refused, "{what}: a second target was taken"),
                Err(e) => {
                    assert!(refused, "{what}: {}", e.message);
                    assert_eq!(e.kind, Kind::FailedPrecondition, "{what}");
                    assert!(e.message.contains("pods/a"), "{what}: {}", e.message);
                    assert!(f.mounter.get(&b).is_none(), "{what}");
                    assert!(!f.host.contains(&b), "{what}: target made");
                    assert!(f.ops.state().publish(&b).is_none(), "{what}");
                }
            }
            f.ops
                .unpublish(&id(), &f.dir.path().join("pods/a"))
                .await
                .unwrap();
            if refused {
                // The only other publish gone, the same call goes through.
                f.ops
                    .publish(publish_req(&f, "b", second, ro(second)))
                    .await
                    .unwrap();
            }
            f.ops.unpublish(&id(), &b).await.unwrap();
            assert!(f.ops.state().publishes_of(&id()).is_empty(), "{what}");
        }
    }
}

/// A single-writer publish locks its volume against every other publish
/// or unpublish under way (two at once would each find no other record);
/// publishes of other modes to other targets run side by side.
#[test]
fn a_single_writer_publish_excludes_others_of_its_volume_while_it_runs() {
    let f = fixture();
    let (a, b) = (f.dir.path().join("pods/a"), f.dir.path().join("pods/b"));
    let only = f.ops.lock_only_target(&id(), &a).unwrap();
    let err = f.ops.lock_target(&id(), &b).unwrap_err();
    assert_eq!(err.kind, Kind::Aborted, "{}", err.message);
    let err = f.ops.lock_only_target(&id(), &b).unwrap_err();
    assert_eq!(err.kind, Kind::Aborted, "{}", err.message);
    drop(only);
    let shared = f.ops.lock_target(&id(), &a).unwrap();
    let beside = f.ops.lock_target(&id(), &b).unwrap();
    let err = f
        .ops
        .lock_only_target(&id(), &f.dir.path().join("pods/c"))
        .unwrap_err();
    assert_eq!(err.kind, Kind::Aborted, "{}", err.message);
    drop((shared, beside));
    f.ops.lock_only_target(&id(), &b).unwrap();
}

#[tokio::test]
async fn failed_unmount_keeps_the_record_for_a_retry() {
    let f = fixture();
    f.runner.expect("blkid", Reply::Ok("TYPE=ext4\n".into()));
    f.ops
        .stage(stage_req(&f, AccessMode::SingleNodeWriter))
        .await
        .unwrap();
    f.mounter.fail_next(MountOp::Unmount, 1);
    assert!(f
        .ops
        .unstage(&id(), &f.dir.path().join("staging"))
        .await
        .is_err());
    assert!(f.ops.state().stage(&id()).is_some());
    assert!(
        f.backend.detached.lock().unwrap().is_empty(),
        "device released under a live mount"
    );
    f.ops
        .unstage(&id(), &f.dir.path().join("staging"))
        .await
        .unwrap();
    assert!(f.ops.state().stage(&id()).is_none());
}

#[tokio::test]
async fn interrupted_stage_is_repaired_and_stale_publishes_reconciled() {
    let f = fixture();
    f.runner.expect("blkid", Reply::Ok("TYPE=ext4\n".into()));
    f.ops
        .stage(stage_req(&f, AccessMode::SingleNodeWriter))
        .await
        .unwrap();
    f.ops
        .publish(publish_req(&f, "a", AccessMode::SingleNodeWriter, false))
        .await
        .unwrap();
    // The node lost its mounts (say, a reboot): reconcile drops the publish
    // record and a repeated stage mounts again.
    f.mounter.unmount(&f.dir.path().join("pods/a")).unwrap();
    f.mounter.unmount(&f.dir.path().join("staging")).unwrap();
    assert_eq!(f.ops.reconcile().unwrap(), (1, 1));
    assert!(f.ops.state().publishes().is_empty());
    f.runner.expect("blkid", Reply::Ok("TYPE=ext4\n".into()));
    f.ops
        .stage(stage_req(&f, AccessMode::SingleNodeWriter))
        .await
        .unwrap();
    assert!(f.mounter.get(&f.dir.path().join("staging")).is_some());
}

#[tokio::test]
async fn concurrent_stage_is_aborted() {
    let f = fixture();
    let _busy = f.ops.lock_volume(&id()).unwrap();
    assert_eq!(
        f.ops
            .stage(stage_req(&f, AccessMode::SingleNodeWriter))
            .await
            .unwrap_err()
            .kind,
        Kind::Aborted
    );
    assert_eq!(
        f.ops
            .unstage(&id(), Path::new("/x"))
            .await
            .unwrap_err()
            .kind,
        Kind::Aborted
    );
    assert_eq!(
        f.ops
            .publish(publish_req(&f, "a", AccessMode::SingleNodeWriter, false))
            .await
            .unwrap_err()
            .kind,
        Kind::Aborted
    );
}
