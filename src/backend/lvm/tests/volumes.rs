//! Volumes: thick and thin creation, space, deletes, listing, growth, attach and detach, parameters.

use super::*;

#[tokio::test]
async fn creates_a_thick_lv_rounded_to_extents_with_tags() {
    // The group's figures, then lvcreate: whether an LV of the name is
    // there already is lvcreate's to find.
    let r = Arc::new(FakeRunner::new());
    r.expect("vgs", Reply::Ok(vgs_json(256 * MIB, 200 * MIB)));
    r.expect("lvcreate", Reply::Ok(String::new()));
    let b = backend(r.clone(), None);
    let v = b
        .create_volume(&create("pvc-1", 10 * MIB + 1, 0))
        .await
        .unwrap();
    assert_eq!(v.id.to_string(), "lvm:fast.fv-pvc-1");
    assert_eq!(v.capacity_bytes, 12 * MIB);
    let lines = r.lines();
    assert_eq!(lines.len(), 2, "{lines:?}");
    assert_eq!(
        lines[1],
        "lvcreate -y -an --setactivationskip y -Zn -Wn -L 12582912b -n fv-pvc-1 --addtag ferrovol --addtag ferrovol-name:pvc-1 --addtag ferrovol-class:fast --addtag ferrovol-fresh vg0"
    );
}

#[tokio::test]
async fn existing_lv_is_returned_or_refused() {
    // lvcreate refuses the name; the read after it finds this name's LV.
    let r = Arc::new(FakeRunner::new());
    let row = lv_row(
        "fv-pvc-1",
        12 * MIB,
        "ferrovol,ferrovol-name:pvc-1",
        "-wi-------",
    );
    let exists = || {
        Reply::Fail(
            5,
            "  Logical Volume \"fv-pvc-1\" already exists in volume group \"vg0\"".into(),
        )
    };
    r.expect("vgs", Reply::Ok(vgs_json(256 * MIB, 200 * MIB)));
    r.expect("vgs", Reply::Ok(vgs_json(256 * MIB, 200 * MIB)));
    for _ in 0..2 {
        r.expect("lvcreate", exists());
        r.expect("lvs", Reply::Ok(lvs_json(std::slice::from_ref(&row))));
    }
    let b = backend(r.clone(), None);
    assert_eq!(
        b.create_volume(&create("pvc-1", 10 * MIB, 0))
            .await
            .unwrap()
            .capacity_bytes,
        12 * MIB
    );
    assert_eq!(
        b.create_volume(&create("pvc-1", 100 * MIB, 0))
            .await
            .unwrap_err()
            .kind,
        Kind::AlreadyExists
    );
    // An LV of this name made for another CSI name is never handed out.
    let r = Arc::new(FakeRunner::new());
    r.expect("vgs", Reply::Ok(vgs_json(256 * MIB, 200 * MIB)));
    r.expect("lvcreate", exists());
    r.expect(
        "lvs",
        Reply::Ok(lvs_json(&[lv_row(
            "fv-pvc-1",
            12 * MIB,
            "ferrovol,ferrovol-name:other",
            "-wi-------",
        )])),
    );
    assert_eq!(
        backend(r, None)
            .create_volume(&create("pvc-1", 10 * MIB, 0))
            .await
            .unwrap_err()
            .kind,
        Kind::AlreadyExists
    );
}

