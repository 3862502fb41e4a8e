//! The mount seam: a [`Mounter`] trait with a real implementation over
//! mount(2)/umount2(2) and `/proc/self/mountinfo`, and an in-memory fake with
//! error injection for unit tests. Bind mounts and read-only remounts are
//! syscalls here, never an exec of `mount(8)`.

#[cfg(test)]
mod fake;
mod helper;
mod info;
mod system;

#[cfg(test)]
pub use fake::{FakeMount, FakeMounter, MountOp};
pub use helper::{helper_command, mount_with_helper, own_superblock_option, unmount_with_helper};
pub use info::{parse_mountinfo, MountInfo};
pub use system::SystemMounter;

use crate::error::{Error, Result};
use std::path::Path;

/// Flags and filesystem data parsed from a volume capability's `mount_flags`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MountOptions {
    pub readonly: bool,
    /// Generic per-mount flags by name (`noatime`, `nodev`, ...), applied as
    /// MS_* bits by the system mounter.
    pub flags: Vec<&'static str>,
    /// Filesystem-specific options passed as mount(2) data (`discard`, ...).
    pub data: Vec<String>,
}

const GENERIC_FLAGS: &[&str] = &[
    "ro",
    "rw",
    "noatime",
    "nodiratime",
    "relatime",
    "strictatime",
    "nodev",
    "nosuid",
    "noexec",
    "sync",
    "dirsync",
    "defaults",
    "bind",
];

impl MountOptions {
    /// Parses CSI `mount_flags`. Each entry may hold several comma-separated
    /// options. Only plain option text is accepted: nothing that could smuggle
    /// another mount option or a path.
    pub fn parse(mount_flags: &[String], readonly: bool) -> Result<Self> {
        let mut opts = MountOptions {
            readonly,
            ..Default::default()
        };
        let total: usize = mount_flags.iter().map(String::len).sum();
        if total > 4096 {
            return Err(Error::invalid("mount_flags exceed 4 KiB"));
        }
        for entry in mount_flags {
            for opt in split_options(entry)?
                .iter()
                .map(|o| o.trim())
                .filter(|o| !o.is_empty())
            {
                if let Some(label) = selinux_option(opt)? {
                    if !opts.data.contains(&label) {
                        opts.data.push(label);
                    }
                    continue;
                }
                let ok = opt.len() <= 256
                    && opt
                        .chars()
                        .all(|c| c.is_ascii_alphanumeric() || "_-=.:+/@".contains(c))
                    && opt
                        .chars()
                        .next()
                        .is_some_and(|c| c.is_ascii_alphanumeric());
                if !ok {
                    return Err(Error::invalid(
                        "mount_flags contain an option with characters that are not allowed",
                    ));
                }
                match GENERIC_FLAGS.iter().find(|f| **f == opt) {
                    Some(&"ro") => opts.readonly = true,
                    Some(&"rw") | Some(&"defaults") => {}
                    Some(&"bind") => {
                        return Err(Error::invalid("mount flag `bind` is not allowed"))
                    }
                    Some(flag) => {
                        if !opts.flags.contains(flag) {
                            opts.flags.push(flag)
                        }
                    }
                    None => {
                        if !opts.data.iter().any(|d| d == opt) {
                            opts.data.push(opt.to_string())
                        }
                    }
                }
            }
        }
        Ok(opts)
    }
}

/// The SELinux mount options (KEP-1710: kubelet passes `context="..."`
/// when the CSIDriver says `seLinuxMount`): the label applies to the whole
/// filesystem (its superblock).
pub const SELINUX_OPTIONS: &[&str] = &["context", "fscontext", "defcontext", "rootcontext"];

