//! The cluster's calls on librbd: kept connections per cephx user and key,
//! and the [`Cluster`] seam implemented on the handles of [`super::ffi`].
//! No `unsafe` here.

#![forbid(unsafe_code)]

use super::super::cluster::{Cluster, DiffPage, Info, Inspected, Layout, Spec, TrashEntry};
use super::super::creds::Creds;
use super::ffi::*;
use crate::error::{Error, Kind, Result};
use crate::sync::LockExt;
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

#[derive(Default)]
struct Pool {
    kept: HashMap<[u8; 32], Kept>,
}

struct Kept {
    conn: Arc<tokio::sync::OnceCell<Arc<Connection>>>,
    used: Instant,
}

/// librbd on kept connections, against one cluster.
pub struct LibCluster {
    api: &'static Api,
    monitors: String,
    pool: Mutex<Pool>,
    /// Trash entries (image ids) whose data a background task is removing,
    /// with the parent each holds open meanwhile.
    removing: Arc<Mutex<HashMap<String, Option<Spec>>>>,
    /// Images made in place whose record of making a background task is
    /// removing (a delete of one waits for it).
    unintending: Arc<Mutex<Vec<Spec>>>,
    /// The driver's cap on how long storage is waited on
    /// (`--command-timeout`): every call's deadline is at most this.
    cap: Option<Duration>,
}

impl LibCluster {
    pub fn new(
        monitors: &[String],
        cap: Option<Duration>,
    ) -> std::result::Result<LibCluster, String> {
        Ok(LibCluster {
            api: api()?,
            monitors: monitors.join(","),
            pool: Mutex::new(Pool::default()),
            removing: Default::default(),
            unintending: Default::default(),
            cap,
        })
    }

    /// `deadline`, or the driver's cap when that is shorter.
    fn capped(&self, deadline: Duration) -> Duration {
        self.cap.map_or(deadline, |cap| cap.min(deadline))
    }

    fn digest(creds: &Creds) -> Result<[u8; 32]> {
        use sha2::Digest;
        let mut h = sha2::Sha256::new();
        h.update(creds.user.as_bytes());
        h.update([0]);
        h.update(creds.key()?.as_bytes());
        Ok(h.finalize().into())
    }

    /// The kept connection for these credentials, made when there is none
    /// (one attempt at a time per user and key).
    async fn connection(&self, creds: &Creds) -> Result<Arc<Connection>> {
        let id = Self::digest(creds)?;
        let cell = {
            let mut pool = self.pool.locked();
            let now = Instant::now();
            pool.kept
                .retain(|k, kept| *k == id || now.duration_since(kept.used) < IDLE);
            if !pool.kept.contains_key(&id) && pool.kept.len() >= KEPT {
                if let Some(oldest) = pool
                    .kept
                    .iter()
                    .min_by_key(|(_, k)| k.used)
                    .map(|(k, _)| *k)
                {
                    pool.kept.remove(&oldest);
                }
            }
            let kept = pool.kept.entry(id).or_insert_with(|| Kept {
                conn: Default::default(),
                used: now,
            });
            kept.used = now;
            kept.conn.clone()
        };
        let conn = cell
            .get_or_try_init(|| async {
                let (api, monitors) = (self.api, self.monitors.clone());
                let (user, key) = (creds.user.clone(), creds.key()?.to_string());
                blocking(self.capped(DEADLINE), move || {
                    Connection::open(api, &monitors, &user, &key)
                })
                .await
                .map(Arc::new)
            })
            .await;
        if conn.is_err() {
            self.forget(id, None);
        }
        conn.cloned()
    }

    /// Drops the kept connection `id` (only `conn`, when given: not one a
    /// later call already made anew).
    fn forget(&self, id: [u8; 32], conn: Option<&Arc<Connection>>) {
        let mut pool = self.pool.locked();
        let same = pool
            .kept
            .get(&id)
            .is_some_and(|k| match (conn, k.conn.get()) {
                (Some(c), Some(kept)) => Arc::ptr_eq(c, kept),
                (None, _) => true,
                (Some(_), None) => false,
            });
        if same {
            pool.kept.remove(&id);
        }
    }

