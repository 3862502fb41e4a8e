//! I/O limits per volume, enforced where a pod's I/O happens: a line of
//! the cgroup v2 `io.max` of the pod's cgroup, for the device the pod's
//! I/O goes to (its major:minor). The kernel throttles every bio a
//! process of that cgroup submits to the device, and the writeback of the
//! pages it dirtied (cgroup writeback charges them to it); each pod that
//! uses a volume is limited on its own.
//!
//! A pod's cgroup is found from its UID as kubelet lays it out, with
//! either cgroup driver and in every QoS class:
//!
//! | driver | Guaranteed | Burstable, BestEffort |
//! | --- | --- | --- |
//! | systemd | `kubepods.slice/kubepods-pod<uid_>.slice` | `kubepods.slice/kubepods-<class>.slice/kubepods-<class>-pod<uid_>.slice` |
//! | cgroupfs | `kubepods/pod<uid>` | `kubepods/<class>/pod<uid>` |
//!
//! (`<uid_>`: the UID with its dashes as underscores, as systemd names
//! units.)

use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The parameters that limit a volume's I/O (a StorageClass's, a
/// VolumeAttributesClass's): operations per second...
pub const READ_IOPS: &str = "readIops";
pub const WRITE_IOPS: &str = "writeIops";
/// ...and bytes per second (a plain number, or one with a unit: k, M, G,
/// T for powers of 1000; Ki, Mi, Gi, Ti for powers of 1024).
pub const READ_BPS: &str = "readBps";
pub const WRITE_BPS: &str = "writeBps";

/// Every limit key.
pub const KEYS: [&str; 4] = [READ_IOPS, WRITE_IOPS, READ_BPS, WRITE_BPS];

/// The volume context key kubelet gives a publish the pod's UID in (the
/// CSIDriver's `podInfoOnMount`).
pub const POD_UID_KEY: &str = "csi.storage.k8s.io/pod.uid";

/// The volume context keys the limits travel to the node in (bytes as
/// plain numbers).
const CONTEXT_PREFIX: &str = "ioLimit.";

/// A volume's I/O limits; `None`: that one is not limited.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Limits {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub read_iops: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub write_iops: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub read_bps: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub write_bps: Option<u64>,
}

/// A count with its unit, if any: a positive integer, at most 2^63.
fn quantity(key: &str, value: &str, units: bool) -> Result<u64> {
    let bad = |why: &str| {
        Error::invalid(format!(
            "parameter {key}: {value:?} is not {why}{}",
            if units {
                " (a positive number of bytes per second, with k, M, G, T, Ki, Mi, Gi or Ti if \
                 you like; or max, no limit)"
            } else {
                " (a positive whole number of operations per second; or max, no limit)"
            }
        ))
    };
    let digits = value.bytes().take_while(u8::is_ascii_digit).count();
    let (number, unit) = value.split_at(digits);
    let scale: u64 = match (unit, units) {
        ("", _) => 1,
        ("k", true) => 1_000,
        ("M", true) => 1_000_000,
        ("G", true) => 1_000_000_000,
        ("T", true) => 1_000_000_000_000,
        ("Ki", true) => 1 << 10,
        ("Mi", true) => 1 << 20,
        ("Gi", true) => 1 << 30,
        ("Ti", true) => 1 << 40,
        _ => return Err(bad("a number")),
    };
    let n: u64 = number.parse().map_err(|_| bad("a number"))?;
    match n.checked_mul(scale) {
        Some(0) => Err(bad("above zero")),
        Some(v) if v <= 1 << 63 => Ok(v),
        _ => Err(bad("small enough")),
    }
}

/// The value that lifts a limit (as `io.max` writes it).
pub const NO_LIMIT: &str = "max";

/// A limit's value: a quantity, or [`NO_LIMIT`] (`None`).
fn limit_value(key: &str, value: &str) -> Result<Option<u64>> {
    let value = value.trim();
    if value == NO_LIMIT {
        return Ok(None);
    }
    quantity(key, value, matches!(key, READ_BPS | WRITE_BPS)).map(Some)
}

