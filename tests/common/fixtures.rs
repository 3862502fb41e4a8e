//! In-guest fixtures for backend tests: an LVM volume group on a loop
//! device, a tgtd iSCSI target with an open-iscsi initiator, and a kernel NFS
//! server. Each starts on loopback and is torn down when dropped. They run
//! only inside the real-kernel guest (`tests/guest/suite`).
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Fails unless running in the guest that `tests/guest/suite` boots.
pub fn require_guest() {
    assert_eq!(
        std::env::var("FERROVOL_IN_GUEST").as_deref(),
        Ok("1"),
        "this test needs the real-kernel guest: run it with tests/guest/suite"
    );
    say_panics_at_once();
}

/// Each panic's first line is also written straight to the console (the
/// test harness holds a test's output until the whole suite ends, and a
/// suite cut short by its timeout never prints it): the test's name, where
/// and what, on one line.
fn say_panics_at_once() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let before = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            use std::io::Write;
            let what = info
                .payload()
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| info.payload().downcast_ref::<&str>().copied())
                .unwrap_or("(no message)");
            let what: String = what.chars().take(800).collect();
            let line = format!(
                "PANIC in {} at {}: {}\n",
                std::thread::current().name().unwrap_or("a thread"),
                info.location()
                    .map(|l| format!("{}:{}", l.file(), l.line()))
                    .unwrap_or_default(),
                what.replace('\n', " | ")
            );
            let _ = std::io::stderr().write_all(line.as_bytes());
            before(info);
        }));
    });
}

