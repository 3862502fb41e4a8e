//! Node safety through the binary on real mounts: another's filesystem at a
//! staging path or a target is never used, never taken for ours, and never
//! unmounted, before and after a driver restart. Needs root.

mod common;

use common::*;
use ferrovol::proto::{self as pb, identity_client::IdentityClient};
use std::path::Path;
use tonic::Code;

fn mount_tmpfs_with_a_file(at: &Path) {
    std::fs::create_dir_all(at).unwrap();
    let ok = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=1m", "someone-else"])
        .arg(at)
        .status()
        .unwrap()
        .success();
    assert!(ok, "mount tmpfs");
    std::fs::write(at.join("theirs"), b"another tenant's file").unwrap();
}

fn still_theirs(at: &Path) {
    assert_eq!(
        std::fs::read(at.join("theirs")).unwrap(),
        b"another tenant's file",
        "{} was touched",
        at.display()
    );
}

#[tokio::test]
async fn foreign_mounts_are_refused_and_left_mounted() {
    let mut h = Harness::start().await;
    let cap = mount_cap("ext4", SNMW);
    let vol = h
        .create(create_req("pvc-safe", 16 * MIB, cap.clone()))
        .await;
    let id = vol.volume_id.clone();

    // A stage onto someone's tmpfs is refused, and nothing is attached.
    let foreign_staging = h.path("kubelet/staging/foreign");
    mount_tmpfs_with_a_file(&foreign_staging);
    let r = h
        .node()
        .node_stage_volume(stage_req(&id, &foreign_staging, cap.clone()))
        .await;
    assert_eq!(code(&r), Code::FailedPrecondition, "{r:?}");
    assert!(
        h.loop_devices().is_empty(),
        "a refused stage attached a device"
    );
    still_theirs(&foreign_staging);
    h.node()
        .node_unstage_volume(unstage_req(&id, &foreign_staging))
        .await
        .unwrap();
    still_theirs(&foreign_staging);

    // Staged properly; a publish onto someone's tmpfs is refused.
    let staging = h.path("kubelet/staging/ours");
    std::fs::create_dir_all(&staging).unwrap();
    h.node()
        .node_stage_volume(stage_req(&id, &staging, cap.clone()))
        .await
        .unwrap();
    let foreign_target = h.path("kubelet/pods/foreign");
    mount_tmpfs_with_a_file(&foreign_target);
    let r = h
        .node()
        .node_publish_volume(publish_req(
            &id,
            &staging,
            &foreign_target,
            cap.clone(),
            false,
        ))
        .await;
    assert_eq!(code(&r), Code::FailedPrecondition, "{r:?}");
    h.node()
        .node_unpublish_volume(unpublish_req(&id, &foreign_target))
        .await
        .unwrap();
    still_theirs(&foreign_target);

    // After a restart, the same: nothing of another's is taken or unmounted.
    h.kill();
    h.spawn().await;
    let r = h
        .node()
        .node_publish_volume(publish_req(
            &id,
            &staging,
            &foreign_target,
            cap.clone(),
            false,
        ))
        .await;
    assert_eq!(code(&r), Code::FailedPrecondition, "{r:?}");
    h.node()
        .node_unpublish_volume(unpublish_req(&id, &foreign_target))
        .await
        .unwrap();
    h.node()
        .node_unstage_volume(unstage_req(&id, &foreign_staging))
        .await
        .unwrap();
    still_theirs(&foreign_target);
    still_theirs(&foreign_staging);
    h.node()
        .node_unstage_volume(unstage_req(&id, &staging))
        .await
        .unwrap();
    assert!(h.loop_devices().is_empty());
    // Only the two foreign mounts are left, for the harness to clean up.
    assert_eq!(h.mounts().len(), 2, "{:?}", h.mounts());
}

