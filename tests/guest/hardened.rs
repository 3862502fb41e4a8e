//! Hardened clusters on every backend: SELinux mount labels (KEP-1710)
//! and user-namespaced pods (idmapped mounts).

use super::*;
use std::path::{Path, PathBuf};

/// Two labels of one MCS-separated file type, for two pods. Kubelet asks
/// for `container_file_t` (container-selinux's policy); Debian's reference
/// policy has no container module, and its MCS-separated image type for
/// sVirt guests, `svirt_image_t`, stands in. The driver treats a label as
/// opaque; the kernel checks it against the loaded policy at the mount.
const LABEL_A: &str = "system_u:object_r:svirt_image_t:s0:c1,c2";
const LABEL_B: &str = "system_u:object_r:svirt_image_t:s0:c3,c4";
/// The process label of a pod given `LABEL_A`.
const POD_A: &str = "system_u:system_r:svirt_t:s0:c1,c2";

/// SELinux on, with the reference policy (selinux-policy-default)
/// loaded, permissive. The guest boots with `security=selinux`
/// (tests/guest/run) and no policy: SELinux then checks nothing until one
/// is loaded, so the tests before this one run as without it. Permissive
/// because the guest's root (the host's over 9p, under an overlay)
/// carries no labels, and enforcing would deny the guest's own programs.
/// The kernel still applies every label and decides every access (what
/// it would deny is counted, not refused), which is what these tests
/// read.
fn selinux_permissive() {
    static LOADED: std::sync::Once = std::sync::Once::new();
    LOADED.call_once(|| {
        let fs = Path::new("/sys/fs/selinux");
        assert!(
            fs.is_dir(),
            "the guest kernel runs without SELinux: boot it with security=selinux"
        );
        if !fs.join("enforce").exists() {
            run(
                "mount",
                &["-t", "selinuxfs", "selinuxfs", "/sys/fs/selinux"],
            );
        }
        let dir = Path::new("/etc/selinux/default/policy");
        let policy = std::fs::read_dir(dir)
            .unwrap_or_else(|e| panic!("{}: {e} (selinux-policy-default)", dir.display()))
            .map(|e| e.unwrap().path())
            .max()
            .expect("a compiled policy");
        // Booted without enforcing=1: permissive from the start; the
        // policy is written to the kernel as load_policy would.
        std::fs::write(fs.join("load"), std::fs::read(&policy).unwrap()).unwrap();
        assert_eq!(
            std::fs::read_to_string(fs.join("enforce")).unwrap().trim(),
            "0"
        );
        for label in [LABEL_A, LABEL_B, POD_A] {
            // The kernel takes a context it knows (and refuses others).
            std::fs::write(fs.join("context"), label)
                .unwrap_or_else(|e| panic!("{label}: not a context of the policy: {e}"));
        }
    });
}

/// A file's SELinux label as the kernel reports it to the pod.
fn label_of(path: &Path) -> String {
    run("stat", &["-c", "%C", path.to_str().unwrap()])
        .trim()
        .to_string()
}

/// Whether the policy lets a process labelled `subject` open a file
/// labelled `object` to read and write (the kernel's own decision, asked
/// through selinuxfs's access interface).
fn may_read_write(subject: &str, object: &str) -> bool {
    use std::io::{Read, Write};
    let class = Path::new("/sys/fs/selinux/class/file");
    let index = |p: &str| -> u32 {
        std::fs::read_to_string(class.join(p))
            .unwrap()
            .trim()
            .parse()
            .unwrap()
    };
    let wanted = (1u32 << (index("perms/read") - 1))
        | (1u32 << (index("perms/write") - 1))
        | (1u32 << (index("perms/open") - 1));
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/sys/fs/selinux/access")
        .unwrap();
    f.write_all(format!("{subject} {object} {}", index("index")).as_bytes())
        .unwrap();
    let mut answer = String::new();
    f.read_to_string(&mut answer).unwrap();
    let allowed = u32::from_str_radix(answer.split_whitespace().next().unwrap(), 16).unwrap();
    allowed & wanted == wanted
}

