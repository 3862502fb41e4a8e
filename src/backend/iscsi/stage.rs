//! The `iscsi` backend's volumes on the node: attached for a stage, let go
//! at unstage, and the block device's growth and copies.

use super::*;
use crate::plugin::Finding;

#[async_trait::async_trait]
impl Stager for IscsiBackend {
    // ---- node ----

    async fn node_attach(&self, id: &VolumeId, ctx: &AttachContext) -> Result<Attachment> {
        self.own_volume(id)?;
        let (incoming, outgoing) = chap_from(&ctx.secrets)?;
        self.exports
            .node_attach(id, ctx, incoming.as_ref(), outgoing.as_ref())
            .await
    }

    async fn node_detach(&self, id: &VolumeId, _attachment: Option<&Attachment>) -> Result<()> {
        self.exports.node_detach(id).await
    }

    async fn node_release_io(&self, id: &VolumeId, _attachment: &Attachment) -> Result<()> {
        self.exports.node_release_io(id).await
    }

    async fn node_health(&self, id: &VolumeId, attachment: &Attachment) -> Result<Vec<Finding>> {
        self.exports.node_health(id, attachment).await
    }
}

#[async_trait::async_trait]
impl DeviceMounter for IscsiBackend {
    async fn node_copy_pending(&self, id: &VolumeId, ctx: &AttachContext) -> Result<bool> {
        self.exports.node_copy_pending(id, ctx).await
    }

    async fn node_copy_done(&self, id: &VolumeId, ctx: &AttachContext) -> Result<()> {
        self.exports.node_copy_done(id, ctx).await
    }

    async fn node_refresh_size(&self, id: &VolumeId, _attachment: &Attachment) -> Result<u64> {
        self.exports.node_refresh_size(id).await
    }
}

impl IscsiBackend {
    /// open-iscsi on this node (the tests look at its sessions).
    #[cfg(test)]
    pub(super) fn initiator(&self) -> &OpenIscsi {
        &self.initiator
    }
}
