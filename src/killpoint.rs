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

/// A kill point: a place between two steps, by name. Each set of points
/// is an enum made by [`kill_points!`], so `hit` can only be given a
/// point that exists; the driver's own are [`Step`], each backend's are in
/// its folder and its [`crate::backend::Kind`].
pub trait Point: Copy {
    fn name(self) -> &'static str;
}

/// Declares an enum of kill points, each with its name and (as its doc
/// comment) what has happened and what has not yet when the process dies
/// there; `NAMES` lists the names.
#[macro_export]
macro_rules! kill_points {
    ($(#[$meta:meta])* $vis:vis enum $enum:ident { $($(#[$doc:meta])* $variant:ident = $name:literal,)* }) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        $vis enum $enum {
            $($(#[$doc])* $variant,)*
        }

        impl $enum {
            /// Every point of this set, by name.
            pub const NAMES: &'static [&'static str] = &[$($name),*];
        }

        impl $crate::killpoint::Point for $enum {
            fn name(self) -> &'static str {
                match self {
                    $($enum::$variant => $name,)*
                }
            }
        }
    };
}

kill_points! {
    /// The driver's own points (group snapshots, freezes, encryption,
    /// attach).
    pub enum Step {
        /// A group snapshot's record is written; nothing is frozen or cut
        /// yet.
        GroupRecorded = "group.recorded",
        /// The freeze intent is on disk; its holder is not started.
        FreezeIntent = "freeze.intent",
        /// Every member's filesystem is frozen; no member snapshot is cut.
        FreezeHeld = "freeze.held",
        /// One member's snapshot is cut, the filesystems still frozen
        /// (`@n`: the n-th member).
        GroupMember = "group.member",
        /// The filesystems are thawed; the intent is still on disk.
        FreezeThawed = "freeze.thawed",
        /// Every member is cut and thawed; the group is not yet marked
        /// complete.
        GroupCut = "group.cut",
        /// A stage's LUKS format is recorded as under way; cryptsetup has
        /// not run.
        CryptFormatting = "crypt.formatting",
        /// cryptsetup formatted the device; the record still says a format
        /// is under way, and nothing is opened.
        CryptFormatted = "crypt.formatted",
        /// ControllerPublish: the node's attach place is in the ledger's
        /// journal; the backend has not attached.
        AttachReserved = "attach.reserved",
        /// ControllerPublish: the backend attached; the place is not yet
        /// counted as a grant in memory.
        AttachAttached = "attach.attached",
        /// NodePublish: the target is bound and its record names the I/O
        /// limits for the pod; they are not written to its `io.max` yet.
        PublishLimited = "publish.limited",
        /// ControllerModifyVolume: the limit book has the volume's new I/O
        /// limits; its pods have the old ones.
        ModifyLimits = "modify.limits",
        /// A node took an offered change to one of its volumes' limits:
        /// its book has the change; the pods have the old limits, and the
        /// controller has not been told the offer was taken.
        LimitsTaken = "limits.taken",
    }
}

/// Says, once at start, the kill point this process was asked to die at
/// (`FERROVOL_KILL_AT`): `kill point armed` in a build with kill points,
/// and that it is ignored in one without. A test checks for the first, so
/// that a build without them (a plain `cargo build` of the same target
/// folder puts one in place of the test's binary) fails it for what it is
/// instead of running past the point.
/// `known`: every point there is ([`crate::backend::kill_points`]).
pub fn announce(known: &[&str]) {
    let Ok(wanted) = std::env::var("FERROVOL_KILL_AT") else {
        return;
    };
    let name = wanted.split_once('@').map_or(wanted.as_str(), |(n, _)| n);
    if !cfg!(feature = "kill-points") {
        tracing::warn!(point = %wanted, "FERROVOL_KILL_AT is set, but this build has no kill points: ignored");
    } else if known.contains(&name) {
        tracing::warn!(point = %wanted, "kill point armed");
    } else {
        tracing::error!(point = %wanted, "FERROVOL_KILL_AT names no kill point: ignored");
    }
}

/// Dies here if the test asked for it (a no-op without the feature).
#[cfg(not(feature = "kill-points"))]
#[inline(always)]
pub fn hit(_point: impl Point) {}

/// Dies here if the test asked for it.
#[cfg(feature = "kill-points")]
pub fn hit(point: impl Point) {
    use std::collections::HashMap;
    use std::sync::Mutex;
    static SEEN: Mutex<Option<HashMap<&'static str, u32>>> = Mutex::new(None);
    let point = point.name();
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
    use super::Point;

    /// Each point's name is what its set lists, in order.
    #[test]
    fn names_follow_their_variants() {
        assert_eq!(super::Step::GroupRecorded.name(), super::Step::NAMES[0]);
        assert_eq!(
            super::Step::LimitsTaken.name(),
            *super::Step::NAMES.last().unwrap()
        );
    }
}
