//! Volume and storage health: the LV's attributes and its thin pool.

use super::*;
use crate::plugin::health::{Reason, Status, StorageStatus};
use crate::plugin::HealthReporter;

fn thin(attr: &str) -> String {
    lv_row("fv-t", MIB, "ferrovol", attr).replace(r#""pool_lv":"""#, r#""pool_lv":"pool""#)
}

fn pool(data: &str) -> String {
    lv_row("pool", 64 * MIB, "", "twi-aotz--").replace(
        r#""data_percent":"""#,
        &format!(r#""data_percent":"{data}", "metadata_percent":"10.00""#),
    )
}

#[tokio::test]
async fn a_volume_s_health_is_its_lv_and_its_pool() {
    let r = Arc::new(FakeRunner::new());
    let b = backend(r.clone(), Some("pool"));
    let id = VolumeId::parse("lvm:fast.fv-t").unwrap();
    let secrets = Secrets::default();
    // Inactive (not staged anywhere) and a pool with room: nothing wrong.
    r.expect("lvs", Reply::Ok(lvs_json(&[thin("Vwi---tz--")])))
        .expect("lvs", Reply::Ok(lvs_json(&[pool("50.00")])));
    assert_eq!(b.volume_health(&id, &secrets).await.unwrap(), vec![]);
    // Partial, in a pool at 95%: both said.
    r.expect("lvs", Reply::Ok(lvs_json(&[thin("Vwi-a-tzp-")])))
        .expect("lvs", Reply::Ok(lvs_json(&[pool("95.00")])));
    let found = b.volume_health(&id, &secrets).await.unwrap();
    let kinds: Vec<_> = found.iter().map(|f| (f.status, f.reason)).collect();
    assert_eq!(
        kinds,
        vec![
            (Status::Degraded, reasons::LogicalVolumePartial),
            (Status::Degraded, reasons::ThinPoolNearlyFull)
        ]
    );
    assert!(found[1].message.contains("95% full"), "{found:?}");
    // Gone: the backend no longer has it (its group reads).
    r.expect("lvs", Reply::Ok(lvs_json(&[])))
        .expect("vgs", Reply::Ok(vgs_json(1 << 30, 1 << 29)));
    let found = b.volume_health(&id, &secrets).await.unwrap();
    assert_eq!(found[0].reason, Reason::VolumeNotFound);
    // Not listed because its group cannot be read: said so, not "gone".
    r.expect("lvs", Reply::Ok(lvs_json(&[]))).expect(
        "vgs",
        Reply::Fail(5, "Volume group \"vg0\" not found".into()),
    );
    let found = b.volume_health(&id, &secrets).await.unwrap();
    assert_eq!(
        (found[0].status, found[0].reason),
        (Status::Inaccessible, reasons::VolumeGroupMissing)
    );
    assert!(found[0].message.contains("vg0 cannot be read"), "{found:?}");
}

/// A staged LV that lvs no longer lists: on a volume group that cannot be
/// read (its one disk failed), the node says the group is unreadable and a
/// stage fails UNAVAILABLE (a retry may outlast it); on one that reads,
/// the LV is gone and a stage fails NOT_FOUND.
#[tokio::test]
async fn an_lv_on_an_unreadable_group_is_not_called_gone() {
    use crate::plugin::Stager;
    let r = Arc::new(FakeRunner::new());
    let b = backend(r.clone(), None);
    let id = VolumeId::parse("lvm:fast.fv-t").unwrap();
    let attachment = Attachment::Device {
        path: "/dev/vg0/fv-t".into(),
    };
    let unreadable = || Reply::Fail(5, "Volume group \"vg0\" not found".into());
    r.expect("lvs", Reply::Ok(lvs_json(&[])))
        .expect("vgs", unreadable());
    let found = b.node_health(&id, &attachment).await.unwrap();
    assert_eq!(
        (found[0].status, found[0].reason),
        (Status::Inaccessible, reasons::VolumeGroupMissing)
    );
    r.expect("lvs", Reply::Ok(lvs_json(&[])))
        .expect("vgs", unreadable());
    let e = b
        .node_attach(&id, &AttachContext::default())
        .await
        .unwrap_err();
    assert_eq!(e.kind, Kind::Unavailable, "{e:?}");
    assert!(
        e.message
            .contains("physical volumes are missing or failing"),
        "{e:?}"
    );
    r.expect("lvs", Reply::Ok(lvs_json(&[])))
        .expect("vgs", Reply::Ok(vgs_json(1 << 30, 1 << 29)));
    let found = b.node_health(&id, &attachment).await.unwrap();
    assert_eq!(found[0].reason, reasons::LogicalVolumeGone);
    r.expect("lvs", Reply::Ok(lvs_json(&[])))
        .expect("vgs", Reply::Ok(vgs_json(1 << 30, 1 << 29)));
    let e = b
        .node_attach(&id, &AttachContext::default())
        .await
        .unwrap_err();
    assert_eq!(e.kind, Kind::NotFound, "{e:?}");
}

#[tokio::test]
async fn the_storage_s_health_is_each_class_s_group_and_pool() {
    let r = Arc::new(FakeRunner::new());
    let b = backend(r.clone(), Some("pool"));
    r.expect("vgs", Reply::Ok(vgs_json(1 << 30, 1 << 29)))
        .expect("lvs", Reply::Ok(lvs_json(&[pool("20.00")])));
    assert_eq!(b.storage_findings().await, vec![]);
    r.expect("vgs", Reply::Ok(vgs_json(1 << 30, 1 << 29)))
        .expect("lvs", Reply::Ok(lvs_json(&[pool("91.50")])));
    let found = b.storage_findings().await;
    assert_eq!(
        (found[0].status, found[0].reason),
        (StorageStatus::Degraded, reasons::ThinPoolNearlyFull)
    );
    assert!(
        found[0].message.starts_with("device class fast:"),
        "{found:?}"
    );
    r.expect(
        "vgs",
        Reply::Fail(5, "Volume group \"vg0\" not found".into()),
    );
    let found = b.storage_findings().await;
    assert_eq!(
        (found[0].status, found[0].reason),
        (StorageStatus::Unreachable, reasons::VolumeGroupMissing)
    );
}
