//! Snapshots: classic and thin, cut short and finished, origins kept, removal, settling at start.

use super::*;

#[tokio::test]
async fn classic_snapshot_gets_a_sized_cow_and_clean_tags() {
    let r = Arc::new(FakeRunner::new());
    // One read: the snapshot is not there (lvs exits 5, and reports the
    // source, with the group's figures).
    r.expect(
        "lvs",
        Reply::FailWithOutput(
            5,
            lvs_json(&[with_vg(
                lv_row("fv-a", 40 * MIB, "ferrovol,ferrovol-name:a", "-wi-ao----"),
                256 * MIB,
                100 * MIB,
            )]),
        ),
    );
    r.expect("lvcreate", Reply::Ok(String::new()));
    let b = backend(r.clone(), None);
    let before = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let s = b
        .create_snapshot(&snapshot_of("lvm:fast.fv-a", "s1"))
        .await
        .unwrap();
    assert_eq!(s.id.to_string(), "lvm:fast.fvs-s1");
    assert_eq!(s.size_bytes, 40 * MIB);
    assert_eq!(s.source_volume.to_string(), "lvm:fast.fv-a");
    let lines = r.lines();
    // The read and lvcreate: lvm copies none of the origin's tags onto
    // the snapshot, so there is nothing to take off, and what lvcreate
    // made is not read again.
    assert_eq!(lines.len(), 2, "{lines:?}");
    // Its time is the one its time tag records, which every later read
    // answers.
    let created = s
        .created
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    assert!(created >= before && created <= before + 60, "{created}");
    assert!(
        lines[1].ends_with(&format!(" --addtag ferrovol-time:{created} vg0/fv-a")),
        "{lines:?}"
    );
    let read = lv_row(
        "fvs-s1",
        12 * MIB,
        &format!("ferrovol,ferrovol-name:s1,ferrovol-source:fv-a,ferrovol-size:41943040,ferrovol-time:{created}"),
        "swi-a-s---",
    );
    r.expect("lvs", Reply::Ok(lvs_json(&[read])));
    let got = b
        .get_snapshot(&s.id, &Default::default())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(got.created, s.created);
    assert_eq!(
        lines[0],
        "lvs --reportformat json --units b --nosuffix -o lv_name,vg_name,lv_size,lv_tags,lv_attr,origin,pool_lv,lv_time,data_percent,metadata_percent,vg_size,vg_free,vg_extent_size vg0/fvs-s1 vg0/fv-a"
    );
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with("lvcreate -y -s -n fvs-s1 -L 12582912b")),
        "{lines:?}"
    );
}

