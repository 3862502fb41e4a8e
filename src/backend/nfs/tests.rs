//! The nfs backend over a scripted runner: the "mounted" share is a plain
//! temporary directory, so the directory work, records and policies run
//! for real without an NFS server.

use super::*;
use crate::error::Kind;
use crate::exec::{FakeRunner, Reply};
use crate::host::SystemHost;

struct Fixture {
    dir: tempfile::TempDir,
    runner: Arc<FakeRunner>,
    backend: NfsBackend,
}

fn fixture_with(extra: &str) -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let text = format!(
        "{extra}[[export]]\nname = \"main\"\nserver = \"10.0.0.1\"\nshare = \"/export/k8s\"\nversion = \"4.2\"\n"
    );
    let settings: NfsSettings = toml::from_str(&text).unwrap();
    let runner = Arc::new(FakeRunner::new());
    let backend = NfsBackend::new(
        "nfs",
        settings,
        runner.clone(),
        Arc::new(SystemHost),
        Arc::new(crate::mount::SystemMounter),
        dir.path().join("work"),
    )
    .unwrap();
    Fixture {
        dir,
        runner,
        backend,
    }
}

fn fixture() -> Fixture {
    fixture_with("")
}

impl Fixture {
    /// The working directory the share is "mounted" on (once, by the
    /// first call that needs it).
    fn share(&self) -> PathBuf {
        let work = self.dir.path().join("work");
        std::fs::read_dir(&work)
            .unwrap()
            .flatten()
            .next()
            .unwrap()
            .path()
    }
}

fn req(name: &str, meta: &[(&str, &str)], params: &[(&str, &str)]) -> CreateVolume {
    let map = |kv: &[(&str, &str)]| {
        kv.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    };
    CreateVolume {
        name: name.into(),
        required_bytes: 1 << 30,
        limit_bytes: 0,
        capabilities: vec![],
        parameters: map(params),
        metadata: map(meta),
        source: None,
        secrets: Secrets::default(),
    }
}

const PV: &str = "csi.storage.k8s.io/pv/name";
const PVC: &str = "csi.storage.k8s.io/pvc/name";
const NS: &str = "csi.storage.k8s.io/pvc/namespace";

#[test]
fn templates_fill_in_the_claim_and_refuse_hostile_names() {
    let f = fixture();
    let id = f
        .backend
        .volume_id_for(&req("pvc-1", &[(PV, "pvc-1234")], &[]))
        .unwrap();
    let loc = f.backend.locate(&id).unwrap();
    assert_eq!(
        (
            loc.server.as_str(),
            loc.share.as_str(),
            loc.subdir.to_str().unwrap()
        ),
        ("10.0.0.1", "/export/k8s", "pvc-1234")
    );
    let t = [("subDir", "${pvc.metadata.namespace}/${pvc.metadata.name}")];
    let ok = req("v", &[(NS, "team-a"), (PVC, "data")], &t);
    assert_eq!(
        f.backend.location_for(&ok).unwrap().subdir,
        PathBuf::from("team-a/data")
    );
    // Without metadata a hand call gets the CSI name as the PV name.
    assert_eq!(
        f.backend
            .location_for(&req("pvc-9", &[], &[]))
            .unwrap()
            .subdir,
        PathBuf::from("pvc-9")
    );
    for hostile in ["..", "../etc", ".ssh", "a b", "x\n", "ü"] {
        let r = req("v", &[(NS, hostile), (PVC, "data")], &t);
        assert_eq!(
            f.backend.location_for(&r).unwrap_err().kind,
            Kind::InvalidArgument,
            "{hostile:?}"
        );
    }
    for bad in [
        "${pvc.metadata.name}",
        "${nope}",
        "${pv.metadata.name",
        "/abs",
    ] {
        let r = req("v", &[], &[("subDir", bad)]);
        assert_eq!(
            f.backend.location_for(&r).unwrap_err().kind,
            Kind::InvalidArgument,
            "{bad:?}"
        );
    }
}

#[test]
fn ids_this_backend_did_not_mint_name_nothing() {
    let f = fixture();
    for raw in [
        "nfs:pvc-1",
        "nfs:v1.10_d0_d0_d1._sexport",           // two fields
        "nfs:v1.-oremount._sexport.pvc",         // a server that is an option
        "nfs:v1.10_d0_d0_d1.export.pvc",         // a relative share
        "nfs:v1.10_d0_d0_d1._sexport._d_d_setc", // ../etc as subdir
    ] {
        let id = VolumeId::parse(raw).unwrap();
        assert_eq!(
            f.backend.locate(&id).unwrap_err().kind,
            Kind::NotFound,
            "{raw}"
        );
    }
}