/// Runs a command, panics with its stderr unless it succeeds, returns stdout.
pub fn run(program: &str, args: &[&str]) -> String {
    let out = Command::new(program)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{program}: {e}"));
    assert!(
        out.status.success(),
        "{program} {args:?} failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Runs a command for cleanup, ignoring failure.
pub fn try_run(program: &str, args: &[&str]) {
    let _ = Command::new(program)
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
}

/// Waits until `check` holds, polling every 50 ms, or panics after `limit`.
pub fn wait_for(what: &str, limit: Duration, mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !check() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The longest a fixture waits for a daemon that is still running to be
/// ready: a wait is bounded by the daemon (one that exits fails it at
/// once, see [`wait_on`]), this only by a daemon that runs and never
/// answers. Generous, since a guest on a busy machine is the first to
/// starve.
pub const DAEMON_BACKSTOP: Duration = Duration::from_secs(900);

/// Waits until `check` holds, polling every 50 ms, while every one of
/// `daemons` (name, pid) runs: one that has exited fails the wait at once,
/// naming it; one that runs on and never gets there fails it after
/// [`DAEMON_BACKSTOP`].
pub fn wait_on(what: &str, daemons: &[(&str, u32)], mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + DAEMON_BACKSTOP;
    loop {
        for (name, pid) in daemons {
            assert!(running(*pid), "waiting for {what}: {name} exited");
        }
        if check() {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "timed out waiting for {what} ({} s, its daemons running)",
            DAEMON_BACKSTOP.as_secs()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Whether process `pid` runs (exists, and is not a zombie).
pub fn running(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        // The state follows the command's closing parenthesis.
        stat.rsplit_once(')')
            .is_some_and(|(_, rest)| !rest.trim_start().starts_with(['Z', 'X']))
    })
}

fn daemon(program: &str, args: &[&str]) -> Child {
    Command::new(program)
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("{program}: {e}"))
}

/// A volume group on a sparse file attached as a loop device.
pub struct LvmVg {
    pub name: String,
    pub device: String,
    pub dir: tempfile::TempDir,
    /// lvm `--config` text every command here uses (empty: none).
    pub config: String,
}

/// lvm settings for the host, whose kernel has no device-mapper: metadata
/// operations only.
pub const LVM_NO_ACTIVATION: &str = "global { activation = 0 }";

impl LvmVg {
    pub fn new(name: &str, size_mib: u64) -> Self {
        Self::with_config(name, size_mib, "")
    }

    pub fn with_config(name: &str, size_mib: u64, config: &str) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let image = dir.path().join("pv.img");
        std::fs::File::create(&image)
            .unwrap()
            .set_len(size_mib << 20)
            .unwrap();
        let device = run("losetup", &["--find", "--show", image.to_str().unwrap()])
            .trim()
            .to_string();
        let vg = LvmVg {
            name: name.into(),
            device,
            dir,
            config: config.into(),
        };
        vg.lvm("pvcreate", &["-q", &vg.device]);
        vg.lvm("vgcreate", &["-q", name, &vg.device]);
        vg
    }

    fn with_cfg<'a>(&'a self, args: &[&'a str]) -> Vec<&'a str> {
        let mut all: Vec<&str> = Vec::new();
        if !self.config.is_empty() {
            all.extend(["--config", self.config.as_str()]);
        }
        all.extend_from_slice(args);
        all
    }

    /// Runs an lvm tool with this VG's config.
    pub fn lvm(&self, tool: &str, args: &[&str]) -> String {
        run(tool, &self.with_cfg(args))
    }

    /// Makes thin pool `pool` of `size` (lvcreate's units) in this VG,
    /// with any further lvcreate arguments.
    pub fn thin_pool(&self, pool: &str, size: &str, extra: &[&str]) {
        let mut args = vec!["-q", "-y", "--type", "thin-pool", "-L", size];
        args.extend_from_slice(extra);
        args.extend(["-n", pool, self.name.as_str()]);
        self.lvm("lvcreate", &args);
    }

    /// The tags of an LV, comma-separated, or None when it does not exist.
    pub fn lv_tags(&self, lv: &str) -> Option<String> {
        let target = format!("{}/{lv}", self.name);
        let out = Command::new("lvs")
            .args(self.with_cfg(&["--noheadings", "-o", "lv_tags", &target]))
            .output()
            .unwrap();
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
    }
}

impl Drop for LvmVg {
    fn drop(&mut self) {
        try_run("vgremove", &self.with_cfg(&["-q", "-y", "-f", &self.name]));
        try_run(
            "pvremove",
            &self.with_cfg(&["-q", "-y", "-ff", &self.device]),
        );
        try_run("losetup", &["-d", &self.device]);
        // Device nodes of the group's that outlive it (lvm makes them
        // itself where it finds no udev, and nothing removes them once the
        // group is gone): stale names a later test would count as maps.
        let prefix = format!("{}-", self.name.replace('-', "--"));
        if let Ok(entries) = std::fs::read_dir("/dev/mapper") {
            for e in entries.flatten() {
                if e.file_name().to_string_lossy().starts_with(&prefix) {
                    let _ = std::fs::remove_file(e.path());
                }
            }
        }
        let _ = std::fs::remove_dir_all(Path::new("/dev").join(&self.name));
    }
}

pub const ISCSI_PORTAL: &str = "127.0.0.1:3260";

/// A tgtd target serving one file-backed LUN, and an iscsid to log in with.
pub struct IscsiTarget {
    pub iqn: String,
    pub dir: tempfile::TempDir,
    tgtd: Child,
    iscsid: Child,
}

impl IscsiTarget {
    pub fn new(iqn: &str, size_mib: u64) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let lun = dir.path().join("lun1.img");
        std::fs::File::create(&lun)
            .unwrap()
            .set_len(size_mib << 20)
            .unwrap();
        let tgtd = daemon("tgtd", &["-f"]);
        wait_on("tgtd", &[("tgtd", tgtd.id())], || {
            Command::new("tgtadm")
                .args(["--lld", "iscsi", "--op", "show", "--mode", "sys"])
                .output()
                .is_ok_and(|o| o.status.success())
        });
        run(
            "tgtadm",
            &[
                "--lld", "iscsi", "--op", "new", "--mode", "target", "--tid", "1", "-T", iqn,
            ],
        );
        run(
            "tgtadm",
            &[
                "--lld",
                "iscsi",
                "--op",
                "new",
                "--mode",
                "logicalunit",
                "--tid",
                "1",
                "--lun",
                "1",
                "-b",
                lun.to_str().unwrap(),
            ],
        );
        run(
            "tgtadm",
            &[
                "--lld", "iscsi", "--op", "bind", "--mode", "target", "--tid", "1", "-I", "ALL",
            ],
        );
        let iscsid = daemon("iscsid", &["-f"]);
        wait_on("iscsid", &[("iscsid", iscsid.id())], || {
            Path::new("/run/iscsid.pid").exists()
                || Command::new("iscsiadm")
                    .args(["-m", "session"])
                    .output()
                    .is_ok_and(|o| o.status.code() != Some(20))
        });
        IscsiTarget {
            iqn: iqn.into(),
            dir,
            tgtd,
            iscsid,
        }
    }

    /// The by-path link of LUN 1 once logged in.
    pub fn lun_path(&self) -> PathBuf {
        PathBuf::from(format!(
            "/dev/disk/by-path/ip-{ISCSI_PORTAL}-iscsi-{}-lun-1",
            self.iqn
        ))
    }

    /// Discovers and logs in; returns the LUN's by-path link when it appears.
    pub fn login(&self) -> PathBuf {
        run(
            "iscsiadm",
            &["-m", "discovery", "-t", "sendtargets", "-p", ISCSI_PORTAL],
        );
        run(
            "iscsiadm",
            &["-m", "node", "-T", &self.iqn, "-p", ISCSI_PORTAL, "--login"],
        );
        let path = self.lun_path();
        wait_for(
            "the iSCSI LUN's by-path link",
            Duration::from_secs(60),
            || path.exists(),
        );
        path
    }

    pub fn logout(&self) {
        run(
            "iscsiadm",
            &[
                "-m",
                "node",
                "-T",
                &self.iqn,
                "-p",
                ISCSI_PORTAL,
                "--logout",
            ],
        );
    }
}

impl Drop for IscsiTarget {
    fn drop(&mut self) {
        try_run(
            "iscsiadm",
            &[
                "-m",
                "node",
                "-T",
                &self.iqn,
                "-p",
                ISCSI_PORTAL,
                "--logout",
            ],
        );
        try_run("iscsiadm", &["-m", "node", "-o", "delete", "-T", &self.iqn]);
        try_run(
            "tgtadm",
            &[
                "--lld", "iscsi", "--op", "delete", "--mode", "target", "--tid", "1", "--force",
            ],
        );
        let _ = self.iscsid.kill();
        let _ = self.iscsid.wait();
        let _ = self.tgtd.kill();
        let _ = self.tgtd.wait();
    }
}

/// The kernel NFS server exporting a tmpfs folder: NFSv4 only without
/// rpcbind (the folder is the NFSv4 root), or, with [`NfsServer::with_v3`],
/// NFSv3 as well, with rpcbind and mountd serving it.
pub struct NfsServer {
    pub export: PathBuf,
    pub dir: tempfile::TempDir,
    mountd: Child,
    rpcbind: Option<Child>,
    /// The loop device of an XFS or btrfs export, when it has one.
    loop_dev: Option<String>,
}

/// An nfs backend on an [`NfsServer`]'s export, over NFSv4.2 on loopback.
pub const NFS_LOOPBACK_CONFIG: &str = "[[backend]]\ntype = \"nfs\"\n\
    [[backend.export]]\nname = \"main\"\nserver = \"127.0.0.1\"\nshare = \"/\"\nversion = \"4.2\"\n";

impl NfsServer {
    pub fn new() -> Self {
        Self::start_server(false, None)
    }

    /// NFSv3 and v4 (v3 needs rpcbind; clients mount with `nolock`).
    pub fn with_v3() -> Self {
        Self::start_server(true, None)
    }

    /// NFSv4, exporting an XFS filesystem mounted with project quotas.
    pub fn on_xfs_with_quotas() -> Self {
        Self::start_server(false, Some("xfs"))
    }

    /// NFSv4, exporting a btrfs filesystem.
    pub fn on_btrfs() -> Self {
        Self::start_server(false, Some("btrfs"))
    }

    fn start_server(v3: bool, fs: Option<&str>) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let export = dir.path().join("export");
        std::fs::create_dir_all(&export).unwrap();
        let loop_dev = fs.map(|fs| {
            let image = dir.path().join(format!("{fs}.img"));
            std::fs::File::create(&image)
                .unwrap()
                .set_len(512 << 20)
                .unwrap();
            let dev = run("losetup", &["-f", "--show", image.to_str().unwrap()])
                .trim()
                .to_string();
            let options = if fs == "xfs" {
                run("mkfs.xfs", &["-q", &dev]);
                "prjquota"
            } else {
                run("mkfs.btrfs", &["-q", &dev]);
                "defaults"
            };
            run("mount", &["-o", options, &dev, export.to_str().unwrap()]);
            dev
        });
        if !Path::new("/proc/fs/nfsd/versions").exists() {
            run("mount", &["-t", "nfsd", "nfsd", "/proc/fs/nfsd"]);
        }
        let rpcbind = v3.then(|| {
            std::fs::create_dir_all("/run/rpcbind").unwrap();
            let child = daemon("rpcbind", &["-f", "-w"]);
            wait_on("rpcbind", &[("rpcbind", child.id())], || {
                std::process::Command::new("rpcinfo")
                    .args(["-p", "127.0.0.1"])
                    .output()
                    .is_ok_and(|o| o.status.success())
            });
            child
        });
        // Loopback, and the private network a peer guest is on.
        let line = format!(
            "{0} 127.0.0.1(rw,no_root_squash,insecure,fsid=0,no_subtree_check) \
             10.0.0.0/24(rw,no_root_squash,insecure,fsid=0,no_subtree_check)\n",
            export.display()
        );
        std::fs::write("/etc/exports", line).unwrap();
        run("exportfs", &["-ra"]);
        let mountd = if v3 {
            daemon("rpc.mountd", &["--foreground", "--no-udp"])
        } else {
            daemon("rpc.mountd", &["--foreground", "--no-udp", "-N", "3"])
        };
        let server = NfsServer {
            export,
            dir,
            mountd,
            rpcbind,
            loop_dev,
        };
        server.start();
        server
    }

    /// Stops the server (the kernel's nfsd threads): clients stop getting
    /// answers.
    pub fn stop(&self) {
        run("rpc.nfsd", &["0"]);
    }

    /// Starts it again.
    pub fn start(&self) {
        if self.rpcbind.is_some() {
            run("rpc.nfsd", &["--no-udp", "4"]);
        } else {
            run("rpc.nfsd", &["--no-nfs-version", "3", "--no-udp", "4"]);
        }
    }

    /// The NFSv4 source for the export's root.
    pub fn source(&self) -> &'static str {
        "127.0.0.1:/"
    }
}

