//! Checks of the documentation and the release's version, without root:
//! every relative link and anchor in the README, CHANGELOG and docs/
//! resolves, and every place that names the version names Cargo.toml's.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

#[path = "docs/places.rs"]
mod places;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The project's Markdown pages: the top-level ones, docs/ (and its
/// backends/) and deploy/.
fn pages() -> Vec<PathBuf> {
    let mut all = vec![root().join("README.md"), root().join("CHANGELOG.md")];
    for dir in ["docs", "docs/backends", "deploy"] {
        let mut here: Vec<PathBuf> = std::fs::read_dir(root().join(dir))
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|e| e == "md"))
            .collect();
        here.sort();
        all.extend(here);
    }
    all
}

/// A page's lines outside fenced code blocks.
fn prose(text: &str) -> impl Iterator<Item = &str> {
    let mut fenced = false;
    text.lines().filter(move |line| {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            return false;
        }
        !fenced
    })
}

/// The anchors GitHub gives a page's headings: lower case, punctuation
/// dropped (not `-` or `_`), spaces made `-`, a repeat numbered `-1`, `-2`.
fn anchors(text: &str) -> BTreeSet<String> {
    let mut seen = BTreeSet::new();
    for line in prose(text) {
        if !line.starts_with('#') {
            continue;
        }
        let title = line.trim_start_matches('#').trim();
        let slug: String = title
            .to_lowercase()
            .chars()
            .filter(|c| c.is_alphanumeric() || *c == ' ' || *c == '-' || *c == '_')
            .map(|c| if c == ' ' { '-' } else { c })
            .collect();
        let mut name = slug.clone();
        let mut n = 0;
        while seen.contains(&name) {
            n += 1;
            name = format!("{slug}-{n}");
        }
        seen.insert(name);
    }
    seen
}

/// Every inline link target `](target)` outside code.
fn links(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    for line in prose(text) {
        // Inline code spans hold no links.
        let plain: String = line
            .split('`')
            .enumerate()
            .filter(|(i, _)| i % 2 == 0)
            .map(|(_, s)| s)
            .collect::<Vec<_>>()
            .join(" ");
        let mut rest = plain.as_str();
        while let Some(at) = rest.find("](") {
            let after = &rest[at + 2..];
            let Some(end) = after.find(')') else { break };
            out.push(after[..end].trim().to_string());
            rest = &after[end..];
        }
    }
    out
}