/// Mounts go only where they belong: never onto a directory that holds
/// anything, never outside `[node] allowed_paths` (judged on the resolved
/// path); refused before anything is created, attached or mounted.
#[tokio::test]
async fn mounts_go_only_onto_empty_paths_under_the_allowed_prefixes() {
    let config = "[node]\nallowed_paths = [\"@DIR@/kubelet\"]\n[[backend]]\ntype = \"file\"\npool = \"@DIR@/pool\"\n";
    let h = Harness::start_with(Some(config)).await;
    let cap = mount_cap("ext4", SNMW);
    let vol = h
        .create(create_req("pvc-where", 16 * MIB, cap.clone()))
        .await;
    let id = vol.volume_id.clone();
    let mut n = h.node();

    // Outside the prefix (the state dir stands in for /etc).
    let outside = h.path("state/etc");
    std::fs::create_dir_all(&outside).unwrap();
    let r = n
        .node_stage_volume(stage_req(&id, &outside, cap.clone()))
        .await;
    assert_eq!(code(&r), Code::InvalidArgument, "{r:?}");
    // Inside it by name, outside it once a symlink on the way is resolved.
    std::os::unix::fs::symlink(h.path("state"), h.path("kubelet/escape")).unwrap();
    let sneaky = h.path("kubelet/escape/etc");
    let r = n
        .node_stage_volume(stage_req(&id, &sneaky, cap.clone()))
        .await;
    assert_eq!(code(&r), Code::InvalidArgument, "{r:?}");
    // A staging directory that holds something.
    let full = h.path("kubelet/staging/full");
    std::fs::create_dir_all(&full).unwrap();
    std::fs::write(full.join("config"), b"keep me").unwrap();
    let r = n
        .node_stage_volume(stage_req(&id, &full, cap.clone()))
        .await;
    assert_eq!(code(&r), Code::FailedPrecondition, "{r:?}");
    assert_eq!(std::fs::read(full.join("config")).unwrap(), b"keep me");
    assert!(h.loop_devices().is_empty() && h.mounts().is_empty());
    assert!(n
        .node_get_volume_stats(ferrovol::proto::NodeGetVolumeStatsRequest {
            volume_id: id.clone(),
            volume_path: full.display().to_string(),
            staging_target_path: String::new(),
        })
        .await
        .is_err());

    // Staged properly: a publish outside the prefix, or onto a target that
    // holds something, is refused and creates nothing.
    let staging = h.path("kubelet/staging/ok");
    std::fs::create_dir_all(&staging).unwrap();
    n.node_stage_volume(stage_req(&id, &staging, cap.clone()))
        .await
        .unwrap();
    let out_target = h.path("state/pod-target");
    let r = n
        .node_publish_volume(publish_req(&id, &staging, &out_target, cap.clone(), false))
        .await;
    assert_eq!(code(&r), Code::InvalidArgument, "{r:?}");
    assert!(!out_target.exists(), "a refused publish created its target");
    let busy = h.path("kubelet/pods/busy");
    std::fs::create_dir_all(&busy).unwrap();
    std::fs::write(busy.join("data"), b"x").unwrap();
    let r = n
        .node_publish_volume(publish_req(&id, &staging, &busy, cap.clone(), false))
        .await;
    assert_eq!(code(&r), Code::FailedPrecondition, "{r:?}");
    assert_eq!(
        h.mounts().len(),
        1,
        "only the staging mount: {:?}",
        h.mounts()
    );
    n.node_unstage_volume(unstage_req(&id, &staging))
        .await
        .unwrap();
    assert!(h.loop_devices().is_empty() && h.mounts().is_empty());
}

/// NodeUnpublish with nothing published at the target takes away only
/// an empty directory inside the allowed paths: a regular file, a device
/// node, a FIFO, a socket, a directory with something in it, and anything
/// outside `[node] allowed_paths` are left, whatever volume id of the
/// right form the caller names (each of them was removed before).
#[tokio::test]
async fn unpublish_removes_only_what_a_publish_could_have_made() {
    let config = "[node]\nallowed_paths = [\"@DIR@/kubelet\"]\n[[backend]]\ntype = \"file\"\npool = \"@DIR@/pool\"\n";
    let h = Harness::start_with(Some(config)).await;
    let cap = mount_cap("ext4", SNW);
    let vol = h
        .create(create_req("pvc-unpub", 16 * MIB, cap.clone()))
        .await;
    let id = vol.volume_id.clone();
    let mut n = h.node();
    let pods = h.path("kubelet/pods");
    std::fs::create_dir_all(&pods).unwrap();
    let file = pods.join("file");
    std::fs::write(&file, b"").unwrap();
    let full = pods.join("full");
    std::fs::create_dir_all(&full).unwrap();
    std::fs::write(full.join("data"), b"keep").unwrap();
    let fifo = pods.join("fifo");
    nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
    let socket = pods.join("socket");
    let _listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
    let device = pods.join("null");
    nix::sys::stat::mknod(
        &device,
        nix::sys::stat::SFlag::S_IFCHR,
        nix::sys::stat::Mode::from_bits_truncate(0o600),
        nix::sys::stat::makedev(1, 3),
    )
    .unwrap();
    let outside = h.path("state/outside");
    std::fs::create_dir_all(&outside).unwrap();
    let unpublish = |target: &Path| ferrovol::proto::NodeUnpublishVolumeRequest {
        volume_id: id.clone(),
        target_path: target.display().to_string(),
    };
    for kept in [&file, &full, &fifo, &socket, &device] {
        n.node_unpublish_volume(unpublish(kept)).await.unwrap();
        assert!(
            std::fs::symlink_metadata(kept).is_ok(),
            "{} was removed",
            kept.display()
        );
    }
    assert_eq!(std::fs::read(full.join("data")).unwrap(), b"keep");
    let r = n.node_unpublish_volume(unpublish(&outside)).await;
    assert_eq!(code(&r), Code::InvalidArgument, "{r:?}");
    assert!(
        outside.is_dir(),
        "a directory outside allowed_paths was removed"
    );
    // An empty directory inside them is what a CO made for a publish:
    // it goes, and a second call finds nothing to do.
    let empty = pods.join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    n.node_unpublish_volume(unpublish(&empty)).await.unwrap();
    assert!(!empty.exists());
    n.node_unpublish_volume(unpublish(&empty)).await.unwrap();
}

