//! The export layer: what a backend that serves its volumes to nodes over
//! a network block protocol shares, whatever the protocol (iscsi today).
//! Such a backend keeps its volumes in a private store ([`store`]): a
//! backend of a kind whose descriptor says it can hold them, built from
//! the exporting backend's `[backend.store]` table and driven as a node
//! would drive it. What its controller made for each volume is in its
//! records ([`record`]).

pub mod record;
pub mod store;

pub use store::Store;
