//! The Controller service: each handler validates its request, delegates to
//! the plugin layer's [`ControllerOps`](crate::controller::ControllerOps) (which
//! takes the operation guard), and builds the response.

use super::convert::{self, params};
use super::{respond, respond_hiding, Driver};
use crate::controller::{NewSnapshot, NewVolume};
use crate::error::Error;
use crate::plugin::{AccessMode, ControllerAttach, Secrets};
use crate::proto::{
    self as pb, controller_server::Controller, controller_service_capability as csc,
};
use std::sync::Arc;
use tonic::{Request, Response, Status};

pub struct ControllerService(pub Arc<Driver>);

impl ControllerService {
    /// Whether this controller reports volume health: it makes volumes and
    /// reaches them (a central controller of a node-local driver does not:
    /// their health is the node plugins').
    fn reports_health(&self) -> bool {
        self.0.registry.capabilities().provision && !self.0.volumes_on_nodes
    }

    fn check_reports_health(&self) -> crate::error::Result<()> {
        match self.reports_health() {
            true => Ok(()),
            false => Err(Error::unimplemented(
                "this controller reports no volume health: ask the node plugins (NodeGetVolumeHealth)",
            )),
        }
    }
}

#[tonic::async_trait]
impl Controller for ControllerService {
    async fn create_volume(
        &self,
        request: Request<pb::CreateVolumeRequest>,
    ) -> Result<Response<pb::CreateVolumeResponse>, Status> {
        let r = request.into_inner();
        respond_hiding(&r.name, &r.secrets, async {
            crate::plugin::validate_name("volume", &r.name)?;
            let capabilities = convert::capabilities(&r.volume_capabilities)?;
            let (required_bytes, limit_bytes) = convert::capacity_range(r.capacity_range.as_ref())?;
            if !r.mutable_parameters.is_empty() && !self.0.registry.modifies() {
                return Err(Error::invalid(
                    "mutable_parameters: no configured backend has mutable parameters",
                ));
            }
            let source = convert::content_source(r.volume_content_source.as_ref())?;
            let requisite = r
                .accessibility_requirements
                .as_ref()
                .map(|t| t.requisite.iter().map(|s| s.segments.clone()).collect())
                .unwrap_or_default();
            let placed = self
                .0
                .controller
                .create_volume(NewVolume {
                    name: r.name.clone(),
                    required_bytes,
                    limit_bytes,
                    capabilities,
                    parameters: params(&r.parameters),
                    source,
                    requisite,
                    secrets: Secrets::from(&r.secrets),
                    mutable: params(&r.mutable_parameters),
                })
                .await?;
            Ok(pb::CreateVolumeResponse {
                volume: Some(convert::placed_to_pb(&placed)),
            })
        })
        .await
    }

    async fn delete_volume(
        &self,
        request: Request<pb::DeleteVolumeRequest>,
    ) -> Result<Response<pb::DeleteVolumeResponse>, Status> {
        let r = request.into_inner();
        respond_hiding(&r.volume_id, &r.secrets, async {
            self.0
                .controller
                .delete_volume(&r.volume_id, &Secrets::from(&r.secrets))
                .await?;
            Ok(pb::DeleteVolumeResponse {})
        })
        .await
    }

    async fn controller_publish_volume(
        &self,
        request: Request<pb::ControllerPublishVolumeRequest>,
    ) -> Result<Response<pb::ControllerPublishVolumeResponse>, Status> {
        let r = request.into_inner();
        respond_hiding(&r.volume_id, &r.secrets, async {
            if !self.0.registry.capabilities().attach {
                return Err(Error::unimplemented(
                    "no configured backend attaches volumes to nodes",
                ));
            }
            // Every required field is checked before the id is looked at:
            // a request missing one is invalid whatever volume it names.
            if r.volume_id.is_empty() {
                return Err(Error::invalid("volume_id is required"));
            }
            if r.node_id.is_empty() {
                return Err(Error::invalid("node_id is required"));
            }
            let capability = convert::required_capability(r.volume_capability.as_ref())?;
            let id = convert::volume_id(&r.volume_id)?;
            let limit = self.0.volume_limit_of(&r.node_id).await?;
            let context = self
                .0
                .controller
                .publish(
                    &id,
                    ControllerAttach {
                        node_id: r.node_id.clone(),
                        capability,
                        readonly: r.readonly,
                        volume_context: params(&r.volume_context),
                        secrets: Secrets::from(&r.secrets),
                    },
                    limit,
                )
                .await?;
            Ok(pb::ControllerPublishVolumeResponse {
                publish_context: context.into_iter().collect(),
            })
        })
        .await
    }

