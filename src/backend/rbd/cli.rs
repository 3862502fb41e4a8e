//! The `rbd` command line through the exec seam: credentials in a private
//! keyring file (never argv), JSON reports parsed into typed rows, and
//! rbd's errors classified by their errno.

use crate::error::{Error, Result};
use crate::exec::{path_arg, Command, CommandRunner, ExecError};
use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// A cephx user and where its key is: a keyring file of the config, or a
/// private one written for this call from the CSI secrets.
pub struct Creds {
    pub user: String,
    keyring: PathBuf,
    /// The cephx keys these credentials carry: redacted from whatever a
    /// command run with them prints (a tool that echoes its keyring).
    keys: Vec<String>,
    /// Removed when the credentials are dropped.
    temporary: bool,
}

impl Drop for Creds {
    fn drop(&mut self) {
        if self.temporary {
            let _ = std::fs::remove_file(&self.keyring);
        }
    }
}

/// The `key = ...` values of a keyring file's text.
pub fn keyring_keys(text: &str) -> Vec<String> {
    text.lines()
        .filter_map(|l| {
            let (k, v) = l.split_once('=')?;
            (k.trim() == "key").then(|| v.trim().to_string())
        })
        .filter(|v| !v.is_empty())
        .collect()
}

/// A cephx user name: `client.` is implied.
pub fn check_user(user: &str) -> Result<()> {
    if user.is_empty()
        || user.len() > 64
        || !user
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
    {
        return Err(Error::invalid(
            "secrets: userID must be 1 to 64 of a-z, A-Z, 0-9, '.', '_', '-'",
        ));
    }
    Ok(())
}

impl Creds {
    /// `cmd` with these credentials' keys marked secret.
    fn hidden(&self, cmd: Command) -> Command {
        self.keys.iter().fold(cmd, |c, k| c.secret(k.clone()))
    }

    /// Credentials from a keyring file the config names.
    pub fn from_file(user: &str, keyring: &Path) -> Result<Self> {
        check_user(user)?;
        // Unreadable: rbd will say so; there is no key to hide then.
        let text = std::fs::read_to_string(keyring).unwrap_or_default();
        Ok(Creds {
            user: user.into(),
            keyring: keyring.into(),
            keys: keyring_keys(&text),
            temporary: false,
        })
    }

    /// Writes `key` into a keyring only root can read, in `dir`.
    pub fn from_key(user: &str, key: &str, dir: &Path) -> Result<Self> {
        check_user(user)?;
        if key.len() < 16
            || key.len() > 128
            || !key
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"+/=".contains(&b))
        {
            return Err(Error::invalid(
                "secrets: userKey is not a cephx key (base64)",
            ));
        }
        use std::io::Write;
        use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(|e| Error::io(format!("create {}", dir.display()), e))?;
        let mut random = [0u8; 12];
        std::fs::File::open("/dev/urandom")
            .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut random))
            .map_err(|e| Error::io("read /dev/urandom", e))?;
        let name: String = random.iter().map(|b| format!("{b:02x}")).collect();
        let keyring = dir.join(format!("{name}.keyring"));
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&keyring)
            .map_err(|e| Error::io("create a private keyring", e))?;
        f.write_all(format!("[client.{user}]\n\tkey = {key}\n").as_bytes())
            .map_err(|e| Error::io("write a private keyring", e))?;
        Ok(Creds {
            user: user.into(),
            keyring,
            keys: vec![key.to_string()],
            temporary: true,
        })
    }
}

/// Where an image is.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Spec {
    pub pool: String,
    pub namespace: String,
    pub image: String,
}

impl Spec {
    /// `pool/[namespace/]image` as rbd takes it.
    pub fn arg(&self) -> String {
        if self.namespace.is_empty() {
            format!("{}/{}", self.pool, self.image)
        } else {
            format!("{}/{}/{}", self.pool, self.namespace, self.image)
        }
    }
    /// `pool[/namespace]`.
    pub fn pool_arg(&self) -> String {
        if self.namespace.is_empty() {
            self.pool.clone()
        } else {
            format!("{}/{}", self.pool, self.namespace)
        }
    }
    pub fn with_image(&self, image: &str) -> Spec {
        Spec {
            image: image.into(),
            ..self.clone()
        }
    }
}

/// Pool, namespace and image names: what rbd and ids can carry.
pub fn check_name(what: &str, name: &str, empty_ok: bool) -> Result<()> {
    if (name.is_empty() && !empty_ok)
        || name.len() > 100
        || name.starts_with('-')
        || !name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
    {
        return Err(Error::invalid(format!(
            "{what} {name:?}: letters, digits, '.', '_', '-', not starting with '-'"
        )));
    }
    Ok(())
}

#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
pub struct Parent {
    pub pool: String,
    #[serde(default)]
    pub pool_namespace: String,
    pub image: String,
    pub snapshot: String,
}

