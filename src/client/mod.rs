//! `ferrovol client`: a CSI command-line client on the driver's own
//! generated code, for any CSI driver on a unix socket or TCP. Every RPC of
//! the Identity, Controller, GroupController and Node services and the
//! SnapshotMetadata streams, answers as text or JSON, and an exit status
//! that tells the gRPC code: 0 for OK, 10 + the code for a failed call
//! (13 INVALID_ARGUMENT, 15 NOT_FOUND, 19 FAILED_PRECONDITION, ...), 1 when
//! the driver cannot be reached, 2 for a usage error.

mod args;
mod metadata;
mod walk;

pub use args::*;

use crate::proto::controller_client::ControllerClient;
use crate::proto::group_controller_client::GroupControllerClient;
use crate::proto::identity_client::IdentityClient;
use crate::proto::node_client::NodeClient;
use crate::proto::{self as pb, volume_capability as vc};
use clap::{Args as ClapArgs, Subcommand, ValueEnum};
use std::collections::HashMap;
use std::path::PathBuf;
use tonic::transport::{Channel, Endpoint, Uri};

/// Connects to `endpoint` (unix:// or tcp://).
pub async fn connect(endpoint: &str) -> Result<Channel, String> {
    if let Some(path) = endpoint.strip_prefix("unix://") {
        let path = PathBuf::from(path);
        return Endpoint::try_from("http://[::]:50051")
            .map_err(|e| e.to_string())?
            .connect_with_connector(tower::service_fn(move |_: Uri| {
                let path = path.clone();
                async move {
                    Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(
                        tokio::net::UnixStream::connect(path).await?,
                    ))
                }
            }))
            .await
            .map_err(|e| format!("cannot reach {endpoint}: {e}"));
    }
    let addr = endpoint
        .strip_prefix("tcp://")
        .ok_or_else(|| format!("endpoint {endpoint:?} must start with unix:// or tcp://"))?;
    Endpoint::from_shared(format!("http://{addr}"))
        .map_err(|e| e.to_string())?
        .connect()
        .await
        .map_err(|e| format!("cannot reach {endpoint}: {e}"))
}

/// Reads a secrets file: a JSON object, or `key=value` / `key: value`
/// lines (blank lines and `#` comments skipped).
pub fn read_secrets(path: &std::path::Path) -> Result<HashMap<String, String>, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("secrets file {}: {e}", path.display()))?;
    if text.trim_start().starts_with('{') {
        return serde_json::from_str(&text)
            .map_err(|e| format!("secrets file {}: {e}", path.display()));
    }
    let mut out = HashMap::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (k, v) = line
            .split_once('=')
            .or_else(|| line.split_once(':'))
            .ok_or_else(|| {
                format!(
                    "secrets file {}: line {} is not key=value",
                    path.display(),
                    n + 1
                )
            })?;
        out.insert(k.trim().to_string(), v.trim().to_string());
    }
    Ok(out)
}

/// Prints an answer.
fn print<T: serde::Serialize>(output: Output, answer: &T) {
    let value = serde_json::to_value(answer).unwrap_or(serde_json::Value::Null);
    match output {
        Output::Json => println!(
            "{}",
            serde_json::to_string_pretty(&value).unwrap_or_default()
        ),
        Output::Text => {
            let mut lines = Vec::new();
            text(&value, "", &mut lines);
            if lines.is_empty() {
                println!("ok");
            }
            for l in lines {
                println!("{l}");
            }
        }
    }
}

/// `path: value` lines, skipping empty values.
fn text(v: &serde_json::Value, path: &str, out: &mut Vec<String>) {
    use serde_json::Value as V;
    let join = |k: &str| {
        if path.is_empty() {
            k.to_string()
        } else {
            format!("{path}.{k}")
        }
    };
    match v {
        V::Object(m) => {
            for (k, v) in m {
                text(v, &join(k), out);
            }
        }
        V::Array(a) => {
            for (i, v) in a.iter().enumerate() {
                text(v, &format!("{path}[{i}]"), out);
            }
        }
        V::Null => {}
        V::String(s) if s.is_empty() => {}
        V::String(s) => out.push(format!("{path}: {s}")),
        other => out.push(format!("{path}: {other}")),
    }
}

