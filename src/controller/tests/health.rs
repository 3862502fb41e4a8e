//! Controller health over backends without a reporter of their own: a
//! volume is reported by whether it exists, storage that does not answer
//! is said so, and the list walks every backend once, page by page.

use super::*;
use crate::plugin::health::Reason;
use std::collections::BTreeSet;

/// Every unhealthy volume the list gives, page by page of `max`.
async fn walk(c: &ControllerOps, max: i32) -> Vec<String> {
    let (mut all, mut token) = (Vec::new(), String::new());
    for _ in 0..1000 {
        let page = c
            .list_volume_health(max, &token, &Secrets::default())
            .await
            .unwrap();
        assert!(max == 0 || page.entries.len() <= max as usize);
        all.extend(page.entries.into_iter().map(|(id, _)| id.to_string()));
        if page.next_token.is_empty() {
            return all;
        }
        token = page.next_token;
    }
    panic!("the list never ended");
}

#[tokio::test]
async fn volumes_are_reported_by_whether_they_exist_and_the_list_walks_every_backend() {
    let a = Arc::new(Memory::new("a", local()).with_volumes(300));
    let b = Arc::new(Memory::new("b", local()).with_volumes(5));
    let c = ops(vec![a.clone(), b.clone()]);
    let mut lost = BTreeSet::new();
    for i in [0, 7, 255, 256, 299] {
        a.lost.lock().unwrap().insert(format!("v{i:04}"));
        lost.insert(format!("a:v{i:04}"));
    }
    b.lost.lock().unwrap().insert("v0003".into());
    lost.insert("b:v0003".into());
    // One that answers nothing: said as such, and listed.
    b.not_answering.lock().unwrap().insert("v0001".into());
    lost.insert("b:v0001".into());

    let id = |s: &str| VolumeId::parse(s).unwrap();
    let s = Secrets::default();
    assert_eq!(c.volume_health(&id("a:v0001"), &s).await.unwrap(), vec![]);
    let f = c.volume_health(&id("a:v0007"), &s).await.unwrap();
    assert_eq!(f[0].reason, Reason::VolumeNotFound, "{f:?}");
    let f = c.volume_health(&id("b:v0001"), &s).await.unwrap();
    assert_eq!(f[0].reason, Reason::StorageNotAnswering, "{f:?}");
    assert_eq!(
        c.volume_health(&id("other:v1"), &s).await.unwrap_err().kind,
        crate::error::Kind::NotFound
    );
    // Pages of every size give each unhealthy volume once, across the
    // 256-volume scan bound and the backends' boundary.
    for max in [0, 1, 2, 3, 5, 100] {
        let listed = walk(&c, max).await;
        let unique: BTreeSet<String> = listed.iter().cloned().collect();
        assert_eq!(listed.len(), unique.len(), "max {max}: {listed:?}");
        assert_eq!(unique, lost, "max {max}");
    }
    assert_eq!(
        c.list_volume_health(-1, "", &s).await.unwrap_err().kind,
        crate::error::Kind::InvalidArgument
    );
}

/// A backend whose volumes cannot be listed leaves them out of the list;
/// the other backends' volumes are listed still (one unreachable store
/// must not hide every volume's health from the monitor).
#[tokio::test]
async fn a_backend_that_cannot_list_leaves_only_its_own_volumes_out() {
    let a = Arc::new(Memory::new("a", local()).with_volumes(3));
    let b = Arc::new(Memory::new("b", local()).with_volumes(3));
    let c = ops(vec![a.clone(), b.clone()]);
    a.lost.lock().unwrap().insert("v0001".into());
    b.lost.lock().unwrap().insert("v0002".into());
    a.list_fails
        .store(true, std::sync::atomic::Ordering::Relaxed);
    assert_eq!(walk(&c, 0).await, vec!["b:v0002".to_string()]);
    a.list_fails
        .store(false, std::sync::atomic::Ordering::Relaxed);
    assert_eq!(
        walk(&c, 0).await,
        vec!["a:v0001".to_string(), "b:v0002".to_string()]
    );
}