#[tokio::test]
async fn space_is_checked_before_lvcreate() {
    for (required, kind) in [
        (300 * MIB, Kind::OutOfRange),
        (100 * MIB, Kind::ResourceExhausted),
    ] {
        // The group's figures say no; the LV is not there (this is no
        // retry); nothing is made.
        let r = Arc::new(FakeRunner::new());
        r.expect("vgs", Reply::Ok(vgs_json(256 * MIB, 64 * MIB)));
        r.expect("lvs", Reply::Fail(5, String::new()));
        r.expect("vgs", Reply::Ok(vgs_json(256 * MIB, 64 * MIB)));
        let err = backend(r.clone(), None)
            .create_volume(&create("pvc-x", required, 0))
            .await
            .unwrap_err();
        assert_eq!(err.kind, kind, "{}", err.message);
        assert!(!r.lines().iter().any(|l| l.starts_with("lvcreate")));
    }
    // A limit below one extent cannot be met.
    let r = Arc::new(FakeRunner::new());
    r.expect("vgs", Reply::Ok(vgs_json(256 * MIB, 200 * MIB)));
    assert_eq!(
        backend(r, None)
            .create_volume(&create("pvc-y", MIB, 2 * MIB))
            .await
            .unwrap_err()
            .kind,
        Kind::OutOfRange
    );
    // lvcreate refuses after a racing create took the space: the group,
    // read again, has less free than the volume needs: RESOURCE_EXHAUSTED,
    // from lvm's figures and not its wording.
    let refused = |r: &FakeRunner, free_after: u64| {
        r.expect("vgs", Reply::Ok(vgs_json(256 * MIB, 200 * MIB)));
        r.expect(
            "lvcreate",
            Reply::Fail(
                5,
                "  Volume group \"vg0\" has insufficient free space (1 extents): 3 required."
                    .into(),
            ),
        );
        r.expect("lvs", Reply::Fail(5, String::new()));
        r.expect("vgs", Reply::Ok(vgs_json(256 * MIB, free_after)));
    };
    let r = Arc::new(FakeRunner::new());
    refused(&r, 4 * MIB);
    let err = backend(r, None)
        .create_volume(&create("pvc-z", 12 * MIB, 0))
        .await
        .unwrap_err();
    assert_eq!(err.kind, Kind::ResourceExhausted, "{}", err.message);
    assert!(
        err.message.contains("4194304 bytes free"),
        "{}",
        err.message
    );
    // The same words with the room still there: some other failure, kept as
    // lvm gave it (retryable, not "out of space").
    let r = Arc::new(FakeRunner::new());
    refused(&r, 200 * MIB);
    let err = backend(r, None)
        .create_volume(&create("pvc-z", 12 * MIB, 0))
        .await
        .unwrap_err();
    assert_ne!(err.kind, Kind::ResourceExhausted, "{}", err.message);
}

