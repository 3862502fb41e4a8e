//! Filesystems on block devices: probe, format (only when empty), grow.

use crate::error::{Error, Result};
use crate::exec::{path_arg, Command, CommandRunner};
use crate::host::Host;
use std::path::Path;
use std::sync::Arc;
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

/// What an allowed mkfs option takes as its value (the next word).
#[derive(Clone, Copy)]
enum Takes {
    /// Nothing: a flag.
    Nothing,
    /// A size or count: digits, with a unit suffix.
    Number,
    /// A filesystem label.
    Label,
    /// One of these words.
    OneOf(&'static [&'static str]),
    /// A comma-separated list of these keys, each bare or `key=value`
    /// (a value of letters, digits and `._-:`, never a path).
    Keys(&'static [&'static str]),
    /// A comma-separated list of feature names (`^name` turns one off).
    Features,
}
use Takes::{Features, Keys, Label, Nothing, Number, OneOf};

/// The mkfs options a StorageClass may add, reviewed one by one per mkfs:
/// sizes, counts, layout and feature switches. Nothing that names a file
/// or directory (mke2fs `-d`, `-E root_owner`, `-J device=`, `-l`, `-z`;
/// mkfs.xfs `-p`, `-c`, `-d file=,name=`, `-l logdev=`, `-r`; mkfs.btrfs
/// `-r`), sets a UUID (the driver keeps copies' UUIDs apart), runs
/// something else (mke2fs `-c` runs badblocks) or makes the kernel panic
/// on an error (mke2fs `-e panic`) is here.
fn allowed_mkfs_options(fs: &str) -> &'static [(&'static str, Takes)] {
    match fs {
        "ext4" | "ext3" => EXT4_OPTIONS,
        "xfs" => XFS_OPTIONS,
        "btrfs" => BTRFS_OPTIONS,
        _ => &[],
    }
}

const EXT4_OPTIONS: &[(&str, Takes)] = &[
    ("-b", Number),
    ("-C", Number),
    ("-i", Number),
    ("-I", Number),
    ("-N", Number),
    ("-m", Number),
    ("-g", Number),
    ("-G", Number),
    ("-j", Nothing),
    ("-L", Label),
    ("-O", Features),
    (
        "-T",
        OneOf(&[
            "default",
            "floppy",
            "small",
            "big",
            "huge",
            "news",
            "largefile",
            "largefile4",
            "hurd",
        ]),
    ),
    ("-e", OneOf(&["continue", "remount-ro"])),
    ("-J", Keys(&["size", "fast_commit_size"])),
    (
        "-E",
        Keys(&[
            "stride",
            "stripe_width",
            "stripe-width",
            "lazy_itable_init",
            "lazy_journal_init",
            "packed_meta_blocks",
            "num_backup_sb",
            "resize",
            "discard",
            "nodiscard",
            "quotatype",
            "encoding",
            "encoding_flags",
            "assume_storage_prezeroed",
            "orphan_file_size",
        ]),
    ),
];

const XFS_OPTIONS: &[(&str, Takes)] = &[
    ("-b", Keys(&["size"])),
    ("-s", Keys(&["size"])),
    (
        "-m",
        Keys(&[
            "crc",
            "finobt",
            "rmapbt",
            "reflink",
            "inobtcount",
            "bigtime",
        ]),
    ),
    (
        "-d",
        Keys(&[
            "agcount", "agsize", "su", "sw", "sunit", "swidth", "noalign",
        ]),
    ),
    (
        "-i",
        Keys(&["size", "maxpct", "align", "perblock", "sparse", "nrext64"]),
    ),
    (
        "-l",
        Keys(&["size", "version", "su", "sunit", "lazy-count"]),
    ),
    ("-n", Keys(&["size", "version", "ftype"])),
    ("-L", Label),
    ("-K", Nothing),
];

