//! Changed block tracking for thin snapshots, from the thin pool's own
//! block map: with a metadata snapshot of the live pool reserved
//! (`reserve_metadata_snap`), `thin_dump` gives the chunks a thin device
//! maps (its allocated ranges) and `thin_delta` the chunks where two thin
//! devices differ (mapped differently, or mapped in one only), both in the
//! pool's chunks (its granularity); the metadata snapshot is released
//! after. One at a time per pool: a pool holds one metadata snapshot.
//! Thick (copy-on-write) snapshots keep no block map of their own:
//! FAILED_PRECONDITION.

use super::{DeviceClass, LvmBackend, LVM_TIMEOUT, SOURCE_TAG};
use crate::error::{Error, Result};
use crate::exec::Command;
use crate::plugin::{BlockPage, SnapshotId};

/// The value of attribute `name` in one XML element's text.
fn attr<'a>(element: &'a str, name: &str) -> Option<&'a str> {
    let key = format!(" {name}=\"");
    let at = element.find(&key)? + key.len();
    let rest = &element[at..];
    Some(&rest[..rest.find('"')?])
}

fn num(element: &str, name: &str) -> Result<u64> {
    attr(element, name)
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| Error::internal(format!("thin tools: no {name} in {element:?}")))
}

/// The pool's chunk size in bytes, from the superblock element.
fn chunk_bytes(xml: &str) -> Result<u64> {
    let sb = xml
        .lines()
        .find(|l| l.trim_start().starts_with("<superblock"))
        .ok_or_else(|| Error::internal("thin tools: no superblock"))?;
    Ok(num(sb, "data_block_size")? * 512)
}

/// Chunk ranges (first, count) merged where they touch.
fn merged(mut ranges: Vec<(u64, u64)>) -> Vec<(u64, u64)> {
    ranges.sort_unstable();
    let mut out: Vec<(u64, u64)> = Vec::new();
    for (b, n) in ranges {
        match out.last_mut() {
            Some((lb, ln)) if *lb + *ln >= b => *ln = (*ln).max(b + n - *lb),
            _ => out.push((b, n)),
        }
    }
    out
}

/// `thin_dump` of one device: the chunks it maps.
pub(super) fn mapped_chunks(xml: &str) -> Result<(u64, Vec<(u64, u64)>)> {
    let chunk = chunk_bytes(xml)?;
    let mut ranges = Vec::new();
    for l in xml.lines().map(str::trim_start) {
        if l.starts_with("<range_mapping") {
            ranges.push((num(l, "origin_begin")?, num(l, "length")?));
        } else if l.starts_with("<single_mapping") {
            ranges.push((num(l, "origin_block")?, 1));
        }
    }
    Ok((chunk, merged(ranges)))
}

/// `thin_delta` of two devices: the chunks where they differ.
pub(super) fn differing_chunks(xml: &str) -> Result<(u64, Vec<(u64, u64)>)> {
    let chunk = chunk_bytes(xml)?;
    let mut ranges = Vec::new();
    for l in xml.lines().map(str::trim_start) {
        if ["<different", "<left_only", "<right_only"]
            .iter()
            .any(|p| l.starts_with(p))
        {
            ranges.push((num(l, "begin")?, num(l, "length")?));
        }
    }
    Ok((chunk, merged(ranges)))
}

/// A page of byte ranges from chunk ranges, from `start`, at most `max`,
/// none past `capacity`.
pub(super) fn page(
    chunk: u64,
    chunks: &[(u64, u64)],
    capacity: u64,
    start: u64,
    max: usize,
) -> BlockPage {
    let mut ranges = Vec::new();
    let mut next = None;
    for (b, n) in chunks {
        let (from, to) = (
            (b * chunk).max(start - start % chunk),
            ((b + n) * chunk).min(capacity),
        );
        if to <= from || to <= start {
            continue;
        }
        if ranges.len() == max {
            next = Some(from);
            break;
        }
        ranges.push((from, to - from));
    }
    BlockPage {
        fixed: None,
        capacity,
        ranges,
        next,
    }
}

/// Doubles the dashes of a VG or LV name, as device-mapper names them.
fn dm_part(name: &str) -> String {
    name.replace('-', "--")
}

impl LvmBackend {
    /// A thin snapshot's class, origin and thin device id; NOT_FOUND or
    /// FAILED_PRECONDITION (thick).
    pub(super) async fn thin_snapshot(
        &self,
        id: &SnapshotId,
    ) -> Result<(DeviceClass, String, u64, u64)> {
        let missing = || Error::no_snapshot(id);
        let (class, lv_name) = self.split(id.locator()).map_err(|_| missing())?;
        if !lv_name.starts_with("fvs-") {
            return Err(missing());
        }
        let lv = self.class_lv(class, lv_name).await?.ok_or_else(missing)?;
        if lv.pool_lv.is_empty() {
            return Err(Error::precondition(format!(
                "snapshot {id} is a thick (copy-on-write) snapshot, which keeps no block map: \
                 changed block tracking needs thin volumes (a device class with thin_pool)"
            )));
        }
        let out = self
            .runner
            .run(self.lvm("lvs").args([
                "--noheadings",
                "-o",
                "thin_id",
                &format!("{}/{lv_name}", class.volume_group),
            ]))
            .await?;
        let thin_id =
            out.stdout.trim().parse().map_err(|_| {
                Error::internal(format!("lvs thin_id of {lv_name}: {:?}", out.stdout))
            })?;
        let origin = lv.tag_value(SOURCE_TAG).unwrap_or(&lv.origin).to_string();
        Ok((class.clone(), origin, thin_id, lv.size()))
    }