#[test]
fn configuration_is_checked() {
    let dir = tempfile::tempdir().unwrap();
    for bad in [
        "[[export]]\nname = \"m\"\nserver = \"-o x\"\nshare = \"/e\"\n",
        "[[export]]\nname = \"m\"\nserver = \"h\"\nshare = \"e\"\n",
        "[[export]]\nname = \"m\"\nserver = \"h\"\nshare = \"/e/../x\"\n",
        "[[export]]\nname = \"m\"\nserver = \"h\"\nshare = \"/e\"\nmount_options = [\"a;b\"]\n",
        "default_export = \"nope\"\n",
        "directory_mode = 0o17777\n",
        "[[export]]\nname = \"m\"\nserver = \"h\"\nshare = \"/e\"\nbtrfs_path = \"/srv/../etc\"\n",
        "[[export]]\nname = \"m\"\nserver = \"h\"\nshare = \"/e\"\nbtrfs_path = \"/srv/e\"\n\
         xfs_quota_path = \"/srv/e\"\n",
    ] {
        let settings: NfsSettings = toml::from_str(bad).unwrap();
        assert!(
            NfsBackend::new(
                "nfs",
                settings,
                Arc::new(FakeRunner::new()),
                Arc::new(SystemHost),
                Arc::new(crate::mount::SystemMounter),
                dir.path().to_path_buf()
            )
            .is_err(),
            "{bad}"
        );
    }
}

/// A create from a source that the driver died in leaves a record saying
/// the volume is being filled: the retry empties what the directory holds
/// and fills it again, and nothing lists the volume meanwhile. One cut
/// before its directory was made gets it made.
#[tokio::test]
async fn a_fill_cut_short_is_done_again_by_the_retry() {
    let f = fixture();
    f.runner.ok("mount.nfs");
    f.runner.ok("cp");
    let src = f
        .backend
        .create_volume(&req("pvc-src", &[(PV, "src")], &[]))
        .await
        .unwrap();
    let work = f.share();
    let mut r = req("pvc-copy", &[(PV, "copy")], &[]);
    r.source = Some(ContentSource::Volume(src.id.clone()));
    // As the kill left it: the record (filling), a directory holding part.
    let record = VolumeRecord {
        name: "pvc-copy".into(),
        subdir: "copy".into(),
        capacity_bytes: 1 << 30,
        on_delete: OnDelete::Delete,
        source: r.source.clone(),
        project_id: None,
        mode: None,
        filling: true,
    };
    NfsBackend::write_record(&f.backend.mounts.local(work.clone()), &record)
        .await
        .unwrap();
    std::fs::create_dir(work.join("copy")).unwrap();
    std::fs::write(work.join("copy/partial"), b"half").unwrap();
    let listed = f.backend.list_volumes(&Page::all()).await.unwrap();
    assert_eq!(
        listed,
        vec![src.clone()],
        "a volume being filled is not listed"
    );
    let copy = f.backend.create_volume(&r).await.unwrap();
    assert!(
        !work.join("copy/partial").exists(),
        "the part was not emptied"
    );
    assert!(f.runner.lines().iter().any(|l| l.starts_with("cp -a")));
    let now = NfsBackend::read_record(&work, Path::new("copy"))
        .await
        .unwrap()
        .unwrap();
    assert!(!now.filling);
    assert_eq!(f.backend.list_volumes(&Page::all()).await.unwrap().len(), 2);
    // Done: a retry answers it and copies nothing again.
    let copies = f.runner.lines().len();
    assert_eq!(f.backend.create_volume(&r).await.unwrap(), copy);
    assert_eq!(f.runner.lines().len(), copies);
    // Cut before its directory was made: the retry makes it.
    let plain = req("pvc-plain", &[(PV, "plain")], &[]);
    let record = VolumeRecord {
        name: "pvc-plain".into(),
        subdir: "plain".into(),
        source: None,
        filling: false,
        ..record
    };
    NfsBackend::write_record(&f.backend.mounts.local(work.clone()), &record)
        .await
        .unwrap();
    f.backend.create_volume(&plain).await.unwrap();
    assert!(work.join("plain").is_dir());
}

