//! Classes sharing a volume group, a deactivation that did not happen, read-ahead.

use super::*;

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
        skip_attached_devices: false,
        lvm_library: false,
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