/// A change to a volume's limits (a ControllerModifyVolume's): for each
/// key it names, the new value (`None`: the limit lifted); a key it does
/// not name keeps its value.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LimitChanges(pub BTreeMap<String, Option<u64>>);

impl LimitChanges {
    /// The changes `params` make (the four keys; others are not looked
    /// at), each checked: INVALID_ARGUMENT naming the key.
    pub fn parse(params: &BTreeMap<String, String>) -> Result<LimitChanges> {
        let mut changes = BTreeMap::new();
        for key in KEYS {
            if let Some(v) = params.get(key) {
                changes.insert(key.to_string(), limit_value(key, v)?);
            }
        }
        Ok(LimitChanges(changes))
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// These changes, then `later` over them.
    pub fn then(&self, later: &LimitChanges) -> LimitChanges {
        let mut all = self.0.clone();
        all.extend(later.0.clone());
        LimitChanges(all)
    }
}

impl Limits {
    /// The limits `params` set (the four keys; others are not looked
    /// at), each checked: INVALID_ARGUMENT naming the key. [`NO_LIMIT`]
    /// sets none.
    pub fn parse(params: &BTreeMap<String, String>) -> Result<Limits> {
        Ok(Limits::default().changed(&LimitChanges::parse(params)?))
    }

    /// These limits with `changes` made.
    pub fn changed(&self, changes: &LimitChanges) -> Limits {
        let mut out = *self;
        for (key, value) in &changes.0 {
            let slot = match key.as_str() {
                READ_IOPS => &mut out.read_iops,
                WRITE_IOPS => &mut out.write_iops,
                READ_BPS => &mut out.read_bps,
                WRITE_BPS => &mut out.write_bps,
                _ => continue,
            };
            *slot = *value;
        }
        out
    }

    pub fn is_empty(&self) -> bool {
        *self == Limits::default()
    }

    /// Each limit by its key, unset ones `None`.
    pub fn pairs(&self) -> [(&'static str, Option<u64>); 4] {
        [
            (READ_IOPS, self.read_iops),
            (WRITE_IOPS, self.write_iops),
            (READ_BPS, self.read_bps),
            (WRITE_BPS, self.write_bps),
        ]
    }

    /// Written into a volume context (what reaches the node).
    pub fn to_context(&self, context: &mut BTreeMap<String, String>) {
        for (key, value) in self.pairs() {
            if let Some(v) = value {
                context.insert(format!("{CONTEXT_PREFIX}{key}"), v.to_string());
            }
        }
    }

    /// Read from a volume context; keys of another form are
    /// INVALID_ARGUMENT (a context is the controller's: a bad one was
    /// altered on its way).
    pub fn from_context<'a>(
        context: impl IntoIterator<Item = (&'a String, &'a String)>,
    ) -> Result<Limits> {
        let own: BTreeMap<String, String> = context
            .into_iter()
            .filter_map(|(k, v)| {
                k.strip_prefix(CONTEXT_PREFIX)
                    .map(|k| (k.to_string(), v.clone()))
            })
            .collect();
        if let Some(k) = own.keys().find(|k| !KEYS.contains(&k.as_str())) {
            return Err(Error::invalid(format!(
                "volume context key {CONTEXT_PREFIX}{k} is no I/O limit"
            )));
        }
        Limits::parse(&own)
    }

    /// The `io.max` line that sets these limits on device `dev` (every
    /// one not limited as `max`: the kernel drops a line all `max`).
    pub fn io_max_line(&self, dev: Dev) -> String {
        let v = |x: Option<u64>| x.map_or("max".to_string(), |n| n.to_string());
        format!(
            "{}:{} rbps={} wbps={} riops={} wiops={}",
            dev.0,
            dev.1,
            v(self.read_bps),
            v(self.write_bps),
            v(self.read_iops),
            v(self.write_iops)
        )
    }

