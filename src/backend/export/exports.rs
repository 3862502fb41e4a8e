//! An exporting backend's exports, whatever its protocol: one per volume
//! on its [`Target`], serving the store's device (through a hold device
//! where the host has device-mapper), granted to the hosts ControllerPublish
//! names, fenced when they are taken off, and made again when the server
//! lost them. The backend's controller calls (see `volumes.rs`,
//! `snapshots.rs`, `health.rs` beside it) are these, given its protocol's
//! words for what a host brings.

use super::initiator::Initiator;
use super::record::{FsCopy, Record, Records};
use super::target::{Credential, Target, Terms};
use super::Store;
use crate::error::{Error, Kind, Result};
use crate::exec::CommandRunner;
use crate::host::hold::Holds;
use crate::plugin::{
    check_publish_terms, AttachContext, Attachment, Backend, ControllerAttach, VolumeId,
};
use crate::sync::LockExt;
use std::collections::{BTreeSet, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// An export's name: the backend's prefix and the volume's locator when
/// it is a valid name part (iSCSI and NVMe names alike take lowercase
/// letters, digits, '-' and '.', up to 223 bytes), else a digest of it.
pub fn name_for(prefix: &str, locator: &str) -> String {
    let clean = locator
        .bytes()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"-.".contains(&b));
    if clean && prefix.len() + 1 + locator.len() <= 223 {
        format!("{prefix}:{locator}")
    } else {
        format!(
            "{prefix}:v-{}",
            crate::plugin::digest_hex(locator.as_bytes(), 16)
        )
    }
}

/// The many-node mode a publish's terms (`mode/access/rw`, as
/// [`ControllerAttach::terms`] writes them) share a volume in, if any:
/// nodes may hold one volume together only in the same such mode. A
/// record from before terms were kept has none: single-node.
pub(super) fn shared_as(terms: &str) -> Option<&'static str> {
    match terms.split('/').next()? {
        "multi_node_multi_writer" => Some("multi_node_multi_writer"),
        "multi_node_reader_only" => Some("multi_node_reader_only"),
        _ => None,
    }
}

/// How often [`Exports::health`] checks that the server still serves
/// every export.
const RECONCILE_EVERY: Duration = Duration::from_secs(30);

/// What an exporting backend gives its exports besides its target,
/// initiator and store: how it names an export, where nodes reach it, and
/// its kill points.
pub struct Setup {
    /// The backend's name.
    pub name: String,
    /// A volume's export name, from its locator.
    pub export_name: Box<dyn Fn(&str) -> String + Send + Sync>,
    /// What every export name of the backend starts with (then `:`).
    pub prefix: String,
    /// `host:port` of the target server as nodes reach it.
    pub portals: Vec<String>,
    /// Where its records are.
    pub dir: PathBuf,
    /// Reached with the hold devices of a group's volumes in use suspended
    /// (the backend's kill point there).
    pub held: fn(),
}

pub struct Exports {
    pub(super) name: String,
    export_name: Box<dyn Fn(&str) -> String + Send + Sync>,
    pub(super) prefix: String,
    pub(super) portals: Vec<String>,
    pub(super) target: Arc<dyn Target>,
    pub(super) initiator: Arc<dyn Initiator>,
    pub(super) store: Store,
    pub(super) records: Records,
    runner: Arc<dyn CommandRunner>,
    /// Per volume: its RPC (the operation guard lets one at a time) and
    /// the periodic rebuild, which passes over a volume an RPC holds. No
    /// lock spans two volumes.
    volumes: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// Credentials' secrets last given, by name and direction (outgoing),
    /// for rebuilding exports.
    secrets: Mutex<HashMap<(String, bool), String>>,
    last_reconcile: Mutex<Option<Instant>>,
    /// Held shared by whatever gives a host credentials and grants
    /// (publish, a rebuild), alone by [`Exports::forget_hosts`]: a host is
    /// never forgotten between its credential and its grant.
    hosts: tokio::sync::RwLock<()>,
    /// Hold devices for exports, where this host has device-mapper.
    pub(super) holds: Option<Holds>,
    pub(super) held: fn(),
}

