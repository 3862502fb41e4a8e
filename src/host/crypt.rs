//! LUKS2 encryption of a volume's device, through `cryptsetup`: the node
//! formats a volume that asks for encryption at its first stage, opens it
//! at every stage (the filesystem or raw device a pod sees is the opened
//! mapping), and closes it at unstage. The passphrase reaches cryptsetup
//! on its stdin only, marked secret for whatever the runner shows.
//!
//! Headers ferrovol makes carry the LUKS2 subsystem `ferrovol`; a LUKS
//! device without it is someone else's and is never opened. Mappings are
//! named `fvc-<32 hex>` from the volume id; one of that name found open is
//! reused only when it maps the volume's device. Mappings are opened with
//! `--disable-keyring`: the volume key stays in the dm-crypt table, so a
//! resize needs no passphrase (NodeExpandVolume carries none).

use crate::error::{Error, Result};
use crate::exec::{Command, CommandRunner, ExecError};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The LUKS2 subsystem of the headers ferrovol makes.
pub const SUBSYSTEM: &str = "ferrovol";
/// The volume context key that asks for encryption, and its one value.
pub const CONTEXT_KEY: &str = "encrypted";
pub const LUKS2: &str = "luks2";
/// The NodeStage secret that holds a volume's passphrase.
pub const PASSPHRASE_KEY: &str = "encryptionPassphrase";
const PREFIX: &str = "fvc-";
/// The maps of encrypted volumes, as lvm's `global_filter` matches them.
pub const MAPS: &str = "^/dev/mapper/fvc-";
/// Formatting and opening run the key derivation (argon2id, [`Kdf`]: by
/// default about half a second where the header is made).
const TIMEOUT: Duration = Duration::from_secs(120);

fn cryptsetup() -> Command {
    Command::new("cryptsetup").timeout(TIMEOUT)
}

fn dev_arg(device: &Path) -> Result<String> {
    crate::exec::path_arg(device)
}

/// The mapping's name for a volume (its id string).
pub fn name_for(volume: &str) -> String {
    format!("{PREFIX}{}", crate::id::digest_hex(volume.as_bytes(), 16))
}

/// Where mapping `name` is served from.
pub fn path(name: &str) -> PathBuf {
    Path::new("/dev/mapper").join(name)
}

fn check_name(name: &str) -> Result<()> {
    if super::hold::is_hashed_name(PREFIX, name) {
        Ok(())
    } else {
        Err(Error::internal(format!(
            "{name:?} is not an encryption mapping's name"
        )))
    }
}

/// A passphrase as the secrets carry it: non-empty, and never more than
/// cryptsetup reads from a key file by default.
pub fn check_passphrase(p: &str) -> Result<()> {
    if p.is_empty() || p.len() > 8192 {
        return Err(Error::invalid(format!(
            "secret {PASSPHRASE_KEY} must hold 1 to 8192 bytes"
        )));
    }
    Ok(())
}

/// The LUKS header at the start of `device`, read directly (one read, no
/// process: what every stage of an unencrypted volume pays): None when
/// there is none, else its subsystem (empty when unset, and for LUKS1).
/// A device that is not there holds none (what uses it next says it is
/// missing).
pub async fn header(device: &Path) -> Result<Option<String>> {
    let device = device.to_path_buf();
    crate::host::off_worker("reading a device's first bytes", TIMEOUT, move || {
        use std::os::unix::fs::FileExt;
        let f = match std::fs::File::open(&device) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(Error::io(format!("open {}", device.display()), e)),
        };
        let mut head = [0u8; 512];
        match f.read_exact_at(&mut head, 0) {
            Ok(()) => Ok(parse_header(&head)),
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => Ok(None),
            Err(e) => Err(Error::io(format!("read {}", device.display()), e)),
        }
    })
    .await
}

