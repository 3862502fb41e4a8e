//! The `nfs` backend against the guest's kernel nfsd: lifecycles and
//! policies, dead and stale servers and exports, NFSv3.

use super::*;

#[test]
#[ignore = "needs the real-kernel guest: run tests/guest/suite"]
fn guest_nfs_fixture_serves_a_v4_mount() {
    require_guest();
    let server = NfsServer::new();
    let mnt = server.dir.path().join("mnt");
    std::fs::create_dir_all(&mnt).unwrap();
    run(
        "mount",
        &[
            "-t",
            "nfs4",
            "-o",
            "soft,timeo=50",
            server.source(),
            mnt.to_str().unwrap(),
        ],
    );
    std::fs::write(mnt.join("f"), b"over NFS").unwrap();
    run("umount", &[mnt.to_str().unwrap()]);
    assert_eq!(std::fs::read(server.export.join("f")).unwrap(), b"over NFS");
}

/// The nfs backend against the kernel's NFS server on loopback: a volume is
/// a subdirectory; two pods on a node share one staged NFS mount; delete,
/// retain and archive; and a server that stops answering: stats return an
/// abnormal condition within the deadline, Probe answers throughout,
/// unstage lets go (forced, then lazy), and once the server is back the
/// next stage works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the real-kernel guest: run tests/guest/suite"]
async fn guest_nfs_backend_lifecycle_policies_and_a_dead_server() {
    require_guest();
    let server = NfsServer::new();
    let config = NFS_LOOPBACK_CONFIG;
    // Deadlines of 8 s keep the dead-server part short.
    let h = Harness::start_with_env(Some(config), &[("FERROVOL_COMMAND_TIMEOUT", "8")]).await;
    let (mut c, mut n) = (h.controller(), h.node());
    let cap = mount_cap("", 5); // MULTI_NODE_MULTI_WRITER, the backend's default fs type
    let create = |name: &str, params: &[(&str, &str)]| {
        let mut r = create_req(name, 64 * MIB, cap.clone());
        r.parameters = params
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        r.parameters
            .insert("csi.storage.k8s.io/pv/name".into(), name.into());
        r
    };
    let vol = h.create(create("pvc-nfs", &[])).await;
    assert!(vol.volume_id.starts_with("nfs:v1."), "{}", vol.volume_id);
    assert!(server.export.join("pvc-nfs").is_dir());

    // Two pods share one staged mount.
    let staging = h.path("kubelet/staging/nfs");
    std::fs::create_dir_all(&staging).unwrap();
    n.node_stage_volume(stage_req(&vol.volume_id, &staging, cap.clone()))
        .await
        .unwrap();
    let targets: Vec<_> = ["a", "b"]
        .iter()
        .map(|t| h.path(&format!("kubelet/pods/nfs-{t}")))
        .collect();
    for t in &targets {
        n.node_publish_volume(publish_req(&vol.volume_id, &staging, t, cap.clone(), false))
            .await
            .unwrap();
    }
    std::fs::write(targets[0].join("shared"), b"from pod a").unwrap();
    assert_eq!(
        std::fs::read(targets[1].join("shared")).unwrap(),
        b"from pod a"
    );
    assert_eq!(
        std::fs::read(server.export.join("pvc-nfs/shared")).unwrap(),
        b"from pod a"
    );
    let table = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    let infos = ferrovol::mount::parse_mountinfo(&table);
    let nfs: Vec<_> = infos
        .iter()
        .filter(|m| m.fstype.starts_with("nfs"))
        .collect();
    let stage_dev = &nfs.iter().find(|m| m.mount_point == staging).unwrap().dev;
    for t in &targets {
        let m = nfs
            .iter()
            .find(|m| &m.mount_point == t)
            .expect("target mounted");
        assert_eq!(&m.dev, stage_dev, "{} is not the staged mount", t.display());
    }
    let stats = n
        .node_get_volume_stats(pb::NodeGetVolumeStatsRequest {
            volume_id: vol.volume_id.clone(),
            volume_path: targets[0].display().to_string(),
            staging_target_path: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(!stats.volume_condition.unwrap().abnormal);
    assert!(stats.usage[0].total > 0);
    for t in &targets {
        n.node_unpublish_volume(unpublish_req(&vol.volume_id, t))
            .await
            .unwrap();
    }
    n.node_unstage_volume(unstage_req(&vol.volume_id, &staging))
        .await
        .unwrap();
    assert!(
        mounts_under(&h.path("kubelet")).is_empty(),
        "{:?}",
        mounts_under(&h.path("kubelet"))
    );

    // Delete policies.
    let keep = h
        .create(create("pvc-keep", &[("onDelete", "retain")]))
        .await;
    let arch = h
        .create(create("pvc-arch", &[("onDelete", "archive")]))
        .await;
    std::fs::write(server.export.join("pvc-arch/kept"), b"x").unwrap();
    for v in [&vol, &keep, &arch] {
        c.delete_volume(pb::DeleteVolumeRequest {
            volume_id: v.volume_id.clone(),
            ..Default::default()
        })
        .await
        .unwrap();
    }
    assert!(!server.export.join("pvc-nfs").exists());
    assert!(server.export.join("pvc-keep").is_dir());
    assert!(!server.export.join("pvc-arch").exists());
    let archived: Vec<_> = std::fs::read_dir(server.export.join(".ferrovol/archive"))
        .unwrap()
        .flatten()
        .collect();
    assert_eq!(archived.len(), 1);
    assert!(archived[0].path().join("kept").exists());

    // The server stops answering while a volume is staged.
    let dead = h.create(create("pvc-dead", &[])).await;
    let staging = h.path("kubelet/staging/dead");
    std::fs::create_dir_all(&staging).unwrap();
    n.node_stage_volume(stage_req(&dead.volume_id, &staging, cap.clone()))
        .await
        .unwrap();
    server.stop();
    let started = std::time::Instant::now();
    let mut n2 = h.node();
    let stats_call = {
        let (id, path) = (dead.volume_id.clone(), staging.display().to_string());
        tokio::spawn(async move {
            n2.node_get_volume_stats(pb::NodeGetVolumeStatsRequest {
                volume_id: id,
                volume_path: path,
                staging_target_path: String::new(),
            })
            .await
        })
    };
    // Probe answers while the stats call waits on the dead server.
    let mut id = h.identity();
    while !stats_call.is_finished() {
        let t = std::time::Instant::now();
        id.probe(pb::ProbeRequest {}).await.unwrap();
        assert!(
            t.elapsed() < Duration::from_millis(500),
            "Probe took {:?}",
            t.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(started.elapsed() < Duration::from_secs(60), "stats hung");
    }
    let stats = stats_call.await.unwrap().unwrap().into_inner();
    let condition = stats.volume_condition.unwrap();
    assert!(condition.abnormal, "{condition:?}");
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "{:?}",
        started.elapsed()
    );
    // Unstage lets go of the dead mount.
    n.node_unstage_volume(unstage_req(&dead.volume_id, &staging))
        .await
        .unwrap();
    assert!(
        mounts_under(&h.path("kubelet")).is_empty(),
        "{:?}",
        mounts_under(&h.path("kubelet"))
    );
    // The server comes back: the next stage works.
    server.start();
    n.node_stage_volume(stage_req(&dead.volume_id, &staging, cap.clone()))
        .await
        .unwrap();
    n.node_unstage_volume(unstage_req(&dead.volume_id, &staging))
        .await
        .unwrap();
    c.delete_volume(pb::DeleteVolumeRequest {
        volume_id: dead.volume_id.clone(),
        ..Default::default()
    })
    .await
    .unwrap();
}

/// Two volumes of one export staged on the node share the kernel's
/// superblock of that filesystem, and so does the controller's working
/// mount of the export: unstaging one volume, and the driver stopping
/// (which releases its working mounts), must leave the other volume's
/// writes alone. A pod writes and syncs to volume B without a pause while
/// A is unstaged and while the driver stops and starts again; no write
/// fails (a forced unmount failed them: it aborts the RPCs of every mount
/// of the superblock).
#[tokio::test]
#[ignore = "needs the real-kernel guest: run tests/guest/suite"]
async fn guest_nfs_one_volume_s_unstage_leaves_the_other_volumes_writes_alone() {
    require_guest();
    let _server = NfsServer::new();
    let config = NFS_LOOPBACK_CONFIG;
    let mut h = Harness::start_with(Some(config)).await;
    let cap = mount_cap("", SNW);
    let a = h.provision("pvc-nfs-a", 16 * MIB, cap.clone()).await;
    let b = h.provision("pvc-nfs-b", 16 * MIB, cap.clone()).await;
    let pod = Steady::start(b.target.join("pod-writes"));
    assert!(pod.next_write_within(Duration::from_secs(60)).is_some());
    h.unpublish_unstage(&a.id, &a.staging, &a.target).await;
    assert!(
        pod.next_write_within(Duration::from_secs(60)).is_some(),
        "the pod's writes stopped"
    );
    // The driver stops (a roll) and starts again with the pod writing on.
    assert!(h.terminate().success(), "{}", h.log());
    h.spawn().await;
    assert!(
        pod.next_write_within(Duration::from_secs(60)).is_some(),
        "the pod's writes stopped"
    );
    let writes = pod.finish();
    assert!(writes > 0);
    h.delete_volume(&a.id).await;
    h.teardown(&b).await;
    // The controller's working mount goes with the driver.
    assert!(h.terminate().success(), "{}", h.log());
    assert!(h.mounts().is_empty(), "{:?}", h.mounts());
}

/// A staged NFS mount whose directory is replaced on the server goes stale
/// (ESTALE): the volume condition says so, a publish is refused with
/// FAILED_PRECONDITION, and NodeStage mounts it again.
#[tokio::test]
#[ignore = "needs the real-kernel guest: run tests/guest/suite"]
async fn guest_nfs_stale_mount_is_detected_and_remounted() {
    require_guest();
    let server = NfsServer::new();
    let config = "[[backend]]\ntype = \"nfs\"\n\
        [[backend.export]]\nname = \"main\"\nserver = \"127.0.0.1\"\nshare = \"/\"\n";
    let h = Harness::start_with(Some(config)).await;
    let mut n = h.node();
    let cap = mount_cap("nfs", 5);
    let vol = h
        .create(create_req("pvc-stale", 64 * MIB, cap.clone()))
        .await;
    let staging = h.path("kubelet/staging/stale");
    std::fs::create_dir_all(&staging).unwrap();
    n.node_stage_volume(stage_req(&vol.volume_id, &staging, cap.clone()))
        .await
        .unwrap();
    // The directory is replaced on the server: the client's handle is stale.
    let dir = server.export.join("pvc-stale");
    std::fs::remove_dir_all(&dir).unwrap();
    std::fs::create_dir(&dir).unwrap();
    std::fs::write(dir.join("new"), b"after").unwrap();
    let stats = n
        .node_get_volume_stats(pb::NodeGetVolumeStatsRequest {
            volume_id: vol.volume_id.clone(),
            volume_path: staging.display().to_string(),
            staging_target_path: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    let condition = stats.volume_condition.unwrap();
    assert!(condition.abnormal, "{condition:?}");
    let target = h.path("kubelet/pods/stale");
    let publish = n
        .node_publish_volume(publish_req(
            &vol.volume_id,
            &staging,
            &target,
            cap.clone(),
            false,
        ))
        .await;
    assert_eq!(
        code(&publish),
        tonic::Code::FailedPrecondition,
        "{publish:?}"
    );
    // NodeStage again: remounted, and the new directory is what it shows.
    n.node_stage_volume(stage_req(&vol.volume_id, &staging, cap.clone()))
        .await
        .unwrap();
    assert_eq!(std::fs::read(staging.join("new")).unwrap(), b"after");
    n.node_unstage_volume(unstage_req(&vol.volume_id, &staging))
        .await
        .unwrap();
    assert!(mounts_under(&h.path("kubelet")).is_empty());
}

/// The nfs backend on an NFSv3 export (rpcbind, mountd, `nolock`).
#[tokio::test]
#[ignore = "needs the real-kernel guest: run tests/guest/suite"]
async fn guest_nfs_backend_on_an_nfsv3_export() {
    require_guest();
    let server = NfsServer::with_v3();
    let config = format!(
        "[[backend]]\ntype = \"nfs\"\n\
         [[backend.export]]\nname = \"v3\"\nserver = \"127.0.0.1\"\nshare = \"{}\"\n\
         version = \"3\"\nmount_options = [\"nolock\"]\n",
        server.export.display()
    );
    let h = Harness::start_with(Some(&config)).await;
    let (mut c, mut n) = (h.controller(), h.node());
    let cap = mount_cap("nfs", 5);
    let vol = h.create(create_req("pvc-v3", 64 * MIB, cap.clone())).await;
    let staging = h.path("kubelet/staging/v3");
    std::fs::create_dir_all(&staging).unwrap();
    n.node_stage_volume(stage_req(&vol.volume_id, &staging, cap.clone()))
        .await
        .unwrap();
    let table = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    let staged = ferrovol::mount::parse_mountinfo(&table)
        .into_iter()
        .find(|m| m.mount_point == staging)
        .expect("staged");
    assert_eq!(staged.fstype, "nfs", "an NFSv3 mount");
    assert!(
        staged.super_options.iter().any(|o| o == "vers=3"),
        "{:?}",
        staged.super_options
    );
    std::fs::write(staging.join("f"), b"over v3").unwrap();
    assert_eq!(
        std::fs::read(server.export.join("pvc-v3/f")).unwrap(),
        b"over v3"
    );
    n.node_unstage_volume(unstage_req(&vol.volume_id, &staging))
        .await
        .unwrap();
    c.delete_volume(pb::DeleteVolumeRequest {
        volume_id: vol.volume_id,
        ..Default::default()
    })
    .await
    .unwrap();
    assert!(!server.export.join("pvc-v3").exists());
}

/// One dead NFS server holds up only its own export: while a CreateVolume
/// on an export whose server accepts connections and never answers is
/// stuck in the controller's mount of it, creates and deletes on another
/// export finish, and the stuck call ends UNAVAILABLE at its deadline.
/// (The controller held one lock across every export's mount before, so
/// the live export's calls waited out the dead one's deadline.)
#[tokio::test]
#[ignore = "needs the real-kernel guest: run tests/guest/suite"]
async fn guest_nfs_a_dead_export_holds_up_only_itself() {
    require_guest();
    let _server = NfsServer::new();
    // A "server" that takes connections and never says a word.
    let silent = std::net::TcpListener::bind("127.0.0.2:0").unwrap();
    let port = silent.local_addr().unwrap().port();
    let contacted = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    {
        let contacted = contacted.clone();
        std::thread::spawn(move || {
            let mut held = Vec::new();
            for s in silent.incoming().flatten() {
                contacted.store(true, std::sync::atomic::Ordering::SeqCst);
                held.push(s);
            }
        });
    }
    let config = format!(
        "[[backend]]\ntype = \"nfs\"\n\
         [[backend.export]]\nname = \"live\"\nserver = \"127.0.0.1\"\nshare = \"/\"\nversion = \"4.2\"\n\
         [[backend.export]]\nname = \"dead\"\nserver = \"127.0.0.2\"\nshare = \"/\"\nversion = \"4.2\"\n\
         mount_options = [\"port={port}\"]\n"
    );
    let limit = 20;
    let h = Harness::start_with_env(
        Some(&config),
        &[("FERROVOL_COMMAND_TIMEOUT", &limit.to_string())],
    )
    .await;
    let cap = mount_cap("", 5);
    let create = |name: &str, export: &str| {
        let mut r = create_req(name, 16 * MIB, cap.clone());
        r.parameters.insert("export".into(), export.into());
        r
    };
    let stuck = {
        let mut c = h.controller();
        let req = create("pvc-on-dead", "dead");
        tokio::spawn(async move { c.create_volume(req).await })
    };
    // The dead export's mount is under way once its server was contacted.
    let since = std::time::Instant::now();
    while !contacted.load(std::sync::atomic::Ordering::SeqCst) {
        assert!(
            !stuck.is_finished(),
            "the dead export's create ended before its server was contacted: {:?}",
            stuck.await
        );
        assert!(
            since.elapsed() < Duration::from_secs(limit),
            "the dead export was never contacted"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let started = std::time::Instant::now();
    let mut c = h.controller();
    for i in 0..3 {
        let v = h.create(create(&format!("pvc-live-{i}"), "live")).await;
        c.delete_volume(pb::DeleteVolumeRequest {
            volume_id: v.volume_id,
            secrets: Default::default(),
        })
        .await
        .unwrap();
    }
    let live = started.elapsed();
    assert!(
        !stuck.is_finished(),
        "the dead export's create ended before the live export's calls ({live:?})"
    );
    println!("three creates and deletes on the live export: {live:?} while the dead one hangs");
    let r = stuck.await.unwrap();
    assert_eq!(code(&r), tonic::Code::Unavailable, "{r:?}");
}
