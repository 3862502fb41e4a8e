//! The SnapshotMetadata service (changed block tracking): a server stream
//! of pages of ranges, each computed when the one before has been taken by
//! the client (the channel holds two), so a large sparse snapshot is
//! answered in bounded messages and bounded memory. The first page is
//! computed before the stream starts: an error there (NOT_FOUND,
//! OUT_OF_RANGE, FAILED_PRECONDITION) is the call's status; one later ends
//! the stream with it.

use super::{respond_hiding, Driver};
use crate::error::{Error, Result};
use crate::plugin::{BlockPage, Secrets, SnapshotId};
use crate::proto::{self as pb, snapshot_metadata_server::SnapshotMetadata};
use std::future::Future;
use std::sync::Arc;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

/// Ranges per message when the client names no maximum, and the most any
/// message carries.
const DEFAULT_RANGES: usize = 1024;
const MAX_RANGES: usize = 8192;

pub struct SnapshotMetadataService(pub Arc<Driver>);

fn max_ranges(max_results: i32) -> Result<usize> {
    match max_results {
        n if n < 0 => Err(Error::invalid("max_results must not be negative")),
        0 => Ok(DEFAULT_RANGES),
        n => Ok((n as usize).min(MAX_RANGES)),
    }
}

fn start_of(starting_offset: i64) -> Result<u64> {
    u64::try_from(starting_offset)
        .map_err(|_| Error::invalid("starting_offset must not be negative"))
}

/// A snapshot id from the request: required, and one that cannot be ours
/// names no snapshot.
fn snapshot(field: &str, raw: &str) -> Result<SnapshotId> {
    if raw.is_empty() {
        return Err(Error::invalid(format!("{field} is required")));
    }
    SnapshotId::parse(raw).map_err(|_| Error::not_found(format!("snapshot {raw:?} does not exist")))
}

/// The wire form of a page.
fn ranges(page: &BlockPage) -> (i32, i64, Vec<pb::BlockMetadata>) {
    let kind = match page.fixed {
        Some(_) => pb::BlockMetadataType::FixedLength,
        None => pb::BlockMetadataType::VariableLength,
    };
    let blocks = page
        .ranges
        .iter()
        .map(|(offset, len)| pb::BlockMetadata {
            byte_offset: *offset as i64,
            size_bytes: *len as i64,
        })
        .collect();
    (kind as i32, page.capacity as i64, blocks)
}

/// Streams `first` and the pages after it, each fetched by `next` from
/// where the last ended, as messages made by `message`; under the call's
/// secrets (hidden from what the runner reports).
fn stream<T, N, F>(
    first: BlockPage,
    secrets: Vec<String>,
    next: N,
    message: fn(&BlockPage) -> T,
) -> ReceiverStream<std::result::Result<T, Status>>
where
    T: Send + 'static,
    N: Fn(u64) -> F + Send + 'static,
    F: Future<Output = Result<BlockPage>> + Send,
{
    let (tx, rx) = mpsc::channel(2);
    tokio::spawn(crate::exec::hiding(secrets, async move {
        let mut page = first;
        loop {
            let after = page.next;
            if tx.send(Ok(message(&page))).await.is_err() {
                return; // The client went away.
            }
            let Some(at) = after else {
                return;
            };
            match next(at).await {
                Ok(p) => page = p,
                Err(e) => {
                    let _ = tx.send(Err(e.to_status())).await;
                    return;
                }
            }
        }
    }));
    ReceiverStream::new(rx)
}

#[tonic::async_trait]
impl SnapshotMetadata for SnapshotMetadataService {
    type GetMetadataAllocatedStream =
        ReceiverStream<std::result::Result<pb::GetMetadataAllocatedResponse, Status>>;
    type GetMetadataDeltaStream =
        ReceiverStream<std::result::Result<pb::GetMetadataDeltaResponse, Status>>;

