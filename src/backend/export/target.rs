//! The target seam: what the export layer asks of a target server, by the
//! export's name. An export serves one store device to the hosts granted
//! it (an iSCSI target with its LUN, an NVMe subsystem with its
//! namespace). A server's own handles (tgtd's target ids) stay inside its
//! implementation.
//!
//! Every change that finds the server already so succeeds: a grant that is
//! there, a revoke of a host that is not, a delete of an export that is
//! gone. A call on an export the server does not have is NOT_FOUND, after
//! the implementation read the server again (what it remembered of the
//! server may be stale).

use crate::error::Result;
use crate::plugin::health::Reason;
use std::path::Path;

/// The words a protocol's messages use, and its health reason for an
/// export the server lost.
#[derive(Debug, Clone, Copy)]
pub struct Terms {
    /// What one export is called ("target").
    pub export: &'static str,
    /// The server, as an operator knows it ("tgtd").
    pub server: &'static str,
    /// What a host is called ("initiator").
    pub host: &'static str,
    /// How a host that uses an export is said to ("logged in from").
    pub connected: &'static str,
    /// What a credential is named by ("CHAP account", "DH-HMAC-CHAP
    /// host").
    pub credential: &'static str,
    /// The health reason of an export its server no longer serves.
    pub missing: Reason,
    /// Why an export in use cannot grow, where the server cannot grow one
    /// under I/O; `None` where it can.
    pub grows_only_unused: Option<&'static str>,
}

/// A credential a host proves itself with (or the server proves itself
/// to a host with): a name and its secret.
pub type Credential = (String, String);

/// What the export layer needs from a target server.
#[async_trait::async_trait]
pub trait Target: Send + Sync {
    fn terms(&self) -> &'static Terms;

    /// Whether the server serves export `name`, as far as is known (what
    /// is remembered, read again when the server restarted).
    async fn serves(&self, name: &str) -> Result<bool>;

    /// The hosts connected to export `name` now, or `None` when the
    /// server has no such export.
    async fn connected(&self, name: &str) -> Result<Option<Vec<String>>>;

    /// Forgets what is remembered of the server: the next call reads it.
    async fn reread(&self);

    /// Makes export `name` serving `backing` (no host granted), or finds
    /// it made.
    async fn create(&self, name: &str, backing: &Path) -> Result<()>;

    /// Removes export `name`; refused by the server while hosts are
    /// connected.
    async fn delete(&self, name: &str) -> Result<()>;

    /// Makes the export report its backing's current size. Where the
    /// terms say it grows only unused, only for an export nobody uses: I/O
    /// in flight meanwhile may fail.
    async fn refresh(&self, name: &str, backing: &Path) -> Result<()>;

    /// Lets `host` connect to export `name`.
    async fn grant(&self, name: &str, host: &str) -> Result<()>;

    /// Takes `host` off export `name`'s grants: it cannot connect again.
    async fn revoke(&self, name: &str, host: &str) -> Result<()>;

    /// Closes every connection `host` has to export `name` (its commands
    /// not yet taken stop there); returns how many it closed. Call it
    /// after a revoke, or the host connects again.
    async fn disconnect(&self, name: &str, host: &str) -> Result<usize>;

    /// Makes the credential known to the server: one a host proves itself
    /// with, or (`outgoing`) one the server answers a host with. A name is
    /// one secret in each direction: the layer refuses a second before it
    /// asks.
    async fn add_credential(&self, credential: &Credential, outgoing: bool) -> Result<()>;

    /// Makes export `name` ask hosts for credential `user` (or, when
    /// `outgoing`, answer hosts with it). Binding an outgoing credential
    /// where the export has one is FAILED_PRECONDITION, even when it is
    /// this one: the caller knows which it bound.
    async fn bind(&self, name: &str, user: &str, outgoing: bool) -> Result<()>;

    async fn unbind(&self, name: &str, user: &str, outgoing: bool) -> Result<()>;

    /// Removes what the server keeps of `host` beyond its grants (its
    /// credentials), where nothing on the server grants it anything any
    /// more; the layer asks once no export of the backend is granted to
    /// it. Whether the server forgot it (its credentials may then be
    /// given anew). A server whose credentials are not a host's keeps
    /// them: the default.
    async fn forget_host(&self, _host: &str) -> Result<bool> {
        Ok(false)
    }

    /// Whether the export reports thin provisioning (discards served by
    /// punching holes in its backing). Initiators see a change at their
    /// next rescan or connection.
    async fn set_thin_provisioning(&self, name: &str, on: bool) -> Result<()>;
}
