//! Hold devices: a device-mapper `linear` device over a block device, as
//! large as it, through which the device is served. Suspending the hold
//! (a dm suspend) lets what is in flight finish and makes what comes next
//! wait, flushes included, until it is resumed: several holds suspended one
//! after another keep every write that was acknowledged as durable before
//! the first on its devices, and none that a writer issued after. The
//! iscsi backend serves its LUNs through them, so that a group snapshot
//! holds every member's writers (remote initiators) while the store
//! snapshots each member.
//!
//! Holds are named `fvh-<32 hex>` from a key of the caller's; a hold of
//! that name mapping another device is the driver's own leftover, mended
//! only while nothing has it open. A suspended hold never outlives its
//! holder for long: the caller resumes it, and [`Holds::resume_ours`]
//! resumes those of its own a driver that died left suspended (run at
//! start).
//!
//! Holds are used only where the kernel has device-mapper loaded; elsewhere
//! the device is served directly.

use crate::error::{Error, Result};
use crate::exec::{Command, CommandRunner, ExecError};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

const PREFIX: &str = "fvh-";
const DMSETUP_TIMEOUT: Duration = Duration::from_secs(30);

/// What a failed command said on stderr.
pub(crate) fn stderr(e: &ExecError) -> &str {
    match e {
        ExecError::Failed { output, .. } => &output.stderr,
        _ => "",
    }
}

/// Whether dmsetup failed because the device it was asked about does not
/// exist.
pub(crate) fn no_such_map(e: &ExecError) -> bool {
    stderr(e).contains("No such device") || stderr(e).contains("does not exist")
}

/// Whether `name` is `prefix` and 32 hex digits: the names the driver
/// gives its device-mapper devices (from a digest of a key of its own).
pub(crate) fn is_hashed_name(prefix: &str, name: &str) -> bool {
    name.strip_prefix(prefix)
        .is_some_and(|h| h.len() == 32 && h.chars().all(|c| c.is_ascii_hexdigit()))
}

/// The hold devices of one backend.
#[derive(Clone)]
pub struct Holds {
    runner: Arc<dyn CommandRunner>,
    sysfs: PathBuf,
}

impl Holds {
    pub fn new(runner: Arc<dyn CommandRunner>) -> Self {
        Holds {
            runner,
            sysfs: "/sys".into(),
        }
    }

    /// Another `sys` root (tests).
    pub fn with_sysfs(mut self, sysfs: &Path) -> Self {
        self.sysfs = sysfs.to_path_buf();
        self
    }

    /// Whether this host's kernel has device-mapper loaded (its misc
    /// device registered; a control node alone may be a leftover).
    pub fn available() -> bool {
        Path::new("/sys/class/misc/device-mapper").exists()
    }

    /// The hold's name for `key` (a volume's own string).
    pub fn name_for(key: &str) -> String {
        format!("{PREFIX}{}", crate::id::digest_hex(key.as_bytes(), 16))
    }

    /// Where the hold `name` is served from.
    pub fn path(name: &str) -> PathBuf {
        Path::new("/dev/mapper").join(name)
    }

    fn dmsetup(&self) -> Command {
        Command::new("dmsetup").timeout(DMSETUP_TIMEOUT)
    }

    fn check_name(name: &str) -> Result<()> {
        if is_hashed_name(PREFIX, name) {
            Ok(())
        } else {
            Err(Error::internal(format!("{name:?} is not a hold's name")))
        }
    }

    /// The linear table mapping all of `device`.
    fn table_for(&self, device: &Path) -> Result<String> {
        use std::os::unix::fs::MetadataExt;
        let rdev = std::fs::metadata(device)
            .map_err(|e| Error::io(format!("stat {}", device.display()), e))?
            .rdev();
        let (major, minor) = (libc::major(rdev), libc::minor(rdev));
        let size = self.sysfs.join(format!("dev/block/{major}:{minor}/size"));
        let sectors: u64 = std::fs::read_to_string(&size)
            .map_err(|e| Error::io(format!("read {}", size.display()), e))?
            .trim()
            .parse()
            .map_err(|_| Error::internal(format!("{}: not a sector count", size.display())))?;
        if sectors == 0 {
            return Err(Error::internal(format!("{} is empty", device.display())));
        }
        Ok(format!("0 {sectors} linear {major}:{minor} 0"))
    }

