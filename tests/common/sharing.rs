//! Two pods on one node sharing a volume, as kubelet asks for it: one
//! stage, a publish per pod, under each single-node access mode. Shared by
//! the host test (file backend) and the guest test (a remote block backend).

use super::*;
use std::io::{Read, Seek, SeekFrom, Write};

/// The single-node modes, in the order the walk takes them: the writers
/// first (one of them writes what the read-only pass reads back).
const MODES: [(i32, &str); 4] = [
    (SNW, "single_node_writer"),
    (SNMW, "single_node_multi_writer"),
    (SNSW, "single_node_single_writer"),
    (SNRO, "single_node_reader_only"),
];

/// What the writers' pass leaves for the read-only pass to find.
const KEPT: &[u8] = b"written by a single_node_writer pod";

/// A volume's data as a pod sees it at a target: a file in a mounted
/// filesystem, or bytes at an offset of a raw block device.
#[derive(Clone, Copy)]
enum Access {
    Mount,
    Block,
}

impl Access {
    fn write(self, target: &Path, slot: u64, bytes: &[u8]) -> std::io::Result<()> {
        match self {
            Access::Mount => {
                let mut f = std::fs::File::create(target.join(format!("slot-{slot}")))?;
                f.write_all(bytes)?;
                f.sync_all()
            }
            Access::Block => {
                let mut dev = std::fs::OpenOptions::new().write(true).open(target)?;
                dev.seek(SeekFrom::Start(Self::offset(slot)))?;
                dev.write_all(bytes)?;
                dev.sync_all()
            }
        }
    }

    fn read(self, target: &Path, slot: u64, len: usize) -> Vec<u8> {
        let mut buf = vec![0u8; len];
        match self {
            Access::Mount => {
                let got = std::fs::read(target.join(format!("slot-{slot}"))).unwrap();
                return got;
            }
            Access::Block => {
                let mut dev = std::fs::File::open(target).unwrap();
                dev.seek(SeekFrom::Start(Self::offset(slot))).unwrap();
                dev.read_exact(&mut buf).unwrap();
            }
        }
        buf
    }

    /// Slots sit 1 MiB in (past any header) a block apart.
    fn offset(slot: u64) -> u64 {
        MIB as u64 + slot * 4096
    }
}

/// The kernel name of the block device at `path` (a device node, or a
/// bind of one).
fn device_name(path: &Path) -> String {
    use std::os::unix::fs::MetadataExt;
    let rdev = std::fs::metadata(path).unwrap().rdev();
    let (major, minor) = (nix::sys::stat::major(rdev), nix::sys::stat::minor(rdev));
    let link = std::fs::read_link(format!("/sys/dev/block/{major}:{minor}")).unwrap();
    link.file_name().unwrap().to_string_lossy().into_owned()
}

/// Loop devices whose backing is `/dev/<name>`: the read-only devices
/// that read-only block publishes make over the staged device.
fn loops_over(name: &str) -> Vec<String> {
    let want = format!("/dev/{name}");
    let mut out = Vec::new();
    for e in std::fs::read_dir("/sys/block").unwrap().flatten() {
        let b = std::fs::read_to_string(e.path().join("loop/backing_file")).unwrap_or_default();
        if b.trim_end() == want {
            out.push(e.file_name().to_string_lossy().into_owned());
        }
    }
    out
}

/// `cap` under another access mode.
fn with_mode(cap: &pb::VolumeCapability, mode: i32) -> pb::VolumeCapability {
    pb::VolumeCapability {
        access_mode: Some(pb::volume_capability::AccessMode { mode }),
        ..cap.clone()
    }
}

