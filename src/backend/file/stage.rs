//! The `file` backend's volumes on the node: attached for a stage, let go
//! at unstage, and the block device's growth and copies.

use super::*;
use crate::plugin::Finding;

#[async_trait::async_trait]
impl Stager for FileBackend {
    async fn node_attach(&self, id: &VolumeId, _ctx: &AttachContext) -> Result<Attachment> {
        self.own(id.backend())?;
        let image = self.image(id.locator());
        if self.load_volume(id.locator())?.is_none() {
            return Err(Error::no_volume(id));
        }
        let path = self.loops.attach(&image).await?;
        Ok(Attachment::Device { path })
    }

    async fn node_detach(&self, id: &VolumeId, attachment: Option<&Attachment>) -> Result<()> {
        self.own(id.backend())?;
        let image = self.image(id.locator());
        match attachment {
            Some(Attachment::Device { path }) => self.loops.detach(path, &image).await,
            None => match self.loops.find(&image) {
                Some(dev) => self.loops.detach(&dev, &image).await,
                None => Ok(()),
            },
            Some(Attachment::Remote { .. }) => {
                Err(Error::internal("file volumes are never remote"))
            }
        }
    }

    async fn node_health(&self, id: &VolumeId, attachment: &Attachment) -> Result<Vec<Finding>> {
        let image = self.image(id.locator());
        let Attachment::Device { path } = attachment else {
            return Err(Error::internal("file volumes are attached as loop devices"));
        };
        let backs = self.loops.backs(path, &image);
        let mut found = Vec::new();
        match (image.exists(), backs) {
            (true, true) => {}
            // Deleted under its loop device: the device still holds the
            // data, until the volume is unstaged.
            (false, true) => found.push(Finding::data_loss(
                reasons::ImageMissing,
                format!(
                    "image {} was deleted; {} still holds its data until the volume is \
                     unstaged, then it is gone: copy it off first",
                    image.display(),
                    path.display()
                ),
            )),
            (exists, false) => {
                if !exists {
                    found.push(Finding::inaccessible(
                        reasons::ImageMissing,
                        format!("image {} is missing", image.display()),
                    ));
                }
                found.push(Finding::inaccessible(
                    reasons::LoopDeviceGone,
                    format!("{} no longer backs this volume", path.display()),
                ));
            }
        }
        Ok(found)
    }
}

#[async_trait::async_trait]
impl DeviceMounter for FileBackend {
    fn node_device(&self) -> Option<crate::host::devices::DeviceClass> {
        Some(crate::host::devices::LOOP)
    }

    async fn node_copy_pending(&self, id: &VolumeId, _ctx: &AttachContext) -> Result<bool> {
        self.own(id.backend())?;
        Ok(read_json::<VolumeMeta>(&self.meta(id.locator()))?.is_some_and(|m| m.copy_pending))
    }

    async fn node_copy_done(&self, id: &VolumeId, _ctx: &AttachContext) -> Result<()> {
        self.own(id.backend())?;
        let path = self.meta(id.locator());
        if let Some(mut meta) = read_json::<VolumeMeta>(&path)? {
            meta.copy_pending = false;
            write_json(&path, &meta).await?;
        }
        Ok(())
    }

    async fn node_refresh_size(&self, id: &VolumeId, attachment: &Attachment) -> Result<u64> {
        self.own(id.backend())?;
        match attachment {
            Attachment::Device { path } => self.loops.refresh(path).await,
            Attachment::Remote { .. } => Err(Error::internal("file volumes are never remote")),
        }
    }
}
