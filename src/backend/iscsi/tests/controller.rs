//! The controller's side: targets, grants, lost and restarted target servers, growth, thin provisioning.

use super::*;

#[tokio::test]
async fn create_makes_one_target_and_a_retry_finds_it() {
    use target::ipc::*;
    let s = Setup::new();
    let t = FakeTgtd::start(s.dir.path());
    // Target 4 is there already.
    t.edit(|st| {
        st.targets.insert(
            4,
            FakeTarget {
                iqn: "iqn.other:x".into(),
                ..Default::default()
            },
        );
    });
    let b = s.backend();
    let v = b.create_volume(&create("pvc-1")).await.unwrap();
    assert_eq!(v.id.to_string(), "iscsi:pvc-1");
    let (tid, made) = t.target(IQN).expect("the target was made");
    assert_eq!(tid, 5, "the id after the highest there");
    assert_eq!(made.lun1.as_deref(), Some("/dev/loop7"));
    // LUN 1 gets an identity of its own, from the target name.
    let serial = target::serial_for(IQN);
    assert_eq!(serial.len(), 16);
    assert_eq!(
        made.updates,
        [format!("targetOps scsi_id=fv{serial},scsi_sn={serial},")]
    );
    assert_eq!(
        s.store.calls(),
        ["create pvc-1", "attach iscsi-store:pvc-1"]
    );

    // Retried: the target is known, nothing is asked of tgtd or made.
    let asked = t.requests().len();
    b.create_volume(&create("pvc-1")).await.unwrap();
    assert_eq!(t.requests().len(), asked);

    // A LUN that cannot be made leaves no target behind.
    let iqn_of = |name: &str| b.iqn(&VolumeId::parse(&format!("iscsi:{name}")).unwrap());
    t.refuse_next(MODE_DEVICE, OP_NEW, 23);
    assert!(b.create_volume(&create("pvc-2")).await.is_err());
    assert!(t.target(&iqn_of("pvc-2")).is_none());

    // An id taken behind the backend's back (7, the next it would pick):
    // the server is read again and the next free one is used.
    t.edit(|st| {
        st.targets.insert(
            7,
            FakeTarget {
                iqn: "iqn.other:y".into(),
                ..Default::default()
            },
        );
    });
    b.create_volume(&create("pvc-3")).await.unwrap();
    assert_eq!(t.target(&iqn_of("pvc-3")).unwrap().0, 8);
    assert_eq!(t.target("iqn.other:y").unwrap().1.lun1, None, "left alone");
    // The targets were listed at the first lookup and after the taken id
    // only: creating does not list them.
    let listings = t
        .requests()
        .iter()
        .filter(|r| (r.0, r.1) == (MODE_TARGET, OP_SHOW))
        .count();
    assert_eq!(listings, 2);
}

