//! The `iscsi` backend's volumes on the node: attached for a stage, let go
//! at unstage, and the block device's growth and copies.

use super::*;
use crate::plugin::Finding;

#[async_trait::async_trait]
impl Stager for IscsiBackend {
    // ---- node ----

    async fn node_attach(&self, id: &VolumeId, ctx: &AttachContext) -> Result<Attachment> {
        self.own_volume(id)?;
        let iqn = ctx.publish_context.get(CTX_IQN).ok_or_else(|| {
            Error::invalid("publish context has no iqn: was the volume ControllerPublished?")
        })?;
        if *iqn != self.iqn(id) {
            return Err(Error::invalid(format!(
                "publish context names target {iqn:?}, not this volume's"
            )));
        }
        let portals: Vec<&str> = ctx
            .publish_context
            .get(CTX_PORTALS)
            .map(|p| p.split(',').filter(|p| !p.is_empty()).collect())
            .unwrap_or_default();
        if portals.is_empty() || portals.iter().any(|p| !is_portal(p)) {
            return Err(Error::invalid(
                "publish context: portals must be host:port, comma-separated",
            ));
        }
        let lun: u32 = ctx
            .publish_context
            .get(CTX_LUN)
            .and_then(|l| l.parse().ok())
            .ok_or_else(|| Error::invalid("publish context: lun must be a number"))?;
        let (incoming, outgoing) = chap_from(&ctx.secrets)?;
        let path = self
            .initiator()
            .attach(iqn, &portals, lun, incoming.as_ref(), outgoing.as_ref())
            .await?;
        Ok(Attachment::Device { path })
    }

    async fn node_detach(&self, id: &VolumeId, _attachment: Option<&Attachment>) -> Result<()> {
        self.own_volume(id)?;
        self.initiator().detach(&self.iqn(id)).await?;
        remove_file(&self.renewed_path(id))
    }

    async fn node_release_io(&self, id: &VolumeId, _attachment: &Attachment) -> Result<()> {
        self.own_volume(id)?;
        self.initiator().release_lost(&self.iqn(id)).await
    }

    async fn node_health(&self, id: &VolumeId, attachment: &Attachment) -> Result<Vec<Finding>> {
        self.own_volume(id)?;
        let Attachment::Device { path } = attachment else {
            return Err(Error::internal("iscsi volumes are attached as devices"));
        };
        Ok(self
            .initiator()
            .condition(&self.iqn(id), path)
            .await?
            .into_iter()
            .collect())
    }
}

#[async_trait::async_trait]
impl DeviceMounter for IscsiBackend {
    async fn node_copy_pending(&self, id: &VolumeId, ctx: &AttachContext) -> Result<bool> {
        self.own_volume(id)?;
        let Some(token) = ctx.publish_context.get(CTX_FS_COPY) else {
            return Ok(false);
        };
        if !is_token(token) {
            return Err(Error::invalid(format!(
                "publish context: {CTX_FS_COPY} is not a token ferrovol makes"
            )));
        }
        match std::fs::read_to_string(self.renewed_path(id)) {
            Ok(done) => Ok(done.trim() != token),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(true),
            Err(e) => Err(Error::io("read the copy's renewal mark", e)),
        }
    }

    async fn node_copy_done(&self, id: &VolumeId, ctx: &AttachContext) -> Result<()> {
        self.own_volume(id)?;
        let Some(token) = ctx.publish_context.get(CTX_FS_COPY).filter(|t| is_token(t)) else {
            return Ok(());
        };
        write_file(&self.renewed_path(id), token.as_bytes())
    }

    async fn node_refresh_size(&self, id: &VolumeId, _attachment: &Attachment) -> Result<u64> {
        self.own_volume(id)?;
        self.initiator().rescan(&self.iqn(id)).await
    }
}

impl IscsiBackend {
    /// Node side: the token under which this node renewed a copy's UUID.
    pub(super) fn renewed_path(&self, id: &VolumeId) -> PathBuf {
        self.exports
            .records()
            .dir()
            .join("renewed")
            .join(id.locator())
    }

    pub(super) fn initiator(&self) -> initiator::Initiator<'_> {
        initiator::Initiator {
            runner: self.runner.as_ref(),
            multipath: self.settings.multipath,
            node_db: &self.settings.node_db,
            sysfs: &self.sysfs,
            dev: &self.dev,
            timeout: Duration::from_secs(self.settings.login_timeout),
            replacement_timeout: self.settings.replacement_timeout,
        }
    }
}
