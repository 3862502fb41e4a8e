//! ferrovol: a Kubernetes CSI driver for NFS, Ceph RBD, iSCSI, LVM and
//! loop-mounted image files.
//!
//! No unsafe code but where a syscall has no safe wrapper; each such place
//! allows it locally and says why.
#![deny(unsafe_code)]

pub mod app;
pub mod backend;
pub mod client;
pub mod config;
pub mod controller;
pub mod error;
pub mod exec;
pub mod format;
pub mod host;
pub mod id;
pub mod intents;
pub mod killpoint;
pub mod locks;
pub mod metrics;
pub mod mount;
pub mod node;
pub mod plugin;
pub mod records;
pub mod state;
pub mod sync;

pub mod server;
pub mod service;

/// Code generated from `proto/csi.proto`.
pub mod proto {
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("csi.v1");
}
