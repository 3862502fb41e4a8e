//! The backend's targets on tgtd: made for a volume, their accounts and sessions, reconciled with the records, opened at publish.

use super::*;

impl IscsiBackend {
    /// Who can use the volume now: the initiators published to it and
    /// those logged in to its target.
    pub(super) async fn users(&self, record: &Record) -> Result<BTreeSet<String>> {
        let sessions = self
            .target_sessions(&record.export)
            .await?
            .map(|(_, s)| s)
            .unwrap_or_default();
        let mut users: BTreeSet<String> = record.hosts.iter().cloned().collect();
        users.extend(sessions);
        Ok(users)
    }

    /// Makes sure account `user` exists on the server with the password
    /// given now (remembered for rebuilding). One name, one secret: a
    /// second secret for a name this driver knows is refused.
    pub(super) async fn ensure_account(&self, user: &str, password: &str) -> Result<()> {
        {
            let mut known = self.passwords.locked();
            if known.get(user).is_some_and(|p| p != password) {
                return Err(Error::precondition(format!(
                    "CHAP account {user:?} exists on the target server with another secret; \
                     use one secret per account name"
                )));
            }
            known.insert(user.to_string(), password.to_string());
        }
        self.target.new_account(user, password).await.map(|_| ())
    }

    /// The tid of target `iqn` if the server has it, from the cache (read
    /// from the server when it is a new run, or when `fresh` asks).
    pub(super) async fn tid_of(&self, iqn: &str, fresh: bool) -> Result<Option<u32>> {
        let instance = self.target.instance().await?;
        let mut tids = self.tids.lock().await;
        if fresh || tids.instance != Some(instance) {
            let listed = self.target.targets().await?;
            tids.load(instance, &listed);
        }
        Ok(tids.by_iqn.get(iqn).copied())
    }

    /// Target `iqn`'s id and the initiators logged in to it, if the server
    /// has it (a target the cache names that turned out gone: the server
    /// is read again and looked at once more).
    pub(super) async fn target_sessions(&self, iqn: &str) -> Result<Option<(u32, Vec<String>)>> {
        let Some(tid) = self.tid_of(iqn, false).await? else {
            return Ok(None);
        };
        match self.target.sessions(tid).await {
            Ok(s) => Ok(Some((tid, s))),
            Err(e) if e.kind == Kind::NotFound => match self.tid_of(iqn, true).await? {
                Some(tid) => Ok(Some((tid, self.target.sessions(tid).await?))),
                None => Ok(None),
            },
            Err(e) => Err(e),
        }
    }

    /// Forgets what the cache knows: the next lookup reads the server.
    pub(super) async fn forget_tids(&self) {
        self.tids.lock().await.instance = None;
    }

    /// The volume's target, made again (with its LUN, ACL and accounts)
    /// if the server lost it. A target whose CHAP secret is not known here
    /// (the driver restarted too) is made with an empty ACL: closed until
    /// the next ControllerPublish brings the secret.
    pub(super) async fn ensure_target(&self, id: &VolumeId, record: &mut Record) -> Result<u32> {
        if let Some(tid) = self.tid_of(&record.export, false).await? {
            return Ok(tid);
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
        let mut tries = 0;
        let tid = loop {
            let tid = {
                let mut tids = self.tids.lock().await;
                tids.last += 1;
                tids.last
            };
            match self
                .target
                .create(tid, &record.export, &record.served())
                .await
            {
                Ok(()) => {
                    self.tids
                        .lock()
                        .await
                        .by_iqn
                        .insert(record.export.clone(), tid);
                    break tid;
                }
                // The id was taken behind the cache's back (or the name,
                // by a create of this volume that the cache missed): read
                // the server again and look.
                Err(e) if e.kind == Kind::AlreadyExists && tries < 3 => {
                    tries += 1;
                    if let Some(tid) = self.tid_of(&record.export, true).await? {
                        return Ok(tid);
                    }
                }
                Err(e) => return Err(e),
            }
        };
        if record.thin_provisioning {
            self.target.set_thin_provisioning(tid, true).await?;
        }
        let mut open = true;
        for (user, outgoing) in [
            (&record.incoming_user, false),
            (&record.outgoing_user, true),
        ] {
            let Some(user) = user else { continue };
            match self.password(user) {
                Some(password) => {
                    self.ensure_account(user, &password).await?;
                    self.target.bind_account(tid, user, outgoing).await?;
                }
                None => open = false,
            }
        }
        if open {
            for initiator in &record.hosts {
                self.target.allow(tid, initiator).await?;
            }
        } else {
            tracing::warn!(volume = %id, iqn = %record.export,
                "target rebuilt without its ACL: its CHAP secret is not known since a restart; \
                 the next ControllerPublish opens it");
        }
        tracing::info!(volume = %id, iqn = %record.export, tid, "target rebuilt");
        Ok(tid)
    }

    /// Reads the server's targets again (the cache follows them) and
    /// rebuilds every recorded target it lost.
    pub(super) async fn reconcile(&self) -> Result<()> {
        self.forget_tids().await;
        let locators = self.records.locators()?;
        for locator in locators {
            let Ok(id) = VolumeId::new(&self.name, &locator) else {
                continue;
            };
            // A volume an RPC is working on is that RPC's to mend.
            let Ok(_volume) = self.volume_mutex(&id).try_lock_owned() else {
                continue;
            };
            let Some(mut record) = self.load(&id)? else {
                continue;
            };
            if self.tid_of(&record.export, false).await?.is_none() {
                self.ensure_target(&id, &mut record).await?;
                self.save(&id, &record)?;
            }
        }
        Ok(())
    }

    /// ControllerPublish's work on the server: the volume's target (made
    /// again if the server lost it), its CHAP accounts bound first, so the
    /// ACL never opens a target that should ask, then the ACL made whole
    /// (it may lag: a target rebuilt closed) with `initiator` in it.
    pub(super) async fn open_target(
        &self,
        id: &VolumeId,
        record: &mut Record,
        incoming: &Option<Chap>,
        outgoing: &Option<Chap>,
        initiator: &str,
    ) -> Result<u32> {
        let tid = self.ensure_target(id, record).await?;
        for (pair, outgoing_dir) in [(incoming, false), (outgoing, true)] {
            let slot = if outgoing_dir {
                &mut record.outgoing_user
            } else {
                &mut record.incoming_user
            };
            match pair {
                Some((user, password)) => {
                    self.ensure_account(user, password).await?;
                    if let Some(old) = slot.as_ref().filter(|o| *o != user) {
                        self.target.unbind_account(tid, old, outgoing_dir).await?;
                    }
                    match self.target.bind_account(tid, user, outgoing_dir).await {
                        Ok(()) => {}
                        // tgt refuses a second bind of an outgoing account,
                        // even the same one: this volume's publish bound it.
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
                            "volume {id} is published with CHAP account {old:?}; \
                             ControllerPublish must bring the same secrets"
                        )));
                    }
                }
            }
        }
        for known in &record.hosts {
            self.target.allow(tid, known).await?;
        }
        self.target.allow(tid, initiator).await?;
        Ok(tid)
    }
}