/// One entry of `mount_flags` cut at its commas, except those inside
/// double quotes (an SELinux label's category set: `s0:c1,c2`).
fn split_options(entry: &str) -> Result<Vec<&str>> {
    let mut parts = Vec::new();
    let (mut start, mut quoted) = (0, false);
    for (i, c) in entry.char_indices() {
        match c {
            '"' => quoted = !quoted,
            ',' if !quoted => {
                parts.push(&entry[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    if quoted {
        return Err(Error::invalid("mount_flags contain an unclosed quote"));
    }
    parts.push(&entry[start..]);
    Ok(parts)
}

/// An SELinux option (`context=...`, quoted or not) as mount(2) takes it:
/// `name="label"`, the label checked (`user:role:type[:level]`, of
/// `[A-Za-z0-9_.:,-]`). `None` for any other option; an option of another
/// name with a quote in it is refused.
fn selinux_option(opt: &str) -> Result<Option<String>> {
    let Some((name, value)) = opt.split_once('=') else {
        return Ok(None);
    };
    if !SELINUX_OPTIONS.contains(&name) {
        if opt.contains('"') {
            return Err(Error::invalid(format!(
                "mount_flags: only an SELinux option ({}) takes a quoted value",
                SELINUX_OPTIONS.join(", ")
            )));
        }
        return Ok(None);
    }
    let label = match value.strip_prefix('"') {
        Some(inner) => inner.strip_suffix('"').unwrap_or("\""),
        None => value,
    };
    let ok = !label.is_empty()
        && label.len() <= 255
        && label.split(':').count() >= 3
        && label.split(':').take(3).all(|p| !p.is_empty())
        && label
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "_.:,-".contains(c));
    if !ok {
        return Err(Error::invalid(format!(
            "mount_flags: {name} must be an SELinux label (user:role:type[:level]), quoted \
             where it holds a comma"
        )));
    }
    Ok(Some(format!("{name}=\"{label}\"")))
}

impl MountOptions {
    /// The SELinux options among the data (`context="..."`, ...), as
    /// mount(2) takes them.
    pub fn selinux(&self) -> Vec<&str> {
        self.data
            .iter()
            .map(String::as_str)
            .filter(|d| {
                d.split_once('=')
                    .is_some_and(|(n, _)| SELINUX_OPTIONS.contains(&n))
            })
            .collect()
    }
}

/// What is mounted at a path, as one `statx` of it tells: the device number
/// of its filesystem, and, for a device node bound there (a raw block
/// publish), the device it stands for. Recorded when ferrovol mounts, and
/// compared before anything is taken for "already done" or unmounted, so
/// a foreign mount is never mistaken for ours.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct MountId {
    pub dev: u64,
    pub rdev: u64,
}

/// Mount operations on the node.
pub trait Mounter: Send + Sync {
    /// Mounts a filesystem of `fstype` from `device` on the directory `target`.
    fn mount_fs(
        &self,
        device: &Path,
        target: &Path,
        fstype: &str,
        options: &MountOptions,
    ) -> Result<()>;
    /// Bind-mounts `source` (a directory or a device/file) on `target`,
    /// read-only if asked (a bind followed by a read-only remount).
    fn bind(
        &self,
        source: &Path,
        target: &Path,
        readonly: bool,
        options: &MountOptions,
    ) -> Result<()>;
    /// Unmounts `target` without following a symlink there. Returns false if
    /// nothing was mounted at `target`.
    fn unmount(&self, target: &Path) -> Result<bool>;
    /// Whether `path` is the root of a mount (cheap: no mount table scan).
    fn is_mount_point(&self, path: &Path) -> Result<bool> {
        Ok(self.mounted(path)?.is_some())
    }
    /// What is mounted at `path`; `None` when it is not a mount root. One
    /// `statx`, whatever the number of mounts.
    fn mounted(&self, path: &Path) -> Result<Option<MountId>>;
    /// The device numbers of any path (a device node, say), mount root or
    /// not: what a bind of it shows.
    fn node_id(&self, path: &Path) -> Result<MountId>;
    /// The mount table of this process's namespace.
    fn mounts(&self) -> Result<Vec<MountInfo>>;
    /// The entry for the mount rooted at `target`, if any.
    fn mount_at(&self, target: &Path) -> Result<Option<MountInfo>> {
        if !self.is_mount_point(target)? {
            return Ok(None);
        }
        Ok(self
            .mounts()?
            .into_iter()
            .rev()
            .find(|m| m.mount_point == target))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_generic_flags_and_data() {
        let o = MountOptions::parse(
            &["noatime,discard".into(), "nodev".into(), "ro".into()],
            false,
        )
        .unwrap();
        assert!(o.readonly);
        assert_eq!(o.flags, vec!["noatime", "nodev"]);
        assert_eq!(o.data, vec!["discard".to_string()]);
    }

    /// kubelet's SELinux option: its category set's comma stays inside
    /// the quotes; the label is checked and reaches mount(2) quoted.
    #[test]
    fn takes_an_selinux_context_with_its_commas() {
        let o = MountOptions::parse(
            &[
                "noatime".into(),
                "context=\"system_u:object_r:container_file_t:s0:c1,c2\",discard".into(),
            ],
            false,
        )
        .unwrap();
        assert_eq!(
            o.data,
            vec![
                "context=\"system_u:object_r:container_file_t:s0:c1,c2\"".to_string(),
                "discard".to_string()
            ]
        );
        assert_eq!(
            o.selinux(),
            vec!["context=\"system_u:object_r:container_file_t:s0:c1,c2\""]
        );
        // Unquoted (no comma): quoted for mount(2).
        let o =
            MountOptions::parse(&["fscontext=system_u:object_r:nfs_t:s0".into()], false).unwrap();
        assert_eq!(
            o.data,
            vec!["fscontext=\"system_u:object_r:nfs_t:s0\"".to_string()]
        );
        for bad in [
            "context=\"system_u:object_r:x_t:s0",
            "context=\"a:b\"",
            "context=\"::t:s0\"",
            "context=\"u:r:t:s0\\\"\"",
            "context=\"u:r:t:s0;rm\"",
            "context=\"u:r:t:s0\",x=\"1\"",
            "nfsvers=\"4\"",
            "context=",
        ] {
            assert!(MountOptions::parse(&[bad.into()], false).is_err(), "{bad}");
        }
    }

    #[test]
    fn refuses_injection_and_bind() {
        for bad in ["a b", "x;rm", "bind", "/etc", "$(x)", "x\ny"] {
            assert!(MountOptions::parse(&[bad.into()], false).is_err(), "{bad}");
        }
        assert!(MountOptions::parse(&["x".repeat(5000)], false).is_err());
    }
}
