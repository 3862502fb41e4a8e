//! Kill points: named places between two steps of an operation where a
//! test can have the driver die as a SIGKILL kills it, so that crash
//! recovery is tested at that exact step instead of wherever a timer
//! lands. Compiled in only with the `kill-points` feature (the test
//! builds; never the release image); without it [`hit`] is nothing.
//!
//! `FERROVOL_KILL_AT=<point>` kills the process at the first time it
//! reaches `<point>`, `<point>@<n>` at the n-th. `FERROVOL_KILL_CHILDREN=1`
//! first kills every child of the driver (what a container's end does to
//! the helpers it runs, a freeze's holder among them).
//! `FERROVOL_PAUSE_MS=<ms>` does not kill: the operation stops at the
//! point for that long (the thread sleeps), so that a test can kill
//! something else exactly there (a freeze's holder, alone).
//! `FERROVOL_KILL_AFTER_MS=<ms>` lets the operation go on past the point
//! and dies that long after it: aimed at a point just before a command the
//! driver runs, it kills the command part way through its own steps (the
//! driver's children die with it), which no point inside the driver can.

/// Every point, by name: what has happened and what has not yet when the
/// process dies there.
pub const POINTS: &[&str] = &[
    // A group snapshot's record is written; nothing is frozen or cut yet.
    "group.recorded",
    // The freeze intent is on disk; its holder is not started.
    "freeze.intent",
    // Every member's filesystem is frozen; no member snapshot is cut.
    "freeze.held",
    // One member's snapshot is cut, the filesystems still frozen (`@n`: the
    // n-th member).
    "group.member",
    // The filesystems are thawed; the intent is still on disk.
    "freeze.thawed",
    // Every member is cut and thawed; the group is not yet marked complete.
    "group.cut",
    // A stage's LUKS format is recorded as under way; cryptsetup has not
    // run.
    "crypt.formatting",
    // cryptsetup formatted the device; the record still says a format is
    // under way, and nothing is opened.
    "crypt.formatted",
    // ControllerPublish: the node's attach place is in the ledger's
    // journal; the backend has not attached.
    "attach.reserved",
    // ControllerPublish: the backend attached; the place is not yet
    // counted as a grant in memory.
    "attach.attached",
    // iscsi: the hold devices of the volumes in use are suspended (their
    // initiators' writes wait); no snapshot is taken.
    "iscsi.held",
    // iscsi ModifyVolume: the store's keys are changed; the LUN's and the
    // record are not.
    "iscsi.modify.store",
    // rbd: a new volume's image is made (a clone, for a copy) and sized,
    // under its final name with its making recorded (librbd) or under its
    // temporary name (the CLI road); it carries no CSI name yet.
    "rbd.made",
    // rbd (librbd road): a volume made in place has its CSI name; the
    // record of its making is still there (its removal runs after the
    // answer, in the background).
    "rbd.named",
    // rbd (librbd road): a deleted image is in the trash, out of the
    // pool's directory; the removal of its data has not begun.
    "rbd.trashed",
    // rbd: a group snapshot of volumes in use: the temporary rbd group
    // holds every member and its snapshot; no member is copied.
    "rbd.group.cut",
    // rbd: a group snapshot of volumes nobody writes: every member's
    // exclusive lock is held, and the member's cut is made (`@n`: the n-th
    // member's); the rest are not.
    "rbd.group.snapped",
    // lvm: lvcreate of a snapshot is about to run (with
    // FERROVOL_KILL_AFTER_MS, it dies part way through, the origin perhaps
    // suspended).
    "lvm.snapshot",
    // lvm: lvcreate made the snapshot; it still carries its origin's tags.
    "lvm.snapshot.made",
    // lvm: lvcreate made a copy (restore or clone) with the filling tag;
    // a thick one holds no data yet, a thin one its source's tags.
    "lvm.copy.made",
    // nfs: a volume made from a source has its record (saying it is being
    // filled) and its empty directory (on a btrfs export, not yet its
    // subvolume); the copy or the snapshot has not started.
    "nfs.fill",
    // nfs on a btrfs export: the snapshot's subvolume is made under its
    // temporary name; no record says so.
    "nfs.snapshot.made",
];

