//! What the rbd backend asks of a Ceph cluster, typed: one seam with two
//! clients behind it, the `rbd` command line (`cli.rs`, a process and a
//! cephx session per call) and librbd on a kept connection (`librbd.rs`).
//! Errors carry the errno that failed (`Error::os_error`), which callers
//! decide by, never the message.

use super::creds::Creds;
use crate::error::{Error, Result};
use serde::Deserialize;
use std::collections::BTreeMap;

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

impl Parent {
    /// The parent image.
    pub fn image_spec(&self) -> Spec {
        Spec {
            pool: self.pool.clone(),
            namespace: self.pool_namespace.clone(),
            image: self.image.clone(),
        }
    }
}

/// What the backend needs to know of an image.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
pub struct Info {
    pub size: u64,
    #[serde(default)]
    pub parent: Option<Parent>,
}

/// An image as a delete sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Inspected {
    pub info: Info,
    pub meta: BTreeMap<String, String>,
    /// The addresses of the clients watching it.
    pub watchers: Vec<String>,
    /// The temporary group a group snapshot cut short left holding it
    /// (see [`Cluster::leftover_group`]).
    pub group: Option<String>,
    /// Its user snapshots.
    pub snaps: Vec<String>,
}

/// One image of a pool, with its size.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
pub struct Listed {
    pub image: String,
    pub size: u64,
    #[serde(default)]
    pub snapshot: Option<String>,
}

#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
pub struct TrashEntry {
    pub id: String,
    pub name: String,
}

/// How a new image is made: its features (rbd's names, comma-separated)
/// and where its data goes.
#[derive(Debug, Clone, Copy)]
pub struct Layout<'a> {
    pub features: &'a str,
    pub data_pool: &'a str,
}

/// A page of a diff: its ranges (offset, length), and where the next page
/// starts (None: this was the last).
pub type DiffPage = (Vec<(u64, u64)>, Option<u64>);

/// One page of an image's diff: its extents as they come (in order),
/// merged where they touch, at most `max`; the offset of the first extent
/// that did not fit is where the next page starts.
pub struct Pager {
    start: u64,
    max: usize,
    ranges: Vec<(u64, u64)>,
    next: Option<u64>,
}

impl Pager {
    pub fn new(start: u64, max: usize) -> Pager {
        Pager {
            start,
            max: max.max(1),
            ranges: Vec::new(),
            next: None,
        }
    }

    /// Takes one extent (the part from the page's start); false once the
    /// page is full.
    pub fn take(&mut self, offset: u64, len: u64) -> bool {
        let (from, to) = (offset.max(self.start), offset.saturating_add(len));
        if to <= from {
            return true;
        }
        if let Some((at, n)) = self.ranges.last_mut() {
            if *at + *n >= from {
                *n = (*n).max(to - *at);
                return true;
            }
        }
        if self.ranges.len() == self.max {
            self.next = Some(from);
            return false;
        }
        self.ranges.push((from, to - from));
        true
    }

    /// The page's ranges and where the next one starts.
    pub fn done(self) -> DiffPage {
        (self.ranges, self.next)
    }
}

/// errno values decisions are made by.
pub const ENOENT: i32 = 2;
pub const EEXIST: i32 = 17;
/// Removing an image that still has snapshots (its clones need them).
pub const ENOTEMPTY: i32 = 39;