/// The mount options of the mount at `path` (the superblock's, where an
/// SELinux label is shown).
fn superblock_options(path: &Path) -> String {
    let table = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    ferrovol::mount::parse_mountinfo(&table)
        .into_iter()
        .find(|m| m.mount_point == path)
        .unwrap_or_else(|| panic!("{} is not mounted", path.display()))
        .super_options
        .join(",")
}

fn device_of(path: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).unwrap().dev()
}

fn labelled_cap(fs: &str, mode: i32, label: &str) -> pb::VolumeCapability {
    let mut cap = mount_cap(fs, mode);
    if let Some(pb::volume_capability::AccessType::Mount(m)) = cap.access_type.as_mut() {
        // As kubelet writes it (Go's %q).
        m.mount_flags = vec![format!("context=\"{label}\"")];
    }
    cap
}

/// One backend and filesystem under SELinux, as kubelet drives it with
/// SELinuxMount: two volumes, each staged and published with its pod's
/// label. The files each pod sees carry its label; the label is the
/// mounted filesystem's (the superblock's options say it), each volume's
/// filesystem is its own (nfs too, from one export), and the policy lets
/// pod A read and write its files and not pod B's. A second pod with A's
/// label shares A's mount; one with B's label is refused A's volume
/// (FAILED_PRECONDITION naming both), and a stage of A with B's label is
/// ALREADY_EXISTS. Answers the two volumes, A's first, still published.
async fn labels_on(
    h: &Harness,
    backend: &str,
    fs: &str,
    attach: bool,
    secrets: &HashMap<String, String>,
) -> Vec<Published> {
    let mode = if backend == "nfs" { 5 } else { SNW };
    let mut made = Vec::new();
    for (which, label) in [("a", LABEL_A), ("b", LABEL_B)] {
        let name = format!(
            "se-{backend}-{}-{which}",
            if fs.is_empty() { "nfs" } else { fs }
        );
        let mut req = create_req(&name, 320 * MIB, labelled_cap(fs, mode, label));
        req.parameters.insert("backend".into(), backend.into());
        req.secrets = secrets.clone();
        let vol = match attach {
            true => h.provision_attached(req).await,
            false => h.provision_req(req).await,
        };
        std::fs::write(vol.target.join("written"), which).unwrap();
        std::fs::create_dir(vol.target.join("dir")).unwrap();
        for p in [
            vol.target.clone(),
            vol.target.join("written"),
            vol.target.join("dir"),
        ] {
            assert_eq!(label_of(&p), label, "{backend} {fs}: {}", p.display());
        }
        let options = superblock_options(&vol.staging);
        assert!(
            options.contains(&format!("context=\"{label}\"")),
            "{backend} {fs}: the staged filesystem's options: {options}"
        );
        made.push(vol);
    }
    let (a, b) = (&made[0], &made[1]);
    assert_ne!(
        device_of(&a.target),
        device_of(&b.target),
        "{backend} {fs}: two labels on one filesystem"
    );
    let (file_a, file_b) = (a.target.join("written"), b.target.join("written"));
    assert!(may_read_write(POD_A, &label_of(&file_a)), "{backend} {fs}");
    assert!(!may_read_write(POD_A, &label_of(&file_b)), "{backend} {fs}");
    println!(
        "selinux {backend} {}: files labelled as each pod asked ({LABEL_A} / {LABEL_B}), \
         on filesystems {} and {}; pod A may read and write its files, not B's",
        if fs.is_empty() { "nfs" } else { fs },
        device_of(&a.target),
        device_of(&b.target),
    );

    // A second pod with A's label shares the staged filesystem.
    let second = h.path(&format!("kubelet/pods/{backend}-{fs}-a2"));
    let cap_a = labelled_cap(fs, mode, LABEL_A);
    let cap_b = labelled_cap(fs, mode, LABEL_B);
    h.node()
        .node_publish_volume(publish_req(&a.id, &a.staging, &second, cap_a, false))
        .await
        .unwrap_or_else(|e| panic!("{backend} {fs}: the second pod: {e:?}\n{}", h.log()));
    assert_eq!(std::fs::read(second.join("written")).unwrap(), b"a");
    assert_eq!(device_of(&second), device_of(&a.target));
    // A pod with B's label is refused A's volume, with both labels said.
    let other = h.path(&format!("kubelet/pods/{backend}-{fs}-b2"));
    let e = h
        .node()
        .node_publish_volume(publish_req(&a.id, &a.staging, &other, cap_b.clone(), false))
        .await
        .unwrap_err();
    assert_eq!(
        e.code(),
        tonic::Code::FailedPrecondition,
        "{backend} {fs}: {e:?}"
    );
    assert!(
        e.message().contains(LABEL_A) && e.message().contains(LABEL_B),
        "{e:?}"
    );
    assert!(
        !h.mounts().contains(&other),
        "{backend} {fs}: refused, yet mounted"
    );
    let e = h
        .node()
        .node_stage_volume(stage_req(&a.id, &a.staging, cap_b))
        .await
        .unwrap_err();
    assert_eq!(
        e.code(),
        tonic::Code::AlreadyExists,
        "{backend} {fs}: {e:?}"
    );
    h.node()
        .node_unpublish_volume(unpublish_req(&a.id, &second))
        .await
        .unwrap();
    made
}

