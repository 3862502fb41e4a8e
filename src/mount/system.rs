//! The real mounter: mount(2), umount2(2), statx(2) and mountinfo.

use super::{parse_mountinfo, MountId, MountInfo, MountOptions, Mounter};
use crate::error::{Error, Result};
use nix::errno::Errno;
use nix::mount::{mount, umount2, MntFlags, MsFlags};
use std::path::Path;

/// Mounts for real in the driver's mount namespace.
#[derive(Debug, Default, Clone)]
pub struct SystemMounter;

fn ms_flags(options: &MountOptions) -> MsFlags {
    let mut f = MsFlags::empty();
    for name in &options.flags {
        f |= match *name {
            "noatime" => MsFlags::MS_NOATIME,
            "nodiratime" => MsFlags::MS_NODIRATIME,
            "relatime" => MsFlags::MS_RELATIME,
            "strictatime" => MsFlags::MS_STRICTATIME,
            "nodev" => MsFlags::MS_NODEV,
            "nosuid" => MsFlags::MS_NOSUID,
            "noexec" => MsFlags::MS_NOEXEC,
            "sync" => MsFlags::MS_SYNCHRONOUS,
            "dirsync" => MsFlags::MS_DIRSYNC,
            _ => MsFlags::empty(),
        };
    }
    if options.readonly {
        f |= MsFlags::MS_RDONLY;
    }
    f
}

fn errno_error(what: String, errno: Errno) -> Error {
    let err = std::io::Error::from_raw_os_error(errno as i32);
    Error::io(what, err)
}

impl Mounter for SystemMounter {
    fn mount_fs(
        &self,
        device: &Path,
        target: &Path,
        fstype: &str,
        options: &MountOptions,
    ) -> Result<()> {
        let data = options.data.join(",");
        mount(
            Some(device),
            target,
            Some(fstype),
            ms_flags(options),
            (!data.is_empty()).then_some(data.as_str()),
        )
        .map_err(|e| {
            errno_error(
                format!(
                    "mount {fstype} {} on {}",
                    device.display(),
                    target.display()
                ),
                e,
            )
        })
    }

    fn bind(
        &self,
        source: &Path,
        target: &Path,
        readonly: bool,
        options: &MountOptions,
    ) -> Result<()> {
        mount(
            Some(source),
            target,
            None::<&str>,
            MsFlags::MS_BIND,
            None::<&str>,
        )
        .map_err(|e| {
            errno_error(
                format!("bind {} on {}", source.display(), target.display()),
                e,
            )
        })?;
        // Per-mount flags (read-only, nodev, ...) on a bind take a remount.
        let extra = ms_flags(&MountOptions {
            readonly,
            ..options.clone()
        });
        if !extra.is_empty() {
            let flags = MsFlags::MS_REMOUNT | MsFlags::MS_BIND | extra;
            if let Err(e) = mount(None::<&str>, target, None::<&str>, flags, None::<&str>) {
                // Never leave a writable bind behind when read-only was asked.
                let _ = umount2(target, MntFlags::UMOUNT_NOFOLLOW);
                return Err(errno_error(
                    format!("remount {} with flags", target.display()),
                    e,
                ));
            }
        }
        Ok(())
    }

    fn unmount(&self, target: &Path) -> Result<bool> {
        // A mount is busy for a moment while a process lets go of a file
        // in it (a child forked with the file open, before its exec
        // closes it; a probe of the filesystem): asked again over 300 ms
        // before the error is said. A holder that stays (a pod's process)
        // is said.
        let mut waits = [20u64, 40, 80, 160].into_iter();
        loop {
            match umount2(target, MntFlags::UMOUNT_NOFOLLOW) {
                Ok(()) => return Ok(true),
                Err(Errno::EINVAL) | Err(Errno::ENOENT) => return Ok(false),
                Err(e) => match (e, waits.next()) {
                    (Errno::EBUSY, Some(ms)) => {
                        std::thread::sleep(std::time::Duration::from_millis(ms))
                    }
                    _ => return Err(errno_error(format!("unmount {}", target.display()), e)),
                },
            }
        }
    }

    fn mounted(&self, path: &Path) -> Result<Option<MountId>> {
        statx_mount_root(path)
    }

    fn node_id(&self, path: &Path) -> Result<MountId> {
        use std::os::unix::fs::MetadataExt;
        let md = std::fs::metadata(path)
            .map_err(|e| Error::io(format!("stat {}", path.display()), e))?;
        let split = |d: u64| ((nix::sys::stat::major(d)) << 32) | nix::sys::stat::minor(d);
        Ok(MountId {
            dev: split(md.dev()),
            rdev: split(md.rdev()),
        })
    }

    fn mounts(&self) -> Result<Vec<MountInfo>> {
        let text = std::fs::read_to_string("/proc/self/mountinfo")
            .map_err(|e| Error::io("read mountinfo", e))?;
        Ok(parse_mountinfo(&text))
    }
}

