//! Volumes made by every earlier state format, adopted by this driver.

use super::*;

/// Upgrades on the backends that need the real kernel (the `file` one is
/// `tests/upgrade.rs`'s): for each, a volume staged and published with a
/// pod writing to it, the driver stopped as a DaemonSet roll stops it, its
/// records (the state directory's, the iscsi and nvmf stores', the nfs export's,
/// the LV's tags, the rbd image's metadata) replaced by each format's
/// fixture (`tests/fixtures/upgrade/format-N/<backend>.json`, see
/// `common::upgrade`), and the current driver started on them: it knows
/// the volume staged and published (stage and publish again add no
/// mount), the pod's writes never stop, a second pod is published from the
/// same staged mount, and it takes everything down and deletes the volume,
/// leaving no mount, record, LV, image, mapping or session.
#[tokio::test]
#[ignore = "needs the real-kernel guest: run tests/guest/suite"]
async fn guest_volumes_of_every_backend_survive_every_state_format() {
    require_guest();
    let every = EveryBackend::new("upgrade", 256, true);
    let (vg, tgtd, cluster, config) = (&every.vg, &every.tgtd, every.cluster, &every.config);
    let nvmet = &every.nvmet;
    let nfs = every.nfs.as_ref().unwrap();
    let outside = Outside { vg, cluster };
    for format in common::upgrade::formats() {
        for backend in ["lvm", "nfs", "iscsi", "rbd", "nvmf"] {
            adopts(config, backend, format, nfs, tgtd, nvmet, &outside).await;
        }
    }
}

/// What a backend keeps outside files: the LVs' tags, the rbd images'
/// metadata, as records named `lvm-tags/<lv>` and `rbd-meta/<image>`.
pub(crate) struct Outside<'a> {
    vg: &'a LvmVg,
    cluster: &'a CephCluster,
}

impl Outside<'_> {
    /// Whether a record's name is one of these.
    fn names(record: &str) -> bool {
        record.starts_with("lvm-tags/") || record.starts_with("rbd-meta/")
    }

    fn lvs(&self) -> Vec<String> {
        self.vg
            .lvm("lvs", &["--noheadings", "-o", "lv_name", &self.vg.name])
            .split_whitespace()
            .map(str::to_string)
            .collect()
    }

    fn images(&self) -> Vec<String> {
        self.cluster
            .rbd(&["ls", "rbd"])
            .split_whitespace()
            .map(str::to_string)
            .collect()
    }

    fn read(&self) -> common::upgrade::Records {
        let mut out = common::upgrade::Records::new();
        for lv in self.lvs() {
            let tags = self.vg.lv_tags(&lv).unwrap_or_default();
            let tags: Vec<serde_json::Value> = tags
                .split(',')
                .filter(|t| !t.is_empty())
                .map(|t| t.into())
                .collect();
            out.insert(format!("lvm-tags/{lv}"), tags.into());
        }
        for image in self.images() {
            let meta = self.cluster.rbd(&[
                "image-meta",
                "list",
                &format!("rbd/{image}"),
                "--format",
                "json",
            ]);
            let meta: serde_json::Value = if meta.trim().is_empty() {
                serde_json::json!({})
            } else {
                serde_json::from_str(&meta).unwrap()
            };
            out.insert(format!("rbd-meta/{image}"), meta);
        }
        out
    }

    /// Takes away what `old` names of its kind and puts what `new` does.
    fn replace(&self, old: &common::upgrade::Records, new: &common::upgrade::Records) {
        for (records, put) in [(old, false), (new, true)] {
            for (name, v) in records {
                if let Some(lv) = name.strip_prefix("lvm-tags/") {
                    let target = format!("{}/{lv}", self.vg.name);
                    let flag = if put { "--addtag" } else { "--deltag" };
                    let mut args = vec!["-q"];
                    for tag in v.as_array().unwrap() {
                        args.extend([flag, tag.as_str().unwrap()]);
                    }
                    if args.len() > 1 {
                        args.push(&target);
                        self.vg.lvm("lvchange", &args);
                    }
                } else if let Some(image) = name.strip_prefix("rbd-meta/") {
                    let image = format!("rbd/{image}");
                    for (key, value) in v.as_object().unwrap() {
                        match put {
                            true => self.cluster.rbd(&[
                                "image-meta",
                                "set",
                                &image,
                                key,
                                value.as_str().unwrap(),
                            ]),
                            false => self.cluster.rbd(&["image-meta", "remove", &image, key]),
                        };
                    }
                }
            }
        }
    }
}

