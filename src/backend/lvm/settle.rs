//! What a classic (thick) snapshot's lvcreate leaves when it is killed part
//! way (the driver died and took it along, or its timeout ran out), and how
//! it is undone. lvcreate makes the snapshot in steps, each visible
//! (measured in the guest, a kill every few hundred milliseconds):
//!
//! 1. the copy-on-write area as a plain LV with the snapshot's name and
//!    tags;
//! 2. that LV's device reloaded as the `-cow` layer, the origin's data
//!    moved under an `-real` layer and the origin's live table switched to
//!    `snapshot-origin` over it (the origin suspended meanwhile);
//! 3. the metadata committed: the snapshot exists.
//!
//! Killed before 3, the metadata still says a plain LV, while the kernel
//! may hold the origin suspended, its table not what the metadata says
//! (lvs shows its state as `X`), and the `-real` and `-cow` devices. Left
//! so, the next lvcreate of that snapshot fails ("already exists") and
//! lvm refuses to refresh the origin while the stray layers use it.
//!
//! Undone in this order, which lvm accepts: the plain LV goes (with its
//! device and `-cow` layer), each origin of ours is refreshed (its table
//! reloaded from the metadata, resumed), and the `-real`/`-cow` layers of
//! our LVs that nothing opens and the metadata does not name go. Run at
//! every start and by a snapshot's retry that finds step 1's LV.

use super::report::Lv;
use super::{LvmBackend, TAG};
use crate::error::Result;

/// The snapshots ferrovol makes are named so; a plain LV so named is a
/// copy-on-write area lvcreate did not finish turning into a snapshot.
pub(super) const SNAPSHOT_PREFIX: &str = "fvs-";

/// A device-mapper name `vg-lv[-layer]` split back into its parts (lvm
/// doubles every `-` inside a part).
pub(super) fn split_dm_name(name: &str) -> Option<(String, String, Option<String>)> {
    let mut parts = vec![String::new()];
    let mut chars = name.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '-' {
            parts.last_mut().unwrap().push(c);
        } else if chars.peek() == Some(&'-') {
            chars.next();
            parts.last_mut().unwrap().push('-');
        } else {
            parts.push(String::new());
        }
    }
    match parts.len() {
        2 => Some((parts[0].clone(), parts[1].clone(), None)),
        3 => Some((parts[0].clone(), parts[1].clone(), Some(parts[2].clone()))),
        _ => None,
    }
    .filter(|(vg, lv, _)| !vg.is_empty() && !lv.is_empty())
}

/// Whether `lv` is a copy-on-write area left by a cut-short lvcreate of
/// one of our snapshots: a plain LV of ours with a snapshot's name.
pub(super) fn is_cut_short_snapshot(lv: &Lv) -> bool {
    lv.plain() && lv.lv_name.starts_with(SNAPSHOT_PREFIX) && lv.has_tag(TAG)
}

impl LvmBackend {
    /// Undoes what cut-short snapshots left in the configured volume
    /// groups (see the module's text). Answers what it did, one line each.
    pub(super) async fn settle(&self) -> Result<Vec<String>> {
        let mut done = Vec::new();
        let lvs = self.all_lvs().await?;
        for (class, lv) in lvs.iter().filter(|(_, lv)| is_cut_short_snapshot(lv)) {
            self.remove_lv(class, &lv.lv_name).await?;
            done.push(format!(
                "removed {}/{}: the copy-on-write area of a snapshot whose making was cut short",
                lv.vg_name, lv.lv_name
            ));
        }
        // Origins whose live table may not be the metadata's: every LV of
        // ours that is suspended or in an unknown state, and every one a
        // cut-short snapshot named as its source.
        let cut_sources: Vec<(&str, &str)> = lvs
            .iter()
            .filter(|(_, lv)| is_cut_short_snapshot(lv))
            .filter_map(|(_, lv)| Some((lv.vg_name.as_str(), lv.tag_value(super::SOURCE_TAG)?)))
            .collect();
        for (_, lv) in &lvs {
            let state = lv.lv_attr.chars().nth(4);
            let suspect = matches!(state, Some('s' | 'S' | 'X' | 'i'))
                || cut_sources.contains(&(lv.vg_name.as_str(), lv.lv_name.as_str()));
            if !suspect || is_cut_short_snapshot(lv) || lv.inactive() {
                continue;
            }
            let target = format!("{}/{}", lv.vg_name, lv.lv_name);
            self.runner
                .run(self.lvm("lvchange").args(["--refresh", &target]))
                .await?;
            done.push(format!(
                "refreshed {target} (state {state:?}): its table reloaded and resumed"
            ));
        }
        // Layers of ours that nothing uses and the metadata does not name.
        let now = self.all_lvs().await?;
        let groups: Vec<&str> = self
            .settings
            .device_classes
            .iter()
            .map(|c| c.volume_group.as_str())
            .collect();
        let listing = self
            .runner
            .run(
                crate::exec::Command::new("dmsetup")
                    .timeout(super::LVM_TIMEOUT)
                    .args([
                        "info",
                        "-c",
                        "--noheadings",
                        "--separator",
                        ":",
                        "-o",
                        "name,open",
                    ]),
            )
            .await;
        let listing = match listing {
            Ok(out) => out.stdout,
            // No device-mapper devices at all.
            Err(e) if e.to_string().contains("No devices found") => String::new(),
            Err(e) => return Err(e.into()),
        };
        for line in listing.lines() {
            let Some((name, open)) = line.trim().rsplit_once(':') else {
                continue;
            };
            let Some((vg, lv_name, Some(layer))) = split_dm_name(name) else {
                continue;
            };
            let ours = (lv_name.starts_with("fv-") || lv_name.starts_with(SNAPSHOT_PREFIX))
                && groups.contains(&vg.as_str());
            if !ours || open.trim() != "0" {
                continue;
            }
            let lv = now
                .iter()
                .map(|(_, l)| l)
                .find(|l| l.vg_name == vg && l.lv_name == lv_name);
            let named = match (layer.as_str(), lv) {
                // An origin's data layer, while it has snapshots.
                ("real", Some(l)) => l.lv_attr.starts_with('o'),
                // A snapshot's copy-on-write layer.
                ("cow", Some(l)) => l.lv_attr.starts_with(['s', 'S']),
                ("real" | "cow", None) => false,
                _ => true,
            };
            if named {
                continue;
            }
            self.runner
                .run(
                    crate::exec::Command::new("dmsetup")
                        .timeout(super::LVM_TIMEOUT)
                        .args(["remove", "--retry", name]),
                )
                .await?;
            done.push(format!("removed the stray device-mapper layer {name}"));
        }
        Ok(done)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_mapper_names_split_back_into_their_parts() {
        assert_eq!(
            split_dm_name("vg0-fv--pvc--1-real"),
            Some(("vg0".into(), "fv-pvc-1".into(), Some("real".into())))
        );
        assert_eq!(
            split_dm_name("my--vg-fvs--a"),
            Some(("my-vg".into(), "fvs-a".into(), None))
        );
        assert_eq!(
            split_dm_name("fvh-0123"),
            Some(("fvh".into(), "0123".into(), None))
        );
        assert_eq!(split_dm_name("plain"), None);
        assert_eq!(split_dm_name("a-b-c-d"), None);
        assert_eq!(split_dm_name("-b"), None);
    }
}
