//! The controller's side: parameters, keyrings, creation, clones, snapshots, deletes, capacity, growth, redaction, listing.

use super::*;

#[test]
fn parameters_and_ids_are_checked() {
    let dir = tempfile::tempdir().unwrap();
    let b = backend(Arc::new(FakeRunner::new()), dir.path(), false);
    let p = |pairs: &[(&str, &str)]| {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect::<BTreeMap<_, _>>()
    };
    b.validate_parameters(&p(&[
        ("pool", "fast"),
        ("radosNamespace", "team-a"),
        ("imageFeatures", "layering,exclusive-lock"),
        ("mapOptions", "ms_mode=crc"),
    ]))
    .unwrap();
    for bad in [
        p(&[("pool", "other")]),
        p(&[("size", "1")]),
        p(&[("radosNamespace", "../x")]),
        p(&[("imageFeatures", "magic")]),
        p(&[("mapOptions", "a b")]),
        p(&[("dataPool", "-x")]),
    ] {
        assert_eq!(
            crate::plugin::check_parameters(&b, &bad).unwrap_err().kind,
            Kind::InvalidArgument,
            "{bad:?}"
        );
    }
    let id = b.volume_id_for(&create("pvc-1")).unwrap();
    assert_eq!(id.to_string(), "rbd:v1.c1.rbd._e.fv-pvc-1");
    assert_eq!(b.volume_spec(&id).unwrap().arg(), "rbd/fv-pvc-1");
    for other in [
        "rbd:v1.c2.rbd._e.fv-x",
        "rbd:v1.c1.elsewhere._e.fv-x",
        "rbd:v1.c1.rbd._e.fvs-x",
        "rbd:v1.c1.rbd._e.someone",
    ] {
        assert!(
            b.volume_spec(&VolumeId::parse(other).unwrap()).is_err(),
            "{other}"
        );
    }
    assert!(RbdBackend::new(
        "rbd",
        RbdSettings {
            monitors: vec!["10.0.0.1".into()],
            ..b.settings.clone()
        },
        Arc::new(FakeRunner::new()),
        dir.path().into()
    )
    .is_err());
}

#[tokio::test]
async fn secrets_reach_rbd_in_a_private_keyring_only() {
    let dir = tempfile::tempdir().unwrap();
    let r = Arc::new(FakeRunner::new());
    let b = backend(r.clone(), dir.path(), false);
    // Missing, half, and malformed secrets; no config user to fall back on.
    let e = b
        .delete_volume(
            &VolumeId::parse("rbd:v1.c1.rbd._e.fv-x").unwrap(),
            &Secrets::default(),
        )
        .await
        .unwrap_err();
    assert_eq!(e.kind, Kind::InvalidArgument);
    let mut half = create("pvc-1");
    half.secrets = Secrets::new(BTreeMap::from([(
        USER_ID.to_string(),
        "ferrovol".to_string(),
    )]));
    assert_eq!(
        b.create_volume(&half).await.unwrap_err().kind,
        Kind::InvalidArgument
    );
    let mut bad = create("pvc-1");
    bad.secrets = Secrets::new(BTreeMap::from([
        (USER_ID.to_string(), "ferrovol".to_string()),
        (USER_KEY.to_string(), "not a key; rm -rf".to_string()),
    ]));
    let e = b.create_volume(&bad).await.unwrap_err();
    assert!(!e.message.contains("rm -rf"), "{e}");
    assert!(r.lines().is_empty());

    // A call with secrets: the key is in a 0600 keyring named on argv,
    // gone after the call.
    r.expect("rbd", Reply::Fail(2, NO_IMAGE.into()))
        .expect("rbd", Reply::Fail(2, NO_IMAGE.into())) // no temporary left
        .expect("rbd", Reply::Ok("[]".into()));
    let id = VolumeId::parse("rbd:v1.c1.rbd._e.fv-gone").unwrap();
    b.delete_volume(&id, &secrets()).await.unwrap();
    let line = &r.lines()[0];
    assert!(
        line.starts_with("rbd -c /dev/null -m v1:10.0.0.1:6789 --id ferrovol --keyring "),
        "{line}"
    );
    assert!(!line.contains(KEY));
    let keyring = line
        .split(" --keyring ")
        .nth(1)
        .unwrap()
        .split(' ')
        .next()
        .unwrap();
    assert!(
        !std::path::Path::new(keyring).exists(),
        "the keyring was left behind"
    );
}

