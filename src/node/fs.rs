//! Filesystems on block devices: probe, format (only when empty), grow.

use crate::error::{Error, Result};
use crate::exec::{path_arg, Command, CommandRunner};
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

/// The filesystem UUID on the device, if blkid finds one.
pub async fn uuid(runner: &dyn CommandRunner, device: &Path) -> Result<Option<String>> {
    let cmd = Command::new("blkid")
        .args(["-p", "-o", "value", "-s", "UUID"])
        .arg(path_arg(device)?)
        .timeout(PROBE_TIMEOUT);
    match runner.run(cmd).await {
        Ok(out) => Ok(Some(out.stdout.trim().to_string()).filter(|u| !u.is_empty())),
        Err(e) if e.exit_code() == Some(2) => Ok(None),
        Err(e) => Err(e.into()),
    }
}

/// The command that gives the filesystem on `device` a new random UUID,
/// for a copy (a restored snapshot, a clone) that still carries its
/// source's. `None` for filesystems without one to change.
pub fn new_uuid_command(fs: &str, device: &Path) -> Result<Option<Command>> {
    let dev = path_arg(device)?;
    Ok(match fs {
        "ext4" | "ext3" | "ext2" => Some(Command::new("tune2fs").args(["-U", "random"]).arg(dev)),
        // Needs a clean log: the caller replays it first (a mount with
        // `nouuid` and an unmount).
        "xfs" => Some(Command::new("xfs_admin").args(["-U", "generate"]).arg(dev)),
        // A new fsid, the metadata UUID kept: quick, whatever the size.
        "btrfs" => Some(Command::new("btrfstune").arg("-m").arg(dev)),
        _ => None,
    }
    .map(|c| c.timeout(GROW_TIMEOUT)))
}

/// Whether a btrfs filesystem holds a tree log (fsync'd writes not yet
/// committed) that a mount must replay: changing its fsid first would
/// make the log unreadable.
pub async fn btrfs_log_pending(runner: &dyn CommandRunner, device: &Path) -> Result<bool> {
    let out = runner
        .run(
            Command::new("btrfs")
                .args(["inspect-internal", "dump-super"])
                .arg(path_arg(device)?)
                .timeout(PROBE_TIMEOUT),
        )
        .await?;
    let root = out
        .stdout
        .lines()
        .find_map(|l| l.strip_prefix("log_root").map(str::trim))
        .ok_or_else(|| Error::internal("btrfs dump-super shows no log_root"))?;
    Ok(root != "0")
}

/// Checks and repairs an ext filesystem so its UUID can change (tune2fs
/// wants a clean, checked filesystem). Exit codes 1 and 2 mean "fixed".
pub async fn check_ext(runner: &dyn CommandRunner, device: &Path) -> Result<()> {
    let cmd = Command::new("e2fsck")
        .args(["-f", "-y"])
        .arg(path_arg(device)?)
        .timeout(MKFS_TIMEOUT);
    match runner.run(cmd).await {
        Ok(_) => Ok(()),
        Err(e) if matches!(e.exit_code(), Some(1) | Some(2)) => Ok(()),
        Err(e) => Err(Error::from(e).context("check the copied filesystem")),
    }
}

/// The volume context key whose value is extra options for mkfs (from a
/// StorageClass parameter of the backend).
pub const MKFS_OPTIONS: &str = "mkfsOptions";

/// Parses extra mkfs options: whitespace-separated, each an option
/// (`-x`, `-x=v`, `--long`) or a plain value, of letters, digits and
/// `=,._:-` only, at most 16 of them. Nothing from a request reaches mkfs
/// otherwise.
pub fn mkfs_options(text: &str) -> Result<Vec<String>> {
    let words: Vec<String> = text.split_whitespace().map(str::to_string).collect();
    if words.len() > 16
        || words.iter().any(|w| {
            w.len() > 64
                || !w
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"=,._:-".contains(&b))
        })
    {
        return Err(Error::invalid(
            "mkfsOptions: at most 16 words of letters, digits and =,._:- (no paths)",
        ));
    }
    Ok(words)
}

/// Formats the device with `fs` unless it already holds something. A device
/// holding another filesystem is an error, never formatted over. `extra`
/// comes from [`mkfs_options`].
pub async fn format_if_unformatted(
    runner: &dyn CommandRunner,
    device: &Path,
    fs: &str,
    extra: &[String],
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
                    .args(extra.iter().cloned())
                    .arg(dev),
                "xfs" => Command::new("mkfs.xfs")
                    .args(["-q"])
                    .args(extra.iter().cloned())
                    .arg(dev),
                "btrfs" => Command::new("mkfs.btrfs")
                    .args(["-q"])
                    .args(extra.iter().cloned())
                    .arg(dev),
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
mod mkfs_option_tests {
    use super::*;

    #[test]
    fn mkfs_options_are_words_without_paths() {
        assert_eq!(
            mkfs_options(" -E  lazy_itable_init=0,nodiscard -N 4096 ").unwrap(),
            ["-E", "lazy_itable_init=0,nodiscard", "-N", "4096"]
        );
        assert!(mkfs_options("").unwrap().is_empty());
        for bad in ["-d /etc/passwd", "-O $(reboot)", "a;b", "x\\y"] {
            assert!(mkfs_options(bad).is_err(), "{bad}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::exec::{FakeRunner, Reply};

    #[tokio::test]
    async fn formats_only_empty_devices() {
        let r = FakeRunner::new();
        r.expect("blkid", Reply::Fail(2, String::new()));
        r.ok("mkfs.ext4");
        assert!(
            format_if_unformatted(&r, Path::new("/dev/loop1"), "ext4", &[])
                .await
                .unwrap()
        );
        assert_eq!(
            r.lines(),
            vec![
                "blkid -p -o export /dev/loop1",
                "mkfs.ext4 -F -q -m 0 /dev/loop1"
            ]
        );

        let r = FakeRunner::new();
        r.expect("blkid", Reply::Ok("DEVNAME=/dev/loop1\nTYPE=ext4\n".into()));
        assert!(
            !format_if_unformatted(&r, Path::new("/dev/loop1"), "ext4", &[])
                .await
                .unwrap()
        );
        assert_eq!(r.calls().len(), 1);
    }

    #[tokio::test]
    async fn never_formats_over_other_data() {
        for out in ["TYPE=xfs\n", "PTTYPE=gpt\n", "DEVNAME=/dev/x\n"] {
            let r = FakeRunner::new();
            r.expect("blkid", Reply::Ok(out.into()));
            let err = format_if_unformatted(&r, Path::new("/dev/loop1"), "ext4", &[])
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
        assert!(
            format_if_unformatted(&r, Path::new("/dev/loop1"), "ext4", &[])
                .await
                .is_err()
        );
        assert_eq!(r.calls().len(), 1);
    }

    #[tokio::test]
    async fn grow_uses_the_right_tool() {
        let r = FakeRunner::new();
        r.ok("resize2fs").ok("xfs_growfs");
        grow(&r, "ext4", Path::new("/dev/loop2"), Path::new("/s"))
            .await
            .unwrap();
        grow(&r, "xfs", Path::new("/dev/loop2"), Path::new("/s"))
            .await
            .unwrap();
        assert_eq!(r.lines(), vec!["resize2fs /dev/loop2", "xfs_growfs /s"]);
    }
}
