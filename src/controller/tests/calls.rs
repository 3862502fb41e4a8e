//! What calls carry: secrets, snapshot parameters, guards, walks and cursors, modify's checks, encryption, sizes.

use super::*;

#[tokio::test]
async fn secrets_reach_the_backend_for_every_rpc_that_carries_them() {
    // Everything logged during the test, at every level.
    #[derive(Clone, Default)]
    struct Captured(Arc<Mutex<Vec<u8>>>);
    impl std::io::Write for Captured {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let captured = Captured::default();
    let writer = captured.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::TRACE)
        .with_writer(move || writer.clone())
        .finish();
    let _logging = tracing::subscriber::set_default(subscriber);
    // Only this test's backend logs, so the line's interest is first
    // worked out here, with this subscriber set (see `Memory::logs`).
    tracing::callsite::rebuild_interest_cache();

    let b = Arc::new(Memory::new("net", remote_attach()));
    b.logs.store(true, std::sync::atomic::Ordering::Relaxed);
    let c = ops(vec![b.clone()]);
    let v = c
        .create_volume(new_volume("pvc-1", &[]))
        .await
        .unwrap()
        .volume;
    c.expand(&v.id, 10, 0, None, &secrets()).await.unwrap();
    c.publish(
        &v.id,
        ControllerAttach {
            node_id: "node-b".into(),
            capability: cap(),
            readonly: false,
            volume_context: BTreeMap::new(),
            secrets: secrets(),
        },
        None,
    )
    .await
    .unwrap();
    c.unpublish(&v.id.to_string(), Some("node-b"), &secrets())
        .await
        .unwrap();
    let s = c
        .create_snapshot(NewSnapshot {
            source: v.id.clone(),
            name: "snap-1".into(),
            parameters: BTreeMap::new(),
            secrets: secrets(),
        })
        .await
        .unwrap();
    c.delete_snapshot(&s.id.to_string(), &secrets())
        .await
        .unwrap();
    c.delete_volume(&v.id.to_string(), &secrets())
        .await
        .unwrap();
    let seen = b.secrets_seen.lock().unwrap().clone();
    let ops: Vec<&str> = seen.iter().map(|(op, _)| *op).collect();
    assert_eq!(
        ops,
        [
            "create_volume",
            "expand_volume",
            "controller_attach",
            "controller_detach",
            "create_snapshot",
            "delete_snapshot",
            "delete_volume"
        ]
    );
    for (op, s) in &seen {
        assert_eq!(s.get("key"), Some("value-never-shown"), "{op}");
        assert!(!format!("{s:?} {s}").contains("never-shown"), "{op}");
    }
    let log = String::from_utf8(captured.0.lock().unwrap().clone()).unwrap();
    assert_eq!(log.matches("backend called").count(), 7, "{log}");
    assert!(
        !log.contains("never-shown"),
        "a secret reached the log:\n{log}"
    );
}

#[tokio::test]
async fn snapshot_parameters_keep_the_cos_keys_out_and_pass_them_as_metadata() {
    let b = Arc::new(Memory::new("file", local()));
    let c = ops(vec![b.clone()]);
    let v = c
        .create_volume(new_volume(
            "pvc-1",
            &[("csi.storage.k8s.io/pvc/name", "data")],
        ))
        .await
        .unwrap()
        .volume;
    let co_keys = BTreeMap::from([
        (
            "csi.storage.k8s.io/volumesnapshot/name".to_string(),
            "snap".to_string(),
        ),
        (
            "csi.storage.k8s.io/volumesnapshot/namespace".to_string(),
            "default".to_string(),
        ),
        (
            "csi.storage.k8s.io/volumesnapshotcontent/name".to_string(),
            "snapcontent-1".to_string(),
        ),
    ]);
    let new_snapshot = |parameters: BTreeMap<String, String>| NewSnapshot {
        source: v.id.clone(),
        name: "snap-1".into(),
        parameters,
        secrets: Secrets::default(),
    };
    c.create_snapshot(new_snapshot(co_keys.clone()))
        .await
        .unwrap();
    let metadata = b.metadata_seen.lock().unwrap().clone();
    assert_eq!(
        metadata[0]
            .get("csi.storage.k8s.io/pvc/name")
            .map(String::as_str),
        Some("data")
    );
    assert_eq!(metadata[1], co_keys);
    let mut own = co_keys;
    own.insert("speed".into(), "fast".into());
    let err = c.create_snapshot(new_snapshot(own)).await.unwrap_err();
    assert_eq!(err.kind, Kind::InvalidArgument);
    assert!(err.message.contains("speed"), "{}", err.message);
}