/// mkfs options come from the volume context, which a caller of
/// NodeStage writes: only the options reviewed for the filesystem's mkfs
/// pass. `-d etc` (from the driver's working directory, `/` in a container
/// without WORKDIR, it copied the node's /etc into the new filesystem) and
/// its other spellings are refused before anything is formatted, and the
/// stage leaves nothing attached or mounted.
#[tokio::test]
async fn mkfs_options_that_name_files_are_refused_at_stage() {
    let h = Harness::start().await;
    let cap = mount_cap("ext4", SNW);
    let vol = h
        .create(create_req("pvc-mkfs", 16 * MIB, cap.clone()))
        .await;
    let mut n = h.node();
    let staging = h.path("staging");
    std::fs::create_dir_all(&staging).unwrap();
    for options in [
        "-d etc",
        "-d /etc",
        "-E root_owner=0:0",
        "-J device=/etc/passwd",
        "-detc",
    ] {
        let mut req = stage_req(&vol.volume_id, &staging, cap.clone());
        req.volume_context
            .insert("mkfsOptions".into(), options.into());
        let r = n.node_stage_volume(req).await;
        assert_eq!(code(&r), Code::InvalidArgument, "{options}: {r:?}");
        assert!(h.mounts().is_empty(), "{options}: {:?}", h.mounts());
        assert!(
            h.loop_devices().is_empty(),
            "{options}: {:?}",
            h.loop_devices()
        );
    }
    // A reviewed option goes through.
    let mut req = stage_req(&vol.volume_id, &staging, cap.clone());
    req.volume_context
        .insert("mkfsOptions".into(), "-E nodiscard -L data".into());
    n.node_stage_volume(req).await.unwrap();
    n.node_unstage_volume(unstage_req(&vol.volume_id, &staging))
        .await
        .unwrap();
    assert!(h.loop_devices().is_empty() && h.mounts().is_empty());
}

/// Everything the driver keeps is root's alone: images, snapshot copies,
/// restored copies, records and their directories carry no group or
/// other permission bits (images were 0644 and the pool 0755, readable by
/// every local user), a state directory that was open before is closed.
#[tokio::test]
async fn what_the_driver_keeps_is_private_to_root() {
    use std::os::unix::fs::PermissionsExt;
    let h = Harness::start().await;
    let cap = mount_cap("ext4", SNW);
    let mut c = h.controller();
    let vol = h
        .create(create_req("pvc-private", 16 * MIB, cap.clone()))
        .await;
    let snap = h.snapshot_made("snap-private", &vol.volume_id).await;
    let mut restore = create_req("pvc-restored", 16 * MIB, cap.clone());
    restore.volume_content_source = Some(snapshot_source(&snap.snapshot_id));
    c.create_volume(restore).await.unwrap();
    let mut n = h.node();
    let staging = h.path("kubelet/staging/private");
    std::fs::create_dir_all(&staging).unwrap();
    n.node_stage_volume(stage_req(&vol.volume_id, &staging, cap.clone()))
        .await
        .unwrap();
    let target = h.path("kubelet/pods/private");
    n.node_publish_volume(publish_req(
        &vol.volume_id,
        &staging,
        &target,
        cap.clone(),
        false,
    ))
    .await
    .unwrap();

    fn walk(p: &Path, out: &mut Vec<(std::path::PathBuf, u32)>) {
        let md = std::fs::symlink_metadata(p).unwrap();
        out.push((p.to_path_buf(), md.permissions().mode() & 0o7777));
        if md.is_dir() {
            for e in std::fs::read_dir(p).unwrap() {
                walk(&e.unwrap().path(), out);
            }
        }
    }
    let mut seen = Vec::new();
    walk(&h.state_dir(), &mut seen);
    assert!(seen.len() > 8, "{seen:?}");
    assert!(
        seen.iter()
            .any(|(p, _)| p.extension().is_some_and(|e| e == "img")),
        "no image under the state dir: {seen:?}"
    );
    let open: Vec<_> = seen.iter().filter(|(_, m)| m & 0o077 != 0).collect();
    assert!(open.is_empty(), "readable by others: {open:#?}");

    n.node_unpublish_volume(pb::NodeUnpublishVolumeRequest {
        volume_id: vol.volume_id.clone(),
        target_path: target.display().to_string(),
    })
    .await
    .unwrap();
    n.node_unstage_volume(unstage_req(&vol.volume_id, &staging))
        .await
        .unwrap();
}