/// Runs one call; returns the process exit status.
pub async fn run(args: Args) -> i32 {
    let secrets = match &args.secrets_file {
        Some(p) => match read_secrets(p) {
            Ok(s) => s,
            Err(e) => {
                eprintln!("ferrovol client: {e}");
                return 2;
            }
        },
        None => HashMap::new(),
    };
    let channel = match connect(&args.endpoint).await {
        Ok(c) => c,
        Err(e) => {
            eprintln!("ferrovol client: {e}");
            return 1;
        }
    };
    let deadline = std::time::Duration::from_secs(args.timeout);
    let result = tokio::time::timeout(deadline, call(&args, channel, secrets)).await;
    match result {
        Err(_) => {
            eprintln!("ferrovol client: no answer within {}s", args.timeout);
            10 + tonic::Code::DeadlineExceeded as i32
        }
        Ok(Ok(())) => 0,
        Ok(Err(status)) => {
            eprintln!("ferrovol client: {:?}: {}", status.code(), status.message());
            10 + status.code() as i32
        }
    }
}

/// The CreateVolume request a `create-volume` subcommand asks for.
fn create_request(a: &CreateArgs, secrets: HashMap<String, String>) -> pb::CreateVolumeRequest {
    use pb::volume_content_source as vcs;
    let CreateArgs {
        name,
        size,
        limit,
        cap,
        params,
        from_snapshot,
        from_volume,
        requisite,
        preferred,
        mutable,
    } = a;
    let source = match (from_snapshot, from_volume) {
        (Some(s), _) => Some(vcs::Type::Snapshot(vcs::SnapshotSource {
            snapshot_id: s.clone(),
        })),
        (_, Some(v)) => Some(vcs::Type::Volume(vcs::VolumeSource {
            volume_id: v.clone(),
        })),
        _ => None,
    };
    let topo = |t: &[Topo]| {
        t.iter()
            .map(|t| pb::Topology {
                segments: t.0.clone(),
            })
            .collect::<Vec<_>>()
    };
    let accessibility =
        (!requisite.is_empty() || !preferred.is_empty()).then(|| pb::TopologyRequirement {
            requisite: topo(requisite),
            preferred: topo(preferred),
        });
    pb::CreateVolumeRequest {
        name: name.clone(),
        capacity_range: range(*size, *limit),
        volume_capabilities: vec![cap.build()],
        parameters: map(params),
        secrets,
        volume_content_source: source.map(|t| pb::VolumeContentSource { r#type: Some(t) }),
        accessibility_requirements: accessibility,
        mutable_parameters: map(mutable),
    }
}

fn print_names(out: Output, names: Vec<String>) {
    print(out, &serde_json::json!({ "capabilities": names }));
}

fn plugin_capabilities(a: pb::GetPluginCapabilitiesResponse) -> Vec<String> {
    use pb::plugin_capability as pc;
    a.capabilities
        .iter()
        .filter_map(|c| match c.r#type.as_ref()? {
            pc::Type::Service(s) => Some(format!(
                "SERVICE:{}",
                pc::service::Type::try_from(s.r#type).ok()?.as_str_name()
            )),
            pc::Type::VolumeExpansion(e) => Some(format!(
                "VOLUME_EXPANSION:{}",
                pc::volume_expansion::Type::try_from(e.r#type)
                    .ok()?
                    .as_str_name()
            )),
        })
        .collect()
}

fn controller_capabilities(a: pb::ControllerGetCapabilitiesResponse) -> Vec<String> {
    use pb::controller_service_capability as csc;
    a.capabilities
        .iter()
        .filter_map(|c| match c.r#type.as_ref()? {
            csc::Type::Rpc(r) => csc::rpc::Type::try_from(r.r#type)
                .ok()
                .map(|t| t.as_str_name().to_string()),
        })
        .collect()
}

fn node_capabilities(a: pb::NodeGetCapabilitiesResponse) -> Vec<String> {
    use pb::node_service_capability as nsc;
    a.capabilities
        .iter()
        .filter_map(|c| match c.r#type.as_ref()? {
            nsc::Type::Rpc(r) => nsc::rpc::Type::try_from(r.r#type)
                .ok()
                .map(|t| t.as_str_name().to_string()),
        })
        .collect()
}

/// Awaits a call and prints its answer.
macro_rules! show {
    ($out:expr, $e:expr) => {{
        let answer = $e.await?.into_inner();
        print($out, &answer);
    }};
}

/// One RPC per subcommand, dispatched by service: each service's
/// function builds its requests from the arguments and prints the answers.
async fn call(
    args: &Args,
    channel: Channel,
    secrets: HashMap<String, String>,
) -> Result<(), tonic::Status> {
    let out = args.output;
    match &args.call {
        Call::Identity(call) => identity(call, channel, out).await,
        Call::Controller(call) => controller(call, channel, out, secrets).await,
        Call::Group(call) => group(call, channel, out, secrets).await,
        Call::Metadata(call) => snapshot_metadata(call, channel, out, secrets).await,
        Call::Node(call) => node(call, channel, out, secrets).await,
        Call::Lifecycle { work } => walk::walk(channel, work, secrets).await,
    }
}

/// The Identity service's calls.
async fn identity(call: &IdentityCall, channel: Channel, out: Output) -> Result<(), tonic::Status> {
    let mut id = IdentityClient::new(channel);
    match call {
        IdentityCall::PluginInfo => show!(out, id.get_plugin_info(pb::GetPluginInfoRequest {})),
        IdentityCall::PluginCapabilities => print_names(
            out,
            plugin_capabilities(
                id.get_plugin_capabilities(pb::GetPluginCapabilitiesRequest {})
                    .await?
                    .into_inner(),
            ),
        ),
        IdentityCall::Probe => show!(out, id.probe(pb::ProbeRequest {})),
    }
    Ok(())
}

/// The Controller service's calls.
async fn controller(
    call: &ControllerCall,
    channel: Channel,
    out: Output,
    secrets: HashMap<String, String>,
) -> Result<(), tonic::Status> {
    let mut c = ControllerClient::new(channel);
    match call {
        ControllerCall::CreateVolume(a) => show!(out, c.create_volume(create_request(a, secrets))),
        ControllerCall::DeleteVolume { id: v } => show!(
            out,
            c.delete_volume(pb::DeleteVolumeRequest {
                volume_id: v.clone(),
                secrets,
            })
        ),
        ControllerCall::ControllerPublish {
            id: v,
            node,
            cap,
            readonly,
            context,
        } => show!(
            out,
            c.controller_publish_volume(pb::ControllerPublishVolumeRequest {
                volume_id: v.clone(),
                node_id: node.clone(),
                volume_capability: Some(cap.build()),
                readonly: *readonly,
                secrets,
                volume_context: map(context),
            })
        ),
        ControllerCall::ControllerUnpublish { id: v, node } => {
            show!(
                out,
                c.controller_unpublish_volume(pb::ControllerUnpublishVolumeRequest {
                    volume_id: v.clone(),
                    node_id: node.clone().unwrap_or_default(),
                    secrets,
                })
            )
        }
        ControllerCall::ValidateCapabilities {
            id: v,
            cap,
            context,
            params,
        } => show!(
            out,
            c.validate_volume_capabilities(pb::ValidateVolumeCapabilitiesRequest {
                volume_id: v.clone(),
                volume_context: map(context),
                volume_capabilities: vec![cap.build()],
                parameters: map(params),
                secrets,
                ..Default::default()
            })
        ),
        ControllerCall::ListVolumes {
            max_entries,
            starting_token,
        } => show!(
            out,
            c.list_volumes(pb::ListVolumesRequest {
                max_entries: *max_entries,
                starting_token: starting_token.clone(),
            })
        ),
        ControllerCall::GetCapacity { params, topology } => show!(
            out,
            c.get_capacity(pb::GetCapacityRequest {
                parameters: map(params),
                accessible_topology: topology.as_ref().map(|t| pb::Topology {
                    segments: t.0.clone()
                }),
                ..Default::default()
            })
        ),
        ControllerCall::ControllerCapabilities => print_names(
            out,
            controller_capabilities(
                c.controller_get_capabilities(pb::ControllerGetCapabilitiesRequest {})
                    .await?
                    .into_inner(),
            ),
        ),
        ControllerCall::CreateSnapshot {
            name,
            source,
            params,
        } => show!(
            out,
            c.create_snapshot(pb::CreateSnapshotRequest {
                source_volume_id: source.clone(),
                name: name.clone(),
                secrets,
                parameters: map(params),
            })
        ),
        ControllerCall::DeleteSnapshot { id: s } => show!(
            out,
            c.delete_snapshot(pb::DeleteSnapshotRequest {
                snapshot_id: s.clone(),
                secrets,
            })
        ),
        ControllerCall::ListSnapshots {
            snapshot_id,
            source,
            max_entries,
            starting_token,
        } => show!(
            out,
            c.list_snapshots(pb::ListSnapshotsRequest {
                max_entries: *max_entries,
                starting_token: starting_token.clone(),
                source_volume_id: source.clone(),
                snapshot_id: snapshot_id.clone(),
                secrets,
            })
        ),
        ControllerCall::GetSnapshot { id: s } => show!(
            out,
            c.get_snapshot(pb::GetSnapshotRequest {
                snapshot_id: s.clone(),
                secrets,
            })
        ),
        ControllerCall::ControllerExpand { id: v, size, limit } => {
            show!(
                out,
                c.controller_expand_volume(pb::ControllerExpandVolumeRequest {
                    volume_id: v.clone(),
                    capacity_range: range(Some(*size), *limit),
                    secrets,
                    ..Default::default()
                })
            )
        }
        ControllerCall::VolumeHealth { id: v } => show!(
            out,
            c.controller_get_volume_health(pb::ControllerGetVolumeHealthRequest {
                volume_id: v.clone(),
                secrets,
            })
        ),
        ControllerCall::ListVolumeHealth {
            max_entries,
            starting_token,
        } => show!(
            out,
            c.controller_list_volume_health(pb::ControllerListVolumeHealthRequest {
                max_entries: *max_entries,
                starting_token: starting_token.clone(),
                secrets,
            })
        ),
        ControllerCall::GetVolume { id: v } => {
            show!(
                out,
                c.controller_get_volume(pb::ControllerGetVolumeRequest {
                    volume_id: v.clone(),
                })
            )
        }
        ControllerCall::ModifyVolume { id: v, mutable } => {
            show!(
                out,
                c.controller_modify_volume(pb::ControllerModifyVolumeRequest {
                    volume_id: v.clone(),
                    secrets,
                    mutable_parameters: map(mutable),
                })
            )
        }
    }
    Ok(())
}

/// The GroupController service's calls.
async fn group(
    call: &GroupCall,
    channel: Channel,
    out: Output,
    secrets: HashMap<String, String>,
) -> Result<(), tonic::Status> {
    let mut g = GroupControllerClient::new(channel);
    match call {
        GroupCall::CreateGroupSnapshot {
            name,
            sources,
            params,
        } => show!(
            out,
            g.create_volume_group_snapshot(pb::CreateVolumeGroupSnapshotRequest {
                name: name.clone(),
                source_volume_ids: sources.clone(),
                secrets,
                parameters: map(params),
            })
        ),
        GroupCall::DeleteGroupSnapshot { id: gid, snapshots } => show!(
            out,
            g.delete_volume_group_snapshot(pb::DeleteVolumeGroupSnapshotRequest {
                group_snapshot_id: gid.clone(),
                snapshot_ids: snapshots.clone(),
                secrets,
            })
        ),
        GroupCall::GetGroupSnapshot { id: gid, snapshots } => show!(
            out,
            g.get_volume_group_snapshot(pb::GetVolumeGroupSnapshotRequest {
                group_snapshot_id: gid.clone(),
                snapshot_ids: snapshots.clone(),
                secrets,
            })
        ),
        GroupCall::GroupCapabilities => {
            show!(
                out,
                g.group_controller_get_capabilities(pb::GroupControllerGetCapabilitiesRequest {})
            )
        }
    }
    Ok(())
}

/// The SnapshotMetadata service's calls (streams, read whole).
async fn snapshot_metadata(
    call: &MetadataCall,
    channel: Channel,
    out: Output,
    secrets: HashMap<String, String>,
) -> Result<(), tonic::Status> {
    match call {
        MetadataCall::Allocated {
            snapshot,
            starting_offset,
            max_results,
        } => {
            let found = metadata::allocated(
                channel.clone(),
                snapshot,
                *starting_offset,
                *max_results,
                secrets,
            )
            .await?;
            print(out, &found);
        }
        MetadataCall::Delta {
            base,
            target,
            starting_offset,
            max_results,
        } => {
            let found = metadata::delta(
                channel.clone(),
                base,
                target,
                *starting_offset,
                *max_results,
                secrets,
            )
            .await?;
            print(out, &found);
        }
        MetadataCall::Backup {
            snapshot,
            data,
            out: image,
            base,
        } => {
            let done = metadata::backup(
                channel.clone(),
                snapshot,
                base.as_deref(),
                data,
                image,
                secrets,
            )
            .await?;
            print(out, &done);
        }
    }
    Ok(())
}

/// The Node service's calls.
async fn node(
    call: &NodeCall,
    channel: Channel,
    out: Output,
    secrets: HashMap<String, String>,
) -> Result<(), tonic::Status> {
    let mut n = NodeClient::new(channel);
    match call {
        NodeCall::Stage {
            id: v,
            staging,
            cap,
            publish_context,
            context,
        } => show!(
            out,
            n.node_stage_volume(pb::NodeStageVolumeRequest {
                volume_id: v.clone(),
                publish_context: map(publish_context),
                staging_target_path: staging.clone(),
                volume_capability: Some(cap.build()),
                secrets,
                volume_context: map(context),
            })
        ),
        NodeCall::Unstage { id: v, staging } => {
            show!(
                out,
                n.node_unstage_volume(pb::NodeUnstageVolumeRequest {
                    volume_id: v.clone(),
                    staging_target_path: staging.clone(),
                })
            )
        }
        NodeCall::Publish {
            id: v,
            target,
            staging,
            cap,
            readonly,
            publish_context,
            context,
        } => show!(
            out,
            n.node_publish_volume(pb::NodePublishVolumeRequest {
                volume_id: v.clone(),
                publish_context: map(publish_context),
                staging_target_path: staging.clone(),
                target_path: target.clone(),
                volume_capability: Some(cap.build()),
                readonly: *readonly,
                secrets,
                volume_context: map(context),
            })
        ),
        NodeCall::Unpublish { id: v, target } => {
            show!(
                out,
                n.node_unpublish_volume(pb::NodeUnpublishVolumeRequest {
                    volume_id: v.clone(),
                    target_path: target.clone(),
                })
            )
        }
        NodeCall::NodeVolumeHealth {
            id: v,
            path,
            staging,
        } => show!(
            out,
            n.node_get_volume_health(pb::NodeGetVolumeHealthRequest {
                volume_id: v.clone(),
                volume_publish_path: path.clone(),
                staging_target_path: staging.clone(),
            })
        ),
        NodeCall::StorageHealth => show!(
            out,
            n.node_get_storage_health(pb::NodeGetStorageHealthRequest { secrets })
        ),
        NodeCall::Stats {
            id: v,
            path,
            staging,
        } => show!(
            out,
            n.node_get_volume_stats(pb::NodeGetVolumeStatsRequest {
                volume_id: v.clone(),
                volume_path: path.clone(),
                staging_target_path: staging.clone(),
            })
        ),
        NodeCall::NodeExpand {
            id: v,
            path,
            staging,
            size,
        } => show!(
            out,
            n.node_expand_volume(pb::NodeExpandVolumeRequest {
                volume_id: v.clone(),
                volume_path: path.clone(),
                capacity_range: range(Some(*size), None),
                staging_target_path: staging.clone(),
                secrets,
                ..Default::default()
            })
        ),
        NodeCall::NodeCapabilities => print_names(
            out,
            node_capabilities(
                n.node_get_capabilities(pb::NodeGetCapabilitiesRequest {})
                    .await?
                    .into_inner(),
            ),
        ),
        NodeCall::NodeInfo => show!(out, n.node_get_info(pb::NodeGetInfoRequest {})),
    }
    Ok(())
}