pub(crate) async fn adopts(
    config: &str,
    backend: &str,
    format: u32,
    nfs: &NfsServer,
    tgtd: &Tgtd,
    nvmet: &NvmetPort,
    outside: &Outside<'_>,
) {
    use common::upgrade::{self, Run};
    if format < ferrovol::format::FORMAT
        && !upgrade::fixtures()
            .join(format!("format-{format}/{backend}.json"))
            .exists()
    {
        return; // the backend's records had no other format then
    }
    let mut h = Harness::start_with(Some(config)).await;
    let fs = if backend == "nfs" { "" } else { "ext4" };
    let cap = mount_cap(fs, SNW);
    let name = format!("pvc-upgrade-{backend}");
    let mut req = create_req(&name, 32 * MIB, cap.clone());
    req.parameters.insert("backend".into(), backend.into());
    let attach = matches!(backend, "iscsi" | "rbd" | "nvmf");
    let secrets = match backend {
        "rbd" => outside.cluster.secrets(),
        _ => HashMap::new(),
    };
    req.secrets = secrets.clone();
    let vol = match attach {
        true => h.provision_attached(req).await,
        false => h.provision_req(req).await,
    };
    let (staging, target) = (&vol.staging, &vol.target);
    std::fs::write(target.join("kept"), upgrade::KEPT).unwrap();
    let pod = Steady::start(target.join("pod-writes"));
    assert!(h.terminate().success(), "{}", h.log());

    let state = h.state_dir();
    let (pool, nvmf_pool) = (h.path("pool"), h.path("nvmf-pool"));
    let roots = [
        ("", state.as_path()),
        ("iscsi-pool/", pool.as_path()),
        ("nvmf-pool/", nvmf_pool.as_path()),
        ("nfs-export/", nfs.export.as_path()),
    ];
    let roots: Vec<_> = roots.into_iter().filter(|(_, p)| p.is_dir()).collect();
    let mut written = upgrade::read(&roots);
    let outside_written = outside.read();
    written.extend(outside_written.clone());
    // This run's values: folders, the version, the portal, this
    // machine's initiator name, the iscsi store's device, the rbd
    // mapping's client.
    let mut values: Vec<(String, String)> = vec![
        (h.dir.path().display().to_string(), "@DIR@".into()),
        (env!("CARGO_PKG_VERSION").to_string(), "@VERSION@".into()),
        (nfs.export.display().to_string(), "@EXPORT@".into()),
        (tgtd.portal(), "@PORTAL@".into()),
        (nvmet.portal(), "@NVMF_PORTAL@".into()),
        (nvmet.host_nqn.clone(), "@HOST_NQN@".into()),
    ];
    let initiator = std::fs::read_to_string("/etc/iscsi/initiatorname.iscsi").unwrap_or_default();
    if let Some(name) = initiator
        .lines()
        .find_map(|l| l.trim().strip_prefix("InitiatorName="))
    {
        values.push((name.to_string(), "@INITIATOR@".into()));
    }
    for (name, record) in &written {
        if name.starts_with("iscsi/") || name.starts_with("nvmf/") {
            if let Some(device) = record["device"].as_str() {
                values.push((device.to_string(), "@STORE_DEVICE@".into()));
            }
        }
        if name.starts_with("rbd-meta/") {
            for (key, value) in record.as_object().unwrap() {
                if key.starts_with("ferrovol.client.") {
                    values.push((value.as_str().unwrap().to_string(), "@RBD_CLIENT@".into()));
                }
            }
        }
    }
    let run = Run::new(values, &written);
    let fixture = upgrade::expect_fixture(backend, format, &written, &run);
    let (fixture_outside, fixture_files): (upgrade::Records, upgrade::Records) =
        fixture.into_iter().partition(|(k, _)| Outside::names(k));
    let written_files: upgrade::Records = written
        .into_iter()
        .filter(|(k, _)| !Outside::names(k))
        .collect();
    upgrade::replace(&roots, &written_files, &fixture_files);
    outside.replace(&outside_written, &fixture_outside);

    h.spawn().await;
    let publish_context = match attach {
        true => h.attach_here(&vol.id, &cap, &secrets).await,
        false => HashMap::new(),
    };
    let stage = pb::NodeStageVolumeRequest {
        secrets: secrets.clone(),
        publish_context,
        ..stage_req(&vol.id, staging, cap.clone())
    };
    let what = format!("{backend} format {format}");
    upgrade::adopted(&h, &vol, &cap, stage, pod, Duration::from_secs(120), &what).await;
    h.unpublish_unstage(&vol.id, staging, target).await;
    if attach {
        h.controller()
            .controller_unpublish_volume(pb::ControllerUnpublishVolumeRequest {
                volume_id: vol.id.clone(),
                node_id: h.node_id().await,
                secrets: secrets.clone(),
            })
            .await
            .unwrap_or_else(|e| panic!("{backend}: ControllerUnpublish: {e:?}\n{}", h.log()));
    }
    h.controller()
        .delete_volume(pb::DeleteVolumeRequest {
            volume_id: vol.id.clone(),
            secrets,
        })
        .await
        .unwrap_or_else(|e| panic!("{backend}: DeleteVolume: {e:?}\n{}", h.log()));

    // The driver stops (the nfs controller's working mount goes with it):
    // nothing of the volume is left.
    assert!(h.terminate().success(), "{}", h.log());
    assert!(
        h.mounts().is_empty(),
        "{backend}: mounts left: {:?}",
        h.mounts()
    );
    let left: Vec<String> = upgrade::read(&roots)
        .into_keys()
        .chain(outside.read().into_keys())
        .filter(|k| k != ferrovol::format::FILE && !k.ends_with(".log"))
        .collect();
    assert!(left.is_empty(), "{backend} format {format}: left: {left:?}");
    let sessions = Iscsid::sessions();
    assert!(
        sessions.is_empty(),
        "{backend}: sessions left: {sessions:?}"
    );
    assert_eq!(
        nvmet.controllers(),
        Vec::<String>::new(),
        "{backend}: NVMe controllers left"
    );
    assert_eq!(
        nvmet.subsystems(),
        Vec::<String>::new(),
        "{backend}: nvmet subsystems left"
    );
    let mapped = std::fs::read_dir("/sys/bus/rbd/devices")
        .map(|d| d.count())
        .unwrap_or(0);
    assert_eq!(mapped, 0, "{backend}: rbd devices left mapped");
}
