//! The TOML config file: node settings and the backends to enable. With no
//! file, the `file` backend is enabled with its pool under the state dir; a
//! file or directory given must name its backends.

use crate::error::{Error, Result};
use serde::Deserialize;
use std::path::{Path, PathBuf};

/// The whole config file.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Config {
    #[serde(default)]
    pub node: NodeSettings,
    /// The backend used when a StorageClass names none.
    pub default_backend: Option<String>,
    /// `[[backend]]` tables.
    #[serde(default, rename = "backend")]
    pub backends: Vec<BackendConfig>,
}

/// One file of a config directory: like [`Config`], but it can tell
/// whether `[node]` was written at all.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Fragment {
    node: Option<NodeSettings>,
    default_backend: Option<String>,
    #[serde(default, rename = "backend")]
    backends: Vec<BackendConfig>,
}

/// Settings of the node service.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct NodeSettings {
    /// Reported in NodeGetInfo; 0 means no limit.
    pub max_volumes_per_node: i64,
    /// The topology key whose value is this node's id.
    pub topology_key: String,
    /// Where staging paths and publish targets may be (absolute path
    /// prefixes, checked on the resolved path); empty: anywhere. The
    /// manifests set it to the kubelet root.
    pub allowed_paths: Vec<PathBuf>,
    /// The key derivation of encrypted volumes formatted from now on
    /// (argon2id): the memory it takes, in KiB...
    pub encryption_kdf_memory_kib: u32,
    /// ...and the time it is tuned to take on this node, in milliseconds.
    /// Every stage of the volume derives its key again with the cost
    /// fixed at its format.
    pub encryption_kdf_time_ms: u32,
    /// The cgroup v2 tree kubelet puts its pods' cgroups in, as this
    /// process sees it (the node plugin mounts the host's there), where
    /// volumes' I/O limits are set.
    pub cgroup_root: PathBuf,
    /// The controller the node asks for changes to its volumes' I/O limits
    /// (`http://host:port`, the controller's metrics address; a Service's
    /// name on a cluster); none: the node takes a volume's limits from its
    /// context (and, where it is its own controller, from its changes).
    pub limits_from: Option<String>,
    /// How often, in seconds, the node asks it.
    pub limits_refresh_seconds: u64,
}

impl Default for NodeSettings {
    fn default() -> Self {
        let kdf = crate::host::crypt::Kdf::default();
        Self {
            max_volumes_per_node: 256,
            topology_key: "topology.ferrovol.io/node".into(),
            allowed_paths: Vec::new(),
            encryption_kdf_memory_kib: kdf.memory_kib,
            encryption_kdf_time_ms: kdf.time_ms,
            cgroup_root: "/sys/fs/cgroup".into(),
            limits_from: None,
            limits_refresh_seconds: 10,
        }
    }
}

impl NodeSettings {
    /// The key derivation the settings name, within cryptsetup's bounds.
    pub fn kdf(&self) -> Result<crate::host::crypt::Kdf> {
        crate::host::crypt::Kdf::new(self.encryption_kdf_memory_kib, self.encryption_kdf_time_ms)
    }
}

/// One `[[backend]]` table: its type, an optional name (default: the type)
/// and the backend's own settings, which the backend parses.
#[derive(Debug, Clone, Deserialize, PartialEq)]
pub struct BackendConfig {
    #[serde(rename = "type")]
    pub kind: String,
    pub name: Option<String>,
    #[serde(flatten)]
    pub settings: toml::Table,
}

impl BackendConfig {
    pub fn name(&self) -> &str {
        self.name.as_deref().unwrap_or(&self.kind)
    }

    /// Parses this backend's settings into its typed form.
    pub fn settings<T: for<'de> Deserialize<'de>>(&self) -> Result<T> {
        toml::Value::Table(self.settings.clone())
            .try_into()
            .map_err(|e| {
                Error::invalid(format!(
                    "backend {:?}: {}",
                    self.name(),
                    e.to_string().trim()
                ))
            })
    }
}

impl Config {
    /// Parses config text.
    pub fn parse(text: &str) -> Result<Self> {
        parse_toml(text)
    }

    /// Reads the config file (or the `*.toml` files of a config directory),
    /// or, when there is none, serves the `built_in` backend alone (the
    /// driver's: [`crate::backend::built_in`]).
    pub fn load(path: Option<&Path>, built_in: impl FnOnce() -> BackendConfig) -> Result<Self> {
        let Some(path) = path else {
            let mut config = Config::default();
            config.backends.push(built_in());
            return Ok(config);
        };
        let config: Config = match path.is_dir() {
            true => Self::load_dir(path)?,
            false => read_toml(path)?,
        };
        // A config that names no backend is a mistake (a fragment left
        // out, every backend turned off), never a wish for the built-in
        // one: that would put volumes on a node meant to have none.
        if config.backends.is_empty() {
            return Err(Error::invalid(format!(
                "config {} names no backend ([[backend]]); the built-in file backend is \
                 only for a driver started without --config. A node that serves no backend \
                 of this driver runs no node plugin of it: keep the DaemonSet off it",
                path.display()
            )));
        }
        Ok(config)
    }

