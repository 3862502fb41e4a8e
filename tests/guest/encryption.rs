//! Encrypted (LUKS2) volumes on every block backend, and a format cut
//! short.

use super::*;

/// The backing device of LUKS mapping `name` (`dmsetup deps -o
/// blkdevname`: its kernel name, which is under /dev for dm devices too).
pub(crate) fn crypt_backing(name: &str) -> std::path::PathBuf {
    let out = std::process::Command::new("dmsetup")
        .args(["deps", "-o", "blkdevname", name])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let dev = text
        .split_once('(')
        .and_then(|(_, r)| r.split_once(')'))
        .map(|(d, _)| d.to_string())
        .unwrap_or_else(|| panic!("dmsetup deps {name}: {text}"));
    std::path::Path::new("/dev").join(dev)
}

/// Whether a sector of the device or file at `path` begins with `needle`,
/// read after the caches are dropped (what is on the device, not what was
/// cached).
pub(crate) fn holds(path: &std::path::Path, needle: &[u8]) -> bool {
    std::fs::write("/proc/sys/vm/drop_caches", "3").unwrap();
    // The needle opens a file's first block, and a filesystem's blocks sit
    // on sector boundaries of every layer below it (a LUKS header is whole
    // sectors): a look at the start of each 512-byte sector finds it. A
    // look at every offset costs minutes under TCG in a debug build.
    std::fs::read(path)
        .unwrap()
        .chunks(512)
        .any(|sector| sector.starts_with(needle))
}

