//! The node's view of health (CSI v1.13's NodeGetVolumeHealth and
//! NodeGetStorageHealth, and v1.12's condition in NodeGetVolumeStats, read
//! from the same findings). Every measurement goes through a book with the
//! quick deadline: storage that does not answer makes the call answer late
//! with what was known, never hold it, and never holds another volume's.

use super::*;
use crate::plugin::health::{self, Answer, Book, Finding, Reason, StorageFinding, StorageStatus};

/// Per volume: its findings when last measured.
pub(super) type VolumeBook = Book<String, Vec<Finding>>;

/// Per backend: what was wrong with it when last checked.
pub(super) type StorageBook = Book<String, Vec<StorageFinding>>;

impl NodeOps {
    /// What is wrong with a staged volume, as its backend measures what it
    /// set up on this node.
    pub(super) async fn measured_health(
        &self,
        id: &VolumeId,
        stage: &StageRecord,
    ) -> Result<Vec<Finding>> {
        let backend = self.backend(id)?.clone();
        backend.staging()?;
        let Some(attachment) = stage.attachment.clone() else {
            return Ok(vec![Finding::inaccessible(
                Reason::NotAttached,
                "the volume's device was never attached",
            )]);
        };
        // A remote filesystem's root, asked of its server (not the
        // client's cache): a directory removed there is a stale handle.
        let remote_root = match (&attachment, &stage.capability.access) {
            (Attachment::Remote { .. }, AccessType::Mount { .. }) => {
                Some(stage.staging_path.clone())
            }
            _ => None,
        };
        // A staged device is read from (past the cache): its storage gone
        // or fenced fails the read, whatever its backend can tell.
        let device = match &attachment {
            Attachment::Device { .. } => stage.device(),
            Attachment::Remote { .. } => None,
        };
        // A filesystem staged from a device: what the kernel says of it.
        let fs_root = match (&attachment, &stage.capability.access) {
            (Attachment::Device { .. }, AccessType::Mount { .. }) => {
                Some((self.mounter.clone(), stage.staging_path.clone()))
            }
            _ => None,
        };
        let key = id.clone();
        let measure = async move {
            let mut found = health::from_check(match backend.staging() {
                Ok(stager) => stager.node_health(&key, &attachment).await,
                Err(e) => Err(e),
            });
            if let Some(root) = remote_root {
                found.extend(remote_root_findings(root).await);
            }
            // Only when the backend saw nothing wrong: a read of a device
            // whose storage it already knows gone (an iSCSI session down)
            // would wait on it for nothing.
            if let Some(device) = device.filter(|_| found.is_empty()) {
                found.extend(device_findings(device).await);
            }
            if let Some((mounter, root)) = fs_root {
                let at = root.display().to_string();
                let read = tokio::task::spawn_blocking(move || {
                    troubles(mounter.as_ref(), Path::new("/sys"), &root)
                })
                .await;
                match read {
                    Ok(Ok(troubles)) => found.extend(troubles),
                    Ok(Err(e)) => found.push(Finding::inaccessible(
                        Reason::HealthCheckFailed,
                        format!("the filesystem at {at} could not be checked: {}", e.message),
                    )),
                    Err(e) => found.push(Finding::inaccessible(
                        Reason::HealthCheckFailed,
                        format!("the check of {at} failed to run: {e}"),
                    )),
                }
            }
            health::dedup(found)
        };
        // Half the call's deadline: the mount checks that follow have the
        // rest.
        Ok(self
            .through_book(id, self.deadlines.quick / 2, measure)
            .await)
    }

