//! The node's side and changed blocks: maps, copies, diff pages.

use super::*;

#[tokio::test]
async fn the_node_maps_only_what_is_published_to_it() {
    let dir = tempfile::tempdir().unwrap();
    let r = Arc::new(FakeRunner::new());
    let b = backend(r.clone(), dir.path(), false);
    let id = VolumeId::parse("rbd:v1.c1.rbd._e.fv-a").unwrap();
    r.expect(
        "rbd",
        Reply::Ok(r#"{"ferrovol.name":"a","ferrovol.node.node-a":"single"}"#.into()),
    );
    let e = b.node_attach(&id, &stage_ctx("node-b")).await.unwrap_err();
    assert_eq!(e.kind, Kind::FailedPrecondition);
    assert!(!ops(&r).iter().any(|l| l.contains("map")));

    // Published here: mapped with the config's, the class's and read-only
    // options, with a client of its own; the client's address (as the
    // kernel shows it) is recorded in the image.
    let dev3 = dir.path().join("sys/bus/rbd/devices/3");
    std::fs::create_dir_all(&dev3).unwrap();
    std::fs::write(dev3.join("client_addr"), "10.0.0.2:0/3459289423\n").unwrap();
    r.expect(
        "rbd",
        Reply::Ok(r#"{"ferrovol.name":"a","ferrovol.node.node-a":"single"}"#.into()),
    )
    .expect("rbd", Reply::Ok("/dev/rbd3\n".into()))
    .ok("rbd");
    let a = b.node_attach(&id, &stage_ctx("node-a")).await.unwrap();
    assert_eq!(
        a,
        Attachment::Device {
            path: "/dev/rbd3".into()
        }
    );
    let o = ops(&r);
    assert_eq!(
        o[o.len() - 2..],
        [
            "device map rbd/fv-a --options queue_depth=128,ms_mode=crc,ro,noshare",
            "image-meta set rbd/fv-a ferrovol.client.node-a 10.0.0.2:0/3459289423"
        ]
    );
    // After a restart: the mapping is found, in the kernel's table.
    mapped(dir.path());
    r.expect("rbd", Reply::Ok(r#"{"ferrovol.name":"a"}"#.into()));
    let a = b.node_attach(&id, &stage_ctx("node-a")).await.unwrap();
    assert_eq!(
        a,
        Attachment::Device {
            path: "/dev/rbd0".into()
        }
    );

    // Unstage unmaps, then removes this node's client record (with the
    // stage's secrets); not mapped is success, with nothing left to remove.
    r.expect("rbd", Reply::OkAfter(String::new(), unmaps(dir.path())))
        .ok("rbd");
    b.node_detach(&id, Some(&a)).await.unwrap();
    assert!(r.lines().iter().any(|l| l == "rbd device unmap /dev/rbd0"));
    assert_eq!(
        ops(&r).last().unwrap(),
        "image-meta remove rbd/fv-a ferrovol.client.node-a"
    );
    let before = r.lines().len();
    b.node_detach(&id, None).await.unwrap();
    assert_eq!(r.lines().len(), before, "not mapped: no command");
    // Busy a moment after the unmount (udev probing it): asked again.
    mapped(dir.path());
    r.expect(
        "rbd",
        Reply::Fail(16, "rbd: unmap failed: (16) Device or resource busy".into()),
    )
    .expect("rbd", Reply::OkAfter(String::new(), unmaps(dir.path())));
    b.node_detach(&id, None).await.unwrap();
    let unmaps = |r: &FakeRunner| {
        r.lines()
            .iter()
            .filter(|l| *l == "rbd device unmap /dev/rbd0")
            .count()
    };
    assert_eq!(unmaps(&r), 3);

    // Condition: the mapping gone is abnormal.
    let c = b.node_health(&id, &a).await.unwrap().remove(0);
    assert!(c.message.contains("no longer mapped"), "{c:?}");
    assert_eq!(c.reason, reasons::MappingGone);
    // Size after a resize, from sysfs.
    std::fs::create_dir_all(dir.path().join("sys/block/rbd0")).unwrap();
    std::fs::write(dir.path().join("sys/block/rbd0/size"), "40960\n").unwrap();
    assert_eq!(b.node_refresh_size(&id, &a).await.unwrap(), 20 * MIB);
}

/// A copy's filesystem UUID is renewed by the node that stages it first:
/// the image says so in its metadata, and the mark is removed after.
#[tokio::test]
async fn a_copy_is_marked_until_a_node_renews_it() {
    let dir = tempfile::tempdir().unwrap();
    let r = Arc::new(FakeRunner::new());
    let b = backend(r.clone(), dir.path(), false);
    let id = VolumeId::parse("rbd:v1.c1.rbd._e.fv-copy").unwrap();
    // Mapped read-only: nothing can be renewed, nothing is asked.
    assert!(!b
        .node_copy_pending(&id, &stage_ctx("node-a"))
        .await
        .unwrap());
    assert!(r.lines().is_empty());
    let ctx = AttachContext {
        readonly: false,
        ..stage_ctx("node-a")
    };
    r.expect(
        "rbd",
        Reply::Ok(r#"{"ferrovol.name":"copy","ferrovol.fscopy":"1"}"#.into()),
    );
    assert!(b.node_copy_pending(&id, &ctx).await.unwrap());
    r.ok("rbd");
    b.node_copy_done(&id, &ctx).await.unwrap();
    assert_eq!(
        ops(&r).last().unwrap(),
        "image-meta remove rbd/fv-copy ferrovol.fscopy"
    );
    r.expect("rbd", Reply::Ok(r#"{"ferrovol.name":"copy"}"#.into()));
    assert!(!b.node_copy_pending(&id, &ctx).await.unwrap());
    // The node's own key went to rbd in a keyring file, never in argv.
    assert!(
        r.lines()
            .iter()
            .all(|l| l.contains("--keyring") && !l.contains(KEY)),
        "{:?}",
        r.lines()
    );
}

#[test]
fn diff_pages_merge_touching_extents_and_say_where_the_next_starts() {
    let out = r#"[{"offset":0,"length":4096,"exists":"true"},{"offset":4096,"length":4096,"exists":"true"},
        {"offset":1048576,"length":8192,"exists":"false"},{"offset":4194304,"length":4096,"exists":"true"}]"#;
    let (ranges, next) = cli::diff_page(out, 0, 2).unwrap();
    assert_eq!(ranges, [(0, 8192), (1048576, 8192)]);
    assert_eq!(next, Some(4194304));
    // From inside an extent: its part from there on.
    let (ranges, next) = cli::diff_page(out, 6144, 8).unwrap();
    assert_eq!(ranges, [(6144, 2048), (1048576, 8192), (4194304, 4096)]);
    assert_eq!(next, None);
    assert_eq!(cli::diff_page("", 0, 8).unwrap(), (vec![], None));
    assert!(cli::diff_page("not json", 0, 8).is_err());
}

#[tokio::test]
async fn changed_blocks_read_the_source_between_the_two_cuts() {
    let dir = tempfile::tempdir().unwrap();
    let r = Arc::new(FakeRunner::new());
    let b = backend(r.clone(), dir.path(), false);
    let (s1, s2) = (
        SnapshotId::parse("rbd:v1.c1.rbd._e.fvs-s1").unwrap(),
        SnapshotId::parse("rbd:v1.c1.rbd._e.fvs-s2").unwrap(),
    );
    let meta = |name: &str, src: &str, at: u64| {
        format!(
            r#"{{"ferrovol.name":"{name}","ferrovol.source":"rbd:v1.c1.rbd._e.{src}","ferrovol.created":"{at}"}}"#
        )
    };
    let both = |r: &FakeRunner, src2: &str| {
        r.expect("rbd", Reply::Ok(clone_info("fvs-s1", "fv-src")))
            .expect("rbd", Reply::Ok(meta("s1", "fv-src", 100)))
            .expect("rbd", Reply::Ok(clone_info("fvs-s2", src2)))
            .expect("rbd", Reply::Ok(meta("s2", src2, 200)));
    };
    both(&r, "fv-src");
    r.expect(
        "rbd",
        Reply::Ok(r#"[{"id":4,"name":"tmp-tmp-fvs-s1"},{"id":6,"name":"tmp-tmp-fvs-s2"}]"#.into()),
    )
    .expect(
        "rbd",
        Reply::Ok(r#"[{"offset":65536,"length":4096,"exists":"true"}]"#.into()),
    );
    let page = b.changed_blocks(&s1, &s2, 0, 16, &secrets()).await.unwrap();
    assert_eq!(page.ranges, [(65536, 4096)]);
    assert_eq!(page.capacity, 16 << 20);
    assert_eq!(
        ops(&r).last().unwrap(),
        "diff --format json rbd/fv-src@tmp-tmp-fvs-s2 --from-snap tmp-tmp-fvs-s1"
    );

    // A snapshot without its cut (a copy of a volume in use): no changes
    // to read, and no diff run.
    both(&r, "fv-src");
    r.expect(
        "rbd",
        Reply::Ok(r#"[{"id":6,"name":"tmp-tmp-fvs-s2"}]"#.into()),
    );
    let n = r.lines().len();
    let e = b
        .changed_blocks(&s1, &s2, 0, 16, &secrets())
        .await
        .unwrap_err();
    assert_eq!(e.kind, Kind::FailedPrecondition, "{e}");
    assert!(e.message.contains("fvs-s1"), "{e}");
    assert!(!ops(&r).iter().skip(n).any(|l| l.starts_with("diff")));

    // Of two volumes: INVALID_ARGUMENT; backwards: the same.
    both(&r, "fv-other");
    let e = b
        .changed_blocks(&s1, &s2, 0, 16, &secrets())
        .await
        .unwrap_err();
    assert_eq!(e.kind, Kind::InvalidArgument, "{e}");
    r.expect("rbd", Reply::Ok(clone_info("fvs-s2", "fv-src")))
        .expect("rbd", Reply::Ok(meta("s2", "fv-src", 200)))
        .expect("rbd", Reply::Ok(clone_info("fvs-s1", "fv-src")))
        .expect("rbd", Reply::Ok(meta("s1", "fv-src", 100)));
    let e = b
        .changed_blocks(&s2, &s1, 0, 16, &secrets())
        .await
        .unwrap_err();
    assert_eq!(e.kind, Kind::InvalidArgument, "{e}");
    assert!(e.message.contains("newer"), "{e}");
}

/// The node finds an image's mapping in the kernel's table: by pool,
/// namespace and name, the image itself (a snapshot's mapping is not the
/// volume), with no command run.
#[tokio::test]
async fn the_mapping_is_read_from_the_kernel_table() {
    let dir = tempfile::tempdir().unwrap();
    let r = Arc::new(FakeRunner::new());
    let b = backend(r.clone(), dir.path(), false);
    let devices = dir.path().join("sys/bus/rbd/devices");
    let entry = |id: &str, pool: &str, ns: &str, name: &str, snap: &str| {
        let d = devices.join(id);
        std::fs::create_dir_all(&d).unwrap();
        for (attr, v) in [
            ("pool", pool),
            ("pool_ns", ns),
            ("name", name),
            ("current_snap", snap),
        ] {
            std::fs::write(d.join(attr), format!("{v}\n")).unwrap();
        }
    };
    let spec = |ns: &str, image: &str| Spec {
        pool: "rbd".into(),
        namespace: ns.into(),
        image: image.into(),
    };
    // Nothing mapped, and no rbd module at all: not mapped.
    assert_eq!(b.find_mapping(&spec("", "fv-a")).await.unwrap(), None);
    entry("0", "rbd", "", "fv-a", "s1");
    entry("1", "rbd", "tenant", "fv-a", "-");
    entry("2", "other", "", "fv-a", "-");
    entry("12", "rbd", "", "fv-a", "-");
    // Not a device's entry.
    entry("x", "rbd", "", "fv-b", "-");
    assert_eq!(
        b.find_mapping(&spec("", "fv-a")).await.unwrap(),
        Some("/dev/rbd12".into())
    );
    assert_eq!(
        b.find_mapping(&spec("tenant", "fv-a")).await.unwrap(),
        Some("/dev/rbd1".into())
    );
    assert_eq!(b.find_mapping(&spec("", "fv-b")).await.unwrap(), None);
    // A kernel without namespaces (no pool_ns): the default namespace.
    std::fs::remove_file(devices.join("12/pool_ns")).unwrap();
    assert_eq!(
        b.find_mapping(&spec("", "fv-a")).await.unwrap(),
        Some("/dev/rbd12".into())
    );
    assert!(r.lines().is_empty(), "{:?}", r.lines());
}

/// NodeGetInfo's count of rbd devices, read from the kernel's tables.
mod devices {
    use crate::backend::rbd::stage::DEVICES;
    use crate::host::devices::fixture::*;

    #[test]
    fn rbd_room_with_one_major_is_its_minor_space_less_others_mappings() {
        let f = Fixture::new();
        f.write("module/rbd/parameters/single_major", "Y\n");
        f.write("bus/rbd/devices/0/pool", "rbd\n");
        f.write("bus/rbd/devices/3/pool", "other\n");
        let t = f.tables();
        assert_eq!(t.room(&DEVICES, &set(&["rbd0"])), 65_536 - 1);
        // The module not loaded yet: it loads with one major.
        let empty = Fixture::new();
        assert_eq!(empty.tables().room(&DEVICES, &set(&[])), 65_536);
    }

    #[test]
    fn rbd_room_without_one_major_counts_the_free_dynamic_majors() {
        let f = Fixture::new();
        f.write("module/rbd/parameters/single_major", "N\n");
        f.write("bus/rbd/devices/0/pool", "rbd\n");
        f.write("bus/rbd/devices/1/pool", "rbd\n");
        // Majors 1 to 250 take their slots and 259 hashes onto slot 4,
        // taken already: slots 251 to 254 are free. Two of the taken ones
        // are the mapped devices' own.
        let mut devices = String::from("Character devices:\n  1 mem\n\nBlock devices:\n");
        for m in 1..=250 {
            devices.push_str(&format!("{m} blk{m}\n"));
        }
        devices.push_str("259 blkext\n");
        f.proc_devices(&devices);
        let t = f.tables();
        // 4 free slots + 2 held by mapped devices, one of them others'.
        assert_eq!(t.room(&DEVICES, &set(&["rbd0"])), 4 + 2 - 1);
    }
}
