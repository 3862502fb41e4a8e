//! The backend registry: names validated, duplicates refused, lookup by name,
//! by StorageClass parameter and by volume id.

use super::{is_dns_label, Backend, Capabilities, SnapshotId, VolumeId};
use crate::error::{Error, Result};
use std::collections::BTreeMap;
use std::sync::Arc;

/// The StorageClass parameter that picks a backend.
pub const BACKEND_PARAMETER: &str = "backend";

/// The registered backends.
#[derive(Default, Clone)]
pub struct Registry {
    backends: BTreeMap<String, Arc<dyn Backend>>,
    default: Option<String>,
}

impl Registry {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a backend. Its name must be a lowercase DNS label and unique.
    pub fn register(&mut self, backend: Arc<dyn Backend>) -> Result<()> {
        let name = backend.name().to_string();
        if !is_dns_label(&name) {
            return Err(Error::invalid(format!(
                "backend name {name:?} is not a lowercase DNS label (a-z, 0-9, '-', at most 63)"
            )));
        }
        if self.backends.contains_key(&name) {
            return Err(Error::invalid(format!(
                "backend name {name:?} is registered twice"
            )));
        }
        self.backends.insert(name, backend);
        Ok(())
    }

    /// Sets the backend used when a StorageClass names none.
    pub fn set_default(&mut self, name: &str) -> Result<()> {
        if !self.backends.contains_key(name) {
            return Err(Error::invalid(format!(
                "default backend {name:?} is not configured"
            )));
        }
        self.default = Some(name.to_string());
        Ok(())
    }

    pub fn is_empty(&self) -> bool {
        self.backends.is_empty()
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.backends.keys().map(String::as_str)
    }

    pub fn all(&self) -> impl Iterator<Item = &Arc<dyn Backend>> {
        self.backends.values()
    }

    /// The backend of this name.
    pub fn get(&self, name: &str) -> Option<&Arc<dyn Backend>> {
        self.backends.get(name)
    }

    /// The backend a StorageClass's parameters select: its `backend`
    /// parameter, else the default, else the only backend.
    pub fn for_parameters(
        &self,
        parameters: &BTreeMap<String, String>,
    ) -> Result<&Arc<dyn Backend>> {
        if let Some(name) = parameters.get(BACKEND_PARAMETER) {
            return self.get(name).ok_or_else(|| {
                Error::invalid(format!(
                    "parameter backend={name:?} names no configured backend"
                ))
            });
        }
        if let Some(name) = &self.default {
            return Ok(&self.backends[name]);
        }
        match self.backends.len() {
            1 => Ok(self.backends.values().next().expect("one backend")),
            0 => Err(Error::precondition("no backend is configured")),
            _ => Err(Error::invalid(
                "several backends are configured: set the `backend` parameter",
            )),
        }
    }

    /// The backend that owns a volume. An id naming no backend is a volume
    /// that does not exist: NOT_FOUND.
    pub fn for_volume(&self, id: &VolumeId) -> Result<&Arc<dyn Backend>> {
        self.get(id.backend()).ok_or_else(|| {
            Error::not_found(format!(
                "volume {id} does not exist (no backend {:?})",
                id.backend()
            ))
        })
    }

    /// The backend that owns a snapshot.
    pub fn for_snapshot(&self, id: &SnapshotId) -> Result<&Arc<dyn Backend>> {
        self.get(id.backend()).ok_or_else(|| {
            Error::not_found(format!(
                "snapshot {id} does not exist (no backend {:?})",
                id.backend()
            ))
        })
    }

    /// Whether any backend has mutable parameters (MODIFY_VOLUME).
    pub fn modifies(&self) -> bool {
        self.backends.values().any(|b| b.modifier().is_some())
    }

