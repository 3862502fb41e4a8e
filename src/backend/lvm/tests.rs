//! The lvm backend over the scripted runner and report fixtures.

use super::*;
use crate::error::Kind;
use crate::exec::{FakeRunner, Reply};
use std::time::UNIX_EPOCH;

const MIB: u64 = 1 << 20;

fn lv_row(name: &str, size: u64, tags: &str, attr: &str) -> String {
    format!(
        r#"{{"lv_name":"{name}", "vg_name":"vg0", "lv_size":"{size}", "lv_tags":"{tags}", "lv_attr":"{attr}", "origin":"", "pool_lv":"", "lv_time":"2026-11-22 00:26:21 +0000", "data_percent":""}}"#
    )
}

fn lvs_json(rows: &[String]) -> String {
    format!("  {{\n      \"report\": [\n          {{\n              \"lv\": [\n{}\n              ]\n          }}\n      ]\n  }}\n", rows.join(",\n"))
}

fn vgs_json(size: u64, free: u64) -> String {
    format!(
        r#"{{"report":[{{"vg":[{{"vg_name":"vg0", "vg_size":"{size}", "vg_free":"{free}", "vg_extent_size":"4194304"}}]}}]}}"#
    )
}

fn backend(runner: Arc<FakeRunner>, thin: Option<&str>) -> LvmBackend {
    let settings = LvmSettings {
        default_device_class: None,
        device_classes: vec![DeviceClass {
            name: "fast".into(),
            volume_group: "vg0".into(),
            thin_pool: thin.map(str::to_string),
            snapshot_size_percent: 25,
            default_volume_size: Size(1 << 30),
            zero_on_delete: true,
        }],
        deactivate_on_unstage: true,
        lvm_config: String::new(),
    };
    LvmBackend::new("lvm", settings, runner).unwrap()
}

fn create(name: &str, required: u64, limit: u64) -> CreateVolume {
    CreateVolume {
        name: name.into(),
        required_bytes: required,
        limit_bytes: limit,
        capabilities: vec![],
        parameters: BTreeMap::new(),
        metadata: BTreeMap::new(),
        source: None,
        secrets: Secrets::default(),
    }
}

fn snapshot_of(source: &str, name: &str) -> CreateSnapshot {
    CreateSnapshot {
        source: VolumeId::parse(source).unwrap(),
        name: name.into(),
        parameters: BTreeMap::new(),
        metadata: BTreeMap::new(),
        secrets: Secrets::default(),
    }
}

