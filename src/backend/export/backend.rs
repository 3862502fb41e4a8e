//! An exporting backend: its [`Exports`] as a [`Backend`] with every
//! capability the layer gives, for any [`Protocol`]. What a protocol adds
//! is small: its kind, how a node id names a host, what credentials a
//! call's secrets carry, and the export's own mutable parameters.

use super::record::Record;
use super::{Credential, Exports};
use crate::error::Result;
use crate::plugin::health::{Finding, StorageFinding};
use crate::plugin::{
    AccessMode, AttachContext, Attacher, Attachment, Backend, BlockPage, BlockTracker, Capacity,
    ControllerAttach, CreateSnapshot, CreateVolume, DeviceMounter, Expander, Groups,
    HealthReporter, Kind, Modifier, Page, Provisioner, Secrets, SnapshotId, SnapshotInfo,
    SnapshotInstant, Snapshotter, Stager, VolumeId, VolumeInfo, SINGLE_NODE_MODES,
};
use std::collections::BTreeMap;

/// A call's credentials: the one a host proves itself with, and the one
/// the server answers with.
pub type Credentials = (Option<Credential>, Option<Credential>);

/// What a protocol gives an exporting backend besides its target and
/// initiator.
#[async_trait::async_trait]
pub trait Protocol: Send + Sync + 'static {
    fn kind(&self) -> &'static Kind;

    /// This node's token for its node id (its initiator's name).
    fn node_token(&self) -> Result<String>;

    /// The host a node id names, if it names one of this protocol's.
    fn host_in<'a>(&self, node_id: &'a str) -> Option<&'a str>;

    /// The credentials a call's secrets carry for `host` (on the node, the
    /// node's own: `None`), checked; the error never shows a secret.
    fn credentials(&self, secrets: &Secrets, host: Option<&str>) -> Result<Credentials>;

    /// Checks the values of the export's own StorageClass parameters (its
    /// kind's [`Kind::parameters`]; the store's are the store's): at
    /// CreateVolume, and on the node from the volume context, where they
    /// shape the connection.
    fn check_parameters(&self, _own: &BTreeMap<String, String>) -> Result<()> {
        Ok(())
    }

    /// The export's own mutable parameters (the store's are passed on).
    fn mutable_keys(&self) -> &'static [&'static str] {
        &[]
    }

    /// Checks values of the export's own keys against the exports (their
    /// store's kind, say).
    fn check_mutable(&self, _exports: &Exports, _own: &BTreeMap<String, String>) -> Result<()> {
        Ok(())
    }

    /// Applies the export's own keys to a volume's export and record
    /// (the volume's lock is held), the record saved last.
    async fn modify(
        &self,
        _exports: &Exports,
        _id: &VolumeId,
        _record: &mut Record,
        _own: &BTreeMap<String, String>,
    ) -> Result<()> {
        Ok(())
    }
}

/// A backend whose volumes are exported by `P`.
pub struct Exported<P> {
    pub(crate) name: String,
    pub(crate) protocol: P,
    pub(crate) exports: Exports,
    /// Reached when a modify changed the store's keys and not yet the
    /// export's (the backend's kill point).
    pub(crate) modified_store: fn(),
}

impl<P: Protocol> Exported<P> {
    pub fn from_parts(protocol: P, exports: Exports, modified_store: fn()) -> Self {
        Exported {
            name: exports.name.clone(),
            protocol,
            exports,
            modified_store,
        }
    }

    pub fn exports(&self) -> &Exports {
        &self.exports
    }

    /// `changes` split: the export's own keys, and the store's.
    fn split(
        &self,
        changes: &BTreeMap<String, String>,
    ) -> (BTreeMap<String, String>, BTreeMap<String, String>) {
        split_by(changes, self.protocol.mutable_keys())
    }

    /// A request's StorageClass parameters split: the export's own (its
    /// kind's), and the store's.
    fn split_parameters(
        &self,
        parameters: &BTreeMap<String, String>,
    ) -> (BTreeMap<String, String>, BTreeMap<String, String>) {
        split_by(parameters, self.protocol.kind().parameters)
    }

