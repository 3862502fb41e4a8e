//! nvmet, the Linux kernel's NVMe target, through configfs: the nvmf
//! backend's target server ([`export::Target`]). A volume is a subsystem
//! (`<nqn_prefix>:<locator>`) with the store's device as namespace 1,
//! linked to every port the backend serves on. A host is granted by a
//! link in the subsystem's `allowed_hosts` to its `hosts/<host NQN>`
//! entry, where its DH-HMAC-CHAP keys are written. No process is run, and
//! a key goes nowhere but its configfs attribute.
//!
//! What nvmet does not show: which hosts are connected to a subsystem
//! (only its debugfs says, a kernel option Debian leaves out). A host is
//! fenced by taking the subsystem off every port and putting it back: the
//! kernel drops the subsystem's controllers on a port it leaves, and a
//! host no longer allowed cannot connect again.

use super::reasons;
use crate::backend::export::{self, Credential};
use crate::error::{Error, Result};
use std::io::ErrorKind;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// What the nvmf backend's messages and health call things.
pub static TERMS: export::Terms = export::Terms {
    export: "subsystem",
    server: "nvmet",
    host: "host",
    connected: "connected from",
    credential: "DH-HMAC-CHAP host",
    missing: reasons::SubsystemMissing,
    grows_only_unused: None,
};

/// How long one configfs change may take (a namespace's enable opens its
/// device; a port's first link starts listening).
const CONFIGFS_DEADLINE: Duration = Duration::from_secs(30);

/// The model every subsystem of the driver's reports.
pub const MODEL: &str = "ferrovol";

/// The namespace every subsystem serves its volume as.
pub const NSID: u32 = 1;

/// One port the backend's subsystems are served on: nvmet's port `id`,
/// listening on `addr` (an IP address) and `service` (a TCP port).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Port {
    pub id: u16,
    pub addr: std::net::IpAddr,
    pub service: u16,
}

impl Port {
    fn family(&self) -> &'static str {
        if self.addr.is_ipv4() {
            "ipv4"
        } else {
            "ipv6"
        }
    }
}

/// nvmet's configfs tree (`/sys/kernel/config/nvmet`).
pub struct Nvmet {
    root: PathBuf,
    ports: Vec<Port>,
}

/// A configfs change, off the async threads, with a deadline; an I/O
/// error is `what`'s.
async fn blocking<T: Send + 'static>(
    what: String,
    f: impl FnOnce() -> Result<T> + Send + 'static,
) -> Result<T> {
    match tokio::time::timeout(CONFIGFS_DEADLINE, tokio::task::spawn_blocking(f)).await {
        Ok(Ok(done)) => done,
        Ok(Err(e)) => Err(Error::internal(format!("{what}: {e}"))),
        Err(_) => Err(Error::unavailable(format!(
            "{what}: no answer from nvmet's configfs in {} s",
            CONFIGFS_DEADLINE.as_secs()
        ))),
    }
}

/// An I/O error of configfs, as `what`'s.
fn io(what: &str) -> impl Fn(std::io::Error) -> Error + '_ {
    move |e| Error::io(what.to_string(), e)
}

/// Writes one attribute (configfs takes a whole value in one write).
fn set(path: &Path, value: &str) -> std::io::Result<()> {
    std::fs::write(path, value)
}

/// The attribute's value, trimmed.
fn get(path: &Path) -> std::io::Result<String> {
    Ok(std::fs::read_to_string(path)?.trim().to_string())
}

/// Makes a configfs group; one there already is fine.
fn make(path: &Path) -> std::io::Result<()> {
    match std::fs::create_dir(path) {
        Err(e) if e.kind() == ErrorKind::AlreadyExists => Ok(()),
        done => done,
    }
}

/// Links `item` into a group as `link`; one there already is fine.
fn link(item: &Path, link: &Path) -> std::io::Result<()> {
    match std::os::unix::fs::symlink(item, link) {
        Err(e) if e.kind() == ErrorKind::AlreadyExists => Ok(()),
        done => done,
    }
}

/// Removes a link or an empty group; one gone already is fine.
fn unlink(path: &Path) -> std::io::Result<()> {
    let removed = match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_symlink() => std::fs::remove_file(path),
        Ok(_) => std::fs::remove_dir(path),
        Err(e) => Err(e),
    };
    match removed {
        Err(e) if e.kind() == ErrorKind::NotFound => Ok(()),
        done => done,
    }
}

