//! Tests that need the real kernel: they run inside the QEMU guest that
//! `tests/guest/suite` boots (one boot for all of them), and are ignored by
//! a plain `cargo test`. Each fixture is proven by a test that uses it.

mod common;
mod two_nodes;

#[path = "guest/blocks.rs"]
mod blocks;
#[path = "guest/deployed.rs"]
mod deployed;
#[path = "guest/encryption.rs"]
mod encryption;
#[path = "guest/faults.rs"]
mod faults;
#[path = "guest/file.rs"]
mod file;
#[path = "guest/hardened.rs"]
mod hardened;
#[path = "guest/health.rs"]
mod health;
#[path = "guest/iolimits.rs"]
mod iolimits;
#[path = "guest/iscsi.rs"]
mod iscsi;
#[path = "guest/iscsi_copies.rs"]
mod iscsi_copies;
#[path = "guest/lvm.rs"]
mod lvm;
#[path = "guest/lvm_snapshots.rs"]
mod lvm_snapshots;
#[path = "guest/nfs.rs"]
mod nfs;
#[path = "guest/nfs_copies.rs"]
mod nfs_copies;
#[path = "guest/nvmf.rs"]
mod nvmf;
#[path = "guest/rbd.rs"]
mod rbd;
#[path = "guest/sanity.rs"]
mod sanity;
#[path = "guest/upgrade.rs"]
mod upgrade;

use common::fixtures::*;
use common::*;
use ferrovol::proto as pb;
use std::collections::HashMap;
use std::time::Duration;

use blocks::*;
