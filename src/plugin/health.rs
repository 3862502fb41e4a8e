//! Volume and storage health (CSI v1.13): what a backend finds wrong, each
//! finding named by a reason from one list, and the book that answers from
//! what was last measured so that a health call never waits on storage
//! that does not answer.

use std::collections::HashMap;
use std::future::Future;
use std::hash::Hash;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::watch;

/// What is wrong with a volume (v1.13's `VolumeHealthErrorType`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Status {
    /// It cannot be reached: from any node when the controller says so,
    /// from this node when a node does.
    Inaccessible,
    /// Its data is lost, or very likely so.
    DataLoss,
    /// It is usable, not at its best.
    Degraded,
}

/// What is wrong with a backend as this node sees it (v1.13's
/// `StorageHealthErrorType`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum StorageStatus {
    Unreachable,
    Degraded,
}

/// Why a volume or a backend is not well: a CamelCase word on the wire
/// (v1.13's `reason`), and a line in docs/monitoring.md and
/// docs/troubleshooting.md (tests/docs.rs checks both). The reasons any
/// backend may give are here, as `Reason::X`; a backend's own are in its
/// folder (`reasons::X`, made by [`crate::reasons!`]), listed in its
/// [`crate::backend::Kind::reasons`]. Every one there is:
/// [`crate::backend::reasons`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Reason(&'static str);

impl Reason {
    /// The reason this word names (a CamelCase word: checked by the test
    /// of every reason).
    pub const fn named(word: &'static str) -> Self {
        Reason(word)
    }

    /// The word on the wire.
    pub fn as_str(self) -> &'static str {
        self.0
    }
}

