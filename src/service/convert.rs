//! Conversions between the wire types and the plugin layer's types, with
//! the checks the spec asks for on the way in.

use crate::controller::Placed;
use crate::error::{Error, Result};
use crate::plugin::health::{Finding, StorageFinding};
use crate::plugin::{
    AccessMode, AccessType, ContentSource, SnapshotId, SnapshotInfo, VolumeCapability, VolumeId,
    VolumeInfo,
};
use crate::proto as pb;
use std::collections::{BTreeMap, HashMap};

/// A required volume id: empty is INVALID_ARGUMENT, ill-formed NOT_FOUND.
pub fn volume_id(raw: &str) -> Result<VolumeId> {
    VolumeId::parse(raw)
}

pub fn snapshot_id(raw: &str) -> Result<SnapshotId> {
    SnapshotId::parse(raw)
}

pub fn access_mode(mode: i32) -> Result<AccessMode> {
    use pb::volume_capability::access_mode::Mode as M;
    Ok(
        match M::try_from(mode)
            .map_err(|_| Error::invalid(format!("unknown access mode {mode}")))?
        {
            M::Unknown => return Err(Error::invalid("volume capability access mode is required")),
            M::SingleNodeWriter => AccessMode::SingleNodeWriter,
            M::SingleNodeReaderOnly => AccessMode::SingleNodeReaderOnly,
            M::MultiNodeReaderOnly => AccessMode::MultiNodeReaderOnly,
            M::MultiNodeSingleWriter => AccessMode::MultiNodeSingleWriter,
            M::MultiNodeMultiWriter => AccessMode::MultiNodeMultiWriter,
            M::SingleNodeSingleWriter => AccessMode::SingleNodeSingleWriter,
            M::SingleNodeMultiWriter => AccessMode::SingleNodeMultiWriter,
        },
    )
}

fn access_mode_to_pb(mode: AccessMode) -> i32 {
    use pb::volume_capability::access_mode::Mode as M;
    (match mode {
        AccessMode::SingleNodeWriter => M::SingleNodeWriter,
        AccessMode::SingleNodeReaderOnly => M::SingleNodeReaderOnly,
        AccessMode::MultiNodeReaderOnly => M::MultiNodeReaderOnly,
        AccessMode::MultiNodeSingleWriter => M::MultiNodeSingleWriter,
        AccessMode::MultiNodeMultiWriter => M::MultiNodeMultiWriter,
        AccessMode::SingleNodeSingleWriter => M::SingleNodeSingleWriter,
        AccessMode::SingleNodeMultiWriter => M::SingleNodeMultiWriter,
    }) as i32
}

/// A capability from the wire: access type and mode are both required.
pub fn capability(cap: &pb::VolumeCapability) -> Result<VolumeCapability> {
    use pb::volume_capability::AccessType as A;
    let access = match &cap.access_type {
        Some(A::Block(_)) => AccessType::Block,
        Some(A::Mount(m)) => {
            if m.volume_mount_group.is_empty() {
                AccessType::Mount {
                    fs_type: m.fs_type.clone(),
                    mount_flags: m.mount_flags.clone(),
                }
            } else {
                return Err(Error::invalid("volume_mount_group is not supported"));
            }
        }
        None => {
            return Err(Error::invalid(
                "volume capability access type (mount or block) is required",
            ))
        }
    };
    let mode = access_mode(cap.access_mode.as_ref().map(|m| m.mode).unwrap_or(0))?;
    Ok(VolumeCapability { access, mode })
}

/// A required capability field.
pub fn required_capability(cap: Option<&pb::VolumeCapability>) -> Result<VolumeCapability> {
    capability(cap.ok_or_else(|| Error::invalid("volume_capability is required"))?)
}

/// A required, non-empty list of capabilities.
pub fn capabilities(caps: &[pb::VolumeCapability]) -> Result<Vec<VolumeCapability>> {
    if caps.is_empty() {
        return Err(Error::invalid("volume_capabilities are required"));
    }
    caps.iter().map(capability).collect()
}