fn openssl(dir: &Path, args: &[&str]) {
    let out = std::process::Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("openssl");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A CA, a server certificate for localhost/127.0.0.1 and a client
/// certificate, made with the openssl CLI.
fn make_certs(dir: &Path) {
    openssl(
        dir,
        &[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            "ca.key",
            "-out",
            "ca.crt",
            "-days",
            "1",
            "-subj",
            "/CN=ferrovol-test-ca",
        ],
    );
    std::fs::write(
        dir.join("server.ext"),
        "subjectAltName=DNS:localhost,IP:127.0.0.1\n",
    )
    .unwrap();
    // Extensions make the certificates X.509 v3, which rustls requires.
    std::fs::write(dir.join("client.ext"), "extendedKeyUsage=clientAuth\n").unwrap();
    for (name, ext) in [
        ("server", Some("server.ext")),
        ("client", Some("client.ext")),
    ] {
        let (key, csr, crt) = (
            format!("{name}.key"),
            format!("{name}.csr"),
            format!("{name}.crt"),
        );
        openssl(
            dir,
            &[
                "req",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-keyout",
                &key,
                "-out",
                &csr,
                "-subj",
                &format!("/CN={name}"),
            ],
        );
        let mut args = vec![
            "x509",
            "-req",
            "-in",
            &csr,
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            &crt,
            "-days",
            "1",
        ];
        if let Some(e) = ext {
            args.extend(["-extfile", e]);
        }
        openssl(dir, &args);
    }
}

async fn tls_probe(port: u16, certs: &Path, with_client_cert: bool) -> Result<bool, String> {
    use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity};
    let read = |f: &str| std::fs::read(certs.join(f)).unwrap();
    let mut tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(read("ca.crt")))
        .domain_name("localhost");
    if with_client_cert {
        tls = tls.identity(Identity::from_pem(read("client.crt"), read("client.key")));
    }
    let channel = Endpoint::from_shared(format!("https://127.0.0.1:{port}"))
        .unwrap()
        .tls_config(tls)
        .map_err(|e| e.to_string())?
        .connect()
        .await
        .map_err(|e| e.to_string())?;
    let mut id = ferrovol::proto::identity_client::IdentityClient::new(channel);
    id.probe(ferrovol::proto::ProbeRequest {})
        .await
        .map(|r| r.into_inner().ready == Some(true))
        .map_err(|e| e.to_string())
}