/// The subsystem of a LUKS binary header (its first 512 bytes): the magic
/// `LUKS\xba\xbe`, a big-endian version, and in LUKS2 the NUL-padded
/// subsystem at byte 208 (after the header size, sequence id, label,
/// checksum algorithm, salt and uuid fields).
pub fn parse_header(head: &[u8; 512]) -> Option<String> {
    if &head[..6] != b"LUKS\xba\xbe" {
        return None;
    }
    let version = u16::from_be_bytes([head[6], head[7]]);
    if version != 2 {
        return Some(String::new());
    }
    let field = &head[208..256];
    let end = field.iter().position(|b| *b == 0).unwrap_or(field.len());
    Some(String::from_utf8_lossy(&field[..end]).into_owned())
}

/// Where a LUKS2 header's JSON metadata starts (after the 4 KiB binary
/// header), and how much of it the headers ferrovol makes have (16 KiB of
/// metadata in all).
const JSON_AT: u64 = 4096;
const JSON_LEN: usize = 16384 - 4096;

/// Whether the LUKS2 header at the start of `device` has a key slot: a
/// header whose format was cut short has none yet (cryptsetup writes the
/// header, then adds the slot), or has metadata that does not parse.
pub async fn has_key_slot(device: &Path) -> Result<bool> {
    let device = device.to_path_buf();
    crate::host::off_worker("reading a LUKS header's metadata", TIMEOUT, move || {
        use std::os::unix::fs::FileExt;
        let f = std::fs::File::open(&device)
            .map_err(|e| Error::io(format!("open {}", device.display()), e))?;
        let mut json = vec![0u8; JSON_LEN];
        f.read_exact_at(&mut json, JSON_AT)
            .map_err(|e| Error::io(format!("read {}", device.display()), e))?;
        Ok(key_slots(&json) > 0)
    })
    .await
}

/// Zeroes both copies of a LUKS2 header ferrovol makes (the first 32 KiB)
/// and syncs: for a device whose format failed part way, which held
/// nothing before it (the format's own check), so that the next stage
/// finds no header and formats afresh.
pub async fn wipe_header(device: &Path) -> Result<()> {
    let device = device.to_path_buf();
    crate::host::off_worker("wiping a failed LUKS header", TIMEOUT, move || {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(&device)
            .map_err(|e| Error::io(format!("open {}", device.display()), e))?;
        f.write_all_at(&[0u8; 2 * 16384], 0)
            .and_then(|()| f.sync_all())
            .map_err(|e| Error::io(format!("wipe the header of {}", device.display()), e))
    })
    .await
}

/// How many key slots a LUKS2 JSON metadata area (NUL-padded) lists; 0
/// when it does not parse.
pub fn key_slots(area: &[u8]) -> usize {
    let end = area.iter().position(|b| *b == 0).unwrap_or(area.len());
    serde_json::from_slice::<serde_json::Value>(&area[..end])
        .ok()
        .and_then(|v| {
            v.get("keyslots")
                .and_then(|k| k.as_object())
                .map(|k| k.len())
        })
        .unwrap_or(0)
}

/// The key derivation (argon2id) a format sets: its memory in KiB and the
/// time it is tuned to take where the header is made, in milliseconds
/// (at least cryptsetup's four passes). Each open pays the same again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Kdf {
    pub memory_kib: u32,
    pub time_ms: u32,
}

impl Default for Kdf {
    /// 64 MiB and half a second.
    fn default() -> Self {
        Self {
            memory_kib: 65536,
            time_ms: 500,
        }
    }
}

impl Kdf {
    /// Within what cryptsetup takes for argon2id: 32 KiB to 4 GiB of
    /// memory, 1 ms to a minute.
    pub fn new(memory_kib: u32, time_ms: u32) -> Result<Self> {
        if !(32..=4 * 1024 * 1024).contains(&memory_kib) {
            return Err(Error::invalid(format!(
                "node.encryption_kdf_memory_kib is {memory_kib}: it must be 32 to 4194304 (4 GiB)"
            )));
        }
        if !(1..=60_000).contains(&time_ms) {
            return Err(Error::invalid(format!(
                "node.encryption_kdf_time_ms is {time_ms}: it must be 1 to 60000"
            )));
        }
        Ok(Self {
            memory_kib,
            time_ms,
        })
    }
}