    /// The hold's table now, or None when there is no such device.
    async fn table(&self, name: &str) -> Result<Option<String>> {
        match self.runner.run(self.dmsetup().args(["table", name])).await {
            Ok(out) => Ok(Some(out.stdout.trim().to_string())),
            Err(e) if no_such_map(&e) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    async fn open_count(&self, name: &str) -> Result<u64> {
        let out = self
            .runner
            .run(
                self.dmsetup()
                    .args(["info", "-c", "--noheadings", "-o", "open", name]),
            )
            .await?;
        out.stdout
            .trim()
            .parse()
            .map_err(|_| Error::internal(format!("dmsetup info {name}: {:?}", out.stdout)))
    }

    /// Makes hold `name` over `device` (or finds it made), sized to it
    /// now; it is served from [`Holds::path`].
    pub async fn ensure(&self, name: &str, device: &Path) -> Result<()> {
        Self::check_name(name)?;
        let want = self.table_for(device)?;
        match self.table(name).await? {
            Some(t) if t == want => {}
            Some(t) => {
                // Ours by name, over another device or size: mended only
                // while nothing uses it.
                if self.open_count(name).await? > 0 {
                    return Err(Error::precondition(format!(
                        "hold device {name} maps {t:?}, not {}, and is in use",
                        device.display()
                    )));
                }
                self.reload(name, &want).await?;
            }
            None => {
                self.runner
                    .run(self.dmsetup().args(["create", name, "--table", &want]))
                    .await?;
            }
        }
        Ok(())
    }

    async fn reload(&self, name: &str, table: &str) -> Result<()> {
        self.runner
            .run(self.dmsetup().args(["reload", name, "--table", table]))
            .await?;
        self.resume(name).await
    }

    /// Sizes hold `name` to `device` again (after the device grew).
    pub async fn resize(&self, name: &str, device: &Path) -> Result<()> {
        Self::check_name(name)?;
        let want = self.table_for(device)?;
        if self.table(name).await?.as_deref() == Some(want.as_str()) {
            return Ok(());
        }
        self.reload(name, &want).await
    }

    /// Removes hold `name`; one that is not there is no error. A device
    /// that is busy for a moment after its user let go (udev or multipath
    /// still probing it: seen on a busy machine right after tgtd closed
    /// a LUN's hold) is asked again for a few seconds (`--retry`) before
    /// the call fails.
    pub async fn remove(&self, name: &str) -> Result<()> {
        Self::check_name(name)?;
        if self.table(name).await?.is_none() {
            return Ok(());
        }
        self.runner
            .run(self.dmsetup().args(["remove", "--retry", name]))
            .await?;
        Ok(())
    }

    /// Holds the I/O to `name`: what is in flight finishes first.
    pub async fn suspend(&self, name: &str) -> Result<()> {
        Self::check_name(name)?;
        self.runner
            .run(self.dmsetup().args(["suspend", name]))
            .await?;
        Ok(())
    }

    /// Lets the I/O to `name` go.
    pub async fn resume(&self, name: &str) -> Result<()> {
        Self::check_name(name)?;
        self.runner
            .run(self.dmsetup().args(["resume", name]))
            .await?;
        Ok(())
    }

    /// Resumes the holds among `ours` left suspended (a driver that died
    /// holding them); answers their names. A suspended hold not in `ours`
    /// is another driver's (another backend, or another driver on this
    /// host, in the middle of its own group snapshot): left as it is.
    pub async fn resume_ours(
        &self,
        ours: &std::collections::BTreeSet<String>,
    ) -> Result<Vec<String>> {
        let out = match self
            .runner
            .run(self.dmsetup().args([
                "info",
                "-c",
                "--noheadings",
                "--separator",
                " ",
                "-o",
                "name,suspended",
            ]))
            .await
        {
            Ok(out) => out,
            // No devices at all.
            Err(e) if stderr(&e).contains("No devices found") => return Ok(Vec::new()),
            Err(e) => return Err(e.into()),
        };
        let mut resumed = Vec::new();
        for line in out.stdout.lines() {
            let mut f = line.split_whitespace();
            let (Some(name), Some(state)) = (f.next(), f.next()) else {
                continue;
            };
            if state == "Suspended" && Self::check_name(name).is_ok() && ours.contains(name) {
                self.resume(name).await?;
                resumed.push(name.to_string());
            }
        }
        Ok(resumed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::exec::{FakeRunner, Reply};

    fn fixture(root: &Path) -> PathBuf {
        // A "device": a regular file standing for it cannot carry a device
        // number, so the test uses /dev/null's (1:3) and a sysfs entry.
        let sys = root.join("sys/dev/block/1:3");
        std::fs::create_dir_all(&sys).unwrap();
        std::fs::write(sys.join("size"), "2048\n").unwrap();
        PathBuf::from("/dev/null")
    }

    #[tokio::test]
    async fn holds_are_made_once_mended_only_when_unused_resized_removed_and_resumed_after_a_crash()
    {
        let root = tempfile::tempdir().unwrap();
        let device = fixture(root.path());
        let r = Arc::new(FakeRunner::new());
        let holds = Holds::new(r.clone()).with_sysfs(&root.path().join("sys"));
        let name = Holds::name_for("iqn.2026-01.io.ferrovol:v1");
        assert!(name.starts_with("fvh-") && name.len() == 36, "{name}");
        assert_eq!(name, Holds::name_for("iqn.2026-01.io.ferrovol:v1"));
        let table = "0 2048 linear 1:3 0";

        // Not there: made.
        r.expect(
            "dmsetup",
            Reply::Fail(
                1,
                "device-mapper: table ioctl on x failed: No such device or address".into(),
            ),
        )
        .ok("dmsetup");
        holds.ensure(&name, &device).await.unwrap();
        assert_eq!(Holds::path(&name), Path::new("/dev/mapper").join(&name));
        // There with this table: nothing run but the look.
        r.expect("dmsetup", Reply::Ok(format!("{table}\n")));
        holds.ensure(&name, &device).await.unwrap();
        // Another table, unused: reloaded and resumed.
        r.expect("dmsetup", Reply::Ok("0 1024 linear 7:0 0\n".into()))
            .expect("dmsetup", Reply::Ok("0\n".into()))
            .ok("dmsetup")
            .ok("dmsetup");
        holds.ensure(&name, &device).await.unwrap();
        // Another table, in use: refused, nothing changed.
        r.expect("dmsetup", Reply::Ok("0 1024 linear 7:0 0\n".into()))
            .expect("dmsetup", Reply::Ok("1\n".into()));
        let e = holds.ensure(&name, &device).await.unwrap_err();
        assert!(e.message.contains("in use"), "{e:?}");
        // Left suspended by a driver that died: resumed; others' devices
        // are not touched, nor another driver's hold suspended meanwhile.
        let theirs = Holds::name_for("another driver's volume");
        r.expect(
            "dmsetup",
            Reply::Ok(format!(
                "{name} Suspended\nvg-lv Suspended\n{name}x Active\n{theirs} Suspended\n"
            )),
        )
        .ok("dmsetup");
        let ours = std::collections::BTreeSet::from([name.clone()]);
        assert_eq!(holds.resume_ours(&ours).await.unwrap(), vec![name.clone()]);
        let lines = r.lines();
        let tail: Vec<&String> = lines.iter().rev().take(2).collect();
        assert_eq!(tail[0], &format!("dmsetup resume {name}"), "{lines:#?}");
        assert!(
            lines.contains(&format!("dmsetup create {name} --table {table}")),
            "{lines:#?}"
        );
        assert!(
            lines.contains(&format!("dmsetup reload {name} --table {table}")),
            "{lines:#?}"
        );
        assert!(!lines
            .iter()
            .any(|l| (l.contains("vg-lv") || l.contains(&theirs)) && l.contains("resume")));
        // Grown: reloaded at the new size and resumed; the same size:
        // nothing but the look.
        std::fs::write(root.path().join("sys/dev/block/1:3/size"), "4096\n").unwrap();
        r.expect("dmsetup", Reply::Ok(format!("{table}\n")))
            .ok("dmsetup")
            .ok("dmsetup");
        holds.resize(&name, &device).await.unwrap();
        let grown = "0 4096 linear 1:3 0";
        assert!(r
            .lines()
            .contains(&format!("dmsetup reload {name} --table {grown}")));
        let before = r.lines().len();
        r.expect("dmsetup", Reply::Ok(format!("{grown}\n")));
        holds.resize(&name, &device).await.unwrap();
        assert_eq!(r.lines().len(), before + 1);
        // Removed when there; gone already: no error, nothing removed.
        r.expect("dmsetup", Reply::Ok(format!("{grown}\n")))
            .ok("dmsetup");
        holds.remove(&name).await.unwrap();
        assert_eq!(
            r.lines().last().unwrap(),
            &format!("dmsetup remove --retry {name}")
        );
        r.expect(
            "dmsetup",
            Reply::Fail(1, "Device does not exist.\nCommand failed.".into()),
        );
        holds.remove(&name).await.unwrap();
        assert!(r.lines().last().unwrap().starts_with("dmsetup table"));
        // Names not of a hold are refused before anything runs.
        let before = r.lines().len();
        assert!(holds.suspend("vg-lv").await.is_err());
        assert!(holds.remove("../x").await.is_err());
        assert_eq!(r.lines().len(), before);
    }
}
