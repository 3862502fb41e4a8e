//! The exports' health as the target host sees it: the store's view of
//! each volume (an image or LV gone, a pool nearly full) and whether the
//! server still serves its export.

use super::Exports;
use crate::error::Result;
use crate::plugin::health::{volume_not_found, Finding, Reason};
use crate::plugin::{Page, Secrets, VolumeId};

impl Exports {
    /// The volumes the store knows, as this backend's.
    pub async fn known_volumes(&self, page: &Page) -> Result<Vec<VolumeId>> {
        let store = self.store.get()?;
        let ids = match store.health_reporter() {
            Some(reporter) => reporter.known_volumes(page).await?,
            None => store
                .provisioning()?
                .list_volumes(page)
                .await?
                .into_iter()
                .map(|v| v.id)
                .collect(),
        };
        ids.iter().map(|id| self.store.owner_volume(id)).collect()
    }

    /// What the store finds of the volume, and its export missing from the
    /// server (the protocol's reason).
    pub async fn volume_health(&self, id: &VolumeId, secrets: &Secrets) -> Result<Vec<Finding>> {
        let not_found = || vec![volume_not_found(id)];
        if id.backend() != self.name {
            return Ok(not_found());
        }
        let store = self.store.get()?;
        let store_id = self.store.volume(id)?;
        let mut found = match store.health_reporter() {
            Some(reporter) => reporter.volume_health(&store_id, secrets).await?,
            None => match store.provisioning()?.get_volume(&store_id, secrets).await? {
                Some(_) => Vec::new(),
                None => not_found(),
            },
        };
        if found.iter().any(|f| f.reason == Reason::VolumeNotFound) {
            return Ok(not_found());
        }
        if let Some(record) = self.load(id)? {
            if self.target.connected(&record.export).await?.is_none() {
                let terms = self.terms();
                found.push(Finding::inaccessible(
                    terms.missing,
                    format!(
                        "{} {} is not served by {}",
                        terms.export, record.export, terms.server
                    ),
                ));
            }
        }
        Ok(found)
    }
}