impl Drop for NfsServer {
    fn drop(&mut self) {
        try_run("rpc.nfsd", &["0"]);
        try_run("exportfs", &["-ua"]);
        let _ = self.mountd.kill();
        let _ = self.mountd.wait();
        if let Some(mut r) = self.rpcbind.take() {
            let _ = r.kill();
            let _ = r.wait();
        }
        if let Some(dev) = self.loop_dev.take() {
            try_run("umount", &[self.export.to_str().unwrap()]);
            try_run("losetup", &["-d", &dev]);
        }
    }
}

/// The memstore OSD's size, as it tells the monitor: 16 GiB, none of it
/// taken until written. memstore counts an object as long as its last
/// written byte (32 writes of 4 KiB at random offsets of a 1 GiB image,
/// 128 KiB of data, counted 68 MiB), so a 1 GiB store was called full
/// (95%) after a few dozen volumes had an ext4 made and written on them,
/// with a few MiB of the guest's memory in use; the pool full, the OSD
/// drops a write a client sends anyway (the driver's record of making,
/// a class call librados sends as a read). That is most likely what
/// every rbd test after one CI run's fault tests (2026-12-02) timed out
/// on: that write, while reads of the same object answered. (Between
/// the tests of a whole run the store held at most 15 MiB: the peak
/// within a test is not known.)
const MEMSTORE_BYTES: u64 = 16 << 30;

/// A single-node Ceph cluster: one monitor and one in-memory (memstore) OSD
/// on loopback, cephx on, an `rbd` pool of size 1, and a client key
/// (`client.ferrovol`) limited to that pool.
pub struct CephCluster {
    pub dir: tempfile::TempDir,
    pub conf: PathBuf,
    pub client_keyring: PathBuf,
    pub mon_addr: String,
    pub pool: &'static str,
    mon: Child,
    osd: Option<Child>,
    /// The manager: usage figures (`ceph df`) come from it.
    mgr: Option<Child>,
    /// The admin commands' one connection (tests/common/ceph-admin),
    /// started at the first command.
    admin: std::sync::Mutex<Option<CephAdmin>>,
}

/// tests/common/ceph-admin: `ceph` command lines through one Python and
/// one cluster connection.
struct CephAdmin {
    child: Child,
    to: std::process::ChildStdin,
    from: std::io::BufReader<std::process::ChildStdout>,
}

impl CephAdmin {
    fn start(conf: &Path) -> Self {
        let mut child = Command::new(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/common/ceph-admin"
        ))
        .arg(conf)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("tests/common/ceph-admin: {e}"));
        let to = child.stdin.take().unwrap();
        let from = std::io::BufReader::new(child.stdout.take().unwrap());
        CephAdmin { child, to, from }
    }

    /// The command's answer: None when ceph-admin does not know it.
    fn ask(&mut self, args: &[&str]) -> Option<Result<String, String>> {
        use std::io::{BufRead, Write};
        let line = serde_json::to_string(args).unwrap();
        writeln!(self.to, "{line}").expect("ceph-admin: write");
        let mut answer = String::new();
        self.from.read_line(&mut answer).expect("ceph-admin: read");
        assert!(!answer.is_empty(), "ceph-admin ended (see its stderr)");
        let v: serde_json::Value = serde_json::from_str(&answer).unwrap();
        let out = v["out"].as_str().unwrap_or_default().to_string();
        match v["rc"].as_i64() {
            None => None,
            Some(0) => Some(Ok(out)),
            Some(rc) => Some(Err(format!(
                "ceph {args:?} failed ({rc}): {}",
                v["err"].as_str().unwrap_or_default()
            ))),
        }
    }
}

impl Drop for CephAdmin {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn uuid() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/uuid")
        .unwrap()
        .trim()
        .to_string()
}

/// After each panic of a test while the shared cluster is there (and free:
/// the test's own ask for it says more), the cluster at a glance
/// ([`CephCluster::at_a_glance`]) on a line of its own that begins
/// `the shared Ceph cluster at this panic:` (tests/run gathers those),
/// asked from a thread of its own within 90 s.
fn say_the_shared_cluster_at_each_panic() {
    use std::sync::atomic::{AtomicBool, Ordering};
    static ASKING: AtomicBool = AtomicBool::new(false);
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        previous(info);
        let cluster = match SHARED_CEPH.try_lock() {
            Ok(shared) => *shared,
            Err(std::sync::TryLockError::Poisoned(e)) => *e.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => None,
        };
        let Some(cluster) = cluster else { return };
        // Not for a panic of the asking thread itself, nor two at a time.
        if ASKING.swap(true, Ordering::SeqCst) {
            return;
        }
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(cluster.at_a_glance());
        });
        let said = rx
            .recv_timeout(Duration::from_secs(90))
            .unwrap_or_else(|e| format!("no answer ({e})"));
        // Straight to the console, as the panic's own line
        // (say_panics_at_once).
        let line = format!(
            "the shared Ceph cluster at this panic: {}\n",
            said.replace('\n', " | ")
        );
        let _ = std::io::Write::write_all(&mut std::io::stderr(), line.as_bytes());
        ASKING.store(false, Ordering::SeqCst);
    }));
}

/// A Ceph daemon's admin socket's answer to a command of no arguments
/// (its JSON), within 20 s.
fn admin_socket(path: &Path, prefix: &str) -> Result<serde_json::Value, String> {
    use std::io::{Read, Write};
    let fail = |e: std::io::Error| format!("{}: {e}", path.display());
    let mut s = std::os::unix::net::UnixStream::connect(path).map_err(fail)?;
    s.set_read_timeout(Some(Duration::from_secs(20)))
        .map_err(fail)?;
    s.set_write_timeout(Some(Duration::from_secs(20)))
        .map_err(fail)?;
    s.write_all(format!("{{\"prefix\": \"{prefix}\"}}\0").as_bytes())
        .map_err(fail)?;
    let mut len = [0u8; 4];
    s.read_exact(&mut len).map_err(fail)?;
    let mut body = vec![0u8; u32::from_be_bytes(len) as usize];
    s.read_exact(&mut body).map_err(fail)?;
    serde_json::from_slice(&body).map_err(|e| e.to_string())
}

/// The cluster [`CephCluster::shared`] hands out (leaked: its daemons live
/// as long as the process, or until it is let go).
static SHARED_CEPH: std::sync::Mutex<Option<&'static CephCluster>> = std::sync::Mutex::new(None);

impl CephCluster {
    pub fn new() -> Self {
        Self::on("127.0.0.1")
    }

