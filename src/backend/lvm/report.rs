//! lvm's JSON reports (`lvs`/`vgs --reportformat json`), parsed into typed
//! rows; the attributes and tags ferrovol reads from them.

use super::reasons;
use crate::error::{Error, Result};
use crate::plugin::health::Finding;
use serde::Deserialize;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

#[derive(Debug, Deserialize)]
struct Report<T> {
    report: Vec<T>,
}

#[derive(Debug, Deserialize)]
struct LvSection {
    #[serde(default)]
    lv: Vec<Lv>,
}

#[derive(Debug, Deserialize)]
struct VgSection {
    #[serde(default)]
    vg: Vec<Vg>,
}

/// One row of `lvs`.
#[derive(Debug, Clone, Default, Deserialize, PartialEq, Eq)]
pub struct Lv {
    pub lv_name: String,
    pub vg_name: String,
    pub lv_size: String,
    #[serde(default)]
    pub lv_tags: String,
    #[serde(default)]
    pub lv_attr: String,
    #[serde(default)]
    pub origin: String,
    #[serde(default)]
    pub pool_lv: String,
    #[serde(default)]
    pub lv_time: String,
    #[serde(default)]
    pub data_percent: String,
    #[serde(default)]
    pub metadata_percent: String,
    /// A thin LV's device id in its pool (read only where asked for).
    #[serde(default)]
    pub thin_id: String,
    /// A thin pool's transaction id in the metadata (read only where
    /// asked for).
    #[serde(default)]
    pub transaction_id: String,
}

impl Lv {
    pub(super) fn size(&self) -> u64 {
        self.lv_size.trim().parse().unwrap_or(0)
    }
    pub(super) fn tags(&self) -> impl Iterator<Item = &str> {
        self.lv_tags
            .split(',')
            .map(str::trim)
            .filter(|t| !t.is_empty())
    }
    pub(super) fn has_tag(&self, tag: &str) -> bool {
        self.tags().any(|t| t == tag)
    }
    pub(super) fn tag_value(&self, prefix: &str) -> Option<&str> {
        self.tags().find_map(|t| t.strip_prefix(prefix))
    }
    /// Known to be inactive: the fifth attribute character is `-` (not
    /// active, suspended, unknown `X`, or a device left without tables).
    pub(super) fn inactive(&self) -> bool {
        self.lv_attr.chars().nth(4) == Some('-')
    }
    /// A plain LV (the first attribute character `-`): not a snapshot, a
    /// thin volume or a pool.
    pub(super) fn plain(&self) -> bool {
        self.lv_attr.starts_with('-')
    }
    /// The first: `o` for the origin of classic (thick) snapshots.
    pub(super) fn snapshot_origin(&self) -> bool {
        self.lv_attr.starts_with('o')
    }
    /// The sixth: `o` when open (mounted or in use).
    pub(super) fn open(&self) -> bool {
        self.lv_attr.chars().nth(5) == Some('o')
    }
    /// The eighth, on a thin pool: `z` when newly provisioned chunks are
    /// zeroed before use.
    pub(super) fn zeroes_new_chunks(&self) -> bool {
        self.lv_attr.chars().nth(7) == Some('z')
    }
    /// The problem the attributes show, if any.
    pub(super) fn problem(&self) -> Option<Finding> {
        let a: Vec<char> = self.lv_attr.chars().collect();
        Some(match (a.get(4), a.get(8)) {
            (Some('I'), _) => Finding::data_loss(reasons::SnapshotInvalid, "snapshot is invalid"),
            (Some(s), _) if *s != 'a' => Finding::inaccessible(
                reasons::LogicalVolumeInactive,
                format!("LV is not active (attr {})", self.lv_attr),
            ),
            (_, Some('p')) => Finding::degraded(
                reasons::LogicalVolumePartial,
                "LV is partial: a physical volume is missing",
            ),
            (_, Some('r')) => {
                Finding::degraded(reasons::LogicalVolumeUnsettled, "LV needs a refresh")
            }
            (_, Some('m')) => {
                Finding::degraded(reasons::LogicalVolumeUnsettled, "LV has mismatches")
            }
            (_, Some('X')) => {
                Finding::degraded(reasons::LogicalVolumeUnsettled, "LV state is unknown")
            }
            _ => return None,
        })
    }
    /// A thin pool with no room left for new chunks: its data or its
    /// metadata at 100%.
    pub(super) fn pool_full(&self) -> bool {
        let pct = |s: &str| s.trim().parse::<f64>().unwrap_or(0.0);
        pct(&self.data_percent) >= 100.0 || pct(&self.metadata_percent) >= 100.0
    }
    /// Creation time: a snapshot's time tag, else `lv_time`
    /// (`2026-11-22 00:26:21 +0000`).
    pub(super) fn created(&self) -> SystemTime {
        self.tag_value(super::TIME_TAG)
            .and_then(|s| s.parse().ok())
            .map(|secs| UNIX_EPOCH + Duration::from_secs(secs))
            .or_else(|| parse_lv_time(&self.lv_time))
            .unwrap_or(UNIX_EPOCH)
    }
}

