//! Test doubles of the export layer, for any exporting backend's tests:
//! a store that keeps volumes in memory, and the requests they make.

use crate::error::{Error, Result};
use crate::plugin::{
    locator_for_name, AccessMode, AccessType, AttachContext, Attachment, Backend, Capacity,
    ControllerAttach, CreateVolume, DeviceMounter, Expander, Page, Provisioner, Secrets, Stager,
    VolumeCapability, VolumeId, VolumeInfo,
};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex as StdMutex};

/// CreateVolume of an 8 MiB single-node block volume named `name`.
pub fn create(name: &str) -> CreateVolume {
    CreateVolume {
        name: name.into(),
        required_bytes: 8 << 20,
        limit_bytes: 0,
        capabilities: vec![VolumeCapability {
            access: AccessType::Block,
            mode: AccessMode::SingleNodeWriter,
        }],
        parameters: BTreeMap::new(),
        metadata: BTreeMap::new(),
        source: None,
        secrets: Secrets::default(),
    }
}

/// ControllerPublish of a single-node block volume to `node_id`, with
/// `secrets`.
pub fn attach_block(node_id: &str, secrets: &[(&str, &str)]) -> ControllerAttach {
    ControllerAttach {
        node_id: node_id.into(),
        capability: VolumeCapability {
            access: AccessType::Block,
            mode: AccessMode::SingleNodeWriter,
        },
        readonly: false,
        volume_context: BTreeMap::new(),
        secrets: Secrets::new(
            secrets
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        ),
    }
}

/// A store that keeps volumes in memory and records what it is asked.
#[derive(Default)]
pub struct MemStore {
    /// Its name: `<owner>-store`.
    name: String,
    sizes: StdMutex<BTreeMap<String, u64>>,
    calls: StdMutex<Vec<String>>,
    /// Copies whose filesystem UUID is still their source's.
    pub copies: StdMutex<BTreeSet<String>>,
    /// A volume whose detach hangs (a store that does not answer) until
    /// the test lets it go: (locator, entered, release).
    pub stuck: StdMutex<Option<Stuck>>,
    /// Whether it stands for a store of logical volumes (which take no
    /// punched holes) rather than image files.
    lv: bool,
}

/// The kinds of store a MemStore stands for: of image files, of logical
/// volumes.
const FILE_STORE: crate::plugin::Kind = crate::plugin::Kind {
    store: Some(crate::plugin::StoreKind {
        punches_holes: true,
        as_store: |_| {},
    }),
    ..crate::plugin::DOUBLE
};
const LV_STORE: crate::plugin::Kind = crate::plugin::Kind {
    store: Some(crate::plugin::StoreKind {
        punches_holes: false,
        as_store: |_| {},
    }),
    ..crate::plugin::DOUBLE
};

/// A detach held: (locator, entered, release).
pub type Stuck = (String, Arc<tokio::sync::Notify>, Arc<tokio::sync::Notify>);

impl MemStore {
    /// A store of image files for backend `owner`.
    pub fn new(owner: &str) -> Self {
        MemStore {
            name: format!("{owner}-store"),
            ..Default::default()
        }
    }

    /// A store of logical volumes for backend `owner`.
    pub fn lv(owner: &str) -> Self {
        MemStore {
            lv: true,
            ..Self::new(owner)
        }
    }

    /// What it was asked, in order (a create with the parameters it was
    /// given).
    pub fn calls(&self) -> Vec<String> {
        self.calls.lock().unwrap().clone()
    }
    fn note(&self, s: String) {
        self.calls.lock().unwrap().push(s);
    }
}

#[async_trait::async_trait]
impl Backend for MemStore {
    fn name(&self) -> &str {
        &self.name
    }

