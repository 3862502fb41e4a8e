//! The upstream CSI conformance suite (csi-sanity, from `../shared/tools/`
//! beside the project) against a running driver: its JSON report is kept
//! under `target/sanity/<name>.json`, and a run with any failed spec fails
//! the test, naming each failure and its message.

use super::Harness;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;

/// What one csi-sanity run asks of the suite beyond the driver's socket.
#[derive(Default)]
pub struct Sanity<'a> {
    /// Names the report file.
    pub name: &'a str,
    /// CreateVolume parameters for every volume the suite makes.
    pub parameters: BTreeMap<String, String>,
    /// The same secrets for every RPC that carries them.
    pub secrets: BTreeMap<String, String>,
    /// A ginkgo focus (a regular expression over spec names); none: all.
    pub focus: Option<&'a str>,
    /// Specs to leave out (a regular expression), unless the whole suite
    /// is asked for (`FERROVOL_SANITY=full`): what the default run, CI's,
    /// passes over to stay within its time, each for a reason its caller
    /// gives.
    pub skip_unless_full: Option<&'a str>,
    /// Likewise a focus that applies unless the whole suite is asked for.
    pub focus_unless_full: Option<&'a str>,
    /// Test volume size in bytes (default 64 MiB; expansion to twice it).
    pub volume_bytes: Option<u64>,
    /// Runs the attach-limit spec (`--csi.testnodevolumeattachlimit`): as
    /// many volumes as NodeGetInfo's `max_volumes_per_node` published to
    /// the node, and one more refused. Keep the driver's count small.
    pub attach_limit: bool,
    /// Mutable parameters for the modify specs (a VolumeAttributesClass's
    /// keys, `--csi.testvolumemutableparameters`); none: those specs skip.
    pub mutable: BTreeMap<String, String>,
}

/// Counts from one run.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Tally {
    pub passed: usize,
    pub failed: usize,
    pub skipped: usize,
}

/// The csi-sanity binary: `FERROVOL_CSI_SANITY`, else the shared tools.
pub fn binary() -> PathBuf {
    std::env::var_os("FERROVOL_CSI_SANITY")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../shared/tools/csi-sanity")
        })
}

/// The secret names csi-sanity passes on, each to the RPC it names.
const SECRET_NAMES: &[&str] = &[
    "CreateVolumeSecret",
    "DeleteVolumeSecret",
    "ControllerPublishVolumeSecret",
    "ControllerUnpublishVolumeSecret",
    "ControllerValidateVolumeCapabilitiesSecret",
    "NodeStageVolumeSecret",
    "NodePublishVolumeSecret",
    "CreateSnapshotSecret",
    "DeleteSnapshotSecret",
    "ControllerExpandVolumeSecret",
    "NodeExpandVolumeSecret",
    "ListSnapshotsSecret",
];

