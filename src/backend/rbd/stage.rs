//! The `rbd` backend's volumes on the node: attached for a stage, let go at
//! unstage, and the block device's growth and copies.

use super::*;

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
        while let Some(dev) = self.find_mapping(&spec).await? {
            match self.cli.unmap(&dev).await {
                Ok(()) => {}
                Err(e) if e.kind == Kind::NotFound => {}
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

    async fn node_condition(
        &self,
        id: &VolumeId,
        attachment: &Attachment,
    ) -> Result<Option<String>> {
        let spec = self.volume_spec(id)?;
        let Attachment::Device { path } = attachment else {
            return Ok(Some("unexpected attachment".into()));
        };
        if self.find_mapping(&spec).await?.as_ref() != Some(path) {
            return Ok(Some(format!(
                "{} is no longer mapped to {}",
                path.display(),
                spec.arg()
            )));
        }
        // The client this node recorded at stage is no longer in the
        // image: a detach fenced it (blocklisted; its I/O fails).
        let staged = self.staged.locked().get(&id.to_string()).cloned();
        if let Some(Staged {
            secrets,
            node,
            client: Some(addr),
        }) = staged
        {
            let meta = self.rbd().meta(&self.creds(&secrets)?, &spec).await?;
            if meta.get(&client_key(&node)) != Some(&addr) {
                return Ok(Some(format!(
                    "the volume was detached from this node while staged here: its client {addr} is fenced"
                )));
            }
        }
        // With credentials of its own, the node also asks the cluster
        // (bounded by the command timeout).
        if let Ok(creds) = self.creds(&Secrets::default()) {
            if let Err(e) = self.rbd().watchers(&creds, &spec).await {
                return Ok(Some(format!("the cluster does not answer: {}", e.message)));
            }
        }
        Ok(None)
    }
}

#[async_trait::async_trait]
impl DeviceMounter for RbdBackend {
    fn node_device(&self) -> Option<crate::host::devices::DeviceKind> {
        Some(crate::host::devices::DeviceKind::Rbd)
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