/// A snapshot found carrying its origin's tags (made by an lvm that copies
/// them), or a copy a driver that died left with the filling tag: the
/// CO's retry of the same call finishes it, and answers it as made.
#[tokio::test]
async fn a_snapshot_or_copy_cut_short_is_finished_by_the_retry() {
    let origin = lv_row("fv-a", 40 * MIB, "ferrovol,ferrovol-name:a", "-wi-ao----");
    let r = Arc::new(FakeRunner::new());
    // The snapshot: both name tags, so it reads as this snapshot's (by
    // membership) and the origin's is dropped.
    let half = lv_row(
        "fvs-s1",
        12 * MIB,
        "ferrovol,ferrovol-name:a,ferrovol-name:s1,ferrovol-source:fv-a,ferrovol-size:41943040",
        "swi-a-s---",
    );
    let whole = lv_row(
        "fvs-s1",
        12 * MIB,
        "ferrovol,ferrovol-name:s1,ferrovol-source:fv-a,ferrovol-size:41943040",
        "swi-a-s---",
    );
    r.expect("lvs", Reply::Ok(lvs_json(&[half.clone(), origin.clone()])));
    r.ok("lvchange");
    r.expect("lvs", Reply::Ok(lvs_json(std::slice::from_ref(&whole))));
    let b = backend(r.clone(), None);
    let s = b
        .create_snapshot(&snapshot_of("lvm:fast.fv-a", "s1"))
        .await
        .unwrap();
    assert_eq!(s.id.to_string(), "lvm:fast.fvs-s1");
    let lines = r.lines();
    assert!(
        !lines.iter().any(|l| l.starts_with("lvcreate")),
        "{lines:?}"
    );
    assert!(
        lines
            .iter()
            .any(|l| l == "lvchange --deltag ferrovol-name:a vg0/fvs-s1"),
        "{lines:?}"
    );

    // A classic snapshot cut short inside lvcreate: its copy-on-write area
    // left as a plain LV with the snapshot's tags. It goes, and the
    // snapshot is made again.
    let r = Arc::new(FakeRunner::new());
    let cow = lv_row(
        "fvs-s1",
        12 * MIB,
        "ferrovol,ferrovol-name:s1,ferrovol-source:fv-a,ferrovol-size:41943040",
        "-wi-a-----",
    );
    r.expect(
        "lvs",
        Reply::Ok(lvs_json(&[
            with_vg(cow.clone(), 256 * MIB, 100 * MIB),
            with_vg(origin.clone(), 256 * MIB, 100 * MIB),
        ])),
    );
    r.expect("lvs", Reply::Ok(lvs_json(&[origin.clone(), cow.clone()])));
    r.ok("lvremove").ok("lvchange");
    r.expect("lvs", Reply::Ok(lvs_json(std::slice::from_ref(&origin))));
    r.expect(
        "dmsetup",
        Reply::Ok("vg0-fv--a:1\nvg0-fv--a-real:0\n".into()),
    );
    r.ok("dmsetup");
    r.expect("lvs", Reply::Fail(5, String::new()));
    r.expect("vgs", Reply::Ok(vgs_json(256 * MIB, 100 * MIB)));
    r.ok("lvcreate");
    backend(r.clone(), None)
        .create_snapshot(&snapshot_of("lvm:fast.fv-a", "s1"))
        .await
        .unwrap();
    let lines = r.lines();
    assert_eq!(lines.len(), 10, "{lines:?}");
    assert_eq!(lines[2], "lvremove -y vg0/fvs-s1");
    assert_eq!(lines[3], "lvchange --refresh vg0/fv-a");
    assert_eq!(lines[6], "dmsetup remove --retry vg0-fv--a-real");
    assert!(
        lines[9].starts_with("lvcreate -y -s -n fvs-s1"),
        "{lines:?}"
    );
    // A plain LV of that name that is not this snapshot's is left alone.
    let r = Arc::new(FakeRunner::new());
    let other = lv_row(
        "fvs-s1",
        12 * MIB,
        "ferrovol,ferrovol-name:zz",
        "-wi-a-----",
    );
    r.expect("lvs", Reply::Ok(lvs_json(std::slice::from_ref(&other))));
    assert_eq!(
        backend(r.clone(), None)
            .create_snapshot(&snapshot_of("lvm:fast.fv-a", "s1"))
            .await
            .unwrap_err()
            .kind,
        Kind::AlreadyExists
    );
    assert_eq!(r.lines().len(), 1);

    // A thick copy left filling: its data is copied again, then the tag
    // goes. Without the tag the same LV is answered as it is.
    let r = Arc::new(FakeRunner::new());
    let snap = lv_row(
        "fvs-s1",
        12 * MIB,
        "ferrovol,ferrovol-name:s1,ferrovol-source:fv-a,ferrovol-size:41943040",
        "swi-a-s---",
    );
    let filling = lv_row(
        "fv-b",
        40 * MIB,
        "ferrovol,ferrovol-name:b,ferrovol-class:fast,ferrovol-source:fvs-s1,ferrovol-copy,ferrovol-filling",
        "-wi-------",
    );
    let filled = lv_row(
        "fv-b",
        40 * MIB,
        "ferrovol,ferrovol-name:b,ferrovol-class:fast,ferrovol-source:fvs-s1,ferrovol-copy",
        "-wi-------",
    );
    r.expect("lvs", Reply::Ok(lvs_json(std::slice::from_ref(&snap))));
    r.expect("lvs", Reply::Ok(lvs_json(std::slice::from_ref(&filling))));
    r.expect("vgs", Reply::Ok(vgs_json(256 * MIB, 100 * MIB)));
    r.expect("lvs", Reply::Ok(lvs_json(std::slice::from_ref(&filling))));
    r.ok("lvchange")
        .ok("lvchange")
        .ok("dd")
        .ok("lvchange")
        .ok("lvchange");
    r.expect("lvs", Reply::Ok(lvs_json(std::slice::from_ref(&filled))));
    let mut req = create("b", 0, 0);
    req.source = Some(ContentSource::Snapshot(
        SnapshotId::parse("lvm:fast.fvs-s1").unwrap(),
    ));
    let v = backend(r.clone(), None).create_volume(&req).await.unwrap();
    assert_eq!(v.capacity_bytes, 40 * MIB);
    let lines = r.lines();
    assert!(
        !lines.iter().any(|l| l.starts_with("lvcreate")),
        "{lines:?}"
    );
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with("dd if=/dev/vg0/fvs-s1 of=/dev/vg0/fv-b")),
        "{lines:?}"
    );
    assert_eq!(
        lines.last().unwrap(),
        &"lvs --reportformat json --units b --nosuffix -o lv_name,vg_name,lv_size,lv_tags,lv_attr,origin,pool_lv,lv_time,data_percent,metadata_percent vg0/fv-b".to_string()
    );
    assert!(
        lines
            .iter()
            .any(|l| l == "lvchange --deltag ferrovol-filling vg0/fv-b"),
        "{lines:?}"
    );
    let r = Arc::new(FakeRunner::new());
    r.expect("lvs", Reply::Ok(lvs_json(std::slice::from_ref(&snap))));
    r.expect("lvs", Reply::Ok(lvs_json(std::slice::from_ref(&filled))));
    backend(r.clone(), None).create_volume(&req).await.unwrap();
    assert_eq!(r.lines().len(), 2);
}

