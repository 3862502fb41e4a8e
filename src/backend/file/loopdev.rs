//! Loop devices over image files: attach, find, refresh and detach through
//! `losetup` (exec seam), with attachments read from sysfs.

use crate::error::{Error, Result};
use crate::exec::{path_arg, Command, CommandRunner};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

const LOSETUP_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a detach may take to be final.
const DETACH_WAIT: Duration = Duration::from_secs(10);

/// Loop device management rooted at a sysfs path (tests use a fixture tree).
#[derive(Clone)]
pub struct LoopDevices {
    runner: Arc<dyn CommandRunner>,
    sysfs_block: PathBuf,
}

impl LoopDevices {
    pub fn new(runner: Arc<dyn CommandRunner>) -> Self {
        Self::with_sysfs(runner, "/sys/block")
    }

    pub fn with_sysfs(runner: Arc<dyn CommandRunner>, sysfs_block: impl Into<PathBuf>) -> Self {
        Self {
            runner,
            sysfs_block: sysfs_block.into(),
        }
    }

    /// The loop device currently backed by `image`, if any.
    pub fn find(&self, image: &Path) -> Option<PathBuf> {
        let entries = std::fs::read_dir(&self.sysfs_block).ok()?;
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if !name.starts_with("loop") {
                continue;
            }
            let Ok(backing) = std::fs::read_to_string(entry.path().join("loop/backing_file"))
            else {
                continue;
            };
            if backing_path(&backing) == image {
                return Some(PathBuf::from("/dev").join(name));
            }
        }
        None
    }

    /// Whether `device` is a loop device backed by `image`.
    pub fn backs(&self, device: &Path, image: &Path) -> bool {
        let Some(name) = device.file_name() else {
            return false;
        };
        std::fs::read_to_string(self.sysfs_block.join(name).join("loop/backing_file"))
            .map(|b| backing_path(&b) == image)
            .unwrap_or(false)
    }

    /// The loop device for `image`, attaching one if none exists.
    pub async fn attach(&self, image: &Path) -> Result<PathBuf> {
        if let Some(dev) = self.find(image) {
            return Ok(dev);
        }
        self.losetup_new("--nooverlap", image).await
    }

    /// A new read-only loop device over `backing` (a block device): what a
    /// read-only publish of a raw block volume hands out, since a read-only
    /// bind of a device node does not stop writes through it.
    pub async fn attach_read_only(&self, backing: &Path) -> Result<PathBuf> {
        self.losetup_new("--read-only", backing).await
    }

    /// `losetup --find --show <flag> <backing>`: the new device's path.
    async fn losetup_new(&self, flag: &str, backing: &Path) -> Result<PathBuf> {
        let out = self
            .runner
            .run(
                Command::new("losetup")
                    .args(["--find", "--show", flag])
                    .arg(path_arg(backing)?)
                    .timeout(LOSETUP_TIMEOUT),
            )
            .await?;
        let dev = PathBuf::from(out.stdout.trim());
        if !dev.starts_with("/dev") {
            return Err(Error::internal(format!(
                "losetup printed an unexpected device {:?}",
                out.stdout.trim()
            )));
        }
        Ok(dev)
    }

    /// Detaches `device` if it is a read-only loop device over `backing`
    /// ([`LoopDevices::attach_read_only`]); anything else is left alone.
    pub async fn detach_read_only(&self, device: &Path, backing: &Path) -> Result<()> {
        let ro = device
            .file_name()
            .and_then(|n| std::fs::read_to_string(self.sysfs_block.join(n).join("ro")).ok())
            .is_some_and(|v| v.trim() == "1");
        if !ro || !self.backs(device, backing) {
            return Ok(());
        }
        self.detach_and_wait(device, backing).await
    }

    /// Detaches `device` if it still backs `image`; otherwise nothing to do.
    /// Waits until the kernel has really let go: a loop device still open
    /// somewhere is only marked for detach (autoclear), and the image must
    /// not be treated as free before it is.
    pub async fn detach(&self, device: &Path, image: &Path) -> Result<()> {
        if !self.backs(device, image) {
            // Also catch a device re-attached under another name.
            match self.find(image) {
                Some(other) => return Box::pin(self.detach(&other, image)).await,
                None => return Ok(()),
            }
        }
        self.detach_and_wait(device, image).await
    }

    async fn detach_and_wait(&self, device: &Path, image: &Path) -> Result<()> {
        self.runner
            .run(
                Command::new("losetup")
                    .arg("--detach")
                    .arg(path_arg(device)?)
                    .timeout(LOSETUP_TIMEOUT),
            )
            .await?;
        let deadline = std::time::Instant::now() + DETACH_WAIT;
        while self.backs(device, image) {
            if std::time::Instant::now() > deadline {
                return Err(Error::new(
                    crate::error::Kind::Unavailable,
                    format!("{} is still busy after detach; it will be released when its last user closes it", device.display()),
                ));
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        Ok(())
    }

    /// Makes the device see its image's new size; returns the size in bytes.
    pub async fn refresh(&self, device: &Path) -> Result<u64> {
        self.runner
            .run(
                Command::new("losetup")
                    .arg("--set-capacity")
                    .arg(path_arg(device)?)
                    .timeout(LOSETUP_TIMEOUT),
            )
            .await?;
        self.size(device)
    }

    /// The device's size in bytes, from sysfs.
    pub fn size(&self, device: &Path) -> Result<u64> {
        let name = device
            .file_name()
            .ok_or_else(|| Error::internal("device path has no name"))?;
        let path = self.sysfs_block.join(name).join("size");
        let sectors: u64 = std::fs::read_to_string(&path)
            .map_err(|e| Error::io(format!("read {}", path.display()), e))?
            .trim()
            .parse()
            .map_err(|_| Error::internal(format!("unreadable {}", path.display())))?;
        Ok(sectors * 512)
    }
}

/// The image path in a sysfs `backing_file`. An image deleted while
/// attached reads `<path> (deleted)`: it is still that image's device, and
/// must still be found so it can be released.
fn backing_path(text: &str) -> &Path {
    let t = text.trim_end_matches('\n');
    Path::new(t.strip_suffix(" (deleted)").unwrap_or(t))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::exec::{FakeRunner, Reply};

    fn fixture() -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let block = dir.path().join("block");
        for (name, backing, size) in [
            ("loop0", "/pool/a.img\n", "2048"),
            ("loop1", "/pool/b.img\n", "4096"),
            ("sda", "", "1"),
        ] {
            let d = block.join(name);
            std::fs::create_dir_all(d.join("loop")).unwrap();
            std::fs::write(d.join("size"), size).unwrap();
            if !backing.is_empty() {
                std::fs::write(d.join("loop/backing_file"), backing).unwrap();
            }
        }
        (dir, block)
    }

    #[tokio::test]
    async fn finds_existing_attachment_without_running_losetup() {
        let (_d, block) = fixture();
        let runner = Arc::new(FakeRunner::new());
        let loops = LoopDevices::with_sysfs(runner.clone(), &block);
        assert_eq!(
            loops.attach(Path::new("/pool/b.img")).await.unwrap(),
            PathBuf::from("/dev/loop1")
        );
        assert!(runner.calls().is_empty());
        assert_eq!(loops.size(Path::new("/dev/loop1")).unwrap(), 4096 * 512);
    }

    #[tokio::test]
    async fn attaches_new_image_with_losetup() {
        let (_d, block) = fixture();
        let runner = Arc::new(FakeRunner::new());
        runner.expect("losetup", Reply::Ok("/dev/loop7\n".into()));
        let loops = LoopDevices::with_sysfs(runner.clone(), &block);
        assert_eq!(
            loops.attach(Path::new("/pool/c.img")).await.unwrap(),
            PathBuf::from("/dev/loop7")
        );
        assert_eq!(
            runner.lines(),
            vec!["losetup --find --show --nooverlap /pool/c.img"]
        );
    }

    #[tokio::test]
    async fn detach_only_touches_our_device() {
        let (_d, block) = fixture();
        let runner = Arc::new(FakeRunner::new());
        let loops = LoopDevices::with_sysfs(runner.clone(), &block);
        // loop0 backs a.img, not c.img: nothing to detach.
        loops
            .detach(Path::new("/dev/loop0"), Path::new("/pool/c.img"))
            .await
            .unwrap();
        assert!(runner.calls().is_empty());
        // The recorded device moved: the one really backing b.img is
        // detached, and detach waits until the kernel lets go of it.
        let backing = block.join("loop1/loop/backing_file");
        runner.ok("losetup");
        let released = Arc::new(std::sync::atomic::AtomicBool::new(false));
        // The kernel lets go only after losetup ran (and a while later).
        let release = {
            let (runner, released) = (runner.clone(), released.clone());
            tokio::spawn(async move {
                while runner.calls().is_empty() {
                    tokio::task::yield_now().await;
                }
                for _ in 0..5 {
                    tokio::task::yield_now().await;
                }
                released.store(true, std::sync::atomic::Ordering::SeqCst);
                std::fs::remove_file(backing).unwrap();
            })
        };
        loops
            .detach(Path::new("/dev/loop0"), Path::new("/pool/b.img"))
            .await
            .unwrap();
        assert!(
            released.load(std::sync::atomic::Ordering::SeqCst),
            "returned before the device was released"
        );
        release.await.unwrap();
        assert_eq!(runner.lines(), vec!["losetup --detach /dev/loop1"]);
    }

    #[tokio::test]
    async fn losetup_failure_is_reported_with_stderr() {
        let (_d, block) = fixture();
        let runner = Arc::new(FakeRunner::new());
        runner.expect(
            "losetup",
            Reply::Fail(1, "losetup: cannot find an unused loop device".into()),
        );
        let loops = LoopDevices::with_sysfs(runner, &block);
        let err = loops.attach(Path::new("/pool/z.img")).await.unwrap_err();
        assert!(
            err.message.contains("cannot find an unused loop device"),
            "{}",
            err.message
        );
    }
}
