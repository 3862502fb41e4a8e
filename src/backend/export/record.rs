//! What an exporting backend's controller made for each volume, kept in a
//! private folder of its own: one record a volume (`<locator>.json`). The
//! fields keep the names iscsi's records were first written with (`iqn`,
//! `initiators`, `lun_bytes`): the format is unchanged.

use crate::error::{Error, Result};
use crate::host::hold::Holds;
use crate::plugin::{Attachment, VolumeId};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// What the controller made for a volume, persisted.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    /// The export's name on the target server (an iSCSI target name).
    #[serde(rename = "iqn")]
    pub export: String,
    /// The store's device the export serves.
    pub device: PathBuf,
    pub attachment: Attachment,
    /// The hosts ControllerPublish granted it to (their initiator names).
    #[serde(rename = "initiators")]
    pub hosts: BTreeSet<String>,
    /// The terms each host's publish was made on (records from before
    /// they were kept have none).
    #[serde(default)]
    pub terms: BTreeMap<String, String>,
    /// The accounts bound to the export (names only; their secrets are
    /// kept in memory and never written).
    pub incoming_user: Option<String>,
    pub outgoing_user: Option<String>,
    /// A copy whose filesystem UUID is still its source's: the nodes renew
    /// it (the store is here, the filesystem is mounted there).
    #[serde(default)]
    pub copy: Option<FsCopy>,
    /// The size the export was last made or refreshed at (records from
    /// before it was kept have none).
    #[serde(default, rename = "lun_bytes")]
    pub bytes: Option<u64>,
    /// The export reports thin provisioning (iscsi's mutable
    /// `thinProvisioning`).
    #[serde(default)]
    pub thin_provisioning: bool,
    /// The hold device the export serves (see `crate::host::hold`): none
    /// where the target host has no device-mapper, and on exports made
    /// before holds were.
    #[serde(default)]
    pub hold: Option<String>,
}

impl Record {
    /// A volume's record before its export is made.
    pub fn new(export: String) -> Self {
        Record {
            export,
            device: PathBuf::new(),
            attachment: Attachment::Device {
                path: PathBuf::new(),
            },
            hosts: BTreeSet::new(),
            terms: BTreeMap::new(),
            incoming_user: None,
            outgoing_user: None,
            copy: None,
            bytes: None,
            thin_provisioning: false,
            hold: None,
        }
    }

    /// What the export serves: the hold device, else the store's device.
    pub fn served(&self) -> PathBuf {
        match &self.hold {
            Some(name) => Holds::path(name),
            None => self.device.clone(),
        }
    }
}

/// A copy whose filesystem still carries its source's UUID.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FsCopy {
    /// Handed to nodes in the publish context; a node renews once per token.
    pub token: String,
    /// The UUID it was made with (its source's): once the device shows
    /// another, the renewal is done.
    pub uuid: String,
}

/// The records of one exporting backend, in its folder.
#[derive(Clone)]
pub struct Records {
    dir: PathBuf,
}

impl Records {
    pub fn new(dir: PathBuf) -> Self {
        Records { dir }
    }

    /// The folder (private to the driver's user once written to).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn path(&self, id: &VolumeId) -> PathBuf {
        self.dir.join(format!("{}.json", id.locator()))
    }

    /// A volume's record, if it has one.
    pub fn load(&self, id: &VolumeId) -> Result<Option<Record>> {
        crate::records::read_json(&self.path(id))
    }

    /// Writes a volume's record (the folder made private first).
    pub fn save(&self, id: &VolumeId, record: &Record) -> Result<()> {
        let bytes = crate::records::encode_record("a target record", record)?;
        crate::records::private_dir(&self.dir)?;
        crate::records::write(&self.path(id), &bytes)
    }

    /// Removes a volume's record; one already gone is fine.
    pub fn remove(&self, id: &VolumeId) -> Result<()> {
        crate::records::remove(&self.path(id)).map(drop)
    }

    /// The locators of the volumes with a record, in order; none when the
    /// folder is not there yet.
    pub fn locators(&self) -> Result<Vec<String>> {
        let entries = match std::fs::read_dir(&self.dir) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(Error::io("read target records", e)),
        };
        let mut locators: Vec<String> = entries
            .flatten()
            .filter_map(|e| {
                e.file_name()
                    .to_string_lossy()
                    .strip_suffix(".json")
                    .map(str::to_string)
            })
            .collect();
        locators.sort();
        Ok(locators)
    }

    /// The hold devices the exports are served through, from their
    /// records. A record that cannot be read is said (its hold, if left
    /// suspended, is not resumed).
    pub fn holds(&self) -> BTreeSet<String> {
        let entries = match std::fs::read_dir(&self.dir) {
            Ok(entries) => entries,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return BTreeSet::new(),
            Err(e) => {
                tracing::error!(dir = %self.dir.display(), error = %e, "could not list the target records");
                return BTreeSet::new();
            }
        };
        let mut holds = BTreeSet::new();
        for entry in entries.flatten() {
            let path = entry.path();
            if path.extension().is_none_or(|x| x != "json") {
                continue;
            }
            match crate::records::read_json::<Record>(&path) {
                Ok(Some(Record { hold: Some(h), .. })) => {
                    holds.insert(h);
                }
                Ok(_) => {}
                Err(e) => {
                    tracing::error!(record = %path.display(), error = %e.message, "a target record could not be read: its hold device, if left suspended, stays so")
                }
            }
        }
        holds
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The record of the oldest state format's iscsi fixture reads into
    /// a record and writes back with the same keys: the format is iscsi's
    /// as it was first written.
    #[test]
    fn the_first_format_s_target_record_reads_and_writes_the_same_keys() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/upgrade/format-1/iscsi.json");
        let fixture: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let mut old = fixture["iscsi/iscsi/pvc-upgrade-iscsi.json"].clone();
        old.as_object_mut().unwrap().remove("format");
        let record: Record = serde_json::from_value(old.clone()).unwrap();
        assert_eq!(
            record.export,
            "iqn.2026-11.io.ferrovol.upgrade:pvc-upgrade-iscsi"
        );
        assert_eq!(record.hosts, BTreeSet::from(["@INITIATOR@".to_string()]));
        assert_eq!(record.bytes, Some(33_554_432));
        assert_eq!(
            record.served(),
            Holds::path("fvh-2842d4985258cf469e0ae42e25a77664")
        );
        assert_eq!(serde_json::to_value(&record).unwrap(), old);
    }

    #[test]
    fn records_are_saved_loaded_listed_and_removed_in_their_folder() {
        let dir = tempfile::tempdir().unwrap();
        let records = Records::new(dir.path().join("iscsi"));
        assert!(records.locators().unwrap().is_empty());
        let (a, b) = (
            VolumeId::parse("iscsi:pvc-b").unwrap(),
            VolumeId::parse("iscsi:pvc-a").unwrap(),
        );
        let mut held = Record::new("iqn.x:b".into());
        held.hold = Some("fvh-b".into());
        records.save(&a, &held).unwrap();
        records.save(&b, &Record::new("iqn.x:a".into())).unwrap();
        assert_eq!(records.load(&a).unwrap(), Some(held));
        assert_eq!(records.locators().unwrap(), ["pvc-a", "pvc-b"]);
        assert_eq!(records.holds(), BTreeSet::from(["fvh-b".to_string()]));
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(records.dir())
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o077, 0, "the folder is private: {mode:o}");
        records.remove(&a).unwrap();
        records.remove(&a).unwrap();
        assert_eq!(records.load(&a).unwrap(), None);
        assert_eq!(records.locators().unwrap(), ["pvc-a"]);
    }
}