impl Exports {
    pub fn new(
        setup: Setup,
        target: Arc<dyn Target>,
        initiator: Arc<dyn Initiator>,
        store: Option<Arc<dyn Backend>>,
        runner: Arc<dyn CommandRunner>,
    ) -> Self {
        let holds = Holds::available().then(|| Holds::new(runner.clone()));
        Exports {
            store: Store::new(&setup.name, store),
            name: setup.name,
            export_name: setup.export_name,
            prefix: setup.prefix,
            portals: setup.portals,
            target,
            initiator,
            records: Records::new(setup.dir),
            runner,
            volumes: Mutex::new(HashMap::new()),
            secrets: Mutex::new(HashMap::new()),
            last_reconcile: Mutex::new(None),
            hosts: tokio::sync::RwLock::new(()),
            holds,
            held: setup.held,
        }
    }

    /// Without hold devices (a test's host).
    #[cfg(test)]
    pub fn without_holds(mut self) -> Self {
        self.holds = None;
        self
    }

    /// The backend's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn store(&self) -> &Store {
        &self.store
    }

    pub fn records(&self) -> &Records {
        &self.records
    }

    pub fn target(&self) -> &dyn Target {
        self.target.as_ref()
    }

    /// With another initiator (a test's, over its own sysfs).
    #[cfg(test)]
    pub fn with_initiator(mut self, initiator: Arc<dyn Initiator>) -> Self {
        self.initiator = initiator;
        self
    }

    pub fn terms(&self) -> &'static Terms {
        self.target.terms()
    }

    /// Whether this host has hold devices.
    pub fn holds(&self) -> bool {
        self.holds.is_some()
    }

    /// The export name of a volume.
    pub fn export_name(&self, id: &VolumeId) -> String {
        (self.export_name)(id.locator())
    }

    /// NOT_FOUND for another backend's volume.
    pub fn own_volume(&self, id: &VolumeId) -> Result<()> {
        if id.backend() != self.name {
            return Err(Error::not_found(format!(
                "volume {id} is not an {} volume",
                self.name
            )));
        }
        Ok(())
    }

    pub fn load(&self, id: &VolumeId) -> Result<Option<Record>> {
        self.records.load(id)
    }

    pub fn save(&self, id: &VolumeId, record: &Record) -> Result<()> {
        self.records.save(id, record)
    }

    pub(super) fn forget(&self, id: &VolumeId) -> Result<()> {
        self.records.remove(id)?;
        self.volumes.locked().remove(id.locator());
        Ok(())
    }

    /// The volume's own lock (see `volumes`).
    fn mutex(&self, id: &VolumeId) -> Arc<tokio::sync::Mutex<()>> {
        self.volumes
            .locked()
            .entry(id.locator().to_string())
            .or_default()
            .clone()
    }

    /// Takes the volume's own lock.
    pub async fn lock(&self, id: &VolumeId) -> tokio::sync::OwnedMutexGuard<()> {
        self.mutex(id).lock_owned().await
    }

    /// The volume's lock if no RPC holds it.
    fn try_lock(&self, id: &VolumeId) -> Option<tokio::sync::OwnedMutexGuard<()>> {
        self.mutex(id).try_lock_owned().ok()
    }

    /// Who can use the volume now: the hosts published to it and those
    /// connected to its export.
    pub(super) async fn users(&self, record: &Record) -> Result<BTreeSet<String>> {
        let connected = self
            .target
            .connected(&record.export)
            .await?
            .unwrap_or_default();
        let mut users: BTreeSet<String> = record.hosts.iter().cloned().collect();
        users.extend(connected);
        Ok(users)
    }

    /// Makes sure credential `user` is on the server with the secret given
    /// now (remembered for rebuilding). One name, one secret in each
    /// direction: a second secret for a name this driver knows is refused.
    async fn ensure_credential(&self, (user, secret): &Credential, outgoing: bool) -> Result<()> {
        {
            let mut known = self.secrets.locked();
            let key = (user.clone(), outgoing);
            if known.get(&key).is_some_and(|s| s != secret) {
                return Err(Error::precondition(format!(
                    "{} {user:?} exists on the target server with another secret; \
                     use one secret per {} name",
                    self.terms().credential,
                    self.terms().credential
                )));
            }
            known.insert(key, secret.clone());
        }
        self.target
            .add_credential(&(user.clone(), secret.clone()), outgoing)
            .await
    }

    /// The secret last given for credential `user` in a direction.
    fn secret(&self, user: &str, outgoing: bool) -> Option<String> {
        self.secrets
            .locked()
            .get(&(user.to_string(), outgoing))
            .cloned()
    }

    /// The volume's export, made again (with its grants and credentials)
    /// if the server lost it. An export whose credential's secret is not
    /// known here (the driver restarted too) is made with no grant: closed
    /// until the next ControllerPublish brings the secret.
    pub async fn ensure(&self, id: &VolumeId, record: &mut Record) -> Result<()> {
        if self.target.serves(&record.export).await? {
            return Ok(());
        }
        let store = self.store.get()?;
        let store_id = self.store.volume(id)?;
        let attachment = store
            .staging()?
            .node_attach(&store_id, &AttachContext::default())
            .await?;
        let Attachment::Device { path } = &attachment else {
            return Err(Error::internal("the store gave no block device"));
        };
        record.device = path.clone();
        record.attachment = attachment.clone();
        record.hold = match &self.holds {
            Some(holds) => {
                let name = Holds::name_for(&record.export);
                holds.ensure(&name, path).await?;
                Some(name)
            }
            None => None,
        };
        self.target.create(&record.export, &record.served()).await?;
        if record.thin_provisioning {
            self.target
                .set_thin_provisioning(&record.export, true)
                .await?;
        }
        let mut open = true;
        for (user, outgoing) in [
            (&record.incoming_user, false),
            (&record.outgoing_user, true),
        ] {
            let Some(user) = user else { continue };
            match self.secret(user, outgoing) {
                Some(secret) => {
                    self.ensure_credential(&(user.clone(), secret), outgoing)
                        .await?;
                    self.target.bind(&record.export, user, outgoing).await?;
                }
                None => open = false,
            }
        }
        let terms = self.terms();
        if open {
            for host in &record.hosts {
                self.target.grant(&record.export, host).await?;
            }
        } else {
            tracing::warn!(volume = %id, export = %record.export,
                "{} rebuilt with no {} granted: its credential's secret is not known since a \
                 restart; the next ControllerPublish opens it", terms.export, terms.host);
        }
        tracing::info!(volume = %id, export = %record.export, "{} rebuilt", terms.export);
        Ok(())
    }

    /// Reads the server again and rebuilds every recorded export it lost.
    pub async fn reconcile(&self) -> Result<()> {
        self.target.reread().await;
        for locator in self.records.locators()? {
            let Ok(id) = VolumeId::new(&self.name, &locator) else {
                continue;
            };
            // A volume an RPC is working on is that RPC's to mend.
            let Some(_volume) = self.try_lock(&id) else {
                continue;
            };
            let Some(mut record) = self.load(&id)? else {
                continue;
            };
            if !self.target.serves(&record.export).await? {
                let _hosts = self.hosts.read().await;
                self.ensure(&id, &mut record).await?;
                self.save(&id, &record)?;
            }
        }
        Ok(())
    }

    /// At start: a driver that died cutting a group left its holds
    /// suspended, and the hosts' I/O waits on them until they are resumed.
    pub async fn start(&self) -> Result<()> {
        if let (Some(_), Some(holds)) = (self.store.here(), &self.holds) {
            let records = self.records.clone();
            let ours = tokio::task::spawn_blocking(move || records.holds())
                .await
                .unwrap_or_default();
            match holds.resume_ours(&ours).await {
                Ok(resumed) => {
                    for name in resumed {
                        tracing::warn!(hold = %name, "resumed a hold device a group snapshot left suspended");
                    }
                }
                Err(e) => {
                    tracing::error!(error = %e.message, "could not look for hold devices left suspended")
                }
            }
        }
        Ok(())
    }

    /// The backend's health (where the store is): every export the server
    /// lost made again, at most every [`RECONCILE_EVERY`].
    pub async fn health(&self) -> Result<()> {
        if self.store.here().is_none() {
            return Ok(());
        }
        let due = {
            let mut last = self.last_reconcile.locked();
            let due = last.is_none_or(|t| t.elapsed() >= RECONCILE_EVERY);
            if due {
                *last = Some(Instant::now());
            }
            due
        };
        if due {
            self.reconcile().await?;
        }
        Ok(())
    }

    /// ControllerPublish's work on the server: the volume's export (made
    /// again if the server lost it), its credentials bound first, so a
    /// grant never opens an export that should ask, then its grants made
    /// whole (they may lag: an export rebuilt closed) with `host` among
    /// them.
    async fn open(
        &self,
        id: &VolumeId,
        record: &mut Record,
        incoming: &Option<Credential>,
        outgoing: &Option<Credential>,
        host: &str,
    ) -> Result<()> {
        self.ensure(id, record).await?;
        for (pair, outgoing_dir) in [(incoming, false), (outgoing, true)] {
            let slot = if outgoing_dir {
                &mut record.outgoing_user
            } else {
                &mut record.incoming_user
            };
            match pair {
                Some((user, secret)) => {
                    self.ensure_credential(&(user.clone(), secret.clone()), outgoing_dir)
                        .await?;
                    if let Some(old) = slot.as_ref().filter(|o| *o != user) {
                        self.target
                            .unbind(&record.export, old, outgoing_dir)
                            .await?;
                    }
                    match self.target.bind(&record.export, user, outgoing_dir).await {
                        Ok(()) => {}
                        // A second bind of an outgoing credential is
                        // refused, even the same one: this volume's
                        // publish bound it.
                        Err(e)
                            if outgoing_dir
                                && e.kind == Kind::FailedPrecondition
                                && slot.as_ref() == Some(user) => {}
                        Err(e) => return Err(e),
                    }
                    *slot = Some(user.clone());
                }
                None => {
                    if let Some(old) = slot.as_ref() {
                        return Err(Error::precondition(format!(
                            "volume {id} is published with {} {old:?}; \
                             ControllerPublish must bring the same secrets",
                            self.terms().credential
                        )));
                    }
                }
            }
        }
        for known in &record.hosts {
            self.target.grant(&record.export, known).await?;
        }
        self.target.grant(&record.export, host).await
    }

    /// ControllerPublish: grants the volume to `host` (the node `req`
    /// names) with the credentials the call brought, and returns its
    /// record. Nodes share a volume only when every publish of it is in
    /// one many-node mode ([`shared_as`]): all writers of a raw block
    /// volume, or all read-only. Otherwise a volume published to one node
    /// is not published to another (two nodes mounting one filesystem
    /// read-write corrupt it).
    pub async fn publish(
        &self,
        id: &VolumeId,
        host: &str,
        incoming: &Option<Credential>,
        outgoing: &Option<Credential>,
        req: &ControllerAttach,
    ) -> Result<Record> {
        self.own_volume(id)?;
        let terms = self.terms();
        let _volume = self.lock(id).await;
        let _hosts = self.hosts.read().await;
        let mut record = self.load(id)?.ok_or_else(|| Error::no_volume(id))?;
        let asked = shared_as(&req.terms());
        for other in record.hosts.iter().filter(|h| *h != host) {
            let theirs = record.terms.get(other).and_then(|t| shared_as(t));
            match (asked, theirs) {
                (Some(a), Some(t)) if a == t => {}
                (Some(_), _) | (_, Some(_)) => {
                    return Err(Error::precondition(format!(
                        "volume {id} is published to {} {other} (another node) as {}; \
                         nodes share it only when all publish it in one many-node mode \
                         (MULTI_NODE_MULTI_WRITER raw block, or MULTI_NODE_READER_ONLY)",
                        terms.host,
                        record
                            .terms
                            .get(other)
                            .map_or("single-node", String::as_str),
                    )));
                }
                (None, None) => {
                    return Err(Error::precondition(format!(
                        "volume {id} is published to {} {other} (another node); \
                         it is used by one node at a time: unpublish it there first",
                        terms.host
                    )));
                }
            }
        }
        if record.hosts.contains(host) {
            check_publish_terms(
                id,
                &req.node_id,
                record.terms.get(host).map(String::as_str),
                req,
            )?;
        }
        match self.open(id, &mut record, incoming, outgoing, host).await {
            // An export the server lost meanwhile: read the server and
            // make it again.
            Err(e) if e.kind == Kind::NotFound => {
                self.target.reread().await;
                self.open(id, &mut record, incoming, outgoing, host).await?;
            }
            done => done?,
        }
        record.terms.insert(host.to_string(), req.terms());
        record.hosts.insert(host.to_string());
        self.check_copy(id, &mut record).await?;
        self.save(id, &record)?;
        Ok(record)
    }

    /// ControllerUnpublish: takes `host` (every host, when `None`) off the
    /// volume, fencing it first.
    pub async fn unpublish(&self, id: &VolumeId, host: Option<&str>) -> Result<()> {
        if id.backend() != self.name {
            return Ok(());
        }
        let _volume = self.lock(id).await;
        let Some(mut record) = self.load(id)? else {
            return Ok(());
        };
        let gone: Vec<String> = match host {
            Some(h) => vec![h.to_string()],
            None => record.hosts.iter().cloned().collect(),
        };
        // Fenced whether or not the export is whole: one a driver left
        // half made (or off its ports) must not keep a host it will serve
        // again once it is mended.
        match self.fence(id, &record.export, &gone).await {
            // Gone from the server (removed behind the driver's back, or
            // never made): nothing to detach from.
            Err(e) if e.kind == Kind::NotFound => tracing::warn!(volume = %id,
                "the volume's {} is gone from {}: nothing to detach from",
                self.terms().export, self.terms().server),
            done => done?,
        }
        for h in &gone {
            record.hosts.remove(h);
            record.terms.remove(h);
        }
        self.save(id, &record)?;
        drop(_volume);
        self.forget_hosts(&gone).await
    }

    /// Has the server forget each of `hosts` no record of the backend
    /// names any more (their credentials with them, here too: a host's
    /// next publish may bring a new key). A record that cannot be read
    /// counts as naming every host.
    pub(super) async fn forget_hosts(&self, hosts: &[String]) -> Result<()> {
        if hosts.is_empty() {
            return Ok(());
        }
        let _alone = self.hosts.write().await;
        let mut unused: BTreeSet<&String> = hosts.iter().collect();
        for locator in self.records.locators()? {
            let Ok(id) = VolumeId::new(&self.name, &locator) else {
                continue;
            };
            match self.load(&id) {
                Ok(Some(r)) => unused.retain(|h| !r.hosts.contains(*h)),
                Ok(None) => {}
                Err(_) => return Ok(()),
            }
        }
        for host in unused {
            if self.target.forget_host(host).await? {
                let mut known = self.secrets.locked();
                known.remove(&(host.clone(), false));
                known.remove(&(host.clone(), true));
                tracing::info!(host = %host, "no volume of the backend is published to the {} any more: its entry and credentials are removed from {}",
                    self.terms().host, self.terms().server);
            }
        }
        Ok(())
    }

    /// Takes `hosts` off export `export`'s grants and closes their
    /// connections.
    async fn fence(&self, id: &VolumeId, export: &str, hosts: &[String]) -> Result<()> {
        for h in hosts {
            self.target.revoke(export, h).await?;
            // Fenced: a node still connected when its volume is detached
            // (a node lost, its teardown never came) loses its connections
            // before the detach answers, so none of its writes land once
            // the volume moves on. It cannot connect again: it just lost
            // its grant.
            let closed = self.target.disconnect(export, h).await?;
            if closed > 0 {
                tracing::warn!(volume = %id, host = %h, connections = closed,
                    "fenced: the node was still connected to the volume's {} at detach; its connections are closed",
                    self.terms().export);
            }
        }
        Ok(())
    }

    /// At CreateVolume: a copy the store just made (a restored snapshot, a
    /// clone) still carries its source's filesystem UUID. The record takes
    /// it over from the store with that UUID and a token, which
    /// ControllerPublish hands to the nodes.
    pub(super) async fn take_over_copy(&self, id: &VolumeId, record: &mut Record) -> Result<()> {
        let store = self.store.get()?;
        let store_id = self.store.volume(id)?;
        let none = AttachContext::default();
        if record.copy.is_some()
            || !store
                .device_mounting()?
                .node_copy_pending(&store_id, &none)
                .await?
        {
            return Ok(());
        }
        // Read through what the server serves: the hosts' writes are in
        // its cache until they reach the store's device.
        if let Some(uuid) = crate::host::fs::uuid(self.runner.as_ref(), &record.served()).await? {
            record.copy = Some(FsCopy {
                token: crate::id::random_hex(16)?,
                uuid,
            });
            // Recorded before the store forgets it.
            self.save(id, record)?;
        }
        store
            .device_mounting()?
            .node_copy_done(&store_id, &none)
            .await
    }

    /// At ControllerPublish: once the device shows a UUID of its own, a
    /// node has renewed it and the copy is let go.
    async fn check_copy(&self, id: &VolumeId, record: &mut Record) -> Result<()> {
        let Some(copy) = &record.copy else {
            return Ok(());
        };
        let now = crate::host::fs::uuid(self.runner.as_ref(), &record.served()).await?;
        if now.is_some_and(|u| u != copy.uuid) {
            tracing::info!(volume = %id, "the copy's filesystem has its own UUID now");
            record.copy = None;
        }
        Ok(())
    }
}