/// `rbd info --format json`.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
pub struct Info {
    pub name: String,
    pub id: String,
    pub size: u64,
    #[serde(default)]
    pub parent: Option<Parent>,
    #[serde(default)]
    pub create_timestamp: String,
}

/// One row of `rbd ls -l --format json`.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
pub struct Listed {
    pub image: String,
    pub size: u64,
    #[serde(default)]
    pub snapshot: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
struct Status {
    #[serde(default)]
    watchers: Vec<Watcher>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct Watcher {
    pub address: String,
}

#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
pub struct TrashEntry {
    pub id: String,
    pub name: String,
}

/// `ceph df detail --format json`: what each pool can still take.
#[derive(Debug, Clone, Deserialize)]
struct Df {
    pools: Vec<DfPool>,
}

#[derive(Debug, Clone, Deserialize)]
struct DfPool {
    name: String,
    stats: DfStats,
}

#[derive(Debug, Clone, Deserialize)]
struct DfStats {
    /// What the pool can still store, after replication, before the
    /// fullest OSD it maps to is full.
    max_avail: u64,
    /// Bytes stored (before replication).
    #[serde(default)]
    stored: u64,
    /// The pool's byte quota; 0: none.
    #[serde(default)]
    quota_bytes: u64,
}

/// The bytes a pool can still take from `ceph df detail` output: its free
/// room, or what its quota leaves when that is less.
pub fn pool_available(df_json: &str, pool: &str) -> Result<u64> {
    let df: Df = serde_json::from_str(df_json)
        .map_err(|e| Error::internal(format!("ceph df: unexpected output: {e}")))?;
    let p = df
        .pools
        .iter()
        .find(|p| p.name == pool)
        .ok_or_else(|| Error::not_found(format!("ceph df lists no pool {pool:?}")))?;
    let mut free = p.stats.max_avail;
    if p.stats.quota_bytes > 0 {
        free = free.min(p.stats.quota_bytes.saturating_sub(p.stats.stored));
    }
    Ok(free)
}

/// One row of `rbd device list --format json` (showmapped).
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
pub struct Mapped {
    pub pool: String,
    #[serde(default)]
    pub namespace: String,
    pub name: String,
    #[serde(default)]
    pub snap: String,
    pub device: String,
}

const TIMEOUT: Duration = Duration::from_secs(60);
/// Copies (flatten) take their time.
const LONG: Duration = Duration::from_secs(3600);

/// errno values rbd reports in its exit status.
pub const ENOENT: i32 = 2;
pub const EEXIST: i32 = 17;
/// `rbd rm` of an image that still has snapshots (its clones need them).
pub const ENOTEMPTY: i32 = 39;

/// rbd against one cluster.
pub struct Rbd<'a> {
    pub runner: &'a dyn CommandRunner,
    pub monitors: &'a [String],
}

/// rbd exits with the errno of what failed: it is kept on the error
/// (`os_error`) for callers to decide by, never the message, which holds
/// the command line and so the pool and image names.
fn classify(e: ExecError) -> Error {
    let text = e.to_string();
    let code = e.exit_code();
    // EPERM shares exit status 1 with rbd's plain failures: rbd's own
    // word for it, in its stderr (names never hold a space).
    let eperm = matches!(&e, ExecError::Failed { output, .. }
        if output.code == Some(1) && output.stderr.contains("Operation not permitted"));
    let err = match code {
        Some(ENOENT) => Error::not_found(text),
        Some(EEXIST) => Error::already_exists(text),
        // EACCES: cephx refused the key; EPERM: the user may not do it.
        Some(13) => Error::invalid(format!("the cluster refused the credentials: {text}")),
        Some(1) if eperm => Error::invalid(format!("the cluster refused the credentials: {text}")),
        _ if matches!(e, ExecError::Timeout { .. }) => Error::unavailable(text),
        _ => Error::from(e),
    };
    Error {
        os_error: code.filter(|c| *c > 1),
        ..err
    }
}

impl Rbd<'_> {
    fn cmd(&self, creds: &Creds) -> Result<Command> {
        Ok(creds
            .hidden(Command::new("rbd"))
            .args(["-c", "/dev/null", "-m", &self.monitors.join(",")])
            .args(["--id", &creds.user, "--keyring", &path_arg(&creds.keyring)?])
            .args(["--client-mount-timeout", "20"])
            .args([
                "--rados-mon-op-timeout",
                "30",
                "--rados-osd-op-timeout",
                "30",
            ])
            .timeout(TIMEOUT))
    }

    /// The bytes `pool` can still take (`ceph df`, with the same user).
    pub async fn pool_available(&self, creds: &Creds, pool: &str) -> Result<u64> {
        let out = self
            .run_cmd(
                creds
                    .hidden(Command::new("ceph"))
                    .args(["-c", "/dev/null", "-m", &self.monitors.join(",")])
                    .args(["--id", &creds.user, "--keyring", &path_arg(&creds.keyring)?])
                    .args(["--connect-timeout", "20"])
                    .args(["df", "detail", "--format", "json"])
                    .timeout(TIMEOUT),
            )
            .await?;
        pool_available(&out, pool)
    }