impl Sanity<'_> {
    /// Runs the suite against `h`'s driver; panics with every failure
    /// unless none failed. Returns the counts.
    pub fn run(&self, h: &Harness) -> Tally {
        let bin = binary();
        assert!(
            bin.is_file(),
            "csi-sanity not found at {} (../shared/tools beside the project, or FERROVOL_CSI_SANITY)",
            bin.display()
        );
        let reports = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/sanity");
        std::fs::create_dir_all(&reports).unwrap();
        let report = reports.join(format!("{}.json", self.name));
        let _ = std::fs::remove_file(&report);
        let size = self.volume_bytes.unwrap_or(64 << 20);
        let mut cmd = Command::new(&bin);
        cmd.arg(format!("--csi.endpoint={}", h.socket().display()))
            .arg(format!(
                "--csi.stagingdir={}",
                h.path("kubelet/sanity-staging").display()
            ))
            .arg(format!(
                "--csi.mountdir={}",
                h.path("kubelet/sanity-target").display()
            ))
            .arg(format!("--csi.testvolumesize={size}"))
            .arg(format!("--csi.testvolumeexpandsize={}", 2 * size))
            .arg("--ginkgo.no-color")
            .arg("--ginkgo.v")
            // A hung spec ends the run, reported, instead of the guest's
            // own time limit ending everything.
            .arg("--ginkgo.timeout=20m")
            .arg(format!("--ginkgo.json-report={}", report.display()));
        if self.attach_limit {
            cmd.arg("--csi.testnodevolumeattachlimit");
        }
        // JSON is YAML: the suite reads both files as YAML.
        if !self.parameters.is_empty() {
            let p = h.path("sanity-parameters.yaml");
            std::fs::write(&p, serde_json::to_string(&self.parameters).unwrap()).unwrap();
            cmd.arg(format!("--csi.testvolumeparameters={}", p.display()));
        }
        if !self.mutable.is_empty() {
            let p = h.path("sanity-mutable.yaml");
            std::fs::write(&p, serde_json::to_string(&self.mutable).unwrap()).unwrap();
            cmd.arg(format!("--csi.testvolumemutableparameters={}", p.display()));
        }
        if !self.secrets.is_empty() {
            let all: BTreeMap<&str, &BTreeMap<String, String>> =
                SECRET_NAMES.iter().map(|n| (*n, &self.secrets)).collect();
            let p = h.path("sanity-secrets.yaml");
            std::fs::write(&p, serde_json::to_string(&all).unwrap()).unwrap();
            cmd.arg(format!("--csi.secrets={}", p.display()));
        }
        let full = std::env::var("FERROVOL_SANITY").as_deref() == Ok("full");
        let focus = self.focus.or(self.focus_unless_full.filter(|_| !full));
        if let Some(f) = focus {
            cmd.arg(format!("--ginkgo.focus={f}"));
        }
        if let Some(skip) = self.skip_unless_full.filter(|_| !full) {
            cmd.arg(format!("--ginkgo.skip={skip}"));
        }
        // Its progress (one line per spec) and the driver's log stay
        // beside the report.
        let log = reports.join(format!("{}.log", self.name));
        cmd.stdout(std::fs::File::create(&log).unwrap());
        let out = cmd.output().expect("run csi-sanity");
        let _ = std::fs::write(reports.join(format!("{}.driver.log", self.name)), h.log());
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        let json = std::fs::read_to_string(&report).unwrap_or_else(|e| {
            panic!(
                "csi-sanity wrote no report ({e}); it printed:\n{text}\n{}",
                String::from_utf8_lossy(&out.stderr)
            )
        });
        let (tally, failures) = read_report(&json);
        println!(
            "csi-sanity {}: {} passed, {} failed, {} skipped (report: {})",
            self.name,
            tally.passed,
            tally.failed,
            tally.skipped,
            report.display()
        );
        assert!(
            failures.is_empty() && out.status.success(),
            "csi-sanity {}: {} failed (exit {:?}):\n{}\nits output and the driver's log: {}",
            self.name,
            failures.len(),
            out.status.code(),
            failures.join("\n"),
            log.display()
        );
        assert!(tally.passed > 0, "csi-sanity {} ran no spec", self.name);
        tally
    }
}

/// Counts the specs of a ginkgo JSON report by state, and lists each
/// failure as `name: message`.
pub fn read_report(json: &str) -> (Tally, Vec<String>) {
    let suites: Vec<serde_json::Value> = serde_json::from_str(json).expect("ginkgo JSON report");
    let mut tally = Tally::default();
    let mut failures = Vec::new();
    for spec in suites
        .iter()
        .flat_map(|s| s["SpecReports"].as_array().cloned().unwrap_or_default())
    {
        let name = spec["ContainerHierarchyTexts"]
            .as_array()
            .into_iter()
            .flatten()
            .chain(std::iter::once(&spec["LeafNodeText"]))
            .filter_map(|t| t.as_str())
            .collect::<Vec<_>>()
            .join(" ");
        match spec["State"].as_str().unwrap_or("") {
            "passed" => tally.passed += 1,
            "skipped" | "pending" => tally.skipped += 1,
            other => {
                tally.failed += 1;
                let message = spec["Failure"]["Message"].as_str().unwrap_or(other);
                failures.push(format!("- {name}: {}", message.trim()));
            }
        }
    }
    (tally, failures)
}