/// A TCP endpoint serves the network only with mutual TLS: a non-loopback
/// address without TLS is refused at start, naming the flags; with TLS, a
/// client without a certificate is refused and one with a certificate is
/// served.
#[tokio::test]
async fn tcp_serves_the_network_only_with_mutual_tls() {
    require_root();
    let dir = tempfile::tempdir().unwrap();
    let port = free_port;
    let bin = env!("CARGO_BIN_EXE_ferrovol");
    let state = dir.path().join("state");
    let refused = std::process::Command::new(bin)
        .args([
            "serve",
            "--endpoint",
            &format!("tcp://0.0.0.0:{}", port()),
            "--node-id",
            "n",
            "--state-dir",
        ])
        .arg(&state)
        .output()
        .unwrap();
    assert!(!refused.status.success());
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(
        stderr.contains("--tls-cert") && stderr.contains("loopback"),
        "{stderr}"
    );

    make_certs(dir.path());
    let port = port();
    /// Kills the driver however the test ends.
    struct Killed(std::process::Child);
    impl Drop for Killed {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let child = std::process::Command::new(bin)
        .args([
            "serve",
            "--endpoint",
            &format!("tcp://127.0.0.1:{port}"),
            "--node-id",
            "n",
            "--state-dir",
        ])
        .arg(&state)
        .arg("--tls-cert")
        .arg(dir.path().join("server.crt"))
        .arg("--tls-key")
        .arg(dir.path().join("server.key"))
        .arg("--tls-client-ca")
        .arg(dir.path().join("ca.crt"))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut child = Killed(child);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    let served = loop {
        match tls_probe(port, dir.path(), true).await {
            Ok(ready) => break ready,
            Err(e) => {
                assert!(
                    std::time::Instant::now() < deadline,
                    "never served over TLS: {e}"
                );
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            }
        }
    };
    let without = tls_probe(port, dir.path(), false).await;
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.0.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let status = child.0.wait().unwrap();
    assert!(served, "Probe with a client certificate");
    assert!(
        without.is_err(),
        "a client without a certificate was served: {without:?}"
    );
    assert!(status.success(), "{status:?}");
}

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Connects to a unix socket, retrying while the driver's accept queue is
/// full (a driver at its connection cap stops accepting for a moment).
async fn connect_when_queued(socket: &Path) -> tokio::net::UnixStream {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        match tokio::net::UnixStream::connect(socket).await {
            Ok(s) => return s,
            Err(e) => {
                assert!(
                    std::time::Instant::now() < deadline,
                    "could not connect for 60 s: {e}"
                );
                tokio::time::sleep(std::time::Duration::from_millis(5)).await;
            }
        }
    }
}

