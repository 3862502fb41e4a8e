//! The lvm backend over the scripted runner and report fixtures.

use super::*;
use crate::error::Kind;
use crate::exec::{FakeRunner, Reply};
use std::time::UNIX_EPOCH;

mod health;
mod shared;
mod snapshots;
mod volumes;

const MIB: u64 = 1 << 20;

fn lv_row(name: &str, size: u64, tags: &str, attr: &str) -> String {
    format!(
        r#"{{"lv_name":"{name}", "vg_name":"vg0", "lv_size":"{size}", "lv_tags":"{tags}", "lv_attr":"{attr}", "origin":"", "pool_lv":"", "lv_time":"2026-11-22 00:26:21 +0000", "data_percent":""}}"#
    )
}

/// An lvs row with the group's figures (vg0: `size`, `free`, 4 MiB
/// extents), as a create's read has them.
fn with_vg(row: String, size: u64, free: u64) -> String {
    format!(
        r#"{}, "vg_size":"{size}", "vg_free":"{free}", "vg_extent_size":"4194304"}}"#,
        row.trim_end_matches('}')
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
        skip_attached_devices: false,
        lvm_library: false,
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
    use crate::plugin::health::Status;
    let p = lv("-wi-------").problem().unwrap();
    assert!(p.message.contains("not active"));
    assert_eq!(
        (p.status, p.reason),
        (Status::Inaccessible, reasons::LogicalVolumeInactive)
    );
    let p = lv("-wi-a---p-").problem().unwrap();
    assert!(p.message.contains("partial"));
    assert_eq!(
        (p.status, p.reason),
        (Status::Degraded, reasons::LogicalVolumePartial)
    );
    let p = lv("swi-I-s---").problem().unwrap();
    assert!(p.message.contains("invalid"));
    assert_eq!(
        (p.status, p.reason),
        (Status::DataLoss, reasons::SnapshotInvalid)
    );
    assert_eq!(lv("-wi-ao----").problem(), None);
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