/// One row of `vgs`.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
pub struct Vg {
    pub vg_name: String,
    pub vg_size: String,
    pub vg_free: String,
    pub vg_extent_size: String,
}

impl Vg {
    pub(super) fn size(&self) -> u64 {
        self.vg_size.trim().parse().unwrap_or(0)
    }
    pub(super) fn free(&self) -> u64 {
        self.vg_free.trim().parse().unwrap_or(0)
    }
    pub(super) fn extent(&self) -> u64 {
        self.vg_extent_size
            .trim()
            .parse()
            .unwrap_or(4 << 20)
            .max(512)
    }
}

/// The LV fields every `lvs` reads (an [`Lv`]'s).
pub const LV_FIELDS: &str =
    "lv_name,vg_name,lv_size,lv_tags,lv_attr,origin,pool_lv,lv_time,data_percent,metadata_percent";
/// The group fields `vgs` reads (a [`Vg`]'s).
pub const VG_FIELDS: &str = "vg_name,vg_size,vg_free,vg_extent_size";
/// The group's figures an `lvs` row can carry beside [`LV_FIELDS`] (which
/// name the group already).
pub const VG_FIGURES: &str = "vg_size,vg_free,vg_extent_size";

/// Parses an `lvs` JSON report whose rows carry [`VG_FIGURES`] too: each
/// LV with its group (None where the row lacks the group's fields).
pub fn parse_lv_rows(json: &str) -> Result<Vec<(Lv, Option<Vg>)>> {
    let r: Report<RowSection> = serde_json::from_str(json)
        .map_err(|e| Error::internal(format!("unreadable lvs report: {e}")))?;
    r.report
        .into_iter()
        .flat_map(|s| s.lv)
        .map(|row| {
            let lv: Lv = serde_json::from_value(row.clone())
                .map_err(|e| Error::internal(format!("unreadable lvs row: {e}")))?;
            Ok((lv, serde_json::from_value(row).ok()))
        })
        .collect()
}

#[derive(Debug, Deserialize)]
struct RowSection {
    #[serde(default)]
    lv: Vec<serde_json::Value>,
}

/// Parses an `lvs` JSON report.
pub fn parse_lvs(json: &str) -> Result<Vec<Lv>> {
    let r: Report<LvSection> = serde_json::from_str(json)
        .map_err(|e| Error::internal(format!("unreadable lvs report: {e}")))?;
    Ok(r.report.into_iter().flat_map(|s| s.lv).collect())
}

/// Parses a `vgs` JSON report.
pub fn parse_vgs(json: &str) -> Result<Vec<Vg>> {
    let r: Report<VgSection> = serde_json::from_str(json)
        .map_err(|e| Error::internal(format!("unreadable vgs report: {e}")))?;
    Ok(r.report.into_iter().flat_map(|s| s.vg).collect())
}

pub(super) fn parse_lv_time(text: &str) -> Option<SystemTime> {
    // "YYYY-MM-DD HH:MM:SS +ZZZZ"
    let mut parts = text.split_whitespace();
    let date = parts.next()?;
    let time = parts.next()?;
    let zone = parts.next().unwrap_or("+0000");
    let d: Vec<i64> = date
        .split('-')
        .map(|x| x.parse().ok())
        .collect::<Option<_>>()?;
    let t: Vec<i64> = time
        .split(':')
        .map(|x| x.parse().ok())
        .collect::<Option<_>>()?;
    if d.len() != 3 || t.len() != 3 || zone.len() != 5 {
        return None;
    }
    let (y, m, day) = (d[0], d[1], d[2]);
    // Days from civil (Howard Hinnant's algorithm).
    let y2 = if m <= 2 { y - 1 } else { y };
    let era = y2.div_euclid(400);
    let yoe = y2 - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146097 + doe - 719468;
    let sign = if zone.starts_with('-') { -1 } else { 1 };
    let zh: i64 = zone[1..3].parse().ok()?;
    let zm: i64 = zone[3..5].parse().ok()?;
    let secs = days * 86400 + t[0] * 3600 + t[1] * 60 + t[2] - sign * (zh * 3600 + zm * 60);
    (secs >= 0).then(|| UNIX_EPOCH + Duration::from_secs(secs as u64))
}
