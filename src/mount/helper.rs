//! Mounts made by the filesystem's own mount helper (`mount -t nfs` runs
//! `mount.nfs`, which resolves the server and negotiates the protocol
//! version), in a child process through the exec seam: a mount of an
//! unreachable server is killed at its deadline, where a thread stuck in
//! mount(2) could not be.

use super::MountOptions;
use crate::error::{Error, Result};
use crate::exec::{Command, CommandRunner};
use std::path::Path;
use std::time::Duration;

/// The command line for a helper mount. `source` and `fs_type` come from a
/// backend that validated them; the options are plain option text (checked
/// by [`MountOptions::parse`]); each is one argument, never a shell string.
pub fn helper_command(
    source: &str,
    target: &Path,
    fs_type: &str,
    options: &MountOptions,
    deadline: Duration,
) -> Result<Command> {
    let plain = |s: &str| !s.is_empty() && !s.starts_with('-') && !s.contains(['\0', '\n']);
    if !plain(source) || !plain(fs_type) || fs_type.contains([',', ' ']) {
        return Err(Error::invalid(
            "remote mount source or type is not plain text",
        ));
    }
    let target = target
        .to_str()
        .filter(|t| t.starts_with('/'))
        .ok_or_else(|| Error::invalid("mount target must be an absolute UTF-8 path"))?;
    let mut opts: Vec<String> = Vec::new();
    opts.push(if options.readonly { "ro" } else { "rw" }.into());
    opts.extend(options.flags.iter().map(|f| f.to_string()));
    opts.extend(options.data.iter().cloned());
    Ok(Command::new("mount")
        .args(["-t", fs_type, "-o", &opts.join(","), "--", source, target])
        .timeout(deadline))
}

/// Mounts `source` of `fs_type` on `target` through its mount helper.
pub async fn mount_with_helper(
    runner: &dyn CommandRunner,
    source: &str,
    target: &Path,
    fs_type: &str,
    options: &MountOptions,
    deadline: Duration,
) -> Result<()> {
    let cmd = helper_command(source, target, fs_type, options, deadline)?;
    runner
        .run(cmd)
        .await
        .map(|_| ())
        .map_err(|e| Error::from(e).context(format!("mount {fs_type} {source}")))
}

/// Unmounts a (remote) filesystem at `target` with `umount`, and lazily
/// when that fails or outlives `deadline` (a lazy unmount never waits on
/// the server). Never forced: a forced unmount of an NFS mount aborts the
/// RPCs in flight of every mount that shares its superblock (the kernel
/// shares one between mounts of the same filesystem from the same server:
/// the other volumes of an export staged on the node, the pods' mounts
/// under a controller's working mount), so their writers would see their
/// writes fail.
pub async fn unmount_with_helper(
    runner: &dyn CommandRunner,
    target: &Path,
    deadline: Duration,
) -> Result<()> {
    let arg = crate::exec::path_arg(target)?;
    let umount = |flag: Option<&str>| {
        Command::new("umount")
            .args(flag.into_iter().chain([arg.as_str()]))
            .timeout(deadline)
    };
    if runner.run(umount(None)).await.is_err() {
        runner.run(umount(Some("-l"))).await?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::exec::{FakeRunner, Reply};

    #[tokio::test]
    async fn unmounts_plainly_then_lazily_and_never_forced() {
        let target = Path::new("/var/lib/kubelet/staging/a");
        let runner = FakeRunner::new();
        runner.ok("umount");
        unmount_with_helper(&runner, target, Duration::from_secs(5))
            .await
            .unwrap();
        assert_eq!(runner.lines(), ["umount /var/lib/kubelet/staging/a"]);
        // A server that does not answer: the plain unmount runs out, the
        // lazy one lets go.
        let runner = FakeRunner::new();
        runner.expect("umount", Reply::Timeout).ok("umount");
        unmount_with_helper(&runner, target, Duration::from_secs(5))
            .await
            .unwrap();
        assert_eq!(
            runner.lines(),
            [
                "umount /var/lib/kubelet/staging/a",
                "umount -l /var/lib/kubelet/staging/a"
            ]
        );
        for c in runner.calls() {
            assert!(!c.args.iter().any(|a| a == "-f"), "{c}");
        }
    }

    #[test]
    fn builds_one_argument_each() {
        let o = MountOptions::parse(&["nfsvers=4.2,noatime".into()], true).unwrap();
        let c = helper_command(
            "10.0.0.1:/export/a b",
            Path::new("/var/lib/kubelet/x"),
            "nfs",
            &o,
            Duration::from_secs(5),
        )
        .unwrap();
        assert_eq!(
            c.args,
            [
                "-t",
                "nfs",
                "-o",
                "ro,noatime,nfsvers=4.2",
                "--",
                "10.0.0.1:/export/a b",
                "/var/lib/kubelet/x"
            ]
        );
        assert_eq!(c.timeout, Duration::from_secs(5));
        for (src, fs) in [
            ("-oremount", "nfs"),
            ("a", "nfs,x"),
            ("", "nfs"),
            ("a\nb", "nfs"),
        ] {
            assert!(
                helper_command(src, Path::new("/t"), fs, &o, Duration::from_secs(1)).is_err(),
                "{src:?} {fs:?}"
            );
        }
        assert!(helper_command("a", Path::new("rel"), "nfs", &o, Duration::from_secs(1)).is_err());
    }
}