#[tokio::test]
async fn publish_sets_chap_then_the_acl_and_unpublish_takes_it_back() {
    use target::ipc::*;
    let s = Setup::new();
    let t = FakeTgtd::start(s.dir.path());
    let b = s.backend();
    let id = s.created(&b).await;
    let chap = [
        (CHAP_USER, "alice"),
        (CHAP_PASSWORD, "alice-secret-01"),
        (MUTUAL_USER, "target"),
        (MUTUAL_PASSWORD, "target-secret-02"),
    ];
    let ctx = b.controller_attach(&id, &attach_req(&chap)).await.unwrap();
    assert_eq!(ctx["iqn"], IQN);
    assert_eq!(ctx["portals"], "10.0.0.5:3260");
    assert_eq!(ctx["lun"], "1");
    let (tid, published) = t.target(IQN).unwrap();
    assert_eq!(published.incoming, ["alice"]);
    assert_eq!(published.outgoing.as_deref(), Some("target"));
    assert_eq!(published.acl, BTreeSet::from([INITIATOR.to_string()]));
    // CHAP first: the ACL opens last.
    let requests = t.requests();
    let acl_at = requests
        .iter()
        .position(|r| (r.0, r.1) == (MODE_TARGET, OP_BIND))
        .unwrap();
    assert_eq!(acl_at, requests.len() - 1);
    assert!(requests[..acl_at]
        .iter()
        .any(|r| (r.0, r.1, r.2) == (MODE_ACCOUNT, OP_BIND, tid as i32)));
    // The secrets went only in the requests that make the accounts.
    assert_eq!(
        t.state.lock().unwrap().accounts,
        BTreeMap::from([
            ("alice".to_string(), "alice-secret-01".to_string()),
            ("target".to_string(), "target-secret-02".to_string())
        ])
    );
    for r in &requests {
        assert!(
            !r.3.contains("secret") || (r.0, r.1) == (MODE_ACCOUNT, OP_NEW),
            "{r:?}"
        );
    }

    // Published again without CHAP: refused, the accounts stay.
    let e = b
        .controller_attach(&id, &attach_req(&[]))
        .await
        .unwrap_err();
    assert_eq!(e.kind, Kind::FailedPrecondition);
    assert_eq!(t.target(IQN).unwrap().1.incoming, ["alice"]);

    // Published again with the same secrets (a retry): done, nothing
    // doubled (tgt refuses a second outgoing bind even of the same
    // account; this volume's record says it is bound).
    b.controller_attach(&id, &attach_req(&chap)).await.unwrap();
    let again = t.target(IQN).unwrap().1;
    assert_eq!(again.incoming, ["alice"]);
    assert_eq!(again.outgoing.as_deref(), Some("target"));

    // Another node, while it is published here: refused, naming who has
    // it, and tgtd is not asked anything.
    let before = t.requests().len();
    let mut other = attach_req(&chap);
    other.node_id = "worker-2/iqn.1993-08.org.debian:01:bb".into();
    let e = b.controller_attach(&id, &other).await.unwrap_err();
    assert_eq!(e.kind, Kind::FailedPrecondition, "{e}");
    assert!(e.message.contains(INITIATOR), "{e}");
    assert_eq!(t.requests().len(), before);

    // This node again, read-only now: not what it was published as, so
    // ALREADY_EXISTS, and nothing changes on the target.
    let mut ro = attach_req(&chap);
    ro.readonly = true;
    let e = b.controller_attach(&id, &ro).await.unwrap_err();
    assert_eq!(e.kind, Kind::AlreadyExists, "{e}");
    assert_eq!(t.requests().len(), before);

    // A node without an initiator name, and an unknown volume: NOT_FOUND.
    let mut plain = attach_req(&chap);
    plain.node_id = "worker-2".into();
    assert_eq!(
        b.controller_attach(&id, &plain).await.unwrap_err().kind,
        Kind::NotFound
    );
    let unknown = VolumeId::parse("iscsi:nope").unwrap();
    assert_eq!(
        b.controller_attach(&unknown, &attach_req(&chap))
            .await
            .unwrap_err()
            .kind,
        Kind::NotFound
    );

    // Unpublish takes the initiator out of the ACL and, when the node is
    // still logged in (lost: its unstage never came), closes its
    // connections: another initiator's stay. Again, and for an unknown
    // volume, it is a no-op.
    let tid = t.target(IQN).unwrap().0;
    t.edit(|st| {
        st.targets.get_mut(&tid).unwrap().sessions =
            vec!["iqn.2026-01.io.other:n".into(), INITIATOR.into()]
    });
    b.controller_detach(&id, Some(NODE), &Secrets::default())
        .await
        .unwrap();
    let (_, after) = t.target(IQN).unwrap();
    assert!(after.acl.is_empty());
    assert_eq!(after.sessions, ["iqn.2026-01.io.other:n", ""]);
    let closes: Vec<_> = t
        .requests()
        .into_iter()
        .filter(|r| (r.0, r.1) == (MODE_CONNECTION, OP_DELETE))
        .collect();
    assert_eq!(closes.len(), 1);
    // The ACL went first: a closed connection cannot log in again.
    let order: Vec<_> = t.requests().into_iter().map(|r| (r.0, r.1)).collect();
    let unbind = order
        .iter()
        .rposition(|r| *r == (MODE_TARGET, OP_UNBIND))
        .unwrap();
    let close = order
        .iter()
        .rposition(|r| *r == (MODE_CONNECTION, OP_DELETE))
        .unwrap();
    assert!(unbind < close, "{order:?}");
    t.edit(|st| st.targets.get_mut(&tid).unwrap().sessions.clear());
    b.controller_detach(&id, Some(NODE), &Secrets::default())
        .await
        .unwrap();
    b.controller_detach(&unknown, Some(NODE), &Secrets::default())
        .await
        .unwrap();
    // None of it listed the targets again.
    let listings = t
        .requests()
        .iter()
        .filter(|r| (r.0, r.1) == (MODE_TARGET, OP_SHOW))
        .count();
    assert_eq!(listings, 1);
}