#[test]
fn every_relative_link_and_anchor_in_the_docs_resolves() {
    let mut broken = Vec::new();
    let mut checked = 0;
    for page in pages() {
        let text = std::fs::read_to_string(&page).unwrap();
        let dir = page.parent().unwrap();
        for link in links(&text) {
            if link.contains("://") || link.starts_with("mailto:") {
                continue;
            }
            checked += 1;
            let (file, anchor) = match link.split_once('#') {
                Some((f, a)) => (f, Some(a)),
                None => (link.as_str(), None),
            };
            let target = if file.is_empty() {
                page.clone()
            } else {
                dir.join(file)
            };
            let shown = format!("{}: {link}", rel(&page));
            if !target.exists() {
                broken.push(format!("{shown} (no such file)"));
                continue;
            }
            if let Some(anchor) = anchor {
                let text = std::fs::read_to_string(&target).unwrap_or_default();
                if !anchors(&text).contains(anchor) {
                    broken.push(format!("{shown} (no such heading)"));
                }
            }
        }
    }
    assert!(
        checked > 0,
        "no relative link found: the check reads nothing"
    );
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

fn rel(p: &Path) -> String {
    p.strip_prefix(root()).unwrap_or(p).display().to_string()
}

/// Cargo.toml's version.
fn version() -> String {
    env!("CARGO_PKG_VERSION").to_string()
}

#[test]
fn every_place_that_names_the_version_names_cargos() {
    let v = version();
    // The CHANGELOG's top entry.
    let changelog = std::fs::read_to_string(root().join("CHANGELOG.md")).unwrap();
    let top = changelog
        .lines()
        .find(|l| l.starts_with("## "))
        .expect("CHANGELOG.md has no version entry");
    let named = top[3..].split_whitespace().next().unwrap();
    assert_eq!(named, v, "CHANGELOG.md's top entry: {top}");
    // The image's label, through the Dockerfile's VERSION default.
    let dockerfile = std::fs::read_to_string(root().join("Dockerfile")).unwrap();
    let arg = dockerfile
        .lines()
        .find_map(|l| l.strip_prefix("ARG VERSION="))
        .expect("the Dockerfile has no VERSION argument");
    assert_eq!(arg.trim(), v, "the Dockerfile's VERSION");
    assert!(
        dockerfile.contains("org.opencontainers.image.version=\"${VERSION}\""),
        "the image's version label is not VERSION"
    );
    // The tag the overlays pin (all through one component), the chart's,
    // and the one the README's quick start builds and loads.
    let k = root().join("deploy/components/images/kustomization.yaml");
    let doc: serde_yaml::Value =
        serde_yaml::from_str(&std::fs::read_to_string(&k).unwrap()).unwrap();
    let pinned: Vec<&str> = doc["images"]
        .as_sequence()
        .into_iter()
        .flatten()
        .filter(|i| i["name"].as_str() == Some("ferrovol"))
        .filter_map(|i| i["newTag"].as_str())
        .collect();
    assert_eq!(
        pinned,
        [v.as_str()],
        "{}: the ferrovol image's tag",
        rel(&k)
    );
    // The chart: its version and appVersion (a chart of the same
    // release), and the image tag its values pin.
    let chart: serde_yaml::Value = serde_yaml::from_str(
        &std::fs::read_to_string(root().join("deploy/chart/Chart.yaml")).unwrap(),
    )
    .unwrap();
    for key in ["version", "appVersion"] {
        assert_eq!(chart[key].as_str(), Some(v.as_str()), "Chart.yaml's {key}");
    }
    let values: serde_yaml::Value = serde_yaml::from_str(
        &std::fs::read_to_string(root().join("deploy/chart/values.yaml")).unwrap(),
    )
    .unwrap();
    assert_eq!(
        values["image"]["tag"].as_str(),
        Some(v.as_str()),
        "deploy/chart/values.yaml: image.tag"
    );
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    let tags: Vec<&str> = readme
        .split("ferrovol:")
        .skip(1)
        .map(|rest| {
            rest.split(|c: char| !(c.is_ascii_alphanumeric() || c == '.'))
                .next()
                .unwrap()
                .trim_end_matches('.')
        })
        .collect();
    assert!(!tags.is_empty(), "the README builds no image");
    for t in tags {
        assert_eq!(t, v, "README.md: an image tag that is not the version");
    }
}

#[test]
fn the_binary_reports_cargos_version() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_ferrovol"))
        .arg("--version")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(text.trim(), format!("ferrovol {}", version()));
}

/// `ferrovol serve`'s flags and their environment variables, from its own
/// help: (flag, variable).
fn serve_flags() -> Vec<(String, Option<String>)> {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_ferrovol"))
        .args(["serve", "--help"])
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&out.stdout).to_string();
    let mut flags = Vec::new();
    for line in help.lines() {
        let line = line.trim_start();
        let Some(rest) = line.strip_prefix("--") else {
            continue;
        };
        let flag: String = rest
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '-')
            .collect();
        if flag == "help" {
            continue;
        }
        flags.push((format!("--{flag}"), None));
    }
    // Each flag's help text ends with its variable: `[env: NAME=]`.
    let mut at = 0;
    for (i, line) in help.lines().enumerate() {
        if line.trim_start().starts_with("--") && !line.contains("--help") {
            at = i;
        }
        if let Some(start) = line.find("[env: ") {
            let name: String = line[start + 6..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            let flag_line = help.lines().nth(at).unwrap().trim_start();
            if let Some(f) = flags
                .iter_mut()
                .find(|(f, _)| flag_line.starts_with(f.as_str()))
            {
                f.1 = Some(name);
            }
        }
    }
    flags
}