    /// The union of every backend's capabilities.
    pub fn capabilities(&self) -> Capabilities {
        let mut all = Capabilities::default();
        for b in self.backends.values() {
            let c = b.capabilities();
            all.provision |= c.provision;
            all.attach |= c.attach;
            all.device_mount |= c.device_mount;
            all.expand |= c.expand;
            all.expand_online |= c.expand && c.expand_online;
            all.snapshot |= c.snapshot;
            if all.group_snapshot == super::GroupSnapshots::None {
                all.group_snapshot = c.group_snapshot;
            }
            all.clone |= c.clone;
            all.block |= c.block;
            all.node_local |= c.node_local;
            all.snapshot_metadata |= c.snapshot_metadata;
            for m in c.access_modes {
                if !all.access_modes.contains(&m) {
                    all.access_modes.push(m);
                }
            }
        }
        all
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Kind;
    use crate::plugin::{
        AccessMode, AttachContext, Attacher, Attachment, Capacity, ControllerAttach, CreateVolume,
        DeviceMounter, Expander, Page, Provisioner, Secrets, Stager, VolumeInfo,
    };

    /// A backend of a name that offers what its capabilities say (and
    /// whose calls are never made here).
    struct Named(&'static str, Capabilities);

    #[async_trait::async_trait]
    impl Backend for Named {
        fn name(&self) -> &str {
            self.0
        }

        fn kind(&self) -> &'static crate::plugin::Kind {
            &crate::plugin::DOUBLE
        }

        async fn health(&self) -> Result<()> {
            Ok(())
        }

        fn access_modes(&self) -> Vec<AccessMode> {
            self.1.access_modes.clone()
        }

        fn provisioner(&self) -> Option<&dyn Provisioner> {
            self.1.provision.then_some(self as &dyn Provisioner)
        }

        fn expander(&self) -> Option<&dyn Expander> {
            self.1.expand.then_some(self as &dyn Expander)
        }

        fn attacher(&self) -> Option<&dyn Attacher> {
            self.1.attach.then_some(self as &dyn Attacher)
        }

        fn stager(&self) -> Option<&dyn Stager> {
            self.1.block.then_some(self as &dyn Stager)
        }

        fn device_mounter(&self) -> Option<&dyn DeviceMounter> {
            self.1.block.then_some(self as &dyn DeviceMounter)
        }
    }

    fn never<T>() -> Result<T> {
        Err(Error::internal("not called in these tests"))
    }

    #[async_trait::async_trait]
    impl Provisioner for Named {
        fn clones(&self) -> bool {
            false
        }
        async fn create_volume(&self, _: &CreateVolume) -> Result<VolumeInfo> {
            never()
        }
        async fn delete_volume(&self, _: &VolumeId, _: &Secrets) -> Result<()> {
            never()
        }
        async fn get_volume(&self, _: &VolumeId, _: &Secrets) -> Result<Option<VolumeInfo>> {
            never()
        }
        async fn list_volumes(&self, _: &Page) -> Result<Vec<VolumeInfo>> {
            never()
        }
        async fn capacity(&self, _: &BTreeMap<String, String>) -> Result<Capacity> {
            never()
        }
    }

    #[async_trait::async_trait]
    impl Expander for Named {
        fn online(&self) -> bool {
            self.1.expand_online
        }
        async fn expand_volume(&self, _: &VolumeId, _: u64, _: u64, _: &Secrets) -> Result<u64> {
            never()
        }
    }

    #[async_trait::async_trait]
    impl Attacher for Named {
        async fn controller_attach(
            &self,
            _: &VolumeId,
            _: &ControllerAttach,
        ) -> Result<BTreeMap<String, String>> {
            never()
        }
        async fn controller_detach(
            &self,
            _: &VolumeId,
            _: Option<&str>,
            _: &Secrets,
        ) -> Result<()> {
            never()
        }
    }

    #[async_trait::async_trait]
    impl Stager for Named {
        async fn node_attach(&self, _: &VolumeId, _: &AttachContext) -> Result<Attachment> {
            never()
        }
        async fn node_detach(&self, _: &VolumeId, _: Option<&Attachment>) -> Result<()> {
            never()
        }
    }

    #[async_trait::async_trait]
    impl DeviceMounter for Named {
        async fn node_refresh_size(&self, _: &VolumeId, _: &Attachment) -> Result<u64> {
            never()
        }
    }

    fn named(name: &'static str) -> Arc<dyn Backend> {
        Arc::new(Named(name, Capabilities::default()))
    }

    #[test]
    fn refuses_bad_and_duplicate_names() {
        let mut r = Registry::new();
        r.register(named("file")).unwrap();
        assert!(r
            .register(named("file"))
            .unwrap_err()
            .message
            .contains("twice"));
        for bad in ["File", "a_b", "", "-x", "example.com/x"] {
            assert_eq!(
                r.register(named(bad)).unwrap_err().kind,
                Kind::InvalidArgument,
                "{bad}"
            );
        }
    }

    #[test]
    fn finds_by_parameter_default_and_volume_id() {
        let mut r = Registry::new();
        r.register(named("file")).unwrap();
        let only = r.for_parameters(&BTreeMap::new()).unwrap();
        assert_eq!(only.name(), "file");
        r.register(named("lvm")).unwrap();
        assert_eq!(
            r.for_parameters(&BTreeMap::new()).unwrap_err().kind,
            Kind::InvalidArgument
        );
        r.set_default("lvm").unwrap();
        assert_eq!(r.for_parameters(&BTreeMap::new()).unwrap().name(), "lvm");
        let p = BTreeMap::from([("backend".to_string(), "file".to_string())]);
        assert_eq!(r.for_parameters(&p).unwrap().name(), "file");
        let p = BTreeMap::from([("backend".to_string(), "nfs".to_string())]);
        assert_eq!(
            r.for_parameters(&p).unwrap_err().kind,
            Kind::InvalidArgument
        );
        assert_eq!(
            r.for_volume(&VolumeId::parse("lvm:v1").unwrap())
                .unwrap()
                .name(),
            "lvm"
        );
        assert_eq!(
            r.for_volume(&VolumeId::parse("rbd:v1").unwrap())
                .unwrap_err()
                .kind,
            Kind::NotFound
        );
        assert!(r.set_default("nope").is_err());
    }

    #[test]
    fn capabilities_are_the_union() {
        let mut r = Registry::new();
        let a = Capabilities {
            provision: true,
            access_modes: vec![super::super::AccessMode::SingleNodeWriter],
            ..Default::default()
        };
        let b = Capabilities {
            attach: true,
            block: true,
            ..Default::default()
        };
        r.register(Arc::new(Named("a", a))).unwrap();
        r.register(Arc::new(Named("b", b))).unwrap();
        let c = r.capabilities();
        assert!(c.provision && c.attach && c.block && !c.snapshot);
        assert_eq!(c.access_modes.len(), 1);
    }

    /// Expansion is online when one expanding backend grows volumes in
    /// use; one that grows only unused volumes makes it offline alone, and
    /// a backend that does not expand says nothing of it (its
    /// capabilities cannot say it expands online).
    #[test]
    fn expansion_is_online_if_any_expanding_backend_is() {
        let offline = Capabilities {
            expand: true,
            ..Default::default()
        };
        let online_without_expand = Capabilities {
            expand_online: true,
            ..Default::default()
        };
        let x: Arc<dyn Backend> = Arc::new(Named("x", online_without_expand));
        assert!(!x.capabilities().expand_online);
        let mut r = Registry::new();
        r.register(Arc::new(Named("iscsi", offline.clone())))
            .unwrap();
        r.register(x).unwrap();
        let c = r.capabilities();
        assert!(c.expand && !c.expand_online);
        r.register(Arc::new(Named(
            "rbd",
            Capabilities {
                expand_online: true,
                ..offline
            },
        )))
        .unwrap();
        assert!(r.capabilities().expand_online);
    }
}