#[tokio::test]
async fn one_guard_covers_the_name_the_id_and_the_source() {
    let entered = Arc::new(Notify::new());
    let release = Arc::new(Notify::new());
    let mut m = Memory::new("file", local());
    m.hold = Some((entered.clone(), release.clone()));
    let b = Arc::new(m);
    b.add("origin");
    let c = Arc::new(ops(vec![b.clone()]));
    let origin = VolumeId::new("file", "origin").unwrap();
    let mut clone = new_volume("pvc-clone", &[]);
    clone.source = Some(ContentSource::Volume(origin.clone()));
    let c2 = c.clone();
    let creating = tokio::spawn(async move { c2.create_volume(clone).await });
    entered.notified().await;

    // While the clone is being made: its id, its name and its source are
    // guarded, each as it should be.
    let aborted = |r: Result<()>| assert_eq!(r.unwrap_err().kind, Kind::Aborted);
    aborted(c.delete_volume("file:pvc-clone", &Secrets::default()).await);
    aborted(c.delete_volume("file:origin", &Secrets::default()).await);
    aborted(
        c.expand(&origin, 5, 0, None, &Secrets::default())
            .await
            .map(|_| ()),
    );
    assert_eq!(
        c.create_volume(new_volume("pvc-clone", &[]))
            .await
            .unwrap_err()
            .kind,
        Kind::Aborted
    );
    // The source is shared: a snapshot of it goes ahead meanwhile.
    c.create_snapshot(NewSnapshot {
        source: origin.clone(),
        name: "snap".into(),
        parameters: BTreeMap::new(),
        secrets: Secrets::default(),
    })
    .await
    .unwrap();

    release.notify_one();
    creating.await.unwrap().unwrap();
    c.delete_volume("file:origin", &Secrets::default())
        .await
        .unwrap();
    assert_eq!(c.locks.held(), 0);
}

#[tokio::test]
async fn a_walk_reads_each_volume_once_across_backends() {
    let a = Arc::new(Memory::new("alpha", local()).with_volumes(25));
    let b = Arc::new(Memory::new("beta", remote_attach()).with_volumes(12));
    let c = ops(vec![a.clone(), b.clone()]);
    let mut token = String::new();
    let mut seen = Vec::new();
    let mut pages = 0;
    loop {
        let page = c.list_volumes(10, &token).await.unwrap();
        assert!(page.entries.len() <= 10);
        pages += 1;
        for p in &page.entries {
            // Node-local volumes carry this node's topology, others none.
            assert_eq!(p.topology.is_some(), p.volume.id.backend() == "alpha");
        }
        seen.extend(page.entries.into_iter().map(|p| p.volume.id.to_string()));
        if page.next_token.is_empty() {
            break;
        }
        token = page.next_token;
    }
    assert_eq!(pages, 4);
    assert_eq!(seen.len(), 37);
    let mut sorted = seen.clone();
    sorted.dedup();
    assert_eq!(sorted, seen, "no volume twice");
    // Each page read at most one volume more than it returned: the cost of
    // a walk is the cost of its volumes, not pages times the pool.
    let read = *a.returned.lock().unwrap() + *b.returned.lock().unwrap();
    assert!(read <= 37 + pages, "read {read} volumes for a walk of 37");
    assert!(a.pages.lock().unwrap().iter().all(|p| p.limit <= 11));
}

