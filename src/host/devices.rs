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

/// A kind of device a backend attaches on the node, one per volume: how to
/// read the kernel's ceiling for it and the devices of it attached now.
/// The loop devices of image files are [`LOOP`]; a backend attaching
/// another kind declares its own ([`crate::plugin::DeviceMounter::node_device`]).
#[derive(Debug, Clone, Copy)]
pub struct DeviceClass {
    /// What it is called in a message.
    pub name: &'static str,
    /// Reads its ceiling and the devices attached now from these tables.
    pub census: fn(&DeviceTables) -> Census,
}

/// A kind of device's ceiling, and the devices of it attached now (as
/// `/dev` names them).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Census {
    pub ceiling: u64,
    pub attached: Vec<String>,
}

/// Loop devices over image files.
pub const LOOP: DeviceClass = DeviceClass {
    name: "loop",
    census: |t| Census {
        ceiling: t.loop_ceiling(),
        attached: t.attached_loops(),
    },
};

/// Minor-number bits of a block device (`MINORBITS`).
pub const MINOR_BITS: u32 = 20;
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

    /// How many devices of `class` ferrovol can have attached at once on
    /// this node: the kernel's ceiling less what others hold (`ours` names
    /// the devices of staged volumes, as `/dev` names them: `loop3`,
    /// `rbd0`).
    pub fn room(&self, class: &DeviceClass, ours: &HashSet<String>) -> u64 {
        let Census { ceiling, attached } = (class.census)(self);
        let others = attached.iter().filter(|d| !ours.contains(*d)).count() as u64;
        ceiling.saturating_sub(others)
    }

    /// A module's parameter, when it is loaded.
    pub fn param(&self, module: &str, name: &str) -> Option<String> {
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

    /// The entries of a folder of sysfs (`rel` below its root) that
    /// `keep` accepts; none when it is missing.
    pub fn entries(&self, rel: &str, keep: impl Fn(&str, &Path) -> bool) -> Vec<String> {
        names(&self.sys.join(rel), keep)
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

    /// Slots of the kernel's block major table a dynamic major can still
    /// take (none of the registered majors hashes there).
    pub fn free_dynamic_majors(&self) -> u64 {
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

/// A fixture tree of sysfs and `/proc/devices` for tests.
#[cfg(test)]
pub mod fixture {
    use super::*;

    pub struct Fixture {
        pub dir: tempfile::TempDir,
    }

    impl Fixture {
        #[allow(clippy::new_without_default)]
        pub fn new() -> Self {
            Self {
                dir: tempfile::tempdir().unwrap(),
            }
        }
        fn sys(&self) -> PathBuf {
            self.dir.path().join("sys")
        }
        /// Writes a file below the fixture's sysfs.
        pub fn write(&self, rel: &str, text: &str) {
            let p = self.sys().join(rel);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, text).unwrap();
        }
        /// Writes the fixture's `/proc/devices`.
        pub fn proc_devices(&self, text: &str) {
            std::fs::write(self.dir.path().join("devices"), text).unwrap();
        }
        pub fn loop_device(&self, n: u32, backing: Option<&str>) {
            let dir = self.sys().join(format!("block/loop{n}"));
            std::fs::create_dir_all(&dir).unwrap();
            if let Some(b) = backing {
                self.write(&format!("block/loop{n}/loop/backing_file"), b);
            }
        }
        pub fn tables(&self) -> DeviceTables {
            DeviceTables::at(&self.sys(), &self.dir.path().join("devices"))
        }
    }

    pub fn set(names: &[&str]) -> HashSet<String> {
        names.iter().map(|s| s.to_string()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::fixture::*;
    use super::*;

    #[test]
    fn loop_room_is_the_minor_space_less_the_loops_others_hold() {
        let f = Fixture::new();
        f.write("module/loop/parameters/max_part", "0\n");
        f.loop_device(0, Some("/var/lib/snapd/snaps/core.snap\n"));
        f.loop_device(1, Some("/pool/a.img\n"));
        f.loop_device(2, None); // made, not bound: nobody's
        let t = f.tables();
        assert_eq!(t.room(&LOOP, &set(&["loop1"])), (1 << 20) - 1);
        assert_eq!(t.room(&LOOP, &set(&[])), (1 << 20) - 2);
    }

    #[test]
    fn partitions_per_loop_device_shrink_its_ceiling() {
        let f = Fixture::new();
        // max_part 31 is rounded to 32 minors a device: 2^15 devices.
        f.write("module/loop/parameters/max_part", "31\n");
        f.loop_device(0, Some("/x\n"));
        assert_eq!(f.tables().room(&LOOP, &set(&[])), (1 << 15) - 1);
        f.write("module/loop/parameters/max_part", "255\n");
        assert_eq!(f.tables().room(&LOOP, &set(&["loop0"])), 1 << 12);
    }
}