pub fn capability_to_pb(cap: &VolumeCapability) -> pb::VolumeCapability {
    use pb::volume_capability as vc;
    let access_type = match &cap.access {
        AccessType::Block => vc::AccessType::Block(vc::BlockVolume {}),
        AccessType::Mount {
            fs_type,
            mount_flags,
        } => vc::AccessType::Mount(vc::MountVolume {
            fs_type: fs_type.clone(),
            mount_flags: mount_flags.clone(),
            volume_mount_group: String::new(),
        }),
    };
    pb::VolumeCapability {
        access_type: Some(access_type),
        access_mode: Some(vc::AccessMode {
            mode: access_mode_to_pb(cap.mode),
        }),
    }
}

/// A content source from the wire. An id that cannot be ours is a source
/// that does not exist: NOT_FOUND.
pub fn content_source(src: Option<&pb::VolumeContentSource>) -> Result<Option<ContentSource>> {
    use pb::volume_content_source::Type;
    let Some(src) = src else { return Ok(None) };
    match &src.r#type {
        Some(Type::Snapshot(s)) => {
            let id = SnapshotId::parse(&s.snapshot_id)
                .map_err(|e| Error::not_found(format!("source snapshot: {}", e.message)))?;
            Ok(Some(ContentSource::Snapshot(id)))
        }
        Some(Type::Volume(v)) => {
            let id = VolumeId::parse(&v.volume_id)
                .map_err(|e| Error::not_found(format!("source volume: {}", e.message)))?;
            Ok(Some(ContentSource::Volume(id)))
        }
        None => Err(Error::invalid(
            "volume_content_source names neither a snapshot nor a volume",
        )),
    }
}

pub fn content_source_to_pb(src: &ContentSource) -> pb::VolumeContentSource {
    use pb::volume_content_source as vcs;
    let r#type = match src {
        ContentSource::Snapshot(id) => vcs::Type::Snapshot(vcs::SnapshotSource {
            snapshot_id: id.to_string(),
        }),
        ContentSource::Volume(id) => vcs::Type::Volume(vcs::VolumeSource {
            volume_id: id.to_string(),
        }),
    };
    pb::VolumeContentSource {
        r#type: Some(r#type),
    }
}

/// A volume and where it is reachable.
pub fn placed_to_pb(p: &Placed) -> pb::Volume {
    volume_to_pb(&p.volume, p.topology.as_ref())
}

pub fn volume_to_pb(v: &VolumeInfo, topology: Option<&HashMap<String, String>>) -> pb::Volume {
    pb::Volume {
        capacity_bytes: v.capacity_bytes as i64,
        volume_id: v.id.to_string(),
        volume_context: v
            .context
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect(),
        content_source: v.source.as_ref().map(content_source_to_pb),
        accessible_topology: topology
            .map(|t| {
                vec![pb::Topology {
                    segments: t.clone(),
                }]
            })
            .unwrap_or_default(),
    }
}

pub fn snapshot_to_pb(s: &SnapshotInfo) -> pb::Snapshot {
    let since = s
        .created
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    pb::Snapshot {
        size_bytes: s.size_bytes as i64,
        snapshot_id: s.id.to_string(),
        source_volume_id: s.source_volume.to_string(),
        creation_time: Some(prost_types::Timestamp {
            seconds: since.as_secs() as i64,
            nanos: since.subsec_nanos() as i32,
        }),
        ready_to_use: s.ready,
        group_snapshot_id: s.group.as_ref().map(|g| g.to_string()).unwrap_or_default(),
    }
}

fn timestamp(t: std::time::SystemTime) -> prost_types::Timestamp {
    let since = t.duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    prost_types::Timestamp {
        seconds: since.as_secs() as i64,
        nanos: since.subsec_nanos() as i32,
    }
}

pub fn group_snapshot_to_pb(g: &crate::controller::GroupSnapshotInfo) -> pb::VolumeGroupSnapshot {
    pb::VolumeGroupSnapshot {
        group_snapshot_id: g.id.to_string(),
        snapshots: g.snapshots.iter().map(snapshot_to_pb).collect(),
        creation_time: Some(timestamp(g.created)),
        ready_to_use: g.ready,
    }
}

/// A capacity range: (required, limit), zero meaning unset. Negative values
/// are INVALID_ARGUMENT; a limit below the requirement is OUT_OF_RANGE.
pub fn capacity_range(range: Option<&pb::CapacityRange>) -> Result<(u64, u64)> {
    let Some(r) = range else { return Ok((0, 0)) };
    if r.required_bytes < 0 || r.limit_bytes < 0 {
        return Err(Error::invalid("capacity_range values must not be negative"));
    }
    let (req, lim) = (r.required_bytes as u64, r.limit_bytes as u64);
    if lim > 0 && req > lim {
        return Err(Error::over_limit(req, lim));
    }
    Ok((req, lim))
}