#[tokio::test]
async fn delete_refuses_origins_of_classic_snapshots_and_lvs_opened_meanwhile() {
    let r = Arc::new(FakeRunner::new());
    let b = backend(r.clone(), None);
    // A classic snapshot depends on its origin: refused, nothing removed.
    let snap = lv_row("fvs-s", MIB, "ferrovol", "swi-a-s---")
        .replace(r#""origin":"""#, r#""origin":"fv-orig""#);
    r.expect(
        "lvs",
        Reply::Ok(lvs_json(&[
            lv_row("fv-orig", MIB, "ferrovol", "owi-a-----"),
            snap,
        ])),
    );
    let err = b
        .delete_volume(
            &VolumeId::parse("lvm:fast.fv-orig").unwrap(),
            &Secrets::default(),
        )
        .await
        .unwrap_err();
    assert_eq!(err.kind, Kind::FailedPrecondition);
    assert!(err.message.contains("fvs-s"), "{}", err.message);
    assert!(!r.lines().iter().any(|l| l.starts_with("lvremove")));
    // A thin snapshot does not depend on it.
    let thin = lv_row("fvs-t", MIB, "ferrovol", "Vwi-a-tz--")
        .replace(r#""origin":"""#, r#""origin":"fv-thin""#);
    r.expect(
        "lvs",
        Reply::Ok(lvs_json(&[
            lv_row("fv-thin", MIB, "ferrovol,ferrovol-class:fast", "Vwi-a-tz--")
                .replace(r#""pool_lv":"""#, r#""pool_lv":"pool""#),
            thin,
        ])),
    );
    r.ok("lvremove");
    b.delete_volume(
        &VolumeId::parse("lvm:fast.fv-thin").unwrap(),
        &Secrets::default(),
    )
    .await
    .unwrap();
    assert_eq!(r.lines().last().unwrap(), "lvremove -y vg0/fv-thin");
    // Opened between the check and lvremove: lvm's refusal is FAILED_PRECONDITION.
    r.expect(
        "lvs",
        Reply::Ok(lvs_json(&[lv_row(
            "fv-race",
            MIB,
            "ferrovol",
            "-wi-a-----",
        )])),
    );
    // Zeroing opens the device exclusively: in use, it is refused, and
    // nothing is removed. (One lvchange tags and activates it.)
    r.ok("lvchange");
    r.expect(
        "blkdiscard",
        Reply::Fail(
            1,
            "blkdiscard: cannot open /dev/vg0/fv-race: Device or resource busy".into(),
        ),
    );
    // What says it is in use: lvs, which shows it open.
    r.expect("lvs", deleting("-wi-ao----"));
    let race = VolumeId::parse("lvm:fast.fv-race").unwrap();
    let none = Secrets::default();
    let delete = || b.delete_volume(&race, &none);
    let err = delete().await.unwrap_err();
    assert_eq!(err.kind, Kind::FailedPrecondition, "{}", err.message);
    assert!(!r
        .lines()
        .iter()
        .any(|l| l.contains("lvremove -y vg0/fv-race")));
    // Opened between zeroing and lvremove: lvm's refusal is FAILED_PRECONDITION.
    r.expect("lvs", deleting("-wi-a-----"));
    r.ok("lvchange").ok("blkdiscard");
    r.expect(
        "lvremove",
        Reply::Fail(5, "  Logical volume vg0/fv-race in use.".into()),
    );
    r.expect("lvs", deleting("-wi-ao----"));
    let err = delete().await.unwrap_err();
    assert_eq!(err.kind, Kind::FailedPrecondition);
    // A failure whose words say "busy" over an LV nobody has open is
    // that failure, not FAILED_PRECONDITION: lvs decides, not the text.
    r.expect("lvs", deleting("-wi-a-----"));
    r.ok("lvchange");
    r.expect(
        "blkdiscard",
        Reply::Fail(1, "blkdiscard: /dev/vg0/fv-race: busy in use".into()),
    );
    r.expect("lvs", deleting("-wi-a-----"));
    let err = delete().await.unwrap_err();
    assert_eq!(err.kind, Kind::Internal, "{}", err.message);
}

/// A classic snapshot's extents hold the origin's old blocks: it is tagged,
/// split from its origin, zeroed and only then removed; a delete retried
/// after the split zeroes again and skips the split; while it is being
/// deleted it is neither listed nor usable as a source.
#[tokio::test]
async fn classic_snapshots_are_split_and_zeroed_before_removal() {
    let r = Arc::new(FakeRunner::new());
    let b = backend(r.clone(), None);
    let id = SnapshotId::parse("lvm:fast.fvs-s1").unwrap();
    let snap = lv_row(
        "fvs-s1",
        MIB,
        "ferrovol,ferrovol-source:fv-a,ferrovol-size:1048576",
        "swi-a-s---",
    );
    r.expect("lvs", Reply::Ok(lvs_json(std::slice::from_ref(&snap))));
    // The split fails (say, lvm is busy): nothing is removed.
    r.ok("lvchange")
        .expect("lvconvert", Reply::Fail(5, "busy".into()));
    assert!(b.delete_snapshot(&id, &Secrets::default()).await.is_err());
    assert!(!r.lines().iter().any(|l| l.starts_with("lvremove")));

    // Retried after a split that happened: a plain LV with the tag.
    let split = lv_row(
        "fvs-s1",
        MIB,
        "ferrovol,ferrovol-source:fv-a,ferrovol-size:1048576,ferrovol-deleting",
        "-wi-------",
    );
    r.expect("lvs", Reply::Ok(lvs_json(std::slice::from_ref(&split))));
    assert!(
        b.get_snapshot(&id, &Secrets::default())
            .await
            .unwrap()
            .is_none(),
        "hidden while deleting"
    );
    r.expect("lvs", Reply::Ok(lvs_json(std::slice::from_ref(&split))));
    r.ok("lvchange").ok("blkdiscard").ok("lvremove");
    b.delete_snapshot(&id, &Secrets::default()).await.unwrap();
    let lines = r.lines();
    assert_eq!(
        lines[..3],
        [
            "lvs --reportformat json --units b --nosuffix -o lv_name,vg_name,lv_size,lv_tags,lv_attr,origin,pool_lv,lv_time,data_percent,metadata_percent vg0/fvs-s1",
            "lvchange --addtag ferrovol-deleting vg0/fvs-s1",
            "lvconvert -y --splitsnapshot vg0/fvs-s1",
        ]
    );
    assert_eq!(
        lines[lines.len() - 3..],
        [
            "lvchange -ay -K -y vg0/fvs-s1",
            "blkdiscard --zeroout /dev/vg0/fvs-s1",
            "lvremove -y vg0/fvs-s1"
        ]
    );
    assert_eq!(
        lines.iter().filter(|l| l.contains("splitsnapshot")).count(),
        1
    );
}

/// A driver that died while lvcreate cut a classic snapshot: the next
/// start removes the half-made snapshot (a plain LV with a snapshot's name),
/// refreshes its origin and every LV of ours left suspended, and removes
/// the stray layers of ours nothing opens; nothing else is touched.
#[tokio::test]
async fn start_settles_what_a_cut_short_snapshot_left() {
    let r = Arc::new(FakeRunner::new());
    r.expect(
        "lvs",
        Reply::Ok(lvs_json(&[
            lv_row("fv-a", 40 * MIB, "ferrovol,ferrovol-name:a", "-wi-XX--X-"),
            lv_row(
                "fvs-s",
                12 * MIB,
                "ferrovol,ferrovol-name:s,ferrovol-source:fv-a",
                "-wi-i-----",
            ),
            lv_row("fv-b", 40 * MIB, "ferrovol,ferrovol-name:b", "-wi-so----"),
            lv_row("fv-c", 40 * MIB, "ferrovol,ferrovol-name:c", "owi-ao----"),
            lv_row("theirs", 40 * MIB, "", "-wi-s-----"),
        ])),
    );
    r.ok("lvremove").ok("lvchange").ok("lvchange");
    r.expect(
        "lvs",
        Reply::Ok(lvs_json(&[
            lv_row("fv-a", 40 * MIB, "ferrovol,ferrovol-name:a", "-wi-ao----"),
            lv_row("fv-b", 40 * MIB, "ferrovol,ferrovol-name:b", "-wi-ao----"),
            lv_row("fv-c", 40 * MIB, "ferrovol,ferrovol-name:c", "owi-ao----"),
        ])),
    );
    r.expect(
        "dmsetup",
        Reply::Ok(
            "vg0-fv--a:1\nvg0-fv--a-real:0\nvg0-fvs--s-cow:0\nvg0-fv--c-real:0\n\
             vg0-theirs-real:0\nvg0-fv--b-real:1\nother-fv--x-real:0\n"
                .into(),
        ),
    );
    r.ok("dmsetup").ok("dmsetup");
    backend(r.clone(), None).start().await.unwrap();
    let lines = r.lines();
    assert_eq!(
        lines[1..4],
        [
            "lvremove -y vg0/fvs-s",
            "lvchange --refresh vg0/fv-a",
            "lvchange --refresh vg0/fv-b",
        ]
    );
    assert_eq!(
        lines[5..],
        [
            "dmsetup info -c --noheadings --separator : -o name,open",
            "dmsetup remove --retry vg0-fv--a-real",
            "dmsetup remove --retry vg0-fvs--s-cow"
        ]
    );
}

/// A thin backend keeping its records in `dir` (and lvm's locks there).
fn recording(r: Arc<FakeRunner>, dir: &std::path::Path) -> LvmBackend {
    backend(r, Some("pool"))
        .with_records(dir.join("state"))
        .unwrap()
        .with_lock_dir(dir.to_path_buf())
}

fn thin_row(name: &str, tags: &str, thin_id: u32) -> String {
    lv_row(name, 40 * MIB, tags, "Vwi-a-tz--").replace(
        r#""pool_lv":"""#,
        &format!(r#""pool_lv":"pool", "thin_id":"{thin_id}""#),
    )
}

fn pool_row(transaction: u64) -> String {
    lv_row("pool", 96 * MIB, "", "twi-aotz--").replace(
        r#""data_percent":"""#,
        &format!(r#""transaction_id":"{transaction}""#),
    )
}

fn intents_left(dir: &std::path::Path) -> usize {
    std::fs::read_dir(dir.join("state/intents"))
        .map(|d| d.flatten().count())
        .unwrap_or(0)
}

/// What the start's settling of classic snapshots reads when there is
/// nothing of theirs to settle: every LV twice, and the device-mapper
/// devices.
fn settle_finds_nothing(r: &FakeRunner) {
    r.expect("lvs", Reply::Ok(lvs_json(&[])));
    r.expect("lvs", Reply::Ok(lvs_json(&[])));
    r.expect("dmsetup", Reply::Fail(1, "No devices found".into()));
}

/// What settling a pool reads: one lvs (fv-a, the highest thin id
/// `highest` in the pool; the pool's transaction id `metadata` in lvm's
/// metadata), then the pool's status (its transaction id `kernel` in the
/// kernel).
fn pool_read(r: &FakeRunner, highest: u32, metadata: u64, kernel: u64) {
    r.expect(
        "lvs",
        Reply::Ok(lvs_json(&[
            thin_row("fv-a", "ferrovol", highest),
            pool_row(metadata),
        ])),
    );
    r.expect(
        "dmsetup",
        Reply::Ok(format!("0 1 thin-pool {kernel} 1/2 0/3 - rw - 256\n")),
    );
}

const TAKEN_TEXT: &str =
    "  Thin pool vg0-pool-tpool (254:2) already contain thin device with device_id 3.\n";

/// A thin snapshot's lvcreate is recorded before it runs and the record
/// goes once it has answered; one a driver that died left (its LV never
/// made) frees, at the next start, the id its lvcreate left in the pool,
/// only while the pool's transaction ids agree, and a record whose LV was
/// made just goes.
#[tokio::test]
async fn thin_snapshots_are_recorded_and_a_cut_short_one_settled_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let origin = thin_row("fv-a", "ferrovol,ferrovol-name:a,ferrovol-class:fast", 1);
    let r = Arc::new(FakeRunner::new());
    r.expect(
        "lvs",
        Reply::FailWithOutput(
            5,
            lvs_json(&[with_vg(origin.clone(), 256 * MIB, 100 * MIB)]),
        ),
    );
    r.ok("lvcreate");
    let b = recording(r.clone(), dir.path());
    b.create_snapshot(&snapshot_of("lvm:fast.fv-a", "s1"))
        .await
        .unwrap();
    assert_eq!(r.lines().len(), 2, "{:?}", r.lines());
    assert_eq!(intents_left(dir.path()), 0);

    // Recorded, then the driver died before lvcreate answered.
    let cut = orphans::ThinSnapshot {
        vg: "vg0".into(),
        pool: "pool".into(),
        lv: "fvs-s2".into(),
    };
    let intents = orphans::ThinIntents::open_dir(dir.path().join("state/intents")).unwrap();
    intents.record(&cut).unwrap();
    // The next start: fvs-s2 is not in the metadata, whose highest id in
    // the pool is 2, so 3 is deleted from the pool, under lvm's lock.
    let r = Arc::new(FakeRunner::new());
    settle_finds_nothing(&r);
    r.expect(
        "lvs",
        Reply::Ok(lvs_json(&[
            thin_row("fv-a", "ferrovol", 1),
            thin_row("fv-b", "ferrovol", 2),
            pool_row(7),
        ])),
    );
    r.expect(
        "dmsetup",
        Reply::Ok(
            "0 204800 thin-pool 7 114/1024 0/1600 - rw discard_passdown queue_if_no_space - 256\n"
                .into(),
        ),
    );
    r.ok("dmsetup");
    let b = recording(r.clone(), dir.path());
    b.start().await.unwrap();
    let lines = r.lines();
    assert_eq!(
        lines[3],
        "lvs --reportformat json --units b --nosuffix -o lv_name,vg_name,lv_size,pool_lv,thin_id,transaction_id vg0"
    );
    assert_eq!(lines[4], "dmsetup status vg0-pool-tpool");
    assert_eq!(lines[5], "dmsetup message vg0-pool-tpool 0 delete 3");
    assert_eq!(intents_left(dir.path()), 0);

    // The pool's ids disagree (a change of lvm's unfinished): nothing is
    // deleted and the record stays for a later start.
    intents.record(&cut).unwrap();
    let r = Arc::new(FakeRunner::new());
    settle_finds_nothing(&r);
    r.expect(
        "lvs",
        Reply::Ok(lvs_json(&[thin_row("fv-a", "ferrovol", 1), pool_row(7)])),
    );
    r.expect(
        "dmsetup",
        Reply::Ok("0 204800 thin-pool 8 114/1024 0/1600 - rw - 256\n".into()),
    );
    recording(r.clone(), dir.path()).start().await.unwrap();
    assert_eq!(r.lines().len(), 5, "{:?}", r.lines());
    assert_eq!(intents_left(dir.path()), 1);

    // Its LV was made after all: the record just goes.
    let r = Arc::new(FakeRunner::new());
    settle_finds_nothing(&r);
    r.expect(
        "lvs",
        Reply::Ok(lvs_json(&[thin_row("fvs-s2", "ferrovol", 2), pool_row(8)])),
    );
    recording(r.clone(), dir.path()).start().await.unwrap();
    assert_eq!(r.lines().len(), 4, "{:?}", r.lines());
    assert_eq!(intents_left(dir.path()), 0);
}

/// An lvcreate refused because the pool has the id it picked: the id is
/// freed and the lvcreate runs again only when an earlier lvcreate of ours
/// was cut short in that pool; otherwise it is not the driver's, nothing
/// is deleted and the call says why. An lvcreate failing otherwise (its
/// timeout) settles its own record: the id it may have sent goes, and
/// "no such id" means it sent none.
#[tokio::test]
async fn a_thin_snapshot_refused_for_a_taken_id_frees_only_ours() {
    let dir = tempfile::tempdir().unwrap();
    let origin = thin_row("fv-a", "ferrovol,ferrovol-name:a,ferrovol-class:fast", 1);
    let look = || {
        Reply::FailWithOutput(
            5,
            lvs_json(&[with_vg(origin.clone(), 256 * MIB, 100 * MIB)]),
        )
    };
    // Not ours: no record explains the id.
    let r = Arc::new(FakeRunner::new());
    r.expect("lvs", look());
    r.expect("lvcreate", Reply::Fail(5, TAKEN_TEXT.into()));
    pool_read(&r, 2, 4, 4);
    let e = recording(r.clone(), dir.path())
        .create_snapshot(&snapshot_of("lvm:fast.fv-a", "s1"))
        .await
        .unwrap_err();
    assert!(
        e.message.contains("no cut-short lvcreate of this driver's"),
        "{}",
        e.message
    );
    assert!(
        !r.lines().iter().any(|l| l.starts_with("dmsetup message")),
        "{:?}",
        r.lines()
    );
    assert_eq!(intents_left(dir.path()), 0);

    // Ours: an earlier lvcreate in the pool was cut short.
    let intents = orphans::ThinIntents::open_dir(dir.path().join("state/intents")).unwrap();
    intents
        .record(&orphans::ThinSnapshot {
            vg: "vg0".into(),
            pool: "pool".into(),
            lv: "fvs-s0".into(),
        })
        .unwrap();
    let r = Arc::new(FakeRunner::new());
    r.expect("lvs", look());
    r.expect("lvcreate", Reply::Fail(5, TAKEN_TEXT.into()));
    pool_read(&r, 2, 4, 4);
    r.ok("dmsetup");
    r.ok("lvcreate");
    recording(r.clone(), dir.path())
        .create_snapshot(&snapshot_of("lvm:fast.fv-a", "s1"))
        .await
        .unwrap();
    let lines = r.lines();
    assert_eq!(lines[4], "dmsetup message vg0-pool-tpool 0 delete 3");
    assert!(
        lines[5].starts_with("lvcreate -y -s -n fvs-s1"),
        "{lines:?}"
    );
    assert_eq!(intents_left(dir.path()), 0);

    // Refused, with lvm's metadata a transaction ahead of the pool (it
    // queued the id's removal itself): lvcreate runs again, nothing is
    // deleted by the driver.
    let r = Arc::new(FakeRunner::new());
    r.expect("lvs", look());
    r.expect("lvcreate", Reply::Fail(5, TAKEN_TEXT.into()));
    pool_read(&r, 1, 5, 4);
    r.ok("lvcreate");
    recording(r.clone(), dir.path())
        .create_snapshot(&snapshot_of("lvm:fast.fv-a", "s1"))
        .await
        .unwrap();
    let lines = r.lines();
    assert_eq!(lines.len(), 5, "{lines:?}");
    assert!(
        !lines.iter().any(|l| l.starts_with("dmsetup message")),
        "{lines:?}"
    );
    assert_eq!(intents_left(dir.path()), 0);

    // Timed out: its own record is settled; the pool had no such id.
    let r = Arc::new(FakeRunner::new());
    r.expect("lvs", look());
    r.expect("lvcreate", Reply::Timeout);
    pool_read(&r, 1, 4, 4);
    r.expect(
        "dmsetup",
        Reply::Fail(
            1,
            "device-mapper: message ioctl on vg0-pool-tpool  failed: No data available\n".into(),
        ),
    );
    r.expect("lvs", Reply::Ok(lvs_json(&[pool_row(4)])));
    let e = recording(r.clone(), dir.path())
        .create_snapshot(&snapshot_of("lvm:fast.fv-a", "s1"))
        .await
        .unwrap_err();
    assert_eq!(e.kind, Kind::Unavailable, "{}", e.message);
    assert_eq!(r.lines()[4], "dmsetup message vg0-pool-tpool 0 delete 2");
    assert_eq!(intents_left(dir.path()), 0);
}
