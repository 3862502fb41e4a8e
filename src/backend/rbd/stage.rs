//! The `rbd` backend's volumes on the node: attached for a stage, let go at
//! unstage, and the block device's growth and copies.

use super::*;
use crate::host::devices::{Census, DeviceClass, MINOR_BITS};
use crate::plugin::Finding;

/// How long an unstage waits for a mapped device that is busy (EBUSY) to
/// be let go before it fails UNAVAILABLE.
const UNMAP_BUSY_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

#[async_trait::async_trait]
impl Stager for RbdBackend {
    // ---- node ----

    async fn node_attach(&self, id: &VolumeId, ctx: &AttachContext) -> Result<Attachment> {
        let spec = self.volume_spec(id)?;
        let creds = self.creds(&ctx.secrets)?;
        let node = node_name(&ctx.node_id);
        // Fenced: an image published to other nodes only is not mapped here.
        let meta = self.rbd().meta(&creds, &spec).await?;
        let holders: Vec<&str> = meta
            .keys()
            .filter_map(|k| k.strip_prefix(META_NODE))
            .collect();
        if !holders.is_empty() && !holders.contains(&node) {
            return Err(Error::precondition(format!(
                "volume {id} is published to {}, not to this node ({node})",
                holders.join(", ")
            )));
        }
        let path = match self.find_mapping(&spec).await? {
            Some(m) => m,
            None => self.map(&creds, &spec, ctx).await?,
        };
        let client = self
            .record_client(&creds, &spec, node, &path, &meta)
            .await?;
        self.staged.locked().insert(
            id.to_string(),
            Staged {
                secrets: ctx.secrets.clone(),
                node: node.to_string(),
                client,
            },
        );
        Ok(Attachment::Device { path })
    }

    async fn node_detach(&self, id: &VolumeId, _attachment: Option<&Attachment>) -> Result<()> {
        let spec = self.volume_spec(id)?;
        // A device just unmounted may be held a moment longer: udev probes
        // it when its last writer closes it (and longer when its I/O
        // fails, on a fenced client). Busy (EBUSY) is asked again until
        // UNMAP_BUSY_WAIT has passed; then the unstage fails UNAVAILABLE,
        // and the CO asks again.
        let busy_until = std::time::Instant::now() + UNMAP_BUSY_WAIT;
        while let Some(dev) = self.find_mapping(&spec).await? {
            match self.cli.unmap(&dev).await {
                Ok(()) => {}
                Err(e) if e.kind == Kind::NotFound => {}
                Err(e) if e.os_error == Some(libc::EBUSY) => {
                    if std::time::Instant::now() >= busy_until {
                        return Err(Error::unavailable(format!(
                            "{} (volume {id}) is still open {} s after its unmount: {}",
                            dev.display(),
                            UNMAP_BUSY_WAIT.as_secs(),
                            e.message
                        )));
                    }
                    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
                }
                Err(e) => {
                    // Gone meanwhile is what was wanted.
                    if self.find_mapping(&spec).await?.as_ref() == Some(&dev) {
                        return Err(e);
                    }
                }
            }
        }
        // Unmapped: this node's client record goes, so the detach has no
        // one to fence. Without the stage's secrets (the driver restarted
        // since) it stays, and the detach fences a client that is gone.
        let staged = self.staged.locked().get(&id.to_string()).cloned();
        if let Some(Staged { secrets, node, .. }) = staged {
            let creds = self.creds(&secrets)?;
            self.rbd()
                .remove_meta(&creds, &spec, &client_key(&node))
                .await?;
            self.staged.locked().remove(&id.to_string());
        }
        Ok(())
    }