/// Formats `device` as LUKS2 (subsystem [`SUBSYSTEM`]) with `passphrase`,
/// its key derived as `kdf` says. A small header (1 MiB of key slots; the
/// data starts at 2 MiB) leaves the volume most of its size.
pub async fn format(
    runner: &dyn CommandRunner,
    device: &Path,
    passphrase: &str,
    kdf: Kdf,
) -> Result<()> {
    check_passphrase(passphrase)?;
    let (memory, time) = (kdf.memory_kib.to_string(), kdf.time_ms.to_string());
    let cmd = cryptsetup()
        .args([
            "luksFormat",
            "--type",
            "luks2",
            "--batch-mode",
            "--subsystem",
            SUBSYSTEM,
            "--pbkdf",
            "argon2id",
            "--pbkdf-memory",
            &memory,
            "--pbkdf-parallel",
            "1",
            "--iter-time",
            &time,
            "--luks2-metadata-size",
            "16k",
            "--luks2-keyslots-size",
            "1m",
            "--key-file",
            "-",
            &dev_arg(device)?,
        ])
        .stdin(passphrase.as_bytes().to_vec())
        .secret(passphrase);
    runner
        .run(cmd)
        .await
        .map(|_| ())
        .map_err(|e| Error::from(e).context("format the device with LUKS2"))
}

/// Opens `device` as mapping `name` with `passphrase`. A passphrase that
/// opens no key slot is INVALID_ARGUMENT, nothing touched.
pub async fn open(
    runner: &dyn CommandRunner,
    device: &Path,
    name: &str,
    passphrase: &str,
    readonly: bool,
) -> Result<()> {
    check_name(name)?;
    check_passphrase(passphrase)?;
    let mut cmd = cryptsetup().args(["open", "--type", "luks2", "--disable-keyring"]);
    if readonly {
        cmd = cmd.arg("--readonly");
    }
    let cmd = cmd
        .args(["--key-file", "-", &dev_arg(device)?, name])
        .stdin(passphrase.as_bytes().to_vec())
        .secret(passphrase);
    match runner.run(cmd).await {
        Ok(_) => Ok(()),
        // cryptsetup's exit status 2: no key slot opens with it.
        Err(ExecError::Failed { output, .. }) if output.code == Some(2) => {
            Err(Error::invalid(format!(
                "the passphrase in secret {PASSPHRASE_KEY} does not open the LUKS header on {}",
                device.display()
            )))
        }
        Err(e) => Err(Error::from(e).context("open the encrypted device")),
    }
}

/// The device (major, minor) mapping `name` maps; None when there is no
/// such mapping.
pub async fn backing(runner: &dyn CommandRunner, name: &str) -> Result<Option<(u32, u32)>> {
    check_name(name)?;
    let cmd = Command::new("dmsetup")
        .timeout(Duration::from_secs(30))
        .args(["deps", "-o", "devno", name]);
    let out = match runner.run(cmd).await {
        Ok(out) => out.stdout,
        Err(e) if super::hold::no_such_map(&e) => return Ok(None),
        Err(e) => return Err(e.into()),
    };
    parse_deps(&out)
        .map(Some)
        .ok_or_else(|| Error::internal(format!("dmsetup deps {name}: {out:?}")))
}

/// The one device of `dmsetup deps -o devno` output (`1 dependencies  :
/// (7, 3)`).
pub fn parse_deps(out: &str) -> Option<(u32, u32)> {
    let (count, rest) = out.trim().split_once(' ')?;
    if count != "1" {
        return None;
    }
    let inner = rest.split_once('(')?.1.split_once(')')?.0;
    let (major, minor) = inner.split_once(',')?;
    Some((major.trim().parse().ok()?, minor.trim().parse().ok()?))
}

/// The (major, minor) of block device `device`.
pub fn devno(device: &Path) -> Result<(u32, u32)> {
    use std::os::unix::fs::MetadataExt;
    let rdev = std::fs::metadata(device)
        .map_err(|e| Error::io(format!("stat {}", device.display()), e))?
        .rdev();
    Ok((libc::major(rdev), libc::minor(rdev)))
}