    async fn get_metadata_allocated(
        &self,
        request: Request<pb::GetMetadataAllocatedRequest>,
    ) -> std::result::Result<Response<Self::GetMetadataAllocatedStream>, Status> {
        let r = request.into_inner();
        let driver = self.0.clone();
        let hidden = crate::exec::call_secret_values(r.secrets.values().map(String::as_str));
        respond_hiding(&r.snapshot_id, &r.secrets, async {
            let id = snapshot("snapshot_id", &r.snapshot_id)?;
            let start = start_of(r.starting_offset)?;
            let max = max_ranges(r.max_results)?;
            let secrets = Secrets::from(&r.secrets);
            let first = driver
                .controller
                .allocated_blocks(&id, start, max, &secrets)
                .await?;
            Ok(stream(
                first,
                hidden,
                move |at| {
                    let (driver, id, secrets) = (driver.clone(), id.clone(), secrets.clone());
                    async move {
                        driver
                            .controller
                            .allocated_blocks(&id, at, max, &secrets)
                            .await
                    }
                },
                |page| {
                    let (kind, capacity, blocks) = ranges(page);
                    pb::GetMetadataAllocatedResponse {
                        block_metadata_type: kind,
                        volume_capacity_bytes: capacity,
                        block_metadata: blocks,
                    }
                },
            ))
        })
        .await
    }

    async fn get_metadata_delta(
        &self,
        request: Request<pb::GetMetadataDeltaRequest>,
    ) -> std::result::Result<Response<Self::GetMetadataDeltaStream>, Status> {
        let r = request.into_inner();
        let driver = self.0.clone();
        let hidden = crate::exec::call_secret_values(r.secrets.values().map(String::as_str));
        respond_hiding(&r.target_snapshot_id, &r.secrets, async {
            let base = snapshot("base_snapshot_id", &r.base_snapshot_id)?;
            let target = snapshot("target_snapshot_id", &r.target_snapshot_id)?;
            let start = start_of(r.starting_offset)?;
            let max = max_ranges(r.max_results)?;
            let secrets = Secrets::from(&r.secrets);
            let first = driver
                .controller
                .changed_blocks(&base, &target, start, max, &secrets)
                .await?;
            Ok(stream(
                first,
                hidden,
                move |at| {
                    let (driver, base, target, secrets) = (
                        driver.clone(),
                        base.clone(),
                        target.clone(),
                        secrets.clone(),
                    );
                    async move {
                        driver
                            .controller
                            .changed_blocks(&base, &target, at, max, &secrets)
                            .await
                    }
                },
                |page| {
                    let (kind, capacity, blocks) = ranges(page);
                    pb::GetMetadataDeltaResponse {
                        block_metadata_type: kind,
                        volume_capacity_bytes: capacity,
                        block_metadata: blocks,
                    }
                },
            ))
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arguments_are_checked() {
        assert_eq!(max_ranges(0).unwrap(), DEFAULT_RANGES);
        assert_eq!(max_ranges(10).unwrap(), 10);
        assert_eq!(max_ranges(i32::MAX).unwrap(), MAX_RANGES);
        assert!(max_ranges(-1).is_err());
        assert!(start_of(-1).is_err());
        assert_eq!(start_of(4096).unwrap(), 4096);
        assert_eq!(
            snapshot("snapshot_id", "").unwrap_err().kind,
            crate::error::Kind::InvalidArgument
        );
        assert_eq!(
            snapshot("snapshot_id", "no such form").unwrap_err().kind,
            crate::error::Kind::NotFound
        );
        let (kind, capacity, blocks) = ranges(&BlockPage {
            fixed: None,
            capacity: 1 << 20,
            ranges: vec![(0, 4096), (8192, 4096)],
            next: None,
        });
        assert_eq!(kind, pb::BlockMetadataType::VariableLength as i32);
        assert_eq!(capacity, 1 << 20);
        assert_eq!(blocks.len(), 2);
        assert_eq!((blocks[1].byte_offset, blocks[1].size_bytes), (8192, 4096));
    }
}
