//! The `iscsi` backend's volumes granted to nodes (ControllerPublish and
//! Unpublish, with fencing): the exports' own, given the node's initiator
//! name and the call's CHAP.

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
        let initiator = Self::initiator_of(&req.node_id)?;
        let (incoming, outgoing) = chap_from(&req.secrets)?;
        let record = self
            .exports
            .publish(id, initiator, &incoming, &outgoing, req)
            .await?;
        Ok(self.exports.publish_context(&record))
    }

    async fn controller_detach(
        &self,
        id: &VolumeId,
        node_id: Option<&str>,
        _secrets: &Secrets,
    ) -> Result<()> {
        let initiator = match node_id {
            Some(n) => match node_initiator(n) {
                Some(i) => Some(i),
                // A node without an initiator name was never granted one.
                None => return Ok(()),
            },
            None => None,
        };
        self.exports.unpublish(id, initiator).await
    }
}