    /// NodeGetVolumeHealth: what is wrong with a volume on this node. A
    /// node-local volume not staged here (a stage that failed, or none yet)
    /// is asked of its backend, which holds it on this node; a remote one
    /// has nothing of this node's to measure (empty). An id no backend of
    /// this driver made is NOT_FOUND. Paths, when given, must be where the
    /// volume is (or was to be): a staging path or target of another volume
    /// is refused.
    pub async fn volume_health(
        &self,
        id: &VolumeId,
        publish_path: &str,
        staging_path: &str,
    ) -> Result<Vec<Finding>> {
        self.backend(id)?;
        let publish_path = optional_path(publish_path, "volume_publish_path")?;
        let staging_path = optional_path(staging_path, "staging_target_path")?;
        let Some(stage) = self.state.stage(id) else {
            return Ok(self.unstaged_health(id).await);
        };
        if staging_path
            .as_ref()
            .is_some_and(|p| *p != stage.staging_path)
        {
            return Err(Error::not_found(format!(
                "volume {id} is staged at {}, not at the staging_target_path given",
                stage.staging_path.display()
            )));
        }
        if let Some(p) = &publish_path {
            if self.state.publish(p).is_some_and(|r| &r.volume_id != id) {
                return Err(Error::not_found(format!(
                    "{} is another volume's target",
                    p.display()
                )));
            }
        }
        // Every step shares one deadline: the call answers within it.
        let until = std::time::Instant::now() + self.deadlines.quick;
        let mut found = self.measured_health(id, &stage).await?;
        let remote = matches!(stage.attachment, Some(Attachment::Remote { .. }));
        if matches!(stage.capability.access, AccessType::Mount { .. }) {
            match self.mounted_by(&stage.staging_path, until).await {
                Ok(true) => {}
                Ok(false) => found.push(Finding::inaccessible(
                    Reason::StagingMountGone,
                    format!("staging mount {} is gone", stage.staging_path.display()),
                )),
                Err(e) if remote => found.push(not_answering(&e)),
                // A filesystem shut down answers EIO: its own finding
                // (FilesystemShutDown) says so.
                Err(e) if e.os_error == Some(libc::EIO) => {}
                Err(e) => found.push(Finding::inaccessible(
                    Reason::HealthCheckFailed,
                    format!("the staging mount could not be checked: {}", e.message),
                )),
            }
        }
        found.extend(self.limit_findings(id));
        if let Some(p) = publish_path.filter(|p| self.state.publish(p).is_some()) {
            if let Ok(false) = self.mounted_by(&p, until).await {
                found.push(Finding::inaccessible(
                    Reason::PublishMountGone,
                    format!("the volume is no longer mounted at {}", p.display()),
                ));
            }
        }
        Ok(health::dedup(found))
    }

    /// What the kernel says of the filesystem staged from a device (see
    /// [`troubles`]), by `until`; a remote filesystem's is not read
    /// here. A check that cannot finish says so.
    pub(super) async fn fs_troubles(
        &self,
        stage: &StageRecord,
        until: std::time::Instant,
    ) -> Vec<Finding> {
        if !matches!(stage.attachment, Some(Attachment::Device { .. })) {
            return Vec::new();
        }
        let p = stage.staging_path.clone();
        let left = until.saturating_duration_since(std::time::Instant::now());
        let what = format!("checking the filesystem at {}", p.display());
        match self
            .off_worker(what, left, move |m| troubles(m, Path::new("/sys"), &p))
            .await
        {
            Ok(found) => found,
            Err(e) => vec![Finding::inaccessible(
                Reason::HealthCheckFailed,
                format!("the staged filesystem could not be checked: {}", e.message),
            )],
        }
    }

    /// A volume's check through the book, answered within `deadline`.
    async fn through_book(
        &self,
        id: &VolumeId,
        deadline: Duration,
        measure: impl std::future::Future<Output = Vec<Finding>> + Send + 'static,
    ) -> Vec<Finding> {
        let answer = self
            .health
            .get(id.to_string(), Duration::ZERO, deadline, measure)
            .await;
        health::findings_of(answer, deadline)
    }