    /// Runs `f` on a kept connection, off the async workers; a connection
    /// that failed this way is given up.
    async fn call<T: Send + 'static, F: FnOnce(&Connection) -> Result<T> + Send + 'static>(
        &self,
        creds: &Creds,
        deadline: Duration,
        f: F,
    ) -> Result<T> {
        let asked = Instant::now();
        let conn = self.connection(creds).await?;
        let held = conn.clone();
        let connected = asked.elapsed();
        let r = blocking(self.capped(deadline), move || {
            held.fresh()?;
            f(&held)
        })
        .await;
        let took = asked.elapsed();
        if took > SLOW {
            // Which call: the closure's type names the method it is in.
            let call = std::any::type_name::<F>();
            let call = call.split("::{{closure}}").next().unwrap_or(call);
            let call = call.rsplit("::").next().unwrap_or(call);
            tracing::warn!(
                call,
                ms = took.as_millis() as u64,
                connecting_ms = connected.as_millis() as u64,
                "a cluster call was slow"
            );
        }
        if let Err(e) = &r {
            if e.kind == Kind::Unavailable || e.os_error.is_some_and(connection_lost) {
                tracing::info!(error = %e.message, "giving up the cluster connection");
                self.forget(Self::digest(creds)?, Some(&conn));
            }
        }
        r
    }

    /// Removes the record that `spec` is being made, in the background,
    /// on the kept connection: the image has its CSI name, so the record no
    /// longer says anything (a driver that dies first leaves it for the
    /// image's delete, or for a retry, to remove).
    async fn unintend_later(&self, creds: &Creds, spec: &Spec) {
        let Ok(conn) = self.connection(creds).await else {
            // The image is whole; its record goes with its delete.
            return;
        };
        self.unintending.locked().push(spec.clone());
        let (unintending, spec) = (self.unintending.clone(), spec.clone());
        tokio::task::spawn_blocking(move || {
            crate::killpoint::hit(super::super::KillPoint::Named);
            let removed = conn.ioctx(&spec).and_then(|ctx| ctx.unintend(&spec.image));
            match removed {
                Ok(()) => tracing::debug!(image = %spec.arg(), "record of making removed"),
                Err(e) => {
                    tracing::debug!(image = %spec.arg(), error = %e.message, "record of making left")
                }
            }
            unintending.locked().retain(|s| *s != spec);
        });
    }

    /// Runs `f` on an I/O context of `place`.
    async fn on<T: Send + 'static>(
        &self,
        creds: &Creds,
        place: &Spec,
        f: impl FnOnce(&Ctx<'_>) -> Result<T> + Send + 'static,
    ) -> Result<T> {
        let place = place.clone();
        self.call(creds, DEADLINE, move |c| {
            let r = f(&c.ioctx(&place)?);
            full_said(c, &place.pool, r)
        })
        .await
    }

    /// Runs `f` on the image `spec` names, opened for writing or not.
    async fn image<T: Send + 'static>(
        &self,
        creds: &Creds,
        spec: &Spec,
        write: bool,
        deadline: Duration,
        f: impl FnOnce(&Img<'_, '_>) -> Result<T> + Send + 'static,
    ) -> Result<T> {
        let spec = spec.clone();
        self.call(creds, deadline, move |c| {
            let ctx = c.ioctx(&spec)?;
            let r = ctx.open(&spec, write).and_then(|img| f(&img));
            full_said(c, &spec.pool, r)
        })
        .await
    }
}

