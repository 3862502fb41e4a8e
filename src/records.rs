//! The one place records reach the disk. Every record the driver keeps
//! (the node's stage records, the backends' volume, snapshot and target
//! records, the initiator's session settings) is written here, in one of
//! two shapes:
//!
//! - [`write`]: a whole file replaced atomically and durably (temporary
//!   file, fsync, rename, fsync of the folder), so a crash or a power loss
//!   leaves the old record or the new one, never half of one;
//! - [`Journal`]: many small records in one append-only file, for records
//!   written on every call (the node's publish records), where a file per
//!   record would cost an inode to create and delete each time.
//!
//! What is written is root's alone (mode 0600, folders 0700).

use crate::error::{Error, Result};
use crate::sync::LockExt;
use serde::{de::DeserializeOwned, Deserialize, Serialize};
use std::collections::HashMap;
use std::fs;
use std::hash::Hash;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// Writes `bytes` to `path` atomically and durably, readable by root only.
/// The folder must exist.
pub fn write(path: &Path, bytes: &[u8]) -> Result<()> {
    replace(path, bytes, Lasting::Power)
        .map_err(|e| Error::io(format!("write {}", path.display()), e))
}

/// [`write`] for a folder on a network filesystem whose server commits a
/// rename before it answers it (an NFS mount). The new file is fsynced (the
/// server commits its data), the folder is not: an NFS server commits a
/// rename before it answers it (Linux's nfsd on a `sync` export, the
/// default), and the client's fsync of a directory sends nothing (Linux's
/// returns at once); opening the directory for it only cost a round trip
/// to revalidate it, a tenth of a ControllerExpandVolume's time.
pub fn write_on_server(path: &Path, bytes: &[u8]) -> Result<()> {
    replace(path, bytes, Lasting::PowerOnServer)
        .map_err(|e| Error::io(format!("write {}", path.display()), e))
}

/// What a replaced record outlives.
#[derive(Clone, Copy, PartialEq)]
enum Lasting {
    /// A crash of the process (the page cache keeps it).
    Process,
    /// A power loss: the file and its folder fsynced.
    Power,
    /// A power loss of the server the folder is on (NFS): the file fsynced
    /// (the server commits the rename itself).
    PowerOnServer,
}

/// The layout of the JSON records the driver keeps (in the state
/// directory, and beside volumes: a file pool's, an export's, a target's
/// records). Each record carries it as `"format"`; one without is format 1
/// (written before records carried it).
pub const RECORD_FORMAT: u64 = 1;

/// `value` as a record's JSON: its fields and `"format"`.
pub fn encode_record<T: Serialize>(what: &str, value: &T) -> Result<Vec<u8>> {
    let mut v =
        serde_json::to_value(value).map_err(|e| Error::internal(format!("encode {what}: {e}")))?;
    if let serde_json::Value::Object(fields) = &mut v {
        fields.insert("format".into(), RECORD_FORMAT.into());
    }
    serde_json::to_vec_pretty(&v).map_err(|e| Error::internal(format!("encode {what}: {e}")))
}

/// A record's value from its JSON. A record of a newer format than this
/// driver reads is FAILED_PRECONDITION naming both (never half read); one
/// that does not parse is INTERNAL.
pub fn decode_record<T: DeserializeOwned>(what: &str, bytes: &[u8]) -> Result<T> {
    let mut v: serde_json::Value = serde_json::from_slice(bytes)
        .map_err(|e| Error::internal(format!("corrupt record {what}: {e}")))?;
    if let serde_json::Value::Object(fields) = &mut v {
        if let Some(format) = fields.remove("format") {
            let n = format.as_u64().unwrap_or(u64::MAX);
            if n > RECORD_FORMAT {
                return Err(Error::precondition(format!(
                    "record {what} is in format {format}, which a newer ferrovol wrote; this is ferrovol {}, which reads formats up to {RECORD_FORMAT}",
                    env!("CARGO_PKG_VERSION")
                )));
            }
        }
    }
    serde_json::from_value(v).map_err(|e| Error::internal(format!("corrupt record {what}: {e}")))
}

