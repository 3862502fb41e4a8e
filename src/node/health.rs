//! The node's view of health (CSI v1.13's NodeGetVolumeHealth and
//! NodeGetStorageHealth, and v1.12's condition in NodeGetVolumeStats, read
//! from the same findings). Every measurement goes through a book with the
//! quick deadline: storage that does not answer makes the call answer late
//! with what was known, never hold it, and never holds another volume's.

use super::*;
use crate::plugin::health::{self, Answer, Book, Finding, Reason, StorageFinding, StorageStatus};

/// Per volume: its findings when last measured.
pub(super) type VolumeBook = Book<String, Vec<Finding>>;

/// Per backend: what was wrong with it when last checked.
pub(super) type StorageBook = Book<String, Vec<StorageFinding>>;

impl NodeOps {
    /// What is wrong with a staged volume, as its backend measures what it
    /// set up on this node.
    pub(super) async fn measured_health(
        &self,
        id: &VolumeId,
        stage: &StageRecord,
    ) -> Result<Vec<Finding>> {
        let backend = self.backend(id)?.clone();
        backend.staging()?;
        let Some(attachment) = stage.attachment.clone() else {
            return Ok(vec![Finding::inaccessible(
                Reason::NotAttached,
                "the volume's device was never attached",
            )]);
        };
        let key = id.clone();
        let measure = async move {
            health::from_check(match backend.staging() {
                Ok(stager) => stager.node_health(&key, &attachment).await,
                Err(e) => Err(e),
            })
        };
        // Half the call's deadline: the mount checks that follow have the
        // rest.
        Ok(self
            .through_book(id, self.deadlines.quick / 2, measure)
            .await)
    }

    /// NodeGetVolumeHealth: what is wrong with a volume on this node. A
    /// node-local volume not staged here (a stage that failed, or none yet)
    /// is asked of its backend, which holds it on this node; a remote one
    /// has nothing of this node's to measure (empty). An id no backend of
    /// this driver made is NOT_FOUND. Paths, when given, must be where the
    /// volume is (or was to be): a staging path or target of another volume
    /// is refused.
    pub async fn volume_health(
        &self,
        id: &VolumeId,
        publish_path: &str,
        staging_path: &str,
    ) -> Result<Vec<Finding>> {
        self.backend(id)?;
        let publish_path = optional_path(publish_path, "volume_publish_path")?;
        let staging_path = optional_path(staging_path, "staging_target_path")?;
        let Some(stage) = self.state.stage(id) else {
            return Ok(self.unstaged_health(id).await);
        };
        if staging_path
            .as_ref()
            .is_some_and(|p| *p != stage.staging_path)
        {
            return Err(Error::not_found(format!(
                "volume {id} is staged at {}, not at the staging_target_path given",
                stage.staging_path.display()
            )));
        }
        if let Some(p) = &publish_path {
            if self.state.publish(p).is_some_and(|r| &r.volume_id != id) {
                return Err(Error::not_found(format!(
                    "{} is another volume's target",
                    p.display()
                )));
            }
        }
        // Every step shares one deadline: the call answers within it.
        let until = std::time::Instant::now() + self.deadlines.quick;
        let mut found = self.measured_health(id, &stage).await?;
        let remote = matches!(stage.attachment, Some(Attachment::Remote { .. }));
        if matches!(stage.capability.access, AccessType::Mount { .. }) {
            match self.mounted_by(&stage.staging_path, until).await {
                Ok(true) => {}
                Ok(false) => found.push(Finding::inaccessible(
                    Reason::StagingMountGone,
                    format!("staging mount {} is gone", stage.staging_path.display()),
                )),
                Err(e) if remote => found.push(not_answering(&e)),
                Err(e) => found.push(Finding::inaccessible(
                    Reason::HealthCheckFailed,
                    format!("the staging mount could not be checked: {}", e.message),
                )),
            }
        }
        if let Some(p) = publish_path.filter(|p| self.state.publish(p).is_some()) {
            if let Ok(false) = self.mounted_by(&p, until).await {
                found.push(Finding::inaccessible(
                    Reason::PublishMountGone,
                    format!("the volume is no longer mounted at {}", p.display()),
                ));
            }
        }
        Ok(health::dedup(found))
    }

