//! The client's changed block tracking calls: the ranges a stream
//! answers, gathered, and a backup image made from them (a full one from a
//! snapshot's allocated ranges, or an incremental one from a delta written
//! over the base's image): the proof that the ranges are right is that the
//! image equals the snapshot.

use crate::proto::{self as pb, snapshot_metadata_client::SnapshotMetadataClient};
use serde::Serialize;
use std::collections::HashMap;
use std::os::unix::fs::FileExt;
use std::path::Path;
use tonic::transport::Channel;
use tonic::Status;

/// What a stream answered, gathered.
#[derive(Debug, Default, Serialize)]
pub struct Ranges {
    pub block_metadata_type: String,
    pub volume_capacity_bytes: i64,
    pub messages: usize,
    /// (byte offset, length).
    pub ranges: Vec<(i64, i64)>,
}

impl Ranges {
    fn add(&mut self, kind: i32, capacity: i64, blocks: &[pb::BlockMetadata]) {
        self.block_metadata_type = pb::BlockMetadataType::try_from(kind)
            .map(|k| k.as_str_name().to_string())
            .unwrap_or_else(|_| kind.to_string());
        self.volume_capacity_bytes = capacity;
        self.messages += 1;
        self.ranges
            .extend(blocks.iter().map(|b| (b.byte_offset, b.size_bytes)));
    }
}

/// The fields both responses carry.
trait Page {
    fn parts(&self) -> (i32, i64, &[pb::BlockMetadata]);
}

impl Page for pb::GetMetadataAllocatedResponse {
    fn parts(&self) -> (i32, i64, &[pb::BlockMetadata]) {
        (
            self.block_metadata_type,
            self.volume_capacity_bytes,
            &self.block_metadata,
        )
    }
}

impl Page for pb::GetMetadataDeltaResponse {
    fn parts(&self) -> (i32, i64, &[pb::BlockMetadata]) {
        (
            self.block_metadata_type,
            self.volume_capacity_bytes,
            &self.block_metadata,
        )
    }
}

/// Reads a stream to its end.
async fn gather<T: Page>(mut stream: tonic::Streaming<T>) -> Result<Ranges, Status> {
    let mut out = Ranges::default();
    while let Some(m) = stream.message().await? {
        let (kind, capacity, blocks) = m.parts();
        out.add(kind, capacity, blocks);
    }
    Ok(out)
}

pub async fn allocated(
    channel: Channel,
    snapshot: &str,
    starting_offset: i64,
    max_results: i32,
    secrets: HashMap<String, String>,
) -> Result<Ranges, Status> {
    let stream = SnapshotMetadataClient::new(channel)
        .get_metadata_allocated(pb::GetMetadataAllocatedRequest {
            snapshot_id: snapshot.to_string(),
            starting_offset,
            max_results,
            secrets,
        })
        .await?
        .into_inner();
    gather(stream).await
}

pub async fn delta(
    channel: Channel,
    base: &str,
    target: &str,
    starting_offset: i64,
    max_results: i32,
    secrets: HashMap<String, String>,
) -> Result<Ranges, Status> {
    let stream = SnapshotMetadataClient::new(channel)
        .get_metadata_delta(pb::GetMetadataDeltaRequest {
            base_snapshot_id: base.to_string(),
            target_snapshot_id: target.to_string(),
            starting_offset,
            max_results,
            secrets,
        })
        .await?
        .into_inner();
    gather(stream).await
}

/// What a backup wrote.
#[derive(Debug, Serialize)]
pub struct Backup {
    pub image: String,
    pub ranges: usize,
    pub bytes_copied: u64,
    pub image_bytes: i64,
}

fn io_status(what: &str, path: &Path, e: std::io::Error) -> Status {
    Status::internal(format!("{what} {}: {e}", path.display()))
}

/// Copies each range from `data` into `image`, a MiB at a time.
fn copy_ranges(data: &Path, image: &Path, create: bool, ranges: &Ranges) -> Result<u64, Status> {
    let from = std::fs::File::open(data).map_err(|e| io_status("open", data, e))?;
    let to = std::fs::OpenOptions::new()
        .write(true)
        .create_new(create)
        .open(image)
        .map_err(|e| io_status("open", image, e))?;
    let capacity = ranges.volume_capacity_bytes.max(0) as u64;
    let size = to
        .metadata()
        .map_err(|e| io_status("stat", image, e))?
        .len();
    if size < capacity {
        to.set_len(capacity)
            .map_err(|e| io_status("size", image, e))?;
    }
    let mut buf = vec![0u8; 1 << 20];
    let mut copied = 0u64;
    for (offset, len) in &ranges.ranges {
        let (mut at, end) = (*offset as u64, (*offset + *len) as u64);
        while at < end {
            let n = ((end - at) as usize).min(buf.len());
            from.read_exact_at(&mut buf[..n], at)
                .map_err(|e| io_status("read", data, e))?;
            to.write_all_at(&buf[..n], at)
                .map_err(|e| io_status("write", image, e))?;
            at += n as u64;
            copied += n as u64;
        }
    }
    to.sync_all().map_err(|e| io_status("sync", image, e))?;
    Ok(copied)
}

pub async fn backup(
    channel: Channel,
    snapshot: &str,
    base: Option<&str>,
    data: &Path,
    image: &Path,
    secrets: HashMap<String, String>,
) -> Result<Backup, Status> {
    let ranges = match base {
        None => allocated(channel, snapshot, 0, 0, secrets).await?,
        Some(base) => delta(channel, base, snapshot, 0, 0, secrets).await?,
    };
    let (data, image_path) = (data.to_path_buf(), image.to_path_buf());
    let create = base.is_none();
    let (ranges, copied) = tokio::task::spawn_blocking(move || {
        let copied = copy_ranges(&data, &image_path, create, &ranges)?;
        Ok::<_, Status>((ranges, copied))
    })
    .await
    .map_err(|e| Status::internal(format!("copy: {e}")))??;
    Ok(Backup {
        image: image.display().to_string(),
        ranges: ranges.ranges.len(),
        bytes_copied: copied,
        image_bytes: ranges.volume_capacity_bytes,
    })
}