/// The JSON record at `path`; `None` when there is none. One that does
/// not parse is INTERNAL, naming it; one of a newer format,
/// FAILED_PRECONDITION.
pub fn read_json<T: DeserializeOwned>(path: &Path) -> Result<Option<T>> {
    match fs::read(path) {
        Ok(bytes) => decode_record(&path.display().to_string(), &bytes).map(Some),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(Error::io(format!("read {}", path.display()), e)),
    }
}

/// Writes `value` as a record's pretty JSON to `path`, as [`write`] does.
pub fn write_json<T: Serialize>(path: &Path, value: &T) -> Result<()> {
    let bytes = encode_record(&path.display().to_string(), value)?;
    write(path, &bytes)
}

/// Removes the record at `path`, durably (the folder is fsynced). Whether
/// there was one: a record already gone is fine.
pub fn remove(path: &Path) -> Result<bool> {
    remove_lasting(path, Lasting::Power)
}

/// [`remove`] in a folder on a network filesystem whose server commits the
/// removal before it answers (an NFS mount: see [`write_on_server`]); the
/// folder is not fsynced.
pub fn remove_on_server(path: &Path) -> Result<bool> {
    remove_lasting(path, Lasting::PowerOnServer)
}

fn remove_lasting(path: &Path, lasting: Lasting) -> Result<bool> {
    match fs::remove_file(path) {
        Ok(()) => {
            if let (Some(dir), Lasting::Power) = (path.parent(), lasting) {
                sync_dir(dir)?;
            }
            Ok(true)
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(Error::io(format!("remove {}", path.display()), e)),
    }
}

/// Creates `dir` (and its missing parents) private to the driver's user:
/// mode 0700, an existing one of the driver's user made so too. An
/// existing one another user owns keeps its mode: it is a volume's mount
/// point (a pod's emptyDir is root's, mode 2777 with the pod's fsGroup)
/// or a folder an administrator made, not the driver's to change (and
/// only its owner may); what the driver makes inside it is private.
pub fn private_dir(dir: &Path) -> Result<()> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
    let err = |e| Error::io(format!("create {}", dir.display()), e);
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(err)?;
    let meta = fs::metadata(dir).map_err(err)?;
    if meta.uid() != nix::unistd::geteuid().as_raw() || meta.mode() & 0o7777 == 0o700 {
        return Ok(());
    }
    fs::set_permissions(dir, fs::Permissions::from_mode(0o700)).map_err(err)
}

/// The name of the temporary file a write of `path` goes through; a
/// leftover one (an interrupted write) may be removed: the record it was
/// replacing is intact.
pub fn is_leftover(name: &str) -> bool {
    name.starts_with('.') && name.ends_with(".tmp")
}

fn sync_dir(dir: &Path) -> Result<()> {
    fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| Error::io(format!("sync {}", dir.display()), e))
}

/// Writes `bytes` to `path` through a temporary file renamed over the old
/// one: a crash of the process leaves the old record or the new one; made
/// to outlive what `lasting` says.
fn replace(path: &Path, bytes: &[u8], lasting: Lasting) -> std::io::Result<()> {
    let dir = path
        .parent()
        .ok_or_else(|| std::io::Error::other("path has no parent"))?;
    let name = path
        .file_name()
        .ok_or_else(|| std::io::Error::other("path has no file name"))?;
    let tmp = dir.join(format!(".{}.tmp", name.to_string_lossy()));
    let mut f = fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)?;
    let written = f.write_all(bytes).and_then(|()| match lasting {
        Lasting::Process => Ok(()),
        Lasting::Power | Lasting::PowerOnServer => f.sync_all(),
    });
    drop(f);
    if let Err(e) = written.and_then(|()| fs::rename(&tmp, path)) {
        let _ = fs::remove_file(&tmp);
        return Err(e);
    }
    if lasting == Lasting::Power {
        fs::File::open(dir)?.sync_all()?;
    }
    Ok(())
}

/// One line of a journal.
#[derive(Serialize, Deserialize)]
enum Entry<K, V> {
    Put(K, V),
    Del(K),
}

/// Keyed records in one append-only file: a put or a removal is one line
/// appended with one write(2), no new inode; the file is rewritten whole
/// (atomically, as [`write`] does) when it is opened and whenever dead
/// lines outnumber live records by enough to matter.
///
/// A journal survives a crash of the process (a write(2) that returned is
/// in the page cache; a line cut short by a crash is dropped on the next
/// open, which then rewrites the file). It is not fsynced: it is for
/// records that need not outlive the machine (a bind mount does not
/// survive a reboot either).
pub struct Journal<K, V> {
    path: PathBuf,
    inner: Mutex<Inner<K, V>>,
}