/// A filesystem's UUID (blkid).
pub(crate) fn fs_uuid(dev: &std::path::Path) -> String {
    let out = std::process::Command::new("blkid")
        .args(["-p", "-s", "UUID", "-o", "value"])
        .arg(dev)
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// The key derivation's memory in KiB the test of every block backend
/// sets, as luksDump shows it.
const LIGHT_KDF_KIB: u32 = 32;

/// Encryption on one block backend, a mounted ext4 volume and (`block`) a
/// raw block one: see [`guest_encrypted_volumes_on_file_and_lvm`].
pub(crate) async fn encrypted_volume_on(
    h: &mut Harness,
    backend: &str,
    attach: bool,
    backend_secrets: &HashMap<String, String>,
    block: bool,
    kdf_kib: u32,
) {
    let key = format!("passphrase of {backend} volumes, not a word of it logged");
    let mut secrets = backend_secrets.clone();
    secrets.insert("encryptionPassphrase".into(), key.clone());
    let cap = mount_cap("ext4", SNW);
    let request = |name: &str, cap: pb::VolumeCapability, from: Option<String>| {
        let mut req = create_req(name, 32 * MIB, cap);
        req.parameters.insert("backend".into(), backend.into());
        if from.is_none() {
            req.parameters.insert("encrypted".into(), "true".into());
        }
        req.volume_content_source = from.as_deref().map(snapshot_source);
        req.secrets = secrets.clone();
        req
    };
    async fn bring_up_on(h: &Harness, attach: bool, req: pb::CreateVolumeRequest) -> Published {
        match attach {
            true => h.provision_attached(req).await,
            false => h.provision_req(req).await,
        }
    }
    if block {
        // Encryption asked for over unencrypted data (a volume context
        // that says so, on a volume with a filesystem): refused, nothing
        // formatted, the data still there.
        let mut req = request(&format!("luks-{backend}-plain"), cap.clone(), None);
        req.parameters.remove("encrypted");
        let plain = bring_up_on(h, attach, req).await;
        std::fs::write(plain.target.join("kept"), b"plain data").unwrap();
        h.unpublish_unstage(&plain.id, &plain.staging, &plain.target)
            .await;
        let e = h
            .node()
            .node_stage_volume(pb::NodeStageVolumeRequest {
                secrets: secrets.clone(),
                volume_context: HashMap::from([("encrypted".into(), "luks2".into())]),
                ..stage_req(&plain.id, &plain.staging, cap.clone())
            })
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e:?}");
        assert!(e.message().contains("unencrypted"), "{e:?}");
        h.node()
            .node_stage_volume(stage_req(&plain.id, &plain.staging, cap.clone()))
            .await
            .unwrap();
        h.node()
            .node_publish_volume(publish_req(
                &plain.id,
                &plain.staging,
                &plain.target,
                cap.clone(),
                false,
            ))
            .await
            .unwrap();
        assert_eq!(
            std::fs::read(plain.target.join("kept")).unwrap(),
            b"plain data"
        );
        h.teardown(&plain).await;
        let plain_mapping = ferrovol::host::crypt::name_for(&plain.id);
        assert!(!std::path::Path::new("/dev/mapper")
            .join(&plain_mapping)
            .exists());
    }
    let vol = bring_up_on(
        h,
        attach,
        request(&format!("luks-{backend}"), cap.clone(), None),
    )
    .await;
    let mapping = ferrovol::host::crypt::name_for(&vol.id);
    let mapped = std::path::Path::new("/dev/mapper").join(&mapping);
    assert!(mapped.exists(), "{backend}: no mapping {mapping}");
    let backing = crypt_backing(&mapping);
    // The header's key derivation is the node's setting.
    let (memory, dump) = kdf_memory(backing.to_str().unwrap());
    assert_eq!(memory, Some(kdf_kib.to_string()), "{backend}: {dump}");
    // What the pod writes is on the mapping, and only ciphertext below it.
    let pattern: Vec<u8> = b"ferrovol-luks-plaintext-0123456789|"
        .iter()
        .copied()
        .cycle()
        .take(MIB as usize)
        .collect();
    let file = vol.target.join("secret.txt");
    {
        use std::io::Write;
        let mut f = std::fs::File::create(&file).unwrap();
        f.write_all(&pattern).unwrap();
        f.sync_all().unwrap();
    }
    let needle = &pattern[..64];
    assert!(
        holds(&mapped, needle),
        "{backend}: the mapping does not hold what was written"
    );
    assert!(
        !holds(&backing, needle),
        "{backend}: plaintext on the backing device {}",
        backing.display()
    );

    // Unstage closes the mapping; a wrong or missing key opens nothing and
    // harms nothing; the right one finds the data.
    h.unpublish_unstage(&vol.id, &vol.staging, &vol.target)
        .await;
    assert!(
        !mapped.exists(),
        "{backend}: the mapping outlived the unstage"
    );
    let ctx = match attach {
        true => h.attach_here(&vol.id, &cap, &secrets).await,
        false => HashMap::new(),
    };
    let stage = |secrets: HashMap<String, String>| pb::NodeStageVolumeRequest {
        secrets,
        publish_context: ctx.clone(),
        ..stage_req(&vol.id, &vol.staging, cap.clone())
    };
    let mut wrong = secrets.clone();
    wrong.insert("encryptionPassphrase".into(), "not the passphrase".into());
    let e = h.node().node_stage_volume(stage(wrong)).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{backend}: {e:?}");
    assert!(e.message().contains("encryptionPassphrase"), "{e:?}");
    assert!(!e.message().contains(&key), "{e:?}");
    assert!(!mapped.exists());
    let e = h
        .node()
        .node_stage_volume(stage(backend_secrets.clone()))
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{backend}: {e:?}");
    h.node()
        .node_stage_volume(stage(secrets.clone()))
        .await
        .unwrap();
    h.node()
        .node_publish_volume(publish_req(
            &vol.id,
            &vol.staging,
            &vol.target,
            cap.clone(),
            false,
        ))
        .await
        .unwrap();
    assert!(
        std::fs::read(&file).unwrap() == pattern,
        "{backend}: the data changed"
    );

    // A restart between stage and unstage: the open mapping is reused.
    let minor = |n: &str| {
        let out = std::process::Command::new("dmsetup")
            .args(["info", "-c", "--noheadings", "-o", "minor", n])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    };
    let before = minor(&mapping);
    h.kill();
    h.spawn().await;
    h.node()
        .node_stage_volume(stage(secrets.clone()))
        .await
        .unwrap();
    assert_eq!(
        minor(&mapping),
        before,
        "{backend}: the mapping was made again"
    );
    assert!(std::fs::read(&file).unwrap() == pattern);

    // Expansion grows the mapping and the filesystem in it.
    let statfs = |p: &std::path::Path| nix::sys::statvfs::statvfs(p).unwrap();
    let size = |p: &std::path::Path| {
        let s = statfs(p);
        s.blocks() * s.fragment_size()
    };
    let small = size(&vol.target);
    if backend == "iscsi" {
        // tgt grows a LUN only while no node has it: the volume is let go,
        // grown, and attached and staged again (the node's grow follows).
        h.unpublish_unstage(&vol.id, &vol.staging, &vol.target)
            .await;
        h.controller()
            .controller_unpublish_volume(pb::ControllerUnpublishVolumeRequest {
                volume_id: vol.id.clone(),
                node_id: h.node_id().await,
                secrets: secrets.clone(),
            })
            .await
            .unwrap();
        h.controller()
            .controller_expand_volume(expand_req(&vol.id, 48 * MIB))
            .await
            .unwrap();
        let ctx = h.attach_here(&vol.id, &cap, &secrets).await;
        h.node()
            .node_stage_volume(pb::NodeStageVolumeRequest {
                publish_context: ctx,
                ..stage(secrets.clone())
            })
            .await
            .unwrap();
        h.node()
            .node_publish_volume(publish_req(
                &vol.id,
                &vol.staging,
                &vol.target,
                cap.clone(),
                false,
            ))
            .await
            .unwrap();
    }
    h.grow_staged(
        &vol.id,
        &vol.target,
        Some((&vol.staging, &cap)),
        &secrets,
        48 * MIB,
    )
    .await;
    let big = size(&vol.target);
    assert!(
        big >= small + 12 * MIB as u64,
        "{backend}: {small} -> {big}"
    );

    // A snapshot restores (with a class that does not ask for encryption)
    // to a volume that is still encrypted, opens with the same key, and
    // whose filesystem has a UUID of its own.
    let snap = h.snapshot(&format!("luks-{backend}-snap"), &vol.id).await;
    let restored = bring_up_on(
        h,
        attach,
        request(
            &format!("luks-{backend}-r"),
            cap.clone(),
            Some(snap.clone()),
        ),
    )
    .await;
    let restored_mapping =
        std::path::Path::new("/dev/mapper").join(ferrovol::host::crypt::name_for(&restored.id));
    assert!(
        restored_mapping.exists(),
        "{backend}: the restore is not encrypted"
    );
    assert!(
        std::fs::read(restored.target.join("secret.txt")).unwrap() == pattern,
        "{backend}: the restore lost the data"
    );
    let (a, b) = (fs_uuid(&mapped), fs_uuid(&restored_mapping));
    assert!(!a.is_empty() && a != b, "{backend}: UUIDs {a} and {b}");
    assert!(!holds(
        &crypt_backing(&restored_mapping.file_name().unwrap().to_string_lossy()),
        needle
    ));

    if block {
        let raw = bring_up_on(
            h,
            attach,
            request(&format!("luks-{backend}-raw"), block_cap(SNW), None),
        )
        .await;
        let raw_mapping = ferrovol::host::crypt::name_for(&raw.id);
        {
            use std::os::unix::fs::FileExt;
            let f = std::fs::OpenOptions::new()
                .write(true)
                .open(&raw.target)
                .unwrap();
            f.write_all_at(&pattern, 4 * MIB as u64).unwrap();
            f.sync_all().unwrap();
        }
        assert!(holds(
            &std::path::Path::new("/dev/mapper").join(&raw_mapping),
            needle
        ));
        assert!(
            !holds(&crypt_backing(&raw_mapping), needle),
            "{backend}: raw plaintext"
        );
        h.teardown(&raw).await;
        assert!(!std::path::Path::new("/dev/mapper")
            .join(&raw_mapping)
            .exists());
    }

    h.teardown(&restored).await;
    assert!(!restored_mapping.exists());
    h.controller()
        .delete_snapshot(pb::DeleteSnapshotRequest {
            snapshot_id: snap,
            secrets: secrets.clone(),
        })
        .await
        .unwrap();
    h.teardown(&vol).await;
    assert!(!mapped.exists());
    assert!(
        !h.log().contains(&key),
        "{backend}: the passphrase reached the log"
    );
}