/// A target removed from tgtd behind the driver's back (its cache still
/// names it): the detach asks the server again and, the target gone,
/// succeeds with nothing to detach from.
#[tokio::test]
async fn a_detach_from_a_target_removed_behind_the_drivers_back_succeeds() {
    let s = Setup::new();
    let t = FakeTgtd::start(s.dir.path());
    let b = s.backend();
    let id = s.created(&b).await;
    b.controller_attach(&id, &attach_req(&[])).await.unwrap();
    t.edit(|st| st.targets.clear());
    b.controller_detach(&id, Some(NODE), &Secrets::default())
        .await
        .unwrap();
}

/// tgtd restarted under a running driver: it forgot every target. The
/// next call finds the server is a new run and makes the volume's target
/// again, accounts and ACL with it; a create after it goes on.
#[tokio::test]
async fn a_restarted_target_server_gets_its_targets_back() {
    let s = Setup::new();
    let mut t = FakeTgtd::start(s.dir.path());
    let b = s.backend();
    let id = s.created(&b).await;
    let chap = [(CHAP_USER, "alice"), (CHAP_PASSWORD, "alice-secret-01")];
    b.controller_attach(&id, &attach_req(&chap)).await.unwrap();
    t.restart();
    t.edit(|st| st.accounts.clear());
    assert!(t.target(IQN).is_none());
    b.controller_attach(&id, &attach_req(&chap)).await.unwrap();
    let (_, back) = t.target(IQN).expect("made again");
    assert_eq!(back.lun1.as_deref(), Some("/dev/loop7"));
    assert_eq!(back.incoming, ["alice"]);
    assert_eq!(back.acl, BTreeSet::from([INITIATOR.to_string()]));
    b.create_volume(&create("pvc-2")).await.unwrap();
    assert_eq!(t.state.lock().unwrap().targets.len(), 2);
}

#[tokio::test]
async fn delete_is_refused_while_logged_in_and_cleans_up_after() {
    let s = Setup::new();
    let t = FakeTgtd::start(s.dir.path());
    let b = s.backend();
    let id = s.created(&b).await;
    let (tid, _) = t.target(IQN).unwrap();
    t.edit(|st| st.targets.get_mut(&tid).unwrap().sessions = vec![INITIATOR.into()]);
    let e = b.delete_volume(&id, &Secrets::default()).await.unwrap_err();
    assert_eq!(e.kind, Kind::FailedPrecondition);
    assert!(e.message.contains(INITIATOR), "{e}");
    assert!(!s.store.calls().iter().any(|c| c.starts_with("delete")));
    assert!(t.target(IQN).is_some());

    t.edit(|st| st.targets.get_mut(&tid).unwrap().sessions.clear());
    b.delete_volume(&id, &Secrets::default()).await.unwrap();
    assert!(t.target(IQN).is_none());
    assert_eq!(
        s.store.calls()[2..],
        ["detach iscsi-store:pvc-1 true", "delete iscsi-store:pvc-1"]
    );
    assert!(b.load(&id).unwrap().is_none());
    // Gone already: success, and the store is still asked to make sure.
    b.delete_volume(&id, &Secrets::default()).await.unwrap();
    assert_eq!(s.store.calls().len(), 6);
}

