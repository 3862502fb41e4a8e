//! ControllerGetVolumeHealth and ControllerListVolumeHealth: what is wrong
//! with volumes as the controller reaches their storage. Each volume is
//! measured through a book within [`HEALTH_DEADLINE`]: a backend that does
//! not answer makes its volumes' entries say so, late, and never holds the
//! call past the deadline nor another backend's volumes.

use super::*;
use crate::plugin::health::{self, volume_not_found, Book, Finding};
use std::time::Duration;

/// Per volume: its findings when last measured.
pub(super) type VolumeBook = Book<String, Vec<Finding>>;

/// How long one volume's measure may hold a call.
const HEALTH_DEADLINE: Duration = Duration::from_secs(10);

/// How many volumes one ControllerListVolumeHealth page looks at, at most:
/// a page may hold fewer entries than asked, with a token to go on.
const SCAN: usize = 256;

/// Volumes looked at together.
const BATCH: usize = 32;

impl ControllerOps {
    /// ControllerGetVolumeHealth: an id no backend of this driver made is
    /// NOT_FOUND; one a backend made but no longer has is reported
    /// INACCESSIBLE (VolumeNotFound), as its storage lost it.
    pub async fn volume_health(&self, id: &VolumeId, secrets: &Secrets) -> Result<Vec<Finding>> {
        let backend = self.registry.for_volume(id)?.clone();
        backend.provisioning()?;
        Ok(measure(&self.health, backend, id.clone(), secrets.clone()).await)
    }

    /// ControllerListVolumeHealth: the volumes with something wrong, in id
    /// order, each page after the token's volume. A page looks at no more
    /// than [`SCAN`] volumes; it may hold fewer entries than asked (none
    /// at all) and still give a token to go on.
    pub async fn list_volume_health(
        &self,
        max: i32,
        token: &str,
        secrets: &Secrets,
    ) -> Result<Listing<(VolumeId, Vec<Finding>)>> {
        let limit = max_entries(max)?;
        let from = cursor(token)?;
        let mut known = Vec::new();
        for backend in self.registry.all() {
            if backend.provisioner().is_none() {
                continue;
            }
            let Some(page) = page_for(backend.name(), from.as_ref(), SCAN, known.len()) else {
                continue;
            };
            // A backend whose volumes cannot be listed (its storage does
            // not answer) leaves them out of this page, not the others':
            // its storage health and readiness say why.
            match known_volumes(backend.as_ref(), &page).await {
                Ok(ids) => known.extend(ids.into_iter().map(|id| (backend.clone(), id))),
                Err(e) => tracing::warn!(
                    backend = backend.name(),
                    error = %e.message,
                    "volume health: the backend's volumes cannot be listed; left out of this page"
                ),
            }
            if known.len() > SCAN {
                break;
            }
        }
        let more = known.len() > SCAN;
        known.truncate(SCAN);
        let mut entries = Vec::new();
        let mut checked = 0;
        'batches: for batch in known.chunks(BATCH) {
            let checks: Vec<_> = batch
                .iter()
                .map(|(backend, id)| {
                    let (book, backend, id) = (self.health.clone(), backend.clone(), id.clone());
                    let secrets = secrets.clone();
                    tokio::spawn(async move { measure(&book, backend, id, secrets).await })
                })
                .collect();
            for (check, (_, id)) in checks.into_iter().zip(batch) {
                let found = check
                    .await
                    .map_err(|e| Error::internal(format!("a health check failed to run: {e}")))?;
                checked += 1;
                if !found.is_empty() {
                    entries.push((id.clone(), found));
                }
                if entries.len() == limit {
                    break 'batches;
                }
            }
        }
        // Done when every volume there is was looked at; else the next page
        // starts after the last one looked at.
        let next_token = if checked == known.len() && !more {
            String::new()
        } else {
            known[checked - 1].1.to_string()
        };
        Ok(Listing {
            entries,
            next_token,
        })
    }
}

/// The volumes a backend knows of: its reporter's list, or its whole ones.
async fn known_volumes(backend: &dyn Backend, page: &Page) -> Result<Vec<VolumeId>> {
    match backend.health_reporter() {
        Some(reporter) => reporter.known_volumes(page).await,
        None => Ok(backend
            .provisioning()?
            .list_volumes(page)
            .await?
            .into_iter()
            .map(|v| v.id)
            .collect()),
    }
}

/// One volume's findings, through the book.
async fn measure(
    book: &Arc<VolumeBook>,
    backend: Arc<dyn Backend>,
    id: VolumeId,
    secrets: Secrets,
) -> Vec<Finding> {
    let key = id.to_string();
    let check = async move {
        let found = match backend.health_reporter() {
            Some(reporter) => reporter.volume_health(&id, &secrets).await,
            None => match backend.provisioning() {
                Ok(p) => p.get_volume(&id, &secrets).await.map(|v| match v {
                    Some(_) => Vec::new(),
                    None => vec![volume_not_found(&id)],
                }),
                Err(e) => Err(e),
            },
        };
        health::from_check(found)
    };
    let answer = book.get(key, Duration::ZERO, HEALTH_DEADLINE, check).await;
    health::findings_of(answer, HEALTH_DEADLINE)
}
