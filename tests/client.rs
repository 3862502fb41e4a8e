//! `ferrovol client` against the running driver: every subcommand, text and
//! JSON answers, exit statuses by gRPC code. Needs root (real mounts).

mod common;

use common::*;
use serde_json::Value;

struct Run {
    code: i32,
    stdout: String,
    stderr: String,
}

impl Run {
    fn json(&self) -> Value {
        serde_json::from_str(&self.stdout)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}\n{}", self.stdout, self.stderr))
    }
}

fn client(h: &Harness, args: &[&str]) -> Run {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_ferrovol"))
        .arg("client")
        .arg("--endpoint")
        .arg(format!("unix://{}", h.socket().display()))
        .args(args)
        .output()
        .unwrap();
    Run {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

fn ok(h: &Harness, args: &[&str]) -> Run {
    let r = client(h, args);
    assert_eq!(r.code, 0, "{args:?}: {}{}", r.stdout, r.stderr);
    r
}

#[tokio::test]
async fn every_subcommand_against_the_driver() {
    let h = Harness::start().await;
    let j = ["--output", "json"];
    let with = |extra: &[&str]| -> Vec<String> {
        j.iter()
            .chain(extra.iter())
            .map(|s| s.to_string())
            .collect()
    };
    let okj = |args: &[&str]| {
        let a = with(args);
        let a: Vec<&str> = a.iter().map(String::as_str).collect();
        ok(&h, &a).json()
    };

    // Identity.
    assert_eq!(okj(&["plugin-info"])["name"], "csi.ferrovol.io");
    let plugin = okj(&["plugin-capabilities"])["capabilities"].clone();
    assert!(
        plugin
            .as_array()
            .unwrap()
            .contains(&Value::from("SERVICE:CONTROLLER_SERVICE")),
        "{plugin}"
    );
    assert_eq!(ok(&h, &["probe"]).stdout.trim(), "ready: true");
    assert_eq!(okj(&["probe"])["ready"], true);
    // Capabilities and info.
    let ccaps = ok(&h, &["controller-capabilities"]).stdout;
    assert!(
        ccaps.contains("capabilities[0]: CREATE_DELETE_VOLUME"),
        "{ccaps}"
    );
    let ncaps = okj(&["node-capabilities"])["capabilities"].clone();
    assert!(
        ncaps
            .as_array()
            .unwrap()
            .contains(&Value::from("STAGE_UNSTAGE_VOLUME")),
        "{ncaps}"
    );
    assert_eq!(okj(&["node-info"])["node_id"], "test-node");

    // A volume: created, found again, validated, listed, capacity.
    let secrets = h.path("secrets");
    std::fs::write(
        &secrets,
        "# for the call\nuser=nobody\ntoken: do-not-print-me\n",
    )
    .unwrap();
    let secrets_s = secrets.display().to_string();
    let create = [
        "--secrets-file",
        &secrets_s,
        "create-volume",
        "pvc-client",
        "--size",
        "320Mi",
        "--fs-type",
        "xfs",
        "--param",
        "backend=file",
    ];
    let created = ok(
        &h,
        &with(&create).iter().map(String::as_str).collect::<Vec<_>>(),
    );
    assert!(!created.stdout.contains("do-not-print-me"));
    let vol = created.json()["volume"].clone();
    let id = vol["volume_id"].as_str().unwrap().to_string();
    assert_eq!(vol["capacity_bytes"], 320 << 20);
    assert_eq!(okj(&create[2..])["volume"]["volume_id"], id.as_str());
    let v = okj(&["validate-capabilities", &id, "--fs-type", "xfs"]);
    assert!(v["confirmed"].is_object(), "{v}");
    let page = okj(&["list-volumes", "--max-entries", "1"]);
    assert_eq!(page["entries"].as_array().unwrap().len(), 1);
    let cap = okj(&["get-capacity", "--param", "backend=file"]);
    assert!(cap["available_capacity"].as_i64().unwrap() > 0, "{cap}");
    // ControllerGetVolume and ControllerModifyVolume: whatever the driver
    // offers, the status says so.
    let got = client(&h, &["--output", "json", "get-volume", &id]);
    if ccaps.contains("GET_VOLUME") {
        assert_eq!(got.code, 0, "{}", got.stderr);
    } else {
        assert_eq!(
            got.code,
            10 + tonic::Code::Unimplemented as i32,
            "{}",
            got.stderr
        );
    }
    ok(
        &h,
        &["modify-volume", &id, "--mutable-param", "preallocate=true"],
    );
    let modified = client(&h, &["modify-volume", &id, "--mutable-param", "x=y"]);
    assert_eq!(
        modified.code,
        10 + tonic::Code::InvalidArgument as i32,
        "{}",
        modified.stderr
    );

    // Attach: no backend here attaches, so the driver does not offer it
    // (exit 10 + UNIMPLEMENTED); an unknown snapshot is NOT_FOUND (exit 15).
    let publish = client(
        &h,
        &[
            "controller-publish",
            &id,
            "--node",
            "test-node",
            "--fs-type",
            "xfs",
        ],
    );
    assert_eq!(
        publish.code,
        10 + tonic::Code::Unimplemented as i32,
        "{}",
        publish.stderr
    );
    let unpublish = client(&h, &["controller-unpublish", &id, "--node", "test-node"]);
    assert_eq!(
        unpublish.code,
        10 + tonic::Code::Unimplemented as i32,
        "{}",
        unpublish.stderr
    );
    let unknown = client(&h, &["get-snapshot", "file:no-such-snapshot"]);
    assert_eq!(
        unknown.code,
        10 + tonic::Code::NotFound as i32,
        "{}",
        unknown.stderr
    );
    assert!(unknown.stderr.contains("NotFound"), "{}", unknown.stderr);

    // Node: stage, publish, stats, expand, unpublish, unstage.
    let staging = h.path("kubelet/staging/c");
    let target = h.path("kubelet/pods/c");
    std::fs::create_dir_all(&staging).unwrap();
    let (st, tg) = (staging.display().to_string(), target.display().to_string());
    ok(&h, &["stage", &id, "--staging", &st, "--fs-type", "xfs"]);
    ok(
        &h,
        &[
            "publish",
            &id,
            "--staging",
            &st,
            "--target",
            &tg,
            "--fs-type",
            "xfs",
        ],
    );
    std::fs::write(target.join("f"), b"via the client").unwrap();
    let stats = okj(&["stats", &id, "--path", &tg]);
    assert!(stats["usage"][0]["total"].as_i64().unwrap() > 0, "{stats}");
    assert_eq!(
        okj(&["controller-expand", &id, "--size", "400Mi"])["capacity_bytes"],
        400 << 20
    );
    assert_eq!(
        okj(&["node-expand", &id, "--path", &tg, "--size", "400Mi"])["capacity_bytes"],
        400 << 20
    );

    // Snapshots and a restore.
    let snap = okj(&["create-snapshot", "snap-client", "--source", &id])["snapshot"].clone();
    let sid = snap["snapshot_id"].as_str().unwrap().to_string();
    assert!(snap["creation_time"].as_str().is_some(), "{snap}");
    assert_eq!(
        okj(&["get-snapshot", &sid])["snapshot"]["snapshot_id"],
        sid.as_str()
    );
    let listed = okj(&["list-snapshots", "--source", &id]);
    assert_eq!(listed["entries"].as_array().unwrap().len(), 1);
    let restored = okj(&[
        "create-volume",
        "pvc-restored",
        "--fs-type",
        "xfs",
        "--from-snapshot",
        &sid,
    ]);
    let rid = restored["volume"]["volume_id"]
        .as_str()
        .unwrap()
        .to_string();

    // A group snapshot of the staged volume and the restored one.
    let gcaps = okj(&["group-capabilities"]);
    assert_eq!(
        gcaps["capabilities"].as_array().unwrap().len(),
        1,
        "{gcaps}"
    );
    let group = okj(&[
        "create-group-snapshot",
        "group-client",
        "--source",
        &id,
        "--source",
        &rid,
    ])["group_snapshot"]
        .clone();
    let gid = group["group_snapshot_id"].as_str().unwrap().to_string();
    let members = group["snapshots"].as_array().unwrap().clone();
    assert_eq!(members.len(), 2, "{group}");
    assert!(group["creation_time"].as_str().is_some(), "{group}");
    let first = members[0]["snapshot_id"].as_str().unwrap();
    assert_eq!(
        okj(&["get-group-snapshot", &gid])["group_snapshot"]["group_snapshot_id"],
        gid.as_str()
    );
    assert_eq!(
        okj(&["get-snapshot", first])["snapshot"]["group_snapshot_id"],
        gid.as_str()
    );
    let wrong = client(&h, &["delete-group-snapshot", &gid, "--snapshot", first]);
    assert_eq!(
        wrong.code,
        10 + tonic::Code::InvalidArgument as i32,
        "{}",
        wrong.stderr
    );
    ok(&h, &["delete-group-snapshot", &gid]);
    let gone = client(&h, &["get-group-snapshot", &gid]);
    assert_eq!(
        gone.code,
        10 + tonic::Code::NotFound as i32,
        "{}",
        gone.stderr
    );

    ok(&h, &["unpublish", &id, "--target", &tg]);
    ok(&h, &["unstage", &id, "--staging", &st]);
    for v in [&rid, &id] {
        ok(&h, &["delete-volume", v]);
    }
    ok(&h, &["delete-snapshot", &sid]);
    assert!(okj(&["list-volumes"])["entries"]
        .as_array()
        .unwrap_or(&vec![])
        .is_empty());

    // Exit statuses: the call's code, a driver not there, a usage error,
    // a secrets file that is not one.
    let bad = client(&h, &["delete-volume", ""]);
    assert_eq!(
        bad.code,
        10 + tonic::Code::InvalidArgument as i32,
        "{}",
        bad.stderr
    );
    let gone = std::process::Command::new(env!("CARGO_BIN_EXE_ferrovol"))
        .args([
            "client",
            "--endpoint",
            "unix:///nonexistent/csi.sock",
            "probe",
        ])
        .output()
        .unwrap();
    assert_eq!(gone.status.code(), Some(1));
    assert_eq!(client(&h, &["create-volume"]).code, 2);
    std::fs::write(&secrets, "no separator here\n").unwrap();
    let r = client(&h, &["--secrets-file", &secrets_s, "probe"]);
    assert_eq!(r.code, 2, "{}", r.stderr);
}