/// Subsystem `nqn`'s link on port `port`.
fn port_link(root: &Path, port: &Port, nqn: &str) -> PathBuf {
    root.join("ports")
        .join(port.id.to_string())
        .join("subsystems")
        .join(nqn)
}

/// A namespace's identity from the subsystem's name: its NGUID (16 bytes,
/// 32 hex digits) and its serial (the subsystem's, 16 hex digits). The
/// kernel's defaults repeat across target hosts, and native multipath
/// would take two volumes with one identity for two paths to one.
pub fn identity_for(nqn: &str) -> (String, String) {
    let nguid = crate::plugin::digest_hex(nqn.as_bytes(), 16);
    let serial = crate::plugin::digest_hex(nqn.as_bytes(), 8);
    (nguid, serial)
}

impl Nvmet {
    /// The nvmet under configfs `root` (`/sys/kernel/config/nvmet`),
    /// serving on `ports`.
    pub fn new(root: PathBuf, ports: Vec<Port>) -> Self {
        Nvmet { root, ports }
    }

    fn subsystem(&self, nqn: &str) -> PathBuf {
        self.root.join("subsystems").join(nqn)
    }

    fn host(&self, nqn: &str) -> PathBuf {
        self.root.join("hosts").join(nqn)
    }

    /// The subsystem's link on each of the backend's ports.
    fn port_links(&self, nqn: &str) -> Vec<PathBuf> {
        self.ports
            .iter()
            .map(|p| port_link(&self.root, p, nqn))
            .collect()
    }

    /// Makes the backend's ports, or finds them as the backend would make
    /// them: a port of one of its ids that listens elsewhere is not its
    /// own (FAILED_PRECONDITION).
    fn ensure_ports(root: &Path, ports: &[Port]) -> Result<()> {
        for p in ports {
            let dir = root.join("ports").join(p.id.to_string());
            let want = [
                ("addr_trtype", "tcp".to_string()),
                ("addr_adrfam", p.family().to_string()),
                ("addr_traddr", p.addr.to_string()),
                ("addr_trsvcid", p.service.to_string()),
            ];
            let what = format!("make nvmet port {}", p.id);
            let err = io(&what);
            if dir.exists() {
                let listens = get(&dir.join("addr_traddr")).map_err(&err)?;
                let service = get(&dir.join("addr_trsvcid")).map_err(&err)?;
                let trtype = get(&dir.join("addr_trtype")).map_err(&err)?;
                if (listens.as_str(), service.as_str(), trtype.as_str())
                    == (want[2].1.as_str(), want[3].1.as_str(), "tcp")
                {
                    continue;
                }
                if !(listens.is_empty() && service.is_empty()) {
                    return Err(Error::precondition(format!(
                        "nvmet port {} exists and listens on {trtype} {listens}:{service}, not \
                         on {}:{}: it is not this backend's (choose another port id)",
                        p.id, p.addr, p.service
                    )));
                }
            }
            make(&dir).map_err(&err)?;
            for (attr, value) in &want {
                set(&dir.join(attr), value).map_err(&err)?;
            }
        }
        Ok(())
    }

    /// NOT_FOUND for a subsystem nvmet does not have.
    fn missing(nqn: &str) -> Error {
        Error::not_found(format!("subsystem {nqn} is not served by nvmet"))
    }
}

