//! The upstream conformance suite (csi-sanity) against the driver on the
//! embedded `file` backend, on the host. The remote and LVM backends run
//! it in the real-kernel guest (`tests/guest/sanity.rs`). Needs root.

mod common;

use common::sanity::{read_report, Sanity};
use common::*;

#[tokio::test]
async fn csi_sanity_file_backend() {
    let h = Harness::start().await;
    let tally = Sanity {
        name: "file",
        mutable: [("preallocate".to_string(), "true".to_string())].into(),
        ..Default::default()
    }
    .run(&h);
    assert_eq!(tally.failed, 0);
    assert!(h.loop_devices().is_empty(), "{:?}", h.loop_devices());
    assert!(h.mounts().is_empty(), "{:?}", h.mounts());
}

/// The report reader counts a failure as one (the run's verdict rests on
/// it).
#[test]
fn the_report_reader_counts_failures() {
    let json = r#"[{"SpecReports":[
        {"ContainerHierarchyTexts":["Node Service"],"LeafNodeText":"should work","State":"passed"},
        {"ContainerHierarchyTexts":["Controller"],"LeafNodeText":"should fail","State":"failed",
         "Failure":{"Message":"Expected NotFound"}},
        {"ContainerHierarchyTexts":[],"LeafNodeText":"skip me","State":"skipped"}]}]"#;
    let (tally, failures) = read_report(json);
    assert_eq!((tally.passed, tally.failed, tally.skipped), (1, 1, 1));
    assert_eq!(failures, ["- Controller should fail: Expected NotFound"]);
}
