//! The Controller service.

use super::convert::{self, params};
use super::{traced, Driver};
use crate::error::{Error, Kind, Result};
use crate::plugin::{CreateVolume, SnapshotInfo, VolumeId};
use crate::proto::{
    self as pb, controller_server::Controller, controller_service_capability as csc,
};
use std::collections::HashMap;
use std::sync::Arc;
use tonic::{Request, Response, Status};

pub struct ControllerService(pub Arc<Driver>);

/// Parameters every CO may add, which backends ignore.
const CO_PARAMETER_PREFIX: &str = "csi.storage.k8s.io/";

/// The parameters a backend sees: without the `backend` selector and the
/// CO's own keys.
fn backend_parameters(
    p: &std::collections::BTreeMap<String, String>,
) -> std::collections::BTreeMap<String, String> {
    p.iter()
        .filter(|(k, _)| k.as_str() != "backend" && !k.starts_with(CO_PARAMETER_PREFIX))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

fn topology_matches(
    requirement: Option<&pb::TopologyRequirement>,
    ours: &HashMap<String, String>,
) -> bool {
    let Some(req) = requirement else { return true };
    let fits = |t: &pb::Topology| t.segments.iter().all(|(k, v)| ours.get(k) == Some(v));
    if !req.requisite.is_empty() {
        return req.requisite.iter().any(fits);
    }
    true
}

impl ControllerService {
    fn topology_for(&self, node_local: bool) -> Option<HashMap<String, String>> {
        node_local.then(|| self.0.topology())
    }

    async fn find_snapshot(&self, id: &crate::plugin::SnapshotId) -> Result<Option<SnapshotInfo>> {
        let Some(backend) = self.0.registry.get(id.backend()) else {
            return Ok(None);
        };
        Ok(backend
            .list_snapshots()
            .await?
            .into_iter()
            .find(|s| &s.id == id))
    }
}

#[tonic::async_trait]
impl Controller for ControllerService {
    async fn create_volume(
        &self,
        request: Request<pb::CreateVolumeRequest>,
    ) -> Result<Response<pb::CreateVolumeResponse>, Status> {
        let r = request.into_inner();
        traced(&self.0, "CreateVolume", &r.name, async {
            crate::plugin::validate_name("volume", &r.name)?;
            let caps = convert::capabilities(&r.volume_capabilities)?;
            let (required, limit) = convert::capacity_range(r.capacity_range.as_ref())?;
            let parameters = params(&r.parameters);
            if !r.mutable_parameters.is_empty() {
                return Err(Error::invalid("mutable_parameters are not supported"));
            }
            let source = convert::content_source(r.volume_content_source.as_ref())?;
            let backend = self.0.registry.for_parameters(&parameters)?.clone();
            let parameters = backend_parameters(&parameters);
            backend.validate_parameters(&parameters)?;
            let bc = backend.capabilities();
            if !bc.provision {
                return Err(backend.unimplemented("create volumes"));
            }
            for cap in &caps {
                backend.supports(cap)?;
            }
            match &source {
                Some(crate::plugin::ContentSource::Snapshot(_)) if !bc.snapshot => {
                    return Err(Error::invalid(format!(
                        "backend {} cannot create volumes from snapshots",
                        backend.name()
                    )))
                }
                Some(crate::plugin::ContentSource::Volume(_)) if !bc.clone => {
                    return Err(Error::invalid(format!(
                        "backend {} cannot clone volumes",
                        backend.name()
                    )))
                }
                _ => {}
            }
            let topology = self.topology_for(bc.node_local);
            if let Some(t) = &topology {
                if !topology_matches(r.accessibility_requirements.as_ref(), t) {
                    return Err(Error::exhausted(format!(
                        "volumes of backend {} live on node {}, which no requisite topology names",
                        backend.name(),
                        self.0.node_id
                    )));
                }
            }
            let _guard = self
                .0
                .controller_locks
                .try_exclusive(&[format!("volume name {}", r.name)])?;
            let info = backend
                .create_volume(&CreateVolume {
                    name: r.name.clone(),
                    required_bytes: required,
                    limit_bytes: limit,
                    capabilities: caps,
                    parameters,
                    source,
                })
                .await?;
            Ok(pb::CreateVolumeResponse {
                volume: Some(convert::volume_to_pb(&info, topology.as_ref())),
            })
        })
        .await
    }

    async fn delete_volume(
        &self,
        request: Request<pb::DeleteVolumeRequest>,
    ) -> Result<Response<pb::DeleteVolumeResponse>, Status> {
        let r = request.into_inner();
        traced(&self.0, "DeleteVolume", &r.volume_id, async {
            let id = match convert::volume_id(&r.volume_id) {
                Ok(id) => id,
                // An id that cannot be ours names no volume: deleting it is done.
                Err(e) if e.kind == Kind::NotFound => return Ok(pb::DeleteVolumeResponse {}),
                Err(e) => return Err(e),
            };
            let Some(backend) = self.0.registry.get(id.backend()).cloned() else {
                return Ok(pb::DeleteVolumeResponse {});
            };
            let _guard = self
                .0
                .controller_locks
                .try_exclusive(&[format!("volume {id}")])?;
            backend.delete_volume(&id).await?;
            Ok(pb::DeleteVolumeResponse {})
        })
        .await
    }

    async fn controller_publish_volume(
        &self,
        request: Request<pb::ControllerPublishVolumeRequest>,
    ) -> Result<Response<pb::ControllerPublishVolumeResponse>, Status> {
        let r = request.into_inner();
        traced(&self.0, "ControllerPublishVolume", &r.volume_id, async {
            if !self.0.registry.capabilities().attach {
                return Err(Error::unimplemented(
                    "no configured backend attaches volumes to nodes",
                ));
            }
            let id = convert::volume_id(&r.volume_id)?;
            if r.node_id.is_empty() {
                return Err(Error::invalid("node_id is required"));
            }
            let cap = convert::required_capability(r.volume_capability.as_ref())?;
            let backend = self.0.registry.for_volume(&id)?.clone();
            backend.supports(&cap)?;
            let _guard = self
                .0
                .controller_locks
                .try_exclusive(&[format!("volume {id}")])?;
            if backend.get_volume(&id).await?.is_none() {
                return Err(Error::not_found(format!("volume {id} does not exist")));
            }
            let ctx = backend
                .controller_attach(&id, &r.node_id, r.readonly)
                .await?;
            Ok(pb::ControllerPublishVolumeResponse {
                publish_context: ctx.into_iter().collect(),
            })
        })
        .await
    }

    async fn controller_unpublish_volume(
        &self,
        request: Request<pb::ControllerUnpublishVolumeRequest>,
    ) -> Result<Response<pb::ControllerUnpublishVolumeResponse>, Status> {
        let r = request.into_inner();
        traced(&self.0, "ControllerUnpublishVolume", &r.volume_id, async {
            if !self.0.registry.capabilities().attach {
                return Err(Error::unimplemented(
                    "no configured backend attaches volumes to nodes",
                ));
            }
            let id = convert::volume_id(&r.volume_id)?;
            let backend = self.0.registry.for_volume(&id)?.clone();
            let _guard = self
                .0
                .controller_locks
                .try_exclusive(&[format!("volume {id}")])?;
            let node = (!r.node_id.is_empty()).then_some(r.node_id.as_str());
            backend.controller_detach(&id, node).await?;
            Ok(pb::ControllerUnpublishVolumeResponse {})
        })
        .await
    }

    async fn validate_volume_capabilities(
        &self,
        request: Request<pb::ValidateVolumeCapabilitiesRequest>,
    ) -> Result<Response<pb::ValidateVolumeCapabilitiesResponse>, Status> {
        let r = request.into_inner();
        traced(&self.0, "ValidateVolumeCapabilities", &r.volume_id, async {
            let id = convert::volume_id(&r.volume_id)?;
            let caps = convert::capabilities(&r.volume_capabilities)?;
            let backend = self.0.registry.for_volume(&id)?.clone();
            if backend.get_volume(&id).await?.is_none() {
                return Err(Error::not_found(format!("volume {id} does not exist")));
            }
            let parameters = backend_parameters(&params(&r.parameters));
            let unsupported = caps
                .iter()
                .map(|c| backend.supports(c))
                .chain(std::iter::once(backend.validate_parameters(&parameters)))
                .find_map(Result::err);
            Ok(match unsupported {
                Some(e) => pb::ValidateVolumeCapabilitiesResponse {
                    confirmed: None,
                    message: e.message,
                },
                None => pb::ValidateVolumeCapabilitiesResponse {
                    confirmed: Some(pb::validate_volume_capabilities_response::Confirmed {
                        volume_context: r.volume_context.clone(),
                        volume_capabilities: r.volume_capabilities.clone(),
                        parameters: r.parameters.clone(),
                        mutable_parameters: Default::default(),
                    }),
                    message: String::new(),
                },
            })
        })
        .await
    }

    async fn list_volumes(
        &self,
        request: Request<pb::ListVolumesRequest>,
    ) -> Result<Response<pb::ListVolumesResponse>, Status> {
        let r = request.into_inner();
        traced(&self.0, "ListVolumes", "", async {
            let mut all = Vec::new();
            for b in self.0.registry.all() {
                if b.capabilities().provision {
                    let node_local = b.capabilities().node_local;
                    all.extend(b.list_volumes().await?.into_iter().map(|v| (v, node_local)));
                }
            }
            let (page, next) = convert::paginate(
                all,
                |(v, _)| v.id.to_string(),
                r.max_entries,
                &r.starting_token,
            )?;
            let entries = page
                .iter()
                .map(|(v, local)| pb::list_volumes_response::Entry {
                    volume: Some(convert::volume_to_pb(v, self.topology_for(*local).as_ref())),
                    status: None,
                })
                .collect();
            Ok(pb::ListVolumesResponse {
                entries,
                next_token: next,
            })
        })
        .await
    }

    async fn get_capacity(
        &self,
        request: Request<pb::GetCapacityRequest>,
    ) -> Result<Response<pb::GetCapacityResponse>, Status> {
        let r = request.into_inner();
        traced(&self.0, "GetCapacity", "", async {
            let parameters = params(&r.parameters);
            let backend = self.0.registry.for_parameters(&parameters)?.clone();
            let parameters = backend_parameters(&parameters);
            backend.validate_parameters(&parameters)?;
            let caps: Vec<_> = r
                .volume_capabilities
                .iter()
                .map(convert::capability)
                .collect::<Result<_>>()?;
            let served = caps.iter().all(|c| backend.supports(c).is_ok());
            let here = match (&r.accessible_topology, backend.capabilities().node_local) {
                (Some(t), true) => {
                    let ours = self.0.topology();
                    t.segments.iter().all(|(k, v)| ours.get(k) == Some(v))
                }
                _ => true,
            };
            if !served || !here {
                return Ok(pb::GetCapacityResponse {
                    available_capacity: 0,
                    maximum_volume_size: Some(0),
                    minimum_volume_size: None,
                });
            }
            let c = backend.capacity(&parameters).await?;
            Ok(pb::GetCapacityResponse {
                available_capacity: c.available_bytes as i64,
                maximum_volume_size: c.maximum_volume_bytes.map(|v| v as i64),
                minimum_volume_size: c.minimum_volume_bytes.map(|v| v as i64),
            })
        })
        .await
    }

    async fn controller_get_capabilities(
        &self,
        _: Request<pb::ControllerGetCapabilitiesRequest>,
    ) -> Result<Response<pb::ControllerGetCapabilitiesResponse>, Status> {
        let c = self.0.registry.capabilities();
        traced(&self.0, "ControllerGetCapabilities", "", async {
            use csc::rpc::Type as T;
            let mut types = Vec::new();
            if c.provision {
                types.extend([
                    T::CreateDeleteVolume,
                    T::ListVolumes,
                    T::GetCapacity,
                    T::GetVolume,
                ]);
            }
            if c.attach {
                types.extend([T::PublishUnpublishVolume, T::PublishReadonly]);
            }
            if c.snapshot {
                types.extend([T::CreateDeleteSnapshot, T::ListSnapshots, T::GetSnapshot]);
            }
            if c.clone {
                types.push(T::CloneVolume);
            }
            if c.expand {
                types.push(T::ExpandVolume);
            }
            if c.access_modes
                .contains(&crate::plugin::AccessMode::SingleNodeMultiWriter)
            {
                types.push(T::SingleNodeMultiWriter);
            }
            let capabilities = types
                .into_iter()
                .map(|t| pb::ControllerServiceCapability {
                    r#type: Some(csc::Type::Rpc(csc::Rpc { r#type: t as i32 })),
                })
                .collect();
            Ok(pb::ControllerGetCapabilitiesResponse { capabilities })
        })
        .await
    }

    async fn create_snapshot(
        &self,
        request: Request<pb::CreateSnapshotRequest>,
    ) -> Result<Response<pb::CreateSnapshotResponse>, Status> {
        let r = request.into_inner();
        traced(&self.0, "CreateSnapshot", &r.source_volume_id, async {
            if r.source_volume_id.is_empty() {
                return Err(Error::invalid("source_volume_id is required"));
            }
            crate::plugin::validate_name("snapshot", &r.name)?;
            if !r.parameters.is_empty() {
                return Err(Error::invalid("snapshot parameters are not supported"));
            }
            let source = convert::volume_id(&r.source_volume_id)?;
            let backend = self.0.registry.for_volume(&source)?.clone();
            if !backend.capabilities().snapshot {
                return Err(backend.unimplemented("take snapshots"));
            }
            let _guard = self
                .0
                .controller_locks
                .try_exclusive(&[format!("snapshot name {}", r.name)])?;
            let snap = backend.create_snapshot(&source, &r.name).await?;
            Ok(pb::CreateSnapshotResponse {
                snapshot: Some(convert::snapshot_to_pb(&snap)),
            })
        })
        .await
    }

    async fn delete_snapshot(
        &self,
        request: Request<pb::DeleteSnapshotRequest>,
    ) -> Result<Response<pb::DeleteSnapshotResponse>, Status> {
        let r = request.into_inner();
        traced(&self.0, "DeleteSnapshot", &r.snapshot_id, async {
            let id = match convert::snapshot_id(&r.snapshot_id) {
                Ok(id) => id,
                Err(e) if e.kind == Kind::NotFound => return Ok(pb::DeleteSnapshotResponse {}),
                Err(e) => return Err(e),
            };
            let Some(backend) = self.0.registry.get(id.backend()).cloned() else {
                return Ok(pb::DeleteSnapshotResponse {});
            };
            let _guard = self
                .0
                .controller_locks
                .try_exclusive(&[format!("snapshot {id}")])?;
            backend.delete_snapshot(&id).await?;
            Ok(pb::DeleteSnapshotResponse {})
        })
        .await
    }

    async fn list_snapshots(
        &self,
        request: Request<pb::ListSnapshotsRequest>,
    ) -> Result<Response<pb::ListSnapshotsResponse>, Status> {
        let r = request.into_inner();
        traced(&self.0, "ListSnapshots", &r.source_volume_id, async {
            let mut all = Vec::new();
            if !r.snapshot_id.is_empty() {
                // One snapshot: an id that cannot be ours matches nothing.
                if let Ok(id) = convert::snapshot_id(&r.snapshot_id) {
                    all.extend(self.find_snapshot(&id).await?);
                }
            } else {
                for b in self.0.registry.all() {
                    if b.capabilities().snapshot {
                        all.extend(b.list_snapshots().await?);
                    }
                }
            }
            if !r.source_volume_id.is_empty() {
                let source = VolumeId::parse(&r.source_volume_id).ok();
                all.retain(|s| Some(&s.source_volume) == source.as_ref());
            }
            let (page, next) =
                convert::paginate(all, |s| s.id.to_string(), r.max_entries, &r.starting_token)?;
            let entries = page
                .iter()
                .map(|s| pb::list_snapshots_response::Entry {
                    snapshot: Some(convert::snapshot_to_pb(s)),
                })
                .collect();
            Ok(pb::ListSnapshotsResponse {
                entries,
                next_token: next,
            })
        })
        .await
    }

    async fn get_snapshot(
        &self,
        request: Request<pb::GetSnapshotRequest>,
    ) -> Result<Response<pb::GetSnapshotResponse>, Status> {
        let r = request.into_inner();
        traced(&self.0, "GetSnapshot", &r.snapshot_id, async {
            let id = convert::snapshot_id(&r.snapshot_id)?;
            let snap = self
                .find_snapshot(&id)
                .await?
                .ok_or_else(|| Error::not_found(format!("snapshot {id} does not exist")))?;
            Ok(pb::GetSnapshotResponse {
                snapshot: Some(convert::snapshot_to_pb(&snap)),
            })
        })
        .await
    }

    async fn controller_expand_volume(
        &self,
        request: Request<pb::ControllerExpandVolumeRequest>,
    ) -> Result<Response<pb::ControllerExpandVolumeResponse>, Status> {
        let r = request.into_inner();
        traced(&self.0, "ControllerExpandVolume", &r.volume_id, async {
            let id = convert::volume_id(&r.volume_id)?;
            let range = r
                .capacity_range
                .as_ref()
                .ok_or_else(|| Error::invalid("capacity_range is required"))?;
            let (required, limit) = convert::capacity_range(Some(range))?;
            let backend = self.0.registry.for_volume(&id)?.clone();
            if !backend.capabilities().expand {
                return Err(backend.unimplemented("expand volumes"));
            }
            if let Some(cap) = &r.volume_capability {
                backend.supports(&convert::capability(cap)?)?;
            }
            let _guard = self
                .0
                .controller_locks
                .try_exclusive(&[format!("volume {id}")])?;
            let size = backend.expand_volume(&id, required, limit).await?;
            // Devices on the node must learn the new size (and filesystems
            // grow), so the node step is always wanted.
            Ok(pb::ControllerExpandVolumeResponse {
                capacity_bytes: size as i64,
                node_expansion_required: backend.capabilities().device_mount,
            })
        })
        .await
    }

    async fn controller_get_volume(
        &self,
        request: Request<pb::ControllerGetVolumeRequest>,
    ) -> Result<Response<pb::ControllerGetVolumeResponse>, Status> {
        let r = request.into_inner();
        traced(&self.0, "ControllerGetVolume", &r.volume_id, async {
            let id = convert::volume_id(&r.volume_id)?;
            let backend = self.0.registry.for_volume(&id)?.clone();
            let info = backend
                .get_volume(&id)
                .await?
                .ok_or_else(|| Error::not_found(format!("volume {id} does not exist")))?;
            let topology = self.topology_for(backend.capabilities().node_local);
            Ok(pb::ControllerGetVolumeResponse {
                volume: Some(convert::volume_to_pb(&info, topology.as_ref())),
                status: Some(pb::controller_get_volume_response::VolumeStatus::default()),
            })
        })
        .await
    }

    async fn controller_modify_volume(
        &self,
        request: Request<pb::ControllerModifyVolumeRequest>,
    ) -> Result<Response<pb::ControllerModifyVolumeResponse>, Status> {
        let r = request.into_inner();
        traced(&self.0, "ControllerModifyVolume", &r.volume_id, async {
            Err::<pb::ControllerModifyVolumeResponse, _>(Error::unimplemented(
                "no backend has mutable parameters",
            ))
        })
        .await
    }
}