    async fn node_health(&self, id: &VolumeId, attachment: &Attachment) -> Result<Vec<Finding>> {
        let spec = self.volume_spec(id)?;
        let Attachment::Device { path } = attachment else {
            return Err(Error::internal("rbd volumes are attached as devices"));
        };
        if self.find_mapping(&spec).await?.as_ref() != Some(path) {
            return Ok(vec![Finding::inaccessible(
                reasons::MappingGone,
                format!("{} is no longer mapped to {}", path.display(), spec.arg()),
            )]);
        }
        // The client this node recorded at stage is no longer in the
        // image: a detach fenced it (blocklisted; its I/O fails).
        let staged = self.staged.locked().get(&id.to_string()).cloned();
        let mut recorded = None;
        if let Some(Staged {
            secrets,
            node,
            client: Some(addr),
        }) = staged
        {
            let meta = self.rbd().meta(&self.creds(&secrets)?, &spec).await?;
            if meta.get(&client_key(&node)) != Some(&addr) {
                return Ok(vec![Finding::inaccessible(
                    reasons::ClientFenced,
                    format!(
                        "the volume was detached from this node while staged here: its client {addr} is fenced"
                    ),
                )]);
            }
            recorded = Some(meta);
        }
        // With credentials of its own, the node also asks the cluster
        // (bounded by the command timeout): whether it answers, and, when
        // this node's own client is recorded, which other clients have
        // the image open.
        if let Ok(creds) = self.creds(&Secrets::default()) {
            let foreign = match &recorded {
                Some(meta) => self.foreign_watchers(&creds, &spec, meta, 0).await,
                None => self.rbd().watchers(&creds, &spec).await.map(|_| Vec::new()),
            };
            match foreign {
                Err(e) => {
                    return Ok(vec![Finding::inaccessible(
                        reasons::ClusterNotAnswering,
                        format!("the cluster does not answer: {}", e.message),
                    )])
                }
                Ok(foreign) => {
                    return Ok(super::health::watchers_finding(&spec, &foreign)
                        .into_iter()
                        .collect())
                }
            }
        }
        Ok(Vec::new())
    }
}

/// rbd's minors per device with `single_major` (`RBD_SINGLE_MAJOR_PART_SHIFT`).
const PART_SHIFT: u32 = 4;

/// Mapped rbd images, for NodeGetInfo's count. With `single_major` (the
/// default, and what a module not loaded yet will get) rbd numbers devices
/// within its one major: 65,536. Without it each device takes a dynamic
/// block major of its own: those free now, and those its mapped devices
/// hold.
pub const DEVICES: DeviceClass = DeviceClass {
    name: "rbd",
    census: |t| {
        let attached: Vec<String> = t
            .entries("bus/rbd/devices", |_, _| true)
            .into_iter()
            .map(|id| format!("rbd{id}"))
            .collect();
        let ceiling = match t.param("rbd", "single_major").as_deref() {
            Some("N" | "n" | "0") => t.free_dynamic_majors() + attached.len() as u64,
            _ => 1u64 << (MINOR_BITS - PART_SHIFT),
        };
        Census { ceiling, attached }
    },
};

#[async_trait::async_trait]
impl DeviceMounter for RbdBackend {
    fn node_device(&self) -> Option<DeviceClass> {
        Some(DEVICES)
    }

    async fn node_copy_pending(&self, id: &VolumeId, ctx: &AttachContext) -> Result<bool> {
        // Mapped read-only: the UUID cannot change here; a writer's stage
        // renews it.
        if ctx.readonly {
            return Ok(false);
        }
        let spec = self.volume_spec(id)?;
        let creds = self.creds(&ctx.secrets)?;
        Ok(self
            .rbd()
            .meta(&creds, &spec)
            .await?
            .contains_key(META_FS_COPY))
    }

    async fn node_copy_done(&self, id: &VolumeId, ctx: &AttachContext) -> Result<()> {
        let spec = self.volume_spec(id)?;
        let creds = self.creds(&ctx.secrets)?;
        self.rbd().remove_meta(&creds, &spec, META_FS_COPY).await
    }