/// Unpublishes, unstages, detaches (`attach`) and deletes `vol`.
async fn remove(h: &Harness, vol: &Published, attach: bool, secrets: &HashMap<String, String>) {
    h.unpublish_unstage(&vol.id, &vol.staging, &vol.target)
        .await;
    if attach {
        h.detach_here(&vol.id).await;
    }
    h.delete_volume_with(&vol.id, secrets.clone()).await;
}

/// A user namespace as a runtime makes one for a pod with `hostUsers:
/// false`: ids 0-65535 inside are 100000-165535 on the host. Its first
/// process sleeps until dropped.
struct PodUserns {
    child: std::process::Child,
}

/// Where the pod's ids begin on the host.
const POD_BASE: u32 = 100_000;

impl PodUserns {
    fn new() -> Self {
        // Debian's unshare maps other ids through newuidmap (package
        // uidmap); root writes the maps itself.
        let child = std::process::Command::new("unshare")
            .args(["--user", "--", "sleep", "3600"])
            .spawn()
            .unwrap();
        let ns = PodUserns { child };
        let pid = ns.child.id();
        let ours = std::fs::read_link("/proc/self/ns/user").unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        while !(std::fs::read_to_string(format!("/proc/{pid}/comm"))
            .is_ok_and(|c| c.trim() == "sleep")
            && std::fs::read_link(format!("/proc/{pid}/ns/user")).is_ok_and(|l| l != ours))
        {
            assert!(
                std::time::Instant::now() < deadline,
                "unshare: no namespace"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        for map in ["uid_map", "gid_map"] {
            std::fs::write(
                format!("/proc/{pid}/{map}"),
                format!("0 {POD_BASE} 65536\n"),
            )
            .unwrap();
        }
        ns
    }

    fn path(&self) -> String {
        format!("/proc/{}/ns/user", self.child.id())
    }

    /// Runs `script` with sh in the namespace as `uid` (its own group and,
    /// given, one more), as the pod's process would; its status and
    /// output.
    fn sh(&self, uid: u32, group: Option<u32>, script: &str) -> (bool, String) {
        let groups = group.map_or(String::from("--clear-groups"), |g| format!("--groups={g}"));
        let out = std::process::Command::new("nsenter")
            .arg(format!("--user={}", self.path()))
            .args(["--", "setpriv"])
            .arg(format!("--reuid={uid}"))
            .arg(format!("--regid={uid}"))
            .arg(groups)
            .args(["--", "sh", "-c", script])
            .output()
            .unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        (out.status.success(), text.trim().to_string())
    }
}

impl Drop for PodUserns {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// What a runtime does for a user-namespaced pod's volume: the publish
/// target bound at `at` with the namespace's id mapping
/// (`open_tree(OPEN_TREE_CLONE)`, `mount_setattr(MOUNT_ATTR_IDMAP)`,
/// `move_mount`). Debian 12's mount(8) predates `X-mount.idmap`. The
/// kernel's error when the filesystem cannot be idmapped.
fn idmapped_bind(source: &Path, at: &Path, userns: &Path) -> std::io::Result<()> {
    use std::ffi::CString;
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    #[repr(C)]
    struct MountAttr {
        attr_set: u64,
        attr_clr: u64,
        propagation: u64,
        userns_fd: u64,
    }
    const OPEN_TREE_CLONE: libc::c_uint = 1;
    const MOUNT_ATTR_IDMAP: u64 = 0x0010_0000;
    const MOVE_MOUNT_F_EMPTY_PATH: libc::c_uint = 0x4;
    let cstr = |p: &Path| CString::new(p.as_os_str().as_encoded_bytes()).unwrap();
    let check = |r: libc::c_long| match r < 0 {
        true => Err(std::io::Error::last_os_error()),
        false => Ok(r),
    };
    let ns = std::fs::File::open(userns)?;
    let (src, dst, empty) = (cstr(source), cstr(at), CString::new("").unwrap());
    // SAFETY: the paths are NUL-terminated strings that outlive the
    // calls; the answered descriptor is owned from here on.
    let tree = unsafe {
        OwnedFd::from_raw_fd(check(libc::syscall(
            libc::SYS_open_tree,
            libc::AT_FDCWD,
            src.as_ptr(),
            OPEN_TREE_CLONE | libc::O_CLOEXEC as libc::c_uint,
        ))? as i32)
    };
    let attr = MountAttr {
        attr_set: MOUNT_ATTR_IDMAP,
        attr_clr: 0,
        propagation: 0,
        userns_fd: ns.as_raw_fd() as u64,
    };
    // SAFETY: `attr` is a mount_attr of the size given, alive for the
    // call; the descriptors are open.
    check(unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            tree.as_raw_fd(),
            empty.as_ptr(),
            libc::AT_EMPTY_PATH,
            &attr as *const MountAttr,
            std::mem::size_of::<MountAttr>(),
        )
    })?;
    // SAFETY: as above.
    check(unsafe {
        libc::syscall(
            libc::SYS_move_mount,
            tree.as_raw_fd(),
            empty.as_ptr(),
            libc::AT_FDCWD,
            dst.as_ptr(),
            MOVE_MOUNT_F_EMPTY_PATH,
        )
    })?;
    Ok(())
}

/// Owner and group of `path` as the host sees them.
fn owner(path: &Path) -> String {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(path).unwrap();
    format!("{}:{}", m.uid(), m.gid())
}

/// The fsGroup kubelet gives the pod, applied as kubelet applies it (on
/// the host, through the publish target, before the containers start):
/// every file's group set to it, group read and write added, and
/// directories setgid so that new files take it.
const FS_GROUP: u32 = 2000;

fn apply_fs_group(root: &Path) {
    run(
        "chgrp",
        &["-R", &FS_GROUP.to_string(), root.to_str().unwrap()],
    );
    run("chmod", &["-R", "g+rwX", root.to_str().unwrap()]);
    run(
        "find",
        &[
            root.to_str().unwrap(),
            "-type",
            "d",
            "-exec",
            "chmod",
            "g+s",
            "{}",
            "+",
        ],
    );
}

/// A user-namespaced pod given volume `vol` of one backend and filesystem
/// (see [`guest_hardened_pods_on_file_and_lvm`]): its publish target
/// idmapped into the pod's namespace. The fresh filesystem's root is
/// root's inside; the pod's root writes files that are uid 0 on disk; a pod
/// user (uid 1000) cannot write the root until fsGroup is applied, and then
/// writes files that are 1000:fsGroup on disk and inside. The host, through
/// the idmapped mount, sees those ids shifted by the namespace's base (the
/// mapping is in force). Answers the line for the closing table.
async fn idmapped_on(
    h: &Harness,
    ns: &PodUserns,
    vol: &Published,
    backend: &str,
    fs: &str,
) -> String {
    let fs_name = if fs.is_empty() { "nfs" } else { fs };
    let name = format!("userns-{backend}-{fs_name}");
    let pod = h.path(&format!("pod-rootfs/{name}"));
    std::fs::create_dir_all(&pod).unwrap();
    let line = match idmapped_bind(&vol.target, &pod, Path::new(&ns.path())) {
        Err(e) => {
            // The kernel decides which filesystems take an idmapped
            // mount; NFS does not (Linux 6.12): the runtime refuses the pod.
            assert_eq!(backend, "nfs", "{backend} {fs_name}: idmapped mount: {e}");
            assert_eq!(e.raw_os_error(), Some(libc::EINVAL), "{e}");
            // Bound without a mapping instead (what a runtime that goes on
            // would give): the pod's root is its host id to the server, and
            // the export's own files are nobody's inside.
            run(
                "mount",
                &[
                    "--bind",
                    vol.target.to_str().unwrap(),
                    pod.to_str().unwrap(),
                ],
            );
            let p = pod.display();
            let (ok, inside) = ns.sh(
                0,
                None,
                &format!("stat -c %u:%g {p} && echo root > {p}/by-root"),
            );
            assert!(ok, "{inside}");
            assert_eq!(inside, "65534:65534", "the export's root, seen inside");
            let on_server = owner(&vol.target.join("by-root"));
            assert_eq!(on_server, format!("{POD_BASE}:{POD_BASE}"));
            // The pod is "other" to the volume's directory: what it may do
            // there is what mountPermissions gives others (the backend's
            // directory_mode, 0777, until a class changes it).
            let (ok, mode) = ns.sh(0, None, &format!("stat -c %a {p}"));
            assert!(ok && mode == "777", "{mode}");
            h.controller()
                .controller_modify_volume(pb::ControllerModifyVolumeRequest {
                    volume_id: vol.id.clone(),
                    mutable_parameters: HashMap::from([(
                        "mountPermissions".to_string(),
                        "0750".to_string(),
                    )]),
                    ..Default::default()
                })
                .await
                .unwrap_or_else(|e| panic!("mountPermissions 0750: {e:?}\n{}", h.log()));
            let (ok, out) = ns.sh(0, None, &format!("echo more > {p}/by-root-again"));
            assert!(!ok && out.contains("Permission denied"), "{ok}: {out}");
            run("umount", &[pod.to_str().unwrap()]);
            format!(
                "userns {backend} {fs_name}: the kernel refuses an idmapped mount ({e}); \
                 bound without one, the export's root is 65534:65534 inside, the pod \
                 root's files are {on_server} on the server, and the pod may write only \
                 what mountPermissions gives others (0777 yes, 0750 no)"
            )
        }
        Ok(()) => {
            let p = pod.display();
            let inside = |uid: u32, group: Option<u32>, script: &str| {
                let (ok, out) = ns.sh(uid, group, script);
                assert!(ok, "{backend} {fs_name}: as {uid}: {script}: {out}");
                out
            };
            // The fresh filesystem's root is root's inside.
            assert_eq!(inside(0, None, &format!("stat -c %u:%g {p}")), "0:0");
            inside(0, None, &format!("echo root > {p}/by-root"));
            assert_eq!(owner(&vol.target.join("by-root")), "0:0");
            assert_eq!(
                owner(&pod.join("by-root")),
                format!("{POD_BASE}:{POD_BASE}"),
                "{backend} {fs_name}: the mount is not idmapped"
            );
            // A pod user: not before fsGroup, then as kubelet set it.
            let (ok, _) = ns.sh(1000, Some(FS_GROUP), &format!("echo user > {p}/by-user"));
            assert!(!ok, "{backend} {fs_name}: uid 1000 wrote root's directory");
            apply_fs_group(&vol.target);
            inside(1000, Some(FS_GROUP), &format!("echo user > {p}/by-user"));
            inside(
                1000,
                Some(FS_GROUP),
                &format!("mkdir {p}/by-user-dir && echo in > {p}/by-user-dir/f"),
            );
            let fs_group = format!("1000:{FS_GROUP}");
            for f in ["by-user", "by-user-dir", "by-user-dir/f"] {
                assert_eq!(
                    owner(&vol.target.join(f)),
                    fs_group,
                    "{backend} {fs_name}: {f}"
                );
                assert_eq!(
                    inside(0, None, &format!("stat -c %u:%g {p}/{f}")),
                    fs_group,
                    "{backend} {fs_name}: {f} inside"
                );
            }
            // The root's file, regrouped, is the pod user's to write too.
            inside(1000, Some(FS_GROUP), &format!("echo more >> {p}/by-root"));
            run("umount", &[pod.to_str().unwrap()]);
            format!(
                "userns {backend} {fs_name}: idmapped; pod root's files 0:0 on disk \
                 ({POD_BASE}:{POD_BASE} through the mount from the host), fsGroup \
                 {FS_GROUP} lets uid 1000 write, its files {fs_group} on disk and inside"
            )
        }
    };
    line
}

/// Pods of a hardened cluster on every backend and filesystem, in two
/// tests the guest runs side by side (tests/guest/lanes): the node's own
/// backends here, file (ext4, xfs, btrfs) and lvm (ext4, xfs), one driver
/// serving both; the remote ones in
/// [`guest_hardened_pods_on_the_remote_backends`]. SELinux mount labels
/// (see [`labels_on`]) with the reference policy loaded permissive (see
/// [`selinux_permissive`]); then the first, labelled, volume given to a
/// user-namespaced pod (`hostUsers: false`), the runtime's part done by
/// hand (see [`idmapped_on`]): idmapped where the kernel can (every block
/// filesystem), refused where it cannot (nfs, EINVAL). Prints the lines
/// of the closing table; nothing is left mounted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the real-kernel guest: run tests/guest/suite"]
async fn guest_hardened_pods_on_file_and_lvm() {
    require_guest();
    selinux_permissive();
    let local = LocalBackends::new("hardl", 700);
    let none = HashMap::new();
    let mut cases: Vec<(&str, &str, bool, &HashMap<String, String>)> = ["ext4", "xfs", "btrfs"]
        .into_iter()
        .map(|fs| ("file", fs, false, &none))
        .collect();
    for fs in ["ext4", "xfs"] {
        cases.push(("lvm", fs, false, &none));
    }
    hardened_pods(&local.config, cases).await;
}

/// Pods of a hardened cluster on the remote backends, one driver serving
/// them all: iscsi and rbd (ext4, xfs), nvmf (ext4), nfs (two volumes of
/// one export);
/// as [`guest_hardened_pods_on_file_and_lvm`] on the node's own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the real-kernel guest: run tests/guest/suite"]
async fn guest_hardened_pods_on_the_remote_backends() {
    require_guest();
    selinux_permissive();
    let every = EveryBackend::new("hardened", 64, true);
    let cluster = every.cluster;
    let none = HashMap::new();
    let rbd = cluster.secrets();
    let mut cases: Vec<(&str, &str, bool, &HashMap<String, String>)> = Vec::new();
    for fs in ["ext4", "xfs"] {
        cases.push(("iscsi", fs, true, &none));
        cases.push(("rbd", fs, true, &rbd));
    }
    // nvmf's device is a block device as iscsi's: its filesystems' labels
    // are the shared code's, proven on both above; ext4 shows its own path.
    cases.push(("nvmf", "ext4", true, &none));
    cases.push(("nfs", "", false, &none));
    hardened_pods(&every.config, cases).await;
}

/// Each case (backend, filesystem, attached, secrets) labelled and given
/// to a user-namespaced pod by one driver of `config`; the closing table's
/// lines printed; nothing left mounted once the driver stops (it lets go
/// of its own working mount of an nfs export then).
async fn hardened_pods(config: &str, cases: Vec<(&str, &str, bool, &HashMap<String, String>)>) {
    let mut h = Harness::start_with(Some(config)).await;
    let ns = PodUserns::new();
    let mut lines = Vec::new();
    for (backend, fs, attach, secrets) in cases {
        let made = labels_on(&h, backend, fs, attach, secrets).await;
        lines.push(idmapped_on(&h, &ns, &made[0], backend, fs).await);
        for vol in &made {
            remove(&h, vol, attach, secrets).await;
        }
    }
    println!("{}", lines.join("\n"));
    assert!(h.terminate().success(), "{}", h.log());
    let left: Vec<PathBuf> = h.mounts();
    assert!(left.is_empty(), "{left:?}");
}