    /// `req` with only the store's parameters, and the export's own
    /// (checked).
    fn for_store(&self, req: &CreateVolume) -> Result<(CreateVolume, BTreeMap<String, String>)> {
        let (own, theirs) = self.split_parameters(&req.parameters);
        self.protocol.check_parameters(&own)?;
        let mut r = req.clone();
        r.parameters = theirs;
        Ok((r, own))
    }
}

/// `map` split: the entries whose keys are in `keys`, and the others.
fn split_by(
    map: &BTreeMap<String, String>,
    keys: &[&str],
) -> (BTreeMap<String, String>, BTreeMap<String, String>) {
    map.iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .partition(|(k, _)| keys.contains(&k.as_str()))
}

#[async_trait::async_trait]
impl<P: Protocol> Backend for Exported<P> {
    fn name(&self) -> &str {
        &self.name
    }

    fn kind(&self) -> &'static Kind {
        self.protocol.kind()
    }

    async fn start(&self) -> Result<()> {
        self.exports.start().await
    }

    async fn health(&self) -> Result<()> {
        self.exports.health().await
    }

    /// Its own (its kind's: the node's connection to the export) and its
    /// store's (an export is made as the store makes a volume).
    fn parameters(&self) -> Vec<&'static str> {
        let mut keys = self.protocol.kind().parameters.to_vec();
        keys.extend(self.exports.store().parameters());
        keys
    }

    fn validate_parameters(&self, parameters: &BTreeMap<String, String>) -> Result<()> {
        let (own, theirs) = self.split_parameters(parameters);
        self.protocol.check_parameters(&own)?;
        self.exports.store().get()?.validate_parameters(&theirs)
    }

    /// The single-node modes, and two that nodes share (see
    /// [`Exports::publish`]): many writers of a raw block device (a
    /// filesystem's is refused before: `supports`), and many readers.
    fn access_modes(&self) -> Vec<AccessMode> {
        let mut modes = SINGLE_NODE_MODES.to_vec();
        modes.extend([
            AccessMode::MultiNodeReaderOnly,
            AccessMode::MultiNodeMultiWriter,
        ]);
        modes
    }

    async fn storage_findings(&self) -> Vec<StorageFinding> {
        self.exports.path_findings().await
    }

    /// What the store and the server say (only where the store is: the
    /// target host).
    fn health_reporter(&self) -> Option<&dyn HealthReporter> {
        self.exports.store().here().is_some().then_some(self as _)
    }

    fn provisioner(&self) -> Option<&dyn Provisioner> {
        Some(self)
    }

    /// What the store grows (a node, without a store, grows its view of
    /// the export).
    fn expander(&self) -> Option<&dyn Expander> {
        let grows = self
            .exports
            .store()
            .here()
            .is_none_or(|s| s.expander().is_some());
        grows.then_some(self as &dyn Expander)
    }

    /// The store's snapshots (controllers only: nodes have no store).
    fn snapshotter(&self) -> Option<&dyn Snapshotter> {
        let takes = self
            .exports
            .store()
            .here()
            .is_some_and(|s| s.snapshotter().is_some());
        takes.then_some(self as &dyn Snapshotter)
    }

    fn modifier(&self) -> Option<&dyn Modifier> {
        Some(self)
    }

    fn attacher(&self) -> Option<&dyn Attacher> {
        Some(self)
    }

    fn stager(&self) -> Option<&dyn Stager> {
        Some(self)
    }

    fn device_mounter(&self) -> Option<&dyn DeviceMounter> {
        Some(self)
    }

    /// The store's own, of the store's snapshots.
    fn block_tracker(&self) -> Option<&dyn BlockTracker> {
        let tracks = self
            .exports
            .store()
            .here()
            .is_some_and(|s| s.block_tracker().is_some());
        tracks.then_some(self as &dyn BlockTracker)
    }
}

#[async_trait::async_trait]
impl<P: Protocol> Provisioner for Exported<P> {
    fn clones(&self) -> bool {
        self.exports.store().clones()
    }

    fn volume_id_for(&self, req: &CreateVolume) -> Result<VolumeId> {
        self.exports.store().volume_id_for(&self.for_store(req)?.0)
    }

