//! How many more devices of each kind the node's kernel can hold, for
//! NodeGetInfo's `max_volumes_per_node` (KEP-4876: a count the kubelet
//! reads again every `nodeAllocatableUpdatePeriodSeconds`).
//!
//! Each kind has a ceiling set by the kernel (the minor numbers its driver
//! can hand out, or the block majors left) and a share of it held by others
//! (devices of that kind attached by anything but a staged ferrovol
//! volume). What is left is the room ferrovol's volumes have on this node,
//! counting the ones attached now. Everything is read from sysfs and
//! `/proc/devices` at call time: nothing is cached, so the answer moves as
//! the node's devices do.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

/// The kinds of device a backend attaches on the node, one per volume.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DeviceKind {
    /// A loop device over an image file.
    Loop,
    /// A mapped rbd image.
    Rbd,
    /// An iSCSI LUN: a session of its own (its own SCSI host) and a disk.
    Iscsi,
}

/// Minor-number bits of a block device (`MINORBITS`).
const MINOR_BITS: u32 = 20;
/// rbd's minors per device with `single_major` (`RBD_SINGLE_MAJOR_PART_SHIFT`).
const RBD_PART_SHIFT: u32 = 4;
/// Dynamic block majors are picked from 254 down to 1, one per slot of the
/// kernel's major table (255 slots, hashed by major).
const MAJOR_SLOTS: u32 = 255;

/// The kernel's device tables, rooted at `/sys` and `/proc` (tests use a
/// fixture tree).
#[derive(Debug, Clone)]
pub struct DeviceTables {
    sys: PathBuf,
    proc_devices: PathBuf,
}

impl Default for DeviceTables {
    fn default() -> Self {
        Self::at(Path::new("/sys"), Path::new("/proc/devices"))
    }
}

impl DeviceTables {
    pub fn at(sys: &Path, proc_devices: &Path) -> Self {
        Self {
            sys: sys.to_path_buf(),
            proc_devices: proc_devices.to_path_buf(),
        }
    }

    /// How many devices of `kind` ferrovol can have attached at once on
    /// this node: the kernel's ceiling less what others hold (`ours` names
    /// the devices of staged volumes, as `/dev` names them: `loop3`,
    /// `rbd0`). `None`: the kernel sets no ceiling worth reporting.
    pub fn room(&self, kind: DeviceKind, ours: &HashSet<String>) -> Option<u64> {
        let (ceiling, attached) = match kind {
            DeviceKind::Loop => (self.loop_ceiling(), self.attached_loops()),
            DeviceKind::Rbd => {
                let mapped = self.mapped_rbd();
                (self.rbd_ceiling(mapped.len() as u64), mapped)
            }
            // One session and one SCSI host per volume, LUN 1: the kernel
            // numbers sessions, hosts and disks without a ceiling.
            DeviceKind::Iscsi => return None,
        };
        let others = attached.iter().filter(|d| !ours.contains(*d)).count() as u64;
        Some(ceiling.saturating_sub(others))
    }

    fn param(&self, module: &str, name: &str) -> Option<String> {
        let path = self
            .sys
            .join("module")
            .join(module)
            .join("parameters")
            .join(name);
        std::fs::read_to_string(path)
            .ok()
            .map(|s| s.trim().to_string())
    }

    /// Loop devices are numbered within the minors left after each takes
    /// `2^part_shift` of them for partitions (`max_part`, rounded up to a
    /// power of two): 1,048,576 with none.
    fn loop_ceiling(&self) -> u64 {
        let max_part: u32 = self
            .param("loop", "max_part")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        let part_shift = match max_part {
            0 => 0,
            p => u32::BITS - p.leading_zeros(),
        };
        1u64 << MINOR_BITS.saturating_sub(part_shift)
    }

    /// Loop devices bound to a file now.
    fn attached_loops(&self) -> Vec<String> {
        names(&self.sys.join("block"), |name, path| {
            name.starts_with("loop") && path.join("loop/backing_file").exists()
        })
    }

    /// rbd images mapped now, as their devices are named.
    fn mapped_rbd(&self) -> Vec<String> {
        names(&self.sys.join("bus/rbd/devices"), |_, _| true)
            .into_iter()
            .map(|id| format!("rbd{id}"))
            .collect()
    }

    /// With `single_major` (the default, and what a module not loaded yet
    /// will get) rbd numbers devices within its one major: 65,536. Without
    /// it each device takes a dynamic block major of its own: those free
    /// now, and those its mapped devices hold.
    fn rbd_ceiling(&self, mapped: u64) -> u64 {
        match self.param("rbd", "single_major").as_deref() {
            Some("N" | "n" | "0") => self.free_dynamic_majors() + mapped,
            _ => 1u64 << (MINOR_BITS - RBD_PART_SHIFT),
        }
    }