/// Reads until the driver closes the connection; panics if it is still
/// open after `within`.
async fn closed_by_driver(mut s: tokio::net::UnixStream, within: std::time::Duration, what: &str) {
    use tokio::io::AsyncReadExt;
    let mut buf = [0u8; 4096];
    let closed = tokio::time::timeout(within, async {
        loop {
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    })
    .await;
    assert!(closed.is_ok(), "the driver kept a {what} connection open");
}

/// 3,000 connections at once, half of them garbage (random bytes, a valid
/// HTTP/2 preface followed by junk, or nothing at all): the driver drops the
/// garbage (the silent ones at its handshake timeout), serves the others,
/// answers a client that was there before the flood without delay (99
/// Probes in 100 within a second, none held 5 s), and its
/// peak memory stays under the stated bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn connection_floods_cost_bounded_memory() {
    const CONNECTIONS: usize = 3000;
    /// How much the driver's resident memory may grow at its peak during
    /// the flood (without the connection cap it grows by about 13 MiB).
    const GROWTH_KB: u64 = 8 * 1024;
    let h = Harness::start_with_env(
        None,
        &[
            ("FERROVOL_MAX_CONNECTIONS", "64"),
            ("FERROVOL_HANDSHAKE_TIMEOUT", "2"),
            ("RUST_LOG", "info"),
        ],
    )
    .await;
    let socket = h.socket();
    let rss_before = h.status_kb("VmRSS");
    h.reset_peak_rss();

    // A client connected before the flood keeps calling Probe.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let watcher = {
        let mut id = h.identity();
        let stop = stop.clone();
        tokio::spawn(async move {
            let mut took = Vec::new();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let t = std::time::Instant::now();
                let r = id.probe(pb::ProbeRequest {}).await;
                assert!(r.is_ok(), "Probe during the flood: {r:?}");
                took.push(t.elapsed());
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
            took.sort();
            took
        })
    };

    let mut rng = Rng::seeded("connection_floods_cost_bounded_memory");
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..CONNECTIONS {
        let socket = socket.clone();
        let mut junk = vec![0u8; 1024 + rng.below(8192) as usize];
        for b in junk.iter_mut() {
            *b = rng.next() as u8;
        }
        tasks.spawn(async move {
            use tokio::io::AsyncWriteExt;
            let limit = std::time::Duration::from_secs(60);
            match i % 6 {
                // Random bytes.
                0 => {
                    let mut s = connect_when_queued(&socket).await;
                    let _ = s.write_all(&junk).await;
                    closed_by_driver(s, limit, "garbage").await;
                }
                // The HTTP/2 preface, then a frame header announcing 16 MiB
                // and junk.
                2 => {
                    let mut s = connect_when_queued(&socket).await;
                    let _ = s.write_all(PREFACE).await;
                    let _ = s.write_all(&[0xff, 0xff, 0xff, 0, 0, 0, 0, 0, 1]).await;
                    let _ = s.write_all(&junk).await;
                    closed_by_driver(s, limit, "oversized-frame").await;
                }
                // The preface, then junk as a DATA frame where SETTINGS
                // must come.
                4 => {
                    let mut s = connect_when_queued(&socket).await;
                    let _ = s.write_all(PREFACE).await;
                    let len = junk.len().min(16_384) as u32;
                    let mut frame = len.to_be_bytes()[1..].to_vec();
                    frame.extend([0, 0, 0, 0, 0, 0]);
                    frame.extend(&junk[..len as usize]);
                    let _ = s.write_all(&frame).await;
                    closed_by_driver(s, limit, "junk-frame").await;
                }
                // Well-behaved clients: connect, Probe, stay a moment, leave.
                _ => {
                    let ch = loop {
                        if let Ok(ch) = connect(&socket).await {
                            break ch;
                        }
                        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
                    };
                    let r = IdentityClient::new(ch.clone())
                        .probe(pb::ProbeRequest {})
                        .await;
                    assert!(r.is_ok(), "a well-behaved client's Probe: {r:?}");
                    // Stay a moment, as a client between calls does.
                    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
                    drop(ch);
                }
            }
        });
    }
    // And some that connect and say nothing: dropped at the handshake
    // timeout, so they cannot hold the connection slots.
    for _ in 0..100 {
        let socket = socket.clone();
        tasks.spawn(async move {
            let s = connect_when_queued(&socket).await;
            closed_by_driver(s, std::time::Duration::from_secs(60), "silent").await;
        });
    }
    while let Some(r) = tasks.join_next().await {
        r.unwrap();
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let took = watcher.await.unwrap();
    let peak = h.status_kb("VmHWM");
    let rss_after = h.status_kb("VmRSS");
    assert!(took.len() >= 20, "{} Probes", took.len());
    let at = |q: usize| took[(took.len() - 1) * q / 100];
    let (p50, p99, worst) = (at(50), at(99), took[took.len() - 1]);
    println!(
        "flood: rss before {rss_before} kB, peak {peak} kB, after {rss_after} kB; \
         watcher: {} Probes, p50 {p50:?}, p99 {p99:?}, slowest {worst:?}",
        took.len()
    );
    // Served through the flood, not after it: the Probes within a second
    // but for one in a hundred (a test on a busy machine loses the CPU
    // now and then, the driver or this process: the slowest of 207 took
    // 1.8 s in a run of tests/run beside the guest, 2026-12-03), and none
    // held for long (a client starved by the flood would wait for most
    // of it: 20-30 s).
    assert!(
        p99 < std::time::Duration::from_secs(1),
        "a client connected before the flood waited {p99:?} at the 99th percentile"
    );
    assert!(
        worst < std::time::Duration::from_secs(5),
        "a client connected before the flood waited {worst:?}"
    );
    assert!(
        peak < rss_before + GROWTH_KB,
        "peak memory {peak} kB during the flood, from {rss_before} kB (bound: {GROWTH_KB} kB more)"
    );
    // Still serving afterwards.
    let r = h.identity().probe(pb::ProbeRequest {}).await;
    assert!(r.is_ok(), "{r:?}");
}

