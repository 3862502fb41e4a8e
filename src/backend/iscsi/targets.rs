//! tgt as the export layer's target server ([`export::Target`]): tgtd's
//! targets by name, each a volume's export with its store device as LUN 1.
//! tgtd knows its targets by id; the ids are kept here.

use super::target::{TargetState, Tgtd};
use super::*;
use crate::backend::export::{self, target::Credential};
use crate::sync::LockExt;

/// What the iscsi backend's messages and health call things.
pub(super) static TERMS: export::Terms = export::Terms {
    export: "target",
    server: "tgtd",
    host: "initiator",
    connected: "logged in from",
    credential: "CHAP account",
    missing: reasons::TargetMissing,
    grows_only_unused: Some(
        "an iSCSI volume grows only while no node uses it (tgt cannot grow a LUN under I/O)",
    ),
};

/// A tgtd on this host, by target name.
pub struct Tgt {
    tgtd: Tgtd,
    tids: tokio::sync::Mutex<Tids>,
    /// The CHAP accounts made, by name: tgt's accounts are the server's,
    /// one secret a name whichever way it is bound.
    accounts: std::sync::Mutex<HashMap<String, String>>,
}

/// What the controller knows of tgtd's targets: their ids by name, read
/// from the server once (a listing grows with every target: 0.9 MB at 800)
/// and kept as the backend makes and deletes them, so creating and
/// publishing a volume never list them. Read again when the server is a new
/// run (it restarted and forgot every target), when a target the cache names
/// is gone, and at each reconcile. The targets on the server are the
/// driver's own (its own tgtd, on its own control port).
#[derive(Debug, Default)]
struct Tids {
    /// The server run the names were read from.
    instance: Option<u64>,
    by_iqn: HashMap<String, u32>,
    /// The highest id seen or handed out: a new target takes the next.
    last: u32,
}

impl Tids {
    fn load(&mut self, instance: u64, listed: &[TargetState]) {
        self.instance = Some(instance);
        self.by_iqn = listed.iter().map(|t| (t.iqn.clone(), t.tid)).collect();
        self.last = self
            .last
            .max(listed.iter().map(|t| t.tid).max().unwrap_or(0));
    }
}

/// One call to tgtd on a target id.
type Call<'a, T> = std::pin::Pin<Box<dyn std::future::Future<Output = Result<T>> + Send + 'a>>;

/// NOT_FOUND for a target tgtd does not have.
fn missing(iqn: &str) -> Error {
    Error::not_found(format!("target {iqn} is not served by tgtd"))
}

impl Tgt {
    pub fn new(control_port: u32, socket_dir: &Path) -> Self {
        Tgt {
            tgtd: Tgtd::new(control_port, socket_dir),
            tids: tokio::sync::Mutex::new(Tids::default()),
            accounts: std::sync::Mutex::new(HashMap::new()),
        }
    }

    /// The tid of target `iqn` if the server has it, from the cache (read
    /// from the server when it is a new run, or when `fresh` asks).
    async fn tid(&self, iqn: &str, fresh: bool) -> Result<Option<u32>> {
        let instance = self.tgtd.instance().await?;
        let mut tids = self.tids.lock().await;
        if fresh || tids.instance != Some(instance) {
            let listed = self.tgtd.targets().await?;
            tids.load(instance, &listed);
        }
        Ok(tids.by_iqn.get(iqn).copied())
    }

    /// `op` on target `iqn`'s id. A target the cache named that turned out
    /// gone: the server is read again and `op` tried once more on the id
    /// it has now; none is NOT_FOUND.
    async fn on<'a, T>(&self, iqn: &str, op: impl Fn(u32) -> Call<'a, T>) -> Result<T> {
        let Some(tid) = self.tid(iqn, false).await? else {
            return Err(missing(iqn));
        };
        match op(tid).await {
            Err(e) if e.kind == Kind::NotFound => match self.tid(iqn, true).await? {
                Some(now) => op(now).await,
                None => Err(missing(iqn)),
            },
            done => done,
        }
    }
}