    /// One cluster for every test of this process that asks (the guest's
    /// tests run one at a time; a guest starts a cluster in a minute or
    /// more), its `rbd` pool empty when handed out: a pool a failed test
    /// left images, trash or records in is made anew first. Its daemons
    /// live as long as the process. It serves on the private network when
    /// this guest has a peer (so the peer's driver reaches it too), on
    /// loopback otherwise. A test that stops or reconfigures daemons takes
    /// a cluster of its own.
    pub fn shared() -> &'static CephCluster {
        // A cluster found unable to take a write is let go (its daemons
        // stopped, its folder removed) and the test that found it fails,
        // saying what the cluster said; the next test gets a new one, so
        // that what one test did to the cluster fails that test only.
        static HOOK: std::sync::Once = std::sync::Once::new();
        HOOK.call_once(say_the_shared_cluster_at_each_panic);
        let mut shared = SHARED_CEPH.lock().unwrap_or_else(|e| e.into_inner());
        let cluster = *shared.get_or_insert_with(|| {
            let private = super::peer::MAIN_ADDR;
            let addresses = Command::new("ip")
                .args(["-o", "-4", "addr", "show"])
                .output()
                .map(|o| String::from_utf8_lossy(&o.stdout).to_string())
                .unwrap_or_default();
            Box::leak(Box::new(
                match addresses.contains(&format!(" {private}/")) {
                    true => CephCluster::on(private),
                    false => CephCluster::new(),
                },
            ))
        });
        let gone: Vec<_> = cluster
            .daemon_pids()
            .into_iter()
            .filter(|(_, pid)| !running(*pid))
            .collect();
        let broken = match gone.is_empty() {
            true => cluster.write_probe().err(),
            false => Some(format!("its daemons exited: {gone:?}")),
        };
        if let Some(why) = broken {
            let said = cluster.diagnosis();
            *shared = None;
            cluster.stop_and_remove();
            panic!("the shared Ceph cluster is broken ({why}); a new one is made for the next test.\n{said}");
        }
        let left = cluster.pool_contents();
        if !left.is_empty() {
            println!("the shared Ceph cluster's pool is made anew: it held {left:?}");
            cluster.renew_pool();
        }
        cluster
    }

    /// Stops the shared cluster, if there is one, and removes its folder;
    /// the next [`CephCluster::shared`] makes another. In the guest the
    /// cluster goes with the guest; a test on the host lets it go itself
    /// (its daemons would outlive the test process).
    #[allow(dead_code)] // the host's tests; not every test binary uses it
    pub fn let_go_of_shared() {
        let mut shared = SHARED_CEPH.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(cluster) = shared.take() {
            cluster.stop_and_remove();
        }
    }

    /// One line of what the cluster says of itself now, each part within
    /// about 30 s: its health checks (but those every cluster of these
    /// tests has), the map's and the pool's flags, the space used, the
    /// placement groups' states and the OSD's oldest operations in
    /// flight. Through the admin's connection when no one else holds it,
    /// and the OSD's admin socket; a part that cannot be had says why.
    pub fn at_a_glance(&self) -> String {
        let ask = |args: &[&str]| -> Result<serde_json::Value, String> {
            let mut all = args.to_vec();
            all.extend_from_slice(&["--format", "json"]);
            let mut admin = self
                .admin
                .try_lock()
                .map_err(|_| "the admin connection is busy".to_string())?;
            let out = admin
                .get_or_insert_with(|| CephAdmin::start(&self.conf))
                .ask(&all)
                .ok_or("not the admin's")??;
            serde_json::from_str(&out).map_err(|e| e.to_string())
        };
        let mut parts = Vec::new();
        parts.push(match ask(&["health", "detail"]) {
            Ok(v) => {
                let usual = [
                    "AUTH_INSECURE_GLOBAL_ID_RECLAIM_ALLOWED",
                    "MGR_MODULE_ERROR",
                    "MON_MSGR2_NOT_ENABLED",
                    "POOL_NO_REDUNDANCY",
                ];
                let checks: Vec<String> = v["checks"]
                    .as_object()
                    .into_iter()
                    .flatten()
                    .filter(|(name, _)| !usual.contains(&name.as_str()))
                    .map(|(name, c)| {
                        format!("{name}: {}", c["summary"]["message"].as_str().unwrap_or(""))
                    })
                    .collect();
                format!("health {} {checks:?}", v["status"].as_str().unwrap_or("?"))
            }
            Err(e) => format!("health: {e}"),
        });
        parts.push(match ask(&["osd", "dump"]) {
            Ok(v) => {
                let pools: Vec<String> = v["pools"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(|p| {
                        format!(
                            "{} {}",
                            p["pool_name"].as_str().unwrap_or("?"),
                            p["flags_names"].as_str().unwrap_or("?")
                        )
                    })
                    .collect();
                format!(
                    "osdmap e{} flags {}, pools {pools:?}, OSDs up {}",
                    v["epoch"],
                    v["flags"].as_str().unwrap_or("?"),
                    v["osds"]
                        .as_array()
                        .map_or(0, |o| o.iter().filter(|o| o["up"] == 1).count())
                )
            }
            Err(e) => format!("osd dump: {e}"),
        });
        parts.push(match ask(&["df"]) {
            Ok(v) => format!(
                "used {} of {} MiB",
                v["stats"]["total_used_raw_bytes"].as_u64().unwrap_or(0) >> 20,
                v["stats"]["total_bytes"].as_u64().unwrap_or(0) >> 20
            ),
            Err(e) => format!("df: {e}"),
        });
        parts.push(match ask(&["pg", "dump", "pgs_brief"]) {
            Ok(v) => {
                let mut states = std::collections::BTreeMap::new();
                let list = v["pg_stats"]
                    .as_array()
                    .or(v.as_array())
                    .cloned()
                    .unwrap_or_default();
                for pg in list {
                    *states
                        .entry(pg["state"].as_str().unwrap_or("?").to_string())
                        .or_insert(0) += 1;
                }
                format!("placement groups {states:?}")
            }
            Err(e) => format!("pg dump: {e}"),
        });
        parts.push(
            match admin_socket(
                &self.dir.path().join("run/osd.0.asok"),
                "dump_ops_in_flight",
            ) {
                Ok(v) => {
                    let mut ops = v["ops"].as_array().cloned().unwrap_or_default();
                    ops.sort_by(|a, b| {
                        b["age"]
                            .as_f64()
                            .partial_cmp(&a["age"].as_f64())
                            .unwrap_or(std::cmp::Ordering::Equal)
                    });
                    let oldest: Vec<String> = ops
                        .iter()
                        .take(3)
                        .map(|op| {
                            let events = op["type_data"]["events"].as_array();
                            format!(
                                "{:.1} s {} ({}, last {})",
                                op["age"].as_f64().unwrap_or(0.0),
                                op["description"].as_str().unwrap_or("?"),
                                op["type_data"]["flag_point"].as_str().unwrap_or("?"),
                                events
                                    .and_then(|e| e.last())
                                    .and_then(|e| e["event"].as_str())
                                    .unwrap_or("?")
                            )
                        })
                        .collect();
                    format!("OSD ops in flight {}: {oldest:?}", ops.len())
                }
                Err(e) => format!("OSD ops in flight: {e}"),
            },
        );
        parts.join("; ")
    }

    /// Writes and removes an object in each of the pool's placement groups
    /// and an attribute of the driver's record of making, through the
    /// admin's connection (no process to start), each within 25 s: an
    /// error when the cluster does not take them (its OSD down, a full or
    /// paused cluster, a placement group inactive, a write to the record
    /// stuck). The test's output says how much of the store is used.
    fn write_probe(&self) -> Result<(), String> {
        match self.ask_admin(&["--write-probe", self.pool]) {
            Some(Ok(used)) => {
                let mib: Vec<u64> = used.split(' ').filter_map(|n| n.parse().ok()).collect();
                println!(
                    "the shared Ceph cluster took the write probe; {} of {} MiB used, as its OSD counts",
                    mib.first().unwrap_or(&0),
                    mib.get(1).unwrap_or(&0)
                );
                Ok(())
            }
            Some(Err(e)) => Err(e),
            None => Err("tests/common/ceph-admin did not take the write probe".into()),
        }
    }

    /// What the cluster and this machine say of the cluster, each answer
    /// within 30 s: its status, flags, blocklist and placement groups, the
    /// machine's firewall rules and free memory, the OSD log's end.
    fn diagnosis(&self) -> String {
        let conf = self.conf.to_str().unwrap();
        let mut said = String::new();
        let mut ask = |what: &str, program: &str, args: &[&str]| {
            let out = Command::new("timeout")
                .arg("30")
                .arg(program)
                .args(args)
                .output();
            let text = match out {
                Ok(o) => format!(
                    "{}{}",
                    String::from_utf8_lossy(&o.stdout),
                    String::from_utf8_lossy(&o.stderr)
                ),
                Err(e) => e.to_string(),
            };
            said.push_str(&format!("--- {what}:\n{}\n", text.trim_end()));
        };
        for (what, args) in [
            ("ceph health detail", &["health", "detail"][..]),
            ("ceph -s", &["-s"]),
            ("ceph osd dump", &["osd", "dump"]),
            ("ceph osd blocklist ls", &["osd", "blocklist", "ls"]),
            ("ceph pg dump pgs_brief", &["pg", "dump", "pgs_brief"]),
            ("ceph df", &["df"]),
        ] {
            let mut all = vec!["-c", conf, "--connect-timeout", "25"];
            all.extend_from_slice(args);
            ask(what, "ceph", &all);
        }
        ask("nft list ruleset", "nft", &["list", "ruleset"]);
        ask(
            "memory",
            "grep",
            &["-E", "MemTotal|MemAvailable", "/proc/meminfo"],
        );
        let log = self.dir.path().join("osd.0.log");
        ask(
            "the OSD log's end",
            "tail",
            &["-n", "30", log.to_str().unwrap()],
        );
        said
    }

    /// Stops the daemons of a cluster that is never dropped (the shared
    /// one) and removes its folder (its store is in memory; the folder
    /// holds the monitor's store and the logs).
    fn stop_and_remove(&self) {
        drop(self.admin.lock().unwrap_or_else(|e| e.into_inner()).take());
        for (_, pid) in self.daemon_pids() {
            try_run("kill", &["-9", &pid.to_string()]);
        }
        for (_, pid) in self.daemon_pids() {
            wait_for("a Ceph daemon killed", Duration::from_secs(30), || {
                !running(pid)
            });
        }
        let _ = std::fs::remove_dir_all(self.dir.path());
    }

    /// What the pool holds (as `namespace/object`) but the objects of an
    /// empty rbd pool: an image, anything in its trash, a record in
    /// ferrovol's record of images being made, in any namespace. Listed
    /// through the admin's connection (no `rados` or `rbd` process).
    fn pool_contents(&self) -> Vec<String> {
        match self.ask_admin(&["--pool-contents", self.pool]) {
            Some(Ok(left)) => left.lines().map(str::to_string).collect(),
            Some(Err(e)) => panic!("{e}"),
            None => panic!("tests/common/ceph-admin did not list the pool"),
        }
    }

    /// Deletes the pool and makes it again, initialized for rbd (the
    /// client's caps name it, so they hold).
    fn renew_pool(&self) {
        let pool = self.pool;
        self.ceph(&[
            "osd",
            "pool",
            "rm",
            pool,
            pool,
            "--yes-i-really-really-mean-it",
        ]);
        self.make_pool();
    }

    /// The `rbd` pool, initialized, once the manager reports its figures.
    fn make_pool(&self) {
        self.ceph(&["osd", "pool", "create", self.pool, "8"]);
        run(
            "rbd",
            &["-c", self.conf.to_str().unwrap(), "pool", "init", self.pool],
        );
        // Usage figures reach `ceph df` once the manager has heard from
        // the OSD about the pool.
        let daemons = self.daemon_pids();
        wait_on("the manager's pool figures", &daemons, || {
            let df: serde_json::Value =
                serde_json::from_str(&self.ceph(&["df", "--format", "json"])).unwrap_or_default();
            df["pools"].as_array().is_some_and(|p| {
                p.iter()
                    .any(|p| p["name"] == self.pool && p["stats"]["max_avail"].as_u64() > Some(0))
            })
        });
    }

    /// Runs `rados` as the admin against this cluster.
    pub fn rados(&self, args: &[&str]) -> String {
        let mut all = vec!["-c", self.conf.to_str().unwrap()];
        all.extend_from_slice(args);
        run("rados", &all)
    }

    /// A cluster whose monitor and OSD serve on `addr` (the private
    /// network's address, for a peer guest to reach).
    pub fn on(addr: &str) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().to_path_buf();
        let d = d.as_path();
        for sub in ["mon", "osd", "mgr", "mgr-modules", "run"] {
            std::fs::create_dir_all(d.join(sub)).unwrap();
        }
        let fsid = uuid();
        let mon_addr = format!("{addr}:{}", super::free_port());
        let public = if addr == "127.0.0.1" {
            String::new()
        } else {
            format!("public addr = {addr}\n")
        };
        let conf = d.join("ceph.conf");
        let admin = d.join("admin.keyring");
        // The manager keeps its cluster log to itself (the monitor stored
        // each entry it sent in its consensus store): an idle cluster's
        // daemons used 4.3 s of CPU a minute against 5.1 in the guest
        // (2026-12-03), the monitor 1.6 against 2.4.
        std::fs::write(
            &conf,
            format!(
                "[global]\nfsid = {fsid}\nmon host = v1:{mon_addr}\nmon initial members = a\n{public}\
                 auth cluster required = cephx\nauth service required = cephx\nauth client required = cephx\n\
                 osd pool default size = 1\nosd pool default min size = 1\nmon allow pool size one = true\n\
                 mon allow pool delete = true\nosd objectstore = memstore\nmemstore device bytes = {device_bytes}\n\
                 osd crush chooseleaf type = 0\nms bind ipv6 = false\nrun dir = {run}\nlog file = {dir}/$name.log\n\
                 admin socket = {run}/$name.asok\nkeyring = {admin}\n\
                 mgr stats period = 1\nmgr initial modules = \nmgr module path = {modules}\n\
                 [mon.a]\nmon data = {dir}/mon\n[osd.0]\nosd data = {dir}/osd\nkeyring = {dir}/osd/keyring\n\
                 [mgr.x]\nmgr data = {dir}/mgr\nkeyring = {dir}/mgr/keyring\nclog to monitors = false\n",
                run = d.join("run").display(),
                device_bytes = MEMSTORE_BYTES,
                // An empty folder: the manager serves `ceph df` (the rbd
                // backend's capacity) from its core, and none of its Python
                // modules serves anything here; it imports every one it
                // finds at start, which was most of a cluster's start under
                // the guest's emulation (4.3 s of CPU of the host's 4.6,
                // 0.07 s without).
                modules = d.join("mgr-modules").display(),
                dir = d.display(),
                admin = admin.display(),
            ),
        )
        .unwrap();
        let c = conf.to_str().unwrap().to_string();
        let mon_keyring = d.join("mon.keyring");
        let (mk, ak) = (mon_keyring.to_str().unwrap(), admin.to_str().unwrap());
        run(
            "ceph-authtool",
            &[
                "--create-keyring",
                mk,
                "--gen-key",
                "-n",
                "mon.",
                "--cap",
                "mon",
                "allow *",
            ],
        );
        run(
            "ceph-authtool",
            &[
                "--create-keyring",
                ak,
                "--gen-key",
                "-n",
                "client.admin",
                "--cap",
                "mon",
                "allow *",
                "--cap",
                "osd",
                "allow *",
                "--cap",
                "mgr",
                "allow *",
            ],
        );
        run("ceph-authtool", &[mk, "--import-keyring", ak]);
        let monmap = d.join("monmap");
        run(
            "monmaptool",
            &[
                "--create",
                "--add",
                "a",
                &format!("v1:{mon_addr}"),
                "--fsid",
                &fsid,
                monmap.to_str().unwrap(),
            ],
        );
        run(
            "ceph-mon",
            &[
                "-c",
                &c,
                "--mkfs",
                "-i",
                "a",
                "--monmap",
                monmap.to_str().unwrap(),
                "--keyring",
                mk,
            ],
        );
        let mon = daemon("ceph-mon", &["-c", &c, "-i", "a", "-f"]);
        let mut cluster = CephCluster {
            dir,
            conf: conf.clone(),
            client_keyring: d.join("client.ferrovol.keyring"),
            mon_addr,
            pool: "rbd",
            mon,
            osd: None,
            mgr: None,
            admin: Default::default(),
        };
        let osd_uuid = uuid();
        let id = cluster.ceph(&["osd", "create", &osd_uuid]);
        assert_eq!(id.trim(), "0");
        run(
            "ceph-osd",
            &[
                "-c",
                &c,
                "-i",
                "0",
                "--mkfs",
                "--mkkey",
                "--osd-uuid",
                &osd_uuid,
                "--no-mon-config",
            ],
        );
        let osd_keyring = d.join("osd/keyring");
        cluster.ceph(&[
            "auth",
            "add",
            "osd.0",
            "osd",
            "allow *",
            "mon",
            "allow profile osd",
            "-i",
            osd_keyring.to_str().unwrap(),
        ]);
        cluster.osd = Some(daemon("ceph-osd", &["-c", &c, "-i", "0", "-f"]));
        // An idle guest has it up in seconds; a busy machine's guest takes
        // as long as it takes while the daemons run.
        let daemons = cluster.daemon_pids();
        wait_on("the OSD to come up", &daemons, || {
            cluster.ceph(&["osd", "stat"]).contains("1 up")
        });
        let mgr_keyring = d.join("mgr/keyring");
        cluster.ceph(&[
            "auth",
            "get-or-create",
            "mgr.x",
            "mon",
            "allow profile mgr",
            "osd",
            "allow *",
            "-o",
            mgr_keyring.to_str().unwrap(),
        ]);
        cluster.mgr = Some(daemon("ceph-mgr", &["-c", &c, "-i", "x", "-f"]));
        cluster.make_pool();
        let client = cluster.client_keyring.to_str().unwrap().to_string();
        cluster.ceph(&[
            "auth",
            "get-or-create",
            "client.ferrovol",
            "mon",
            "profile rbd",
            "osd",
            "profile rbd pool=rbd",
            "-o",
            &client,
        ]);
        cluster
    }

    /// Runs a `ceph` command line as the admin against this cluster (as
    /// [`run`]: panics unless it succeeds), through ceph-admin's one
    /// connection; one it does not know through the `ceph` tool.
    pub fn ceph(&self, args: &[&str]) -> String {
        match self.ask_admin(args) {
            Some(Ok(out)) => out,
            Some(Err(e)) => panic!("{e}"),
            None => {
                let mut all = vec!["-c", self.conf.to_str().unwrap(), "--connect-timeout", "30"];
                all.extend_from_slice(args);
                run("ceph", &all)
            }
        }
    }

    /// The admin connection's answer to `args` (None: not its to answer).
    fn ask_admin(&self, args: &[&str]) -> Option<Result<String, String>> {
        let mut admin = self.admin.lock().unwrap_or_else(|e| e.into_inner());
        admin
            .get_or_insert_with(|| CephAdmin::start(&self.conf))
            .ask(args)
    }

    /// Runs `rbd` as `client.ferrovol`.
    pub fn rbd(&self, args: &[&str]) -> String {
        let mut all = vec![
            "-c",
            self.conf.to_str().unwrap(),
            "--id",
            "ferrovol",
            "--keyring",
            self.client_keyring.to_str().unwrap(),
        ];
        all.extend_from_slice(args);
        run("rbd", &all)
    }

    /// The daemons by name and pid, for [`wait_on`].
    fn daemon_pids(&self) -> Vec<(&'static str, u32)> {
        let mut out = vec![("ceph-mon", self.mon.id())];
        out.extend(self.osd.iter().map(|c| ("ceph-osd", c.id())));
        out.extend(self.mgr.iter().map(|c| ("ceph-mgr", c.id())));
        out
    }

    /// The daemons' pids (monitor, OSD, manager).
    #[allow(dead_code)] // the bench's; not every test binary uses it
    pub fn pids(&self) -> Vec<u32> {
        std::iter::once(self.mon.id())
            .chain(self.osd.iter().map(|c| c.id()))
            .chain(self.mgr.iter().map(|c| c.id()))
            .collect()
    }

    /// The client key itself (a cephx secret).
    pub fn client_key(&self) -> String {
        let text = std::fs::read_to_string(&self.client_keyring).unwrap();
        text.lines()
            .find_map(|l| l.trim().strip_prefix("key = "))
            .expect("key in keyring")
            .to_string()
    }

    /// An rbd backend table on this cluster's `rbd` pool, with the client
    /// user's keyring as the driver's own credentials.
    pub fn backend_config(&self, cluster_id: &str) -> String {
        format!(
            "[[backend]]\ntype = \"rbd\"\ncluster_id = \"{cluster_id}\"\nmonitors = [\"v1:{}\"]\n\
             pools = [\"rbd\"]\nuser = \"ferrovol\"\nkeyring = \"{}\"\n",
            self.mon_addr,
            self.client_keyring.display()
        )
    }

    /// The CSI secrets a call carries for the client user.
    pub fn secrets(&self) -> std::collections::HashMap<String, String> {
        std::collections::HashMap::from([
            ("userID".to_string(), "ferrovol".to_string()),
            ("userKey".to_string(), self.client_key()),
        ])
    }
}