/// The memory (KiB) of the key derivation in the LUKS header on `device`,
/// and the header's dump (for a failed assertion's message).
fn kdf_memory(device: &str) -> (Option<String>, String) {
    let dump = run("cryptsetup", &["luksDump", device]);
    let memory = dump
        .lines()
        .find_map(|l| l.trim().strip_prefix("Memory:"))
        .map(|m| m.trim().to_string());
    (memory, dump)
}

/// A LUKS format cut short by the driver's death is done again by the
/// CO's retry of the stage, and a finished one is never formatted over:
/// the driver killed (kill points) with the format recorded as under way
/// but cryptsetup not run yet; with the device formatted but its key slot
/// erased, as a luksFormat killed between its header and its slot leaves
/// it; and with the format finished. Each time the stage is retried with
/// the driver started again: the first two stage, a file written through
/// the volume reads back after an unstage and a stage; the third refuses
/// a wrong passphrase with the header untouched, then stages with the
/// right one. No mapping is left. The first two rounds derive keys as
/// lightly as cryptsetup allows (what they test is the format's
/// recovery); the third with the driver's default key derivation, so the
/// defaults' own format and opens run in the real kernel (each 64 MiB
/// argon2id derivation costs seconds of the emulated CPU).
#[tokio::test]
#[ignore = "needs the real-kernel guest: run tests/guest/suite"]
async fn guest_a_luks_format_cut_short_is_formatted_again() {
    require_guest();
    // The built-in file backend, named as the config with none has it.
    let file = "[[backend]]\ntype = \"file\"\npool = \"@DIR@/state/pool\"\n";
    let mut h = Harness::start_with(Some(&light_kdf(file))).await;
    let config = h.config.clone().unwrap();
    let default_kdf = file.replace("@DIR@", &h.dir.path().display().to_string());
    let key = "the passphrase of volumes whose format was cut short";
    let mut mappings = Vec::new();
    let cap = mount_cap("ext4", SNW);
    let header_of = |dev: &str| -> Vec<u8> {
        let mut head = vec![0u8; 16384];
        use std::os::unix::fs::FileExt;
        std::fs::File::open(dev)
            .unwrap()
            .read_exact_at(&mut head, 0)
            .unwrap();
        head
    };
    for (round, (point, erase)) in [
        ("crypt.formatting", false),
        ("crypt.formatted", true),
        ("crypt.formatted", false),
    ]
    .into_iter()
    .enumerate()
    {
        if round == 2 {
            // The driver started next (below) reads it.
            std::fs::write(&config, &default_kdf).unwrap();
        }
        let name = format!("luks-cut-{round}");
        let mut req = create_req(&name, 32 * MIB, cap.clone());
        req.parameters.insert("encrypted".into(), "true".into());
        let vol = h.create_volume(req).await;
        mappings.push(ferrovol::host::crypt::name_for(&vol.volume_id));
        let staging = h.path(&format!("kubelet/staging/{name}"));
        std::fs::create_dir_all(&staging).unwrap();
        let stage = |passphrase: &str| pb::NodeStageVolumeRequest {
            secrets: HashMap::from([("encryptionPassphrase".into(), passphrase.into())]),
            volume_context: vol.volume_context.clone(),
            ..stage_req(&vol.volume_id, &staging, cap.clone())
        };
        h.env = vec![("FERROVOL_KILL_AT".into(), point.into())];
        h.kill();
        h.spawn().await;
        let died = h.node().node_stage_volume(stage(key)).await;
        assert!(died.is_err(), "{point}: the stage answered {died:?}");
        h.kill();
        h.env.clear();
        // The header is erased through the loop device (the page cache of
        // the device the driver reads), compared in the image (a stage
        // that fails detaches the loop device).
        let loops = h.loop_devices();
        assert_eq!(loops.len(), 1, "{point}: {loops:?}");
        let dev = loops[0].trim_start_matches("/dev/");
        let image = std::fs::read_to_string(format!("/sys/block/{dev}/loop/backing_file"))
            .unwrap()
            .trim_end()
            .to_string();
        if erase {
            run("cryptsetup", &["erase", "--batch-mode", &loops[0]]);
        }
        h.spawn().await;
        if point == "crypt.formatted" && !erase {
            let before = header_of(&image);
            let e = h
                .node()
                .node_stage_volume(stage("not the passphrase it was formatted with"))
                .await
                .unwrap_err();
            assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
            assert_eq!(header_of(&image), before, "a finished header was touched");
        }
        h.node()
            .node_stage_volume(stage(key))
            .await
            .unwrap_or_else(|e| panic!("{point} (erased: {erase}): the retry: {e:?}\n{}", h.log()));
        // The header's key derivation is the round's setting.
        let (memory, dump) = kdf_memory(&h.loop_devices()[0]);
        let kdf_kib = match round {
            2 => ferrovol::host::crypt::Kdf::default().memory_kib,
            _ => LIGHT_KDF_KIB,
        };
        assert_eq!(memory, Some(kdf_kib.to_string()), "{point}: {dump}");
        std::fs::write(staging.join("kept"), b"written after the retry").unwrap();
        h.node()
            .node_unstage_volume(unstage_req(&vol.volume_id, &staging))
            .await
            .unwrap();
        h.node().node_stage_volume(stage(key)).await.unwrap();
        assert_eq!(
            std::fs::read(staging.join("kept")).unwrap(),
            b"written after the retry"
        );
        h.node()
            .node_unstage_volume(unstage_req(&vol.volume_id, &staging))
            .await
            .unwrap();
        h.delete_volume(&vol.volume_id).await;
    }
    assert!(h.mounts().is_empty(), "{:?}", h.mounts());
    // Its volumes' mappings (the other lane's tests may have theirs open,
    // see tests/guest/lanes).
    let left = run("dmsetup", &["ls"]);
    for name in &mappings {
        assert!(!left.contains(name.as_str()), "{name} left: {left}");
    }
    assert!(!h.log().contains(key), "the passphrase reached the log");
}