/// Declares reasons, each a constant named as its word on the wire:
/// `reasons! { impl { ... } }` the shared ones, as `Reason::X`;
/// `reasons! { pub mod reasons { ... } }` a backend's own, as
/// `reasons::X`, with `reasons::ALL` for its [`crate::backend::Kind`].
#[macro_export]
macro_rules! reasons {
    (impl { $($(#[$doc:meta])* $variant:ident,)* }) => {
        #[allow(non_upper_case_globals)]
        impl $crate::plugin::health::Reason {
            $($(#[$doc])* pub const $variant: Self = Self::named(stringify!($variant));)*

            /// The reasons any backend may give (each backend's own:
            /// [`crate::backend::reasons`]).
            pub const SHARED: &'static [Self] = &[$(Self::$variant,)*];
        }
    };
    ($(#[$meta:meta])* $vis:vis mod $set:ident { $($(#[$doc:meta])* $variant:ident,)* }) => {
        $(#[$meta])*
        #[allow(non_upper_case_globals)]
        $vis mod $set {
            use $crate::plugin::health::Reason;
            $($(#[$doc])* pub const $variant: Reason = Reason::named(stringify!($variant));)*

            /// All of them, for the backend's [`crate::backend::Kind`].
            pub const ALL: &[Reason] = &[$($variant,)*];
        }
    };
}

crate::reasons! { impl {
    /// The measurement did not finish within its deadline: the storage
    /// behind it does not answer.
    HealthCheckTimedOut,
    /// The measurement itself failed (the message says how).
    HealthCheckFailed,
    /// The storage behind the volume did not answer the check (its server,
    /// target or cluster), within the check's own command deadline.
    StorageNotAnswering,
    /// The volume was never attached on this node, or its attachment was
    /// not recorded.
    NotAttached,
    /// The filesystem staged for the volume is no longer mounted.
    StagingMountGone,
    /// The filesystem does not answer (a remote server, a stale handle).
    FilesystemNotAnswering,
    /// The staged device answers a read with I/O errors.
    DeviceIOErrors,
    /// The filesystem recorded errors (ext4's count): data may be lost.
    FilesystemErrors,
    /// The kernel made the filesystem read-only after an error.
    FilesystemReadOnly,
    /// The filesystem answers I/O errors: the kernel shut it down (xfs).
    FilesystemShutDown,
    /// The volume is no longer mounted at the publish path asked about.
    PublishMountGone,
    /// The backend has no such volume (deleted outside the driver, or its
    /// storage lost).
    VolumeNotFound,
    /// A backend is not ready on this node (what it lacks is in the
    /// message): NodeGetStorageHealth's STORAGE_UNREACHABLE.
    BackendNotReady,
    /// The volume's I/O limits are not set for a pod that uses it (its
    /// cgroup was not found, or its publish named no pod): that pod's I/O
    /// is unlimited.
    IoLimitNotApplied,
} }

/// One thing found wrong with a volume.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finding {
    pub status: Status,
    pub reason: Reason,
    pub message: String,
}

impl Finding {
    pub fn new(status: Status, reason: Reason, message: impl Into<String>) -> Self {
        Finding {
            status,
            reason,
            message: message.into(),
        }
    }
    pub fn inaccessible(reason: Reason, message: impl Into<String>) -> Self {
        Self::new(Status::Inaccessible, reason, message)
    }
    pub fn degraded(reason: Reason, message: impl Into<String>) -> Self {
        Self::new(Status::Degraded, reason, message)
    }
    pub fn data_loss(reason: Reason, message: impl Into<String>) -> Self {
        Self::new(Status::DataLoss, reason, message)
    }
}

/// One thing found wrong with a backend as this node sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StorageFinding {
    pub status: StorageStatus,
    pub reason: Reason,
    pub message: String,
}

/// What v1.12's callers get for a volume: abnormal with every finding's
/// message, or healthy. One place knows a volume's health; the old
/// condition is read from it.
pub fn condition(findings: &[Finding]) -> Option<String> {
    if findings.is_empty() {
        return None;
    }
    Some(
        findings
            .iter()
            .map(|f| f.message.as_str())
            .collect::<Vec<_>>()
            .join("; "),
    )
}

/// A check's result as findings: its own, one per (status, reason); a
/// check that failed is said as such (storage that did not answer it
/// apart from any other failure).
pub fn from_check(found: crate::error::Result<Vec<Finding>>) -> Vec<Finding> {
    match found {
        Ok(found) => dedup(found),
        Err(e) if e.kind == crate::error::Kind::Unavailable => vec![Finding::inaccessible(
            Reason::StorageNotAnswering,
            format!("the storage does not answer: {}", e.message),
        )],
        Err(e) => vec![Finding::inaccessible(
            Reason::HealthCheckFailed,
            format!("the health check failed: {}", e.message),
        )],
    }
}

/// Keeps the spec's rule: one entry per (status, reason), the first kept.
pub fn dedup(mut findings: Vec<Finding>) -> Vec<Finding> {
    let mut seen = std::collections::BTreeSet::new();
    findings.retain(|f| seen.insert((f.status, f.reason)));
    findings
}

/// A measurement and when it was taken.
#[derive(Debug, Clone)]
pub struct Measured<T> {
    pub value: T,
    pub at: Instant,
}

struct Slot<T> {
    last: Option<Measured<T>>,
    /// Set while a measurement runs: its result is sent here.
    running: Option<watch::Receiver<Option<Measured<T>>>>,
}

/// What was last measured, per key (a volume, a backend). A call asks for
/// a value no older than `fresh`: the book answers from what it has, or
/// starts one measurement (never two at once for a key) and waits for it
/// no longer than `deadline`. A measurement that outlives the deadline goes
/// on in the background and is kept for the next call; the caller gets
/// what was measured before, with its age, or nothing.
pub struct Book<K, T> {
    slots: Arc<Mutex<HashMap<K, Slot<T>>>>,
}

impl<K, T> Default for Book<K, T> {
    fn default() -> Self {
        Book {
            slots: Arc::new(Mutex::new(HashMap::new())),
        }
    }
}

/// A book's answer.
#[derive(Debug, Clone)]
pub enum Answer<T> {
    /// Measured within the freshness asked for, or by this call.
    Fresh(Measured<T>),
    /// The measurement did not finish in time: the last one before it,
    /// if any.
    Late(Option<Measured<T>>),
}

impl<K, T> Book<K, T>
where
    K: Eq + Hash + Clone + Send + 'static,
    T: Clone + Send + Sync + 'static,
{
    pub async fn get<F>(&self, key: K, fresh: Duration, deadline: Duration, measure: F) -> Answer<T>
    where
        F: Future<Output = T> + Send + 'static,
    {
        let mut rx = {
            let mut slots = self.slots.lock().unwrap_or_else(|e| e.into_inner());
            let slot = slots.entry(key.clone()).or_insert(Slot {
                last: None,
                running: None,
            });
            if let Some(m) = &slot.last {
                if m.at.elapsed() <= fresh {
                    return Answer::Fresh(m.clone());
                }
            }
            match &slot.running {
                Some(rx) => rx.clone(),
                None => {
                    let (tx, rx) = watch::channel(None);
                    slot.running = Some(rx.clone());
                    let slots = self.slots.clone();
                    let key = key.clone();
                    tokio::spawn(async move {
                        let value = measure.await;
                        let m = Measured {
                            value,
                            at: Instant::now(),
                        };
                        let mut slots = slots.lock().unwrap_or_else(|e| e.into_inner());
                        if let Some(slot) = slots.get_mut(&key) {
                            slot.last = Some(m.clone());
                            slot.running = None;
                        }
                        let _ = tx.send(Some(m));
                    });
                    rx
                }
            }
        };
        let done = tokio::time::timeout(deadline, rx.wait_for(|v| v.is_some())).await;
        match done {
            Ok(Ok(m)) => Answer::Fresh(m.clone().expect("waited for a value")),
            _ => {
                let slots = self.slots.lock().unwrap_or_else(|e| e.into_inner());
                Answer::Late(slots.get(&key).and_then(|s| s.last.clone()))
            }
        }
    }

    /// Forgets a key (a volume deleted or unstaged).
    pub fn forget(&self, key: &K) {
        let mut slots = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        if slots.get(key).is_some_and(|s| s.running.is_none()) {
            slots.remove(key);
        }
    }
}

/// A volume's findings from a book's answer: a late measurement says so
/// (the last findings, with their age, and that the check timed out).
pub fn findings_of(answer: Answer<Vec<Finding>>, deadline: Duration) -> Vec<Finding> {
    match answer {
        Answer::Fresh(m) => m.value,
        Answer::Late(last) => {
            let mut findings = vec![Finding::inaccessible(
                Reason::HealthCheckTimedOut,
                match &last {
                    Some(m) if m.value.is_empty() => format!(
                        "the health check did not finish within {} s; the one before, {} s ago, \
                         found nothing wrong",
                        deadline.as_secs_f64(),
                        m.at.elapsed().as_secs()
                    ),
                    Some(m) => format!(
                        "the health check did not finish within {} s; what follows was measured {} s ago",
                        deadline.as_secs_f64(),
                        m.at.elapsed().as_secs()
                    ),
                    None => format!(
                        "the health check did not finish within {} s: the storage does not answer",
                        deadline.as_secs_f64()
                    ),
                },
            )];
            findings.extend(last.map(|m| m.value).unwrap_or_default());
            dedup(findings)
        }
    }
}

/// The finding for a volume its backend no longer has.
pub fn volume_not_found(id: &super::VolumeId) -> Finding {
    Finding::inaccessible(
        Reason::VolumeNotFound,
        format!("volume {id} is not on its backend"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_entry_per_status_and_reason_and_the_old_condition_from_them() {
        let f = dedup(vec![
            Finding::inaccessible(Reason::StagingMountGone, "a"),
            Finding::inaccessible(Reason::StagingMountGone, "b"),
            Finding::degraded(Reason::DeviceIOErrors, "c"),
        ]);
        assert_eq!(f.len(), 2);
        assert_eq!(condition(&f).as_deref(), Some("a; c"));
        assert_eq!(condition(&[]), None);
    }

    #[tokio::test]
    async fn a_hung_measurement_answers_late_once_and_is_never_run_twice() {
        let book: Book<&str, Vec<Finding>> = Book::default();
        let started = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let (release, hold) = tokio::sync::oneshot::channel::<()>();
        let s = started.clone();
        let short = Duration::from_millis(50);
        // The first measurement hangs until released.
        let answer = book
            .get("v", Duration::ZERO, short, async move {
                s.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let _ = hold.await;
                vec![Finding::degraded(Reason::DeviceIOErrors, "slow")]
            })
            .await;
        assert!(matches!(answer, Answer::Late(None)));
        let f = findings_of(answer, short);
        assert_eq!(f[0].reason, Reason::HealthCheckTimedOut);
        // A second call while it hangs starts nothing new and is late too.
        let s = started.clone();
        let answer = book
            .get("v", Duration::ZERO, short, async move {
                s.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                vec![]
            })
            .await;
        assert!(matches!(answer, Answer::Late(None)));
        assert_eq!(started.load(std::sync::atomic::Ordering::SeqCst), 1);
        // Released, its result is what the next call gets while fresh
        // (waited for if it is still being written, measured again never).
        release.send(()).unwrap();
        let answer = book
            .get(
                "v",
                Duration::from_secs(60),
                Duration::from_secs(30),
                async { vec![] },
            )
            .await;
        match answer {
            Answer::Fresh(m) => assert_eq!(m.value[0].message, "slow"),
            other => panic!("{other:?}"),
        }
    }
}