const BTRFS_OPTIONS: &[(&str, Takes)] = &[
    ("-L", Label),
    ("-n", Number),
    ("-s", Number),
    ("-m", OneOf(&["single", "dup"])),
    ("-d", OneOf(&["single", "dup"])),
    ("-O", Features),
    ("-R", Features),
    ("-K", Nothing),
    ("-M", Nothing),
    ("--csum", OneOf(&["crc32c", "xxhash", "sha256", "blake2"])),
];

fn plain_value(v: &str) -> bool {
    !v.is_empty()
        && v.len() <= 64
        && !v.starts_with('-')
        && v.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-:".contains(&b))
}

fn value_ok(takes: Takes, v: &str) -> bool {
    match takes {
        Takes::Nothing => false,
        Takes::Number => {
            let digits = v.trim_end_matches(|c: char| "kKmMgGtTsb".contains(c));
            !digits.is_empty()
                && digits.len() + 1 >= v.len()
                && digits.bytes().all(|b| b.is_ascii_digit())
        }
        Takes::Label => v.len() <= 16 && plain_value(v),
        Takes::OneOf(words) => words.contains(&v),
        Takes::Keys(keys) => v.split(',').all(|item| {
            let (k, val) = item.split_once('=').unwrap_or((item, ""));
            keys.contains(&k) && (val.is_empty() && !item.contains('=') || plain_value(val))
        }),
        Takes::Features => v.split(',').all(|f| {
            let f = f.strip_prefix('^').unwrap_or(f);
            !f.is_empty() && f.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
        }),
    }
}

/// Checks `words` against the reviewed options of one mkfs.
fn check_mkfs_words(fs: &str, words: &[String]) -> std::result::Result<(), String> {
    let allowed = allowed_mkfs_options(fs);
    let mut i = 0;
    while i < words.len() {
        let option = &words[i];
        let Some((_, takes)) = allowed.iter().find(|(o, _)| o == option) else {
            return Err(format!(
                "mkfs.{fs} option {option:?} is not one ferrovol passes on"
            ));
        };
        if !matches!(takes, Takes::Nothing) {
            i += 1;
            match words.get(i) {
                Some(v) if value_ok(*takes, v) => {}
                Some(v) => {
                    return Err(format!(
                        "mkfs.{fs} option {option} {v:?}: value not allowed"
                    ))
                }
                None => return Err(format!("mkfs.{fs} option {option} needs a value")),
            }
        }
        i += 1;
    }
    Ok(())
}