struct Inner<K, V> {
    live: HashMap<K, V>,
    file: fs::File,
    /// Lines in the file.
    lines: usize,
}

/// Dead lines allowed before a rewrite, beyond twice the live records.
const SLACK_LINES: usize = 1024;

impl<K, V> Journal<K, V>
where
    K: Serialize + DeserializeOwned + Eq + Hash + Clone,
    V: Serialize + DeserializeOwned + Clone,
{
    /// Opens the journal at `path` (its folder must exist), loading what
    /// it holds and adding `seed` (records carried over from an older
    /// layout) under it; then rewrites it compactly.
    pub fn open(path: &Path, seed: impl IntoIterator<Item = (K, V)>) -> Result<Self> {
        let mut live: HashMap<K, V> = seed.into_iter().collect();
        match fs::read(path) {
            Ok(bytes) => {
                replay(path, &bytes, &mut live);
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(Error::io(format!("read {}", path.display()), e)),
        }
        let inner = Mutex::new(Inner {
            file: rewrite(path, &live)?,
            lines: live.len(),
            live,
        });
        Ok(Self {
            path: path.to_path_buf(),
            inner,
        })
    }

    /// What the journal at `path` holds, read without changing it (while
    /// the driver that keeps it runs), and how many of its lines did not
    /// parse.
    pub fn peek(path: &Path) -> Result<(Vec<V>, usize)> {
        let bytes = fs::read(path).map_err(|e| Error::io(format!("read {}", path.display()), e))?;
        let mut live = HashMap::<K, V>::new();
        let dropped = replay(path, &bytes, &mut live);
        Ok((live.into_values().collect(), dropped))
    }

    pub fn get<Q>(&self, key: &Q) -> Option<V>
    where
        K: std::borrow::Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.inner.locked().live.get(key).cloned()
    }

    /// Every live record.
    pub fn values(&self) -> Vec<V> {
        self.inner.locked().live.values().cloned().collect()
    }

    /// The live records that `keep` accepts.
    pub fn filtered(&self, keep: impl Fn(&V) -> bool) -> Vec<V> {
        let inner = self.inner.locked();
        inner.live.values().filter(|v| keep(v)).cloned().collect()
    }

    /// Records `value` under `key`, in the file first.
    pub fn put(&self, key: K, value: V) -> Result<()> {
        let mut inner = self.inner.locked();
        self.append(&mut inner, &Entry::Put(&key, &value))?;
        inner.live.insert(key, value);
        self.compact_if_due(&mut inner)
    }

    /// Removes the record under `key`; one already gone is fine.
    pub fn remove<Q>(&self, key: &Q) -> Result<()>
    where
        K: std::borrow::Borrow<Q>,
        Q: Serialize + Hash + Eq + ?Sized,
    {
        let mut inner = self.inner.locked();
        if !inner.live.contains_key(key) {
            return Ok(());
        }
        self.append(&mut inner, &Entry::<&Q, &V>::Del(key))?;
        inner.live.remove(key);
        self.compact_if_due(&mut inner)
    }

    fn append<Q: Serialize + ?Sized>(
        &self,
        inner: &mut Inner<K, V>,
        entry: &Entry<&Q, &V>,
    ) -> Result<()> {
        let mut line = serde_json::to_vec(entry)
            .map_err(|e| Error::internal(format!("encode {}: {e}", self.path.display())))?;
        line.push(b'\n');
        // One write(2) per line: O_APPEND puts it whole at the end.
        inner
            .file
            .write_all(&line)
            .map_err(|e| Error::io(format!("append to {}", self.path.display()), e))?;
        inner.lines += 1;
        Ok(())
    }

    fn compact_if_due(&self, inner: &mut Inner<K, V>) -> Result<()> {
        if inner.lines > 2 * inner.live.len() + SLACK_LINES {
            inner.file = rewrite(&self.path, &inner.live)?;
            inner.lines = inner.live.len();
        }
        Ok(())
    }
}