/// The cluster operations of the controller, and the one read of the
/// node's health check. Each either finishes or fails with the errno kept.
#[async_trait::async_trait]
pub trait Cluster: Send + Sync {
    /// Which client this is, for logs and the bench.
    fn client(&self) -> &'static str;
    /// The image's size and parent; `None` when it does not exist.
    async fn info(&self, creds: &Creds, spec: &Spec) -> Result<Option<Info>>;
    /// Info and metadata together (one open of the image where the client
    /// allows); `None` when the image does not exist.
    async fn describe(
        &self,
        creds: &Creds,
        spec: &Spec,
    ) -> Result<Option<(Info, BTreeMap<String, String>)>> {
        let Some(info) = self.info(creds, spec).await? else {
            return Ok(None);
        };
        match self.meta(creds, spec).await {
            Ok(meta) => Ok(Some((info, meta))),
            Err(e) if e.os_error == Some(ENOENT) => Ok(None),
            Err(e) => Err(e),
        }
    }
    /// What a delete decides by: info, metadata, watchers, a leftover group
    /// and the snapshots (one open
    /// of the image where the client allows); `None` when it does not exist.
    async fn inspect(&self, creds: &Creds, spec: &Spec) -> Result<Option<Inspected>> {
        let Some((info, meta)) = self.describe(creds, spec).await? else {
            return Ok(None);
        };
        let watchers = self.watchers(creds, spec).await?;
        let group = self.leftover_group(creds, spec).await?;
        let snaps = self.snaps(creds, spec).await?;
        Ok(Some(Inspected {
            info,
            meta,
            watchers,
            group,
            snaps,
        }))
    }
    async fn meta(&self, creds: &Creds, spec: &Spec) -> Result<BTreeMap<String, String>>;
    async fn set_meta(&self, creds: &Creds, spec: &Spec, key: &str, value: &str) -> Result<()>;
    /// Removes a key; a key that is not there is no error.
    async fn remove_meta(&self, creds: &Creds, spec: &Spec, key: &str) -> Result<()>;
    /// Removes an image as [`Self::remove`] does, but may answer once the
    /// image is out of the pool's directory (moved to the trash), its data
    /// removed in the background (librbd: a task of the driver's; what a
    /// driver that dies leaves in the trash, a later delete's purge of the
    /// trash removes). An image that clones need stays in the trash.
    /// `parent` is the image's parent, if it has one: while its data is
    /// removed the parent is open (watched) by the driver itself.
    async fn discard(&self, creds: &Creds, spec: &Spec, _parent: Option<&Spec>) -> Result<()> {
        self.remove(creds, spec).await
    }
    /// Waits (a bounded while) until no background removal of a clone of
    /// `spec` holds it open: a delete would see the driver's own watch.
    async fn settle(&self, _spec: &Spec) {}
    /// Whether this client makes a new volume under its final name, its
    /// making recorded first in the place's record of images being made
    /// ([`Self::intend`]), rather than under a temporary name renamed when
    /// done. A rename opens the image and updates the pool's directory
    /// (about 6-10 ms, more than the create itself); a record is one OSD
    /// operation each way. The CLI client keeps the rename.
    fn makes_in_place(&self) -> bool {
        false
    }
    /// Records, in the place of `spec`, that image `spec` is being made
    /// for the CSI name `name`; [`Self::finish`] removes the record.
    async fn intend(&self, _creds: &Creds, spec: &Spec, _name: &str) -> Result<()> {
        Err(crate::error::Error::internal(format!(
            "{}: this client makes images under a temporary name",
            spec.arg()
        )))
    }
    /// Makes the new, empty image `spec` under its final name for the CSI
    /// name `name` when no image has that name, in one go: the lookup,
    /// its making recorded ([`Self::intend`]), the create, then `set` on
    /// it, which makes it whole (the steps the backend otherwise takes one
    /// by one, each a hop to a blocking thread and back). `Ok(false)`,
    /// with nothing done, when an image of that name is there: the caller
    /// looks at it. Only for clients that make in place.
    async fn make_new(
        &self,
        _creds: &Creds,
        spec: &Spec,
        _name: &str,
        _size: u64,
        _layout: Layout<'_>,
        _set: &[(&str, &str)],
    ) -> Result<bool> {
        Err(crate::error::Error::internal(format!(
            "{}: this client makes images under a temporary name",
            spec.arg()
        )))
    }
    /// Removes the record that image `spec` is being made (none is no
    /// error).
    async fn unintend(&self, _creds: &Creds, _spec: &Spec) -> Result<()> {
        Ok(())
    }
    /// The images of the place `place` names that are being made (or were
    /// when a driver died), each with the CSI name it is made for.
    async fn intended(&self, _creds: &Creds, _place: &Spec) -> Result<BTreeMap<String, String>> {
        Ok(BTreeMap::new())
    }
    /// Sets `set` and removes the `ferrovol.`-keys not in it (a clone comes
    /// with its parent's), then renames the image to `to`: what makes a
    /// temporary image a finished one. Made in place (`tmp` is `to`), the
    /// image is whole once named, and the record of its making is removed
    /// after the answer, in the background, instead of a rename.
    async fn finish(
        &self,
        creds: &Creds,
        tmp: &Spec,
        to: &Spec,
        set: &[(&str, &str)],
        clear_others: bool,
    ) -> Result<()> {
        if clear_others {
            for key in self.meta(creds, tmp).await?.keys() {
                if key.starts_with("ferrovol.") && !set.iter().any(|(k, _)| k == key) {
                    self.remove_meta(creds, tmp, key).await?;
                }
            }
        }
        for (k, v) in set {
            self.set_meta(creds, tmp, k, v).await?;
        }
        self.rename(creds, tmp, to).await
    }
    /// The addresses of the clients watching the image (mapped it).
    async fn watchers(&self, creds: &Creds, spec: &Spec) -> Result<Vec<String>>;
    /// Denies the client instance at `addr` (`ip:port/nonce`, checked by
    /// [`check_client_addr`]) every OSD operation for `expire` seconds
    /// (`osd blocklist add`; cephx `profile rbd` on the monitors allows it).
    async fn blocklist(&self, creds: &Creds, addr: &str, expire: u64) -> Result<()>;
    /// The names of the images of a pool (and namespace) `place` names.
    async fn list(&self, creds: &Creds, place: &Spec) -> Result<Vec<String>>;
    /// The sizes of these images, `None` for one that is gone: what a page
    /// of ListVolumes reads, for its own entries only.
    async fn sizes(&self, creds: &Creds, specs: &[Spec]) -> Result<Vec<Option<u64>>> {
        let mut out = Vec::with_capacity(specs.len());
        for spec in specs {
            out.push(self.info(creds, spec).await?.map(|i| i.size));
        }
        Ok(out)
    }
    async fn namespaces(&self, creds: &Creds, pool: &str) -> Result<Vec<String>>;
    async fn trash(&self, creds: &Creds, place: &Spec) -> Result<Vec<TrashEntry>>;
    async fn trash_move(&self, creds: &Creds, spec: &Spec) -> Result<()>;
    async fn trash_remove(&self, creds: &Creds, place: &Spec, id: &str) -> Result<()>;
    async fn create(&self, creds: &Creds, spec: &Spec, size: u64, layout: Layout<'_>)
        -> Result<()>;
    /// A format 2 clone of `parent@snap` as `to`; with the cluster's
    /// default features when no layout is given.
    async fn clone_image(
        &self,
        creds: &Creds,
        parent: &Spec,
        snap: &str,
        to: &Spec,
        layout: Option<Layout<'_>>,
    ) -> Result<()>;
    async fn resize(&self, creds: &Creds, spec: &Spec, size: u64) -> Result<()>;
    /// Copies the parent's data into the image (long).
    async fn flatten(&self, creds: &Creds, spec: &Spec) -> Result<()>;
    /// Fails with ENOTEMPTY while the image has snapshots.
    async fn remove(&self, creds: &Creds, spec: &Spec) -> Result<()>;
    async fn rename(&self, creds: &Creds, from: &Spec, to: &Spec) -> Result<()>;
    async fn snap_create(&self, creds: &Creds, spec: &Spec, snap: &str) -> Result<()>;
    async fn snap_remove(&self, creds: &Creds, spec: &Spec, snap: &str) -> Result<()>;
    /// The names of the image's own (user) snapshots.
    async fn snaps(&self, creds: &Creds, spec: &Spec) -> Result<Vec<String>>;
    /// One page (see [`Pager`]) of the exact extents from `start` that
    /// image `spec`, at snapshot `at` or its head, holds data in, its
    /// parent's included (`from` None), or that changed since its earlier
    /// snapshot `from` (written, or discarded).
    async fn diff(
        &self,
        creds: &Creds,
        spec: &Spec,
        at: Option<&str>,
        from: Option<&str>,
        start: u64,
        max: usize,
    ) -> Result<DiffPage>;
    /// The bytes `pool` can still take.
    async fn pool_available(&self, creds: &Creds, pool: &str) -> Result<u64>;
    /// Snapshots every `(image, snapshot name)` at one instant: each
    /// image's exclusive lock is taken and held (a client writing it, a
    /// node's kernel client, gives the lock up when asked and waits for it
    /// before its next write), every snapshot is cut, every lock let go. A
    /// failure removes the snapshots made. Needs a client that can hold
    /// locks across calls: only librbd can.
    async fn snap_together(&self, _creds: &Creds, _members: &[(Spec, String)]) -> Result<()> {
        Err(Error::precondition(
            "group snapshots of rbd volumes hold every member's exclusive lock at once, \
             which only the librbd client can (client = \"librbd\" in the backend's config)",
        ))
    }

    /// Copies every `(image, to)` as all were at one instant, for images in
    /// use: a temporary rbd group (`group`: its pool, namespace and name)
    /// takes each member's exclusive lock the way a writing client (a
    /// node's kernel client) hands it over and waits for it back, snapshots
    /// all, and each member is copied from its snapshot (a full, flat copy:
    /// the group's snapshots cannot be cloned from before Ceph 18). The
    /// group and its snapshots are removed, and on failure the copies
    /// made. Only librbd can reach a group's snapshots.
    async fn copy_together(
        &self,
        _creds: &Creds,
        _group: &Spec,
        _members: &[(Spec, Spec)],
    ) -> Result<()> {
        Err(Error::precondition(
            "group snapshots of rbd volumes in use go through an rbd group, whose snapshots \
             only the librbd client can read (client = \"librbd\" in the backend's config)",
        ))
    }

    /// The temporary group of [`Cluster::copy_together`] (named `fvg-`,
    /// in the image's pool) that the image is still a member of: a driver
    /// that died copying left it, with its snapshots, and an image in a
    /// group cannot be removed. None when the image is in no group of
    /// ours (and on clients that cannot make such groups).
    async fn leftover_group(&self, _creds: &Creds, _spec: &Spec) -> Result<Option<String>> {
        Ok(None)
    }

    /// Removes group `name` of the pool (and namespace) `place` names: its
    /// snapshots go, its members leave it.
    async fn group_remove(&self, _creds: &Creds, _place: &Spec, name: &str) -> Result<()> {
        Err(Error::precondition(format!(
            "rbd group {name} can be removed only on the librbd client"
        )))
    }
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

/// `osd pool ls detail --format json`: each pool's flags.
#[derive(Debug, Clone, Deserialize)]
struct PoolFlags {
    pool_name: String,
    #[serde(default)]
    flags_names: String,
}

/// The flags that say `pool` takes no more data, from `osd pool ls detail`
/// output: `full` (an OSD it maps to past its full ratio, or its quota
/// reached, which adds `full_quota`); None when it has none of them, or is
/// not listed.
pub fn pool_full(pools_json: &str, pool: &str) -> Option<String> {
    let pools: Vec<PoolFlags> = serde_json::from_str(pools_json).ok()?;
    let p = pools.iter().find(|p| p.pool_name == pool)?;
    let full: Vec<&str> = p
        .flags_names
        .split(',')
        .filter(|f| *f == "full" || *f == "full_quota")
        .collect();
    (!full.is_empty()).then(|| full.join(","))
}

/// The backend's features by name, as librbd's bits.
pub fn feature_bits(features: &str) -> Result<u64> {
    let mut bits = 0;
    for f in features.split(',').filter(|f| !f.is_empty()) {
        bits |= match f {
            "layering" => 1 << 0,
            "exclusive-lock" => 1 << 2,
            "object-map" => 1 << 3,
            "fast-diff" => 1 << 4,
            "deep-flatten" => 1 << 5,
            "journaling" => 1 << 6,
            other => return Err(Error::invalid(format!("unknown image feature {other:?}"))),
        };
    }
    Ok(bits)
}

/// A Ceph client instance's address as the kernel shows it
/// (`10.0.0.2:0/3459289423`, `[fd00::2]:0/17`): what may go into a
/// blocklist command.
pub fn check_client_addr(addr: &str) -> Result<()> {
    let (host_port, nonce) = addr.split_once('/').unwrap_or(("", ""));
    let ok = addr.len() <= 64
        && host_port.contains(':')
        && !nonce.is_empty()
        && nonce.bytes().all(|b| b.is_ascii_digit())
        && host_port
            .bytes()
            .all(|b| b.is_ascii_hexdigit() || matches!(b, b'.' | b':' | b'[' | b']'));
    if ok {
        Ok(())
    } else {
        Err(crate::error::Error::internal(format!(
            "{addr:?} is not a Ceph client address"
        )))
    }
}