    /// A volume's check through the book, answered within `deadline`.
    async fn through_book(
        &self,
        id: &VolumeId,
        deadline: Duration,
        measure: impl std::future::Future<Output = Vec<Finding>> + Send + 'static,
    ) -> Vec<Finding> {
        let answer = self
            .health
            .get(id.to_string(), Duration::ZERO, deadline, measure)
            .await;
        health::findings_of(answer, deadline)
    }

    /// Whether `path` is mounted, answered by `until` (UNAVAILABLE after).
    pub(super) async fn mounted_by(&self, path: &Path, until: std::time::Instant) -> Result<bool> {
        let left = until.saturating_duration_since(std::time::Instant::now());
        match tokio::time::timeout(left, self.is_mounted(path)).await {
            Ok(answer) => answer,
            Err(_) => Err(Error::unavailable(format!(
                "checking whether {} is mounted: no answer within the call's deadline",
                path.display()
            ))),
        }
    }

    /// A volume not staged here: its backend's own view when the volume
    /// lives on this node, through the book.
    async fn unstaged_health(&self, id: &VolumeId) -> Vec<Finding> {
        let Ok(backend) = self.backend(id).cloned() else {
            return Vec::new();
        };
        if !backend.node_local() || backend.health_reporter().is_none() {
            return Vec::new();
        }
        let key = id.clone();
        let measure = async move {
            let reporter = backend.health_reporter().expect("checked above");
            health::from_check(reporter.volume_health(&key, &Secrets::default()).await)
        };
        self.through_book(id, self.deadlines.quick, measure).await
    }

    /// NodeGetStorageHealth: each backend as this node sees it, checked
    /// through its `health`, all at once, each through the book within the
    /// quick deadline. One entry per (status, reason): backends that fail
    /// alike share it, each named in its message.
    pub async fn storage_health(&self) -> Vec<StorageFinding> {
        let deadline = self.deadlines.quick;
        let checks: Vec<_> = self
            .registry
            .all()
            .cloned()
            .map(|backend| {
                let book = self.storage.clone();
                tokio::spawn(async move {
                    let name = backend.name().to_string();
                    let measure = async move {
                        match backend.health().await {
                            Err(e) => vec![StorageFinding {
                                status: StorageStatus::Unreachable,
                                reason: Reason::BackendNotReady,
                                message: e.message,
                            }],
                            Ok(()) => backend.storage_findings().await,
                        }
                    };
                    let named = |f: StorageFinding| StorageFinding {
                        message: format!("{name}: {}", f.message),
                        ..f
                    };
                    match book
                        .get(name.clone(), Duration::ZERO, deadline, measure)
                        .await
                    {
                        Answer::Fresh(m) => m.value.into_iter().map(named).collect(),
                        Answer::Late(_) => vec![StorageFinding {
                            status: StorageStatus::Unreachable,
                            reason: Reason::HealthCheckTimedOut,
                            message: format!("{name}: no answer within {} s", deadline.as_secs()),
                        }],
                    }
                })
            })
            .collect();
        let mut by_kind: std::collections::BTreeMap<(StorageStatus, Reason), Vec<String>> =
            Default::default();
        for check in checks {
            for f in check.await.unwrap_or_default() {
                by_kind
                    .entry((f.status, f.reason))
                    .or_default()
                    .push(f.message);
            }
        }
        by_kind
            .into_iter()
            .map(|((status, reason), messages)| StorageFinding {
                status,
                reason,
                message: messages.join("; "),
            })
            .collect()
    }
}

/// A path field that may be empty; when given, it must be a clean absolute
/// path, as every path the driver takes.
fn optional_path(raw: &str, field: &str) -> Result<Option<PathBuf>> {
    if raw.is_empty() {
        return Ok(None);
    }
    paths::validate(raw, field).map(Some)
}