/// The node settings of the tests of every block backend, before the
/// backends' `config`: the lightest key derivation cryptsetup takes. What
/// is tested there is the driver's use of LUKS, and argon2id's default
/// 64 MiB cost about 18 s a format and 6 s an open under the guest's
/// emulated CPU. The format cut short (below) runs the default in its
/// last round.
fn light_kdf(config: &str) -> String {
    format!(
        "[node]\nencryption_kdf_memory_kib = {LIGHT_KDF_KIB}\nencryption_kdf_time_ms = 1\n{config}"
    )
}

/// LUKS2 encryption on every block backend, in two tests the guest runs
/// side by side (tests/guest/lanes): the node's own backends (file, lvm)
/// here, one driver serving both; the remote ones in
/// [`guest_encrypted_volumes_on_the_remote_block_backends`]. On each: a
/// StorageClass parameter asks
/// for it, the node formats the device at the first stage and serves the
/// pod its opened mapping; a known pattern written through the volume is
/// on the mapping and nowhere on the backing device; unstage closes the
/// mapping; a wrong or missing passphrase is INVALID_ARGUMENT with nothing
/// touched and the right one finds the data; a driver restart between
/// stage and unstage reuses the open mapping; expansion grows the mapping
/// and the filesystem; a snapshot restores (under a class that does not ask
/// for encryption) to an encrypted volume that opens with the same key,
/// with a filesystem UUID of its own; a raw block volume (file) is
/// encrypted too, and (file) a volume with an unencrypted filesystem whose
/// stage asks for encryption is refused with its data kept; the passphrase is never in the driver's log, and no
/// mapping is left.
#[tokio::test]
#[ignore = "needs the real-kernel guest: run tests/guest/suite"]
async fn guest_encrypted_volumes_on_file_and_lvm() {
    require_guest();
    let local = LocalBackends::new("luksl", 256);
    let mut h = Harness::start_with(Some(&light_kdf(&local.config))).await;
    let none = HashMap::new();
    encrypted_volume_on(&mut h, "file", false, &none, true, LIGHT_KDF_KIB).await;
    encrypted_volume_on(&mut h, "lvm", false, &none, false, LIGHT_KDF_KIB).await;
    // Each volume's mapping was found gone after its teardown (another
    // lane's test may have mappings of its own open: tests/guest/lanes).
    assert!(h.mounts().is_empty(), "{:?}", h.mounts());
}

/// LUKS2 encryption on the remote block backends (iscsi and nvmf over
/// file stores, rbd), one driver serving them all: as
/// [`guest_encrypted_volumes_on_file_and_lvm`] on the node's own.
#[tokio::test]
#[ignore = "needs the real-kernel guest: run tests/guest/suite"]
async fn guest_encrypted_volumes_on_the_remote_block_backends() {
    require_guest();
    let every = EveryBackend::new("luks", 256, false);
    let cluster = every.cluster;
    let mut h = Harness::start_with(Some(&light_kdf(&every.config))).await;
    let none = HashMap::new();
    encrypted_volume_on(&mut h, "iscsi", true, &none, false, LIGHT_KDF_KIB).await;
    encrypted_volume_on(&mut h, "nvmf", true, &none, false, LIGHT_KDF_KIB).await;
    encrypted_volume_on(
        &mut h,
        "rbd",
        true,
        &cluster.secrets(),
        false,
        LIGHT_KDF_KIB,
    )
    .await;
    assert!(h.mounts().is_empty(), "{:?}", h.mounts());
}