    /// Runs a thin tool over the pool's metadata snapshot, reserved for
    /// the call and released after.
    pub(super) async fn with_metadata_snapshot(
        &self,
        class: &DeviceClass,
        tool: Command,
    ) -> Result<String> {
        let pool = class
            .thin_pool
            .as_deref()
            .ok_or_else(|| Error::internal("a thin snapshot in a class without a pool"))?;
        let lock = self.pool_lock(&class.volume_group, pool);
        let _one = lock.lock().await;
        let vg = dm_part(&class.volume_group);
        let tpool = format!("{vg}-{}-tpool", dm_part(pool));
        let tmeta = format!("/dev/mapper/{vg}-{}_tmeta", dm_part(pool));
        let message = |what: &str| {
            Command::new("dmsetup")
                .timeout(LVM_TIMEOUT)
                .args(["message", &tpool, "0", what])
        };
        if let Err(first) = self.runner.run(message("reserve_metadata_snap")).await {
            // One left reserved by a call that died: released, then ours.
            self.runner
                .run(message("release_metadata_snap"))
                .await
                .map_err(|_| first)?;
            self.runner.run(message("reserve_metadata_snap")).await?;
        }
        let out = self.runner.run(tool.arg("-m").arg(tmeta)).await;
        let released = self.runner.run(message("release_metadata_snap")).await;
        let out = out?;
        released?;
        Ok(out.stdout)
    }

    pub(super) async fn thin_allocated(
        &self,
        id: &SnapshotId,
        start: u64,
        max: usize,
    ) -> Result<BlockPage> {
        let (class, _, thin_id, size) = self.thin_snapshot(id).await?;
        let xml = self
            .with_metadata_snapshot(
                &class,
                Command::new("thin_dump")
                    .timeout(LVM_TIMEOUT)
                    .args(["--dev-id", &thin_id.to_string()]),
            )
            .await?;
        let (chunk, chunks) = mapped_chunks(&xml)?;
        Ok(page(chunk, &chunks, size, start, max))
    }

    pub(super) async fn thin_changed(
        &self,
        base: &SnapshotId,
        target: &SnapshotId,
        start: u64,
        max: usize,
    ) -> Result<BlockPage> {
        let (class, base_origin, base_id, _) = self.thin_snapshot(base).await?;
        let (target_class, target_origin, target_id, size) = self.thin_snapshot(target).await?;
        if class.name != target_class.name || base_origin != target_origin {
            return Err(Error::invalid(format!(
                "snapshots {base} and {target} are not of one volume"
            )));
        }
        let xml = self
            .with_metadata_snapshot(
                &class,
                Command::new("thin_delta").timeout(LVM_TIMEOUT).args([
                    "--snap1",
                    &base_id.to_string(),
                    "--snap2",
                    &target_id.to_string(),
                ]),
            )
            .await?;
        let (chunk, chunks) = differing_chunks(&xml)?;
        Ok(page(chunk, &chunks, size, start, max))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DUMP: &str = r#"<superblock uuid="" time="2" transaction="3" version="2" data_block_size="128" nr_data_blocks="1536">
  <device dev_id="4" mapped_blocks="5" transaction="2" creation_time="1" snap_time="2">
    <range_mapping origin_begin="0" data_begin="10" length="2" time="0"/>
    <single_mapping origin_block="2" data_block="40" time="1"/>
    <single_mapping origin_block="9" data_block="41" time="1"/>
  </device>
</superblock>"#;

    const DELTA: &str = r#"<superblock uuid="" time="2" transaction="3" data_block_size="128" nr_data_blocks="1536">
  <diff left="3" right="4">
    <same begin="0" length="2"/>
    <different begin="2" length="1"/>
    <same begin="3" length="6"/>
    <right_only begin="9" length="1"/>
    <left_only begin="20" length="2"/>
  </diff>
</superblock>"#;

    #[test]
    fn the_thin_tools_reports_read_as_chunks_then_bytes() {
        let chunk = 128 * 512;
        let (c, mapped) = mapped_chunks(DUMP).unwrap();
        assert_eq!(c, chunk);
        assert_eq!(mapped, vec![(0, 3), (9, 1)]);
        let (_, changed) = differing_chunks(DELTA).unwrap();
        assert_eq!(changed, vec![(2, 1), (9, 1), (20, 2)]);

        let size = 16 * chunk;
        let all = page(chunk, &changed, size, 0, 10);
        // Chunk 20-21 lies past the volume's end: left out.
        assert_eq!(all.ranges, vec![(2 * chunk, chunk), (9 * chunk, chunk)]);
        assert_eq!(all.next, None);
        let first = page(chunk, &changed, size, 0, 1);
        assert_eq!(first.ranges, vec![(2 * chunk, chunk)]);
        assert_eq!(first.next, Some(9 * chunk));
        let rest = page(chunk, &changed, size, 9 * chunk, 1);
        assert_eq!(rest.ranges, vec![(9 * chunk, chunk)]);
        assert_eq!(rest.next, None);
        // A start inside a range rounds down to its chunk.
        let inside = page(chunk, &[(0, 3)], size, chunk + 5, 10);
        assert_eq!(inside.ranges, vec![(chunk, 2 * chunk)]);
        assert!(mapped_chunks("<nothing/>").is_err());
        assert_eq!(dm_part("my-vg"), "my--vg");
    }
}