impl Harness {
    /// Two pods on this node sharing the volume that `stage` names (its
    /// id, staging path, capability, contexts and secrets; the volume
    /// attached already where its backend attaches), under each
    /// single-node mode in turn, staged afresh under it:
    ///
    /// - SINGLE_NODE_WRITER and SINGLE_NODE_MULTI_WRITER: a second target
    ///   is published, both writable, what one writes the other reads;
    ///   a driver killed and started again keeps both (they still serve,
    ///   the same publish again is OK); unpublishing one leaves the other
    ///   serving, reads and writes.
    /// - SINGLE_NODE_SINGLE_WRITER: the second target is
    ///   FAILED_PRECONDITION, nothing made there; once the first is
    ///   unpublished the same call goes through.
    /// - SINGLE_NODE_READER_ONLY: two read-only targets, both reading what
    ///   the writers left, neither taking a write.
    ///
    /// Every pass ends unpublished and unstaged with nothing mounted
    /// under the test's folder and no read-only device left over the
    /// staged one.
    pub async fn two_pods_on_one_node(&mut self, stage: &pb::NodeStageVolumeRequest, name: &str) {
        let cap = stage.volume_capability.clone().unwrap();
        let access = match cap.access_type {
            Some(pb::volume_capability::AccessType::Block(_)) => Access::Block,
            _ => Access::Mount,
        };
        let id = stage.volume_id.clone();
        let staging = PathBuf::from(&stage.staging_target_path);
        let (a, b) = (
            self.path(&format!("kubelet/pods/{name}-a")),
            self.path(&format!("kubelet/pods/{name}-b")),
        );
        for (slot, (mode, mode_name)) in MODES.into_iter().enumerate() {
            let slot = slot as u64;
            let cap = with_mode(&cap, mode);
            let readonly = mode == SNRO;
            let publish = |target: &Path| pb::NodePublishVolumeRequest {
                volume_context: stage.volume_context.clone(),
                secrets: stage.secrets.clone(),
                ..publish_req(&id, &staging, target, cap.clone(), readonly)
            };
            self.node()
                .node_stage_volume(pb::NodeStageVolumeRequest {
                    volume_capability: Some(cap.clone()),
                    ..stage.clone()
                })
                .await
                .unwrap_or_else(|e| panic!("{mode_name}: stage: {e:?}\n{}", self.log()));
            self.node().node_publish_volume(publish(&a)).await.unwrap();
            let second = self.node().node_publish_volume(publish(&b)).await;
            if mode == SNSW {
                let e = second.expect_err("a second single-writer target was published");
                assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e:?}");
                assert!(
                    e.message().contains(&a.display().to_string()),
                    "the refusal names the publish in the way: {e:?}"
                );
                assert!(!b.exists(), "{mode_name}: a refused target was made");
                access.write(&a, slot, mode_name.as_bytes()).unwrap();
                self.node()
                    .node_unpublish_volume(unpublish_req(&id, &a))
                    .await
                    .unwrap();
                self.node().node_publish_volume(publish(&b)).await.unwrap();
                assert_eq!(access.read(&b, slot, mode_name.len()), mode_name.as_bytes());
            } else {
                second.unwrap_or_else(|e| panic!("{mode_name}: second target: {e:?}"));
                self.check_both_serve(access, &a, &b, slot, readonly, mode_name);
                // The node plugin dies and comes back (a crash, a
                // DaemonSet rollout): both pods keep their volume.
                self.kill();
                self.spawn().await;
                self.check_both_serve(access, &b, &a, slot + 16, readonly, mode_name);
                for t in [&a, &b] {
                    self.node().node_publish_volume(publish(t)).await.unwrap();
                }
                // One pod goes; the other keeps reading and writing.
                self.node()
                    .node_unpublish_volume(unpublish_req(&id, &a))
                    .await
                    .unwrap();
                assert!(!a.exists(), "{mode_name}: unpublished target left");
                match readonly {
                    true => assert_eq!(access.read(&b, 0, KEPT.len()), KEPT),
                    false => {
                        let last = format!("{mode_name} after the other pod left");
                        access.write(&b, slot + 32, last.as_bytes()).unwrap();
                        assert_eq!(access.read(&b, slot + 32, last.len()), last.as_bytes());
                    }
                }
            }
            let device = matches!(access, Access::Block).then(|| device_name(&b));
            self.node()
                .node_unpublish_volume(unpublish_req(&id, &b))
                .await
                .unwrap();
            assert!(!b.exists(), "{mode_name}: unpublished target left");
            if let Some(device) = device {
                assert!(
                    loops_over(&device).is_empty(),
                    "{mode_name}: read-only devices left over {device}: {:?}",
                    loops_over(&device)
                );
            }
            self.node()
                .node_unstage_volume(unstage_req(&id, &staging))
                .await
                .unwrap();
            assert!(self.mounts().is_empty(), "{mode_name}: {:?}", self.mounts());
        }
    }

    /// Both targets serve one volume: writable ones take a write through
    /// `one` that reads back through `other`, and the reverse; read-only
    /// ones read what the writers' pass left and refuse a write.
    fn check_both_serve(
        &self,
        access: Access,
        one: &Path,
        other: &Path,
        slot: u64,
        readonly: bool,
        mode_name: &str,
    ) {
        if readonly {
            for t in [one, other] {
                assert_eq!(access.read(t, 0, KEPT.len()), KEPT, "{mode_name}");
                assert!(
                    access.write(t, slot, b"must not land").is_err(),
                    "{mode_name}: a read-only target took a write at {}",
                    t.display()
                );
            }
            return;
        }
        // The first writers' pass leaves slot 0 for the read-only pass.
        let first = match slot {
            0 => KEPT.to_vec(),
            _ => format!("{mode_name}: through {}", one.display()).into_bytes(),
        };
        access.write(one, slot, &first).unwrap();
        assert_eq!(access.read(other, slot, first.len()), first, "{mode_name}");
        let back = format!("{mode_name}: back through {}", other.display()).into_bytes();
        access.write(other, slot + 1, &back).unwrap();
        assert_eq!(access.read(one, slot + 1, back.len()), back, "{mode_name}");
    }
}
