//! ferrovol: a Kubernetes CSI driver for NFS, Ceph RBD, iSCSI, LVM and
//! loop-mounted image files.

pub mod error;
pub mod exec;
pub mod mount;

/// Code generated from `proto/csi.proto`.
pub mod csi {
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("csi.v1");
}
