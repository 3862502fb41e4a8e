//! What the cluster says of a volume: its image gone, or open by clients
//! that no node it is published to recorded (read twice, so that a brief
//! open is not counted).

use super::*;
use crate::plugin::health::{Reason, Status};
use crate::plugin::HealthReporter;

const RECORDED: &str = r#"{"ferrovol.name":"a","ferrovol.node.node-a":"single","ferrovol.client.node-a":"10.0.0.2:0/77"}"#;

fn watchers(addrs: &[&str]) -> String {
    let list: Vec<String> = addrs
        .iter()
        .enumerate()
        .map(|(i, a)| format!(r#"{{"address":"{a}","client":{},"cookie":1}}"#, 4000 + i))
        .collect();
    format!(r#"{{"watchers":[{}]}}"#, list.join(","))
}

#[tokio::test]
async fn the_controller_says_an_image_gone_and_clients_no_node_recorded() {
    let dir = tempfile::tempdir().unwrap();
    let r = Arc::new(FakeRunner::new());
    let b = backend(r.clone(), dir.path(), true);
    let id = VolumeId::parse("rbd:v1.c1.rbd._e.fv-a").unwrap();
    let none = Secrets::default();
    let health = || b.volume_health(&id, &none);

    r.expect("rbd", Reply::Fail(2, NO_IMAGE.into()));
    let f = health().await.unwrap();
    assert_eq!(f[0].reason, Reason::VolumeNotFound, "{f:?}");

    // Only the client its node recorded: healthy.
    r.expect("rbd", Reply::Ok(info("fv-a", MIB)))
        .expect("rbd", Reply::Ok(RECORDED.into()))
        .expect("rbd", Reply::Ok(watchers(&["10.0.0.2:0/77"])));
    assert_eq!(health().await.unwrap(), vec![]);

    // Another client, there both times (the messenger's prefix aside).
    r.expect("rbd", Reply::Ok(info("fv-a", MIB)))
        .expect("rbd", Reply::Ok(RECORDED.into()))
        .expect(
            "rbd",
            Reply::Ok(watchers(&["10.0.0.2:0/77", "v1:10.0.0.9:0/5"])),
        )
        .expect(
            "rbd",
            Reply::Ok(watchers(&["10.0.0.9:0/5", "10.0.0.2:0/77"])),
        );
    let f = health().await.unwrap();
    assert_eq!(f.len(), 1, "{f:?}");
    assert_eq!(
        (f[0].status, f[0].reason),
        (Status::Degraded, reasons::WatchersElsewhere)
    );
    assert!(
        f[0].message.contains("10.0.0.9:0/5") && !f[0].message.contains("0/77"),
        "{}",
        f[0].message
    );

    // One that is gone by the second read (a brief open): healthy.
    r.expect("rbd", Reply::Ok(info("fv-a", MIB)))
        .expect("rbd", Reply::Ok(RECORDED.into()))
        .expect(
            "rbd",
            Reply::Ok(watchers(&["10.0.0.2:0/77", "10.0.0.9:0/5"])),
        )
        .expect("rbd", Reply::Ok(watchers(&["10.0.0.2:0/77"])));
    assert_eq!(health().await.unwrap(), vec![]);

    // Published to a second node that recorded no client yet: one watch
    // may be its own; not asked twice.
    let two = r#"{"ferrovol.name":"a","ferrovol.node.node-a":"multi","ferrovol.client.node-a":"10.0.0.2:0/77","ferrovol.node.node-b":"multi"}"#;
    r.expect("rbd", Reply::Ok(info("fv-a", MIB)))
        .expect("rbd", Reply::Ok(two.into()))
        .expect(
            "rbd",
            Reply::Ok(watchers(&["10.0.0.2:0/77", "10.0.0.3:0/8"])),
        );
    let before = r.lines().len();
    assert_eq!(health().await.unwrap(), vec![]);
    assert_eq!(r.lines().len(), before + 3);

    // The cluster not answering: the error goes to the caller (the book
    // says StorageNotAnswering).
    r.expect("rbd", Reply::Timeout);
    let e = health().await.unwrap_err();
    assert_eq!(e.kind, Kind::Unavailable, "{e}");
}

/// A node with its client recorded asks which other clients have the
/// image open; one that stays is said, its own client is not.
#[tokio::test]
async fn the_node_says_other_clients_of_its_staged_image() {
    let dir = tempfile::tempdir().unwrap();
    let r = Arc::new(FakeRunner::new());
    let b = backend(r.clone(), dir.path(), true);
    let id = VolumeId::parse("rbd:v1.c1.rbd._e.fv-a").unwrap();
    let dev0 = dir.path().join("sys/bus/rbd/devices/0");
    std::fs::create_dir_all(&dev0).unwrap();
    std::fs::write(dev0.join("client_addr"), "10.0.0.2:0/77\n").unwrap();
    mapped(dir.path());
    r.expect("rbd", Reply::Ok(RECORDED.into()));
    let a = b.node_attach(&id, &stage_ctx("node-a")).await.unwrap();

    r.expect("rbd", Reply::Ok(RECORDED.into()))
        .expect("rbd", Reply::Ok(watchers(&["10.0.0.2:0/77"])));
    assert_eq!(b.node_health(&id, &a).await.unwrap(), vec![]);

    r.expect("rbd", Reply::Ok(RECORDED.into()))
        .expect(
            "rbd",
            Reply::Ok(watchers(&["10.0.0.2:0/77", "10.0.0.4:0/9"])),
        )
        .expect(
            "rbd",
            Reply::Ok(watchers(&["10.0.0.2:0/77", "10.0.0.4:0/9"])),
        );
    let f = b.node_health(&id, &a).await.unwrap();
    assert_eq!(f.len(), 1, "{f:?}");
    assert_eq!(f[0].reason, reasons::WatchersElsewhere);
    assert!(f[0].message.contains("10.0.0.4:0/9"), "{}", f[0].message);
}
