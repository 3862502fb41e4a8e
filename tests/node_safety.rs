//! Node safety through the binary on real mounts: another's filesystem at a
//! staging path or a target is never used, never taken for ours, and never
//! unmounted, before and after a driver restart. Needs root.

mod common;

use common::*;
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
        .controller()
        .create_volume(create_req("pvc-safe", 16 * MIB, cap.clone()))
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap();
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
    let config = "[node]\nallowed_paths = [\"@DIR@/kubelet\"]\n";
    let h = Harness::start_with(Some(config)).await;
    let cap = mount_cap("ext4", SNMW);
    let vol = h
        .controller()
        .create_volume(create_req("pvc-where", 16 * MIB, cap.clone()))
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap();
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
    let port = || {
        std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    };
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