#[tokio::test]
async fn a_cursor_survives_deletes_and_sees_new_volumes() {
    let a = Arc::new(Memory::new("file", local()).with_volumes(6));
    let c = ops(vec![a.clone()]);
    let first = c.list_volumes(3, "").await.unwrap();
    assert_eq!(first.next_token, "file:v0002");
    // The last entry of the page goes, and new volumes come.
    c.delete_volume("file:v0002", &Secrets::default())
        .await
        .unwrap();
    a.add("v0001a");
    a.add("w-new");
    let rest = c.list_volumes(0, &first.next_token).await.unwrap();
    let ids: Vec<String> = rest
        .entries
        .iter()
        .map(|p| p.volume.id.to_string())
        .collect();
    assert_eq!(
        ids,
        ["file:v0003", "file:v0004", "file:v0005", "file:w-new"]
    );
    assert!(rest.next_token.is_empty());
    for bad in ["garbage", "Nope:x", "file:", &"x".repeat(300)] {
        assert_eq!(
            c.list_volumes(1, bad).await.unwrap_err().kind,
            Kind::Aborted,
            "{bad}"
        );
    }
    assert_eq!(
        c.list_volumes(-1, "").await.unwrap_err().kind,
        Kind::InvalidArgument
    );
}

#[tokio::test]
async fn modify_checks_every_key_before_the_backend_changes_anything() {
    let b = Arc::new(Memory::new("net", remote_attach()));
    let c = ops(vec![b.clone()]);
    // At create: a bad key or value makes nothing; good ones are applied.
    let mut bad = new_volume("pvc-bad", &[]);
    bad.mutable = kv(&[("tier", "gold"), ("colour", "red")]);
    let e = c.create_volume(bad).await.unwrap_err();
    assert_eq!(e.kind, Kind::InvalidArgument);
    assert!(
        e.message.contains("\"colour\"") && e.message.contains("tier, iops"),
        "{}",
        e.message
    );
    let mut bad = new_volume("pvc-bad", &[]);
    bad.mutable = kv(&[("tier", "bronze")]);
    assert_eq!(
        c.create_volume(bad).await.unwrap_err().kind,
        Kind::InvalidArgument
    );
    assert!(b.volumes.lock().unwrap().is_empty(), "nothing made");
    let mut good = new_volume("pvc-1", &[]);
    good.mutable = kv(&[("tier", "gold")]);
    let v = c.create_volume(good).await.unwrap().volume;
    assert_eq!(
        b.modified.lock().unwrap().clone(),
        vec![(v.id.to_string(), kv(&[("tier", "gold")]))]
    );

    // Modify: every key checked first; the backend sees none of a bad set.
    for changes in [
        kv(&[("tier", "silver"), ("x", "1")]),
        kv(&[("tier", "tin")]),
    ] {
        let e = c
            .modify_volume(&v.id, &changes, &secrets())
            .await
            .unwrap_err();
        assert_eq!(e.kind, Kind::InvalidArgument, "{changes:?}");
    }
    // No key: no change, and the backend is not asked.
    c.modify_volume(&v.id, &kv(&[]), &secrets()).await.unwrap();
    assert_eq!(b.modified.lock().unwrap().len(), 1);
    c.modify_volume(
        &v.id,
        &kv(&[("tier", "silver"), ("iops", "100")]),
        &secrets(),
    )
    .await
    .unwrap();
    assert_eq!(b.modified.lock().unwrap().len(), 2);
    let missing = VolumeId::new("net", "nope").unwrap();
    assert_eq!(
        c.modify_volume(&missing, &kv(&[("tier", "gold")]), &secrets())
            .await
            .unwrap_err()
            .kind,
        Kind::NotFound
    );
}

#[tokio::test]
async fn encryption_is_asked_in_the_volume_context_of_block_backends_only() {
    let c = file_and_net();
    let v = c
        .create_volume(new_volume(
            "pvc-1",
            &[("backend", "file"), ("encrypted", "true")],
        ))
        .await
        .unwrap()
        .volume;
    assert_eq!(
        v.context.get("encrypted").map(String::as_str),
        Some("luks2")
    );
    // The backend never sees the parameter (its own validation would
    // refuse a key it does not know).
    let plain = c
        .create_volume(new_volume(
            "pvc-2",
            &[("backend", "file"), ("encrypted", "false")],
        ))
        .await
        .unwrap()
        .volume;
    assert!(!plain.context.contains_key("encrypted"));
    refused_at_create(
        &c,
        &[
            (&[("backend", "file"), ("encrypted", "yes")], "yes"),
            (
                &[("backend", "net"), ("encrypted", "true")],
                "no block devices",
            ),
        ],
    )
    .await;
}