#[async_trait::async_trait]
impl export::Target for Nvmet {
    fn terms(&self) -> &'static export::Terms {
        &TERMS
    }

    /// Served whole: namespace 1 enabled, and linked on every port. A
    /// subsystem a create cut short (the driver killed between its steps)
    /// or a fence left off its ports is not, so `ensure` makes it again
    /// (every step of `create` finds what is done and does the rest).
    async fn serves(&self, nqn: &str) -> Result<bool> {
        let ns = self
            .subsystem(nqn)
            .join("namespaces")
            .join(NSID.to_string());
        let links = self.port_links(nqn);
        blocking(format!("look for subsystem {nqn}"), move || {
            let enabled = get(&ns.join("enable")).is_ok_and(|v| v == "1");
            Ok(enabled && links.iter().all(|l| l.exists()))
        })
        .await
    }

    /// Known only through nvmet's debugfs (`<subsystem>/ctrl<N>/hostnqn`);
    /// without it, none are known.
    async fn connected(&self, nqn: &str) -> Result<Option<Vec<String>>> {
        if !self.serves(nqn).await? {
            return Ok(None);
        }
        let debug = PathBuf::from("/sys/kernel/debug/nvmet").join(nqn);
        blocking(format!("list the hosts connected to {nqn}"), move || {
            let mut hosts = Vec::new();
            let Ok(entries) = std::fs::read_dir(&debug) else {
                return Ok(Some(hosts));
            };
            for entry in entries.flatten() {
                if let Ok(host) = get(&entry.path().join("hostnqn")) {
                    if !hosts.contains(&host) {
                        hosts.push(host);
                    }
                }
            }
            Ok(Some(hosts))
        })
        .await
    }

    /// configfs is read afresh at every call: nothing is remembered.
    async fn reread(&self) {}

    async fn create(&self, nqn: &str, backing: &Path) -> Result<()> {
        let (root, ports) = (self.root.clone(), self.ports.clone());
        let (dir, nqn_owned) = (self.subsystem(nqn), nqn.to_string());
        let device = crate::exec::path_arg(backing)?.to_string();
        let (nguid, serial) = identity_for(nqn);
        let what = format!("make subsystem {nqn}");
        let made = blocking(what.clone(), move || {
            let err = io(&what);
            let ns = dir.join("namespaces").join(NSID.to_string());
            make(&dir).map_err(&err)?;
            set(&dir.join("attr_allow_any_host"), "0").map_err(&err)?;
            // Fixed once a host has identified the subsystem: a rebuilt one
            // shows its hosts the same serial and namespace identity.
            let _ = set(&dir.join("attr_serial"), &serial);
            // The model names the driver: a node's udev links the head as
            // /dev/disk/by-id/nvme-ferrovol_<serial>, which lvm's filter
            // leaves out (see the kind's `attaches`).
            let _ = set(&dir.join("attr_model"), MODEL);
            make(&ns).map_err(&err)?;
            if get(&ns.join("enable")).unwrap_or_default() != "1" {
                set(&ns.join("device_path"), &device).map_err(&err)?;
                set(&ns.join("device_uuid"), &uuid_form(&nguid)).map_err(&err)?;
                set(&ns.join("device_nguid"), &uuid_form(&nguid)).map_err(&err)?;
                set(&ns.join("enable"), "1").map_err(&err)?;
            }
            Nvmet::ensure_ports(&root, &ports)?;
            for p in &ports {
                link(&dir, &port_link(&root, p, &nqn_owned)).map_err(&err)?;
            }
            Ok(())
        })
        .await;
        if let Err(e) = made {
            // No half-made subsystem left behind.
            let _ = export::Target::delete(self, nqn).await;
            return Err(e);
        }
        Ok(())
    }

    async fn delete(&self, nqn: &str) -> Result<()> {
        let (dir, links) = (self.subsystem(nqn), self.port_links(nqn));
        let what = format!("remove subsystem {nqn}");
        blocking(what.clone(), move || {
            let err = io(&what);
            if !dir.exists() {
                return Ok(());
            }
            for l in &links {
                unlink(l).map_err(&err)?;
            }
            if let Ok(hosts) = std::fs::read_dir(dir.join("allowed_hosts")) {
                for h in hosts.flatten() {
                    unlink(&h.path()).map_err(&err)?;
                }
            }
            if let Ok(namespaces) = std::fs::read_dir(dir.join("namespaces")) {
                for ns in namespaces.flatten() {
                    let _ = set(&ns.path().join("enable"), "0");
                    unlink(&ns.path()).map_err(&err)?;
                }
            }
            unlink(&dir).map_err(&err)
        })
        .await
    }

    /// nvmet reads the device's size again and tells the connected hosts
    /// (an asynchronous event): it grows under I/O.
    async fn refresh(&self, nqn: &str, _backing: &Path) -> Result<()> {
        let ns = self
            .subsystem(nqn)
            .join("namespaces")
            .join(NSID.to_string());
        if !self.serves(nqn).await? {
            return Err(Self::missing(nqn));
        }
        let what = format!("revalidate the size of {nqn}");
        blocking(what.clone(), move || {
            set(&ns.join("revalidate_size"), "1").map_err(io(&what))
        })
        .await
    }

    async fn grant(&self, nqn: &str, host: &str) -> Result<()> {
        if !self.serves(nqn).await? {
            return Err(Self::missing(nqn));
        }
        let (entry, allowed) = (
            self.host(host),
            self.subsystem(nqn).join("allowed_hosts").join(host),
        );
        let what = format!("allow {host} on {nqn}");
        blocking(what.clone(), move || {
            make(&entry).map_err(io(&what))?;
            link(&entry, &allowed).map_err(io(&what))
        })
        .await
    }

    async fn revoke(&self, nqn: &str, host: &str) -> Result<()> {
        let allowed = self.subsystem(nqn).join("allowed_hosts").join(host);
        let what = format!("disallow {host} on {nqn}");
        blocking(what.clone(), move || unlink(&allowed).map_err(io(&what))).await
    }

    /// Takes the subsystem off every port and puts it back: the kernel
    /// drops every controller of the subsystem on a port it leaves. Where
    /// several hosts share the volume (raw block, many writers), the others
    /// lose their controllers too and connect again by themselves after
    /// their `reconnect_delay`, their I/O held meanwhile (it fails only
    /// after `fast_io_fail_tmo`). How many connections the fenced host had
    /// is not known: 0 is returned.
    async fn disconnect(&self, nqn: &str, host: &str) -> Result<usize> {
        let (dir, links) = (self.subsystem(nqn), self.port_links(nqn));
        if !dir.exists() {
            return Err(Self::missing(nqn));
        }
        let what = format!("drop {host}'s connections to {nqn}");
        blocking(what.clone(), move || {
            for l in &links {
                unlink(l).map_err(io(&what))?;
            }
            for l in &links {
                link(&dir, l).map_err(io(&what))?;
            }
            Ok(0)
        })
        .await
    }

    /// The key a host proves itself with (`outgoing`: the key the
    /// subsystem answers with), on the host's entry: a DH-HMAC-CHAP key is
    /// the host's, whatever subsystem it connects to.
    async fn add_credential(&self, (host, key): &Credential, outgoing: bool) -> Result<()> {
        let attr = if outgoing {
            "dhchap_ctrl_key"
        } else {
            "dhchap_key"
        };
        let (entry, key) = (self.host(host), key.clone());
        // The error never shows the key: configfs refuses one it cannot
        // take with EINVAL, nothing more.
        let what = format!("set the {attr} of host {host}");
        blocking(what.clone(), move || {
            make(&entry).map_err(io(&what))?;
            set(&entry.join(attr), &key).map_err(io(&what))
        })
        .await
    }

    /// The host's entry (and its keys with it), once no subsystem's
    /// allowed hosts link it: not this backend's, nor anyone's. An entry a
    /// subsystem links, the driver's or not, stays as it is.
    async fn forget_host(&self, host: &str) -> Result<bool> {
        let (entry, subsystems) = (self.host(host), self.root.join("subsystems"));
        let host = host.to_string();
        let what = format!("remove the entry of host {host}");
        blocking(what.clone(), move || {
            if !entry.exists() {
                return Ok(false);
            }
            let linked = std::fs::read_dir(&subsystems)
                .map_err(io(&what))?
                .flatten()
                .any(|s| {
                    std::fs::symlink_metadata(s.path().join("allowed_hosts").join(&host)).is_ok()
                });
            if linked {
                return Ok(false);
            }
            unlink(&entry).map_err(io(&what))?;
            Ok(true)
        })
        .await
    }

    /// A host's keys are on its entry, which a grant links.
    async fn bind(&self, _nqn: &str, _user: &str, _outgoing: bool) -> Result<()> {
        Ok(())
    }

    async fn unbind(&self, _nqn: &str, _user: &str, _outgoing: bool) -> Result<()> {
        Ok(())
    }

    async fn set_thin_provisioning(&self, _nqn: &str, _on: bool) -> Result<()> {
        Err(Error::invalid(
            "nvmet serves discards as its device does: thin provisioning is not a setting",
        ))
    }
}

/// 32 hex digits as nvmet takes a NGUID (`8-4-4-4-12`).
fn uuid_form(hex: &str) -> String {
    format!(
        "{}-{}-{}-{}-{}",
        &hex[0..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..32]
    )
}
