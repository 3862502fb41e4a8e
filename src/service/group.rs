//! The GroupController service: group snapshots, delegated to the plugin
//! layer's [`ControllerOps`](crate::controller::ControllerOps).

use super::convert::{self, params};
use super::{respond, respond_hiding, Driver};
use crate::controller::NewGroupSnapshot;
use crate::error::Error;
use crate::plugin::{Secrets, VolumeId};
use crate::proto::{
    self as pb, group_controller_server::GroupController,
    group_controller_service_capability as gsc,
};
use std::sync::Arc;
use tonic::{Request, Response, Status};

pub struct GroupControllerService(pub Arc<Driver>);

#[tonic::async_trait]
impl GroupController for GroupControllerService {
    async fn group_controller_get_capabilities(
        &self,
        _: Request<pb::GroupControllerGetCapabilitiesRequest>,
    ) -> Result<Response<pb::GroupControllerGetCapabilitiesResponse>, Status> {
        let served = self.0.controller.groups_served();
        respond("", async {
            let capabilities = served
                .then_some(pb::GroupControllerServiceCapability {
                    r#type: Some(gsc::Type::Rpc(gsc::Rpc {
                        r#type: gsc::rpc::Type::CreateDeleteGetVolumeGroupSnapshot as i32,
                    })),
                })
                .into_iter()
                .collect();
            Ok(pb::GroupControllerGetCapabilitiesResponse { capabilities })
        })
        .await
    }

    async fn create_volume_group_snapshot(
        &self,
        request: Request<pb::CreateVolumeGroupSnapshotRequest>,
    ) -> Result<Response<pb::CreateVolumeGroupSnapshotResponse>, Status> {
        let r = request.into_inner();
        respond_hiding(&r.name, &r.secrets, async {
            crate::plugin::validate_name("group snapshot", &r.name)?;
            if r.source_volume_ids.is_empty() {
                return Err(Error::invalid("source_volume_ids is required"));
            }
            let sources = r
                .source_volume_ids
                .iter()
                .map(|v| VolumeId::parse(v))
                .collect::<crate::error::Result<Vec<_>>>()?;
            let group = self
                .0
                .controller
                .create_group_snapshot(NewGroupSnapshot {
                    name: r.name.clone(),
                    sources,
                    parameters: params(&r.parameters),
                    secrets: Secrets::from(&r.secrets),
                })
                .await?;
            Ok(pb::CreateVolumeGroupSnapshotResponse {
                group_snapshot: Some(convert::group_snapshot_to_pb(&group)),
            })
        })
        .await
    }

    async fn delete_volume_group_snapshot(
        &self,
        request: Request<pb::DeleteVolumeGroupSnapshotRequest>,
    ) -> Result<Response<pb::DeleteVolumeGroupSnapshotResponse>, Status> {
        let r = request.into_inner();
        respond_hiding(&r.group_snapshot_id, &r.secrets, async {
            self.0
                .controller
                .delete_group_snapshot(
                    &r.group_snapshot_id,
                    &r.snapshot_ids,
                    &Secrets::from(&r.secrets),
                )
                .await?;
            Ok(pb::DeleteVolumeGroupSnapshotResponse {})
        })
        .await
    }

    async fn get_volume_group_snapshot(
        &self,
        request: Request<pb::GetVolumeGroupSnapshotRequest>,
    ) -> Result<Response<pb::GetVolumeGroupSnapshotResponse>, Status> {
        let r = request.into_inner();
        respond_hiding(&r.group_snapshot_id, &r.secrets, async {
            let group = self
                .0
                .controller
                .get_group_snapshot(
                    &r.group_snapshot_id,
                    &r.snapshot_ids,
                    &Secrets::from(&r.secrets),
                )
                .await?;
            Ok(pb::GetVolumeGroupSnapshotResponse {
                group_snapshot: Some(convert::group_snapshot_to_pb(&group)),
            })
        })
        .await
    }
}