#[async_trait::async_trait]
impl export::Target for Tgt {
    fn terms(&self) -> &'static export::Terms {
        &TERMS
    }

    async fn serves(&self, iqn: &str) -> Result<bool> {
        Ok(self.tid(iqn, false).await?.is_some())
    }

    async fn connected(&self, iqn: &str) -> Result<Option<Vec<String>>> {
        match self.on(iqn, |tid| Box::pin(self.tgtd.sessions(tid))).await {
            Ok(s) => Ok(Some(s)),
            Err(e) if e.kind == Kind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }

    async fn reread(&self) {
        self.tids.lock().await.instance = None;
    }

    async fn create(&self, iqn: &str, backing: &Path) -> Result<()> {
        let mut tries = 0;
        loop {
            let tid = {
                let mut tids = self.tids.lock().await;
                tids.last += 1;
                tids.last
            };
            match self.tgtd.create(tid, iqn, backing).await {
                Ok(()) => {
                    self.tids.lock().await.by_iqn.insert(iqn.to_string(), tid);
                    return Ok(());
                }
                // The id was taken behind the cache's back (or the name,
                // by a create of this volume that the cache missed): read
                // the server again and look.
                Err(e) if e.kind == Kind::AlreadyExists && tries < 3 => {
                    tries += 1;
                    if self.tid(iqn, true).await?.is_some() {
                        return Ok(());
                    }
                }
                Err(e) => return Err(e),
            }
        }
    }

    async fn delete(&self, iqn: &str) -> Result<()> {
        match self.on(iqn, |tid| Box::pin(self.tgtd.delete(tid))).await {
            Err(e) if e.kind == Kind::NotFound => {}
            done => done?,
        }
        self.tids.lock().await.by_iqn.remove(iqn);
        Ok(())
    }

    async fn refresh(&self, iqn: &str, backing: &Path) -> Result<()> {
        self.on(iqn, |tid| Box::pin(self.tgtd.refresh(tid, backing)))
            .await
    }

    async fn grant(&self, iqn: &str, initiator: &str) -> Result<()> {
        self.on(iqn, |tid| Box::pin(self.tgtd.allow(tid, initiator)))
            .await
    }

    async fn revoke(&self, iqn: &str, initiator: &str) -> Result<()> {
        self.on(iqn, |tid| Box::pin(self.tgtd.disallow(tid, initiator)))
            .await
    }

    async fn disconnect(&self, iqn: &str, initiator: &str) -> Result<usize> {
        self.on(iqn, |tid| {
            Box::pin(self.tgtd.close_connections(tid, initiator))
        })
        .await
    }

    /// tgt's accounts are the server's, either way: a name bound one way
    /// with one secret is refused another secret the other way.
    async fn add_credential(&self, (user, password): &Credential, _outgoing: bool) -> Result<()> {
        {
            let mut known = self.accounts.locked();
            if known.get(user).is_some_and(|p| p != password) {
                return Err(Error::precondition(format!(
                    "CHAP account {user:?} exists on the target server with another secret; \
                     use one secret per CHAP account name"
                )));
            }
            known.insert(user.clone(), password.clone());
        }
        self.tgtd.new_account(user, password).await.map(drop)
    }

    async fn bind(&self, iqn: &str, user: &str, outgoing: bool) -> Result<()> {
        self.on(iqn, |tid| {
            Box::pin(self.tgtd.bind_account(tid, user, outgoing))
        })
        .await
    }

    async fn unbind(&self, iqn: &str, user: &str, outgoing: bool) -> Result<()> {
        self.on(iqn, |tid| {
            Box::pin(self.tgtd.unbind_account(tid, user, outgoing))
        })
        .await
    }

    async fn set_thin_provisioning(&self, iqn: &str, on: bool) -> Result<()> {
        self.on(iqn, |tid| {
            Box::pin(self.tgtd.set_thin_provisioning(tid, on))
        })
        .await
    }
}