/// A controller over a node-local block backend (`file`) and a remote one
/// with no block devices (`net`).
fn file_and_net() -> ControllerOps {
    ops(vec![
        Arc::new(Memory::new("file", local())),
        Arc::new(Memory::new("net", remote_attach())),
    ])
}

/// Each of `cases` (the parameters, a word the error says) is refused at
/// CreateVolume, INVALID_ARGUMENT.
async fn refused_at_create(c: &ControllerOps, cases: &[(&[(&str, &str)], &str)]) {
    for (params, what) in cases {
        let e = c
            .create_volume(new_volume("pvc-refused", params))
            .await
            .unwrap_err();
        assert_eq!(e.kind, Kind::InvalidArgument, "{e}");
        assert!(e.message.contains(what), "{e}");
    }
}

/// A class's I/O limits are the plugin layer's: checked once, never seen
/// by the backend, carried to the node in the volume context; refused
/// (naming the key) when bad, and for a backend with no block devices.
#[tokio::test]
async fn io_limits_reach_the_volume_context_of_block_backends_only() {
    let c = file_and_net();
    let v = c
        .create_volume(new_volume(
            "pvc-1",
            &[
                ("backend", "file"),
                ("readIops", "300"),
                ("writeBps", "8Mi"),
            ],
        ))
        .await
        .unwrap()
        .volume;
    assert_eq!(v.context["ioLimit.readIops"], "300");
    assert_eq!(v.context["ioLimit.writeBps"], (8u64 << 20).to_string());
    assert_eq!(
        crate::host::iolimit::Limits::from_context(&v.context).unwrap(),
        crate::host::iolimit::Limits {
            read_iops: Some(300),
            write_bps: Some(8 << 20),
            ..Default::default()
        }
    );
    // A VolumeAttributesClass named at creation: its limits in the
    // class's place; the backend sees none of them.
    let mut req = new_volume("pvc-3", &[("backend", "file"), ("readIops", "300")]);
    req.mutable = kv(&[("readIops", "50"), ("writeIops", "40")]);
    let v = c.create_volume(req).await.unwrap().volume;
    assert_eq!(v.context["ioLimit.readIops"], "50");
    assert_eq!(v.context["ioLimit.writeIops"], "40");
    // Changed where the controller is not the volumes' node: refused,
    // naming the key, nothing changed.
    let e = c
        .modify_volume(&v.id, &kv(&[("writeIops", "10")]), &secrets())
        .await
        .unwrap_err();
    assert_eq!(e.kind, Kind::InvalidArgument, "{e}");
    assert!(e.message.contains("writeIops"), "{e}");
    refused_at_create(
        &c,
        &[
            (&[("backend", "file"), ("writeIops", "0")], "writeIops"),
            (&[("backend", "file"), ("readBps", "fast")], "readBps"),
            (
                &[("backend", "net"), ("readIops", "10")],
                "no block devices",
            ),
        ],
    )
    .await;
}

/// What a controller's node was asked to set: each volume, in order.
#[derive(Default)]
struct Relimits(std::sync::Mutex<Vec<String>>);

#[async_trait::async_trait]
impl crate::plugin::Relimit for Relimits {
    async fn relimit(&self, id: &VolumeId) -> usize {
        self.0.lock().unwrap().push(id.to_string());
        1
    }
}

