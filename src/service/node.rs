//! The Node service.

use super::convert;
use super::{respond, respond_hiding, Driver};
use crate::error::Error;
use crate::node::{paths, PublishRequest, StageRequest};
use crate::plugin::AttachContext;
use crate::proto::{self as pb, node_server::Node, node_service_capability as nsc};
use std::sync::Arc;
use tonic::{Request, Response, Status};

pub struct NodeService(pub Arc<Driver>);

fn ordered(
    map: &std::collections::HashMap<String, String>,
) -> std::collections::BTreeMap<String, String> {
    convert::params(map)
}

#[tonic::async_trait]
impl Node for NodeService {
    async fn node_stage_volume(
        &self,
        request: Request<pb::NodeStageVolumeRequest>,
    ) -> Result<Response<pb::NodeStageVolumeResponse>, Status> {
        let r = request.into_inner();
        respond_hiding(&r.volume_id, &r.secrets, async {
            if r.volume_id.is_empty() {
                return Err(Error::invalid("volume_id is required"));
            }
            let staging_path = paths::validate(&r.staging_target_path, "staging_target_path")?;
            let capability = convert::required_capability(r.volume_capability.as_ref())?;
            let volume_id = convert::volume_id(&r.volume_id)?;
            let ctx = AttachContext {
                publish_context: ordered(&r.publish_context),
                volume_context: ordered(&r.volume_context),
                secrets: crate::plugin::Secrets::from(&r.secrets),
                readonly: capability.mode.is_readonly()
                    || crate::plugin::published_read_only(|k| r.publish_context.get(k)),
                node_id: self.0.node_id.clone(),
            };
            self.0
                .node
                .stage(StageRequest {
                    volume_id,
                    staging_path,
                    capability,
                    ctx,
                })
                .await?;
            Ok(pb::NodeStageVolumeResponse {})
        })
        .await
    }

    async fn node_unstage_volume(
        &self,
        request: Request<pb::NodeUnstageVolumeRequest>,
    ) -> Result<Response<pb::NodeUnstageVolumeResponse>, Status> {
        let r = request.into_inner();
        respond(&r.volume_id, async {
            if r.volume_id.is_empty() {
                return Err(Error::invalid("volume_id is required"));
            }
            let staging_path = paths::validate(&r.staging_target_path, "staging_target_path")?;
            let volume_id = convert::volume_id(&r.volume_id)?;
            self.0.node.unstage(&volume_id, &staging_path).await?;
            Ok(pb::NodeUnstageVolumeResponse {})
        })
        .await
    }

    async fn node_publish_volume(
        &self,
        request: Request<pb::NodePublishVolumeRequest>,
    ) -> Result<Response<pb::NodePublishVolumeResponse>, Status> {
        let r = request.into_inner();
        respond_hiding(&r.volume_id, &r.secrets, async {
            if r.volume_id.is_empty() {
                return Err(Error::invalid("volume_id is required"));
            }
            let target_path = paths::validate(&r.target_path, "target_path")?;
            let capability = convert::required_capability(r.volume_capability.as_ref())?;
            if r.staging_target_path.is_empty() {
                return Err(Error::precondition(
                    "staging_target_path is required: stage the volume first",
                ));
            }
            let staging_path = paths::validate(&r.staging_target_path, "staging_target_path")?;
            let volume_id = convert::volume_id(&r.volume_id)?;
            self.0
                .node
                .publish(PublishRequest {
                    volume_id,
                    staging_path,
                    target_path,
                    capability,
                    readonly: r.readonly
                        || crate::plugin::published_read_only(|k| r.publish_context.get(k)),
                    secrets: crate::plugin::Secrets::from(&r.secrets),
                    io: crate::node::IoPublish {
                        limits: crate::host::iolimit::Limits::from_context(&r.volume_context)?,
                        pod_uid: r
                            .volume_context
                            .get(crate::host::iolimit::POD_UID_KEY)
                            .cloned(),
                    },
                })
                .await?;
            Ok(pb::NodePublishVolumeResponse {})
        })
        .await
    }

    async fn node_unpublish_volume(
        &self,
        request: Request<pb::NodeUnpublishVolumeRequest>,
    ) -> Result<Response<pb::NodeUnpublishVolumeResponse>, Status> {
        let r = request.into_inner();
        respond(&r.volume_id, async {
            if r.volume_id.is_empty() {
                return Err(Error::invalid("volume_id is required"));
            }
            let target = paths::validate(&r.target_path, "target_path")?;
            let volume_id = convert::volume_id(&r.volume_id)?;
            self.0.node.unpublish(&volume_id, &target).await?;
            Ok(pb::NodeUnpublishVolumeResponse {})
        })
        .await
    }