    /// Whether `path` is mounted, answered by `until` (UNAVAILABLE after).
    pub(super) async fn mounted_by(&self, path: &Path, until: std::time::Instant) -> Result<bool> {
        let left = until.saturating_duration_since(std::time::Instant::now());
        match tokio::time::timeout(left, self.is_mounted(path)).await {
            Ok(answer) => answer,
            Err(_) => Err(Error::unavailable(format!(
                "checking whether {} is mounted: no answer within the call's deadline",
                path.display()
            ))),
        }
    }

    /// A volume not staged here: its backend's own view when the volume
    /// lives on this node, through the book.
    async fn unstaged_health(&self, id: &VolumeId) -> Vec<Finding> {
        let Ok(backend) = self.backend(id).cloned() else {
            return Vec::new();
        };
        if !backend.node_local() || backend.health_reporter().is_none() {
            return Vec::new();
        }
        let key = id.clone();
        let measure = async move {
            let reporter = backend.health_reporter().expect("checked above");
            health::from_check(reporter.volume_health(&key, &Secrets::default()).await)
        };
        self.through_book(id, self.deadlines.quick, measure).await
    }

    /// NodeGetStorageHealth: each backend as this node sees it, checked
    /// through its `health`, all at once, each through the book within the
    /// quick deadline. One entry per (status, reason): backends that fail
    /// alike share it, each named in its message.
    pub async fn storage_health(&self) -> Vec<StorageFinding> {
        let deadline = self.deadlines.quick;
        let checks: Vec<_> = self
            .registry
            .all()
            .cloned()
            .map(|backend| {
                let book = self.storage.clone();
                tokio::spawn(async move {
                    let name = backend.name().to_string();
                    let measure = async move {
                        match backend.health().await {
                            Err(e) => vec![StorageFinding {
                                status: StorageStatus::Unreachable,
                                reason: Reason::BackendNotReady,
                                message: e.message,
                            }],
                            Ok(()) => backend.storage_findings().await,
                        }
                    };
                    let named = |f: StorageFinding| StorageFinding {
                        message: format!("{name}: {}", f.message),
                        ..f
                    };
                    match book
                        .get(name.clone(), Duration::ZERO, deadline, measure)
                        .await
                    {
                        Answer::Fresh(m) => m.value.into_iter().map(named).collect(),
                        Answer::Late(_) => vec![StorageFinding {
                            status: StorageStatus::Unreachable,
                            reason: Reason::HealthCheckTimedOut,
                            message: format!("{name}: no answer within {} s", deadline.as_secs()),
                        }],
                    }
                })
            })
            .collect();
        let mut by_kind: std::collections::BTreeMap<(StorageStatus, Reason), Vec<String>> =
            Default::default();
        for check in checks {
            for f in check.await.unwrap_or_default() {
                by_kind
                    .entry((f.status, f.reason))
                    .or_default()
                    .push(f.message);
            }
        }
        by_kind
            .into_iter()
            .map(|((status, reason), messages)| StorageFinding {
                status,
                reason,
                message: messages.join("; "),
            })
            .collect()
    }
}

/// A path field that may be empty; when given, it must be a clean absolute
/// path, as every path the driver takes.
fn optional_path(raw: &str, field: &str) -> Result<Option<PathBuf>> {
    if raw.is_empty() {
        return Ok(None);
    }
    paths::validate(raw, field).map(Some)
}

/// What the server says of a remote filesystem's root (synced, past the
/// client's caches): gone there (a stale handle), or not answering.
async fn remote_root_findings(root: PathBuf) -> Vec<Finding> {
    let at = root.display().to_string();
    let asked =
        tokio::task::spawn_blocking(move || crate::host::synced::exists_on_server(&root)).await;
    match asked {
        Ok(Ok(_)) => Vec::new(),
        Ok(Err(e)) if e.os_error == Some(libc::ESTALE) => vec![Finding::inaccessible(
            Reason::FilesystemNotAnswering,
            format!(
                "the server no longer has the volume's directory mounted at {at} (a stale file \
                 handle): it was removed or replaced there"
            ),
        )],
        Ok(Err(e)) => vec![Finding::inaccessible(
            Reason::FilesystemNotAnswering,
            format!("the filesystem at {at} does not answer: {}", e.message),
        )],
        Err(e) => vec![Finding::inaccessible(
            Reason::HealthCheckFailed,
            format!("the check of {at} failed to run: {e}"),
        )],
    }
}