    /// The limits an `io.max` file sets on device `dev` (none when it has
    /// no line for it).
    pub fn from_io_max(text: &str, dev: Dev) -> Limits {
        let want = format!("{}:{}", dev.0, dev.1);
        let mut limits = Limits::default();
        for line in text.lines() {
            let mut fields = line.split_whitespace();
            if fields.next() != Some(want.as_str()) {
                continue;
            }
            for f in fields {
                let Some((k, v)) = f.split_once('=') else {
                    continue;
                };
                let v = v.parse().ok();
                match k {
                    "rbps" => limits.read_bps = v,
                    "wbps" => limits.write_bps = v,
                    "riops" => limits.read_iops = v,
                    "wiops" => limits.write_iops = v,
                    _ => {}
                }
            }
        }
        limits
    }
}

/// A block device's number (major, minor).
pub type Dev = (u64, u64);

/// The number of the block device at `path` (following links).
pub fn device_number(path: &Path) -> Result<Dev> {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let m =
        std::fs::metadata(path).map_err(|e| Error::io(format!("stat {}", path.display()), e))?;
    if !m.file_type().is_block_device() {
        return Err(Error::internal(format!(
            "{} is not a block device",
            path.display()
        )));
    }
    let rdev = m.rdev();
    Ok((
        nix::sys::stat::major(rdev) as u64,
        nix::sys::stat::minor(rdev) as u64,
    ))
}

/// A pod UID as kubelet writes it: a UUID (or, for a static pod, 32 hex
/// digits); INVALID_ARGUMENT otherwise (it becomes a path).
pub fn check_pod_uid(uid: &str) -> Result<()> {
    let hex = uid.bytes().filter(u8::is_ascii_hexdigit).count();
    let dashes = uid.bytes().filter(|b| *b == b'-').count();
    let shaped = match uid.len() {
        36 => dashes == 4 && [8, 13, 18, 23].iter().all(|&i| uid.as_bytes()[i] == b'-'),
        32 => dashes == 0,
        _ => false,
    };
    if shaped && hex + dashes == uid.len() {
        Ok(())
    } else {
        Err(Error::invalid(format!("pod UID {uid:?} is not a UID")))
    }
}

/// The cgroup v2 tree kubelet makes its pods' cgroups in.
#[derive(Debug, Clone)]
pub struct Cgroups {
    root: PathBuf,
}

impl Default for Cgroups {
    fn default() -> Self {
        Cgroups::new("/sys/fs/cgroup".into())
    }
}

impl Cgroups {
    pub fn new(root: PathBuf) -> Self {
        Cgroups { root }
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Where pod `uid`'s cgroup may be, each driver's and QoS class's
    /// place.
    fn candidates(&self, uid: &str) -> Vec<PathBuf> {
        let unit = uid.replace('-', "_");
        let slice = self.root.join("kubepods.slice");
        let fs = self.root.join("kubepods");
        let mut all = vec![slice.join(format!("kubepods-pod{unit}.slice"))];
        for class in ["burstable", "besteffort"] {
            all.push(
                slice
                    .join(format!("kubepods-{class}.slice"))
                    .join(format!("kubepods-{class}-pod{unit}.slice")),
            );
        }
        all.push(fs.join(format!("pod{uid}")));
        for class in ["burstable", "besteffort"] {
            all.push(fs.join(class).join(format!("pod{uid}")));
        }
        all
    }

    /// Pod `uid`'s cgroup, if it has one here.
    pub fn pod(&self, uid: &str) -> Result<Option<PathBuf>> {
        check_pod_uid(uid)?;
        Ok(self
            .candidates(uid)
            .into_iter()
            .find(|p| p.join("io.max").is_file()))
    }

    /// Sets `limits` on device `dev` for the processes of `cgroup` (all
    /// unlimited: its line removed).
    pub fn set(&self, cgroup: &Path, dev: Dev, limits: &Limits) -> Result<()> {
        let file = cgroup.join("io.max");
        std::fs::write(&file, limits.io_max_line(dev))
            .map_err(|e| Error::io(format!("write {}", file.display()), e))
    }

    /// What `cgroup` did on device `dev` since it was made (its `io.stat`
    /// line: `rbytes`, `wbytes`, `rios`, `wios`), if the kernel counted
    /// any.
    pub fn usage(&self, cgroup: &Path, dev: Dev) -> Vec<(String, u64)> {
        let Ok(text) = std::fs::read_to_string(cgroup.join("io.stat")) else {
            return Vec::new();
        };
        let want = format!("{}:{}", dev.0, dev.1);
        let Some(line) = text
            .lines()
            .find(|l| l.split_whitespace().next() == Some(want.as_str()))
        else {
            return Vec::new();
        };
        line.split_whitespace()
            .skip(1)
            .filter_map(|f| f.split_once('='))
            .filter(|(k, _)| ["rbytes", "wbytes", "rios", "wios"].contains(k))
            .filter_map(|(k, v)| Some((k.to_string(), v.parse().ok()?)))
            .collect()
    }

    /// How long `cgroup`'s tasks were stalled on I/O since it was made, on
    /// any device (its `io.pressure` totals: `some`, at least one task;
    /// `full`, all of them), in seconds. A pod held back by its `io.max`
    /// waits there; `io.stat` keeps no throttled time. Nothing when the
    /// kernel keeps no pressure (`psi=0`, or built without it).
    pub fn stalled(&self, cgroup: &Path) -> Vec<(String, f64)> {
        let Ok(text) = std::fs::read_to_string(cgroup.join("io.pressure")) else {
            return Vec::new();
        };
        text.lines()
            .filter_map(|l| {
                let mut fields = l.split_whitespace();
                let kind = fields.next().filter(|k| ["some", "full"].contains(k))?;
                let total = fields.find_map(|f| f.strip_prefix("total="))?;
                let us: u64 = total.parse().ok()?;
                Some((kind.to_string(), us as f64 / 1e6))
            })
            .collect()
    }

    /// The limits `cgroup` has on device `dev` now.
    pub fn get(&self, cgroup: &Path, dev: Dev) -> Result<Limits> {
        let file = cgroup.join("io.max");
        let text = std::fs::read_to_string(&file)
            .map_err(|e| Error::io(format!("read {}", file.display()), e))?;
        Ok(Limits::from_io_max(&text, dev))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn limits_are_read_with_their_units_and_refused_naming_the_key() {
        let l = Limits::parse(&params(&[
            ("readIops", "500"),
            ("writeBps", "10Mi"),
            ("readBps", "2M"),
            ("other", "x"),
        ]))
        .unwrap();
        assert_eq!(
            l,
            Limits {
                read_iops: Some(500),
                write_iops: None,
                read_bps: Some(2_000_000),
                write_bps: Some(10 << 20),
            }
        );
        assert!(Limits::parse(&params(&[])).unwrap().is_empty());
        for (key, value) in [
            ("readIops", "0"),
            ("writeIops", "10k"),
            ("readIops", "-1"),
            ("readIops", "1.5"),
            ("writeBps", "10MB"),
            ("writeBps", "Mi"),
            ("readBps", "99999999999Ti"),
            ("readBps", ""),
        ] {
            let e = Limits::parse(&params(&[(key, value)])).unwrap_err();
            assert_eq!(e.kind, crate::error::Kind::InvalidArgument, "{key}={value}");
            assert!(e.message.contains(key), "{e}");
        }
    }

    #[test]
    fn a_change_keeps_what_it_does_not_name_and_max_lifts_a_limit() {
        let class = Limits::parse(&params(&[("readIops", "50"), ("writeIops", "40")])).unwrap();
        let first =
            LimitChanges::parse(&params(&[("writeIops", "100"), ("readBps", "1Mi")])).unwrap();
        let second = LimitChanges::parse(&params(&[("readIops", "max"), ("x", "y")])).unwrap();
        assert_eq!(second.0.len(), 1);
        let now = class.changed(&first.then(&second));
        assert_eq!(
            now,
            Limits {
                read_iops: None,
                write_iops: Some(100),
                read_bps: Some(1 << 20),
                write_bps: None,
            }
        );
        // The changes in order, one at a time, come to the same.
        assert_eq!(class.changed(&first).changed(&second), now);
        // max in a class is no limit; a bad value names its key.
        assert!(Limits::parse(&params(&[("writeBps", " max ")]))
            .unwrap()
            .is_empty());
        let e = LimitChanges::parse(&params(&[("writeBps", "maximum")])).unwrap_err();
        assert!(
            e.message.contains("writeBps") && e.message.contains("or max"),
            "{e}"
        );
        assert!(LimitChanges::parse(&params(&[])).unwrap().is_empty());
    }

    #[test]
    fn limits_travel_in_a_volume_context_and_become_an_io_max_line() {
        let l = Limits {
            read_iops: Some(100),
            write_bps: Some(1 << 20),
            ..Default::default()
        };
        let mut ctx = params(&[("encrypted", "luks2")]);
        l.to_context(&mut ctx);
        assert_eq!(ctx["ioLimit.readIops"], "100");
        assert_eq!(ctx["ioLimit.writeBps"], "1048576");
        assert_eq!(Limits::from_context(&ctx).unwrap(), l);
        ctx.insert("ioLimit.bogus".into(), "1".into());
        assert!(Limits::from_context(&ctx).is_err());
        let line = l.io_max_line((7, 3));
        assert_eq!(line, "7:3 rbps=max wbps=1048576 riops=100 wiops=max");
        let text = format!("8:0 rbps=1 wbps=max riops=max wiops=max\n{line}\n");
        assert_eq!(Limits::from_io_max(&text, (7, 3)), l);
        assert!(Limits::from_io_max(&text, (7, 4)).is_empty());
    }

    #[test]
    fn a_pod_s_stall_is_read_from_io_pressure_in_seconds() {
        let root = tempfile::tempdir().unwrap();
        let cgroups = Cgroups::new(root.path().into());
        assert!(cgroups.stalled(root.path()).is_empty());
        std::fs::write(
            root.path().join("io.pressure"),
            "some avg10=97.50 avg60=40.10 avg300=9.00 total=3900000\n\
             full avg10=97.50 avg60=40.10 avg300=9.00 total=3850000\n",
        )
        .unwrap();
        assert_eq!(
            cgroups.stalled(root.path()),
            vec![("some".to_string(), 3.9), ("full".to_string(), 3.85)]
        );
    }

    #[test]
    fn a_pod_s_io_on_a_device_is_read_from_io_stat() {
        let root = tempfile::tempdir().unwrap();
        std::fs::write(
            root.path().join("io.stat"),
            "8:0 rbytes=1 wbytes=2 rios=3 wios=4 dbytes=0 dios=0\n\
             7:3 rbytes=10 wbytes=20 rios=30 wios=40 dbytes=5 dios=1\n",
        )
        .unwrap();
        let cgroups = Cgroups::new(root.path().into());
        let usage = cgroups.usage(root.path(), (7, 3));
        let want: Vec<(String, u64)> = [("rbytes", 10), ("wbytes", 20), ("rios", 30), ("wios", 40)]
            .map(|(k, v)| (k.to_string(), v))
            .to_vec();
        assert_eq!(usage, want);
        assert!(cgroups.usage(root.path(), (7, 4)).is_empty());
        assert!(cgroups.usage(&root.path().join("gone"), (7, 3)).is_empty());
    }

    #[test]
    fn a_pod_s_cgroup_is_found_under_either_driver_in_every_qos_class() {
        let uid = "0f6e3a8c-1b2d-4c5e-8f90-a1b2c3d4e5f6";
        let unit = "0f6e3a8c_1b2d_4c5e_8f90_a1b2c3d4e5f6";
        for place in [
            format!("kubepods.slice/kubepods-pod{unit}.slice"),
            format!("kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{unit}.slice"),
            format!("kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{unit}.slice"),
            format!("kubepods/pod{uid}"),
            format!("kubepods/burstable/pod{uid}"),
            format!("kubepods/besteffort/pod{uid}"),
        ] {
            let root = tempfile::tempdir().unwrap();
            let cgroups = Cgroups::new(root.path().into());
            assert_eq!(cgroups.pod(uid).unwrap(), None);
            let dir = root.path().join(&place);
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(dir.join("io.max"), "").unwrap();
            assert_eq!(cgroups.pod(uid).unwrap(), Some(dir), "{place}");
        }
        let cgroups = Cgroups::default();
        for bad in [
            "../../etc",
            "0f6e3a8c-1b2d-4c5e-8f90-a1b2c3d4e5f/",
            "",
            "x".repeat(36).as_str(),
        ] {
            assert!(cgroups.pod(bad).is_err(), "{bad:?}");
        }
        check_pod_uid("0123456789abcdef0123456789abcdef").unwrap();
    }
}