/// tgtd lost its targets and the driver restarted (the CHAP secret is not
/// known): the target comes back with its LUN but a closed ACL, and the
/// next publish with the secret opens it.
#[tokio::test]
async fn a_lost_target_is_rebuilt_closed_until_the_secret_comes_back() {
    let s = Setup::new();
    let t = FakeTgtd::start(s.dir.path());
    let id = VolumeId::parse("iscsi:pvc-1").unwrap();
    {
        let b = s.backend();
        b.save(
            &id,
            &Record {
                export: IQN.into(),
                device: "/dev/loop7".into(),
                attachment: Attachment::Device {
                    path: "/dev/loop7".into(),
                },
                hosts: BTreeSet::from([INITIATOR.to_string()]),
                terms: Default::default(),
                incoming_user: Some("alice".into()),
                outgoing_user: None,
                copy: None,
                bytes: None,
                thin_provisioning: true,
                hold: None,
            },
        )
        .unwrap();
    }
    let b = s.backend();
    b.health().await.unwrap();
    let (_, rebuilt) = t.target(IQN).expect("rebuilt");
    assert_eq!(rebuilt.lun1.as_deref(), Some("/dev/loop7"));
    // Its recorded thin provisioning with it.
    assert_eq!(
        rebuilt.updates.last().map(String::as_str),
        Some("thin_provisioning=1")
    );
    assert!(rebuilt.acl.is_empty() && rebuilt.incoming.is_empty());
    // Probe does not check again for a while.
    let asked = t.requests().len();
    b.health().await.unwrap();
    assert_eq!(t.requests().len(), asked);

    b.controller_attach(
        &id,
        &attach_req(&[(CHAP_USER, "alice"), (CHAP_PASSWORD, "alice-secret-01")]),
    )
    .await
    .unwrap();
    let (_, open) = t.target(IQN).unwrap();
    assert_eq!(open.incoming, ["alice"]);
    assert_eq!(open.acl, BTreeSet::from([INITIATOR.to_string()]));
}

/// An unused volume grows: the store, then LUN 1 reopened on it in one
/// update (same LUN, same SCSI identity).
#[tokio::test]
async fn expansion_grows_the_store_and_refreshes_the_lun() {
    use target::ipc::*;
    let s = Setup::new();
    let t = FakeTgtd::start(s.dir.path());
    let b = s.backend();
    let id = s.created(&b).await;
    assert_eq!(
        b.expand_volume(&id, 16 << 20, 0, &Secrets::default())
            .await
            .unwrap(),
        16 << 20
    );
    assert_eq!(
        t.target(IQN).unwrap().1.updates.last().unwrap(),
        "targetOps online=0,path=/dev/loop7,"
    );
    assert!(s
        .store
        .calls()
        .contains(&"refresh iscsi-store:pvc-1".to_string()));

    // The LUN cannot be reopened: the error is the caller's.
    t.refuse_next(MODE_DEVICE, OP_UPDATE, 2);
    assert!(b
        .expand_volume(&id, 32 << 20, 0, &Secrets::default())
        .await
        .is_err());
}

/// A volume in use (published, or an initiator logged in) is not grown:
/// reopening the LUN's store under I/O fails commands in flight. A repeat
/// of an expansion already done still succeeds.
#[tokio::test]
async fn a_volume_in_use_is_not_grown() {
    let s = Setup::new();
    let t = FakeTgtd::start(s.dir.path());
    let b = s.backend();
    let id = s.created(&b).await;
    let created = b.load(&id).unwrap().unwrap().bytes.unwrap();
    let before = s.store.calls().len();

    // Logged in without a publish record (a session left behind).
    let (tid, _) = t.target(IQN).unwrap();
    t.edit(|st| st.targets.get_mut(&tid).unwrap().sessions = vec![INITIATOR.into()]);
    let e = b
        .expand_volume(&id, created * 2, 0, &Secrets::default())
        .await
        .unwrap_err();
    assert_eq!(e.kind, Kind::FailedPrecondition, "{e}");
    assert!(e.to_string().contains(INITIATOR), "{e}");

    // Published, nobody logged in yet.
    t.edit(|st| st.targets.get_mut(&tid).unwrap().sessions.clear());
    let mut record = b.load(&id).unwrap().unwrap();
    record.hosts.insert(INITIATOR.into());
    b.save(&id, &record).unwrap();
    let e = b
        .expand_volume(&id, created * 2, 0, &Secrets::default())
        .await
        .unwrap_err();
    assert_eq!(e.kind, Kind::FailedPrecondition, "{e}");
    // Nothing was grown.
    assert_eq!(s.store.calls().len(), before, "{:?}", s.store.calls());
    // What the LUN already has is no expansion: done.
    assert_eq!(
        b.expand_volume(&id, created, 0, &Secrets::default())
            .await
            .unwrap(),
        created
    );
    assert_eq!(s.store.calls().len(), before);
}