/// Closes mapping `name`; one that is gone already is no error.
pub async fn close(runner: &dyn CommandRunner, name: &str) -> Result<()> {
    check_name(name)?;
    if backing(runner, name).await?.is_none() {
        return Ok(());
    }
    runner
        .run(cryptsetup().args(["close", name]))
        .await
        .map(|_| ())
        .map_err(|e| Error::from(e).context("close the encrypted device"))
}

/// Grows mapping `name` to its device's size.
pub async fn resize(runner: &dyn CommandRunner, name: &str) -> Result<()> {
    check_name(name)?;
    runner
        .run(cryptsetup().args(["resize", name]))
        .await
        .map(|_| ())
        .map_err(|e| Error::from(e).context("grow the encrypted mapping"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_tool_output() {
        let n = name_for("file:v1.abc");
        assert!(check_name(&n).is_ok(), "{n}");
        // lvm's filter of them matches every map this names.
        assert_eq!(MAPS, format!("^/dev/mapper/{PREFIX}"));
        assert_eq!(n, name_for("file:v1.abc"));
        assert_ne!(n, name_for("file:v1.abd"));
        assert!(check_name("fvc-../../x").is_err());
        assert!(check_name("vg-lv").is_err());
        assert_eq!(parse_deps(" 1 dependencies\t: (7, 3)\n"), Some((7, 3)));
        assert_eq!(parse_deps("1 dependencies  : (253, 12)"), Some((253, 12)));
        assert_eq!(parse_deps("2 dependencies  : (7, 3) (7, 4)"), None);
        assert_eq!(parse_deps("0 dependencies  :"), None);
        let mut head = [0u8; 512];
        assert_eq!(parse_header(&head), None);
        head[..6].copy_from_slice(b"LUKS\xba\xbe");
        head[7] = 2;
        head[24..27].copy_from_slice(b"lbl");
        assert_eq!(parse_header(&head).as_deref(), Some(""));
        head[208..216].copy_from_slice(b"ferrovol");
        assert_eq!(parse_header(&head).as_deref(), Some("ferrovol"));
        head[7] = 1;
        assert_eq!(parse_header(&head).as_deref(), Some(""));
        assert!(check_passphrase("").is_err());
        assert!(check_passphrase(&"x".repeat(8193)).is_err());
        assert!(check_passphrase("correct horse").is_ok());
    }

    /// A format derives its key as the node's settings say, and the
    /// passphrase goes in on stdin, never on the command line.
    #[tokio::test]
    async fn format_derives_the_key_as_set() {
        let runner = crate::exec::FakeRunner::new();
        runner.ok("cryptsetup");
        let kdf = Kdf::new(1024, 50).unwrap();
        format(&runner, Path::new("/dev/loop7"), "correct horse", kdf)
            .await
            .unwrap();
        let line = runner.lines().join("\n");
        for arg in [
            "--pbkdf argon2id",
            "--pbkdf-memory 1024",
            "--iter-time 50",
            "/dev/loop7",
        ] {
            assert!(line.contains(arg), "{arg}: {line}");
        }
        assert!(!line.contains("correct horse"), "{line}");
        assert!(Kdf::new(31, 500).is_err() && Kdf::new(65536, 0).is_err());
    }

    /// The key slots of a LUKS2 metadata area: a format cut short has none
    /// (or metadata that does not parse), a finished one its slot.
    #[test]
    fn key_slots_in_the_metadata() {
        let mut area = vec![0u8; JSON_LEN];
        let finished = br#"{"keyslots":{"0":{"type":"luks2"}},"tokens":{},"segments":{}}"#;
        area[..finished.len()].copy_from_slice(finished);
        assert_eq!(key_slots(&area), 1);
        let erased = br#"{"keyslots":{},"tokens":{},"segments":{}}"#;
        let mut area = vec![0u8; JSON_LEN];
        area[..erased.len()].copy_from_slice(erased);
        assert_eq!(key_slots(&area), 0);
        // Torn: the metadata stops part way.
        let mut area = vec![0u8; JSON_LEN];
        area[..20].copy_from_slice(&finished[..20]);
        assert_eq!(key_slots(&area), 0);
        assert_eq!(key_slots(&[0u8; 16]), 0);
    }
}