    async fn node_refresh_size(&self, id: &VolumeId, attachment: &Attachment) -> Result<u64> {
        self.volume_spec(id)?;
        let Attachment::Device { path } = attachment else {
            return Err(Error::internal("rbd volumes are block devices"));
        };
        // krbd follows the image's header: the new size is there once the
        // resize is done.
        let dev = path
            .file_name()
            .map(|d| d.to_string_lossy().into_owned())
            .ok_or_else(|| Error::internal("no device name"))?;
        let sectors = std::fs::read_to_string(self.sysfs.join("block").join(&dev).join("size"))
            .map_err(|e| Error::io(format!("size of {dev}"), e))?;
        Ok(sectors.trim().parse::<u64>().unwrap_or(0) * 512)
    }
}

impl RbdBackend {
    /// Maps the image on this node, with its own client (`noshare`).
    pub(super) async fn map(
        &self,
        creds: &Creds,
        spec: &Spec,
        ctx: &AttachContext,
    ) -> Result<PathBuf> {
        let mut options: Vec<&str> = Vec::new();
        if !self.settings.map_options.is_empty() {
            options.push(&self.settings.map_options);
        }
        if let Some(o) = ctx.volume_context.get(CTX_MAP_OPTIONS) {
            check_map_options(o)?;
            options.push(o);
        }
        if ctx.readonly {
            options.push("ro");
        }
        if !options.iter().any(|o| o.split(',').any(|x| x == "noshare")) {
            options.push("noshare");
        }
        self.cli.map(creds, spec, &options.join(",")).await
    }

    /// Records in the image which client maps it on `node` (the mapping at
    /// `device`), unless it says so already; returns the address. A kernel
    /// that does not show its client's address leaves nothing to fence
    /// (logged).
    pub(super) async fn record_client(
        &self,
        creds: &Creds,
        spec: &Spec,
        node: &str,
        device: &std::path::Path,
        meta: &BTreeMap<String, String>,
    ) -> Result<Option<String>> {
        let dev_id = device
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.strip_prefix("rbd"))
            .filter(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
            .ok_or_else(|| Error::internal(format!("{} is not an rbd device", device.display())))?;
        let attr = self
            .sysfs
            .join("bus/rbd/devices")
            .join(dev_id)
            .join("client_addr");
        let addr = match std::fs::read_to_string(&attr) {
            Ok(a) => a.trim().to_string(),
            Err(e) => {
                tracing::warn!(device = %device.display(), error = %e,
                    "the kernel shows no client address for the mapping: a detach cannot fence it");
                return Ok(None);
            }
        };
        cluster::check_client_addr(&addr)?;
        let key = client_key(node);
        if meta.get(&key) != Some(&addr) {
            self.rbd().set_meta(creds, spec, &key, &addr).await?;
        }
        Ok(Some(addr))
    }

    /// Controller side, at detach: the client `node` recorded is denied
    /// the cluster before its mark goes, so none of its writes land once
    /// the volume is someone else's. A node that unstaged removed its
    /// record; one that did not (lost, frozen, its teardown never came)
    /// is fenced.
    pub(super) async fn fence(
        &self,
        creds: &Creds,
        spec: &Spec,
        id: &VolumeId,
        node: &str,
        addr: &str,
    ) -> Result<()> {
        self.rbd()
            .blocklist(creds, addr, self.settings.fence_expiry)
            .await?;
        tracing::warn!(volume = %id, %node, client = %addr, expire_secs = self.settings.fence_expiry,
            "fenced: the node still had the image mapped at detach; its client is blocklisted");
        self.rbd().remove_meta(creds, spec, &client_key(node)).await
    }

