//! Group snapshots: one snapshot per member under one freeze, or nothing.

use super::*;

/// A node that records what it was asked to freeze, or refuses.
#[derive(Default)]
struct FakeNode {
    frozen: Mutex<Vec<Vec<VolumeId>>>,
    refuse: Mutex<bool>,
}

#[async_trait::async_trait]
impl crate::plugin::Quiesce for FakeNode {
    async fn freeze(
        &self,
        volumes: &[VolumeId],
        _staged_ok: bool,
        _block_ok: bool,
        deadline: std::time::Duration,
    ) -> Result<crate::host::freeze::Frozen> {
        if *self.refuse.lock().unwrap() {
            return Err(Error::precondition("staged as a raw block device"));
        }
        self.frozen.lock().unwrap().push(volumes.to_vec());
        let _ = deadline;
        Ok(crate::host::freeze::Frozen::none())
    }
}

#[tokio::test]
async fn a_group_snapshot_is_one_snapshot_per_member_under_one_freeze_or_nothing() {
    use super::NewGroupSnapshot;
    let b = Arc::new(Memory::new("file", local()));
    let nfs = Arc::new(Memory::new("nfs", remote_attach()));
    let node = Arc::new(FakeNode::default());
    let dir = tempfile::tempdir().unwrap();
    let groups = || crate::plugin::GroupStore::open(&dir.path().join("groups")).unwrap();
    let c = ops(vec![b.clone(), nfs.clone()]).with_groups(
        groups(),
        Some(node.clone() as Arc<dyn crate::plugin::Quiesce>),
    );
    assert!(c.groups_served());
    let mut ids = Vec::new();
    for name in ["data", "wal", "other"] {
        ids.push(
            c.create_volume(new_volume(name, &[("backend", "file")]))
                .await
                .unwrap()
                .volume
                .id,
        );
    }
    let n = c
        .create_volume(new_volume("share", &[("backend", "nfs")]))
        .await
        .unwrap()
        .volume
        .id;
    let group = |name: &str, sources: &[&VolumeId]| NewGroupSnapshot {
        name: name.into(),
        sources: sources.iter().map(|v| (*v).clone()).collect(),
        parameters: BTreeMap::new(),
        secrets: secrets(),
    };
    let g = c
        .create_group_snapshot(group("g1", &[&ids[0], &ids[1]]))
        .await
        .unwrap();
    assert_eq!(
        node.frozen.lock().unwrap().clone(),
        vec![vec![ids[0].clone(), ids[1].clone()]]
    );
    assert_eq!(g.snapshots.len(), 2);
    assert!(g.ready);
    for (s, source) in g.snapshots.iter().zip(&ids) {
        assert_eq!(&s.source_volume, source);
        assert_eq!(s.group.as_ref(), Some(&g.id));
        // Members are ordinary snapshots that say their group.
        assert_eq!(
            c.get_snapshot(&s.id, &Secrets::default())
                .await
                .unwrap()
                .group
                .as_ref(),
            Some(&g.id)
        );
    }
    let listed = c.list_snapshots("", "", 0, "").await.unwrap().entries;
    assert!(
        listed.iter().all(|s| s.group.as_ref() == Some(&g.id)),
        "{listed:?}"
    );
    // Idempotent by name; another set under the name is ALREADY_EXISTS.
    assert_eq!(
        c.create_group_snapshot(group("g1", &[&ids[0], &ids[1]]))
            .await
            .unwrap(),
        g
    );
    assert_eq!(node.frozen.lock().unwrap().len(), 1, "not cut again");
    let e = c
        .create_group_snapshot(group("g1", &[&ids[0], &ids[2]]))
        .await
        .unwrap_err();
    assert_eq!(e.kind, Kind::AlreadyExists);
    // A group spans one backend; a backend that cannot is refused.
    let e = c
        .create_group_snapshot(group("g2", &[&ids[0], &n]))
        .await
        .unwrap_err();
    assert_eq!(e.kind, Kind::InvalidArgument, "{}", e.message);
    let e = c
        .create_group_snapshot(group("g3", &[&n]))
        .await
        .unwrap_err();
    assert_eq!(e.kind, Kind::FailedPrecondition, "{}", e.message);
    let e = c
        .create_group_snapshot(group("g4", &[&ids[0], &ids[0]]))
        .await
        .unwrap_err();
    assert_eq!(e.kind, Kind::InvalidArgument);

    // A member that fails: the others made go, and no group is left.
    let before = b.snapshots.lock().unwrap().len();
    *b.fail_snapshots_of.lock().unwrap() = Some(ids[2].clone());
    let e = c
        .create_group_snapshot(group("g5", &[&ids[1], &ids[2]]))
        .await
        .unwrap_err();
    assert_eq!(e.kind, Kind::ResourceExhausted);
    assert_eq!(b.snapshots.lock().unwrap().len(), before);
    *b.fail_snapshots_of.lock().unwrap() = None;
    // A freeze the node refuses: nothing made.
    *node.refuse.lock().unwrap() = true;
    let e = c
        .create_group_snapshot(group("g6", &[&ids[1], &ids[2]]))
        .await
        .unwrap_err();
    assert_eq!(e.kind, Kind::FailedPrecondition);
    assert_eq!(b.snapshots.lock().unwrap().len(), before);
    *node.refuse.lock().unwrap() = false;

    // Get and delete check the member list; the group outlives a restart.
    let members: Vec<String> = g.snapshots.iter().map(|s| s.id.to_string()).collect();
    let c = ops(vec![b.clone(), nfs.clone()]).with_groups(
        groups(),
        Some(node.clone() as Arc<dyn crate::plugin::Quiesce>),
    );
    assert_eq!(
        c.get_group_snapshot(&g.id.to_string(), &members, &Secrets::default())
            .await
            .unwrap(),
        g
    );
    let wrong = vec![members[0].clone()];
    assert_eq!(
        c.get_group_snapshot(&g.id.to_string(), &wrong, &Secrets::default())
            .await
            .unwrap_err()
            .kind,
        Kind::InvalidArgument
    );
    assert_eq!(
        c.delete_group_snapshot(&g.id.to_string(), &wrong, &secrets())
            .await
            .unwrap_err()
            .kind,
        Kind::InvalidArgument
    );
    c.delete_group_snapshot(&g.id.to_string(), &members, &secrets())
        .await
        .unwrap();
    assert!(b.snapshots.lock().unwrap().is_empty());
    assert_eq!(
        c.get_group_snapshot(&g.id.to_string(), &[], &Secrets::default())
            .await
            .unwrap_err()
            .kind,
        Kind::NotFound
    );
    c.delete_group_snapshot(&g.id.to_string(), &[], &secrets())
        .await
        .unwrap();
    c.delete_group_snapshot("not an id", &[], &secrets())
        .await
        .unwrap();
    assert_eq!(
        c.get_group_snapshot("", &[], &Secrets::default())
            .await
            .unwrap_err()
            .kind,
        Kind::InvalidArgument
    );
}