    async fn node_get_volume_stats(
        &self,
        request: Request<pb::NodeGetVolumeStatsRequest>,
    ) -> Result<Response<pb::NodeGetVolumeStatsResponse>, Status> {
        let r = request.into_inner();
        respond(&r.volume_id, async {
            if r.volume_id.is_empty() {
                return Err(Error::invalid("volume_id is required"));
            }
            if r.volume_path.is_empty() {
                return Err(Error::invalid("volume_path is required"));
            }
            // An unknown volume is NOT_FOUND whatever the path looks like:
            // the path is only compared with where the volume is.
            let volume_id = convert::volume_id(&r.volume_id)?;
            let s = self.0.node.stats(&volume_id, &r.volume_path).await?;
            use pb::volume_usage::Unit;
            let mut usage = vec![pb::VolumeUsage {
                available: s.available_bytes.unwrap_or(0) as i64,
                total: s.total_bytes as i64,
                used: s.used_bytes.unwrap_or(0) as i64,
                unit: Unit::Bytes as i32,
            }];
            if let (Some(total), Some(free)) = (s.total_inodes, s.free_inodes) {
                usage.push(pb::VolumeUsage {
                    available: free as i64,
                    total: total as i64,
                    used: total.saturating_sub(free) as i64,
                    unit: Unit::Inodes as i32,
                });
            }
            // The limits in force ride on the condition's message: CSI's
            // stats have no place of their own for them.
            let mut condition = convert::condition_to_pb(&s.health);
            if let Some(limits) = &s.io_limits {
                condition.message = format!("{}; {limits}", condition.message);
            }
            Ok(pb::NodeGetVolumeStatsResponse {
                usage,
                volume_condition: Some(condition),
            })
        })
        .await
    }

    async fn node_expand_volume(
        &self,
        request: Request<pb::NodeExpandVolumeRequest>,
    ) -> Result<Response<pb::NodeExpandVolumeResponse>, Status> {
        let r = request.into_inner();
        respond_hiding(&r.volume_id, &r.secrets, async {
            if r.volume_id.is_empty() {
                return Err(Error::invalid("volume_id is required"));
            }
            if r.volume_path.is_empty() {
                return Err(Error::invalid("volume_path is required"));
            }
            let (required, limit) = convert::capacity_range(r.capacity_range.as_ref())?;
            if let Some(cap) = &r.volume_capability {
                convert::capability(cap)?;
            }
            let volume_id = convert::volume_id(&r.volume_id)?;
            let size = self
                .0
                .node
                .expand(&volume_id, &r.volume_path, required, limit)
                .await?;
            Ok(pb::NodeExpandVolumeResponse {
                capacity_bytes: size as i64,
            })
        })
        .await
    }

    async fn node_get_capabilities(
        &self,
        _: Request<pb::NodeGetCapabilitiesRequest>,
    ) -> Result<Response<pb::NodeGetCapabilitiesResponse>, Status> {
        let c = self.0.registry.capabilities();
        respond("", async {
            use nsc::rpc::Type as T;
            // v1.12's callers read the condition in NodeGetVolumeStats;
            // v1.13's call NodeGetVolumeHealth. Both come from one place.
            #[allow(deprecated)]
            let condition = T::VolumeCondition;
            let mut types = vec![T::StageUnstageVolume, T::GetVolumeStats, condition];
            if self.0.volume_health {
                types.extend([T::GetVolumeHealth, T::StorageHealth]);
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
                .map(|t| pb::NodeServiceCapability {
                    r#type: Some(nsc::Type::Rpc(nsc::Rpc { r#type: t as i32 })),
                })
                .collect();
            Ok(pb::NodeGetCapabilitiesResponse { capabilities })
        })
        .await
    }

    async fn node_get_volume_health(
        &self,
        request: Request<pb::NodeGetVolumeHealthRequest>,
    ) -> Result<Response<pb::NodeGetVolumeHealthResponse>, Status> {
        let r = request.into_inner();
        respond(&r.volume_id, async {
            if r.volume_id.is_empty() {
                return Err(Error::invalid("volume_id is required"));
            }
            let volume_id = convert::volume_id(&r.volume_id)?;
            let findings = self
                .0
                .node
                .volume_health(&volume_id, &r.volume_publish_path, &r.staging_target_path)
                .await?;
            Ok(pb::NodeGetVolumeHealthResponse {
                volume_health: Some(convert::volume_health_to_pb(&r.volume_id, &findings)),
            })
        })
        .await
    }

    async fn node_get_storage_health(
        &self,
        request: Request<pb::NodeGetStorageHealthRequest>,
    ) -> Result<Response<pb::NodeGetStorageHealthResponse>, Status> {
        let r = request.into_inner();
        respond_hiding("", &r.secrets, async {
            let findings = self.0.node.storage_health().await;
            Ok(pb::NodeGetStorageHealthResponse {
                backend_health: convert::storage_health_to_pb(&findings),
            })
        })
        .await
    }

    async fn node_get_info(
        &self,
        _: Request<pb::NodeGetInfoRequest>,
    ) -> Result<Response<pb::NodeGetInfoResponse>, Status> {
        let d = &self.0;
        respond("", async {
            let topology = d.registry.capabilities().node_local.then(|| pb::Topology {
                segments: d.topology(),
            });
            Ok(pb::NodeGetInfoResponse {
                node_id: d.node_id.clone(),
                max_volumes_per_node: d.node.volume_limit(d.settings.max_volumes_per_node).await?,
                accessible_topology: topology,
            })
        })
        .await
    }
}
