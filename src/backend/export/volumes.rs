//! The exports' volumes: made in the store with their export, deleted
//! with it, and grown.

use super::record::Record;
use super::Exports;
use crate::error::{Error, Result};
use crate::plugin::{ContentSource, CreateVolume, Secrets, VolumeId, VolumeInfo};

impl Exports {
    /// CreateVolume: the store's volume (from the store's copy of a
    /// source), then its export, recorded.
    pub async fn create_volume(&self, req: &CreateVolume) -> Result<VolumeInfo> {
        let store = self.store.get()?;
        let mut r = req.clone();
        r.source = match &req.source {
            Some(ContentSource::Volume(v)) => {
                self.own_volume(v)
                    .map_err(|_| Error::not_found(format!("source volume {v} does not exist")))?;
                Some(ContentSource::Volume(self.store.volume(v)?))
            }
            Some(ContentSource::Snapshot(s)) => {
                if s.backend() != self.name {
                    return Err(Error::not_found(format!(
                        "source snapshot {s} does not exist"
                    )));
                }
                Some(ContentSource::Snapshot(self.store.snapshot(s)?))
            }
            None => None,
        };
        let info = store.provisioning()?.create_volume(&r).await?;
        let info = self.store.volume_info(info)?;
        let id = info.id.clone();
        let _volume = self.lock(&id).await;
        let mut record = match self.load(&id)? {
            Some(r) => r,
            None => Record::new(self.export_name(&id)),
        };
        record.bytes.get_or_insert(info.capacity_bytes);
        self.ensure(&id, &mut record).await?;
        self.save(&id, &record)?;
        self.take_over_copy(&id, &mut record).await?;
        Ok(info)
    }

    /// DeleteVolume: refused while a host is connected; the export, its
    /// hold device, the store's attachment and volume, then the record.
    pub async fn delete_volume(&self, id: &VolumeId, secrets: &Secrets) -> Result<()> {
        if id.backend() != self.name {
            return Ok(());
        }
        let store = self.store.get()?;
        let store_id = self.store.volume(id)?;
        let _volume = self.lock(id).await;
        let record = self.load(id)?;
        let export = record
            .as_ref()
            .map(|r| r.export.clone())
            .unwrap_or_else(|| self.export_name(id));
        let connected = self.target.connected(&export).await?;
        if let Some(connected) = connected.filter(|c| !c.is_empty()) {
            return Err(Error::in_use(
                format_args!("volume {id}"),
                format_args!("{} {}", self.terms().connected, connected.join(", ")),
                "unstage it on those nodes first",
            ));
        }
        // Asked even when the server does not serve it whole: a delete
        // removes what a create cut short left (one gone is done).
        self.target.delete(&export).await?;
        if let (Some(holds), Some(name)) =
            (&self.holds, record.as_ref().and_then(|r| r.hold.as_ref()))
        {
            holds.remove(name).await?;
        }
        store
            .staging()?
            .node_detach(&store_id, record.as_ref().map(|r| &r.attachment))
            .await?;
        store
            .provisioning()?
            .delete_volume(&store_id, secrets)
            .await?;
        self.forget(id)?;
        drop(_volume);
        let granted: Vec<String> = record
            .map(|r| r.hosts.into_iter().collect())
            .unwrap_or_default();
        self.forget_hosts(&granted).await
    }

    /// NOT_FOUND for a volume without a record of its export.
    fn no_export(&self, id: &VolumeId) -> Error {
        Error::not_found(format!("volume {id} has no {}", self.terms().export))
    }

    /// Whether a volume grows while a node uses it (the server's terms).
    pub fn grows_online(&self) -> bool {
        self.terms().grows_only_unused.is_none()
    }

    /// ControllerExpandVolume: the store's volume grown, then what the
    /// export serves. Where the server cannot grow an export under I/O,
    /// only while no node can use it (a repeat of a growth that is done is
    /// answered with its size).
    pub async fn expand_volume(
        &self,
        id: &VolumeId,
        required: u64,
        limit: u64,
        secrets: &Secrets,
    ) -> Result<u64> {
        self.own_volume(id)?;
        let store = self.store.get()?;
        let store_id = self.store.volume(id)?;
        let record = self.load(id)?.ok_or_else(|| self.no_export(id))?;
        if let Some(why) = self.terms().grows_only_unused {
            // Publish and expand of one volume never overlap (the volume's
            // lock), and the grants keep out hosts that were not published.
            let users = self.users(&record).await?;
            if !users.is_empty() {
                if let Some(bytes) = record
                    .bytes
                    .filter(|&b| b >= required && (limit == 0 || b <= limit))
                {
                    return Ok(bytes);
                }
                return Err(Error::in_use(
                    format_args!("volume {id}"),
                    format_args!(
                        "{} {}",
                        self.terms().connected,
                        users.into_iter().collect::<Vec<_>>().join(", ")
                    ),
                    &format!("{why}: it grows once none does"),
                ));
            }
        }
        let size = store
            .expanding()?
            .expand_volume(&store_id, required, limit, secrets)
            .await?;
        let _volume = self.lock(id).await;
        let mut record = self.load(id)?.ok_or_else(|| self.no_export(id))?;
        self.ensure(id, &mut record).await?;
        store
            .device_mounting()?
            .node_refresh_size(&store_id, &record.attachment)
            .await?;
        if let (Some(holds), Some(name)) = (&self.holds, &record.hold) {
            holds.resize(name, &record.device).await?;
        }
        self.target
            .refresh(&record.export, &record.served())
            .await?;
        record.bytes = Some(size);
        self.save(id, &record)?;
        Ok(size)
    }
}