#[test]
fn every_serve_flag_and_variable_is_in_the_install_docs_and_no_other() {
    let docs = std::fs::read_to_string(root().join("docs/install.md")).unwrap();
    let flags = serve_flags();
    assert!(
        flags.len() >= 10,
        "read too few flags from the help: {flags:?}"
    );
    for (flag, var) in &flags {
        assert!(
            docs.contains(flag.as_str()),
            "docs/install.md does not name {flag}"
        );
        if let Some(var) = var {
            assert!(
                docs.contains(var.as_str()),
                "docs/install.md does not name {var} ({flag})"
            );
        }
    }
    // What the docs name exists: every `--flag` of the usage block, every
    // FERROVOL_ variable.
    let usage = docs
        .split("```")
        .find(|block| block.contains("ferrovol serve"))
        .expect("docs/install.md has no usage block");
    for word in usage.split(|c: char| !(c.is_ascii_alphanumeric() || c == '-')) {
        if word.starts_with("--") {
            assert!(
                flags.iter().any(|(f, _)| f == word),
                "docs/install.md names {word}, which `ferrovol serve` does not take"
            );
        }
    }
    for word in docs.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')) {
        if word.starts_with("FERROVOL_") {
            assert!(
                flags.iter().any(|(_, v)| v.as_deref() == Some(word)),
                "docs/install.md names {word}, which `ferrovol serve` does not read"
            );
        }
    }
}

/// The backticked words of a table cell (`a`, `b` and the like).
fn ticked(cell: &str) -> Vec<String> {
    cell.split('`')
        .enumerate()
        .filter(|(i, _)| i % 2 == 1)
        .map(|(_, s)| s.to_string())
        .collect()
}

/// The rows of the first table under a header line that starts with
/// `header`, as cells.
fn table(text: &str, header: &str) -> Vec<Vec<String>> {
    let mut rows = Vec::new();
    let mut inside = false;
    for line in text.lines() {
        if line.starts_with(header) {
            inside = true;
            continue;
        }
        if inside {
            if !line.starts_with('|') {
                break;
            }
            if line.starts_with("| ---") || line.starts_with("|---") {
                continue;
            }
            rows.push(
                line.trim_matches('|')
                    .split(" | ")
                    .map(|c| c.trim().to_string())
                    .collect(),
            );
        }
    }
    rows
}

#[test]
fn every_backend_s_parameters_in_the_docs_are_the_ones_it_takes() {
    use std::collections::BTreeSet;
    let install = std::fs::read_to_string(root().join("docs/install.md")).unwrap();
    let summary = table(&install, "| backend | mutable parameters |");
    for k in ferrovol::backend::KINDS {
        let (kind, parameters, mutable) = (k.name, k.parameters, k.mutable);
        let page =
            std::fs::read_to_string(root().join(format!("docs/backends/{kind}.md"))).unwrap();
        // StorageClass parameters: the backend page's table, less the
        // keys every backend shares.
        let documented: BTreeSet<String> = table(&page, "| StorageClass parameter")
            .iter()
            .flat_map(|row| ticked(&row[0]))
            .filter(|k| {
                k != "backend"
                    && k != "encrypted"
                    && !k.starts_with("backend:")
                    && !k.starts_with("csi.storage.k8s.io/")
            })
            .collect();
        let taken: BTreeSet<String> = parameters.iter().map(|s| s.to_string()).collect();
        assert_eq!(
            documented, taken,
            "docs/backends/{kind}.md's StorageClass parameters (left) and the backend's (right)"
        );
        // Mutable parameters: the page's table (an iscsi store's keys are
        // its store's page's), and a row of install.md's summary that
        // links to it.
        let documented: BTreeSet<String> = table(&page, "| mutable parameter")
            .iter()
            .flat_map(|row| ticked(&row[0]))
            .collect();
        let taken: BTreeSet<String> = mutable.iter().map(|s| s.to_string()).collect();
        assert_eq!(
            documented, taken,
            "docs/backends/{kind}.md's mutable parameters (left) and the backend's (right)"
        );
        if !taken.is_empty() {
            let link = format!("(backends/{kind}.md#mutable-parameters)");
            assert!(
                summary
                    .iter()
                    .any(|row| ticked(&row[0]) == [kind] && row[1].contains(&link)),
                "docs/install.md's mutable parameters summary has no row for {kind} linking {link}"
            );
        }
    }
}

