//! The `rbd` backend's volumes granted to nodes (ControllerPublish and
//! Unpublish, with fencing).

use super::*;

#[async_trait::async_trait]
impl Attacher for RbdBackend {
    /// With a user of its own: the nodes each image's metadata names as
    /// published to (`ferrovol.node.<name>`).
    async fn grants(&self) -> Result<Option<Vec<(VolumeId, String)>>> {
        if self.settings.user.is_none() {
            return Ok(None);
        }
        let creds = self.creds(&Secrets::default())?;
        let mut out = Vec::new();
        for (locator, spec) in self.images(&creds, "fv-").await? {
            let Some((_, meta)) = self.rbd().describe(&creds, &spec).await? else {
                continue;
            };
            let id = VolumeId::new(&self.name, &locator)?;
            for node in meta.keys().filter_map(|k| k.strip_prefix(META_NODE)) {
                out.push((id.clone(), node.to_string()));
            }
        }
        Ok(Some(out))
    }

    fn node_id_suffix(&self) -> Result<Option<String>> {
        Ok(Some(NODE_TOKEN.to_string()))
    }

    async fn controller_attach(
        &self,
        id: &VolumeId,
        req: &ControllerAttach,
    ) -> Result<BTreeMap<String, String>> {
        let spec = self.volume_spec(id)?;
        let creds = self.creds(&req.secrets)?;
        let node = node_name(&req.node_id);
        check_name("node name", node, false)?;
        if !node_tokens(&req.node_id).any(|t| t == NODE_TOKEN) {
            return Err(Error::not_found(format!(
                "node {:?} does not map rbd images (its node id does not say so: is an rbd backend configured on it?)",
                req.node_id
            )));
        }
        let Some((_, meta)) = self.rbd().describe(&creds, &spec).await? else {
            return Err(Error::no_volume(id));
        };
        // Nodes may share the image only in the same many-node mode: all
        // writers of a raw block volume, or all read-only.
        let kind = match req.capability.mode {
            AccessMode::MultiNodeMultiWriter => "multi",
            AccessMode::MultiNodeReaderOnly => "readers",
            _ => "single",
        };
        let mark = format!("{kind};{}", req.terms());
        for (key, value) in &meta {
            let Some(other) = key.strip_prefix(META_NODE) else {
                continue;
            };
            let (their_kind, terms) = value.split_once(';').unwrap_or((value.as_str(), ""));
            if other == node {
                check_publish_terms(id, node, Some(terms).filter(|t| !t.is_empty()), req)?;
                continue;
            }
            if kind == "single" || their_kind != kind {
                return Err(Error::precondition(format!(
                    "volume {id} is published to node {other} ({}); it is shared only by nodes that all publish it in one many-node mode",
                    if their_kind == "single" { "single-node" } else { their_kind }
                )));
            }
        }
        self.rbd()
            .set_meta(&creds, &spec, &format!("{META_NODE}{node}"), &mark)
            .await?;
        Ok(BTreeMap::new())
    }

    async fn controller_detach(
        &self,
        id: &VolumeId,
        node_id: Option<&str>,
        secrets: &Secrets,
    ) -> Result<()> {
        let Ok(spec) = self.volume_spec(id) else {
            return Ok(());
        };
        let creds = self.creds(secrets)?;
        let Some((_, meta)) = self.rbd().describe(&creds, &spec).await? else {
            return Ok(());
        };
        for (key, addr) in meta.iter().filter(|(k, _)| k.starts_with(META_CLIENT)) {
            let holder = &key[META_CLIENT.len()..];
            if node_id.is_none_or(|n| node_name(n) == holder) {
                self.fence(&creds, &spec, id, holder, addr).await?;
            }
        }
        for key in meta.keys().filter(|k| k.starts_with(META_NODE)) {
            let holder = &key[META_NODE.len()..];
            if node_id.is_none_or(|n| node_name(n) == holder) {
                self.rbd().remove_meta(&creds, &spec, key).await?;
            }
        }
        Ok(())
    }
}