    /// A config directory: every `*.toml` file in it (not hidden ones, such
    /// as the `..data` links of a mounted ConfigMap), in name order. Their
    /// backends add up; `[node]` and `default_backend` may each be set by
    /// one file only, so that fragments from different places (a base and
    /// each backend's overlay) cannot silently override each other.
    pub fn load_dir(dir: &Path) -> Result<Self> {
        let read_err = |e| Error::io(format!("read config directory {}", dir.display()), e);
        let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
            .map_err(read_err)?
            .filter_map(|entry| entry.ok().map(|e| e.path()))
            .filter(|p| {
                let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
                !name.starts_with('.') && name.ends_with(".toml") && p.is_file()
            })
            .collect();
        files.sort();
        let mut config = Config::default();
        let mut node_from: Option<PathBuf> = None;
        let mut default_from: Option<PathBuf> = None;
        for file in &files {
            let fragment: Fragment = read_toml(file)?;
            let twice = |what: &str, first: &Path| {
                Error::invalid(format!(
                    "config: {what} is set in both {} and {}",
                    first.display(),
                    file.display()
                ))
            };
            if let Some(node) = fragment.node {
                if let Some(first) = &node_from {
                    return Err(twice("[node]", first));
                }
                config.node = node;
                node_from = Some(file.clone());
            }
            if let Some(name) = fragment.default_backend {
                if let Some(first) = &default_from {
                    return Err(twice("default_backend", first));
                }
                config.default_backend = Some(name);
                default_from = Some(file.clone());
            }
            config.backends.extend(fragment.backends);
        }
        Ok(config)
    }
}

/// Parses config text into `T`.
fn parse_toml<T: serde::de::DeserializeOwned>(text: &str) -> Result<T> {
    toml::from_str(text).map_err(|e| Error::invalid(format!("config: {}", e.to_string().trim())))
}

/// Reads and parses one config file; errors name it.
fn read_toml<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| Error::io(format!("read config {}", path.display()), e))?;
    parse_toml(&text).map_err(|e| e.context(path.display()))
}

/// Parses a size: a byte count, or a number with a K/M/G/T suffix (powers of
/// 1024; `Ki`, `KiB` and `K` alike).
pub fn parse_size(text: &str) -> Result<u64> {
    let t = text.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| Error::invalid(format!("size {text:?} is not a number")))?;
    let shift = match unit
        .trim()
        .to_ascii_lowercase()
        .trim_end_matches('b')
        .trim_end_matches('i')
    {
        "" => 0,
        "k" => 10,
        "m" => 20,
        "g" => 30,
        "t" => 40,
        "p" => 50,
        _ => return Err(Error::invalid(format!("size {text:?} has an unknown unit"))),
    };
    n.checked_mul(1u64 << shift)
        .ok_or_else(|| Error::invalid(format!("size {text:?} is too large")))
}

/// A size in config: a number of bytes or a string with a unit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Size(pub u64);

impl<'de> Deserialize<'de> for Size {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            N(u64),
            S(String),
        }
        match Raw::deserialize(d)? {
            Raw::N(n) => Ok(Size(n)),
            Raw::S(s) => parse_size(&s)
                .map(Size)
                .map_err(|e| serde::de::Error::custom(e.message)),
        }
    }
}

/// `host:port`: an IPv4 address or DNS name, or `[v6]`, and a port (an
/// iSCSI portal, a Ceph monitor).
pub fn is_host_port(s: &str) -> bool {
    let Some((host, port)) = s.rsplit_once(':') else {
        return false;
    };
    if port.parse::<u16>().is_err() || host.is_empty() || host.len() > 253 {
        return false;
    }
    if let Some(v6) = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
        return v6.parse::<std::net::Ipv6Addr>().is_ok();
    }
    host.bytes()
        .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'-')
        && !host.starts_with('-')
}