/// A thin create that lvm refuses is RESOURCE_EXHAUSTED only when the
/// pool, read again, is full (data or metadata).
#[tokio::test]
async fn a_refused_thin_create_is_judged_by_the_pool() {
    for (data, meta, exhausted) in [
        ("100.00", "3.00", true),
        ("20.00", "100.00", true),
        ("20.00", "3.00", false),
    ] {
        let r = Arc::new(FakeRunner::new());
        let pool = lv_row("pool", 200 * MIB, "", "twi-a-tz--");
        let full = pool.replace(
            r#""data_percent":"""#,
            &format!(r#""data_percent":"{data}", "metadata_percent":"{meta}""#),
        );
        r.expect(
            "lvs",
            Reply::FailWithOutput(5, lvs_json(&[with_vg(pool, 256 * MIB, 0)])),
        );
        r.expect(
            "lvcreate",
            Reply::Fail(5, "  Cannot create new thin volume.".into()),
        );
        r.expect("lvs", Reply::Ok(lvs_json(&[full])));
        let err = backend(r, Some("pool"))
            .create_volume(&create("t", 8 * MIB, 0))
            .await
            .unwrap_err();
        assert_eq!(
            err.kind == Kind::ResourceExhausted,
            exhausted,
            "data {data}% metadata {meta}%: {:?} {}",
            err.kind,
            err.message
        );
    }
}

#[tokio::test]
async fn thin_volumes_go_in_the_pool() {
    let r = Arc::new(FakeRunner::new());
    // One read: the new LV (not there: lvs exits 5) and the pool, each
    // row with the group's figures; then lvcreate, and nothing else.
    r.expect(
        "lvs",
        Reply::FailWithOutput(
            5,
            lvs_json(&[with_vg(
                lv_row("pool", 200 * MIB, "", "twi-a-tz--"),
                256 * MIB,
                0,
            )]),
        ),
    );
    r.expect("lvcreate", Reply::Ok(String::new()));
    let v = backend(r.clone(), Some("pool"))
        .create_volume(&create("t", 8 * MIB + 1, 0))
        .await
        .unwrap();
    assert_eq!(v.id.to_string(), "lvm:fast.fv-t");
    assert_eq!(v.capacity_bytes, 12 * MIB, "whole extents");
    assert!(v.source.is_none());
    let lines = r.lines();
    assert_eq!(lines.len(), 2, "{lines:?}");
    assert!(
        lines[0].ends_with(" vg0/fv-t vg0/pool")
            && lines[0].contains(",vg_size,vg_free,vg_extent_size "),
        "{}",
        lines[0]
    );
    assert!(
        lines[1].starts_with(
            "lvcreate -y -an --setactivationskip y -V 12582912b --thinpool vg0/pool -n fv-t"
        ),
        "{}",
        lines[1]
    );
}

/// A thick create after another within half a minute goes straight to
/// lvcreate, on the extent size the first one read (one lvm command a
/// volume); one that lvcreate refuses is read the careful way, and the
/// group is read again before the next.
#[tokio::test]
async fn thick_creates_after_a_read_go_straight_to_lvcreate() {
    let r = Arc::new(FakeRunner::new());
    r.expect("vgs", Reply::Ok(vgs_json(256 * MIB, 200 * MIB)));
    let b = backend(r.clone(), None);
    for name in ["a", "b", "c"] {
        r.expect("lvcreate", Reply::Ok(String::new()));
        let v = b.create_volume(&create(name, 10 * MIB, 0)).await.unwrap();
        assert_eq!(
            v.capacity_bytes,
            12 * MIB,
            "whole extents of the group read"
        );
        assert_eq!(v.id.to_string(), format!("lvm:fast.fv-{name}"));
    }
    let tools = |from: usize| -> Vec<String> {
        r.lines()[from..]
            .iter()
            .map(|l| l.split(' ').next().unwrap().to_string())
            .collect()
    };
    assert_eq!(tools(0), ["vgs", "lvcreate", "lvcreate", "lvcreate"]);
    assert!(
        r.lines()[3].starts_with(
            "lvcreate -y -an --setactivationskip y -Zn -Wn -L 12582912b -n fv-c --addtag ferrovol --addtag ferrovol-name:c"
        ),
        "{}",
        r.lines()[3]
    );
    // A create of a name that is there already: lvcreate refuses, the
    // read after it finds the LV (this name's), and the create answers it.
    r.expect(
        "lvcreate",
        Reply::Fail(5, "  Logical Volume \"fv-a\" already exists".into()),
    );
    r.expect(
        "lvs",
        Reply::Ok(lvs_json(&[with_vg(
            lv_row(
                "fv-a",
                12 * MIB,
                "ferrovol,ferrovol-name:a,ferrovol-class:fast",
                "-wi-------",
            ),
            256 * MIB,
            150 * MIB,
        )])),
    );
    let v = b.create_volume(&create("a", 10 * MIB, 0)).await.unwrap();
    assert_eq!(v.capacity_bytes, 12 * MIB);
    assert_eq!(tools(4), ["lvcreate", "lvs"]);
    // After a refusal the group is read again before the next create.
    r.expect("vgs", Reply::Ok(vgs_json(256 * MIB, 150 * MIB)));
    r.expect("lvcreate", Reply::Ok(String::new()));
    b.create_volume(&create("d", 10 * MIB, 0)).await.unwrap();
    assert_eq!(tools(6), ["vgs", "lvcreate"]);
    // A request the group's extents cannot meet is refused with no
    // command at all.
    let e = b
        .create_volume(&create("e", MIB, 2 * MIB))
        .await
        .unwrap_err();
    assert_eq!(e.kind, Kind::OutOfRange, "{e}");
    assert_eq!(r.lines().len(), 8);
}

/// A retried create of a volume that took the last of the group's room
/// answers the volume: the group's figures say there is no room for it,
/// and the LV read after that is this name's.
#[tokio::test]
async fn a_retry_in_a_full_group_answers_the_volume() {
    let r = Arc::new(FakeRunner::new());
    r.expect("vgs", Reply::Ok(vgs_json(256 * MIB, 0)));
    r.expect(
        "lvs",
        Reply::Ok(lvs_json(&[with_vg(
            lv_row(
                "fv-full",
                12 * MIB,
                "ferrovol,ferrovol-name:full,ferrovol-class:fast",
                "-wi-------",
            ),
            256 * MIB,
            0,
        )])),
    );
    let v = backend(r.clone(), None)
        .create_volume(&create("full", 10 * MIB, 0))
        .await
        .unwrap();
    assert_eq!(v.capacity_bytes, 12 * MIB);
    assert!(!r.lines().iter().any(|l| l.starts_with("lvcreate")));
    // Another name in the full group: RESOURCE_EXHAUSTED, no lvcreate.
    let r = Arc::new(FakeRunner::new());
    r.expect("vgs", Reply::Ok(vgs_json(256 * MIB, 0)));
    r.expect("lvs", Reply::Fail(5, String::new()));
    r.expect("vgs", Reply::Ok(vgs_json(256 * MIB, 0)));
    let e = backend(r.clone(), None)
        .create_volume(&create("other", 10 * MIB, 0))
        .await
        .unwrap_err();
    assert_eq!(e.kind, Kind::ResourceExhausted, "{e}");
    assert!(!r.lines().iter().any(|l| l.starts_with("lvcreate")));
}

/// A thin create reads its pool every time: a pool whose zeroing is
/// turned off between two creates refuses the second.
#[tokio::test]
async fn every_thin_create_reads_its_pool() {
    let r = Arc::new(FakeRunner::new());
    let pool = |attr: &str| {
        Reply::FailWithOutput(
            5,
            lvs_json(&[with_vg(lv_row("pool", 200 * MIB, "", attr), 256 * MIB, 0)]),
        )
    };
    r.expect("lvs", pool("twi-a-tz--"));
    r.expect("lvcreate", Reply::Ok(String::new()));
    r.expect("lvs", pool("twi-a-t---"));
    let b = backend(r.clone(), Some("pool"));
    b.create_volume(&create("t1", 8 * MIB, 0)).await.unwrap();
    let e = b
        .create_volume(&create("t2", 8 * MIB, 0))
        .await
        .unwrap_err();
    assert_eq!(e.kind, Kind::FailedPrecondition, "{e}");
    assert!(e.message.contains("lvchange --zero y vg0/pool"), "{e}");
    let tools: Vec<String> = r
        .lines()
        .iter()
        .map(|l| l.split(' ').next().unwrap().to_string())
        .collect();
    assert_eq!(tools, ["lvs", "lvcreate", "lvs"]);
}

/// A pool that hands out chunks without zeroing them (attr `twi-a-t---`)
/// would show a new volume the rest of a previous tenant's chunk: refused
/// before anything is created.
#[tokio::test]
async fn a_thin_pool_that_does_not_zero_is_refused() {
    let r = Arc::new(FakeRunner::new());
    r.expect(
        "lvs",
        Reply::FailWithOutput(
            5,
            lvs_json(&[with_vg(
                lv_row("pool", 200 * MIB, "", "twi-a-t---"),
                256 * MIB,
                0,
            )]),
        ),
    );
    let e = backend(r.clone(), Some("pool"))
        .create_volume(&create("t", 8 * MIB, 0))
        .await
        .unwrap_err();
    assert_eq!(e.kind, Kind::FailedPrecondition, "{e}");
    assert!(e.message.contains("lvchange --zero y vg0/pool"), "{e}");
    assert!(!r.lines().iter().any(|l| l.starts_with("lvcreate")));
}

#[tokio::test]
async fn delete_is_idempotent_and_refuses_open_volumes() {
    let r = Arc::new(FakeRunner::new());
    r.expect(
        "lvs",
        Reply::Ok(lvs_json(&[lv_row("other", MIB, "", "-wi-------")])),
    );
    let b = backend(r.clone(), None);
    b.delete_volume(
        &VolumeId::parse("lvm:fast.fv-gone").unwrap(),
        &Secrets::default(),
    )
    .await
    .unwrap();
    b.delete_volume(
        &VolumeId::parse("lvm:nosuchclass.fv-x").unwrap(),
        &Secrets::default(),
    )
    .await
    .unwrap();
    b.delete_volume(
        &VolumeId::parse("lvm:fast.other-lv").unwrap(),
        &Secrets::default(),
    )
    .await
    .unwrap();
    assert!(!r.lines().iter().any(|l| l.starts_with("lvremove")));
    r.expect(
        "lvs",
        Reply::Ok(lvs_json(&[lv_row(
            "fv-busy",
            MIB,
            "ferrovol",
            "-wi-ao----",
        )])),
    );
    let err = b
        .delete_volume(
            &VolumeId::parse("lvm:fast.fv-busy").unwrap(),
            &Secrets::default(),
        )
        .await
        .unwrap_err();
    assert_eq!(err.kind, Kind::FailedPrecondition);
    r.expect(
        "lvs",
        Reply::Ok(lvs_json(&[lv_row(
            "fv-idle",
            MIB,
            "ferrovol",
            "-wi-------",
        )])),
    );
    // A thick LV: tagged and activated (one lvchange), zeroed, then
    // removed (lvremove deactivates it).
    r.ok("lvchange").ok("blkdiscard").ok("lvremove");
    b.delete_volume(
        &VolumeId::parse("lvm:fast.fv-idle").unwrap(),
        &Secrets::default(),
    )
    .await
    .unwrap();
    let lines = r.lines();
    assert_eq!(
        lines[lines.len() - 3..],
        [
            "lvchange -ay -y --setactivationskip n --addtag ferrovol-deleting vg0/fv-idle",
            "blkdiscard --zeroout /dev/vg0/fv-idle",
            "lvremove -y vg0/fv-idle"
        ]
    );
}

#[tokio::test]
async fn lists_only_ferrovol_lvs() {
    let r = Arc::new(FakeRunner::new());
    let rows = [
        lv_row("fv-b", MIB, "ferrovol,ferrovol-name:b", "-wi-------"),
        lv_row("fv-a", MIB, "ferrovol,ferrovol-name:a", "-wi-------"),
        lv_row("root", 10 * MIB, "", "-wi-ao----"),
        lv_row("fv-untagged", MIB, "", "-wi-------"),
        lv_row(
            "fvs-s1",
            MIB,
            "ferrovol,ferrovol-source:fv-a,ferrovol-size:1048576",
            "swi-a-s---",
        ),
    ];
    r.expect("lvs", Reply::Ok(lvs_json(&rows)));
    r.expect("lvs", Reply::Ok(lvs_json(&rows)));
    let b = backend(r, None);
    let ids: Vec<String> = b
        .list_volumes(&Page::all())
        .await
        .unwrap()
        .iter()
        .map(|v| v.id.to_string())
        .collect();
    assert_eq!(ids, vec!["lvm:fast.fv-a", "lvm:fast.fv-b"]);
    let snaps = b.list_snapshots(None, &Page::all()).await.unwrap();
    assert_eq!(snaps.len(), 1);
    assert_eq!(snaps[0].source_volume.to_string(), "lvm:fast.fv-a");
    assert_eq!(snaps[0].size_bytes, MIB);
}

/// An active thick volume with snapshots: lvextend would refuse it;
/// FAILED_PRECONDITION says what to do, and nothing is run.
#[tokio::test]
async fn an_active_origin_of_snapshots_is_not_grown() {
    let r = Arc::new(FakeRunner::new());
    let row = lv_row("fv-o", 8 * MIB, "ferrovol", "owi-aos---");
    r.expect("lvs", Reply::Ok(lvs_json(std::slice::from_ref(&row))));
    r.expect("vgs", Reply::Ok(vgs_json(256 * MIB, 100 * MIB)));
    let b = backend(r.clone(), None);
    let id = VolumeId::parse("lvm:fast.fv-o").unwrap();
    let e = b
        .expand_volume(&id, 16 * MIB, 0, &Secrets::default())
        .await
        .unwrap_err();
    assert_eq!(e.kind, Kind::FailedPrecondition, "{e}");
    assert!(e.message.contains("has snapshots"), "{e}");
    assert!(!r.lines().iter().any(|l| l.starts_with("lvextend")));
}

#[tokio::test]
async fn expand_rounds_and_respects_limits() {
    let r = Arc::new(FakeRunner::new());
    let row = lv_row("fv-e", 8 * MIB, "ferrovol", "-wi-------");
    r.expect("lvs", Reply::Ok(lvs_json(std::slice::from_ref(&row))));
    r.expect("vgs", Reply::Ok(vgs_json(256 * MIB, 100 * MIB)));
    r.ok("lvextend");
    let b = backend(r.clone(), None);
    let id = VolumeId::parse("lvm:fast.fv-e").unwrap();
    assert_eq!(
        b.expand_volume(&id, 9 * MIB, 0, &Secrets::default())
            .await
            .unwrap(),
        12 * MIB
    );
    assert_eq!(r.lines().last().unwrap(), "lvextend -L 12582912b vg0/fv-e");
    r.expect("lvs", Reply::Ok(lvs_json(std::slice::from_ref(&row))));
    r.expect("vgs", Reply::Ok(vgs_json(256 * MIB, 100 * MIB)));
    assert_eq!(
        b.expand_volume(&id, 9 * MIB, 10 * MIB, &Secrets::default())
            .await
            .unwrap_err()
            .kind,
        Kind::OutOfRange
    );
    r.expect("lvs", Reply::Ok(lvs_json(&[row])));
    r.expect("vgs", Reply::Ok(vgs_json(256 * MIB, 100 * MIB)));
    assert_eq!(
        b.expand_volume(&id, 4 * MIB, 0, &Secrets::default())
            .await
            .unwrap(),
        8 * MIB,
        "no shrink"
    );
    r.expect("lvs", Reply::Fail(5, String::new()));
    assert_eq!(
        b.expand_volume(
            &VolumeId::parse("lvm:fast.fv-none").unwrap(),
            MIB,
            0,
            &Secrets::default()
        )
        .await
        .unwrap_err()
        .kind,
        Kind::NotFound
    );
}

#[tokio::test]
async fn first_attach_wipes_a_fresh_lv_once_and_answers_whether_it_is_a_copy() {
    let r = Arc::new(FakeRunner::new());
    r.expect(
        "lvs",
        Reply::Ok(lvs_json(&[lv_row(
            "fv-n",
            8 * MIB,
            "ferrovol,ferrovol-fresh",
            "-wi-------",
        )])),
    );
    r.ok("lvchange").ok("wipefs").ok("dd").ok("lvchange");
    let b = backend(r.clone(), None);
    let id = VolumeId::parse("lvm:fast.fv-n").unwrap();
    let a = b.node_attach(&id, &AttachContext::default()).await.unwrap();
    assert_eq!(
        a,
        Attachment::Device {
            path: "/dev/vg0/fv-n".into()
        }
    );
    let lines = r.lines();
    assert_eq!(lines[1], "lvchange -ay -K -y vg0/fv-n");
    assert_eq!(lines[2], "wipefs -a -q /dev/vg0/fv-n");
    assert!(lines[3].starts_with("dd if=/dev/zero of=/dev/vg0/fv-n bs=1M count=1"));
    assert_eq!(lines[4], "lvchange --deltag ferrovol-fresh vg0/fv-n");
    // Without the tag: no wipe.
    r.expect(
        "lvs",
        Reply::Ok(lvs_json(&[lv_row(
            "fv-n",
            8 * MIB,
            "ferrovol",
            "-wi-a-----",
        )])),
    );
    r.ok("lvchange");
    b.node_attach(&id, &AttachContext::default()).await.unwrap();
    assert_eq!(r.lines().len(), 7);
    // The stage's next question, whether it is a copy, is answered from
    // the attach's read: no command.
    assert!(!b
        .node_copy_pending(&id, &AttachContext::default())
        .await
        .unwrap());
    assert_eq!(r.lines().len(), 7);
    // A copy: the same, once; asked again, lvs answers.
    r.expect(
        "lvs",
        Reply::Ok(lvs_json(&[lv_row(
            "fv-n",
            8 * MIB,
            "ferrovol,ferrovol-class:fast,ferrovol-copy",
            "-wi-a-----",
        )])),
    );
    r.ok("lvchange");
    b.node_attach(&id, &AttachContext::default()).await.unwrap();
    assert!(b
        .node_copy_pending(&id, &AttachContext::default())
        .await
        .unwrap());
    assert_eq!(r.lines().len(), 9);
    r.expect(
        "lvs",
        Reply::Ok(lvs_json(&[lv_row(
            "fv-n",
            8 * MIB,
            "ferrovol,ferrovol-class:fast",
            "-wi-a-----",
        )])),
    );
    assert!(!b
        .node_copy_pending(&id, &AttachContext::default())
        .await
        .unwrap());
    assert_eq!(r.lines().len(), 10);
}

#[tokio::test]
async fn detach_deactivates_only_active_lvs() {
    let r = Arc::new(FakeRunner::new());
    r.expect(
        "lvs",
        Reply::Ok(lvs_json(&[lv_row("fv-d", MIB, "ferrovol", "-wi-a-----")])),
    );
    // After lvchange, and at the second detach: inactive.
    for _ in 0..2 {
        r.expect(
            "lvs",
            Reply::Ok(lvs_json(&[lv_row("fv-d", MIB, "ferrovol", "-wi-------")])),
        );
    }
    r.ok("lvchange");
    let b = backend(r.clone(), None);
    let id = VolumeId::parse("lvm:fast.fv-d").unwrap();
    b.node_detach(&id, None).await.unwrap();
    b.node_detach(&id, None).await.unwrap();
    assert_eq!(
        r.lines()
            .iter()
            .filter(|l| l.starts_with("lvchange -an"))
            .count(),
        1
    );
}

/// A volume the stage recorded (its attachment) was ours when attached:
/// let go at once, and lvs then says it is done: two commands; in use,
/// lvchange's own failure is the answer; already gone, done.
#[tokio::test]
async fn a_staged_lv_is_let_go_first_and_read_once() {
    let id = VolumeId::parse("lvm:fast.fv-d").unwrap();
    let r = Arc::new(FakeRunner::new());
    let b = backend(r.clone(), None);
    let staged = Attachment::Device {
        path: "/dev/vg0/fv-d".into(),
    };
    r.ok("lvchange");
    r.expect(
        "lvs",
        Reply::Ok(lvs_json(&[lv_row("fv-d", MIB, "ferrovol", "-wi-------")])),
    );
    b.node_detach(&id, Some(&staged)).await.unwrap();
    assert_eq!(r.lines().len(), 2);
    assert_eq!(r.lines()[0], "lvchange -an vg0/fv-d");
    // In use: lvchange fails and lvs shows it still active; lvchange's
    // failure is the answer.
    r.expect(
        "lvchange",
        Reply::Fail(5, "  Logical volume vg0/fv-d in use.".into()),
    );
    r.expect(
        "lvs",
        Reply::Ok(lvs_json(&[lv_row("fv-d", MIB, "ferrovol", "-wi-ao----")])),
    );
    let e = b.node_detach(&id, Some(&staged)).await.unwrap_err();
    assert!(e.message.contains("in use"), "{}", e.message);
    // Gone already: lvchange fails, lvs lists nothing: done.
    r.expect(
        "lvchange",
        Reply::Fail(5, "  Failed to find logical volume \"vg0/fv-d\"".into()),
    );
    r.expect("lvs", Reply::Fail(5, String::new()));
    b.node_detach(&id, Some(&staged)).await.unwrap();
}

#[test]
fn parameters_and_settings_are_validated() {
    let b = backend(Arc::new(FakeRunner::new()), None);
    assert!(b.validate_parameters(&BTreeMap::new()).is_ok());
    let p = |k: &str, v: &str| BTreeMap::from([(k.to_string(), v.to_string())]);
    assert!(b.validate_parameters(&p("deviceClass", "fast")).is_ok());
    assert_eq!(
        b.validate_parameters(&p("deviceClass", "slow"))
            .unwrap_err()
            .kind,
        Kind::InvalidArgument
    );
    assert_eq!(
        crate::plugin::check_parameters(&b, &p("fsType", "xfs"))
            .unwrap_err()
            .kind,
        Kind::InvalidArgument
    );
    let bad = LvmSettings {
        default_device_class: None,
        device_classes: vec![DeviceClass {
            name: "x".into(),
            volume_group: "-rf".into(),
            thin_pool: None,
            snapshot_size_percent: 25,
            default_volume_size: Size(1),
            zero_on_delete: true,
        }],
        deactivate_on_unstage: true,
        lvm_config: String::new(),
        skip_attached_devices: false,
        lvm_library: false,
    };
    assert!(LvmBackend::new("lvm", bad, Arc::new(FakeRunner::new())).is_err());
    let none = LvmSettings {
        device_classes: vec![],
        ..backend_settings()
    };
    assert!(LvmBackend::new("lvm", none, Arc::new(FakeRunner::new())).is_err());
}

fn backend_settings() -> LvmSettings {
    LvmSettings {
        default_device_class: None,
        device_classes: vec![],
        deactivate_on_unstage: true,
        lvm_config: String::new(),
        skip_attached_devices: false,
        lvm_library: false,
    }
}

#[test]
fn ids_must_be_ours() {
    let b = backend(Arc::new(FakeRunner::new()), None);
    assert!(b.split("fast.fv-a").is_ok());
    assert!(b.split("fast.fvs-a").is_ok());
    for bad in ["fast", "fast.root", "slow.fv-a", "fast.-fv"] {
        assert!(b.split(bad).is_err(), "{bad}");
    }
}

/// By default every lvm command leaves out the devices the other
/// backends attach (a dead iSCSI portal or Ceph cluster would hold its
/// scan), before the operator's own text; an operator's `devices` section,
/// or `skip_attached_devices = false`, leaves the filter out.
#[test]
fn lvm_commands_skip_what_other_backends_attach() {
    let parsed = |extra: &str| -> LvmSettings {
        toml::from_str(&format!(
            "{extra}[[device_class]]\nname = \"a\"\nvolume_group = \"vg0\"\n"
        ))
        .unwrap()
    };
    let plain = parsed("");
    assert!(plain.skip_attached_devices);
    // What the registry's kinds attach: iSCSI disks by their by-path
    // links, mapped rbd images, NVMe namespaces of ferrovol's subsystems
    // by their by-id links, and the dm-crypt maps of encrypted volumes;
    // nothing of the file, lvm or nfs kinds.
    let attached = crate::backend::attached_devices();
    let filter = skip_filter(&attached).unwrap();
    assert_eq!(
        filter,
        "devices { global_filter = [ \"r|/dev/disk/by-path/.*-iscsi-|\", \"r|^/dev/rbd|\", \"r|/dev/disk/by-id/nvme-ferrovol_|\", \"r|^/dev/mapper/fvc-|\" ] }"
    );
    assert_eq!(skip_filter(&[]), None);
    assert_eq!(plain.config_text(&attached), filter);
    let with = parsed("lvm_config = \"activation { udev_sync = 0 }\"\n");
    assert_eq!(
        with.config_text(&attached),
        format!("{filter} activation {{ udev_sync = 0 }}")
    );
    assert_eq!(
        with.config_text(&[]),
        "activation { udev_sync = 0 }",
        "nothing attached, nothing left out"
    );
    let own = parsed("lvm_config = \"devices { filter = [ \\\"a|.*|\\\" ] }\"\n");
    assert_eq!(own.config_text(&attached), own.lvm_config);
    let own = parsed("lvm_config = \"devices/global_filter = [ \\\"a|.*|\\\" ]\"\n");
    assert_eq!(own.config_text(&attached), own.lvm_config);
    // One devices/ key that is no filter (a store's: its scans skip
    // suspended devices) keeps the filter.
    let store = parsed(
        "lvm_config = \"devices/ignore_suspended_devices=1 activation { monitoring = 0 }\"\n",
    );
    assert_eq!(
        store.config_text(&attached),
        format!("{filter} devices/ignore_suspended_devices=1 activation {{ monitoring = 0 }}")
    );
    let off = parsed("skip_attached_devices = false\n");
    assert_eq!(off.config_text(&attached), "");
    // The runner sees it on every command of a backend built as the
    // registry builds it.
    let r = Arc::new(FakeRunner::new());
    let b = LvmBackend::new("lvm", parsed(""), r.clone())
        .unwrap()
        .with_attached(&attached);
    r.expect("vgs", Reply::Fail(5, String::new()));
    let _ = futures_lite_block(b.vg(&b.settings.device_classes[0]));
    assert!(
        r.lines()[0].starts_with("vgs --config devices { global_filter"),
        "{:?}",
        r.lines()
    );
}

fn futures_lite_block<F: std::future::Future>(f: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap()
        .block_on(f)
}