    /// Makes `tmp` a copy of a new volume's source (a volume's full copy,
    /// or a clone of a snapshot's `base`); the source's size.
    pub(super) async fn copy_source(
        &self,
        creds: &Creds,
        source: &ContentSource,
        tmp: &Spec,
        p: &Params,
    ) -> Result<u64> {
        let gone = |what: &str, id: &dyn std::fmt::Display| {
            Error::not_found(format!("source {what} {id} does not exist"))
        };
        match source {
            ContentSource::Volume(v) => {
                let from = self.volume_spec(v).map_err(|_| gone("volume", v))?;
                let info = self
                    .rbd()
                    .info(creds, &from)
                    .await?
                    .ok_or_else(|| gone("volume", v))?;
                self.copy_of(creds, &from, tmp, Some(p), false).await?;
                Ok(info.size)
            }
            ContentSource::Snapshot(s) => {
                let from = self.snapshot_spec(s).map_err(|_| gone("snapshot", s))?;
                let (info, meta) = self
                    .rbd()
                    .describe(creds, &from)
                    .await?
                    .filter(|(_, meta)| meta.contains_key(META_NAME))
                    .ok_or_else(|| gone("snapshot", s))?;
                // While its source volume lives, the cut the snapshot image
                // was cloned from holds the same data (a snapshot image is
                // never written): a clone of it costs no cluster snapshot
                // (each one is a monitor commit, about a second) and its
                // chain of parents is one shorter. A cut that is gone (its
                // volume deleted, the snapshot being deleted, a snapshot a
                // group copied whole) is NOT_FOUND, and `base` serves.
                if let Some(src) = meta
                    .get(META_SOURCE)
                    .and_then(|v| VolumeId::parse(v).ok())
                    .and_then(|v| self.volume_spec(&v).ok())
                {
                    let cut = Self::snapshot_cut(&from);
                    match self.clone_from(creds, &src, &cut, tmp, Some(p)).await {
                        Ok(()) => return Ok(info.size),
                        Err(e) if e.kind == Kind::NotFound => {}
                        Err(e) => return Err(e),
                    }
                }
                // Else the snapshot image's `base`, taken at the first
                // restore that needs it.
                match self.rbd().snap_create(creds, &from, BASE).await {
                    Ok(()) => {}
                    Err(e) if e.kind == Kind::AlreadyExists => {}
                    Err(e) => return Err(e),
                }
                self.clone_from(creds, &from, BASE, tmp, Some(p)).await?;
                Ok(info.size)
            }
        }
    }

    /// The device this node has the image mapped at, if any, read from
    /// the kernel's table of its rbd devices (sysfs), as `rbd device list`
    /// reads it: without starting a Ceph client, which takes seconds a call
    /// on a busy node (every stage, unstage, health and stats call asks).
    pub(super) async fn find_mapping(&self, spec: &Spec) -> Result<Option<PathBuf>> {
        let dir = self.sysfs.join("bus/rbd/devices");
        let entries = match std::fs::read_dir(&dir) {
            Ok(entries) => entries,
            // No rbd module loaded: nothing is mapped.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(Error::io(format!("list {}", dir.display()), e)),
        };
        for entry in entries {
            let entry = entry.map_err(|e| Error::io(format!("list {}", dir.display()), e))?;
            let id = entry.file_name().to_string_lossy().into_owned();
            if id.is_empty() || !id.bytes().all(|b| b.is_ascii_digit()) {
                continue;
            }
            // An attribute the kernel lacks (pool_ns before 4.19) is
            // empty; a device unmapped meanwhile is not this one.
            let attr = |name: &str| {
                std::fs::read_to_string(entry.path().join(name))
                    .map(|v| v.trim_end_matches('\n').to_string())
            };
            let (Ok(pool), Ok(name)) = (attr("pool"), attr("name")) else {
                continue;
            };
            let namespace = attr("pool_ns").unwrap_or_default();
            let snap = attr("current_snap").unwrap_or_default();
            if pool == spec.pool
                && namespace == spec.namespace
                && name == spec.image
                && (snap.is_empty() || snap == "-")
            {
                return Ok(Some(PathBuf::from(format!("/dev/rbd{id}"))));
            }
        }
        Ok(None)
    }
}