/// Absolute path check for paths named in config.
pub fn absolute(path: &Path, what: &str) -> Result<PathBuf> {
    if !path.is_absolute() {
        return Err(Error::invalid(format!(
            "{what} {} must be an absolute path",
            path.display()
        )));
    }
    Ok(path.to_path_buf())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The built-in backend's table, as `backend::built_in` makes it.
    fn built_in() -> BackendConfig {
        BackendConfig {
            kind: "file".into(),
            name: None,
            settings: toml::Table::from_iter([("pool".into(), "/state/pool".into())]),
        }
    }

    #[test]
    fn without_a_config_the_built_in_backend_alone_and_the_node_defaults() {
        let c = Config::load(None, built_in).unwrap();
        assert_eq!(c.backends.len(), 1);
        assert_eq!(c.backends[0].name(), "file");
        assert_eq!(c.backends[0].settings["pool"].as_str(), Some("/state/pool"));
        assert_eq!(c.default_backend, None);
        assert_eq!(c.node.max_volumes_per_node, 256);
    }

    #[test]
    fn parses_backends_and_node_settings() {
        let c = Config::parse(
            r#"
            default_backend = "fast"
            [node]
            max_volumes_per_node = 10
            [[backend]]
            type = "file"
            name = "fast"
            pool = "/srv/pool"
            max_volume_size = "2Gi"
            "#,
        )
        .unwrap();
        assert_eq!(c.default_backend.as_deref(), Some("fast"));
        assert_eq!(c.node.max_volumes_per_node, 10);
        assert_eq!(c.backends[0].kind, "file");
        assert_eq!(c.backends[0].name(), "fast");
    }

    /// The key derivation of encrypted volumes: 64 MiB and half a second
    /// unless `[node]` says otherwise, within cryptsetup's bounds.
    #[test]
    fn the_encryption_kdf_is_set_in_node() {
        let kdf = Config::default().node.kdf().unwrap();
        assert_eq!((kdf.memory_kib, kdf.time_ms), (65536, 500));
        let parse = |text: &str| toml::from_str::<Config>(text).unwrap().node.kdf();
        let kdf = parse(
            "[node]
encryption_kdf_memory_kib = 1048576
encryption_kdf_time_ms = 2000
",
        )
        .unwrap();
        assert_eq!((kdf.memory_kib, kdf.time_ms), (1048576, 2000));
        for bad in [
            "encryption_kdf_memory_kib = 16",
            "encryption_kdf_memory_kib = 4194305",
            "encryption_kdf_time_ms = 0",
            "encryption_kdf_time_ms = 60001",
        ] {
            let e = parse(&format!("[node]\n{bad}\n")).unwrap_err();
            assert_eq!(e.kind, crate::error::Kind::InvalidArgument, "{bad}");
            assert!(e.message.contains("node.encryption_kdf_"), "{}", e.message);
        }
    }

    #[test]
    fn a_config_directory_adds_up_its_files() {
        let dir = tempfile::tempdir().unwrap();
        let write = |name: &str, text: &str| std::fs::write(dir.path().join(name), text).unwrap();
        write(
            "00-driver.toml",
            "[node]\nmax_volumes_per_node = 7\nallowed_paths = [\"/var/lib/kubelet\"]\n",
        );
        write("lvm.toml", "[[backend]]\ntype = \"lvm\"\n");
        write(
            "file.toml",
            "default_backend = \"file\"\n[[backend]]\ntype = \"file\"\npool = \"/p\"\n",
        );
        // What a mounted ConfigMap also holds, and other files: ignored.
        std::fs::create_dir(dir.path().join("..data")).unwrap();
        write("..data/x.toml", "bogus = 1");
        write("README", "not toml");
        let c = Config::load(Some(dir.path()), built_in).unwrap();
        assert_eq!(c.node.max_volumes_per_node, 7);
        assert_eq!(c.default_backend.as_deref(), Some("file"));
        let names: Vec<&str> = c.backends.iter().map(|b| b.name()).collect();
        assert_eq!(names, ["file", "lvm"], "in file name order");

        write("zz.toml", "[node]\nmax_volumes_per_node = 1\n");
        let e = Config::load(Some(dir.path()), built_in).unwrap_err();
        assert!(e.message.contains("[node] is set in both"), "{}", e.message);
        std::fs::remove_file(dir.path().join("zz.toml")).unwrap();
        write("zz.toml", "default_backend = \"lvm\"\n");
        let e = Config::load(Some(dir.path()), built_in).unwrap_err();
        assert!(
            e.message.contains("default_backend is set in both"),
            "{}",
            e.message
        );
        write(
            "zz.toml",
            "[[backend]]\ntype = \"file\"\nbogus_key = 1\n[oops]\n",
        );
        let e = Config::load(Some(dir.path()), built_in).unwrap_err();
        assert!(e.message.contains("zz.toml"), "{}", e.message);

        // A directory of no backend is refused, naming it: never the
        // built-in file backend in its place.
        let empty = tempfile::tempdir().unwrap();
        std::fs::write(empty.path().join("00-driver.toml"), "[node]\n").unwrap();
        let e = Config::load(Some(empty.path()), built_in).unwrap_err();
        assert_eq!(e.kind, crate::error::Kind::InvalidArgument);
        assert!(e.message.contains("names no backend"), "{}", e.message);
        assert!(
            e.message.contains(&empty.path().display().to_string()),
            "{}",
            e.message
        );
        // Without a config, the built-in one.
        let c = Config::load(None, built_in).unwrap();
        assert_eq!(c.backends[0].settings["pool"].as_str(), Some("/state/pool"));
    }

    #[test]
    fn unknown_keys_are_errors() {
        assert!(Config::parse("bogus = 1").is_err());
        assert!(Config::parse("[node]\nmax_volume = 1").is_err());
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("1048576").unwrap(), 1 << 20);
        assert_eq!(parse_size("1Mi").unwrap(), 1 << 20);
        assert_eq!(parse_size("2GiB").unwrap(), 2 << 30);
        assert_eq!(parse_size("3g").unwrap(), 3 << 30);
        assert!(parse_size("1Xi").is_err());
        assert!(parse_size("-1").is_err());
        assert!(parse_size("99999999999P").is_err());
    }
}