#[test]
fn parses_reports_and_times() {
    let rows = parse_lvs(&lvs_json(&[lv_row(
        "fv-a",
        20 * MIB,
        "ferrovol,ferrovol-name:pvc-1",
        "-wi-ao----",
    )]))
    .unwrap();
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].size(), 20 * MIB);
    assert!(!rows[0].inactive() && rows[0].open());
    assert_eq!(rows[0].tag_value(NAME_TAG), Some("pvc-1"));
    assert_eq!(rows[0].problem(), None);
    let vgs = parse_vgs(&vgs_json(256 * MIB, 200 * MIB)).unwrap();
    assert_eq!(
        (vgs[0].size(), vgs[0].free(), vgs[0].extent()),
        (256 * MIB, 200 * MIB, 4 * MIB)
    );
    assert!(parse_lvs("WARNING: not json").is_err());
    assert_eq!(parse_lvs(r#"{"report":[{}]}"#).unwrap(), vec![]);
    let t = parse_lv_time("2026-11-22 00:26:21 +0100").unwrap();
    // Values from `date -d '...' +%s`.
    assert_eq!(
        t.duration_since(UNIX_EPOCH).unwrap().as_secs(),
        1_795_303_581
    );
    let leap = parse_lv_time("2000-03-01 00:00:00 +0000").unwrap();
    assert_eq!(
        leap.duration_since(UNIX_EPOCH).unwrap().as_secs(),
        951_868_800
    );
    assert!(parse_lv_time("garbage").is_none());
}

#[test]
fn attributes_report_problems() {
    let lv = |attr: &str| Lv {
        lv_attr: attr.into(),
        ..parse_lvs(&lvs_json(&[lv_row("x", 1, "", "")])).unwrap()[0].clone()
    };
    assert!(lv("-wi-------").problem().unwrap().contains("not active"));
    assert!(lv("-wi-a---p-").problem().unwrap().contains("partial"));
    assert!(lv("swi-I-s---").problem().unwrap().contains("invalid"));
    assert_eq!(lv("-wi-ao----").problem(), None);
}

#[tokio::test]
async fn creates_a_thick_lv_rounded_to_extents_with_tags() {
    let r = Arc::new(FakeRunner::new());
    r.expect(
        "lvs",
        Reply::Fail(5, "Failed to find logical volume \"vg0/fv-pvc-1\"".into()),
    );
    r.expect("vgs", Reply::Ok(vgs_json(256 * MIB, 200 * MIB)));
    r.expect("lvcreate", Reply::Ok(String::new()));
    r.expect(
        "lvs",
        Reply::Ok(lvs_json(&[lv_row(
            "fv-pvc-1",
            12 * MIB,
            "ferrovol,ferrovol-name:pvc-1,ferrovol-fresh",
            "-wi-------",
        )])),
    );
    let b = backend(r.clone(), None);
    let v = b
        .create_volume(&create("pvc-1", 10 * MIB + 1, 0))
        .await
        .unwrap();
    assert_eq!(v.id.to_string(), "lvm:fast.fv-pvc-1");
    assert_eq!(v.capacity_bytes, 12 * MIB);
    let lines = r.lines();
    assert_eq!(
        lines[2],
        "lvcreate -y -Zn -Wn -L 12582912b -n fv-pvc-1 --addtag ferrovol --addtag ferrovol-name:pvc-1 --addtag ferrovol-class:fast --addtag ferrovol-fresh vg0"
    );
}

#[tokio::test]
async fn existing_lv_is_returned_or_refused() {
    let r = Arc::new(FakeRunner::new());
    let row = lv_row(
        "fv-pvc-1",
        12 * MIB,
        "ferrovol,ferrovol-name:pvc-1",
        "-wi-------",
    );
    r.expect("lvs", Reply::Ok(lvs_json(std::slice::from_ref(&row))));
    r.expect("lvs", Reply::Ok(lvs_json(std::slice::from_ref(&row))));
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
    assert!(!r.lines().iter().any(|l| l.starts_with("lvcreate")));
    // An LV of this name made for another CSI name is never handed out.
    let r = Arc::new(FakeRunner::new());
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
            .create_volume(&create("pvc-1", 0, 0))
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
        let r = Arc::new(FakeRunner::new());
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
    r.expect("lvs", Reply::Fail(5, String::new()));
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
        r.expect("lvs", Reply::Fail(5, String::new()));
        r.expect("vgs", Reply::Ok(vgs_json(256 * MIB, 200 * MIB)));
        r.expect(
            "lvcreate",
            Reply::Fail(
                5,
                "  Volume group \"vg0\" has insufficient free space (1 extents): 3 required."
                    .into(),
            ),
        );
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
        r.expect("lvs", Reply::Fail(5, String::new()));
        r.expect("vgs", Reply::Ok(vgs_json(256 * MIB, 0)));
        r.expect("lvs", Reply::Ok(lvs_json(&[pool])));
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
    r.expect("lvs", Reply::Fail(5, String::new()));
    r.expect("vgs", Reply::Ok(vgs_json(256 * MIB, 0)));
    r.expect(
        "lvs",
        Reply::Ok(lvs_json(&[lv_row("pool", 200 * MIB, "", "twi-a-tz--")])),
    );
    r.expect("lvcreate", Reply::Ok(String::new()));
    r.expect(
        "lvs",
        Reply::Ok(lvs_json(&[lv_row(
            "fv-t",
            8 * MIB,
            "ferrovol,ferrovol-name:t",
            "Vwi-a-tz--",
        )])),
    );
    let v = backend(r.clone(), Some("pool"))
        .create_volume(&create("t", 8 * MIB, 0))
        .await
        .unwrap();
    assert_eq!(v.capacity_bytes, 8 * MIB);
    assert!(
        r.lines()[3].starts_with("lvcreate -y -V 8388608b --thinpool vg0/pool -n fv-t"),
        "{}",
        r.lines()[3]
    );
}

/// A pool that hands out chunks without zeroing them (attr `twi-a-t---`)
/// would show a new volume the rest of a previous tenant's chunk: refused
/// before anything is created.
#[tokio::test]
async fn a_thin_pool_that_does_not_zero_is_refused() {
    let r = Arc::new(FakeRunner::new());
    r.expect("lvs", Reply::Fail(5, String::new()));
    r.expect("vgs", Reply::Ok(vgs_json(256 * MIB, 0)));
    r.expect(
        "lvs",
        Reply::Ok(lvs_json(&[lv_row("pool", 200 * MIB, "", "twi-a-t---")])),
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
    // A thick LV: tagged, activated, zeroed, deactivated, then removed.
    r.ok("lvchange")
        .ok("lvchange")
        .ok("blkdiscard")
        .ok("lvchange")
        .ok("lvremove");
    b.delete_volume(
        &VolumeId::parse("lvm:fast.fv-idle").unwrap(),
        &Secrets::default(),
    )
    .await
    .unwrap();
    let lines = r.lines();
    assert_eq!(
        lines[lines.len() - 5..],
        [
            "lvchange --addtag ferrovol-deleting vg0/fv-idle",
            "lvchange -ay -K -y vg0/fv-idle",
            "blkdiscard --zeroout /dev/vg0/fv-idle",
            "lvchange -an vg0/fv-idle",
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
async fn classic_snapshot_gets_a_sized_cow_and_clean_tags() {
    let r = Arc::new(FakeRunner::new());
    r.expect("lvs", Reply::Fail(5, String::new()));
    r.expect(
        "lvs",
        Reply::Ok(lvs_json(&[lv_row(
            "fv-a",
            40 * MIB,
            "ferrovol,ferrovol-name:a",
            "-wi-ao----",
        )])),
    );
    r.expect("vgs", Reply::Ok(vgs_json(256 * MIB, 100 * MIB)));
    r.expect("lvcreate", Reply::Ok(String::new()));
    // As made: the origin's name tag came along; it is taken off.
    r.expect(
        "lvs",
        Reply::Ok(lvs_json(&[lv_row(
            "fvs-s1",
            12 * MIB,
            "ferrovol,ferrovol-name:a,ferrovol-name:s1,ferrovol-source:fv-a,ferrovol-size:41943040",
            "swi-a-s---",
        )])),
    );
    r.ok("lvchange");
    r.expect(
        "lvs",
        Reply::Ok(lvs_json(&[lv_row(
            "fvs-s1",
            12 * MIB,
            "ferrovol,ferrovol-name:s1,ferrovol-source:fv-a,ferrovol-size:41943040",
            "swi-a-s---",
        )])),
    );
    let b = backend(r.clone(), None);
    let s = b
        .create_snapshot(&snapshot_of("lvm:fast.fv-a", "s1"))
        .await
        .unwrap();
    assert_eq!(s.id.to_string(), "lvm:fast.fvs-s1");
    assert_eq!(s.size_bytes, 40 * MIB);
    let lines = r.lines();
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with("lvcreate -y -s -n fvs-s1 -L 12582912b")),
        "{lines:?}"
    );
    // The origin's name tag was copied by lvm and is removed.
    assert!(
        lines
            .iter()
            .any(|l| l == "lvchange --deltag ferrovol-name:a vg0/fvs-s1"),
        "{lines:?}"
    );
}

/// A driver that died between lvcreate and the steps after it left a
/// snapshot with its origin's tags, or a copy with the filling tag: the
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
    r.expect("lvs", Reply::Ok(lvs_json(std::slice::from_ref(&half))));
    r.expect("lvs", Reply::Ok(lvs_json(std::slice::from_ref(&origin))));
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
    r.expect("lvs", Reply::Ok(lvs_json(std::slice::from_ref(&cow))));
    r.expect("lvs", Reply::Ok(lvs_json(&[origin.clone(), cow.clone()])));
    r.ok("lvremove").ok("lvchange");
    r.expect("lvs", Reply::Ok(lvs_json(std::slice::from_ref(&origin))));
    r.expect(
        "dmsetup",
        Reply::Ok("vg0-fv--a:1\nvg0-fv--a-real:0\n".into()),
    );
    r.ok("dmsetup");
    r.expect("lvs", Reply::Fail(5, String::new()));
    r.expect("lvs", Reply::Ok(lvs_json(std::slice::from_ref(&origin))));
    r.expect("vgs", Reply::Ok(vgs_json(256 * MIB, 100 * MIB)));
    r.ok("lvcreate");
    r.expect("lvs", Reply::Ok(lvs_json(std::slice::from_ref(&whole))));
    r.expect("lvs", Reply::Ok(lvs_json(std::slice::from_ref(&whole))));
    backend(r.clone(), None)
        .create_snapshot(&snapshot_of("lvm:fast.fv-a", "s1"))
        .await
        .unwrap();
    let lines = r.lines();
    assert_eq!(lines[2], "lvremove -y vg0/fvs-s1");
    assert_eq!(lines[3], "lvchange --refresh vg0/fv-a");
    assert_eq!(lines[6], "dmsetup remove vg0-fv--a-real");
    assert!(
        lines[10].starts_with("lvcreate -y -s -n fvs-s1"),
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
async fn first_attach_wipes_a_fresh_lv_once() {
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
        b.validate_parameters(&p("fsType", "xfs")).unwrap_err().kind,
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
    // nothing is removed.
    r.ok("lvchange").ok("lvchange");
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
    r.ok("lvchange").ok("blkdiscard").ok("lvchange");
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

/// lvs's answer for fv-race, marked for deletion, with these attributes.
fn deleting(attr: &str) -> Reply {
    Reply::Ok(lvs_json(&[lv_row(
        "fv-race",
        MIB,
        "ferrovol,ferrovol-deleting",
        attr,
    )]))
}

fn row_in_pool(name: &str, tags: &str, attr: &str, pool: &str) -> String {
    lv_row(name, MIB, tags, attr).replace(r#""pool_lv":"""#, &format!(r#""pool_lv":"{pool}""#))
}

/// docs/backends/lvm.md's example: a thick class and a thin class on one VG.
fn shared_vg_backend(runner: Arc<FakeRunner>) -> LvmBackend {
    let class = |name: &str, pool: Option<&str>| DeviceClass {
        name: name.into(),
        volume_group: "vg0".into(),
        thin_pool: pool.map(str::to_string),
        snapshot_size_percent: 25,
        default_volume_size: Size(1 << 30),
        zero_on_delete: true,
    };
    let settings = LvmSettings {
        default_device_class: None,
        device_classes: vec![class("ssd", None), class("thin", Some("pool0"))],
        deactivate_on_unstage: true,
        lvm_config: String::new(),
    };
    LvmBackend::new("lvm", settings, runner).unwrap()
}

#[tokio::test]
async fn classes_sharing_a_volume_group_list_each_lv_once() {
    let r = Arc::new(FakeRunner::new());
    let rows = lvs_json(&[
        row_in_pool("fv-a", "ferrovol,ferrovol-class:ssd", "-wi-------", ""),
        row_in_pool(
            "fv-b",
            "ferrovol,ferrovol-class:thin",
            "Vwi---tz--",
            "pool0",
        ),
        // Made before LVs carried their class: told apart by their pool.
        row_in_pool("fv-old-thick", "ferrovol", "-wi-------", ""),
        row_in_pool("fv-old-thin", "ferrovol", "Vwi---tz--", "pool0"),
        row_in_pool(
            "fvs-s",
            "ferrovol,ferrovol-class:ssd,ferrovol-source:fv-a",
            "swi-a-s---",
            "",
        ),
        row_in_pool("pool0", "", "twi-aotz--", ""),
    ]);
    r.expect("lvs", Reply::Ok(rows.clone()));
    let b = shared_vg_backend(r.clone());
    let ids: Vec<String> = b
        .list_volumes(&Page::all())
        .await
        .unwrap()
        .iter()
        .map(|v| v.id.to_string())
        .collect();
    assert_eq!(
        ids,
        [
            "lvm:ssd.fv-a",
            "lvm:ssd.fv-old-thick",
            "lvm:thin.fv-b",
            "lvm:thin.fv-old-thin"
        ]
    );
    // One report for the group, not one per class.
    assert_eq!(r.lines().iter().filter(|l| l.starts_with("lvs")).count(), 1);

    // Pages follow the locator order, whatever the class.
    r.expect("lvs", Reply::Ok(rows.clone()));
    let page = b
        .list_volumes(&Page {
            after: Some("ssd.fv-old-thick".into()),
            limit: 1,
        })
        .await
        .unwrap();
    assert_eq!(page.len(), 1);
    assert_eq!(page[0].id.to_string(), "lvm:thin.fv-b");

    r.expect("lvs", Reply::Ok(rows.clone()));
    let snaps = b.list_snapshots(None, &Page::all()).await.unwrap();
    assert_eq!(snaps.len(), 1);
    assert_eq!(snaps[0].source_volume.to_string(), "lvm:ssd.fv-a");

    // An id naming the wrong class names no volume.
    r.expect(
        "lvs",
        Reply::Ok(lvs_json(&[row_in_pool(
            "fv-a",
            "ferrovol,ferrovol-class:ssd",
            "-wi-------",
            "",
        )])),
    );
    assert!(b
        .get_volume(
            &VolumeId::parse("lvm:thin.fv-a").unwrap(),
            &Secrets::default()
        )
        .await
        .unwrap()
        .is_none());
    r.expect(
        "lvs",
        Reply::Ok(lvs_json(&[row_in_pool(
            "fv-a",
            "ferrovol,ferrovol-class:ssd",
            "-wi-------",
            "",
        )])),
    );
    assert!(b
        .get_volume(
            &VolumeId::parse("lvm:ssd.fv-a").unwrap(),
            &Secrets::default()
        )
        .await
        .unwrap()
        .is_some());
}

#[tokio::test]
async fn a_name_taken_in_one_class_is_refused_in_the_other() {
    let r = Arc::new(FakeRunner::new());
    r.expect(
        "lvs",
        Reply::Ok(lvs_json(&[row_in_pool(
            "fv-pvc-1",
            "ferrovol,ferrovol-name:pvc-1,ferrovol-class:ssd",
            "-wi-------",
            "",
        )])),
    );
    let b = shared_vg_backend(r.clone());
    let mut req = create("pvc-1", MIB, 0);
    req.parameters.insert("deviceClass".into(), "thin".into());
    assert_eq!(
        b.volume_id_for(&req).unwrap().to_string(),
        "lvm:thin.fv-pvc-1"
    );
    let err = b.create_volume(&req).await.unwrap_err();
    assert_eq!(err.kind, Kind::AlreadyExists);
    assert!(
        err.message.contains("another device class"),
        "{}",
        err.message
    );
    assert!(!r.lines().iter().any(|l| l.starts_with("lvcreate")));
}

#[tokio::test]
async fn capacity_is_per_class_on_a_shared_group() {
    let r = Arc::new(FakeRunner::new());
    let b = shared_vg_backend(r.clone());
    let class = |c: &str| BTreeMap::from([("deviceClass".to_string(), c.to_string())]);
    r.expect("vgs", Reply::Ok(vgs_json(1024 * MIB, 400 * MIB)));
    let thick = b.capacity(&class("ssd")).await.unwrap();
    assert_eq!(thick.available_bytes, 400 * MIB);
    r.expect("vgs", Reply::Ok(vgs_json(1024 * MIB, 400 * MIB)));
    let pool = row_in_pool("pool0", "", "twi-aotz--", "")
        .replace(r#""lv_size":"1048576""#, r#""lv_size":"536870912""#)
        .replace(r#""data_percent":"""#, r#""data_percent":"25.00""#);
    r.expect("lvs", Reply::Ok(lvs_json(&[pool])));
    let thin = b.capacity(&class("thin")).await.unwrap();
    // 512 MiB pool, a quarter used.
    assert_eq!(thin.available_bytes, 384 * MIB);
    assert_eq!(thin.maximum_volume_bytes, Some(512 * MIB));
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
    r.ok("lvchange")
        .ok("blkdiscard")
        .ok("lvchange")
        .ok("lvremove");
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
        lines[lines.len() - 4..],
        [
            "lvchange -ay -K -y vg0/fvs-s1",
            "blkdiscard --zeroout /dev/vg0/fvs-s1",
            "lvchange -an vg0/fvs-s1",
            "lvremove -y vg0/fvs-s1"
        ]
    );
    assert_eq!(
        lines.iter().filter(|l| l.contains("splitsnapshot")).count(),
        1
    );
}

/// An LV that lvchange -an leaves active (it answered 0, or lost a race
/// with a udev scan of the device) fails the detach, so NodeUnstage does
/// not answer OK over an active LV: the CO calls again. Its state
/// unknown to lvs (`X`) is not taken for inactive either.
#[tokio::test]
async fn a_deactivation_that_did_not_happen_fails_the_detach() {
    let r = Arc::new(FakeRunner::new());
    for attr in ["Vwi-aotz--", "Vwi-a-tz--", "Vwi-a-tz--"] {
        r.expect(
            "lvs",
            Reply::Ok(lvs_json(&[lv_row("fv-t", MIB, "ferrovol", attr)])),
        );
    }
    r.ok("lvchange").ok("lvchange");
    let b = backend(r.clone(), None);
    let id = VolumeId::parse("lvm:fast.fv-t").unwrap();
    let e = b.node_detach(&id, None).await.unwrap_err();
    assert_eq!(e.kind, Kind::Unavailable, "{e}");
    assert!(e.message.contains("still active"), "{e}");
    assert_eq!(
        r.lines()
            .iter()
            .filter(|l| l.starts_with("lvchange -an"))
            .count(),
        2
    );
    // Unknown state: deactivated (again), then seen inactive.
    r.expect(
        "lvs",
        Reply::Ok(lvs_json(&[lv_row("fv-t", MIB, "ferrovol", "Vwi-X-tz--")])),
    )
    .ok("lvchange")
    .expect(
        "lvs",
        Reply::Ok(lvs_json(&[lv_row("fv-t", MIB, "ferrovol", "Vwi---tz--")])),
    );
    b.node_detach(&id, None).await.unwrap();
}

#[tokio::test]
async fn read_ahead_is_changed_only_when_it_differs_and_checked_first() {
    let r = Arc::new(FakeRunner::new());
    let row = lv_row(
        "fv-pvc-1",
        12 * MIB,
        "ferrovol,ferrovol-name:pvc-1",
        "-wi-a-----",
    );
    let ra = |v: &str| format!(r#"{{"report":[{{"lv":[{{"lv_read_ahead":"{v}"}}]}}]}}"#);
    r.expect("lvs", Reply::Ok(lvs_json(std::slice::from_ref(&row))));
    r.expect("lvs", Reply::Ok(ra("auto")));
    r.expect("lvchange", Reply::Ok(String::new()));
    r.expect("lvs", Reply::Ok(lvs_json(std::slice::from_ref(&row))));
    r.expect("lvs", Reply::Ok(ra("256")));
    let b = backend(r.clone(), None);
    let id = b.volume_id_for(&create("pvc-1", MIB, 0)).unwrap();
    let set = |v: &str| BTreeMap::from([(READ_AHEAD.to_string(), v.to_string())]);
    for bad in ["100", "banana", "131072", "-8"] {
        let e = b.check_mutable(&set(bad)).unwrap_err();
        assert_eq!(e.kind, Kind::InvalidArgument, "{bad}");
        assert!(e.message.contains("readAhead"), "{}", e.message);
    }
    let none = Secrets::default();
    b.modify_volume(&id, &set("256"), &none).await.unwrap();
    // Already 256: nothing run.
    b.modify_volume(&id, &set("256"), &none).await.unwrap();
    let changes: Vec<String> = r
        .lines()
        .into_iter()
        .filter(|l| l.starts_with("lvchange"))
        .collect();
    assert_eq!(
        changes,
        ["lvchange --readahead 256 vg0/fv-pvc-1".to_string()]
    );
    assert!(r
        .lines()
        .iter()
        .any(|l| l.contains("-o lv_read_ahead vg0/fv-pvc-1")));
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
            "dmsetup remove vg0-fv--a-real",
            "dmsetup remove vg0-fvs--s-cow"
        ]
    );
}