    pub async fn run(&self, creds: &Creds, args: &[&str]) -> Result<String> {
        self.run_cmd(self.cmd(creds)?.args(args.iter().copied()))
            .await
    }

    async fn run_cmd(&self, cmd: Command) -> Result<String> {
        self.runner
            .run(cmd)
            .await
            .map(|o| o.stdout)
            .map_err(classify)
    }

    fn json<T: for<'de> Deserialize<'de>>(what: &str, text: &str) -> Result<T> {
        serde_json::from_str(text)
            .map_err(|e| Error::internal(format!("rbd {what}: unexpected output: {e}")))
    }

    /// The image's info; `None` when it does not exist.
    pub async fn info(&self, creds: &Creds, spec: &Spec) -> Result<Option<Info>> {
        match self
            .run(creds, &["info", &spec.arg(), "--format", "json"])
            .await
        {
            Ok(out) => Self::json("info", &out).map(Some),
            Err(e) if e.kind == crate::error::Kind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }

    pub async fn meta(&self, creds: &Creds, spec: &Spec) -> Result<BTreeMap<String, String>> {
        let out = self
            .run(
                creds,
                &["image-meta", "list", &spec.arg(), "--format", "json"],
            )
            .await?;
        if out.trim().is_empty() {
            return Ok(BTreeMap::new());
        }
        Self::json("image-meta list", &out)
    }

    pub async fn set_meta(&self, creds: &Creds, spec: &Spec, key: &str, value: &str) -> Result<()> {
        self.run(creds, &["image-meta", "set", &spec.arg(), key, value])
            .await
            .map(|_| ())
    }

    pub async fn remove_meta(&self, creds: &Creds, spec: &Spec, key: &str) -> Result<()> {
        match self
            .run(creds, &["image-meta", "remove", &spec.arg(), key])
            .await
        {
            Ok(_) => Ok(()),
            Err(e) if e.kind == crate::error::Kind::NotFound => Ok(()),
            Err(e) => Err(e),
        }
    }

    pub async fn watchers(&self, creds: &Creds, spec: &Spec) -> Result<Vec<Watcher>> {
        let out = self
            .run(creds, &["status", &spec.arg(), "--format", "json"])
            .await?;
        Ok(Self::json::<Status>("status", &out)?.watchers)
    }

    pub async fn list(&self, creds: &Creds, pool: &Spec) -> Result<Vec<Listed>> {
        let out = self
            .run(creds, &["ls", "-l", &pool.pool_arg(), "--format", "json"])
            .await?;
        let rows: Vec<Listed> = Self::json("ls", &out)?;
        // Snapshots are listed as rows too; only images.
        Ok(rows.into_iter().filter(|r| r.snapshot.is_none()).collect())
    }

    pub async fn trash(&self, creds: &Creds, pool: &Spec) -> Result<Vec<TrashEntry>> {
        let out = self
            .run(
                creds,
                &["trash", "ls", &pool.pool_arg(), "--format", "json"],
            )
            .await?;
        Self::json("trash ls", &out)
    }

    /// Flattens an image (copies its parent's data into it).
    pub async fn flatten(&self, creds: &Creds, spec: &Spec) -> Result<()> {
        self.run_cmd(
            self.cmd(creds)?
                .args(["flatten", &spec.arg()])
                .timeout(LONG),
        )
        .await
        .map(|_| ())
    }

    /// Mapped images on this node.
    pub async fn mapped(&self) -> Result<Vec<Mapped>> {
        let out = self
            .run_cmd(
                Command::new("rbd")
                    .args(["device", "list", "--format", "json"])
                    .timeout(TIMEOUT),
            )
            .await?;
        if out.trim().is_empty() {
            return Ok(Vec::new());
        }
        Self::json("device list", &out)
    }

    pub async fn map(&self, creds: &Creds, spec: &Spec, options: &str) -> Result<PathBuf> {
        let mut cmd = self.cmd(creds)?.args(["device", "map", &spec.arg()]);
        if !options.is_empty() {
            cmd = cmd.args(["--options", options]);
        }
        let out = self.run_cmd(cmd).await?;
        let dev = out.trim();
        if !dev.starts_with("/dev/rbd") {
            return Err(Error::internal(format!(
                "rbd map printed {dev:?}, not a device"
            )));
        }
        Ok(PathBuf::from(dev))
    }

    pub async fn unmap(&self, device: &Path) -> Result<()> {
        self.run_cmd(
            Command::new("rbd")
                .args(["device", "unmap", &path_arg(device)?])
                .timeout(TIMEOUT),
        )
        .await
        .map(|_| ())
    }
}
