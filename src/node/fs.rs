//! Filesystems on block devices: probe, format (only when empty), grow.

use crate::backend::loopdev::path_arg;
use crate::error::{Error, Result};
use crate::exec::{Command, CommandRunner};
use std::path::Path;
use std::time::Duration;

/// Used when a stage record predates its fs type.
pub const DEFAULT_FS: &str = "ext4";

const PROBE_TIMEOUT: Duration = Duration::from_secs(30);
const MKFS_TIMEOUT: Duration = Duration::from_secs(600);
const GROW_TIMEOUT: Duration = Duration::from_secs(600);

/// What is on the device: a filesystem (or other signature) type, or `None`
/// when blkid finds nothing at all.
pub async fn probe(runner: &dyn CommandRunner, device: &Path) -> Result<Option<String>> {
    let cmd = Command::new("blkid")
        .args(["-p", "-o", "export"])
        .arg(path_arg(device)?)
        .timeout(PROBE_TIMEOUT);
    match runner.run(cmd).await {
        Ok(out) => {
            let value = |key: &str| {
                out.stdout
                    .lines()
                    .find_map(|l| l.strip_prefix(key).map(str::to_string))
                    .filter(|v| !v.is_empty())
            };
            // A partition table or other non-filesystem signature still
            // counts as "not empty": we never format over it.
            Ok(value("TYPE=")
                .or_else(|| value("PTTYPE=").map(|p| format!("partition table {p}")))
                .or(Some("unknown data".into())))
        }
        // blkid exits 2 when it finds no signature: an empty device.
        Err(e) if e.exit_code() == Some(2) => Ok(None),
        Err(e) => Err(e.into()),
    }
}

/// Formats the device with `fs` unless it already holds something. A device
/// holding another filesystem is an error, never formatted over.
pub async fn format_if_unformatted(
    runner: &dyn CommandRunner,
    device: &Path,
    fs: &str,
) -> Result<bool> {
    match probe(runner, device).await? {
        Some(found) if found == fs => Ok(false),
        Some(found) => Err(Error::precondition(format!(
            "{} already holds {found}, not {fs}: refusing to format it",
            device.display()
        ))),
        None => {
            let dev = path_arg(device)?;
            let cmd = match fs {
                "ext4" | "ext3" => Command::new(format!("mkfs.{fs}"))
                    .args(["-F", "-q", "-m", "0"])
                    .arg(dev),
                "xfs" => Command::new("mkfs.xfs").args(["-q"]).arg(dev),
                "btrfs" => Command::new("mkfs.btrfs").args(["-q"]).arg(dev),
                other => return Err(Error::invalid(format!("cannot format {other}"))),
            };
            runner.run(cmd.timeout(MKFS_TIMEOUT)).await?;
            Ok(true)
        }
    }
}

/// Grows the filesystem on `device`, mounted at `mount_point`, to fill it.
pub async fn grow(
    runner: &dyn CommandRunner,
    fs: &str,
    device: &Path,
    mount_point: &Path,
) -> Result<()> {
    let cmd = match fs {
        "ext4" | "ext3" => Command::new("resize2fs").arg(path_arg(device)?),
        "xfs" => Command::new("xfs_growfs").arg(path_arg(mount_point)?),
        "btrfs" => Command::new("btrfs")
            .args(["filesystem", "resize", "max"])
            .arg(path_arg(mount_point)?),
        other => return Err(Error::invalid(format!("cannot grow {other}"))),
    };
    runner.run(cmd.timeout(GROW_TIMEOUT)).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::exec::{FakeRunner, Reply};

    #[tokio::test]
    async fn formats_only_empty_devices() {
        let r = FakeRunner::new();
        r.expect("blkid", Reply::Fail(2, String::new()));
        assert!(format_if_unformatted(&r, Path::new("/dev/loop1"), "ext4")
            .await
            .unwrap());
        assert_eq!(
            r.lines(),
            vec![
                "blkid -p -o export /dev/loop1",
                "mkfs.ext4 -F -q -m 0 /dev/loop1"
            ]
        );

        let r = FakeRunner::new();
        r.expect("blkid", Reply::Ok("DEVNAME=/dev/loop1\nTYPE=ext4\n".into()));
        assert!(!format_if_unformatted(&r, Path::new("/dev/loop1"), "ext4")
            .await
            .unwrap());
        assert_eq!(r.calls().len(), 1);
    }

    #[tokio::test]
    async fn never_formats_over_other_data() {
        for out in ["TYPE=xfs\n", "PTTYPE=gpt\n", "DEVNAME=/dev/x\n"] {
            let r = FakeRunner::new();
            r.expect("blkid", Reply::Ok(out.into()));
            let err = format_if_unformatted(&r, Path::new("/dev/loop1"), "ext4")
                .await
                .unwrap_err();
            assert_eq!(err.kind, crate::error::Kind::FailedPrecondition, "{out}");
            assert_eq!(r.calls().len(), 1, "ran mkfs over {out}");
        }
    }

    #[tokio::test]
    async fn probe_errors_other_than_empty_are_errors() {
        let r = FakeRunner::new();
        r.expect("blkid", Reply::Fail(4, "blkid: cannot open".into()));
        assert!(format_if_unformatted(&r, Path::new("/dev/loop1"), "ext4")
            .await
            .is_err());
        assert_eq!(r.calls().len(), 1);
    }

    #[tokio::test]
    async fn grow_uses_the_right_tool() {
        let r = FakeRunner::new();
        grow(&r, "ext4", Path::new("/dev/loop2"), Path::new("/s"))
            .await
            .unwrap();
        grow(&r, "xfs", Path::new("/dev/loop2"), Path::new("/s"))
            .await
            .unwrap();
        assert_eq!(r.lines(), vec!["resize2fs /dev/loop2", "xfs_growfs /s"]);
    }
}