/// A flood of 3,000 connections that never complete a handshake (half
/// silent, half sending bytes that are not HTTP/2), all held open, with
/// the default caps (256 connections, a 10 s handshake deadline): a new,
/// well-behaved client arriving during it is answered, and so is Probe
/// after it. Before, it waited for the flood's handshake deadlines to run
/// out, batch after batch of 256 (70 s measured); now each new connection
/// at the cap takes the slot of the oldest unproven one. The bound
/// asserted is half of one handshake deadline: without eviction, no new
/// client gets a slot sooner than one deadline. Memory (resident, and
/// its anonymous part) before, during and after the flood is printed, and
/// the heap must shrink back once the flood has gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_new_client_is_served_during_a_flood_of_unproven_connections() {
    use tokio::io::AsyncWriteExt;
    const FLOOD: usize = 3000;
    let h = Harness::start_with_env(None, &[("RUST_LOG", "info")]).await;
    let socket = h.socket();
    let rss_before = h.status_kb("VmRSS");
    let anon_before = h.status_kb("RssAnon");
    let mut flood = Vec::with_capacity(FLOOD);
    for i in 0..FLOOD {
        let mut s = connect_when_queued(&socket).await;
        if i % 2 == 1 {
            let _ = s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").await;
        }
        flood.push(s);
    }
    let started = std::time::Instant::now();
    let ch = loop {
        if let Ok(ch) = connect(&socket).await {
            break ch;
        }
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    };
    let r = IdentityClient::new(ch).probe(pb::ProbeRequest {}).await;
    let waited = started.elapsed();
    assert!(r.is_ok(), "the new client's Probe: {r:?}");
    let peak = h.status_kb("VmRSS");
    let anon_peak = h.status_kb("RssAnon");
    drop(flood);
    // The flood is gone: still serving.
    let r = h.identity().probe(pb::ProbeRequest {}).await;
    assert!(r.is_ok(), "{r:?}");
    // The flood's memory goes back to the system once it has passed: the
    // heap returns to within RETURNED_KB of where it was (before, it stayed
    // at the flood's high-water mark, 7 MB up). The driver checks once a
    // second; a busy machine gets 30 s.
    const RETURNED_KB: u64 = 2048;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let mut anon_after = h.status_kb("RssAnon");
    while anon_after > anon_before + RETURNED_KB && std::time::Instant::now() < deadline {
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        anon_after = h.status_kb("RssAnon");
    }
    let rss_after = h.status_kb("VmRSS");
    println!(
        "flood of {FLOOD}: a new client answered in {waited:?}; rss before {rss_before} kB, \
         during {peak} kB, after {rss_after} kB; of it anonymous (heap): {anon_before}, \
         {anon_peak}, {anon_after} kB"
    );
    assert!(
        waited < std::time::Duration::from_secs(5),
        "a new client waited {waited:?} during the flood"
    );
    assert!(
        anon_after <= anon_before + RETURNED_KB,
        "the flood's memory stayed: heap {anon_after} kB after it, {anon_before} kB before"
    );
}

/// A client that connects and says only HTTP/2's preface and SETTINGS (a
/// gRPC channel opened ahead of its first call) has proven itself: it is
/// not closed at the handshake deadline, however long it stays idle (the
/// :authority fix between the socket and the HTTP/2 server passes the
/// preface on at once; only header blocks wait for it).
#[tokio::test]
async fn an_idle_client_that_has_spoken_http2_is_kept() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let h = Harness::start_with_env(None, &[("FERROVOL_HANDSHAKE_TIMEOUT", "1")]).await;
    let mut s = connect_when_queued(&h.socket()).await;
    s.write_all(PREFACE).await.unwrap();
    // An empty SETTINGS frame.
    s.write_all(&[0, 0, 0, 4, 0, 0, 0, 0, 0]).await.unwrap();
    // A silent one beside it, closed at the deadline: the deadline is live.
    let silent = connect_when_queued(&h.socket()).await;
    closed_by_driver(silent, std::time::Duration::from_secs(30), "silent").await;
    // Three deadlines idle: the talker's connection is still open (the
    // server's SETTINGS and its ack arrive, then nothing, never an EOF).
    let idle_until = tokio::time::Instant::now() + std::time::Duration::from_secs(3);
    let mut buf = [0u8; 1024];
    loop {
        match tokio::time::timeout_at(idle_until, s.read(&mut buf)).await {
            Err(_) => break,
            Ok(Ok(0)) => panic!("the driver closed an idle HTTP/2 client"),
            Ok(Ok(_)) => {}
            Ok(Err(e)) => panic!("the driver dropped an idle HTTP/2 client: {e}"),
        }
    }
}

/// The loop devices backed by the file `image` (its device and inode, as
/// `losetup` reads them from the kernel: not the path text, which depends
/// on the mount namespace of the process that attached it).
fn loops_of(image: &Path) -> Vec<String> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(image).unwrap();
    let (major, minor) = (
        nix::sys::stat::major(m.dev()),
        nix::sys::stat::minor(m.dev()),
    );
    let out = std::process::Command::new("losetup")
        .args(["--list", "--noheadings", "-O", "NAME,BACK-INO,BACK-MAJ:MIN"])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.len() == 3 && f[1] == m.ino().to_string() && f[2] == format!("{major}:{minor}"))
                .then(|| f[0].to_string())
        })
        .collect()
}