impl Drop for CephCluster {
    fn drop(&mut self) {
        // Its connection first, while the monitor answers.
        drop(self.admin.lock().unwrap_or_else(|e| e.into_inner()).take());
        for mut child in [self.mgr.take(), self.osd.take()].into_iter().flatten() {
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = self.mon.kill();
        let _ = self.mon.wait();
    }
}

/// A tgtd of its own (control port and iSCSI port chosen free), for the
/// iscsi backend to drive. Works on the host (tgtd is user space) and in
/// the guest.
pub struct Tgtd {
    pub control_port: u32,
    pub port: u16,
    /// The address its portal listens on.
    pub addr: &'static str,
    child: Option<Child>,
}

impl Tgtd {
    /// An iscsi backend's config for this tgtd, its LUNs in a file store
    /// in the test's folder, its targets named under `prefix`.
    pub fn file_store_config(&self, prefix: &str) -> String {
        format!(
            "[[backend]]\ntype = \"iscsi\"\niqn_prefix = \"{prefix}\"\nportals = [\"{}\"]\n\
             control_port = {}\n[backend.store]\ntype = \"file\"\npool = \"@DIR@/pool\"\n",
            self.portal(),
            self.control_port
        )
    }

    /// A tgtd on a control port of this test process's own. tgtadm takes
    /// control ports up to 32767 only; a tgtd that cannot have its port
    /// (another process's tgtd holds it) makes way for the next one.
    pub fn new() -> Self {
        Self::on("127.0.0.1")
    }

