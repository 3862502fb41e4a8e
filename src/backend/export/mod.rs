//! The export layer: what a backend that serves its volumes to nodes over
//! a network block protocol shares, whatever the protocol (iscsi today).
//! Such a backend keeps its volumes in a private store ([`store`]): a
//! backend of a kind whose descriptor says it can hold them, built from
//! the exporting backend's `[backend.store]` table and driven as a node
//! would drive it. What its controller made for each volume is in its
//! records ([`record`]). Its [`Exports`] make, grant, fence, grow, hold
//! and rebuild one export per volume on a target server, which the
//! protocol gives as a [`Target`]; a node connects to them through the
//! protocol's [`Initiator`]. The backend's controller and node calls are
//! theirs, with the protocol's words for what a host brings.

pub mod backend;
mod exports;
mod health;
pub mod initiator;
pub mod node;
pub mod record;
mod snapshots;
pub mod store;
pub mod target;
#[cfg(test)]
pub mod testing;
#[cfg(test)]
mod tests;
mod volumes;

pub use backend::{Credentials, Exported, Protocol};
pub use exports::{name_for, Exports, Setup};
pub use initiator::{Initiator, NodeTerms};
pub use store::Store;
pub use target::{Credential, Target, Terms};
