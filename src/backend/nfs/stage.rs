//! The `nfs` backend's volumes on the node: attached for a stage, let go at
//! unstage.

use super::*;

#[async_trait::async_trait]
impl Stager for NfsBackend {
    async fn node_attach(&self, id: &VolumeId, _ctx: &AttachContext) -> Result<Attachment> {
        let loc = self.locate(id)?;
        Ok(Attachment::Remote {
            source: format!("{}:{}", loc.server, remote_path(&loc.share, &loc.subdir)),
            fs_type: "nfs".into(),
            options: self.options_for(&loc.server, &loc.share),
        })
    }

    async fn node_detach(&self, _id: &VolumeId, _attachment: Option<&Attachment>) -> Result<()> {
        // The staging mount is all there is, and the node unmounts it.
        Ok(())
    }
}