/// tgtadm reads `-C` into a signed 16-bit integer: a control port above
/// 32767 is refused when the backend is built, not on every later call.
#[test]
fn a_control_port_tgtadm_cannot_take_is_refused_at_startup() {
    let s = Setup::new();
    let build = |port| {
        let mut settings = s.settings();
        settings.control_port = port;
        IscsiBackend::new(
            "iscsi",
            settings,
            s.runner.clone(),
            Some(s.store.clone()),
            s.dir.path().join("records"),
        )
    };
    let err = build(32768).err().expect("32768 is refused");
    assert!(err.to_string().contains("0 to 32767"), "{err}");
    assert!(build(32767).is_ok());
}

/// Slow store work on one volume holds up no call on another: a delete
/// whose store does not answer is still in its store's detach while a
/// ControllerUnpublish of another volume runs to the end (the backend's
/// one admin lock was held across every call before).
#[tokio::test]
async fn a_stuck_volume_does_not_hold_up_another() {
    let s = Setup::new();
    let _tgtd = FakeTgtd::start(s.dir.path());
    let b = Arc::new(s.backend());
    let one = s.created(&b).await;
    let entered = Arc::new(tokio::sync::Notify::new());
    let release = Arc::new(tokio::sync::Notify::new());
    *s.store.stuck.lock().unwrap() = Some(("pvc-1".to_string(), entered.clone(), release.clone()));
    // The delete removes pvc-1's target, then hangs in the store.
    let deleting = {
        let b = b.clone();
        let one = one.clone();
        tokio::spawn(async move { b.delete_volume(&one, &Secrets::default()).await })
    };
    entered.notified().await;
    // Another volume's unpublish (its record: published to INITIATOR).
    let other = VolumeId::parse("iscsi:pvc-9").unwrap();
    let mut record = b.load(&one).unwrap().unwrap();
    record.export = format!("{IQN}-9");
    record.hosts = BTreeSet::from([INITIATOR.to_string()]);
    b.save(&other, &record).unwrap();
    tokio::time::timeout(
        std::time::Duration::from_secs(30),
        b.controller_detach(&other, Some(NODE), &Secrets::default()),
    )
    .await
    .expect("the other volume's unpublish waited on the stuck delete")
    .unwrap();
    assert!(!deleting.is_finished());
    assert!(b.load(&other).unwrap().unwrap().hosts.is_empty());
    release.notify_one();
    deleting.await.unwrap().unwrap();
}

/// Thin provisioning is changed on the live LUN only when it differs, and
/// recorded (a rebuilt target gets it back); a refusal leaves the record.
#[tokio::test]
async fn thin_provisioning_is_set_on_the_live_lun_and_recorded() {
    use target::ipc::*;
    let s = Setup::new();
    let t = FakeTgtd::start(s.dir.path());
    let b = s.backend();
    let id = s.created(&b).await;
    let none = Secrets::default();
    let set = |v: &str| BTreeMap::from([(THIN_PROVISIONING.to_string(), v.to_string())]);
    let e = b.check_mutable(&set("maybe")).unwrap_err();
    assert_eq!(e.kind, Kind::InvalidArgument);
    assert!(e.message.contains(THIN_PROVISIONING), "{}", e.message);
    assert_eq!(b.mutable_keys(), [THIN_PROVISIONING]);

    let updates = || t.target(IQN).unwrap().1.updates;
    let before = updates().len();
    b.modify_volume(&id, &set("true"), &none).await.unwrap();
    assert_eq!(updates().last().unwrap(), "thin_provisioning=1");
    assert!(b.load(&id).unwrap().unwrap().thin_provisioning);
    b.modify_volume(&id, &set("true"), &none).await.unwrap();
    assert_eq!(updates().len(), before + 1, "no change asked twice");

    t.refuse_next(MODE_DEVICE, OP_UPDATE, 2);
    assert!(b.modify_volume(&id, &set("false"), &none).await.is_err());
    assert!(b.load(&id).unwrap().unwrap().thin_provisioning);
    b.modify_volume(&id, &set("false"), &none).await.unwrap();
    assert_eq!(updates().last().unwrap(), "thin_provisioning=0");
    assert!(!b.load(&id).unwrap().unwrap().thin_provisioning);

    let missing = VolumeId::parse("iscsi:nope").unwrap();
    assert_eq!(
        b.modify_volume(&missing, &set("true"), &none)
            .await
            .unwrap_err()
            .kind,
        Kind::NotFound
    );
}