/// What a read of a staged device says (see [`fs::reads`]): I/O errors
/// from it. A device gone from /dev is its backend's to say.
async fn device_findings(device: PathBuf) -> Vec<Finding> {
    let at = device.display().to_string();
    match tokio::task::spawn_blocking(move || fs::reads(&device)).await {
        Ok(Err(e)) if matches!(e.raw_os_error(), Some(libc::EIO | libc::ENXIO)) => {
            vec![Finding::inaccessible(
                Reason::DeviceIOErrors,
                format!(
                    "reads of {at} fail ({e}): its storage is gone, fails, or has fenced this \
                     node's client"
                ),
            )]
        }
        _ => Vec::new(),
    }
}

/// What the kernel says of a mounted filesystem's health: errors ext4
/// counted, a superblock it made read-only under a writable mount (its
/// answer to an error, for ext4's `errors=remount-ro` and btrfs), a root
/// that answers EIO (an xfs shut down). Block filesystems only: a remote
/// one's server is asked elsewhere, within its own deadline.
pub fn troubles(
    m: &dyn crate::mount::Mounter,
    sysfs: &Path,
    path: &Path,
) -> Result<Vec<crate::plugin::health::Finding>> {
    // By the mount table, which needs no answer from the filesystem (a
    // stat of a shut-down one fails).
    let Some(info) = m
        .mounts()?
        .into_iter()
        .rev()
        .find(|i| i.mount_point == path)
    else {
        return Ok(Vec::new());
    };
    if !matches!(
        info.fstype.as_str(),
        "ext4" | "ext3" | "ext2" | "xfs" | "btrfs"
    ) {
        return Ok(Vec::new());
    }
    let root = std::fs::symlink_metadata(path).err();
    let counted = match info.fstype.starts_with("ext") {
        true => ext4_errors(sysfs, &info.dev),
        false => None,
    };
    Ok(verdict(&info, counted, root.as_ref()))
}

/// The errors ext4 counted on the device `major:minor` since it was made
/// or last checked, with when the first one was, from sysfs.
fn ext4_errors(sysfs: &Path, dev: &str) -> Option<(u64, Option<u64>)> {
    let kname = std::fs::canonicalize(sysfs.join("dev/block").join(dev)).ok()?;
    let dir = sysfs.join("fs/ext4").join(kname.file_name()?);
    let read = |f: &str| -> Option<u64> {
        std::fs::read_to_string(dir.join(f))
            .ok()?
            .trim()
            .parse()
            .ok()
    };
    Some((
        read("errors_count")?,
        read("first_error_time").filter(|t| *t > 0),
    ))
}

/// The findings of [`troubles`] from what was read: the mount, ext4's
/// count (and first error's time, seconds since the epoch), and the error
/// a stat of its root met.
pub fn verdict(
    info: &crate::mount::MountInfo,
    ext4_errors: Option<(u64, Option<u64>)>,
    root: Option<&std::io::Error>,
) -> Vec<crate::plugin::health::Finding> {
    use crate::plugin::health::{Finding, Reason};
    let at = info.mount_point.display();
    let mut found = Vec::new();
    if let Some(e) = root.filter(|e| e.raw_os_error() == Some(libc::EIO)) {
        found.push(Finding::inaccessible(
            Reason::FilesystemShutDown,
            format!(
                "the {} filesystem at {at} answers I/O errors ({e}): the kernel shut it down \
                 after errors on its device",
                info.fstype
            ),
        ));
    }
    if let Some((n, first)) = ext4_errors.filter(|(n, _)| *n > 0) {
        let since = first.map_or(String::new(), |t| {
            format!(", the first at {t} (epoch seconds)")
        });
        found.push(Finding::data_loss(
            Reason::FilesystemErrors,
            format!(
                "the ext4 filesystem at {at} recorded {n} error(s){since}: some data may be lost; \
                 stop its pods, unstage it and check it (e2fsck -f) before using it again"
            ),
        ));
    }
    let super_ro = info.super_options.iter().any(|o| o == "ro");
    if super_ro && !info.readonly() {
        found.push(Finding::degraded(
            Reason::FilesystemReadOnly,
            format!(
                "the {} filesystem at {at} was made read-only by the kernel after an error: \
                 writes fail",
                info.fstype
            ),
        ));
    }
    found
}