    async fn controller_unpublish_volume(
        &self,
        request: Request<pb::ControllerUnpublishVolumeRequest>,
    ) -> Result<Response<pb::ControllerUnpublishVolumeResponse>, Status> {
        let r = request.into_inner();
        respond_hiding(&r.volume_id, &r.secrets, async {
            if !self.0.registry.capabilities().attach {
                return Err(Error::unimplemented(
                    "no configured backend attaches volumes to nodes",
                ));
            }
            if r.volume_id.is_empty() {
                return Err(Error::invalid("volume_id is required"));
            }
            let node = (!r.node_id.is_empty()).then_some(r.node_id.as_str());
            self.0
                .controller
                .unpublish(&r.volume_id, node, &Secrets::from(&r.secrets))
                .await?;
            Ok(pb::ControllerUnpublishVolumeResponse {})
        })
        .await
    }

    async fn validate_volume_capabilities(
        &self,
        request: Request<pb::ValidateVolumeCapabilitiesRequest>,
    ) -> Result<Response<pb::ValidateVolumeCapabilitiesResponse>, Status> {
        let r = request.into_inner();
        respond_hiding(&r.volume_id, &r.secrets, async {
            let id = convert::volume_id(&r.volume_id)?;
            let caps = convert::capabilities(&r.volume_capabilities)?;
            let unsupported = self
                .0
                .controller
                .validate_capabilities(
                    &id,
                    &caps,
                    &params(&r.parameters),
                    &Secrets::from(&r.secrets),
                )
                .await?;
            Ok(match unsupported {
                Some(message) => pb::ValidateVolumeCapabilitiesResponse {
                    confirmed: None,
                    message,
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
        respond("", async {
            let page = self
                .0
                .controller
                .list_volumes(r.max_entries, &r.starting_token)
                .await?;
            Ok(pb::ListVolumesResponse {
                entries: page
                    .entries
                    .iter()
                    .map(|p| pb::list_volumes_response::Entry {
                        volume: Some(convert::placed_to_pb(p)),
                        status: None,
                    })
                    .collect(),
                next_token: page.next_token,
            })
        })
        .await
    }

    async fn get_capacity(
        &self,
        request: Request<pb::GetCapacityRequest>,
    ) -> Result<Response<pb::GetCapacityResponse>, Status> {
        let r = request.into_inner();
        respond("", async {
            let caps: Vec<_> = r
                .volume_capabilities
                .iter()
                .map(convert::capability)
                .collect::<crate::error::Result<_>>()?;
            let c = self
                .0
                .controller
                .capacity(
                    &params(&r.parameters),
                    &caps,
                    r.accessible_topology.as_ref().map(|t| &t.segments),
                )
                .await?;
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
        respond("", async {
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
            if self.reports_health() && self.0.volume_health {
                types.extend([T::ListVolumeHealth, T::GetVolumeHealth]);
            }
            if c.attach {
                types.extend([T::PublishUnpublishVolume, T::PublishReadonly]);
            }
            if self.0.registry.modifies() {
                types.push(T::ModifyVolume);
            }
            if c.snapshot {
                types.extend([T::CreateDeleteSnapshot, T::ListSnapshots, T::GetSnapshot]);
            }
            if c.clone {
                types.push(T::CloneVolume);
            }
            if c.expand && self.0.controller_expansion {
                types.push(T::ExpandVolume);
            }
            if c.access_modes.contains(&AccessMode::SingleNodeMultiWriter) {
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
        respond_hiding(&r.source_volume_id, &r.secrets, async {
            if r.source_volume_id.is_empty() {
                return Err(Error::invalid("source_volume_id is required"));
            }
            crate::plugin::validate_name("snapshot", &r.name)?;
            let source = convert::volume_id(&r.source_volume_id)?;
            let snap = self
                .0
                .controller
                .create_snapshot(NewSnapshot {
                    source,
                    name: r.name.clone(),
                    parameters: params(&r.parameters),
                    secrets: Secrets::from(&r.secrets),
                })
                .await?;
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
        respond_hiding(&r.snapshot_id, &r.secrets, async {
            self.0
                .controller
                .delete_snapshot(&r.snapshot_id, &Secrets::from(&r.secrets))
                .await?;
            Ok(pb::DeleteSnapshotResponse {})
        })
        .await
    }

    async fn list_snapshots(
        &self,
        request: Request<pb::ListSnapshotsRequest>,
    ) -> Result<Response<pb::ListSnapshotsResponse>, Status> {
        let r = request.into_inner();
        respond_hiding(&r.source_volume_id, &r.secrets, async {
            let page = self
                .0
                .controller
                .list_snapshots(
                    &r.snapshot_id,
                    &r.source_volume_id,
                    r.max_entries,
                    &r.starting_token,
                )
                .await?;
            Ok(pb::ListSnapshotsResponse {
                entries: page
                    .entries
                    .iter()
                    .map(|s| pb::list_snapshots_response::Entry {
                        snapshot: Some(convert::snapshot_to_pb(s)),
                    })
                    .collect(),
                next_token: page.next_token,
            })
        })
        .await
    }

    async fn get_snapshot(
        &self,
        request: Request<pb::GetSnapshotRequest>,
    ) -> Result<Response<pb::GetSnapshotResponse>, Status> {
        let r = request.into_inner();
        respond_hiding(&r.snapshot_id, &r.secrets, async {
            let id = convert::snapshot_id(&r.snapshot_id)?;
            let snap = self
                .0
                .controller
                .get_snapshot(&id, &Secrets::from(&r.secrets))
                .await?;
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
        let offered = self.0.controller_expansion;
        respond_hiding(&r.volume_id, &r.secrets, async {
            if !offered {
                return Err(Error::unimplemented(
                    "this driver grows volumes on the node (--no-controller-expansion)",
                ));
            }
            let id = convert::volume_id(&r.volume_id)?;
            let range = r
                .capacity_range
                .as_ref()
                .ok_or_else(|| Error::invalid("capacity_range is required"))?;
            let (required, limit) = convert::capacity_range(Some(range))?;
            let capability = r
                .volume_capability
                .as_ref()
                .map(convert::capability)
                .transpose()?;
            let (size, node_expansion_required) = self
                .0
                .controller
                .expand(
                    &id,
                    required,
                    limit,
                    capability.as_ref(),
                    &Secrets::from(&r.secrets),
                )
                .await?;
            Ok(pb::ControllerExpandVolumeResponse {
                capacity_bytes: size as i64,
                node_expansion_required,
            })
        })
        .await
    }

    async fn controller_get_volume(
        &self,
        request: Request<pb::ControllerGetVolumeRequest>,
    ) -> Result<Response<pb::ControllerGetVolumeResponse>, Status> {
        let r = request.into_inner();
        respond(&r.volume_id, async {
            let id = convert::volume_id(&r.volume_id)?;
            let placed = self.0.controller.get_volume(&id).await?;
            Ok(pb::ControllerGetVolumeResponse {
                volume: Some(convert::placed_to_pb(&placed)),
                status: Some(pb::controller_get_volume_response::VolumeStatus::default()),
            })
        })
        .await
    }

    async fn controller_get_volume_health(
        &self,
        request: Request<pb::ControllerGetVolumeHealthRequest>,
    ) -> Result<Response<pb::ControllerGetVolumeHealthResponse>, Status> {
        let r = request.into_inner();
        respond_hiding(&r.volume_id, &r.secrets, async {
            self.check_reports_health()?;
            if r.volume_id.is_empty() {
                return Err(Error::invalid("volume_id is required"));
            }
            let id = convert::volume_id(&r.volume_id)?;
            let secrets = crate::plugin::Secrets::from(&r.secrets);
            let findings = self.0.controller.volume_health(&id, &secrets).await?;
            Ok(pb::ControllerGetVolumeHealthResponse {
                volume_health: Some(convert::volume_health_to_pb(&r.volume_id, &findings)),
            })
        })
        .await
    }

    async fn controller_list_volume_health(
        &self,
        request: Request<pb::ControllerListVolumeHealthRequest>,
    ) -> Result<Response<pb::ControllerListVolumeHealthResponse>, Status> {
        let r = request.into_inner();
        respond_hiding("", &r.secrets, async {
            self.check_reports_health()?;
            let secrets = crate::plugin::Secrets::from(&r.secrets);
            let listing = self
                .0
                .controller
                .list_volume_health(r.max_entries, &r.starting_token, &secrets)
                .await?;
            Ok(pb::ControllerListVolumeHealthResponse {
                entries: listing
                    .entries
                    .iter()
                    .map(|(id, found)| convert::volume_health_to_pb(&id.to_string(), found))
                    .collect(),
                next_token: listing.next_token,
            })
        })
        .await
    }

    async fn controller_modify_volume(
        &self,
        request: Request<pb::ControllerModifyVolumeRequest>,
    ) -> Result<Response<pb::ControllerModifyVolumeResponse>, Status> {
        let r = request.into_inner();
        respond_hiding(&r.volume_id, &r.secrets, async {
            if !self.0.registry.modifies() {
                return Err(Error::unimplemented("no backend has mutable parameters"));
            }
            if r.volume_id.is_empty() {
                return Err(Error::invalid("volume_id is required"));
            }
            let id = convert::volume_id(&r.volume_id)?;
            if self.0.volumes_on_nodes {
                return self
                    .0
                    .controller
                    .relay_limits(&id, &params(&r.mutable_parameters))
                    .await
                    .map(|()| pb::ControllerModifyVolumeResponse {});
            }
            self.0
                .controller
                .modify_volume(
                    &id,
                    &params(&r.mutable_parameters),
                    &Secrets::from(&r.secrets),
                )
                .await?;
            Ok(pb::ControllerModifyVolumeResponse {})
        })
        .await
    }
}
