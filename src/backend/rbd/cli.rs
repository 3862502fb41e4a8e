//! The `rbd` command line through the exec seam: credentials in a private
//! keyring file (never argv), JSON reports parsed into typed rows, and
//! rbd's errors classified by their errno. The cluster road when librbd
//! is not there, and the node's map and unmap always.

use super::cluster::{
    pool_available, Cluster, Info, Layout, Listed, Spec, TrashEntry, EEXIST, ENOENT,
};
use crate::error::{Error, Result};
use crate::exec::{path_arg, Command, CommandRunner, ExecError};
use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// A cephx user and its key: from a keyring file of the config, or from
/// the CSI secrets (written to a private keyring file only when a command
/// needs one, and removed with the credentials).
pub struct Creds {
    pub user: String,
    source: KeySource,
    /// The cephx keys these credentials carry: redacted from whatever a
    /// command run with them prints (a tool that echoes its keyring).
    keys: Vec<String>,
    /// The private keyring written for the command line, if one was.
    written: std::sync::Mutex<Option<PathBuf>>,
}

enum KeySource {
    File(PathBuf),
    /// The key is `keys[0]`; a keyring for it goes into this directory.
    Secret(PathBuf),
}

impl Drop for Creds {
    fn drop(&mut self) {
        let written = self.written.get_mut().map(|w| w.take());
        if let Ok(Some(path)) = written {
            let _ = std::fs::remove_file(path);
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

/// The key of `[client.<user>]` in a keyring file's text.
pub fn keyring_key_for(text: &str, user: &str) -> Option<String> {
    let section = format!("[client.{user}]");
    let mut inside = false;
    for line in text.lines().map(str::trim) {
        if line.starts_with('[') {
            inside = line == section;
            continue;
        }
        if let Some((k, v)) = line.split_once('=') {
            if inside && k.trim() == "key" && !v.trim().is_empty() {
                return Some(v.trim().to_string());
            }
        }
    }
    None
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
        let mut keys = keyring_keys(&text);
        // The user's own key first: the one a kept connection uses.
        if let Some(own) = keyring_key_for(&text, user) {
            keys.retain(|k| *k != own);
            keys.insert(0, own);
        }
        Ok(Creds {
            user: user.into(),
            source: KeySource::File(keyring.into()),
            keys,
            written: Default::default(),
        })
    }

    /// Credentials from the CSI secrets; a keyring for the command line
    /// goes into `dir` when one is needed.
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
        Ok(Creds {
            user: user.into(),
            source: KeySource::Secret(dir.into()),
            keys: vec![key.to_string()],
            written: Default::default(),
        })
    }

    /// The cephx key itself, for a connection of the driver's own.
    pub fn key(&self) -> Result<&str> {
        match (&self.source, self.keys.first()) {
            (_, Some(k)) => Ok(k),
            (KeySource::File(path), None) => Err(Error::invalid(format!(
                "keyring {} holds no key the driver can read for client.{}",
                path.display(),
                self.user
            ))),
            (KeySource::Secret(_), None) => Err(Error::internal("credentials without a key")),
        }
    }

    /// A keyring file for the command line: the config's, or a private
    /// one (only root can read it) written for these credentials once.
    pub fn keyring(&self) -> Result<PathBuf> {
        let dir = match &self.source {
            KeySource::File(path) => return Ok(path.clone()),
            KeySource::Secret(dir) => dir,
        };
        let mut written = self
            .written
            .lock()
            .map_err(|_| Error::internal("keyring lock poisoned"))?;
        if let Some(path) = &*written {
            return Ok(path.clone());
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
        // Recorded before the write: a failed write is removed too.
        *written = Some(keyring.clone());
        f.write_all(format!("[client.{}]\n\tkey = {}\n", self.user, self.key()?).as_bytes())
            .map_err(|e| Error::io("write a private keyring", e))?;
        Ok(keyring)
    }
}

#[derive(Debug, Clone, Deserialize)]
struct Status {
    #[serde(default)]
    watchers: Vec<Watcher>,
}

#[derive(Debug, Clone, Deserialize)]
struct Watcher {
    address: String,
}

#[derive(Debug, Clone, Deserialize)]
struct Namespace {
    name: String,
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

/// rbd through its command line, against one cluster: a process (and a
/// cephx session) per call. Mapping on nodes always goes this way.
pub struct CliCluster {
    pub runner: Arc<dyn CommandRunner>,
    pub monitors: Vec<String>,
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

fn json<T: for<'de> Deserialize<'de>>(what: &str, text: &str) -> Result<T> {
    serde_json::from_str(text)
        .map_err(|e| Error::internal(format!("rbd {what}: unexpected output: {e}")))
}

impl CliCluster {
    fn cmd(&self, creds: &Creds) -> Result<Command> {
        Ok(creds
            .hidden(Command::new("rbd"))
            .args(["-c", "/dev/null", "-m", &self.monitors.join(",")])
            .args([
                "--id",
                &creds.user,
                "--keyring",
                &path_arg(&creds.keyring()?)?,
            ])
            .args(["--client-mount-timeout", "20"])
            .args([
                "--rados-mon-op-timeout",
                "30",
                "--rados-osd-op-timeout",
                "30",
            ])
            .timeout(TIMEOUT))
    }

    async fn run(&self, creds: &Creds, args: &[&str]) -> Result<String> {
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
        json("device list", &out)
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

    fn layout_args<'a>(args: &mut Vec<&'a str>, layout: Layout<'a>) {
        args.extend(["--image-feature", layout.features]);
        if !layout.data_pool.is_empty() {
            args.extend(["--data-pool", layout.data_pool]);
        }
    }
}

#[async_trait::async_trait]
impl Cluster for CliCluster {
    fn road(&self) -> &'static str {
        "cli"
    }

    async fn info(&self, creds: &Creds, spec: &Spec) -> Result<Option<Info>> {
        match self
            .run(creds, &["info", &spec.arg(), "--format", "json"])
            .await
        {
            Ok(out) => json("info", &out).map(Some),
            Err(e) if e.kind == crate::error::Kind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }

    async fn meta(&self, creds: &Creds, spec: &Spec) -> Result<BTreeMap<String, String>> {
        let out = self
            .run(
                creds,
                &["image-meta", "list", &spec.arg(), "--format", "json"],
            )
            .await?;
        if out.trim().is_empty() {
            return Ok(BTreeMap::new());
        }
        json("image-meta list", &out)
    }

    async fn set_meta(&self, creds: &Creds, spec: &Spec, key: &str, value: &str) -> Result<()> {
        self.run(creds, &["image-meta", "set", &spec.arg(), key, value])
            .await
            .map(|_| ())
    }

    async fn remove_meta(&self, creds: &Creds, spec: &Spec, key: &str) -> Result<()> {
        match self
            .run(creds, &["image-meta", "remove", &spec.arg(), key])
            .await
        {
            Ok(_) => Ok(()),
            Err(e) if e.kind == crate::error::Kind::NotFound => Ok(()),
            Err(e) => Err(e),
        }
    }

    async fn watchers(&self, creds: &Creds, spec: &Spec) -> Result<Vec<String>> {
        let out = self
            .run(creds, &["status", &spec.arg(), "--format", "json"])
            .await?;
        Ok(json::<Status>("status", &out)?
            .watchers
            .into_iter()
            .map(|w| w.address)
            .collect())
    }

    async fn list(&self, creds: &Creds, place: &Spec) -> Result<Vec<String>> {
        let out = self
            .run(creds, &["ls", &place.pool_arg(), "--format", "json"])
            .await?;
        json("ls", &out)
    }

    /// One `rbd ls -l` per pool and namespace, not a process per image.
    async fn sizes(&self, creds: &Creds, specs: &[Spec]) -> Result<Vec<Option<u64>>> {
        let mut listed: BTreeMap<String, BTreeMap<String, u64>> = BTreeMap::new();
        for spec in specs {
            let place = spec.pool_arg();
            if listed.contains_key(&place) {
                continue;
            }
            let out = self
                .run(creds, &["ls", "-l", &place, "--format", "json"])
                .await?;
            let rows: Vec<Listed> = json("ls -l", &out)?;
            // Snapshots are listed as rows too; only images.
            let sizes = rows
                .into_iter()
                .filter(|r| r.snapshot.is_none())
                .map(|r| (r.image, r.size))
                .collect();
            listed.insert(place, sizes);
        }
        Ok(specs
            .iter()
            .map(|s| listed[&s.pool_arg()].get(&s.image).copied())
            .collect())
    }

    async fn namespaces(&self, creds: &Creds, pool: &str) -> Result<Vec<String>> {
        let out = self
            .run(creds, &["namespace", "ls", pool, "--format", "json"])
            .await?;
        let names: Vec<Namespace> = serde_json::from_str(out.trim()).unwrap_or_default();
        Ok(names.into_iter().map(|n| n.name).collect())
    }

    async fn trash(&self, creds: &Creds, place: &Spec) -> Result<Vec<TrashEntry>> {
        let out = self
            .run(
                creds,
                &["trash", "ls", &place.pool_arg(), "--format", "json"],
            )
            .await?;
        json("trash ls", &out)
    }

    async fn trash_move(&self, creds: &Creds, spec: &Spec) -> Result<()> {
        self.run(creds, &["trash", "mv", &spec.arg()])
            .await
            .map(|_| ())
    }

    async fn trash_remove(&self, creds: &Creds, place: &Spec, id: &str) -> Result<()> {
        let target = format!("{}/{id}", place.pool_arg());
        self.run(creds, &["trash", "rm", &target]).await.map(|_| ())
    }

    async fn create(
        &self,
        creds: &Creds,
        spec: &Spec,
        size: u64,
        layout: Layout<'_>,
    ) -> Result<()> {
        let at = spec.arg();
        let size_arg = format!("{}M", size >> 20);
        let mut args = vec!["create", at.as_str(), "--size", size_arg.as_str()];
        Self::layout_args(&mut args, layout);
        self.run(creds, &args).await.map(|_| ())
    }

    async fn clone_image(
        &self,
        creds: &Creds,
        parent: &Spec,
        snap: &str,
        to: &Spec,
        layout: Option<Layout<'_>>,
    ) -> Result<()> {
        let from = format!("{}@{snap}", parent.arg());
        let to_arg = to.arg();
        let mut args = vec![
            "clone",
            "--rbd-default-clone-format",
            "2",
            from.as_str(),
            to_arg.as_str(),
        ];
        if let Some(l) = layout {
            Self::layout_args(&mut args, l);
        }
        self.run(creds, &args).await.map(|_| ())
    }

    async fn resize(&self, creds: &Creds, spec: &Spec, size: u64) -> Result<()> {
        self.run(
            creds,
            &["resize", &spec.arg(), "--size", &format!("{}M", size >> 20)],
        )
        .await
        .map(|_| ())
    }

    async fn flatten(&self, creds: &Creds, spec: &Spec) -> Result<()> {
        self.run_cmd(
            self.cmd(creds)?
                .args(["flatten", &spec.arg()])
                .timeout(LONG),
        )
        .await
        .map(|_| ())
    }

    async fn remove(&self, creds: &Creds, spec: &Spec) -> Result<()> {
        self.run(creds, &["rm", &spec.arg()]).await.map(|_| ())
    }

    async fn rename(&self, creds: &Creds, from: &Spec, to: &Spec) -> Result<()> {
        self.run(creds, &["rename", &from.arg(), &to.arg()])
            .await
            .map(|_| ())
    }

    async fn snap_create(&self, creds: &Creds, spec: &Spec, snap: &str) -> Result<()> {
        self.run(
            creds,
            &["snap", "create", &format!("{}@{snap}", spec.arg())],
        )
        .await
        .map(|_| ())
    }

    async fn snap_remove(&self, creds: &Creds, spec: &Spec, snap: &str) -> Result<()> {
        self.run(creds, &["snap", "rm", &format!("{}@{snap}", spec.arg())])
            .await
            .map(|_| ())
    }

    async fn pool_available(&self, creds: &Creds, pool: &str) -> Result<u64> {
        let out = self
            .run_cmd(
                creds
                    .hidden(Command::new("ceph"))
                    .args(["-c", "/dev/null", "-m", &self.monitors.join(",")])
                    .args([
                        "--id",
                        &creds.user,
                        "--keyring",
                        &path_arg(&creds.keyring()?)?,
                    ])
                    .args(["--connect-timeout", "20"])
                    .args(["df", "detail", "--format", "json"])
                    .timeout(TIMEOUT),
            )
            .await?;
        pool_available(&out, pool)
    }
}