#[cfg(test)]
mod trouble_tests {
    use super::*;
    use crate::plugin::health::{Reason, Status};

    fn info(line: &str) -> crate::mount::MountInfo {
        crate::mount::parse_mountinfo(line).remove(0)
    }

    #[test]
    fn what_the_kernel_says_of_a_filesystem_is_a_finding() {
        let rw = info("36 35 253:1 / /stage rw,relatime - ext4 /dev/dm-1 rw,errors=remount-ro");
        assert!(verdict(&rw, Some((0, None)), None).is_empty());
        // Errors counted: data may be lost.
        let f = verdict(&rw, Some((3, Some(1_700_000_000))), None);
        assert_eq!(
            (f[0].status, f[0].reason),
            (Status::DataLoss, Reason::FilesystemErrors)
        );
        assert!(f[0].message.contains("3 error(s)") && f[0].message.contains("1700000000"));
        // Made read-only by the kernel under a writable mount.
        let ro = info("36 35 253:1 / /stage rw,relatime - ext4 /dev/dm-1 ro,errors=remount-ro");
        let f = verdict(&ro, None, None);
        assert_eq!(
            (f[0].status, f[0].reason),
            (Status::Degraded, Reason::FilesystemReadOnly)
        );
        // A read-only stage, read-only by asking: nothing wrong.
        let asked = info("36 35 253:1 / /stage ro,relatime - ext4 /dev/dm-1 ro");
        assert!(verdict(&asked, None, None).is_empty());
        // A root that answers EIO: shut down; other errors say nothing.
        let xfs = info("36 35 253:2 / /stage rw,relatime - xfs /dev/dm-2 rw");
        let eio = std::io::Error::from_raw_os_error(libc::EIO);
        let f = verdict(&xfs, None, Some(&eio));
        assert_eq!(
            (f[0].status, f[0].reason),
            (Status::Inaccessible, Reason::FilesystemShutDown)
        );
        let enoent = std::io::Error::from_raw_os_error(libc::ENOENT);
        assert!(verdict(&xfs, None, Some(&enoent)).is_empty());
    }

    /// ext4's count is read from sysfs by the device's kernel name.
    #[test]
    fn ext4_counts_are_read_by_the_device_kernel_name() {
        let sys = tempfile::tempdir().unwrap();
        let blocks = sys.path().join("devices/virtual/block/dm-4");
        std::fs::create_dir_all(&blocks).unwrap();
        std::fs::create_dir_all(sys.path().join("dev/block")).unwrap();
        std::os::unix::fs::symlink(&blocks, sys.path().join("dev/block/253:4")).unwrap();
        let ext4 = sys.path().join("fs/ext4/dm-4");
        std::fs::create_dir_all(&ext4).unwrap();
        std::fs::write(ext4.join("errors_count"), "2\n").unwrap();
        std::fs::write(ext4.join("first_error_time"), "0\n").unwrap();
        assert_eq!(ext4_errors(sys.path(), "253:4"), Some((2, None)));
        assert_eq!(ext4_errors(sys.path(), "253:5"), None);
    }
}