#[test]
fn every_secret_key_the_backends_read_is_documented_and_the_examples_use_no_other() {
    for k in ferrovol::backend::KINDS {
        let (kind, keys) = (k.name, k.secrets);
        let page =
            std::fs::read_to_string(root().join(format!("docs/backends/{kind}.md"))).unwrap();
        for key in keys {
            assert!(
                page.contains(&format!("`{key}`")),
                "docs/backends/{kind}.md does not name the secret key {key}"
            );
        }
        // The example Secret of the backend's component names only keys
        // the backend reads.
        let example = root().join(format!("deploy/components/{kind}/secret.yaml"));
        if let Ok(text) = std::fs::read_to_string(&example) {
            let doc: serde_yaml::Value = serde_yaml::from_str(&text).unwrap();
            let named: Vec<&str> = doc["stringData"]
                .as_mapping()
                .expect("an example Secret with stringData")
                .keys()
                .filter_map(|k| k.as_str())
                .collect();
            assert!(!named.is_empty(), "{}: no keys", rel(&example));
            for k in named {
                assert!(
                    keys.contains(&k),
                    "{} names {k}, which the {kind} backend does not read",
                    rel(&example)
                );
            }
        }
    }
    let passphrase = ferrovol::host::crypt::PASSPHRASE_KEY;
    let encryption = std::fs::read_to_string(root().join("docs/encryption.md")).unwrap();
    assert!(encryption.contains(&format!("`{passphrase}`")));
}

/// The field names a `Deserialize` struct reads (its `deserialize_struct`
/// call says them), without a value to read.
fn fields<T: for<'de> serde::Deserialize<'de>>() -> Vec<&'static str> {
    use serde::de::{self, Visitor};
    struct Names<'a>(&'a mut Vec<&'static str>);
    impl<'de> de::Deserializer<'de> for Names<'_> {
        type Error = de::value::Error;
        fn deserialize_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Self::Error> {
            Err(de::Error::custom("names only"))
        }
        fn deserialize_struct<V: Visitor<'de>>(
            self,
            _name: &'static str,
            fields: &'static [&'static str],
            _: V,
        ) -> Result<V::Value, Self::Error> {
            self.0.extend_from_slice(fields);
            Err(de::Error::custom("names only"))
        }
        serde::forward_to_deserialize_any! {
            bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string
            bytes byte_buf option unit unit_struct newtype_struct seq tuple
            tuple_struct map enum identifier ignored_any
        }
    }
    let mut out = Vec::new();
    let _ = T::deserialize(Names(&mut out));
    assert!(
        !out.is_empty(),
        "{} read no fields",
        std::any::type_name::<T>()
    );
    out
}

/// Every ```toml block of a page.
fn toml_blocks(text: &str) -> Vec<String> {
    text.split("```toml")
        .skip(1)
        .map(|rest| rest.split("```").next().unwrap().to_string())
        .collect()
}