#[tokio::test]
async fn creates_a_directory_and_a_record_and_answers_retries() {
    let f = fixture_with("directory_mode = 0o2770\n");
    f.runner.ok("mount.nfs");
    let r = req("pvc-1", &[(PV, "pvc-1234")], &[]);
    let v = f.backend.create_volume(&r).await.unwrap();
    assert_eq!(v.id, f.backend.volume_id_for(&r).unwrap());
    assert_eq!(v.capacity_bytes, 1 << 30);
    // Mounted once through the helper, with the export's version.
    let work = f.share();
    assert_eq!(
        f.runner.lines(),
        [format!(
            "mount.nfs 10.0.0.1:/export/k8s {} -o rw,nfsvers=4.2",
            work.display()
        )]
    );
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(work.join("pvc-1234"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o7777, 0o2770);
    // A retry finds it, without mounting again.
    assert_eq!(f.backend.create_volume(&r).await.unwrap(), v);
    assert_eq!(f.runner.lines().len(), 1);
    assert_eq!(f.backend.mounts.mounted(), 1);
    // Another name wanting the same directory is refused.
    let other = req("pvc-2", &[(PV, "pvc-1234")], &[]);
    assert_eq!(
        f.backend.create_volume(&other).await.unwrap_err().kind,
        Kind::AlreadyExists
    );
    // A directory nobody recorded is not taken over.
    std::fs::create_dir(work.join("theirs")).unwrap();
    let theirs = req("pvc-3", &[(PV, "theirs")], &[]);
    assert_eq!(
        f.backend.create_volume(&theirs).await.unwrap_err().kind,
        Kind::AlreadyExists
    );
    // Listing reads the records on the share.
    let listed = f.backend.list_volumes(&Page::all()).await.unwrap();
    assert_eq!(listed, vec![v]);
    // Idle shares are released: unmounted, never forced (that would
    // abort the RPCs of the pods' mounts sharing the superblock).
    f.runner.ok("umount.nfs");
    assert_eq!(f.backend.mounts.release_idle(Duration::ZERO).await, 1);
    assert_eq!(
        f.runner.lines().last().unwrap(),
        &format!("umount.nfs {}", work.display())
    );
}

#[tokio::test]
async fn a_symlink_on_the_share_never_leads_out() {
    let f = fixture();
    f.runner.ok("mount.nfs");
    // Make the share exist, then plant a link where a namespace goes.
    f.backend
        .create_volume(&req("first", &[(PV, "first")], &[]))
        .await
        .unwrap();
    let work = f.share();
    let outside = f.dir.path().join("outside");
    std::fs::create_dir(&outside).unwrap();
    std::os::unix::fs::symlink(&outside, work.join("team-a")).unwrap();
    let r = req(
        "v",
        &[(NS, "team-a"), (PVC, "data")],
        &[("subDir", "${pvc.metadata.namespace}/${pvc.metadata.name}")],
    );
    assert_eq!(
        f.backend.create_volume(&r).await.unwrap_err().kind,
        Kind::FailedPrecondition
    );
    assert_eq!(std::fs::read_dir(&outside).unwrap().count(), 0);
}

#[tokio::test]
async fn delete_follows_the_policy_recorded_at_create() {
    let f = fixture();
    f.runner.ok("mount.nfs");
    let create = |name: &str, policy: Option<&str>| {
        let mut r = req(name, &[(PV, name)], &[]);
        if let Some(p) = policy {
            r.parameters.insert("onDelete".into(), p.into());
        }
        r
    };
    let none = Secrets::default();
    let deleted = f.backend.create_volume(&create("del", None)).await.unwrap();
    let retained = f
        .backend
        .create_volume(&create("keep", Some("retain")))
        .await
        .unwrap();
    let archived = f
        .backend
        .create_volume(&create("arch", Some("archive")))
        .await
        .unwrap();
    let work = f.share();
    std::fs::write(work.join("arch/data"), b"x").unwrap();

    std::fs::create_dir_all(work.join("del/sub")).unwrap();
    std::fs::write(work.join("del/sub/data"), b"x").unwrap();
    f.backend.delete_volume(&deleted.id, &none).await.unwrap();
    assert!(!work.join("del").exists(), "deleted directory left");
    f.backend.delete_volume(&retained.id, &none).await.unwrap();
    assert!(work.join("keep").is_dir(), "retained directory removed");
    f.backend.delete_volume(&archived.id, &none).await.unwrap();
    assert!(!work.join("arch").exists());
    let archive: Vec<_> = std::fs::read_dir(work.join(".ferrovol/archive"))
        .unwrap()
        .flatten()
        .collect();
    assert_eq!(archive.len(), 1);
    assert_eq!(std::fs::read(archive[0].path().join("data")).unwrap(), b"x");
    // All three are gone as volumes; deleting again is fine.
    for v in [&deleted, &retained, &archived] {
        assert!(f
            .backend
            .get_volume(&v.id, &Secrets::default())
            .await
            .unwrap()
            .is_none());
        f.backend.delete_volume(&v.id, &none).await.unwrap();
    }
    // A directory without a record is never deleted.
    std::fs::create_dir(work.join("foreign")).unwrap();
    let foreign = f.backend.volume_id_for(&create("foreign", None)).unwrap();
    f.backend.delete_volume(&foreign, &none).await.unwrap();
    assert!(work.join("foreign").is_dir());
    // No process removed anything.
    assert!(f.runner.lines().iter().all(|l| !l.starts_with("rm")));
}

#[tokio::test]
async fn a_mount_that_hangs_is_killed_and_reported() {
    let f = fixture();
    f.runner.expect("mount.nfs", Reply::Timeout);
    let err = f
        .backend
        .create_volume(&req("pvc-1", &[(PV, "p")], &[]))
        .await
        .unwrap_err();
    assert_eq!(err.kind, Kind::Unavailable, "{}", err.message);
    assert!(err.message.contains("mount the share"), "{}", err.message);
    assert_eq!(f.backend.mounts.mounted(), 0);
    // The next attempt mounts again and works.
    f.runner.ok("mount.nfs");
    f.backend
        .create_volume(&req("pvc-1", &[(PV, "p")], &[]))
        .await
        .unwrap();
}

#[tokio::test]
async fn nodes_mount_the_subdirectory_with_the_exports_options() {
    let f = fixture();
    let id = f
        .backend
        .volume_id_for(&req(
            "v",
            &[(NS, "team"), (PVC, "db")],
            &[("subDir", "${pvc.metadata.namespace}/${pvc.metadata.name}")],
        ))
        .unwrap();
    let a = f
        .backend
        .node_attach(&id, &AttachContext::default())
        .await
        .unwrap();
    assert_eq!(
        a,
        Attachment::Remote {
            source: "10.0.0.1:/export/k8s/team/db".into(),
            fs_type: "nfs".into(),
            options: vec!["nfsvers=4.2".into()],
        }
    );
    // A StorageClass naming a server directly gets the backend's options.
    let direct = f
        .backend
        .volume_id_for(&req(
            "v",
            &[(PV, "x")],
            &[("server", "nfs.example.com"), ("share", "/")],
        ))
        .unwrap();
    let Attachment::Remote { source, .. } = f
        .backend
        .node_attach(&direct, &AttachContext::default())
        .await
        .unwrap()
    else {
        panic!("not remote")
    };
    assert_eq!(source, "nfs.example.com:/x");
}

#[test]
fn parameters_are_checked() {
    let f = fixture();
    let p = |kv: &[(&str, &str)]| -> BTreeMap<String, String> {
        kv.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    };
    assert!(f.backend.validate_parameters(&p(&[])).is_ok());
    assert!(f
        .backend
        .validate_parameters(&p(&[("onDelete", "archive"), ("mountPermissions", "2770")]))
        .is_ok());
    for bad in [
        p(&[("onDelete", "shred")]),
        p(&[("mountPermissions", "rwx")]),
        p(&[("server", "h")]),
        p(&[("server", "h"), ("share", "/s"), ("export", "main")]),
        p(&[("export", "other")]),
        p(&[("speed", "fast")]),
    ] {
        assert_eq!(
            crate::plugin::check_parameters(&f.backend, &bad)
                .unwrap_err()
                .kind,
            Kind::InvalidArgument,
            "{bad:?}"
        );
    }
}

#[tokio::test]
async fn modify_changes_the_mode_and_the_delete_policy_all_or_nothing() {
    let f = fixture_with("directory_mode = 0o2770\n");
    f.runner.ok("mount.nfs");
    let none = Secrets::default();
    let v = f
        .backend
        .create_volume(&req("pvc-m", &[(PV, "pvc-m")], &[]))
        .await
        .unwrap();
    let work = f.share();
    let mode = || {
        use std::os::unix::fs::PermissionsExt;
        std::fs::metadata(work.join("pvc-m"))
            .unwrap()
            .permissions()
            .mode()
            & 0o7777
    };
    let kv = |pairs: &[(&str, &str)]| -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    };
    // One bad value: refused before anything changes, naming it.
    let bad = kv(&[("mountPermissions", "0750"), ("onDelete", "shred")]);
    let e = f.backend.check_mutable(&bad).unwrap_err();
    assert_eq!(e.kind, Kind::InvalidArgument);
    assert!(e.message.contains("onDelete"), "{}", e.message);
    assert_eq!(
        f.backend
            .modify_volume(&v.id, &bad, &none)
            .await
            .unwrap_err()
            .kind,
        Kind::InvalidArgument
    );
    assert_eq!(mode(), 0o2770);

    let good = kv(&[("mountPermissions", "0750"), ("onDelete", "retain")]);
    f.backend.modify_volume(&v.id, &good, &none).await.unwrap();
    assert_eq!(mode(), 0o750);
    // Again: no change.
    f.backend.modify_volume(&v.id, &good, &none).await.unwrap();
    let record = NfsBackend::read_record(&work, Path::new("pvc-m"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (record.mode, record.on_delete),
        (Some(0o750), OnDelete::Retain)
    );
    // The recorded policy is what delete follows now.
    f.backend.delete_volume(&v.id, &none).await.unwrap();
    assert!(work.join("pvc-m").is_dir(), "a retained volume was removed");
    assert_eq!(
        f.backend
            .modify_volume(&v.id, &good, &none)
            .await
            .unwrap_err()
            .kind,
        Kind::NotFound
    );
}

#[tokio::test]
async fn health_says_when_the_export_or_the_volume_s_directory_is_gone() {
    use crate::plugin::health::Reason;
    use crate::plugin::HealthReporter;
    let f = fixture();
    f.runner.ok("mount.nfs");
    let v = f
        .backend
        .create_volume(&req("pvc-1", &[(PV, "pvc-h")], &[]))
        .await
        .unwrap();
    let s = Secrets::default();
    assert_eq!(f.backend.volume_health(&v.id, &s).await.unwrap(), vec![]);
    assert_eq!(
        f.backend.known_volumes(&Page::all()).await.unwrap(),
        vec![v.id.clone()]
    );
    // A volume this export never had: not found.
    let never = f
        .backend
        .volume_id_for(&req("pvc-9", &[(PV, "nothere")], &[]))
        .unwrap();
    let found = f.backend.volume_health(&never, &s).await.unwrap();
    assert_eq!(found[0].reason, Reason::VolumeNotFound, "{found:?}");
    // Its directory removed by hand, its record left.
    std::fs::remove_dir(f.share().join("pvc-h")).unwrap();
    let found = f.backend.volume_health(&v.id, &s).await.unwrap();
    assert_eq!(
        found[0].reason,
        reasons::VolumeDirectoryMissing,
        "{found:?}"
    );
    assert!(found[0].message.contains("pvc-h"), "{found:?}");
    // The export no longer mounts: unreachable, said within the mount's
    // deadline.
    f.runner.ok("umount.nfs");
    assert_eq!(f.backend.mounts.release_idle(Duration::ZERO).await, 1);
    f.runner.expect("mount.nfs", Reply::Timeout);
    let found = f.backend.volume_health(&v.id, &s).await.unwrap();
    assert_eq!(found[0].reason, reasons::ExportUnreachable, "{found:?}");
}

/// The room the server gives a volume's directory: under 5% free is
/// nearly full (its quota, or its export's filesystem), said DEGRADED.
#[test]
fn a_directory_with_under_5_percent_free_is_nearly_full() {
    use crate::host::FsUsage;
    use crate::plugin::health::Status;
    const MIB: u64 = 1 << 20;
    let usage = |total: u64, available: u64| FsUsage {
        total_bytes: total,
        free_bytes: available,
        available_bytes: available,
        ..FsUsage::default()
    };
    assert_eq!(health::nearly_full(&usage(100 * MIB, 5 * MIB)), None);
    assert_eq!(health::nearly_full(&usage(0, 0)), None);
    let found = health::nearly_full(&usage(100 * MIB, 4 * MIB)).unwrap();
    assert_eq!(
        (found.status, found.reason),
        (Status::Degraded, reasons::QuotaNearlyReached)
    );
    assert!(found.message.contains("4194304 of 104857600"), "{found:?}");
}

/// NodeGetStorageHealth's view: each configured export's server asked
/// once per port; the one that holds its connection without a word is
/// said unreachable, the one that answers is not.
#[tokio::test]
async fn storage_health_says_which_servers_do_not_answer() {
    use crate::plugin::health::StorageStatus;
    let answering = probe::fake::server(|call| Some(probe::fake::reply_to(call, 0, 1))).await;
    let silent = probe::fake::server(|_| None).await;
    let export = |name: &str, port: u16| {
        format!(
            "[[export]]\nname = \"{name}\"\nserver = \"127.0.0.1\"\nshare = \"/{name}\"\nmount_options = [\"port={port}\"]\n"
        )
    };
    // Two exports of the answering server: it is asked once (its fake
    // takes one connection only).
    let text = [
        export("a", answering),
        export("b", answering),
        export("c", silent),
    ]
    .concat();
    let dir = tempfile::tempdir().unwrap();
    let b = NfsBackend::new(
        "nfs",
        toml::from_str(&text).unwrap(),
        Arc::new(FakeRunner::new()),
        Arc::new(SystemHost),
        Arc::new(crate::mount::SystemMounter),
        dir.path().join("work"),
    )
    .unwrap();
    let t = std::time::Instant::now();
    let found = b.servers_not_answering(Duration::from_millis(500)).await;
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    assert_eq!(found.len(), 1, "{found:?}");
    assert_eq!(found[0].status, StorageStatus::Unreachable);
    assert_eq!(found[0].reason, reasons::ServerNotAnswering);
    assert!(
        found[0]
            .message
            .starts_with(&format!("server 127.0.0.1 port {silent}: no answer")),
        "{}",
        found[0].message
    );
}

/// A snapshot is a tar of the volume's directory through zstd, made under
/// a temporary name and renamed into place once whole; a restore unpacks
/// it with zstd. A gzip archive, as earlier versions made them, is still
/// restored (with gzip) and deleted with its record.
#[tokio::test]
async fn snapshots_are_zstd_archives_and_gzip_ones_still_restore() {
    use crate::exec::Effect;
    let f = fixture();
    f.runner.ok("mount.nfs");
    let src = f
        .backend
        .create_volume(&req("pvc-src", &[(PV, "src")], &[]))
        .await
        .unwrap();
    let work = f.share();
    let snaps = work.join(".ferrovol/snapshots");
    let locator = crate::id::locator_for_name("snap-1");
    let (tmp, zstd, gzip) = (
        snaps.join(format!(".{locator}.tar.zst.tmp")),
        snaps.join(format!("{locator}.tar.zst")),
        snaps.join(format!("{locator}.tar.gz")),
    );
    let packed = tmp.clone();
    f.runner.expect(
        "tar",
        Reply::OkAfter(
            String::new(),
            Effect(Arc::new(move || std::fs::write(&packed, b"zstd").unwrap())),
        ),
    );
    let made = f
        .backend
        .create_snapshot(&CreateSnapshot {
            source: src.id.clone(),
            name: "snap-1".into(),
            parameters: BTreeMap::new(),
            metadata: BTreeMap::new(),
            secrets: Secrets::default(),
        })
        .await
        .unwrap();
    assert_eq!(
        f.runner.lines().last().unwrap(),
        &format!(
            "tar -I zstd -T0 -q -cf {} --one-file-system -C {} .",
            tmp.display(),
            work.join("src").display()
        )
    );
    assert!(zstd.exists() && !tmp.exists());
    let restore = |name: &'static str| {
        let mut r = req(name, &[(PV, name)], &[]);
        r.source = Some(ContentSource::Snapshot(made.id.clone()));
        r
    };
    f.runner.ok("tar");
    f.backend.create_volume(&restore("r1")).await.unwrap();
    assert_eq!(
        f.runner.lines().last().unwrap(),
        &format!(
            "tar -I zstd -T0 -q -xpf {} -C {} --numeric-owner",
            zstd.display(),
            work.join("r1").display()
        )
    );
    // As an earlier version left it: the same snapshot packed with gzip.
    std::fs::rename(&zstd, &gzip).unwrap();
    let none = Secrets::default();
    assert!(f
        .backend
        .get_snapshot(&made.id, &none)
        .await
        .unwrap()
        .is_some());
    f.runner.ok("tar");
    f.backend.create_volume(&restore("r2")).await.unwrap();
    assert_eq!(
        f.runner.lines().last().unwrap(),
        &format!(
            "tar -I gzip -xpf {} -C {} --numeric-owner",
            gzip.display(),
            work.join("r2").display()
        )
    );
    f.backend.delete_snapshot(&made.id, &none).await.unwrap();
    assert!(!gzip.exists() && !snaps.join(format!("{locator}.json")).exists());
    assert!(f
        .backend
        .get_snapshot(&made.id, &none)
        .await
        .unwrap()
        .is_none());
}