    /// The store's volume made and exported; its own parameters go to the
    /// node in the volume context (a PV keeps them: a class changed later
    /// leaves its volumes as they were made).
    async fn create_volume(&self, req: &CreateVolume) -> Result<VolumeInfo> {
        let (r, own) = self.for_store(req)?;
        let mut info = self.exports.create_volume(&r).await?;
        info.context.extend(own);
        Ok(info)
    }

    async fn delete_volume(&self, id: &VolumeId, secrets: &Secrets) -> Result<()> {
        self.exports.delete_volume(id, secrets).await
    }

    async fn get_volume(&self, id: &VolumeId, secrets: &Secrets) -> Result<Option<VolumeInfo>> {
        self.exports.store().get_volume(id, secrets).await
    }

    async fn list_volumes(&self, page: &Page) -> Result<Vec<VolumeInfo>> {
        self.exports.store().list_volumes(page).await
    }

    async fn capacity(&self, parameters: &BTreeMap<String, String>) -> Result<Capacity> {
        self.exports.store().capacity(parameters).await
    }
}

#[async_trait::async_trait]
impl<P: Protocol> Expander for Exported<P> {
    /// As the server grows an export (see [`super::Terms`]).
    fn online(&self) -> bool {
        self.exports.grows_online()
    }

    async fn expand_volume(
        &self,
        id: &VolumeId,
        required: u64,
        limit: u64,
        secrets: &Secrets,
    ) -> Result<u64> {
        self.exports
            .expand_volume(id, required, limit, secrets)
            .await
    }
}

#[async_trait::async_trait]
impl<P: Protocol> Modifier for Exported<P> {
    /// The export's own keys, and the store's.
    fn mutable_keys(&self) -> Vec<&'static str> {
        let mut keys = self.protocol.mutable_keys().to_vec();
        if let Some(store) = self.exports.store().here() {
            keys.extend(
                store
                    .modifier()
                    .map(|m| m.mutable_keys())
                    .unwrap_or_default(),
            );
        }
        keys
    }

    fn check_mutable(&self, changes: &BTreeMap<String, String>) -> Result<()> {
        let (own, store) = self.split(changes);
        self.protocol.check_mutable(&self.exports, &own)?;
        // A store without mutable parameters has none to check (the keys
        // were checked against mutable_keys, which names only the store's).
        match self.exports.store().get()?.modifier() {
            Some(m) => m.check_mutable(&store),
            None => Ok(()),
        }
    }

    async fn modify_volume(
        &self,
        id: &VolumeId,
        changes: &BTreeMap<String, String>,
        secrets: &Secrets,
    ) -> Result<()> {
        let exports = &self.exports;
        exports.own_volume(id)?;
        let (own, for_store) = self.split(changes);
        let _volume = exports.lock(id).await;
        let mut record = exports
            .load(id)?
            .ok_or_else(|| crate::error::Error::no_volume(id))?;
        // The store's keys first: it checks them whole before it changes
        // anything; then the export's, whose change cannot be refused.
        if !for_store.is_empty() {
            let store = exports.store();
            store
                .get()?
                .modifying()?
                .modify_volume(&store.volume(id)?, &for_store, secrets)
                .await?;
        }
        // Each step is safe to repeat: the CO's retry of a modify cut
        // short here (or after the export's change, before the record)
        // makes every change, the record last.
        (self.modified_store)();
        if own.is_empty() {
            return Ok(());
        }
        self.protocol.modify(exports, id, &mut record, &own).await
    }
}

#[async_trait::async_trait]
impl<P: Protocol> Snapshotter for Exported<P> {
    fn instant(&self) -> SnapshotInstant {
        self.exports.instant()
    }