/// A node plugin replaced as a DaemonSet roll replaces it: the driver runs
/// in a mount namespace of its own with the pool bind-mounted into it (as
/// a container has its hostPath), stages and publishes a file volume, and
/// dies with its namespace; a new one in a new namespace (the kubelet's
/// mounts kept, shared with it as a Bidirectional mount is) must know the
/// volume's loop device for its own: stage and publish again add no
/// device and no mount, the data is there, and unstage lets the device
/// go. The kernel shows the old device's backing file by the dead
/// namespace's path, not the driver's. Needs root.
#[tokio::test]
async fn a_driver_in_a_new_mount_namespace_knows_the_loop_devices_of_the_last() {
    require_root();
    let config = "[[backend]]\ntype = \"file\"\npool = \"@DIR@/view\"\n";
    let mut h = Harness::start_with(Some(config)).await;
    h.kill();
    let (pool, view, kubelet) = (h.path("pool"), h.path("view"), h.path("kubelet"));
    std::fs::create_dir_all(&pool).unwrap();
    // What a failed run leaves: the harness finds loop devices by their
    // path text, which these no longer show.
    struct Detach(std::path::PathBuf);
    impl Drop for Detach {
        fn drop(&mut self) {
            common::cleanup(&self.0.parent().unwrap().join("kubelet"));
            let volumes = self.0.join("volumes");
            for image in std::fs::read_dir(volumes).into_iter().flatten().flatten() {
                for dev in loops_of(&image.path()) {
                    let _ = std::process::Command::new("losetup")
                        .args(["-d", &dev])
                        .status();
                }
            }
        }
    }
    let _detach = Detach(pool.clone());
    // The kubelet's folder is shared with the driver's namespaces.
    let sh = |script: &str| {
        let ok = std::process::Command::new("sh")
            .args(["-c", script])
            .status()
            .unwrap()
            .success();
        assert!(ok, "{script}");
    };
    sh(&format!(
        "mount --bind {k} {k} && mount --make-shared {k}",
        k = kubelet.display()
    ));
    h.wrap = vec![
        "unshare".into(),
        "--mount".into(),
        "--propagation".into(),
        "unchanged".into(),
        "--".into(),
        "sh".into(),
        "-c".into(),
        "mount --bind \"$1\" \"$2\" && shift 2 && exec \"$@\"".into(),
        "sh".into(),
        pool.display().to_string(),
        view.display().to_string(),
    ];
    h.spawn().await;
    let cap = mount_cap("ext4", 1);
    let p = h.provision("pvc-roll", 16 * MIB, cap.clone()).await;
    std::fs::write(p.target.join("data"), "kept").unwrap();
    let image = std::fs::read_dir(pool.join("volumes"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|x| x == "img"))
        .expect("the volume's image in the pool");
    let devices = loops_of(&image);
    assert_eq!(devices.len(), 1, "{devices:?}");
    // The namespace dies with the driver: its path is no longer the one
    // the kernel shows.
    h.kill();
    let name = devices[0].trim_start_matches("/dev/");
    let shown = std::fs::read_to_string(format!("/sys/block/{name}/loop/backing_file")).unwrap();
    assert!(
        !shown.starts_with(view.to_str().unwrap()),
        "the kernel still shows the driver's path: {shown}"
    );

    h.spawn().await;
    // The image is in use: its delete is refused, not done under it.
    let r = h
        .controller()
        .delete_volume(pb::DeleteVolumeRequest {
            volume_id: p.id.clone(),
            ..Default::default()
        })
        .await;
    assert_eq!(code(&r), Code::FailedPrecondition, "{r:?}");
    assert!(image.exists());
    let mounts = h.mounts().len();
    h.node()
        .node_stage_volume(stage_req(&p.id, &p.staging, cap.clone()))
        .await
        .unwrap();
    h.node()
        .node_publish_volume(publish_req(&p.id, &p.staging, &p.target, cap, false))
        .await
        .unwrap();
    assert_eq!(
        loops_of(&image),
        devices,
        "a second loop device over one image"
    );
    assert_eq!(h.mounts().len(), mounts, "stage or publish mounted again");
    assert_eq!(
        std::fs::read_to_string(p.target.join("data")).unwrap(),
        "kept"
    );
    h.unpublish_unstage(&p.id, &p.staging, &p.target).await;
    assert_eq!(
        loops_of(&image),
        Vec::<String>::new(),
        "unstage left the device"
    );
    h.delete_volume(&p.id).await;
    assert!(!image.exists());
    h.kill();
    sh(&format!("umount -l {}", kubelet.display()));
}
