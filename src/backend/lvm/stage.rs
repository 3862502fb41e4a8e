//! The `lvm` backend's volumes on the node: attached for a stage, let go at
//! unstage, and the block device's growth and copies.

use super::*;
use crate::plugin::Finding;

#[async_trait::async_trait]
impl Stager for LvmBackend {
    async fn node_attach(&self, id: &VolumeId, _ctx: &AttachContext) -> Result<Attachment> {
        let (class, lv_name) = self.split(id.locator())?;
        let vg = class.volume_group.clone();
        let lv = match self.class_lv(class, lv_name).await? {
            Some(lv) if !lv.has_tag(DELETING_TAG) => lv,
            Some(_) => return Err(Error::no_volume(id)),
            // Not listed: gone, or its group unreadable (a failed disk),
            // which a retry may outlast.
            None => match self.unreadable_group(class).await {
                Some(why) => return Err(Error::unavailable(format!("{id}: {why}"))),
                None => return Err(Error::no_volume(id)),
            },
        };
        let path = self.activate(&vg, lv_name).await?;
        self.copies_seen
            .lock()
            .unwrap()
            .insert(format!("{vg}/{lv_name}"), lv.has_tag(COPY_TAG));
        if lv.has_tag(FRESH_TAG) {
            // A new LV may sit on extents an old one used: clear the start
            // (old filesystem signatures and data) before anything reads it.
            let dev = path_arg(&path)?;
            self.runner
                .run(
                    Command::new("wipefs")
                        .args(["-a", "-q"])
                        .arg(dev.clone())
                        .timeout(LVM_TIMEOUT),
                )
                .await?;
            self.runner
                .run(
                    Command::new("dd")
                        .args([
                            "if=/dev/zero".to_string(),
                            format!("of={dev}"),
                            "bs=1M".into(),
                            "count=1".into(),
                        ])
                        .args(["oflag=direct", "conv=notrunc", "status=none"])
                        .timeout(LVM_TIMEOUT),
                )
                .await?;
            self.runner
                .run(
                    self.lvm("lvchange")
                        .args(["--deltag", FRESH_TAG, &format!("{vg}/{lv_name}")]),
                )
                .await?;
        }
        Ok(Attachment::Device { path })
    }

    async fn node_detach(&self, id: &VolumeId, attachment: Option<&Attachment>) -> Result<()> {
        let Ok((class, lv_name)) = self.split(id.locator()) else {
            return Ok(());
        };
        if !self.settings.deactivate_on_unstage {
            return Ok(());
        }
        self.copies_seen
            .lock()
            .unwrap()
            .remove(&format!("{}/{lv_name}", class.volume_group));
        if attachment.is_some() {
            // Staged by us: the LV was ours when it was attached. It is
            // let go at once, and lvs then says whether that is done; an
            // lvchange that failed over an LV still active is the answer.
            let first = self.deactivate(&class.volume_group, lv_name).await;
            match self.lv(&class.volume_group, lv_name).await? {
                None => return Ok(()),
                Some(lv) if lv.inactive() => return Ok(()),
                Some(_) => first?,
            }
        }
        // Done only when lvs says so: an LV left active (lvchange raced a
        // udev scan of the device, or answered 0 and left it) fails the
        // unstage, and the CO calls again. Twice, for the udev race.
        for _ in 0..2 {
            match self.lv(&class.volume_group, lv_name).await? {
                None => return Ok(()),
                Some(lv) if lv.inactive() => return Ok(()),
                Some(_) => self.deactivate(&class.volume_group, lv_name).await?,
            }
        }
        match self.lv(&class.volume_group, lv_name).await? {
            Some(lv) if !lv.inactive() => Err(Error::unavailable(format!(
                "LV {}/{lv_name} is still active (attributes {}) after lvchange -an: is its device in use?",
                class.volume_group, lv.lv_attr
            ))),
            _ => Ok(()),
        }
    }

    async fn node_health(&self, id: &VolumeId, _attachment: &Attachment) -> Result<Vec<Finding>> {
        let (class, lv_name) = self.split(id.locator())?;
        Ok(match self.lv(&class.volume_group, lv_name).await? {
            None => vec![match self.unreadable_group(class).await {
                Some(why) => Finding::inaccessible(reasons::VolumeGroupMissing, why),
                None => Finding::inaccessible(
                    reasons::LogicalVolumeGone,
                    format!("LV {}/{lv_name} is gone", class.volume_group),
                ),
            }],
            Some(lv) => lv.problem().into_iter().collect(),
        })
    }
}

#[async_trait::async_trait]
impl DeviceMounter for LvmBackend {
    async fn node_copy_pending(&self, id: &VolumeId, _ctx: &AttachContext) -> Result<bool> {
        let (class, lv_name) = self.split(id.locator())?;
        let key = format!("{}/{lv_name}", class.volume_group);
        if let Some(copy) = self.copies_seen.lock().unwrap().remove(&key) {
            return Ok(copy);
        }
        Ok(self
            .class_lv(class, lv_name)
            .await?
            .is_some_and(|lv| lv.has_tag(COPY_TAG)))
    }

    async fn node_copy_done(&self, id: &VolumeId, _ctx: &AttachContext) -> Result<()> {
        let (class, lv_name) = self.split(id.locator())?;
        self.runner
            .run(self.lvm("lvchange").args([
                "--deltag",
                COPY_TAG,
                &format!("{}/{lv_name}", class.volume_group),
            ]))
            .await?;
        Ok(())
    }

    async fn node_refresh_size(&self, id: &VolumeId, attachment: &Attachment) -> Result<u64> {
        let (class, lv_name) = self.split(id.locator())?;
        let Attachment::Device { path } = attachment else {
            return Err(Error::internal("LVs are block devices"));
        };
        // An active LV's device follows lvextend at once; a refresh covers
        // the case of an extend made while it was active elsewhere.
        self.runner
            .run(
                self.lvm("lvchange")
                    .args(["--refresh", &format!("{}/{lv_name}", class.volume_group)]),
            )
            .await?;
        self.host.device_size(path)
    }
}