    /// Members in use are held at the target while each is cut.
    fn groups(&self) -> Groups<'_> {
        Groups::Cut(&self.exports)
    }

    fn snapshot_id_for(&self, req: &CreateSnapshot) -> Result<SnapshotId> {
        self.exports.store().snapshot_id_for(req)
    }

    fn validate_snapshot_parameters(&self, parameters: &BTreeMap<String, String>) -> Result<()> {
        self.exports
            .store()
            .validate_snapshot_parameters(parameters)
    }

    async fn create_snapshot(&self, req: &CreateSnapshot) -> Result<SnapshotInfo> {
        self.exports.create_snapshot(req).await
    }

    async fn delete_snapshot(&self, id: &SnapshotId, secrets: &Secrets) -> Result<()> {
        self.exports.store().delete_snapshot(id, secrets).await
    }

    async fn get_snapshot(
        &self,
        id: &SnapshotId,
        secrets: &Secrets,
    ) -> Result<Option<SnapshotInfo>> {
        self.exports.store().get_snapshot(id, secrets).await
    }

    async fn list_snapshots(
        &self,
        source: Option<&VolumeId>,
        page: &Page,
    ) -> Result<Vec<SnapshotInfo>> {
        self.exports.store().list_snapshots(source, page).await
    }
}

#[async_trait::async_trait]
impl<P: Protocol> BlockTracker for Exported<P> {
    async fn allocated_blocks(
        &self,
        snapshot: &SnapshotId,
        start: u64,
        max: usize,
        secrets: &Secrets,
    ) -> Result<BlockPage> {
        self.exports
            .store()
            .allocated_blocks(snapshot, start, max, secrets)
            .await
    }

    async fn changed_blocks(
        &self,
        base: &SnapshotId,
        target: &SnapshotId,
        start: u64,
        max: usize,
        secrets: &Secrets,
    ) -> Result<BlockPage> {
        self.exports
            .store()
            .changed_blocks(base, target, start, max, secrets)
            .await
    }
}

#[async_trait::async_trait]
impl<P: Protocol> HealthReporter for Exported<P> {
    async fn known_volumes(&self, page: &Page) -> Result<Vec<VolumeId>> {
        self.exports.known_volumes(page).await
    }

    /// The store's findings, and the server's missing export.
    async fn volume_health(&self, id: &VolumeId, secrets: &Secrets) -> Result<Vec<Finding>> {
        self.exports.volume_health(id, secrets).await
    }
}

#[async_trait::async_trait]
impl<P: Protocol> Attacher for Exported<P> {
    fn node_id_suffix(&self) -> Result<Option<String>> {
        self.protocol.node_token().map(Some)
    }

    /// Grants the volume to the host the node id names, with the call's
    /// credentials; the publish context says where and what to connect to.
    async fn controller_attach(
        &self,
        id: &VolumeId,
        req: &ControllerAttach,
    ) -> Result<BTreeMap<String, String>> {
        self.exports.own_volume(id)?;
        let host = self.protocol.host_in(&req.node_id).ok_or_else(|| {
            crate::error::Error::not_found(format!(
                "node {:?} reported no {} name (is an {} backend configured on it?)",
                req.node_id,
                self.exports.terms().host,
                self.protocol.kind().name
            ))
        })?;
        let (incoming, outgoing) = self.protocol.credentials(&req.secrets, Some(host))?;
        let record = self
            .exports
            .publish(id, host, &incoming, &outgoing, req)
            .await?;
        Ok(self.exports.publish_context(&record))
    }

    async fn controller_detach(
        &self,
        id: &VolumeId,
        node_id: Option<&str>,
        _secrets: &Secrets,
    ) -> Result<()> {
        let host = match node_id {
            Some(n) => match self.protocol.host_in(n) {
                Some(h) => Some(h),
                // A node without a host name of this protocol was never
                // granted anything.
                None => return Ok(()),
            },
            None => None,
        };
        self.exports.unpublish(id, host).await
    }
}

#[async_trait::async_trait]
impl<P: Protocol> Stager for Exported<P> {
    async fn node_attach(&self, id: &VolumeId, ctx: &AttachContext) -> Result<Attachment> {
        self.exports.own_volume(id)?;
        let (incoming, outgoing) = self.protocol.credentials(&ctx.secrets, None)?;
        let (settings, _) = self.split_parameters(&ctx.volume_context);
        self.protocol.check_parameters(&settings)?;
        self.exports
            .node_attach(id, ctx, incoming.as_ref(), outgoing.as_ref(), &settings)
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
impl<P: Protocol> DeviceMounter for Exported<P> {
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