/// Where the controller is its volumes' node, a change to a volume's
/// limits is kept in the book over the volume's own and handed to the
/// node; `max` lifts one; a bad value, a backend without block devices, or
/// a volume that is not there changes nothing; a delete forgets it.
#[tokio::test]
async fn a_limit_change_is_kept_over_the_volume_s_own_and_handed_to_the_node() {
    let dir = tempfile::tempdir().unwrap();
    let book = Arc::new(crate::plugin::LimitBook::open(dir.path()).unwrap());
    let node = Arc::new(Relimits::default());
    let c = file_and_net().with_limits(
        book.clone(),
        Some(node.clone() as Arc<dyn crate::plugin::Relimit>),
    );
    let v = c
        .create_volume(new_volume(
            "pvc-1",
            &[
                ("backend", "file"),
                ("readIops", "300"),
                ("writeIops", "60"),
            ],
        ))
        .await
        .unwrap()
        .volume;
    let created = crate::host::iolimit::Limits::from_context(&v.context).unwrap();
    let now = || created.changed(&book.get(&v.id));
    c.modify_volume(
        &v.id,
        &kv(&[("writeIops", "10"), ("readBps", "1Mi")]),
        &secrets(),
    )
    .await
    .unwrap();
    c.modify_volume(&v.id, &kv(&[("readIops", "max")]), &secrets())
        .await
        .unwrap();
    let want = crate::host::iolimit::Limits {
        write_iops: Some(10),
        read_bps: Some(1 << 20),
        ..Default::default()
    };
    assert_eq!(now(), want);
    assert_eq!(*node.0.lock().unwrap(), vec![v.id.to_string(); 2]);
    // Refused, nothing kept or handed on.
    for (changes, what) in [
        (&[("writeIops", "0")][..], "writeIops"),
        (&[("readBps", "fast")][..], "readBps"),
    ] {
        let e = c
            .modify_volume(&v.id, &kv(changes), &secrets())
            .await
            .unwrap_err();
        assert_eq!(e.kind, Kind::InvalidArgument, "{e}");
        assert!(e.message.contains(what), "{e}");
    }
    let gone = VolumeId::parse("file:never-made").unwrap();
    let e = c
        .modify_volume(&gone, &kv(&[("writeIops", "5")]), &secrets())
        .await
        .unwrap_err();
    assert_eq!(e.kind, Kind::NotFound, "{e}");
    assert!(book.get(&gone).is_empty());
    let n = c
        .create_volume(new_volume("pvc-2", &[("backend", "net")]))
        .await
        .unwrap()
        .volume;
    let e = c
        .modify_volume(&n.id, &kv(&[("writeIops", "5")]), &secrets())
        .await
        .unwrap_err();
    assert!(e.message.contains("no block devices"), "{e}");
    assert!(book.get(&n.id).is_empty());
    assert_eq!(now(), want);
    assert_eq!(node.0.lock().unwrap().len(), 2);
    c.delete_volume(&v.id.to_string(), &secrets())
        .await
        .unwrap();
    assert!(book.get(&v.id).is_empty());
    assert!(crate::plugin::LimitBook::open(dir.path())
        .unwrap()
        .get(&v.id)
        .is_empty());
}

/// A volume asked for smaller than its filesystem can be made on (mkfs.xfs
/// refuses under 300 MiB) is made as large as the filesystem needs, and
/// one whose limit leaves no room for it is OUT_OF_RANGE; ext4 and raw
/// block volumes keep their size.
#[tokio::test]
async fn a_volume_too_small_for_its_filesystem_is_made_as_large_as_it_needs() {
    const MIB: u64 = 1 << 20;
    let b = Arc::new(Memory::new("net", remote_attach()));
    let c = ops(vec![b.clone()]);
    let asked = |name: &str, fs: &str, required: u64, limit: u64| {
        let mut v = new_volume(name, &[]);
        v.required_bytes = required;
        v.limit_bytes = limit;
        v.capabilities = vec![VolumeCapability {
            access: AccessType::Mount {
                fs_type: fs.into(),
                mount_flags: vec![],
            },
            mode: AccessMode::SingleNodeWriter,
        }];
        v
    };
    c.create_volume(asked("pvc-xfs", "xfs", 64 * MIB, 0))
        .await
        .unwrap();
    c.create_volume(asked("pvc-ext4", "ext4", 64 * MIB, 0))
        .await
        .unwrap();
    c.create_volume(asked("pvc-big", "xfs", 512 * MIB, 0))
        .await
        .unwrap();
    assert_eq!(
        *b.required_seen.lock().unwrap(),
        [300 * MIB, 64 * MIB, 512 * MIB]
    );
    let e = c
        .create_volume(asked("pvc-tight", "xfs", 64 * MIB, 100 * MIB))
        .await
        .unwrap_err();
    assert_eq!(e.kind, Kind::OutOfRange, "{e}");
    assert!(e.message.contains("least its filesystem takes"), "{e}");
}