#[tokio::test]
async fn create_names_the_image_only_when_it_is_complete() {
    let dir = tempfile::tempdir().unwrap();
    let r = Arc::new(FakeRunner::new());
    let b = backend(r.clone(), dir.path(), false);
    r.expect("rbd", Reply::Fail(2, NO_IMAGE.into()))
        .expect("rbd", Reply::Fail(2, NO_IMAGE.into()))
        .ok("rbd")
        .ok("rbd")
        .ok("rbd");
    let v = b.create_volume(&create("pvc-1")).await.unwrap();
    assert_eq!(v.capacity_bytes, 11 * MIB);
    assert_eq!(
        ops(&r),
        [
            "info rbd/fv-pvc-1 --format json",
            "info rbd/tmp-fv-pvc-1 --format json",
            "create rbd/tmp-fv-pvc-1 --size 11M --image-feature layering",
            "image-meta set rbd/tmp-fv-pvc-1 ferrovol.name pvc-1",
            "rename rbd/tmp-fv-pvc-1 rbd/fv-pvc-1",
        ]
    );

    // Retried: found by its metadata; another name's image is not taken.
    r.expect("rbd", Reply::Ok(info("fv-pvc-1", 11 * MIB)))
        .expect("rbd", Reply::Ok(r#"{"ferrovol.name":"pvc-1"}"#.into()));
    assert_eq!(b.create_volume(&create("pvc-1")).await.unwrap().id, v.id);
    r.expect("rbd", Reply::Ok(info("fv-pvc-1", 11 * MIB)))
        .expect("rbd", Reply::Ok(r#"{"ferrovol.name":"other"}"#.into()));
    assert_eq!(
        b.create_volume(&create("pvc-1")).await.unwrap_err().kind,
        Kind::AlreadyExists
    );

    // A create cut short left its temporary image: cleared, then made.
    r.expect("rbd", Reply::Fail(2, NO_IMAGE.into()))
        .expect("rbd", Reply::Ok(info("tmp-fv-pvc-2", 11 * MIB)))
        .expect("rbd", Reply::Ok(r#"{"ferrovol.name":"pvc-2"}"#.into()))
        .ok("rbd")
        .ok("rbd")
        .ok("rbd")
        .ok("rbd");
    b.create_volume(&create("pvc-2")).await.unwrap();
    assert!(ops(&r).contains(&"rm rbd/tmp-fv-pvc-2".to_string()));
}

#[tokio::test]
async fn clones_past_the_depth_are_flattened() {
    let dir = tempfile::tempdir().unwrap();
    let r = Arc::new(FakeRunner::new());
    let b = backend(r.clone(), dir.path(), false);
    let mut req = create("pvc-copy");
    req.required_bytes = 0;
    req.source = Some(ContentSource::Volume(
        VolumeId::parse("rbd:v1.c1.rbd._e.fv-src").unwrap(),
    ));
    r.expect("rbd", Reply::Fail(2, NO_IMAGE.into()))
        .expect("rbd", Reply::Fail(2, NO_IMAGE.into()))
        .expect("rbd", Reply::Ok(clone_info("fv-src", "fv-root")))
        .ok("rbd") // snap create
        .ok("rbd") // clone
        .ok("rbd") // snap rm
        // depth: tmp -> fv-src -> fv-root: 2 > 1
        .expect("rbd", Reply::Ok(clone_info("tmp-fv-pvc-copy", "fv-src")))
        .expect("rbd", Reply::Ok(clone_info("fv-src", "fv-root")))
        .expect("rbd", Reply::Ok(info("fv-root", 16 << 20)))
        .ok("rbd") // flatten
        // What the clone inherited from its parent.
        .expect(
            "rbd",
            Reply::Ok(
                r#"{"ferrovol.created":"1","ferrovol.name":"src","ferrovol.node.node-a":"single","other.key":"x"}"#
                    .into(),
            ),
        )
        .ok("rbd") // remove created
        .ok("rbd") // remove node-a
        .ok("rbd") // meta name
        .ok("rbd") // meta source
        .ok("rbd") // meta fscopy
        .ok("rbd"); // rename
    let v = b.create_volume(&req).await.unwrap();
    assert_eq!(v.capacity_bytes, 16 << 20);
    let o = ops(&r);
    assert_eq!(o[3], "snap create rbd/fv-src@tmp-tmp-fv-pvc-copy");
    assert_eq!(
        o[4],
        "clone --rbd-default-clone-format 2 rbd/fv-src@tmp-tmp-fv-pvc-copy rbd/tmp-fv-pvc-copy --image-feature layering"
    );
    assert_eq!(o[5], "snap rm rbd/fv-src@tmp-tmp-fv-pvc-copy");
    assert_eq!(o[9], "flatten rbd/tmp-fv-pvc-copy");
    // The parent's own keys do not come along: not its date, and above all
    // not its fencing (the copy is published nowhere); others' keys stay.
    assert_eq!(
        o[11..13],
        [
            "image-meta remove rbd/tmp-fv-pvc-copy ferrovol.created",
            "image-meta remove rbd/tmp-fv-pvc-copy ferrovol.node.node-a",
        ]
    );
    assert_eq!(
        o[14],
        "image-meta set rbd/tmp-fv-pvc-copy ferrovol.source rbd:v1.c1.rbd._e.fv-src"
    );
    // A copy: its filesystem still has the source's UUID.
    assert_eq!(
        o[15],
        "image-meta set rbd/tmp-fv-pvc-copy ferrovol.fscopy 1"
    );
}

/// A snapshot costs the cluster one snapshot (of its source); a restore
/// clones the cut the snapshot image came from while its source keeps it
/// (no cluster snapshot at all), and once the cut is gone, the snapshot
/// image's `base`, taken at the first restore that needs it and found
/// there by the next.
#[tokio::test]
async fn a_snapshot_takes_one_cluster_snapshot_and_restores_none_while_its_cut_lives() {
    let dir = tempfile::tempdir().unwrap();
    let r = Arc::new(FakeRunner::new());
    let b = backend(r.clone(), dir.path(), false);
    let source = VolumeId::parse("rbd:v1.c1.rbd._e.fv-src").unwrap();
    r.expect("rbd", Reply::Fail(2, NO_IMAGE.into())) // the snapshot image
        .expect("rbd", Reply::Ok(info("fv-src", 16 << 20)))
        .expect("rbd", Reply::Fail(2, NO_IMAGE.into())) // its temporary
        .ok("rbd") // snap create
        .ok("rbd") // clone (the cut kept)
        .expect("rbd", Reply::Ok(clone_info("tmp-fvs-s1", "fv-src")))
        .expect("rbd", Reply::Ok(info("fv-src", 16 << 20)))
        .expect("rbd", Reply::Ok("{}".into()))
        .ok("rbd") // meta name
        .ok("rbd") // meta source
        .ok("rbd") // meta created
        .ok("rbd"); // rename
    let snap = b
        .create_snapshot(&CreateSnapshot {
            name: "s1".into(),
            source: source.clone(),
            parameters: BTreeMap::new(),
            metadata: BTreeMap::new(),
            secrets: secrets(),
        })
        .await
        .unwrap();
    let o = ops(&r);
    let snapshots: Vec<&String> = o.iter().filter(|l| l.starts_with("snap create")).collect();
    assert_eq!(
        snapshots,
        ["snap create rbd/fv-src@tmp-tmp-fvs-s1"],
        "{o:#?}"
    );
    assert!(
        !o.iter().any(|l| l.starts_with("snap rm")),
        "the cut stays on the source for changed blocks: {o:#?}"
    );
    assert_eq!(o.last().unwrap(), "rename rbd/tmp-fvs-s1 rbd/fvs-s1");

    let snapshot_meta = || {
        Reply::Ok(r#"{"ferrovol.name":"s1","ferrovol.source":"rbd:v1.c1.rbd._e.fv-src","ferrovol.created":"1"}"#.into())
    };
    // While the source keeps the cut: one clone of it, no snapshot.
    let before = r.lines().len();
    let mut req = create("r0");
    req.required_bytes = 0;
    req.source = Some(ContentSource::Snapshot(snap.id.clone()));
    r.expect("rbd", Reply::Fail(2, NO_IMAGE.into())) // the volume
        .expect("rbd", Reply::Fail(2, NO_IMAGE.into())) // its temporary
        .expect("rbd", Reply::Ok(clone_info("fvs-s1", "fv-src")))
        .expect("rbd", snapshot_meta())
        .ok("rbd") // clone of the cut
        .expect("rbd", Reply::Ok(clone_info("tmp-fv-r0", "fv-src")))
        .expect("rbd", Reply::Ok(info("fv-src", 16 << 20)))
        .expect("rbd", Reply::Ok("{}".into()))
        .ok("rbd")
        .ok("rbd")
        .ok("rbd")
        .ok("rbd"); // rename
    let v = b.create_volume(&req).await.unwrap();
    assert_eq!(v.capacity_bytes, 16 << 20);
    let o = ops(&r)[before..].to_vec();
    assert!(
        o[4].starts_with(
            "clone --rbd-default-clone-format 2 rbd/fv-src@tmp-tmp-fvs-s1 rbd/tmp-fv-r0"
        ),
        "{o:#?}"
    );
    assert!(
        !o.iter()
            .any(|l| l.starts_with("snap create") || l.starts_with("flatten")),
        "{o:#?}"
    );
    assert_eq!(o.last().unwrap(), "rename rbd/tmp-fv-r0 rbd/fv-r0");

    // The cut gone (the source deleted): `base`, made by the first such
    // restore and found by the next.
    for (restore, base) in [
        ("r1", Reply::Ok(String::new())),
        (
            "r2",
            Reply::Fail(
                17,
                "rbd: failed to create snapshot: (17) File exists".into(),
            ),
        ),
    ] {
        let before = r.lines().len();
        let mut req = create(restore);
        req.required_bytes = 0;
        req.source = Some(ContentSource::Snapshot(snap.id.clone()));
        r.expect("rbd", Reply::Fail(2, NO_IMAGE.into()))
            .expect("rbd", Reply::Fail(2, NO_IMAGE.into()))
            .expect("rbd", Reply::Ok(clone_info("fvs-s1", "fv-src")))
            .expect("rbd", snapshot_meta())
            .expect(
                "rbd",
                Reply::Fail(
                    2,
                    "rbd: error opening image fv-src: (2) No such file or directory".into(),
                ),
            ) // the cut's clone
            .expect("rbd", base)
            .ok("rbd") // clone
            .expect("rbd", Reply::Ok(clone_info("tmp-fv-x", "fvs-s1")))
            .expect("rbd", Reply::Ok(clone_info("fvs-s1", "fv-src")))
            .expect("rbd", Reply::Ok(info("fv-src", 16 << 20)))
            .ok("rbd") // flatten: 2 > 1
            .expect("rbd", Reply::Ok("{}".into()))
            .ok("rbd")
            .ok("rbd")
            .ok("rbd")
            .ok("rbd"); // rename
        let v = b.create_volume(&req).await.unwrap();
        assert_eq!(v.capacity_bytes, 16 << 20);
        let o = ops(&r)[before..].to_vec();
        assert_eq!(o[5], "snap create rbd/fvs-s1@base", "{o:#?}");
        assert!(
            o[6].starts_with(&format!(
                "clone --rbd-default-clone-format 2 rbd/fvs-s1@base rbd/tmp-fv-{restore}"
            )),
            "{o:#?}"
        );
    }
}

#[tokio::test]
async fn deletes_refuse_watchers_and_trash_what_clones_need() {
    let dir = tempfile::tempdir().unwrap();
    let r = Arc::new(FakeRunner::new());
    let b = backend(r.clone(), dir.path(), false);
    let id = VolumeId::parse("rbd:v1.c1.rbd._e.fv-a").unwrap();
    let ours = r#"{"ferrovol.name":"a"}"#;
    r.expect("rbd", Reply::Ok(info("fv-a", MIB)))
        .expect("rbd", Reply::Ok(ours.into()))
        .expect(
            "rbd",
            Reply::Ok(
                r#"{"watchers":[{"address":"10.0.0.9:0/2391","client":4231,"cookie":1}]}"#.into(),
            ),
        )
        .expect("rbd", Reply::Ok("[]".into())); // its snapshots
    let e = b.delete_volume(&id, &secrets()).await.unwrap_err();
    assert_eq!(e.kind, Kind::FailedPrecondition);
    assert!(e.message.contains("10.0.0.9"), "{e}");
    assert!(!ops(&r).iter().any(|l| l.starts_with("rm ")));

    // Clones need it: to the trash; then the purge tries what is there.
    r.expect("rbd", Reply::Ok(info("fv-a", MIB)))
        .expect("rbd", Reply::Ok(ours.into()))
        .expect("rbd", Reply::Ok(r#"{"watchers":[]}"#.into()))
        // Its snapshots' cuts go first; a snapshot someone else made stays.
        .expect(
            "rbd",
            Reply::Ok(r#"[{"id":4,"name":"tmp-tmp-fvs-s1","size":1048576},{"id":5,"name":"backup-nightly","size":1048576}]"#.into()),
        )
        .ok("rbd")
        .expect("rbd", Reply::Fail(39, "rbd: image has snapshots with linked clones - these must be deleted or flattened before the image can be removed.".into()))
        .ok("rbd")
        .expect("rbd", Reply::Ok(r#"[{"id":"102e3ea2dccd","name":"fv-a"},{"id":"99","name":"not-ours"}]"#.into()))
        .expect("rbd", Reply::Fail(39, "rbd: image has snapshots with linked clones".into()));
    b.delete_volume(&id, &secrets()).await.unwrap();
    let o = ops(&r);
    let n = o.len();
    assert_eq!(
        o[n - 6..],
        [
            "snap ls rbd/fv-a --format json",
            "snap rm rbd/fv-a@tmp-tmp-fvs-s1",
            "rm rbd/fv-a",
            "trash mv rbd/fv-a",
            "trash ls rbd --format json",
            "trash rm rbd/102e3ea2dccd",
        ]
    );

    // Another failure whose message names snapshots (a pool of that name,
    // say) is that failure: returned, never a move to the trash. Only the
    // errno (rbd's exit status 39) says clones need the image.
    r.expect("rbd", Reply::Ok(info("fv-a", MIB)))
        .expect("rbd", Reply::Ok(ours.into()))
        .expect("rbd", Reply::Ok(r#"{"watchers":[]}"#.into()))
        .expect("rbd", Reply::Ok("[]".into()))
        .expect(
            "rbd",
            Reply::Fail(
                5,
                "rbd: delete error on snapshots/fv-a: (5) Input/output error".into(),
            ),
        );
    let e = b.delete_volume(&id, &secrets()).await.unwrap_err();
    assert!(e.message.contains("Input/output"), "{e}");
    assert!(!ops(&r).iter().skip(n).any(|l| l.starts_with("trash")));

    // An image ferrovol did not make is never deleted (seen whole: info,
    // metadata, watchers, snapshots).
    let n = r.lines().len();
    r.expect("rbd", Reply::Ok(info("fv-a", MIB)))
        .expect("rbd", Reply::Ok("{}".into()))
        .expect("rbd", Reply::Ok(r#"{"watchers":[]}"#.into()))
        .expect("rbd", Reply::Ok("[]".into()));
    assert_eq!(
        b.delete_volume(&id, &secrets()).await.unwrap_err().kind,
        Kind::FailedPrecondition
    );
    assert!(!ops(&r).iter().skip(n).any(|l| l.starts_with("rm ")));
    // Gone: success (and the trash is looked at); a temporary image a
    // create cut short left goes too.
    let n = r.lines().len();
    r.expect("rbd", Reply::Fail(2, NO_IMAGE.into()))
        .expect("rbd", Reply::Ok(info("tmp-fv-a", MIB)))
        .ok("rbd")
        .expect("rbd", Reply::Ok("[]".into()));
    b.delete_volume(&id, &secrets()).await.unwrap();
    let o = ops(&r);
    assert!(
        o[n + 2].starts_with("rm ") && o[n + 2].contains("rbd/tmp-fv-"),
        "{o:#?}"
    );
}

#[tokio::test]
async fn expansion_rounds_up_and_never_shrinks() {
    let dir = tempfile::tempdir().unwrap();
    let r = Arc::new(FakeRunner::new());
    let b = backend(r.clone(), dir.path(), true);
    let id = VolumeId::parse("rbd:v1.c1.rbd._e.fv-a").unwrap();
    r.expect("rbd", Reply::Ok(info("fv-a", 16 * MIB))).ok("rbd");
    assert_eq!(
        b.expand_volume(&id, 20 * MIB + 5, 0, &Secrets::default())
            .await
            .unwrap(),
        21 * MIB
    );
    assert_eq!(ops(&r).last().unwrap(), "resize rbd/fv-a --size 21M");
    // The config's own user when the call has no secrets.
    assert!(r.lines()[0].contains("--keyring /etc/ferrovol/keyring"));
    r.expect("rbd", Reply::Ok(info("fv-a", 32 * MIB)));
    assert_eq!(
        b.expand_volume(&id, 8 * MIB, 0, &Secrets::default())
            .await
            .unwrap(),
        32 * MIB
    );
    assert!(!ops(&r).last().unwrap().starts_with("resize"));
}

/// A tool that prints its keyring (or the key it was given) on failure:
/// the key never reaches the error, whether it came from the call's
/// secrets or from the config's keyring file.
#[tokio::test]
async fn keys_a_tool_prints_are_redacted_from_errors() {
    let dir = tempfile::tempdir().unwrap();
    let keyring = dir.path().join("ferrovol.keyring");
    let file_key = "AQCfileKeyfileKeyfileKeyfileKeyfileKey0==";
    std::fs::write(
        &keyring,
        format!("[client.ferrovol]\n\tkey = {file_key}\n\tcaps mon = \"profile rbd\"\n"),
    )
    .unwrap();
    let r = Arc::new(FakeRunner::new());
    let mut b = backend(r.clone(), dir.path(), true);
    b.settings.keyring = Some(keyring.clone());
    let id = VolumeId::parse("rbd:v1.c1.rbd._e.fv-a").unwrap();
    for (secrets, key) in [(secrets(), KEY), (Secrets::default(), file_key)] {
        r.expect(
            "rbd",
            Reply::Fail(
                1,
                format!("rbd: failed; keyring was: [client.ferrovol]\n\tkey = {key}\n"),
            ),
        );
        let e = b.delete_volume(&id, &secrets).await.unwrap_err();
        assert!(!e.message.contains(key), "{e}");
        assert!(e.message.contains("***"), "{e}");
    }
    assert_eq!(
        creds::keyring_keys("[client.a]\n key = K1\n[client.b]\nkey=K2\nkeyring = x\n"),
        ["K1", "K2"]
    );
}

/// The key a kept connection uses is the user's own, from its section of
/// a keyring that may hold several; feature names map to librbd's bits.
#[test]
fn keyring_sections_and_feature_bits() {
    let text = "[client.admin]\n\tkey = ADMINKEY\n[client.ferrovol]\n\tkey = OWNKEY\n\tcaps mon = \"profile rbd\"\n";
    assert_eq!(
        creds::keyring_key_for(text, "ferrovol").as_deref(),
        Some("OWNKEY")
    );
    assert_eq!(
        creds::keyring_key_for(text, "admin").as_deref(),
        Some("ADMINKEY")
    );
    assert_eq!(creds::keyring_key_for(text, "other"), None);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("keyring");
    std::fs::write(&path, text).unwrap();
    let creds = Creds::from_file("ferrovol", &path).unwrap();
    assert_eq!(creds.key().unwrap(), "OWNKEY");
    // The file's own path for the command line: nothing written.
    assert_eq!(creds.keyring().unwrap(), path);

    // Secrets: a keyring file only when the command line asks for one,
    // private, and gone with the credentials.
    let creds = Creds::from_key("ferrovol", KEY, dir.path()).unwrap();
    assert_eq!(creds.key().unwrap(), KEY);
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    let written = creds.keyring().unwrap();
    assert_eq!(creds.keyring().unwrap(), written, "written once");
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(
        std::fs::metadata(&written).unwrap().permissions().mode() & 0o777,
        0o600
    );
    drop(creds);
    assert!(!written.exists());

    assert_eq!(cluster::feature_bits("layering").unwrap(), 1);
    assert_eq!(
        cluster::feature_bits("layering,exclusive-lock,object-map,fast-diff,deep-flatten").unwrap(),
        0b11_1101
    );
    assert!(cluster::feature_bits("striping").is_err());
}

/// A page of ListVolumes lists names, and reads sizes for its own entries
/// only: one `rbd ls -l` per pool the page touches, none for the others;
/// an image gone since the listing is left out.
#[tokio::test]
async fn a_page_of_volumes_reads_its_own_sizes() {
    let dir = tempfile::tempdir().unwrap();
    let r = Arc::new(FakeRunner::new());
    let b = backend(r.clone(), dir.path(), true);
    r.expect("rbd", Reply::Ok("[]".into())) // namespaces of rbd
        .expect("rbd", Reply::Ok("[]".into())) // namespaces of fast
        .expect(
            "rbd",
            Reply::Ok(r#"["fv-b","fvs-x","other","fv-a","fv-gone"]"#.into()),
        )
        .expect("rbd", Reply::Ok(r#"["fv-c"]"#.into()))
        .expect(
            "rbd",
            Reply::Ok(
                r#"[{"image":"fv-a","size":1048576,"format":2},{"image":"fv-b","size":2097152,"format":2},{"image":"fv-b","snapshot":"s","size":1,"format":2}]"#
                    .into(),
            ),
        );
    let page = Page {
        after: Some(
            VolumeId::parse("rbd:v1.c1.fast._e.fv-c")
                .unwrap()
                .locator()
                .to_string(),
        ),
        limit: 3,
    };
    let v = b.list_volumes(&page).await.unwrap();
    let ids: Vec<(String, u64)> = v
        .iter()
        .map(|v| (v.id.to_string(), v.capacity_bytes))
        .collect();
    assert_eq!(
        ids,
        [
            ("rbd:v1.c1.rbd._e.fv-a".to_string(), 1 << 20),
            ("rbd:v1.c1.rbd._e.fv-b".to_string(), 2 << 20),
        ]
    );
    let o = ops(&r);
    assert_eq!(o.len(), 5, "{o:#?}");
    assert_eq!(o[4], "ls -l rbd --format json");
}

/// A volume's I/O limit changes are kept in its image's metadata (the
/// controller's state directory may be an emptyDir): read back as they
/// were written, none on an image that has none, NOT_FOUND for an image
/// that is not a volume of ours.
#[tokio::test]
async fn limit_changes_are_kept_in_the_image_s_metadata() {
    use crate::plugin::LimitKeeper;
    let dir = tempfile::tempdir().unwrap();
    let r = Arc::new(FakeRunner::new());
    let b = backend(r.clone(), dir.path(), false);
    let id = VolumeId::parse("rbd:v1.c1.rbd._e.fv-a").unwrap();
    let changes = crate::host::iolimit::LimitChanges::parse(
        &[
            ("writeIops".to_string(), "200".to_string()),
            ("readBps".to_string(), "max".to_string()),
        ]
        .into(),
    )
    .unwrap();
    r.ok("rbd");
    b.keep_limits(&id, &changes, &secrets()).await.unwrap();
    let set = ops(&r).last().unwrap().clone();
    assert_eq!(
        set,
        r#"image-meta set rbd/fv-a ferrovol.limits {"readBps":null,"writeIops":200}"#
    );
    let kept = r#"{"ferrovol.name":"a","ferrovol.limits":"{\"readBps\":null,\"writeIops\":200}"}"#;
    r.expect("rbd", Reply::Ok(info("fv-a", MIB)))
        .expect("rbd", Reply::Ok(kept.into()));
    assert_eq!(b.kept_limits(&id, &secrets()).await.unwrap(), changes);
    r.expect("rbd", Reply::Ok(info("fv-a", MIB)))
        .expect("rbd", Reply::Ok(r#"{"ferrovol.name":"a"}"#.into()));
    assert!(b.kept_limits(&id, &secrets()).await.unwrap().is_empty());
    r.expect("rbd", Reply::Ok(info("fv-a", MIB)))
        .expect("rbd", Reply::Ok("{}".into()));
    let e = b.kept_limits(&id, &secrets()).await.unwrap_err();
    assert_eq!(e.kind, Kind::NotFound, "{e}");
}