/// `r`, or, when an operation of it timed out on a pool the cluster calls
/// full, that (RESOURCE_EXHAUSTED, with the pool's flags): a full pool's
/// writes are held by the client or dropped by the OSD (a write it should
/// have held), and librados's timeout is all the call sees. Asked on the
/// call's own connection, which reached the monitors, and only after a
/// timeout: no call pays for it otherwise, and a cluster that cannot be
/// reached is not asked again.
fn full_said<T>(c: &Connection, pool: &str, r: Result<T>) -> Result<T> {
    let e = match r {
        Err(e) if e.os_error == Some(libc::ETIMEDOUT) => e,
        r => return r,
    };
    let flags = c
        .mon_command(r#"{"prefix":"osd pool ls","detail":"detail","format":"json"}"#)
        .ok()
        .and_then(|out| super::super::cluster::pool_full(&out, pool));
    match flags {
        Some(flags) => Err(Error {
            os_error: e.os_error,
            ..Error::exhausted(format!(
                "pool {pool} is full ({flags}): the cluster takes no more data into it ({})",
                e.message
            ))
        }),
        None => Err(e),
    }
}

/// `f` on the blocking pool, answered within `deadline` (the thread itself
/// ends when librados's own timeouts end the call).
async fn blocking<T: Send + 'static>(
    deadline: Duration,
    f: impl FnOnce() -> Result<T> + Send + 'static,
) -> Result<T> {
    match tokio::time::timeout(deadline, tokio::task::spawn_blocking(f)).await {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => Err(Error::internal(format!("a cluster call failed: {e}"))),
        Err(_) => Err(Error::unavailable(format!(
            "the cluster did not answer within {} s",
            deadline.as_secs()
        ))),
    }
}