#[test]
fn every_config_key_is_documented_and_every_documented_config_parses() {
    use ferrovol::backend::{file, iscsi, lvm, nfs, nvmf, rbd};
    let page = |p: &str| std::fs::read_to_string(root().join(p)).unwrap();
    // The code's keys, each where a reader looks for it.
    let install = page("docs/install.md");
    for key in fields::<ferrovol::config::Config>()
        .into_iter()
        .chain(fields::<ferrovol::config::NodeSettings>())
    {
        // `backends` is read as `[[backend]]`.
        let key = if key == "backends" { "backend" } else { key };
        assert!(
            install.contains(key),
            "docs/install.md does not name the config key {key}"
        );
    }
    let by_kind: Vec<(&str, Vec<&'static str>)> = vec![
        ("file", fields::<file::FileSettings>()),
        (
            "lvm",
            [fields::<lvm::LvmSettings>(), fields::<lvm::DeviceClass>()].concat(),
        ),
        (
            "nfs",
            [
                fields::<nfs::NfsSettings>(),
                fields::<nfs::ExportSettings>(),
            ]
            .concat(),
        ),
        ("iscsi", fields::<iscsi::IscsiSettings>()),
        ("rbd", fields::<rbd::RbdSettings>()),
        ("nvmf", fields::<nvmf::NvmfSettings>()),
    ];
    // One entry per kind the driver has.
    let mut listed: Vec<&str> = by_kind.iter().map(|(k, _)| *k).collect();
    let mut kinds: Vec<&str> = ferrovol::backend::KINDS.iter().map(|k| k.name).collect();
    listed.sort();
    kinds.sort();
    assert_eq!(listed, kinds, "a kind's settings are not checked here");
    for (kind, keys) in &by_kind {
        let text = page(&format!("docs/backends/{kind}.md"));
        for key in keys {
            assert!(
                text.contains(key),
                "docs/backends/{kind}.md does not name the config key {key}"
            );
        }
    }
    // Every config the docs show is one the driver takes: the file, and
    // each backend's settings with its own type (unknown keys are errors).
    let mut parsed = 0;
    for p in pages() {
        for block in toml_blocks(&std::fs::read_to_string(&p).unwrap()) {
            let config: ferrovol::config::Config = toml::from_str(&block).unwrap_or_else(|e| {
                panic!("{}: a config block does not parse: {e}\n{block}", rel(&p))
            });
            for b in &config.backends {
                let r = match b.kind.as_str() {
                    "file" => b.settings::<file::FileSettings>().map(|_| ()),
                    "lvm" => b.settings::<lvm::LvmSettings>().map(|_| ()),
                    "nfs" => b.settings::<nfs::NfsSettings>().map(|_| ()),
                    "iscsi" => b.settings::<iscsi::IscsiSettings>().map(|_| ()),
                    "rbd" => b.settings::<rbd::RbdSettings>().map(|_| ()),
                    "nvmf" => b.settings::<nvmf::NvmfSettings>().map(|_| ()),
                    other => panic!("{}: a backend of type {other}", rel(&p)),
                };
                r.unwrap_or_else(|e| panic!("{}: {}\n{block}", rel(&p), e.message));
                parsed += 1;
            }
        }
    }
    assert!(
        parsed >= 5,
        "only {parsed} backends in the docs' config blocks"
    );
}

#[test]
fn every_health_reason_is_documented_with_what_to_do() {
    let read = |page: &str| std::fs::read_to_string(root().join("docs").join(page)).unwrap();
    let (monitoring, troubleshooting) = (read("monitoring.md"), read("troubleshooting.md"));
    let reported: BTreeSet<String> = ferrovol::backend::reasons()
        .iter()
        .map(|r| r.as_str().to_string())
        .collect();
    let rows = table(&monitoring, "| reason |");
    let documented: BTreeSet<String> = rows.iter().flat_map(|row| ticked(&row[0])).collect();
    assert_eq!(
        documented, reported,
        "monitoring.md's reasons and the driver's differ"
    );
    for row in &rows {
        assert!(
            row.len() == 5 && row[4].len() > 10,
            "{row:?}: a reason says what to do"
        );
    }
    for reason in &reported {
        assert!(
            troubleshooting.contains(&format!("**`{reason}`**")),
            "troubleshooting.md does not say what to do about {reason}"
        );
    }
}
