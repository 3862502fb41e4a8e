//! Compiles `proto/csi.proto` into Rust with tonic's prost generator. The
//! descriptor set comes from `protox`, a protobuf compiler written in Rust, so
//! building needs no system `protoc`.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/csi.proto");
    // Rebuild the version string when HEAD moves: HEAD itself, and the
    // branch ref it points to (which is what a commit changes).
    if let Ok(head) = std::fs::read_to_string(".git/HEAD") {
        println!("cargo:rerun-if-changed=.git/HEAD");
        if let Some(r) = head.trim().strip_prefix("ref: ") {
            println!("cargo:rerun-if-changed=.git/{r}");
        }
    }
    let descriptors = protox::compile(["proto/csi.proto"], ["proto"])?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        // `ferrovol client --output json` prints answers as they are.
        .type_attribute(".csi.v1", "#[derive(serde::Serialize)]")
        .field_attribute(
            ".csi.v1.Snapshot.creation_time",
            "#[serde(serialize_with = \"crate::client::timestamp\")]",
        )
        .field_attribute(
            ".csi.v1.VolumeGroupSnapshot.creation_time",
            "#[serde(serialize_with = \"crate::client::timestamp\")]",
        )
        .compile_fds(descriptors)?;

    // The git revision, when this is built from a checkout, goes into the
    // version string the driver reports.
    let rev = std::process::Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    println!("cargo:rustc-env=FERROVOL_GIT_REV={rev}");
    Ok(())
}