/// Metadata pairs owned, to move onto a blocking thread.
fn owned_pairs(set: &[(&str, &str)]) -> Vec<(String, String)> {
    set.iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn not_found_none<T>(r: Result<T>) -> Result<Option<T>> {
    match r {
        Ok(v) => Ok(Some(v)),
        Err(e) if e.os_error == Some(libc::ENOENT) => Ok(None),
        Err(e) => Err(e),
    }
}

#[async_trait::async_trait]
impl Cluster for LibCluster {
    fn client(&self) -> &'static str {
        "librbd"
    }

    async fn info(&self, creds: &Creds, spec: &Spec) -> Result<Option<Info>> {
        let s = spec.clone();
        self.on(creds, spec, move |ctx| {
            if !ctx.exists(&s)? {
                return Ok(None);
            }
            not_found_none(ctx.open(&s, false).and_then(|img| img.info()))
        })
        .await
    }

    async fn describe(
        &self,
        creds: &Creds,
        spec: &Spec,
    ) -> Result<Option<(Info, BTreeMap<String, String>)>> {
        let s = spec.clone();
        self.on(creds, spec, move |ctx| {
            if !ctx.exists(&s)? {
                return Ok(None);
            }
            not_found_none(
                ctx.open(&s, false)
                    .and_then(|img| Ok((img.info()?, img.meta()?))),
            )
        })
        .await
    }

    async fn inspect(&self, creds: &Creds, spec: &Spec) -> Result<Option<Inspected>> {
        let s = spec.clone();
        self.on(creds, spec, move |ctx| {
            if !ctx.exists(&s)? {
                return Ok(None);
            }
            not_found_none(ctx.open(&s, false).and_then(|img| {
                Ok(Inspected {
                    info: img.info()?,
                    meta: img.meta()?,
                    watchers: img.watchers()?,
                    group: img.leftover_group(ctx)?,
                    snaps: img.user_snaps()?,
                })
            }))
        })
        .await
    }

    async fn meta(&self, creds: &Creds, spec: &Spec) -> Result<BTreeMap<String, String>> {
        self.image(creds, spec, false, DEADLINE, |img| img.meta())
            .await
    }

    async fn set_meta(&self, creds: &Creds, spec: &Spec, key: &str, value: &str) -> Result<()> {
        let (k, v) = (key.to_string(), value.to_string());
        self.image(creds, spec, true, DEADLINE, move |img| img.set_meta(&k, &v))
            .await
    }

    async fn remove_meta(&self, creds: &Creds, spec: &Spec, key: &str) -> Result<()> {
        let k = key.to_string();
        match self
            .image(creds, spec, true, DEADLINE, move |img| img.remove_meta(&k))
            .await
        {
            Err(e) if e.os_error == Some(libc::ENOENT) => Ok(()),
            r => r,
        }
    }

    fn makes_in_place(&self) -> bool {
        true
    }

    async fn intend(&self, creds: &Creds, spec: &Spec, name: &str) -> Result<()> {
        let (image, name) = (spec.image.clone(), name.to_string());
        self.on(creds, spec, move |ctx| {
            ctx.making("metadata_set", &encode_metadata(&[(image, name)]), &mut [])
                .map(|_| ())
        })
        .await
    }

    async fn make_new(
        &self,
        creds: &Creds,
        spec: &Spec,
        name: &str,
        size: u64,
        layout: Layout<'_>,
        set: &[(&str, &str)],
    ) -> Result<bool> {
        let opts = Opts::new(self.api).layout(layout)?;
        let set = owned_pairs(set);
        let (s, intent) = (
            spec.clone(),
            encode_metadata(&[(spec.image.clone(), name.to_string())]),
        );
        let made = self
            .on(creds, spec, move |ctx| {
                if ctx.exists(&s)? {
                    return Ok(false);
                }
                ctx.making("metadata_set", &intent, &mut [])?;
                ctx.create(&s, size, &opts)?;
                crate::killpoint::hit(super::super::KillPoint::Made);
                // Nobody has it open yet: its metadata straight onto its
                // header.
                ctx.set_meta_unopened(&s, &set, false)?;
                Ok(true)
            })
            .await?;
        if made {
            // Whole now that it has its CSI name; the record of its making
            // goes in the background.
            self.unintend_later(creds, spec).await;
        }
        Ok(made)
    }

    async fn unintend(&self, creds: &Creds, spec: &Spec) -> Result<()> {
        let image = spec.image.clone();
        self.on(creds, spec, move |ctx| ctx.unintend(&image)).await
    }

    async fn intended(&self, creds: &Creds, place: &Spec) -> Result<BTreeMap<String, String>> {
        self.on(creds, place, |ctx| ctx.being_made()).await
    }

    async fn finish(
        &self,
        creds: &Creds,
        tmp: &Spec,
        to: &Spec,
        set: &[(&str, &str)],
        clear_others: bool,
    ) -> Result<()> {
        // The metadata on the header (no open), then the rename; made in
        // place, the record of its making goes instead.
        let set = owned_pairs(set);
        let in_place = tmp.image == to.image;
        let (from, dest) = (tmp.clone(), to.clone());
        self.call(creds, DEADLINE, move |c| {
            let ctx = c.ioctx(&from)?;
            // An image being made (a temporary one, or one whose making is
            // on record): nobody has it open. A copy's keys of its parent's
            // go first.
            ctx.set_meta_unopened(&from, &set, clear_others)?;
            if in_place {
                return Ok(());
            }
            ctx.rename(&from, &dest.image)
        })
        .await?;
        if in_place {
            // Done now that it has its CSI name (a named image is whole
            // whatever its record says); the record goes in the background.
            self.unintend_later(creds, to).await;
        }
        Ok(())
    }

    async fn watchers(&self, creds: &Creds, spec: &Spec) -> Result<Vec<String>> {
        self.image(creds, spec, false, DEADLINE, |img| img.watchers())
            .await
    }

    async fn blocklist(&self, creds: &Creds, addr: &str, expire: u64) -> Result<()> {
        super::super::cluster::check_client_addr(addr)?;
        let cmd = serde_json::json!({
            "prefix": "osd blocklist",
            "blocklistop": "add",
            "addr": addr,
            "expire": expire as f64,
        })
        .to_string();
        self.call(creds, DEADLINE, move |c| c.mon_command(&cmd))
            .await
            .map(|_| ())
    }

    async fn list(&self, creds: &Creds, place: &Spec) -> Result<Vec<String>> {
        self.on(creds, place, |ctx| {
            Ok(ctx.list()?.into_iter().map(|(_, name)| name).collect())
        })
        .await
    }

    async fn sizes(&self, creds: &Creds, specs: &[Spec]) -> Result<Vec<Option<u64>>> {
        let specs = specs.to_vec();
        self.call(creds, DEADLINE, move |c| {
            let mut out = Vec::with_capacity(specs.len());
            for spec in &specs {
                let ctx = c.ioctx(spec)?;
                out.push(not_found_none(
                    ctx.open(spec, false).and_then(|i| i.size()),
                )?);
            }
            Ok(out)
        })
        .await
    }

    async fn namespaces(&self, creds: &Creds, pool: &str) -> Result<Vec<String>> {
        let place = Spec {
            pool: pool.into(),
            namespace: String::new(),
            image: String::new(),
        };
        self.on(creds, &place, |ctx| ctx.namespaces()).await
    }

    async fn trash(&self, creds: &Creds, place: &Spec) -> Result<Vec<TrashEntry>> {
        self.on(creds, place, |ctx| ctx.trash()).await
    }

    async fn trash_move(&self, creds: &Creds, spec: &Spec) -> Result<()> {
        let s = spec.clone();
        self.on(creds, spec, move |ctx| ctx.trash_move(&s)).await
    }

    async fn settle(&self, spec: &Spec) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline
            && (self
                .removing
                .locked()
                .values()
                .any(|p| p.as_ref() == Some(spec))
                || self.unintending.locked().contains(spec))
        {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    async fn discard(&self, creds: &Creds, spec: &Spec, parent: Option<&Spec>) -> Result<()> {
        let s = spec.clone();
        // Out of the directory now: its id kept, then moved to the trash.
        let id = self
            .on(creds, spec, move |ctx| {
                let id = ctx.image_id(&s)?;
                ctx.trash_move(&s)?;
                Ok(id)
            })
            .await;
        let id = match id {
            Ok(id) => id,
            Err(e) if e.os_error == Some(libc::ENOENT) => return Ok(()),
            Err(e) => return Err(e),
        };
        crate::killpoint::hit(super::super::KillPoint::Trashed);
        // Its data (every object of it) in the background, on the same
        // kept connection.
        let conn = self.connection(creds).await?;
        self.removing.locked().insert(id.clone(), parent.cloned());
        let (removing, place) = (self.removing.clone(), spec.clone());
        tokio::task::spawn_blocking(move || {
            let removed = conn.ioctx(&place).and_then(|ctx| ctx.trash_remove(&id));
            if let Err(e) = removed {
                // Clones need it (or the cluster failed): a later purge.
                tracing::debug!(image = %place.arg(), error = %e.message, "left in the trash");
            }
            let idle = {
                let mut removing = removing.locked();
                removing.remove(&id);
                removing.is_empty()
            };
            // A removal opens the image (librbd copies its configuration):
            // megabytes freed into this thread's arena, handed back once
            // no other removal runs.
            if idle {
                crate::host::return_free_memory();
            }
        });
        Ok(())
    }

    async fn trash_remove(&self, creds: &Creds, place: &Spec, id: &str) -> Result<()> {
        if self.removing.locked().contains_key(id) {
            return Err(Error::unavailable(format!(
                "{id} is being removed from the trash"
            )));
        }
        let id = id.to_string();
        self.on(creds, place, move |ctx| ctx.trash_remove(&id))
            .await
    }

    async fn create(
        &self,
        creds: &Creds,
        spec: &Spec,
        size: u64,
        layout: Layout<'_>,
    ) -> Result<()> {
        let s = spec.clone();
        let opts = Opts::new(self.api).layout(layout)?;
        self.on(creds, spec, move |ctx| ctx.create(&s, size, &opts))
            .await
    }

    async fn clone_image(
        &self,
        creds: &Creds,
        parent: &Spec,
        snap: &str,
        to: &Spec,
        layout: Option<Layout<'_>>,
    ) -> Result<()> {
        let mut opts = Opts::new(self.api);
        if let Some(l) = layout {
            opts = opts.layout(l)?;
        }
        let opts = opts.clone_format_2()?;
        let (p, t, snap) = (parent.clone(), to.clone(), snap.to_string());
        self.call(creds, DEADLINE, move |c| {
            let (pctx, cctx) = (c.ioctx(&p)?, c.ioctx(&t)?);
            pctx.clone_to(&p, &snap, &cctx, &t, &opts)
        })
        .await
    }

    async fn resize(&self, creds: &Creds, spec: &Spec, size: u64) -> Result<()> {
        self.image(creds, spec, true, DEADLINE, move |img| img.resize(size))
            .await
    }

    async fn flatten(&self, creds: &Creds, spec: &Spec) -> Result<()> {
        self.image(creds, spec, true, LONG, |img| img.flatten())
            .await
    }

    async fn remove(&self, creds: &Creds, spec: &Spec) -> Result<()> {
        let s = spec.clone();
        self.on(creds, spec, move |ctx| ctx.remove(&s)).await
    }

    async fn rename(&self, creds: &Creds, from: &Spec, to: &Spec) -> Result<()> {
        let (f, t) = (from.clone(), to.image.clone());
        self.on(creds, from, move |ctx| ctx.rename(&f, &t)).await
    }

    async fn snap_create(&self, creds: &Creds, spec: &Spec, snap: &str) -> Result<()> {
        let snap = snap.to_string();
        self.image(creds, spec, true, DEADLINE, move |img| {
            img.snap_create(&snap)
        })
        .await
    }

    async fn snap_remove(&self, creds: &Creds, spec: &Spec, snap: &str) -> Result<()> {
        let snap = snap.to_string();
        self.image(creds, spec, true, DEADLINE, move |img| {
            img.snap_remove(&snap)
        })
        .await
    }

    async fn snaps(&self, creds: &Creds, spec: &Spec) -> Result<Vec<String>> {
        self.image(creds, spec, false, DEADLINE, |img| img.user_snaps())
            .await
    }

    async fn diff(
        &self,
        creds: &Creds,
        spec: &Spec,
        at: Option<&str>,
        from: Option<&str>,
        start: u64,
        max: usize,
    ) -> Result<DiffPage> {
        let (spec, at, from) = (
            spec.clone(),
            at.map(str::to_string),
            from.map(str::to_string),
        );
        // Exact extents read every object's snapshot list: long on big
        // images.
        self.call(creds, LONG, move |c| {
            let ctx = c.ioctx(&spec)?;
            let img = match &at {
                Some(snap) => ctx.open_at(&spec, snap)?,
                None => ctx.open(&spec, false)?,
            };
            img.diff(from.as_deref(), start, max)
        })
        .await
    }

    async fn snap_together(&self, creds: &Creds, members: &[(Spec, String)]) -> Result<()> {
        let members = members.to_vec();
        self.call(creds, DEADLINE, move |c| {
            let ctxs = members
                .iter()
                .map(|(spec, _)| c.ioctx(spec))
                .collect::<Result<Vec<_>>>()?;
            let imgs = ctxs
                .iter()
                .zip(&members)
                .map(|(ctx, (spec, _))| ctx.open(spec, true))
                .collect::<Result<Vec<_>>>()?;
            let mut locked = Vec::new();
            let mut cut = Vec::new();
            let mut outcome = Ok(());
            for img in &imgs {
                let taken = img.lock();
                if taken
                    .as_ref()
                    .is_err_and(|e| e.os_error == Some(libc::EINVAL))
                {
                    outcome = Err(Error::precondition(format!(
                        "{} has no exclusive-lock feature: nothing can hold its writes for \
                         a group snapshot (imageFeatures: layering,exclusive-lock)",
                        img.spec().arg()
                    )));
                    break;
                }
                if let Err(e) = taken {
                    // Another client holds it (a driver that died holding
                    // it does until the cluster times its watch out): the
                    // retry takes it.
                    outcome = Err(Error {
                        kind: crate::error::Kind::Unavailable,
                        ..e
                    });
                    break;
                }
                locked.push(img);
            }
            if outcome.is_ok() {
                for (img, (_, snap)) in imgs.iter().zip(&members) {
                    if let Err(e) = img.snap_create(snap) {
                        outcome = Err(e);
                        break;
                    }
                    crate::killpoint::hit(super::super::KillPoint::GroupSnapped);
                    cut.push((img, snap));
                }
            }
            if outcome.is_err() {
                for (img, snap) in &cut {
                    let _ = img.snap_remove(snap);
                }
            }
            for img in locked {
                img.unlock();
            }
            outcome
        })
        .await
    }

    async fn leftover_group(&self, creds: &Creds, spec: &Spec) -> Result<Option<String>> {
        let s = spec.clone();
        self.on(creds, spec, move |ctx| {
            ctx.open(&s, false)?.leftover_group(ctx)
        })
        .await
    }

    async fn group_remove(&self, creds: &Creds, place: &Spec, name: &str) -> Result<()> {
        let (p, name) = (place.clone(), name.to_string());
        self.on(creds, place, move |ctx| {
            ctx.group_remove(&name, || format!("remove rbd group {name} of {}", p.arg()))
        })
        .await
    }

    async fn copy_together(
        &self,
        creds: &Creds,
        group: &Spec,
        members: &[(Spec, Spec)],
    ) -> Result<()> {
        let (group, members) = (group.clone(), members.to_vec());
        // Copies take as long as the members' data does.
        self.call(creds, LONG, move |c| {
            let gctx = c.ioctx(&group)?;
            let gname = &group.image;
            let what = || format!("rbd group {}", group.arg());
            match gctx.group_create(gname, what) {
                // Ours (the name is this group snapshot's), left by an
                // attempt that did not finish: its cut is stale.
                Err(e) if e.os_error == Some(libc::EEXIST) => {
                    gctx.group_remove(gname, what)?;
                    gctx.group_create(gname, what)?;
                }
                r => r?,
            }
            let mut made = Vec::new();
            let outcome = (|| -> Result<()> {
                for (from, _) in &members {
                    let ctx = c.ioctx(from)?;
                    let img = ctx.open(from, false)?;
                    if !img.has_exclusive_lock()? {
                        return Err(Error::precondition(format!(
                            "{} has no exclusive-lock feature: nothing can hold its writes \
                             for a group snapshot (imageFeatures: layering,exclusive-lock)",
                            from.arg()
                        )));
                    }
                    gctx.group_add(gname, &ctx, from, || {
                        format!("add {} to {}", from.arg(), what())
                    })?;
                }
                // Each member's exclusive lock is taken from its writers
                // (kernel clients wait for it to come back) while all are
                // snapshotted; quiesce requests go to clients that take
                // them.
                gctx.group_snap_create(gname, "cut", || format!("snapshot {}", what()))?;
                crate::killpoint::hit(super::super::KillPoint::GroupCut);
                for (from, to) in &members {
                    let ctx = c.ioctx(from)?;
                    let img = ctx.open(from, false)?;
                    img.at_snap_id(img.group_snap_id(&group.image)?)?;
                    let tctx = c.ioctx(to)?;
                    img.copy_to(&tctx, to, &Opts::new(c.api()))?;
                    made.push(to.clone());
                }
                Ok(())
            })();
            if outcome.is_err() {
                for to in &made {
                    if let Ok(ctx) = c.ioctx(to) {
                        let _ = ctx.remove(to);
                    }
                }
            }
            // The group, its snapshot and the members' place in it go.
            let removed = gctx.group_remove(gname, || format!("remove {}", what()));
            outcome.and(removed)
        })
        .await
    }

    async fn pool_available(&self, creds: &Creds, pool: &str) -> Result<u64> {
        let out = self
            .call(creds, DEADLINE, |c| {
                c.mon_command(r#"{"prefix":"df","detail":"detail","format":"json"}"#)
            })
            .await?;
        super::super::cluster::pool_available(&out, pool)
    }
}