/// thinProvisioning on an lvm store is refused before anything is made or
/// changed: tgt would answer the initiators' UNMAP with a hardware error
/// (it punches holes, which a logical volume cannot take). A file store
/// takes it.
#[test]
fn thin_provisioning_is_refused_on_an_lvm_store() {
    let s = Setup::new();
    let thin = BTreeMap::from([(THIN_PROVISIONING.to_string(), "true".to_string())]);
    s.backend().check_mutable(&thin).unwrap();
    let mut settings = s.settings();
    settings.store = Some(crate::config::BackendConfig {
        kind: "lvm".into(),
        name: None,
        settings: Default::default(),
    });
    let lvs = Arc::new(MemStore::lv("iscsi"));
    let b = IscsiBackend::new(
        "iscsi",
        settings,
        s.runner.clone(),
        Some(lvs),
        s.dir.path().join("records"),
    )
    .unwrap();
    let e = b.check_mutable(&thin).unwrap_err();
    assert_eq!(e.kind, Kind::InvalidArgument, "{e}");
    assert!(e.message.contains("cannot punch"), "{e}");
    let off = BTreeMap::from([(THIN_PROVISIONING.to_string(), "false".to_string())]);
    b.check_mutable(&off).unwrap();
}

/// Health as the target host sees it: the store's view of the volume and
/// whether tgtd serves its target.
#[tokio::test]
async fn health_reads_the_store_and_the_target() {
    use crate::plugin::health::Reason;
    use crate::plugin::HealthReporter;
    let s = Setup::new();
    let t = FakeTgtd::start(s.dir.path());
    let b = s.backend();
    let v = b.create_volume(&create("pvc-1")).await.unwrap();
    let secrets = Secrets::default();
    assert_eq!(b.volume_health(&v.id, &secrets).await.unwrap(), vec![]);
    // tgtd lost the target (restarted without it, deleted by hand).
    t.edit(|st| st.targets.retain(|_, target| target.iqn != IQN));
    let found = b.volume_health(&v.id, &secrets).await.unwrap();
    assert_eq!(found[0].reason, reasons::TargetMissing, "{found:?}");
    assert!(found[0].message.contains(IQN), "{found:?}");
    // A volume the store does not have: not found, by this backend's id.
    let never = VolumeId::parse("iscsi:pvc-never").unwrap();
    let found = b.volume_health(&never, &secrets).await.unwrap();
    assert_eq!(found[0].reason, Reason::VolumeNotFound, "{found:?}");
    assert!(found[0].message.contains("iscsi:pvc-never"), "{found:?}");
}

/// The holds a start may resume are its own targets' (from their records):
/// a suspended hold of another driver's on this host is left to it.
#[test]
fn its_own_holds_come_from_its_target_records() {
    let dir = tempfile::tempdir().unwrap();
    let record = |hold: &str| {
        format!(
            "{{\"attachment\": {{\"device\": {{\"path\": \"/dev/loop7\"}}}}, \"device\": \
             \"/dev/loop7\", \"format\": 1, {hold} \"incoming_user\": null, \
             \"initiators\": [], \"iqn\": \"iqn.2026-11.io.ferrovol:pvc-1\", \
             \"outgoing_user\": null}}"
        )
    };
    let ours = Holds::name_for("iqn.2026-11.io.ferrovol:pvc-1");
    std::fs::write(
        dir.path().join("pvc-1.json"),
        record(&format!("\"hold\": \"{ours}\",")),
    )
    .unwrap();
    // One served without a hold, one cut short, and what is no record.
    std::fs::write(dir.path().join("pvc-2.json"), record("")).unwrap();
    std::fs::write(dir.path().join("pvc-3.json"), "{\"iqn\": ").unwrap();
    std::fs::write(
        dir.path().join(".pvc-4.json.tmp"),
        record("\"hold\": \"fvh-x\","),
    )
    .unwrap();
    assert_eq!(
        Records::new(dir.path().to_path_buf()).holds(),
        BTreeSet::from([ours.clone()])
    );
    assert!(Records::new(dir.path().join("none")).holds().is_empty());
}