/// What is mounted at `path`, from one statx: STATX_ATTR_MOUNT_ROOT says
/// whether it is a mount root, whatever the number of mounts on the node,
/// and the device numbers say what it is. A missing path is not a mount
/// point.
#[allow(unsafe_code)] // statx(2) through libc: nix has no wrapper for it
fn statx_mount_root(path: &Path) -> Result<Option<MountId>> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes())
        .map_err(|_| Error::invalid("path contains NUL"))?;
    let mut buf = std::mem::MaybeUninit::<libc::statx>::zeroed();
    // SAFETY: `c` is a valid NUL-terminated string and `buf` is a properly
    // sized, writable statx buffer that outlives the call.
    let rc = unsafe {
        libc::statx(
            libc::AT_FDCWD,
            c.as_ptr(),
            libc::AT_SYMLINK_NOFOLLOW,
            libc::STATX_BASIC_STATS,
            buf.as_mut_ptr(),
        )
    };
    if rc != 0 {
        let err = std::io::Error::last_os_error();
        return match err.kind() {
            std::io::ErrorKind::NotFound => Ok(None),
            _ => Err(Error::io(format!("statx {}", path.display()), err)),
        };
    }
    // SAFETY: statx returned 0, so it filled the buffer.
    let st = unsafe { buf.assume_init() };
    let id = MountId {
        dev: ((st.stx_dev_major as u64) << 32) | st.stx_dev_minor as u64,
        rdev: ((st.stx_rdev_major as u64) << 32) | st.stx_rdev_minor as u64,
    };
    let attr = libc::STATX_ATTR_MOUNT_ROOT as u64;
    let root = if st.stx_attributes_mask & attr != 0 {
        st.stx_attributes & attr != 0
    } else {
        // Kernels before 5.8 lack the attribute: fall back to the mount table.
        let text = std::fs::read_to_string("/proc/self/mountinfo")
            .map_err(|e| Error::io("read mountinfo", e))?;
        parse_mountinfo(&text).iter().any(|m| m.mount_point == path)
    };
    Ok(root.then_some(id))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn root_is_a_mount_point_and_a_plain_dir_is_not() {
        assert!(SystemMounter.is_mount_point(Path::new("/")).unwrap());
        let dir = tempfile::tempdir().unwrap();
        assert!(!SystemMounter.is_mount_point(dir.path()).unwrap());
        assert!(!SystemMounter
            .is_mount_point(&dir.path().join("missing"))
            .unwrap());
    }

    #[test]
    fn unmount_of_a_plain_dir_reports_nothing_mounted() {
        let dir = tempfile::tempdir().unwrap();
        assert!(!SystemMounter.unmount(dir.path()).unwrap());
    }

    /// A mount held for a moment (a file open in it, closed 30 ms later)
    /// is unmounted once it is let go; one held throughout is EBUSY,
    /// said. Needs root (CAP_SYS_ADMIN).
    #[test]
    fn a_mount_busy_for_a_moment_is_unmounted_and_one_busy_throughout_is_said() {
        assert!(
            nix::unistd::geteuid().is_root(),
            "this test needs root: run the suite as root"
        );
        let dir = tempfile::tempdir().unwrap();
        let (src, dst) = (dir.path().join("src"), dir.path().join("dst"));
        std::fs::create_dir_all(&src).unwrap();
        std::fs::create_dir_all(&dst).unwrap();
        std::fs::write(src.join("f"), b"x").unwrap();
        let bind = || {
            SystemMounter
                .bind(&src, &dst, false, &MountOptions::default())
                .unwrap()
        };
        bind();
        let held = std::fs::File::open(dst.join("f")).unwrap();
        let e = SystemMounter.unmount(&dst).unwrap_err();
        assert_eq!(e.os_error, Some(libc::EBUSY), "{e}");
        drop(held);
        let held = std::fs::File::open(dst.join("f")).unwrap();
        let letting_go = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(30));
            drop(held);
        });
        let unmounted = SystemMounter.unmount(&dst);
        letting_go.join().unwrap();
        if unmounted.is_err() {
            let _ = umount2(&dst, MntFlags::MNT_DETACH);
        }
        assert!(unmounted.unwrap());
    }

    /// Needs root (CAP_SYS_ADMIN): CI runs the suite as root.
    #[test]
    fn bind_readonly_and_unmount() {
        assert!(
            nix::unistd::geteuid().is_root(),
            "this test needs root: run the suite as root"
        );
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("src");
        let dst = dir.path().join("dst");
        std::fs::create_dir_all(&src).unwrap();
        std::fs::create_dir_all(&dst).unwrap();
        std::fs::write(src.join("f"), b"x").unwrap();
        SystemMounter
            .bind(&src, &dst, true, &MountOptions::default())
            .unwrap();
        // Assert inside catch_unwind so a failure still unmounts.
        let result = std::panic::catch_unwind(|| {
            assert!(SystemMounter.is_mount_point(&dst).unwrap());
            let info = SystemMounter
                .mount_at(&dst)
                .unwrap()
                .expect("bind listed in mountinfo");
            assert!(info.readonly());
            assert!(
                std::fs::write(dst.join("g"), b"y").is_err(),
                "read-only bind accepted a write"
            );
            assert_eq!(std::fs::read(dst.join("f")).unwrap(), b"x");
        });
        assert!(SystemMounter.unmount(&dst).unwrap());
        assert!(!SystemMounter.is_mount_point(&dst).unwrap());
        if let Err(panic) = result {
            std::panic::resume_unwind(panic);
        }
    }
}