/// Applies a journal's lines to `live`, in order. A line that does not
/// parse (the last one, cut short by a crash, or a damaged one) is left
/// out and logged; the rest still count.
fn replay<K, V>(path: &Path, bytes: &[u8], live: &mut HashMap<K, V>) -> usize
where
    K: DeserializeOwned + Eq + Hash,
    V: DeserializeOwned,
{
    let mut dropped = 0usize;
    for line in bytes.split(|b| *b == b'\n').filter(|l| !l.is_empty()) {
        match serde_json::from_slice::<Entry<K, V>>(line) {
            Ok(Entry::Put(k, v)) => {
                live.insert(k, v);
            }
            Ok(Entry::Del(k)) => {
                live.remove(&k);
            }
            Err(_) => dropped += 1,
        }
    }
    if dropped > 0 {
        tracing::warn!(path = %path.display(), dropped, "unreadable journal lines left out");
    }
    dropped
}

/// Rewrites the journal at `path` to hold exactly `live`, atomically, and
/// opens the new file for appending.
fn rewrite<K: Serialize, V: Serialize>(path: &Path, live: &HashMap<K, V>) -> Result<fs::File> {
    let mut bytes = Vec::new();
    for (k, v) in live {
        serde_json::to_writer(&mut bytes, &Entry::Put(k, v))
            .map_err(|e| Error::internal(format!("encode {}: {e}", path.display())))?;
        bytes.push(b'\n');
    }
    replace(path, &bytes, Lasting::Process)
        .and_then(|()| fs::OpenOptions::new().append(true).open(path))
        .map_err(|e| Error::io(format!("write {}", path.display()), e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_carry_their_format_and_a_newer_one_is_refused() {
        #[derive(Debug, PartialEq, Serialize, serde::Deserialize)]
        enum Kept {
            One { n: u32 },
        }
        let bytes = encode_record("r", &Kept::One { n: 7 }).unwrap();
        let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(v["format"], RECORD_FORMAT);
        assert_eq!(
            decode_record::<Kept>("r", &bytes).unwrap(),
            Kept::One { n: 7 }
        );
        // Written before records carried it: format 1.
        assert_eq!(
            decode_record::<Kept>("r", br#"{"One":{"n":3}}"#).unwrap(),
            Kept::One { n: 3 }
        );
        let newer = format!(r#"{{"One":{{"n":3}},"format":{}}}"#, RECORD_FORMAT + 1);
        let e = decode_record::<Kept>("rec", newer.as_bytes()).unwrap_err();
        assert_eq!(
            e.kind,
            crate::error::Kind::FailedPrecondition,
            "{}",
            e.message
        );
        assert!(e.message.contains("newer ferrovol"), "{}", e.message);
        assert!(
            e.message.contains(env!("CARGO_PKG_VERSION")),
            "{}",
            e.message
        );
    }

    fn names(dir: &Path) -> Vec<String> {
        let mut n: Vec<String> = fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        n.sort();
        n
    }

    #[test]
    fn write_replaces_the_whole_file_privately_and_leaves_no_temporary() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("r.json");
        write(&p, b"first version, long").unwrap();
        write_json(&p, &vec![1, 2]).unwrap();
        assert_eq!(fs::read_to_string(&p).unwrap(), "[\n  1,\n  2\n]");
        assert_eq!(names(dir.path()), vec!["r.json"]);
        assert_eq!(
            fs::metadata(&p).unwrap().permissions().mode() & 0o777,
            0o600
        );
        assert!(remove(&p).unwrap());
        assert!(!remove(&p).unwrap());
        assert!(names(dir.path()).is_empty());
        // The same on an NFS mount's folder (only the folder's fsync is
        // left out).
        write(&p, b"first version, long").unwrap();
        write_on_server(&p, b"second").unwrap();
        assert_eq!(fs::read_to_string(&p).unwrap(), "second");
        assert_eq!(names(dir.path()), vec!["r.json"]);
        assert_eq!(
            fs::metadata(&p).unwrap().permissions().mode() & 0o777,
            0o600
        );
    }

    #[test]
    fn a_failed_write_keeps_the_old_record_and_cleans_up() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("r.json");
        write(&p, b"old").unwrap();
        // A directory where the temporary file goes makes the write fail.
        fs::create_dir(dir.path().join(".r.json.tmp")).unwrap();
        let e = write(&p, b"new").unwrap_err();
        assert!(e.message.contains("r.json"), "{}", e.message);
        assert_eq!(fs::read(&p).unwrap(), b"old");
    }

    #[test]
    fn private_dir_makes_and_tightens_folders() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().join("a/b");
        private_dir(&d).unwrap();
        fs::set_permissions(&d, fs::Permissions::from_mode(0o755)).unwrap();
        private_dir(&d).unwrap();
        assert_eq!(
            fs::metadata(&d).unwrap().permissions().mode() & 0o777,
            0o700
        );
        assert!(is_leftover(".x.json.tmp") && !is_leftover("x.json"));
    }

    /// A folder another user owns (a pod's emptyDir: root's, mode 2777)
    /// keeps its mode, and what is made inside it is private. Needs root
    /// (to give the folder to another user).
    #[test]
    fn private_dir_leaves_another_user_s_folder_as_it_is() {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        assert!(nix::unistd::geteuid().is_root(), "needs root");
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().join("emptydir");
        fs::create_dir(&d).unwrap();
        fs::set_permissions(&d, fs::Permissions::from_mode(0o2777)).unwrap();
        std::os::unix::fs::chown(&d, Some(65532), Some(65532)).unwrap();
        private_dir(&d).unwrap();
        assert_eq!(fs::metadata(&d).unwrap().mode() & 0o7777, 0o2777);
        private_dir(&d.join("state")).unwrap();
        assert_eq!(
            fs::metadata(d.join("state")).unwrap().mode() & 0o7777,
            0o700
        );
    }

    type J = Journal<String, u32>;

    #[test]
    fn journal_puts_and_removals_survive_reopen_in_one_file() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("j.log");
        let j = J::open(&p, []).unwrap();
        j.put("a".into(), 1).unwrap();
        j.put("b".into(), 2).unwrap();
        j.put("a".into(), 3).unwrap();
        j.remove("b").unwrap();
        j.remove("never").unwrap();
        assert_eq!(j.get("a"), Some(3));
        // Four lines appended, one file, no temporaries.
        assert_eq!(fs::read_to_string(&p).unwrap().lines().count(), 4);
        assert_eq!(names(dir.path()), vec!["j.log"]);
        assert_eq!(
            fs::metadata(&p).unwrap().permissions().mode() & 0o777,
            0o600
        );
        drop(j);

        let again = J::open(&p, [("seeded".to_string(), 9)]).unwrap();
        let mut v = again.values();
        v.sort();
        assert_eq!(v, vec![3, 9]);
        assert_eq!(again.get("b"), None);
        assert_eq!(again.filtered(|v| *v > 5), vec![9]);
        // Opening rewrote it to its live records.
        assert_eq!(fs::read_to_string(&p).unwrap().lines().count(), 2);
    }

    #[test]
    fn a_line_cut_short_is_dropped_and_the_rest_kept() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("j.log");
        let j = J::open(&p, []).unwrap();
        j.put("a".into(), 1).unwrap();
        j.put("b".into(), 2).unwrap();
        drop(j);
        // A crash in the middle of a third line, then a damaged one.
        let mut f = fs::OpenOptions::new().append(true).open(&p).unwrap();
        f.write_all(b"not json\n{\"Del\":\"a\"}\n{\"Put\":[\"c\",")
            .unwrap();
        drop(f);
        assert_eq!(J::peek(&p).unwrap(), (vec![2], 2));
        let j = J::open(&p, []).unwrap();
        assert_eq!(j.values(), vec![2]);
        j.put("d".into(), 4).unwrap();
        drop(j);
        let mut v = J::open(&p, []).unwrap().values();
        v.sort();
        assert_eq!(v, vec![2, 4]);
    }

    #[test]
    fn dead_lines_are_compacted_away() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("j.log");
        let j = J::open(&p, []).unwrap();
        j.put("kept".into(), 7).unwrap();
        for i in 0..3 * SLACK_LINES {
            j.put(format!("k{i}"), 1).unwrap();
            j.remove(format!("k{i}").as_str()).unwrap();
        }
        let lines = fs::read_to_string(&p).unwrap().lines().count();
        assert!(
            lines <= 2 + SLACK_LINES + 1,
            "{lines} lines for one live record"
        );
        drop(j);
        assert_eq!(J::open(&p, []).unwrap().values(), vec![7]);
    }
}