    fn kind(&self) -> &'static crate::plugin::Kind {
        if self.lv {
            &LV_STORE
        } else {
            &FILE_STORE
        }
    }

    async fn health(&self) -> Result<()> {
        Ok(())
    }

    fn validate_parameters(&self, _: &BTreeMap<String, String>) -> Result<()> {
        Ok(())
    }

    fn access_modes(&self) -> Vec<AccessMode> {
        crate::plugin::SINGLE_NODE_MODES.to_vec()
    }

    fn provisioner(&self) -> Option<&dyn Provisioner> {
        Some(self)
    }

    fn expander(&self) -> Option<&dyn Expander> {
        Some(self)
    }

    fn stager(&self) -> Option<&dyn Stager> {
        Some(self)
    }

    fn device_mounter(&self) -> Option<&dyn DeviceMounter> {
        Some(self)
    }
}

#[async_trait::async_trait]
impl Provisioner for MemStore {
    fn clones(&self) -> bool {
        true
    }

    async fn get_volume(&self, id: &VolumeId, _: &Secrets) -> Result<Option<VolumeInfo>> {
        let size = self.sizes.lock().unwrap().get(id.locator()).copied();
        Ok(size.map(|capacity_bytes| VolumeInfo {
            id: id.clone(),
            capacity_bytes,
            context: BTreeMap::new(),
            source: None,
        }))
    }

    async fn list_volumes(&self, _: &Page) -> Result<Vec<VolumeInfo>> {
        Err(Error::internal("the store double lists nothing"))
    }

    async fn capacity(&self, _: &BTreeMap<String, String>) -> Result<Capacity> {
        Err(Error::internal("the store double has no capacity"))
    }

    async fn create_volume(&self, req: &CreateVolume) -> Result<VolumeInfo> {
        let locator = locator_for_name(&req.name);
        let mut note = format!("create {locator}");
        for (k, v) in &req.parameters {
            note += &format!(" {k}={v}");
        }
        self.note(note);
        if req.source.is_some() {
            self.copies.lock().unwrap().insert(locator.clone());
        }
        let size = *self
            .sizes
            .lock()
            .unwrap()
            .entry(locator.clone())
            .or_insert(req.required_bytes);
        Ok(VolumeInfo {
            id: VolumeId::new(&self.name, &locator)?,
            capacity_bytes: size,
            context: BTreeMap::new(),
            source: None,
        })
    }

    async fn delete_volume(&self, id: &VolumeId, _: &Secrets) -> Result<()> {
        self.note(format!("delete {id}"));
        self.sizes.lock().unwrap().remove(id.locator());
        Ok(())
    }
}

#[async_trait::async_trait]
impl Expander for MemStore {
    fn online(&self) -> bool {
        true
    }

    async fn expand_volume(
        &self,
        id: &VolumeId,
        required: u64,
        _: u64,
        _: &Secrets,
    ) -> Result<u64> {
        self.note(format!("expand {id} {required}"));
        self.sizes
            .lock()
            .unwrap()
            .insert(id.locator().into(), required);
        Ok(required)
    }
}

#[async_trait::async_trait]
impl Stager for MemStore {
    async fn node_attach(&self, id: &VolumeId, _: &AttachContext) -> Result<Attachment> {
        self.note(format!("attach {id}"));
        Ok(Attachment::Device {
            path: "/dev/loop7".into(),
        })
    }

    async fn node_detach(&self, id: &VolumeId, a: Option<&Attachment>) -> Result<()> {
        self.note(format!("detach {id} {}", a.is_some()));
        let stuck = self.stuck.lock().unwrap().clone();
        if let Some((locator, entered, release)) = stuck {
            if locator == id.locator() {
                entered.notify_one();
                release.notified().await;
            }
        }
        Ok(())
    }
}

#[async_trait::async_trait]
impl DeviceMounter for MemStore {
    async fn node_refresh_size(&self, id: &VolumeId, _: &Attachment) -> Result<u64> {
        self.note(format!("refresh {id}"));
        Ok(self.sizes.lock().unwrap()[id.locator()])
    }

    async fn node_copy_pending(&self, id: &VolumeId, _: &AttachContext) -> Result<bool> {
        Ok(self.copies.lock().unwrap().contains(id.locator()))
    }

    async fn node_copy_done(&self, id: &VolumeId, _: &AttachContext) -> Result<()> {
        self.note(format!("copy done {id}"));
        self.copies.lock().unwrap().remove(id.locator());
        Ok(())
    }
}