    /// Slots of the kernel's block major table a dynamic major can still
    /// take (none of the registered majors hashes there).
    fn free_dynamic_majors(&self) -> u64 {
        let text = std::fs::read_to_string(&self.proc_devices).unwrap_or_default();
        let taken: HashSet<u32> = text
            .split("Block devices:")
            .nth(1)
            .unwrap_or("")
            .lines()
            .filter_map(|l| l.split_whitespace().next()?.parse::<u32>().ok())
            .map(|major| major % MAJOR_SLOTS)
            .collect();
        (1..MAJOR_SLOTS)
            .filter(|slot| !taken.contains(slot))
            .count() as u64
    }
}

/// The entries of `dir` that `keep` accepts; none when it is missing.
fn names(dir: &Path, keep: impl Fn(&str, &Path) -> bool) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            keep(&name, &e.path()).then_some(name)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Fixture {
        dir: tempfile::TempDir,
    }

    impl Fixture {
        fn new() -> Self {
            Self {
                dir: tempfile::tempdir().unwrap(),
            }
        }
        fn sys(&self) -> PathBuf {
            self.dir.path().join("sys")
        }
        fn write(&self, rel: &str, text: &str) {
            let p = self.sys().join(rel);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, text).unwrap();
        }
        fn loop_device(&self, n: u32, backing: Option<&str>) {
            let dir = self.sys().join(format!("block/loop{n}"));
            std::fs::create_dir_all(&dir).unwrap();
            if let Some(b) = backing {
                self.write(&format!("block/loop{n}/loop/backing_file"), b);
            }
        }
        fn tables(&self) -> DeviceTables {
            DeviceTables::at(&self.sys(), &self.dir.path().join("devices"))
        }
    }

    fn set(names: &[&str]) -> HashSet<String> {
        names.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn loop_room_is_the_minor_space_less_the_loops_others_hold() {
        let f = Fixture::new();
        f.write("module/loop/parameters/max_part", "0\n");
        f.loop_device(0, Some("/var/lib/snapd/snaps/core.snap\n"));
        f.loop_device(1, Some("/pool/a.img\n"));
        f.loop_device(2, None); // made, not bound: nobody's
        let t = f.tables();
        assert_eq!(
            t.room(DeviceKind::Loop, &set(&["loop1"])),
            Some((1 << 20) - 1)
        );
        assert_eq!(t.room(DeviceKind::Loop, &set(&[])), Some((1 << 20) - 2));
    }

    #[test]
    fn partitions_per_loop_device_shrink_its_ceiling() {
        let f = Fixture::new();
        // max_part 31 is rounded to 32 minors a device: 2^15 devices.
        f.write("module/loop/parameters/max_part", "31\n");
        f.loop_device(0, Some("/x\n"));
        assert_eq!(
            f.tables().room(DeviceKind::Loop, &set(&[])),
            Some((1 << 15) - 1)
        );
        f.write("module/loop/parameters/max_part", "255\n");
        assert_eq!(
            f.tables().room(DeviceKind::Loop, &set(&["loop0"])),
            Some(1 << 12)
        );
    }

    #[test]
    fn rbd_room_with_one_major_is_its_minor_space_less_others_mappings() {
        let f = Fixture::new();
        f.write("module/rbd/parameters/single_major", "Y\n");
        f.write("bus/rbd/devices/0/pool", "rbd\n");
        f.write("bus/rbd/devices/3/pool", "other\n");
        let t = f.tables();
        assert_eq!(t.room(DeviceKind::Rbd, &set(&["rbd0"])), Some(65_536 - 1));
        // The module not loaded yet: it loads with one major.
        let empty = Fixture::new();
        assert_eq!(
            empty.tables().room(DeviceKind::Rbd, &set(&[])),
            Some(65_536)
        );
    }

    #[test]
    fn rbd_room_without_one_major_counts_the_free_dynamic_majors() {
        let f = Fixture::new();
        f.write("module/rbd/parameters/single_major", "N\n");
        f.write("bus/rbd/devices/0/pool", "rbd\n");
        f.write("bus/rbd/devices/1/pool", "rbd\n");
        // Majors 1 to 250 take their slots and 259 hashes onto slot 4,
        // taken already: slots 251 to 254 are free. Two of the taken ones
        // are the mapped devices' own.
        let mut devices = String::from("Character devices:\n  1 mem\n\nBlock devices:\n");
        for m in 1..=250 {
            devices.push_str(&format!("{m} blk{m}\n"));
        }
        devices.push_str("259 blkext\n");
        std::fs::write(f.dir.path().join("devices"), devices).unwrap();
        let t = f.tables();
        // 4 free slots + 2 held by mapped devices, one of them others'.
        assert_eq!(t.room(DeviceKind::Rbd, &set(&["rbd0"])), Some(4 + 2 - 1));
    }

    #[test]
    fn iscsi_has_no_ceiling() {
        assert_eq!(
            Fixture::new().tables().room(DeviceKind::Iscsi, &set(&[])),
            None
        );
    }
}