    /// A tgtd whose portal listens on `addr` (the private network's
    /// address, for a peer guest to reach).
    pub fn on(addr: &'static str) -> Self {
        // Unique per test process and per fixture (tests run in parallel).
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let base = 1000 + (std::process::id() % 3000) * 8;
        let mut failures = Vec::new();
        for _ in 0..8 {
            let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let mut t = Tgtd {
                control_port: base + n % 8,
                port: super::free_port(),
                addr,
                child: None,
            };
            match t.try_start() {
                Ok(()) => return t,
                Err(e) => failures.push(e),
            }
        }
        panic!("no tgtd started:\n{}", failures.join("\n"));
    }

    pub fn portal(&self) -> String {
        format!("{}:{}", self.addr, self.port)
    }

    /// tgtd's process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    pub fn tgtadm(&self, args: &[&str]) -> String {
        let c = self.control_port.to_string();
        let mut all = vec!["-C", c.as_str(), "--lld", "iscsi"];
        all.extend_from_slice(args);
        run("tgtadm", &all)
    }

    /// Target `tid` named `iqn`, serving the file `backing` as its LUN 1,
    /// made by hand (two tgtadm calls; no initiator is allowed yet).
    pub fn serve(&self, tid: &str, iqn: &str, backing: &str) {
        self.tgtadm(&["--op", "new", "--mode", "target", "--tid", tid, "-T", iqn]);
        self.tgtadm(&[
            "--op",
            "new",
            "--mode",
            "logicalunit",
            "--tid",
            tid,
            "--lun",
            "1",
            "-b",
            backing,
        ]);
    }