/// Parses extra mkfs options (whitespace-separated words, at most 16) and
/// lets through only those reviewed for `fs`'s mkfs (see
/// [`allowed_mkfs_options`]), each option its own word and its value the
/// next. With no `fs` (a StorageClass checked before any filesystem is
/// chosen) the options must suit one of the mkfs ferrovol runs; the node
/// checks them again for the filesystem it formats. Nothing from a
/// request reaches mkfs otherwise.
pub fn mkfs_options(fs: Option<&str>, text: &str) -> Result<Vec<String>> {
    let words: Vec<String> = text.split_whitespace().map(str::to_string).collect();
    if words.len() > 16 {
        return Err(Error::invalid("mkfsOptions: at most 16 words"));
    }
    let verdicts: Vec<std::result::Result<(), String>> = match fs {
        Some(fs) => vec![check_mkfs_words(fs, &words)],
        None => ["ext4", "xfs", "btrfs"]
            .iter()
            .map(|fs| check_mkfs_words(fs, &words))
            .collect(),
    };
    if verdicts.iter().any(Result::is_ok) {
        return Ok(words);
    }
    let why: Vec<String> = verdicts.into_iter().filter_map(Result::err).collect();
    Err(Error::invalid(format!("mkfsOptions: {}", why.join("; "))))
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

/// What an ext2/3/4 superblock (the 1024 bytes at byte 1024 of the
/// device) records of errors: its state says errors were detected, or it
/// counted some since it was last checked. None when it is no ext
/// superblock.
pub fn ext_errors_recorded(superblock: &[u8]) -> Option<bool> {
    let u16_at = |o: usize| -> Option<u16> {
        Some(u16::from_le_bytes(
            superblock.get(o..o + 2)?.try_into().ok()?,
        ))
    };
    let u32_at = |o: usize| -> Option<u32> {
        Some(u32::from_le_bytes(
            superblock.get(o..o + 4)?.try_into().ok()?,
        ))
    };
    // s_magic, s_state (bit 2: errors detected), s_error_count.
    (u16_at(0x38)? == 0xEF53).then_some(())?;
    Some(u16_at(0x3A)? & 0x0002 != 0 || u32_at(0x194)? > 0)
}

/// Before an ext filesystem that recorded errors is mounted read-write
/// for a pod: `e2fsck -p` (it repairs what is safe to repair without
/// asking). Exit 0, 1 or 2: clean or repaired (true when it repaired).
/// Otherwise the filesystem is refused (FAILED_PRECONDITION), never handed
/// to a pod as healthy. A filesystem with no errors recorded is not
/// checked (the kernel replays its journal at mount).
pub async fn preen_if_errors(
    runner: &dyn CommandRunner,
    host: Arc<dyn Host>,
    device: &Path,
    fs: &str,
) -> Result<bool> {
    if !matches!(fs, "ext4" | "ext3" | "ext2") {
        return Ok(false);
    }
    // Its superblock read (false when it cannot be, or is no ext one).
    let dev = device.to_path_buf();
    let errors = tokio::task::spawn_blocking(move || {
        host.read_at(&dev, 1024, 1024)
            .ok()
            .and_then(|sb| ext_errors_recorded(&sb))
            .unwrap_or(false)
    })
    .await
    .unwrap_or(false);
    if !errors {
        return Ok(false);
    }
    let cmd = Command::new("e2fsck")
        .arg("-p")
        .arg(path_arg(device)?)
        .timeout(MKFS_TIMEOUT);
    match runner.run(cmd).await {
        Ok(_) => Ok(true),
        Err(e) if matches!(e.exit_code(), Some(1) | Some(2)) => Ok(true),
        Err(e) => match e.exit_code() {
            Some(code) => Err(Error::precondition(format!(
                "the {fs} filesystem on {} recorded errors that e2fsck -p could not repair \
                 (exit {code}): it is not handed to a pod; check it by hand (e2fsck -f) with the \
                 volume unstaged",
                device.display()
            ))),
            None => Err(Error::from(e).context(format!(
                "check the {fs} filesystem on {}, which recorded errors",
                device.display()
            ))),
        },
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
    fn mkfs_options_are_reviewed_per_mkfs() {
        let ok = |fs: Option<&str>, t: &str| mkfs_options(fs, t).unwrap();
        assert_eq!(
            ok(Some("ext4"), " -E  lazy_itable_init=0,nodiscard -N 4096 "),
            ["-E", "lazy_itable_init=0,nodiscard", "-N", "4096"]
        );
        assert!(ok(Some("ext4"), "").is_empty());
        ok(
            Some("ext4"),
            "-O ^has_journal,metadata_csum -b 4096 -L data -e remount-ro -j",
        );
        ok(
            Some("xfs"),
            "-m crc=1,reflink=1 -d agcount=4 -i size=512 -K",
        );
        ok(Some("btrfs"), "-m dup -n 16k --csum xxhash");
        // Before a filesystem is chosen: any one mkfs will do.
        ok(None, "-m crc=1");
        ok(None, "-E nodiscard");
        let bad = |fs: Option<&str>, t: &str| {
            let e = mkfs_options(fs, t).unwrap_err();
            assert_eq!(e.kind, crate::error::Kind::InvalidArgument, "{t}");
        };
        // Whatever names a file or directory, however it is spelled.
        for fs in [None, Some("ext4"), Some("xfs"), Some("btrfs")] {
            for t in [
                "-d etc",
                "-d /etc",
                "-detc",
                "-E root_owner=0:0",
                "-E lazy_itable_init=0,root_owner",
                "-J device=/dev/sda",
                "-l badblocks.txt",
                "-z undo",
                "-p proto",
                "-c options=cfg",
                "-d file=1,name=img",
                "-l logdev=/dev/sdb",
                "-r rtdev=/dev/sdc",
                "-r dir",
                "--rootdir dir",
                "-U 01234567-89ab-cdef-0123-456789abcdef",
                "-e panic",
                "-c",
                "-O $(reboot)",
                "-E stride=/etc",
                "-L",
                "-b 4096x",
            ] {
                bad(fs, t);
            }
        }
        // An option of another mkfs.
        bad(Some("ext4"), "-m crc=1");
        bad(Some("xfs"), "-E nodiscard");
        bad(Some("ext4"), &"-j ".repeat(17));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::exec::{FakeRunner, Reply};

    /// An ext superblock with this state and error count.
    fn superblock(state: u16, errors: u32) -> Vec<u8> {
        let mut sb = vec![0u8; 1024];
        sb[0x38..0x3A].copy_from_slice(&0xEF53u16.to_le_bytes());
        sb[0x3A..0x3C].copy_from_slice(&state.to_le_bytes());
        sb[0x194..0x198].copy_from_slice(&errors.to_le_bytes());
        sb
    }

    #[test]
    fn an_ext_superblock_says_whether_it_recorded_errors() {
        assert_eq!(ext_errors_recorded(&superblock(1, 0)), Some(false));
        assert_eq!(ext_errors_recorded(&superblock(2, 0)), Some(true));
        assert_eq!(ext_errors_recorded(&superblock(1, 3)), Some(true));
        assert_eq!(ext_errors_recorded(&[0u8; 1024]), None);
        assert_eq!(ext_errors_recorded(&[0u8; 16]), None);
    }

    /// A device whose ext filesystem recorded errors is preened before the
    /// mount, and refused when e2fsck -p leaves errors; one that recorded
    /// none, or no ext filesystem, is not checked at all.
    #[tokio::test]
    async fn an_ext_filesystem_with_errors_is_preened_or_refused() {
        let host = Arc::new(crate::host::FakeHost::new());
        let device = Path::new("/dev/vg/fv-1");
        let write = |state, errors| host.set_contents(device, 1024, superblock(state, errors));
        let shown = format!("e2fsck -p {}", device.display());
        let r = FakeRunner::new();
        // Unreadable, or no errors recorded: no check.
        assert!(!preen_if_errors(&r, host.clone(), device, "ext4")
            .await
            .unwrap());
        write(1, 0);
        assert!(!preen_if_errors(&r, host.clone(), device, "ext4")
            .await
            .unwrap());
        assert!(r.lines().is_empty());
        write(2, 4);
        assert!(!preen_if_errors(&r, host.clone(), device, "xfs")
            .await
            .unwrap());
        assert!(r.lines().is_empty());
        r.expect("e2fsck", Reply::Fail(1, String::new()));
        assert!(preen_if_errors(&r, host.clone(), device, "ext4")
            .await
            .unwrap());
        r.expect("e2fsck", Reply::Fail(4, "UNEXPECTED INCONSISTENCY".into()));
        let e = preen_if_errors(&r, host.clone(), device, "ext4")
            .await
            .unwrap_err();
        assert_eq!(e.kind, crate::error::Kind::FailedPrecondition, "{e:?}");
        assert!(
            e.message.contains("e2fsck -p could not repair (exit 4)"),
            "{e:?}"
        );
        assert_eq!(r.lines(), vec![shown.clone(), shown]);
    }

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

/// Whether the block device at `device` answers a read: one 4 KiB block
/// read from its start, past the page cache (O_DIRECT). A device whose
/// storage is gone (an error table, a fenced client, a LUN that went
/// away) fails it. The caller bounds how long it may take.
pub fn reads(device: &Path) -> std::io::Result<()> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(device)?;
    // O_DIRECT wants an aligned buffer: a 4 KiB-aligned window of a
    // larger one.
    let mut buf = vec![0u8; 8192];
    let at = buf.as_ptr().align_offset(4096);
    f.read(&mut buf[at..at + 4096]).map(|_| ())
}
