//! The `rbd` command line through the exec seam: credentials in a private
//! keyring file (never argv), JSON reports parsed into typed rows, and
//! rbd's errors classified by their errno. The cluster client when librbd
//! is not there, and the node's map and unmap always.

use super::cluster::{
    pool_available, Cluster, DiffPage, Info, Layout, Listed, Pager, Spec, TrashEntry, EEXIST,
    ENOENT,
};
use super::creds::Creds;
use crate::error::{Error, Result};
use crate::exec::{path_arg, Command, CommandRunner, ExecError};
use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

#[derive(Debug, Clone, Deserialize)]
struct Status {
    #[serde(default)]
    watchers: Vec<Watcher>,
}

#[derive(Debug, Clone, Deserialize)]
struct Watcher {
    address: String,
}

/// One row of `rbd snap ls --format json` (user snapshots).
#[derive(Debug, Clone, Deserialize)]
struct Snap {
    name: String,
}

/// One extent of `rbd diff --format json`.
#[derive(Debug, Clone, Deserialize)]
struct DiffExtent {
    offset: u64,
    length: u64,
}

/// A page of `rbd diff` output (every extent of the image, in order).
pub(super) fn diff_page(out: &str, start: u64, max: usize) -> Result<DiffPage> {
    let extents: Vec<DiffExtent> = if out.trim().is_empty() {
        Vec::new()
    } else {
        json("diff", out)?
    };
    let mut pager = Pager::new(start, max);
    for e in extents {
        if !pager.take(e.offset, e.length) {
            break;
        }
    }
    Ok(pager.done())
}

#[derive(Debug, Clone, Deserialize)]
struct Namespace {
    name: String,
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
    /// `cmd` (rbd or ceph) pointed at this cluster with these credentials:
    /// no config file, the key in a keyring file, its values hidden from
    /// whatever the tool prints.
    fn tool(&self, cmd: Command, creds: &Creds) -> Result<Command> {
        Ok(creds
            .hidden(cmd)
            .args(["-c", "/dev/null", "-m", &self.monitors.join(",")])
            .args([
                "--id",
                &creds.user,
                "--keyring",
                &path_arg(&creds.keyring()?)?,
            ])
            .timeout(TIMEOUT))
    }

    fn cmd(&self, creds: &Creds) -> Result<Command> {
        Ok(self
            .tool(Command::new("rbd"), creds)?
            .args(["--client-mount-timeout", "20"])
            .args([
                "--rados-mon-op-timeout",
                "30",
                "--rados-osd-op-timeout",
                "30",
            ]))
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
    fn client(&self) -> &'static str {
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

    async fn blocklist(&self, creds: &Creds, addr: &str, expire: u64) -> Result<()> {
        super::cluster::check_client_addr(addr)?;
        self.run_cmd(
            self.tool(Command::new("ceph"), creds)?
                .args(["--connect-timeout", "20"])
                .args(["osd", "blocklist", "add", addr, &expire.to_string()]),
        )
        .await
        .map(|_| ())
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

    async fn snaps(&self, creds: &Creds, spec: &Spec) -> Result<Vec<String>> {
        let out = self
            .run(creds, &["snap", "ls", &spec.arg(), "--format", "json"])
            .await?;
        let snaps: Vec<Snap> = json("snap ls", &out)?;
        Ok(snaps.into_iter().map(|s| s.name).collect())
    }

    /// The command line has no offset: each page reads the whole diff
    /// and keeps its part.
    async fn diff(
        &self,
        creds: &Creds,
        spec: &Spec,
        at: Option<&str>,
        from: Option<&str>,
        start: u64,
        max: usize,
    ) -> Result<DiffPage> {
        let image = match at {
            Some(snap) => format!("{}@{snap}", spec.arg()),
            None => spec.arg(),
        };
        let mut cmd = self
            .cmd(creds)?
            .args(["diff", "--format", "json", &image])
            .timeout(LONG);
        if let Some(f) = from {
            cmd = cmd.args(["--from-snap", f]);
        }
        diff_page(&self.run_cmd(cmd).await?, start, max)
    }

    async fn pool_available(&self, creds: &Creds, pool: &str) -> Result<u64> {
        let out = self
            .run_cmd(
                self.tool(Command::new("ceph"), creds)?
                    .args(["--connect-timeout", "20"])
                    .args(["df", "detail", "--format", "json"]),
            )
            .await?;
        pool_available(&out, pool)
    }
}