    /// Starts tgtd (again) on this fixture's ports and waits until it
    /// answers on its control port.
    pub fn start(&mut self) {
        if let Err(e) = self.try_start() {
            panic!("{e}");
        }
    }

    /// Starts tgtd; an error says what it printed if it exited. One that
    /// runs but never answers fails the test with what tgtadm said.
    fn try_start(&mut self) -> Result<(), String> {
        let log = tempfile::NamedTempFile::new().unwrap();
        let mut child = Command::new("tgtd")
            .args([
                "-f",
                "-C",
                &self.control_port.to_string(),
                "--iscsi",
                &format!("portal={}:{}", self.addr, self.port),
            ])
            .stdout(Stdio::null())
            .stderr(log.reopen().unwrap())
            .spawn()
            .expect("tgtd");
        let c = self.control_port.to_string();
        let printed = || std::fs::read_to_string(log.path()).unwrap_or_default();
        let deadline = Instant::now() + DAEMON_BACKSTOP;
        loop {
            if let Some(status) = child.try_wait().unwrap() {
                return Err(format!("tgtd -C {c} exited with {status}:\n{}", printed()));
            }
            let out = Command::new("tgtadm")
                .args(["-C", &c, "--lld", "iscsi", "--op", "show", "--mode", "sys"])
                .output()
                .unwrap();
            if out.status.success() {
                self.child = Some(child);
                return Ok(());
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!(
                    "tgtd -C {c} runs and did not answer in {} s; tgtadm: {} {}\ntgtd printed:\n{}",
                    DAEMON_BACKSTOP.as_secs(),
                    out.status,
                    String::from_utf8_lossy(&out.stderr),
                    printed()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Kills tgtd: everything it served is gone (tgt keeps nothing).
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Tgtd {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The kernel's nvmet on loopback, for an nvmf backend (needs the guest:
/// nvmet, nvmet_tcp and nvme_tcp loaded, configfs mounted): a port of its
/// own (an id and a TCP port no other fixture of this process has), and
/// this node's host NQN and host ID in files of its folder (the guest has
/// no nvme-cli, whose files a node reads). Dropped, it deletes this node's
/// controllers of its subsystems, then every subsystem under its prefix,
/// its port and its host's entry: nothing a test left is left.
pub struct NvmetPort {
    pub dir: tempfile::TempDir,
    /// The address its port listens on.
    pub addr: &'static str,
    /// nvmet's id of its first port; its second's is the next.
    pub id: u16,
    pub port: u16,
    /// The TCP port of its second portal ([`NvmetPort::two_portal_config`]).
    pub port2: u16,
    pub prefix: String,
    pub host_nqn: String,
    pub host_id: String,
}

/// nvmet's configfs tree.
pub const NVMET: &str = "/sys/kernel/config/nvmet";

impl NvmetPort {
    pub fn new(prefix: &str) -> Self {
        Self::on("127.0.0.1", prefix)
    }

    /// A port listening on `addr` (the private network's address, for a
    /// peer guest to reach).
    pub fn on(addr: &'static str, prefix: &str) -> Self {
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let pid = std::process::id();
        // Ids 10000 and up, two for each fixture: the nvmf test's own
        // (4420, 4421) and an operator's stay clear.
        let id = 10_000 + ((pid % 2500) * 16 + (n % 8) * 2) as u16;
        let host_id = format!("{pid:08x}-0000-4000-8000-{n:012x}");
        let host_nqn = format!("nqn.2014-08.org.nvmexpress:uuid:{host_id}");
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("hostnqn"), format!("{host_nqn}\n")).unwrap();
        std::fs::write(dir.path().join("hostid"), format!("{host_id}\n")).unwrap();
        assert!(
            Path::new(NVMET).is_dir(),
            "{NVMET}: nvmet is not loaded (the guest loads it)"
        );
        let port = super::free_port();
        NvmetPort {
            dir,
            addr,
            id,
            port,
            port2: loop {
                match super::free_port() {
                    p if p == port => continue,
                    p => break p,
                }
            },
            prefix: prefix.to_string(),
            host_nqn,
            host_id,
        }
    }

    pub fn portal(&self) -> String {
        format!("{}:{}", self.addr, self.port)
    }

    /// Its host NQN and host ID files.
    pub fn host_files(&self) -> (PathBuf, PathBuf) {
        (
            self.dir.path().join("hostnqn"),
            self.dir.path().join("hostid"),
        )
    }

    /// An nvmf backend's config for this port, its namespaces in a file
    /// store in the test's folder (`@DIR@/nvmf-pool`), its subsystems
    /// named under the prefix.
    pub fn file_store_config(&self) -> String {
        self.config_over(&format!("\"{}\"", self.portal()))
    }

    /// [`NvmetPort::file_store_config`] over both its portals (native
    /// multipath: a controller through each).
    pub fn two_portal_config(&self) -> String {
        self.config_over(&format!(
            "\"{}\", \"{}:{}\"",
            self.portal(),
            self.addr,
            self.port2
        ))
    }

    fn config_over(&self, portals: &str) -> String {
        format!(
            "[[backend]]\ntype = \"nvmf\"\nnqn_prefix = \"{}\"\nportals = [{portals}]\n\
             first_port_id = {}\nhost_nqn_file = \"{}\"\nhost_id_file = \"{}\"\n\
             connect_timeout = 20\n[backend.store]\ntype = \"file\"\npool = \"@DIR@/nvmf-pool\"\n",
            self.prefix,
            self.id,
            self.dir.path().join("hostnqn").display(),
            self.dir.path().join("hostid").display(),
        )
    }

    /// Whether a subsystem's name is under this fixture's prefix.
    fn ours(&self, nqn: &str) -> bool {
        nqn.strip_prefix(self.prefix.as_str())
            .is_some_and(|r| r.starts_with(':'))
    }

    /// This node's controllers of the fixture's subsystems (`nvme<N>`).
    pub fn controllers(&self) -> Vec<String> {
        let mut found = Vec::new();
        for e in std::fs::read_dir("/sys/class/nvme")
            .into_iter()
            .flatten()
            .flatten()
        {
            let nqn = std::fs::read_to_string(e.path().join("subsysnqn")).unwrap_or_default();
            if self.ours(nqn.trim()) {
                found.push(e.file_name().to_string_lossy().into_owned());
            }
        }
        found
    }

    /// Nothing of the fixture's left: no controller of this node, no
    /// subsystem.
    pub fn assert_clean(&self) {
        assert!(
            self.controllers().is_empty(),
            "controllers left: {:?}",
            self.controllers()
        );
        assert!(
            self.subsystems().is_empty(),
            "subsystems left: {:?}",
            self.subsystems()
        );
    }

    /// The fixture's subsystems nvmet has.
    pub fn subsystems(&self) -> Vec<String> {
        std::fs::read_dir(Path::new(NVMET).join("subsystems"))
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| self.ours(n))
            .collect()
    }
}

impl Drop for NvmetPort {
    fn drop(&mut self) {
        for c in self.controllers() {
            let _ = std::fs::write(format!("/sys/class/nvme/{c}/delete_controller"), "1");
        }
        let root = Path::new(NVMET);
        for nqn in self.subsystems() {
            remove_subsystem(&nqn);
        }
        for id in [self.id, self.id + 1] {
            let _ = std::fs::remove_dir(root.join("ports").join(id.to_string()));
        }
        let _ = std::fs::remove_dir(root.join("hosts").join(&self.host_nqn));
    }
}

/// Removes subsystem `nqn` from nvmet whatever uses it: off every port
/// (the kernel drops its controllers there), its hosts, its namespaces
/// disabled and removed, then the subsystem.
pub fn remove_subsystem(nqn: &str) {
    let root = Path::new(NVMET);
    let sub = root.join("subsystems").join(nqn);
    for p in std::fs::read_dir(root.join("ports"))
        .into_iter()
        .flatten()
        .flatten()
    {
        let _ = std::fs::remove_file(p.path().join("subsystems").join(nqn));
    }
    for h in std::fs::read_dir(sub.join("allowed_hosts"))
        .into_iter()
        .flatten()
        .flatten()
    {
        let _ = std::fs::remove_file(h.path());
    }
    for ns in std::fs::read_dir(sub.join("namespaces"))
        .into_iter()
        .flatten()
        .flatten()
    {
        let _ = std::fs::write(ns.path().join("enable"), "0");
        let _ = std::fs::remove_dir(ns.path());
    }
    let _ = std::fs::remove_dir(&sub);
}

/// open-iscsi's daemon, for the node side of the iscsi backend.
pub struct Iscsid {
    child: Child,
}

impl Iscsid {
    pub fn new() -> Self {
        let child = daemon("iscsid", &["-f"]);
        wait_on("iscsid", &[("iscsid", child.id())], || {
            Command::new("iscsiadm")
                .args(["-m", "session"])
                .output()
                .is_ok_and(|o| o.status.code() != Some(20))
        });
        Iscsid { child }
    }

    /// The sessions iscsiadm lists (`tcp: [sid] portal,tpgt iqn ...`).
    pub fn sessions() -> Vec<String> {
        let out = Command::new("iscsiadm")
            .args(["-m", "session"])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(str::to_string)
            .collect()
    }
}

impl Drop for Iscsid {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// What one driver serving every backend needs in the guest: a volume
/// group `fv<tag>` of `vg_mib` MiB, tgtd with iscsid, the shared Ceph
/// cluster, (`with_nfs`) the kernel's NFS server on loopback, an nvmet
/// port, and the config naming them all ([`block_backends_config`], the
/// nvmf backend and the nfs one after it). Dropped in this order: the NFS
/// server, the nvmet port, tgtd, iscsid, the volume group.
pub struct EveryBackend {
    pub config: String,
    pub nfs: Option<NfsServer>,
    pub nvmet: NvmetPort,
    pub tgtd: Tgtd,
    pub cluster: &'static CephCluster,
    pub iscsid: Iscsid,
    pub vg: LvmVg,
}

impl EveryBackend {
    pub fn new(tag: &str, vg_mib: u64, with_nfs: bool) -> Self {
        let vg_name = format!("fv{tag}");
        let vg = LvmVg::new(&vg_name, vg_mib);
        let tgtd = Tgtd::new();
        let iscsid = Iscsid::new();
        let cluster = CephCluster::shared();
        let nfs = with_nfs.then(NfsServer::new);
        let nvmet = NvmetPort::new(&format!("nqn.2026-12.io.ferrovol.{tag}"));
        let mut config = block_backends_config(
            &vg_name,
            &tgtd,
            &format!("iqn.2026-11.io.ferrovol.{tag}"),
            cluster,
        );
        config.push_str(&nvmet.file_store_config());
        if nfs.is_some() {
            config.push_str(NFS_LOOPBACK_CONFIG);
        }
        // Every kind the driver has, nfs when asked: a new backend is
        // served here (the encryption and hardened runs take it) or this
        // fails.
        let served: Vec<String> = ferrovol::config::Config::parse(&config)
            .unwrap()
            .backends
            .into_iter()
            .map(|b| b.kind)
            .collect();
        for k in ferrovol::backend::KINDS {
            if with_nfs || k.name != "nfs" {
                assert!(
                    served.iter().any(|s| s == k.name),
                    "EveryBackend lacks {}",
                    k.name
                );
            }
        }
        EveryBackend {
            config,
            nfs,
            nvmet,
            tgtd,
            cluster,
            iscsid,
            vg,
        }
    }
}

/// The backends of the node alone, for a test of the guest's second lane
/// (tests/guest/lanes): file (a pool in the test's folder) and lvm (a
/// thick class on a volume group of the test's own, `fv{tag}`); no
/// server another test could cut off, and nothing another test sees.
pub struct LocalBackends {
    pub config: String,
    pub vg: LvmVg,
}

impl LocalBackends {
    pub fn new(tag: &str, vg_mib: u64) -> Self {
        let vg_name = format!("fv{tag}");
        let vg = LvmVg::new(&vg_name, vg_mib);
        LocalBackends {
            config: local_backends_config(&vg_name),
            vg,
        }
    }
}

/// The config of the file backend (a pool in the test's folder) and the
/// lvm one (a thick class on volume group `vg`), each named by its type.
pub fn local_backends_config(vg: &str) -> String {
    format!(
        "[[backend]]\ntype = \"file\"\npool = \"@DIR@/file-pool\"\n\
         [[backend]]\ntype = \"lvm\"\n[[backend.device_class]]\nname = \"thick\"\nvolume_group = \"{vg}\"\n"
    )
}

/// One driver's config with every block backend, each named by its type:
/// file and lvm (see [`local_backends_config`]), iscsi on `tgtd` (a file
/// store, targets under `iqn_prefix`) and rbd on `cluster`.
pub fn block_backends_config(
    vg: &str,
    tgtd: &Tgtd,
    iqn_prefix: &str,
    cluster: &CephCluster,
) -> String {
    format!(
        "{}{}{}",
        local_backends_config(vg),
        tgtd.file_store_config(iqn_prefix),
        cluster.backend_config("guest"),
    )
}
