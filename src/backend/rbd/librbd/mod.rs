//! librbd and librados in the driver's process, on connections kept per
//! cephx user and key: a call costs the cluster's round trips, not a
//! process and a cephx handshake (about 30 ms each).
//!
//! The libraries are opened at run time (dlopen), so the binary runs where
//! Ceph's libraries are not installed; then the backend takes the command
//! line. The key reaches librados through `rados_conf_set` only: never a
//! file, an argument or a log. Every blocking call runs off the async
//! workers, under librados's own timeouts (monitor, OSD, mount) and an
//! outer deadline; a connection that timed out or was shut out by the
//! cluster is dropped, and the next call connects again.
//!
//! Two rooms: [`ffi`] holds every `unsafe` (the function table and the
//! handles over it), [`client`] the logic of the calls, with `unsafe`
//! forbidden.

mod client;
mod ffi;

pub use client::LibCluster;