/// Plugin parameters into an ordered map.
pub fn params(map: &HashMap<String, String>) -> BTreeMap<String, String> {
    map.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
}

/// A volume's findings, as v1.13 carries them.
pub fn volume_health_to_pb(id: &str, findings: &[Finding]) -> pb::VolumeHealth {
    use crate::plugin::health::Status;
    pb::VolumeHealth {
        volume_id: id.to_string(),
        health_statuses: findings
            .iter()
            .map(|f| pb::volume_health::VolumeHealthEntry {
                status: match f.status {
                    Status::Inaccessible => pb::VolumeHealthErrorType::Inaccessible,
                    Status::DataLoss => pb::VolumeHealthErrorType::DataLoss,
                    Status::Degraded => pb::VolumeHealthErrorType::Degraded,
                } as i32,
                reason: f.reason.as_str().to_string(),
                message: f.message.clone(),
            })
            .collect(),
    }
}

/// A backend's findings, as v1.13 carries them.
pub fn storage_health_to_pb(
    findings: &[StorageFinding],
) -> Vec<pb::node_get_storage_health_response::StorageBackendHealth> {
    use crate::plugin::health::StorageStatus;
    findings
        .iter()
        .map(
            |f| pb::node_get_storage_health_response::StorageBackendHealth {
                status: match f.status {
                    StorageStatus::Unreachable => pb::StorageHealthErrorType::StorageUnreachable,
                    StorageStatus::Degraded => pb::StorageHealthErrorType::StorageDegraded,
                } as i32,
                reason: f.reason.as_str().to_string(),
                message: f.message.clone(),
                volume_capability: None,
            },
        )
        .collect()
}

/// v1.12's condition (deprecated by v1.13, still answered for its
/// callers), read from the same findings.
pub fn condition_to_pb(findings: &[Finding]) -> pb::VolumeCondition {
    match crate::plugin::health::condition(findings) {
        Some(message) => pb::VolumeCondition {
            abnormal: true,
            message,
        },
        None => pb::VolumeCondition {
            abnormal: false,
            message: "volume is healthy".into(),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Kind;

    #[test]
    fn capabilities_require_type_and_mode() {
        assert_eq!(capabilities(&[]).unwrap_err().kind, Kind::InvalidArgument);
        let no_type = pb::VolumeCapability {
            access_type: None,
            access_mode: Some(pb::volume_capability::AccessMode { mode: 1 }),
        };
        assert_eq!(
            capability(&no_type).unwrap_err().kind,
            Kind::InvalidArgument
        );
        let cap = VolumeCapability {
            access: AccessType::Block,
            mode: AccessMode::SingleNodeMultiWriter,
        };
        let mut wire = capability_to_pb(&cap);
        assert_eq!(capability(&wire).unwrap(), cap);
        wire.access_mode = None;
        assert_eq!(capability(&wire).unwrap_err().kind, Kind::InvalidArgument);
        wire.access_mode = Some(pb::volume_capability::AccessMode { mode: 99 });
        assert_eq!(capability(&wire).unwrap_err().kind, Kind::InvalidArgument);
    }

    #[test]
    fn capacity_ranges() {
        assert_eq!(capacity_range(None).unwrap(), (0, 0));
        let r = |a, b| pb::CapacityRange {
            required_bytes: a,
            limit_bytes: b,
        };
        assert_eq!(capacity_range(Some(&r(10, 20))).unwrap(), (10, 20));
        assert_eq!(
            capacity_range(Some(&r(-1, 0))).unwrap_err().kind,
            Kind::InvalidArgument
        );
        assert_eq!(
            capacity_range(Some(&r(30, 20))).unwrap_err().kind,
            Kind::OutOfRange
        );
    }

    #[test]
    fn bad_source_ids_are_not_found() {
        let src = pb::VolumeContentSource {
            r#type: Some(pb::volume_content_source::Type::Snapshot(
                pb::volume_content_source::SnapshotSource {
                    snapshot_id: "file:../x".into(),
                },
            )),
        };
        assert_eq!(content_source(Some(&src)).unwrap_err().kind, Kind::NotFound);
    }
}
