//! The Identity service.

use super::{respond, Driver};
use crate::proto::{self as pb, identity_server::Identity, plugin_capability as pc};
use std::sync::Arc;
use tonic::{Request, Response, Status};

pub struct IdentityService(pub Arc<Driver>);

fn service(t: pc::service::Type) -> pb::PluginCapability {
    pb::PluginCapability {
        r#type: Some(pc::Type::Service(pc::Service { r#type: t as i32 })),
    }
}

#[tonic::async_trait]
impl Identity for IdentityService {
    async fn get_plugin_info(
        &self,
        _: Request<pb::GetPluginInfoRequest>,
    ) -> Result<Response<pb::GetPluginInfoResponse>, Status> {
        let d = &self.0;
        respond("", async {
            Ok(pb::GetPluginInfoResponse {
                name: d.name.clone(),
                vendor_version: d.version.clone(),
                manifest: Default::default(),
            })
        })
        .await
    }

    async fn get_plugin_capabilities(
        &self,
        _: Request<pb::GetPluginCapabilitiesRequest>,
    ) -> Result<Response<pb::GetPluginCapabilitiesResponse>, Status> {
        let caps = self.0.registry.capabilities();
        respond("", async {
            // The same set from every instance, whatever its mode.
            let mut out = vec![service(pc::service::Type::ControllerService)];
            if caps.node_local {
                out.push(service(pc::service::Type::VolumeAccessibilityConstraints));
            }
            // Group snapshots are answered wherever snapshots are: a backend
            // that cannot take them at one instant says why.
            if caps.snapshot {
                out.push(service(pc::service::Type::GroupControllerService));
            }
            if caps.snapshot_metadata {
                out.push(service(pc::service::Type::SnapshotMetadataService));
            }
            if caps.expand {
                // ONLINE when any backend grows volumes in use; a backend
                // that cannot still refuses those with FAILED_PRECONDITION.
                let when = if caps.expand_online {
                    pc::volume_expansion::Type::Online
                } else {
                    pc::volume_expansion::Type::Offline
                };
                out.push(pb::PluginCapability {
                    r#type: Some(pc::Type::VolumeExpansion(pc::VolumeExpansion {
                        r#type: when as i32,
                    })),
                });
            }
            Ok(pb::GetPluginCapabilitiesResponse { capabilities: out })
        })
        .await
    }

    async fn probe(
        &self,
        _: Request<pb::ProbeRequest>,
    ) -> Result<Response<pb::ProbeResponse>, Status> {
        let driver = self.0.clone();
        respond("", async move {
            driver.health().await?;
            Ok(pb::ProbeResponse { ready: Some(true) })
        })
        .await
    }
}