/// Says, once at start, the kill point this process was asked to die at
/// (`FERROVOL_KILL_AT`): `kill point armed` in a build with kill points,
/// and that it is ignored in one without. A test checks for the first, so
/// that a build without them (a plain `cargo build` of the same target
/// folder puts one in place of the test's binary) fails it for what it is
/// instead of running past the point.
pub fn announce() {
    let Ok(wanted) = std::env::var("FERROVOL_KILL_AT") else {
        return;
    };
    let name = wanted.split_once('@').map_or(wanted.as_str(), |(n, _)| n);
    if !cfg!(feature = "kill-points") {
        tracing::warn!(point = %wanted, "FERROVOL_KILL_AT is set, but this build has no kill points: ignored");
    } else if POINTS.contains(&name) {
        tracing::warn!(point = %wanted, "kill point armed");
    } else {
        tracing::error!(point = %wanted, "FERROVOL_KILL_AT names no kill point: ignored");
    }
}

/// Dies here if the test asked for it (a no-op without the feature).
#[cfg(not(feature = "kill-points"))]
#[inline(always)]
pub fn hit(_point: &'static str) {}

/// Dies here if the test asked for it.
#[cfg(feature = "kill-points")]
pub fn hit(point: &'static str) {
    use std::collections::HashMap;
    use std::sync::Mutex;
    static SEEN: Mutex<Option<HashMap<&'static str, u32>>> = Mutex::new(None);
    debug_assert!(POINTS.contains(&point), "unlisted kill point {point}");
    let Ok(wanted) = std::env::var("FERROVOL_KILL_AT") else {
        return;
    };
    let (name, nth) = match wanted.split_once('@') {
        Some((name, n)) => (name.to_string(), n.parse::<u32>().unwrap_or(1)),
        None => (wanted, 1),
    };
    if name != point {
        return;
    }
    let count = {
        let mut seen = SEEN.lock().unwrap_or_else(|p| p.into_inner());
        let n = seen
            .get_or_insert_with(HashMap::new)
            .entry(point)
            .or_insert(0);
        *n += 1;
        *n
    };
    if count != nth {
        return;
    }
    if let Some(ms) = std::env::var("FERROVOL_PAUSE_MS")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
    {
        tracing::warn!(point, ms, "kill point reached: pausing");
        std::thread::sleep(std::time::Duration::from_millis(ms));
        return;
    }
    if let Some(ms) = std::env::var("FERROVOL_KILL_AFTER_MS")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
    {
        tracing::warn!(point, ms, "kill point reached: dying after a delay");
        std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(ms));
            die(point)
        });
        return;
    }
    die(point)
}

#[cfg(feature = "kill-points")]
fn die(point: &'static str) -> ! {
    tracing::warn!(point, "kill point reached: dying");
    if std::env::var("FERROVOL_KILL_CHILDREN").as_deref() == Ok("1") {
        for pid in children() {
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
        }
    }
    let _ = nix::sys::signal::kill(nix::unistd::getpid(), nix::sys::signal::Signal::SIGKILL);
    // SIGKILL is not delivered after the call returns on every kernel path
    // at once: never go on.
    loop {
        std::thread::park();
    }
}

/// The driver's child processes, from /proc.
#[cfg(feature = "kill-points")]
fn children() -> Vec<nix::unistd::Pid> {
    let me = std::process::id().to_string();
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(stat) = std::fs::read_to_string(e.path().join("stat")) else {
            continue;
        };
        // pid (comm) state ppid ...: comm may hold spaces, so after its ')'.
        let fields: Vec<&str> = stat
            .rsplit_once(')')
            .map(|(_, rest)| rest.split_whitespace().collect())
            .unwrap_or_default();
        if fields.get(1) == Some(&me.as_str()) {
            if let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() {
                out.push(nix::unistd::Pid::from_raw(pid));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    /// Every point the code names is listed (with what it means), and
    /// every listed point is named somewhere: a test that aims at a point
    /// can trust it exists.
    #[test]
    fn the_points_named_in_the_code_are_the_listed_ones() {
        fn walk(dir: &std::path::Path, out: &mut Vec<String>) {
            for e in std::fs::read_dir(dir).unwrap().flatten() {
                let p = e.path();
                if p.is_dir() {
                    walk(&p, out);
                } else if p.extension().is_some_and(|x| x == "rs") {
                    out.push(std::fs::read_to_string(&p).unwrap());
                }
            }
        }
        let mut sources = Vec::new();
        walk(
            &std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src"),
            &mut sources,
        );
        let mut named = std::collections::BTreeSet::new();
        let call = concat!("killpoint::hit", "(\"");
        for text in &sources {
            for (i, _) in text.match_indices(call) {
                let rest = &text[i + call.len()..];
                named.insert(rest[..rest.find('"').unwrap()].to_string());
            }
        }
        let listed: std::collections::BTreeSet<String> =
            super::POINTS.iter().map(|p| p.to_string()).collect();
        assert_eq!(named, listed);
    }
}
