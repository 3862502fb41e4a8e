//! The `iscsi` backend's volumes granted to nodes (ControllerPublish and
//! Unpublish, with fencing).

use super::*;

#[async_trait::async_trait]
impl Attacher for IscsiBackend {
    fn node_id_suffix(&self) -> Result<Option<String>> {
        initiator::initiator_name(&self.settings.initiator_name_file).map(Some)
    }

    async fn controller_attach(
        &self,
        id: &VolumeId,
        req: &ControllerAttach,
    ) -> Result<BTreeMap<String, String>> {
        self.own_volume(id)?;
        let initiator = Self::initiator_of(&req.node_id)?.to_string();
        let (incoming, outgoing) = chap_from(&req.secrets)?;
        let _volume = self.volume_mutex(id).lock_owned().await;
        let mut record = self.load(id)?.ok_or_else(|| Error::no_volume(id))?;
        // Every access mode of this backend is single-node: a volume
        // published to one node is not published to another (two nodes
        // mounting one filesystem corrupt it).
        if let Some(other) = record.hosts.iter().find(|i| **i != initiator) {
            return Err(Error::precondition(format!(
                "volume {id} is published to initiator {other} (another node); \
                 it is used by one node at a time: unpublish it there first"
            )));
        }
        if record.hosts.contains(&initiator) {
            check_publish_terms(
                id,
                &req.node_id,
                record.terms.get(&initiator).map(String::as_str),
                req,
            )?;
        }
        match self
            .open_target(id, &mut record, &incoming, &outgoing, &initiator)
            .await
        {
            // A target the cache named is gone: read the server and make
            // it again.
            Err(e) if e.kind == Kind::NotFound => {
                self.forget_tids().await;
                self.open_target(id, &mut record, &incoming, &outgoing, &initiator)
                    .await?;
            }
            r => {
                r?;
            }
        }
        record.terms.insert(initiator.clone(), req.terms());
        record.hosts.insert(initiator);
        self.check_copy(id, &mut record).await?;
        self.save(id, &record)?;
        let mut ctx = BTreeMap::from([
            (CTX_PORTALS.to_string(), self.settings.portals.join(",")),
            (CTX_IQN.to_string(), record.export.clone()),
            (CTX_LUN.to_string(), "1".to_string()),
        ]);
        if let Some(copy) = &record.copy {
            ctx.insert(CTX_FS_COPY.to_string(), copy.token.clone());
        }
        Ok(ctx)
    }

    async fn controller_detach(
        &self,
        id: &VolumeId,
        node_id: Option<&str>,
        _secrets: &Secrets,
    ) -> Result<()> {
        if id.backend() != self.name {
            return Ok(());
        }
        let _volume = self.volume_mutex(id).lock_owned().await;
        let Some(mut record) = self.load(id)? else {
            return Ok(());
        };
        let gone: Vec<String> = match node_id {
            Some(n) => match node_initiator(n) {
                Some(i) => vec![i.to_string()],
                None => return Ok(()),
            },
            None => record.hosts.iter().cloned().collect(),
        };
        if let Some(tid) = self.tid_of(&record.export, false).await? {
            match self.fence(id, tid, &gone).await {
                // The cache named a target removed behind the driver's
                // back: asked of the server again, a target gone is
                // nothing to detach from.
                Err(e) if e.kind == crate::error::Kind::NotFound => {
                    match self.tid_of(&record.export, true).await? {
                        Some(tid) => self.fence(id, tid, &gone).await?,
                        None => tracing::warn!(volume = %id,
                            "the volume's target is gone from the target server: nothing to detach from"),
                    }
                }
                done => done?,
            }
        }
        for i in &gone {
            record.hosts.remove(i);
            record.terms.remove(i);
        }
        self.save(id, &record)
    }
}

impl IscsiBackend {
    /// Takes `initiators` off target `tid`'s ACL and closes their
    /// connections.
    async fn fence(&self, id: &VolumeId, tid: u32, initiators: &[String]) -> Result<()> {
        for i in initiators {
            self.target.disallow(tid, i).await?;
            // Fenced: a node still logged in when its volume is detached
            // (a node lost, its teardown never came) loses its connections
            // before the detach answers, so none of its writes land once
            // the volume moves on. It cannot log in again: it just left
            // the ACL.
            let closed = self.target.close_connections(tid, i).await?;
            if closed > 0 {
                tracing::warn!(volume = %id, initiator = %i, connections = closed,
                    "fenced: the node was still logged in to the volume's target at detach; its connections are closed");
            }
        }
        Ok(())
    }
}
