//! A publish's I/O limits (see [`crate::host::iolimit`]): set in the
//! pod's cgroup for the device the pod's I/O goes to, recorded in the
//! publish's record before they are written (a driver killed in between
//! leaves a record that names them, so the unpublish clears them), and
//! cleared at unpublish unless another publish of the same pod still
//! holds them. A pod whose cgroup is not found gets its volume
//! unlimited: the publish succeeds, and the log and the volume's health
//! say why.

use super::*;
use crate::host::iolimit::{self, LimitChanges, Limits};
use crate::plugin::Relimit;
use crate::state::Limited;
use std::collections::BTreeMap;

impl NodeOps {
    /// Where this publish's limits go: the pod's cgroup and the device
    /// number; why not, when they cannot be set.
    pub(super) fn io_target(
        &self,
        req: &PublishRequest,
        stage: &StageRecord,
        record: &PublishRecord,
        limits: Limits,
    ) -> std::result::Result<Limited, String> {
        let Some(uid) = &req.io.pod_uid else {
            return Err("the publish names no pod (is the CSIDriver's podInfoOnMount on?)".into());
        };
        let cgroup = match self.cgroups.pod(uid) {
            Ok(Some(c)) => c,
            Ok(None) => {
                return Err(format!(
                    "no cgroup of pod {uid} under {}",
                    self.cgroups.root().display()
                ))
            }
            Err(e) => return Err(e.message),
        };
        let device = record
            .device
            .clone()
            .or_else(|| stage.device())
            .ok_or_else(|| "the volume has no block device to limit".to_string())?;
        let dev = iolimit::device_number(&device).map_err(|e| e.message)?;
        Ok(Limited {
            pod: uid.clone(),
            cgroup,
            dev,
            limits,
        })
    }

    /// The limits a publish's pod gets now: its volume's at creation, with
    /// every change the book has made over them.
    pub(super) fn limits_now(&self, record: &PublishRecord) -> Limits {
        let base = record
            .class_limits
            .or_else(|| record.limited.as_ref().map(|l| l.limits))
            .unwrap_or_default();
        match &self.limit_book {
            Some(book) => base.changed(&book.get(&record.volume_id)),
            None => base,
        }
    }

    /// Sets what the book says now for the pod of the publish at `target`
    /// (its record first). Whether the pod is limited as the book says.
    pub(super) async fn relimit_target(&self, target: &Path) -> bool {
        let _held = self.limits_held.lock().await;
        let Some(mut record) = self.state.publish(target) else {
            return false;
        };
        let wanted = self.limits_now(&record);
        let Some(limited) = record.limited.as_mut() else {
            // No pod and device were found when it was published: a limit
            // cannot reach it until it is published again.
            let why = (!wanted.is_empty()).then(|| {
                record.unlimited.clone().unwrap_or_else(|| {
                    "its pod's cgroup was not found when the volume was published to it (the \
                     pod's next start limits it)"
                        .to_string()
                })
            });
            if why != record.unlimited {
                record.unlimited = why;
                self.keep_record(record);
            }
            return false;
        };
        if limited.limits == wanted && record.unlimited.is_none() {
            return true;
        }
        limited.limits = wanted;
        let at = limited.clone();
        record.unlimited = None;
        self.keep_record(record.clone());
        match self.write_limits(at, wanted).await {
            Ok(()) => {
                tracing::info!(volume = %record.volume_id, target = %target.display(),
                    limits = ?wanted, "the pod's I/O limits changed");
                true
            }
            Err(e) => {
                tracing::warn!(volume = %record.volume_id, target = %target.display(),
                    error = %e.message, "the pod's changed I/O limits could not be set");
                record.unlimited = Some(e.message);
                self.keep_record(record);
                false
            }
        }
    }

    fn keep_record(&self, record: PublishRecord) {
        if let Err(e) = self.state.put_publish(record) {
            tracing::warn!(error = %e.message, "could not record a publish's I/O limits");
        }
    }

    /// Sets the limits a publish recorded; a failure leaves the volume
    /// unlimited for this pod, said in its record (and so in its health).
    pub(super) async fn set_limits(&self, mut record: PublishRecord) {
        let Some(l) = record.limited.clone().filter(|l| !l.limits.is_empty()) else {
            if let Some(why) = &record.unlimited {
                tracing::warn!(volume = %record.volume_id, target = %record.target_path.display(),
                    "the volume's I/O limits are not set for this pod: {why}");
            }
            return;
        };
        match self.write_limits(l.clone(), l.limits).await {
            Ok(()) => {
                tracing::info!(volume = %record.volume_id, target = %record.target_path.display(),
                    "I/O limits set for the pod")
            }
            Err(e) => {
                tracing::warn!(volume = %record.volume_id, target = %record.target_path.display(),
                    error = %e.message, "the volume's I/O limits could not be set for this pod");
                record.unlimited = Some(e.message);
                self.keep_record(record);
            }
        }
    }

    /// At start: the limits every record names are written again (a
    /// driver killed between a publish's record and its `io.max` left
    /// them unwritten, and the CO's retry of that publish finds it done).
    /// A pod's cgroup that is gone has nothing to hold; a write that fails
    /// is said. Returns how many were written.
    pub fn restore_limits(&self) -> usize {
        let mut written = 0;
        for mut r in self.state.publishes() {
            // A change the book has that the record does not (a driver
            // killed between the two) is made too.
            let wanted = self.limits_now(&r);
            let Some(l) = r.limited.as_mut() else {
                continue;
            };
            let was = l.limits;
            l.limits = wanted;
            let l = l.clone();
            if was != wanted {
                self.keep_record(r.clone());
            }
            if (was.is_empty() && wanted.is_empty()) || !l.cgroup.exists() {
                continue;
            }
            match self.cgroups.set(&l.cgroup, l.dev, &l.limits) {
                Ok(()) => written += 1,
                Err(e) => tracing::warn!(volume = %r.volume_id, target = %r.target_path.display(),
                    error = %e.message, "the pod's I/O limits could not be written again at start"),
            }
        }
        written
    }

    /// Clears what an unpublished target's record set, unless another
    /// publish on this node set the same (the same pod publishing the
    /// volume twice). A cgroup gone with its pod has nothing to clear.
    pub(super) async fn clear_limits(&self, record: &PublishRecord) {
        let Some(l) = record.limited.clone().filter(|l| !l.limits.is_empty()) else {
            return;
        };
        let shared = self.state.publishes().iter().any(|o| {
            o.target_path != record.target_path
                && o.limited
                    .as_ref()
                    .is_some_and(|x| x.cgroup == l.cgroup && x.dev == l.dev && !x.limits.is_empty())
        });
        if shared || !l.cgroup.exists() {
            return;
        }
        let cleared = self.write_limits(l, Limits::default()).await;
        if let Err(e) = cleared {
            tracing::warn!(volume = %record.volume_id, error = %e.message,
                "could not clear the pod's I/O limits (they go with its cgroup)");
        }
    }

    /// The limits in force for the pod of the publish at `target`, in
    /// words (`I/O limited for pod <uid>: writeIops=200 ...`, bytes per
    /// second as numbers); none when it has none.
    pub(super) fn limits_in_force(&self, target: &Path) -> Option<String> {
        let l = self.state.publish(target)?.limited?;
        let said: Vec<String> = l
            .limits
            .pairs()
            .into_iter()
            .filter_map(|(k, v)| Some(format!("{k}={}", v?)))
            .collect();
        if said.is_empty() {
            return None;
        }
        let mut words = format!("I/O limited for pod {}: {}", l.pod, said.join(" "));
        if let Some((_, secs)) = self
            .cgroups
            .stalled(&l.cgroup)
            .into_iter()
            .find(|(k, _)| k == "some")
        {
            words.push_str(&format!("; the pod stalled on I/O {secs:.1} s in all"));
        }
        Some(words)
    }

    /// Each limited pod's limits and what it did on the volume's device
    /// (read from its cgroup now), for the metrics.
    pub fn pod_io(&self) -> Vec<crate::metrics::PodIo> {
        self.state
            .publishes()
            .into_iter()
            .filter_map(|r| {
                let l = r.limited.filter(|l| !l.limits.is_empty())?;
                Some(crate::metrics::PodIo {
                    volume_id: r.volume_id.to_string(),
                    pod_uid: l.pod.clone(),
                    limits: l
                        .limits
                        .pairs()
                        .into_iter()
                        .filter_map(|(k, v)| Some((k, v?)))
                        .collect(),
                    usage: self.cgroups.usage(&l.cgroup, l.dev),
                    stalled: self.cgroups.stalled(&l.cgroup),
                })
            })
            .collect()
    }

    /// Writes `limits` for the pod and device `at` names, off the async
    /// threads (a write to `io.max` may wait on the cgroup's lock).
    async fn write_limits(&self, at: Limited, limits: Limits) -> Result<()> {
        let cgroups = self.cgroups.clone();
        tokio::task::spawn_blocking(move || cgroups.set(&at.cgroup, at.dev, &limits))
            .await
            .unwrap_or_else(|e| Err(Error::internal(e.to_string())))
    }

    /// What the volume's publishes say of its limits: one finding naming
    /// every target whose pod is unlimited, and why.
    pub(super) fn limit_findings(&self, id: &VolumeId) -> Vec<Finding> {
        let mut unset: Vec<String> = self
            .state
            .publishes_of(id)
            .into_iter()
            .filter_map(|r| {
                r.unlimited
                    .map(|why| format!("{}: {why}", r.target_path.display()))
            })
            .collect();
        if unset.is_empty() {
            return Vec::new();
        }
        unset.sort();
        vec![Finding::degraded(
            Reason::IoLimitNotApplied,
            format!(
                "the volume's I/O limits are not set for {} of its pods ({})",
                unset.len(),
                unset.join("; ")
            ),
        )]
    }
}

#[async_trait::async_trait]
impl Relimit for NodeOps {
    /// Sets the book's limits on every publish of `id` here.
    async fn relimit(&self, id: &VolumeId) -> usize {
        let mut set = 0;
        for r in self.state.publishes_of(id) {
            if self.relimit_target(&r.target_path).await {
                set += 1;
            }
        }
        set
    }
}

/// The controller's address in a `limits_from` setting (`http://host:port`,
/// nothing after it): its `host:port`.
pub fn limits_authority(url: &str) -> Result<String> {
    let bad = |why: &str| Error::invalid(format!("node.limits_from {url:?}: {why}"));
    let rest = url
        .strip_prefix("http://")
        .ok_or_else(|| bad("not an http:// address"))?
        .trim_end_matches('/');
    let (host, port) = rest
        .rsplit_once(':')
        .ok_or_else(|| bad("it names no port"))?;
    let port_ok = port.parse::<u16>().is_ok_and(|p| p > 0);
    let host_ok = !host.is_empty()
        && host
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-.[]:".contains(&b));
    if !port_ok || !host_ok {
        return Err(bad("not a host and port"));
    }
    Ok(rest.to_string())
}

/// How long a node waits for the controller's answer.
const ASK_DEADLINE: std::time::Duration = std::time::Duration::from_secs(10);
/// How long a publish waits for it.
const FIRST_ASK_DEADLINE: std::time::Duration = std::time::Duration::from_secs(3);
/// The most of an answer a node reads.
const ANSWER_BYTES: usize = 8 << 20;

/// What a controller answers a node: the changes made to the limits of
/// the volumes it asked about (those it can say, by id), and the changes
/// offered to node-local volumes' nodes (the central controller of
/// node-local volumes').
#[derive(Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct LimitsAnswer {
    #[serde(default)]
    pub volumes: BTreeMap<String, LimitChanges>,
    #[serde(default)]
    pub offers: Vec<crate::plugin::Offer>,
}

/// Asks the controller at `authority` for the changes made to `ids`'
/// limits and for what it offers, saying which offers this node took
/// (`taken`: volume and generation).
pub async fn ask_limits(
    authority: &str,
    ids: &[String],
    taken: &[(String, u64)],
    deadline: std::time::Duration,
) -> Result<LimitsAnswer> {
    use http_body_util::BodyExt;
    let failed = |what: String| {
        Error::unavailable(format!(
            "the I/O limits could not be asked of the controller at {authority}: {what}"
        ))
    };
    let ask = async {
        let stream = tokio::net::TcpStream::connect(authority)
            .await
            .map_err(|e| failed(e.to_string()))?;
        let (mut sender, conn) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
                .await
                .map_err(|e| failed(e.to_string()))?;
        tokio::spawn(conn);
        let taken: Vec<String> = taken.iter().map(|(v, g)| format!("{v}@{g}")).collect();
        let query = format!("volumes={}&taken={}", ids.join(","), taken.join(","));
        let request = hyper::Request::get(format!("{LIMITS_PATH}?{query}"))
            .header(hyper::header::HOST, authority)
            .body(http_body_util::Empty::<hyper::body::Bytes>::new())
            .map_err(|e| failed(e.to_string()))?;
        let answer = sender
            .send_request(request)
            .await
            .map_err(|e| failed(e.to_string()))?;
        let status = answer.status();
        let body = http_body_util::Limited::new(answer.into_body(), ANSWER_BYTES)
            .collect()
            .await
            .map_err(|e| failed(e.to_string()))?
            .to_bytes();
        if !status.is_success() {
            return Err(failed(format!(
                "it answered {status}: {}",
                String::from_utf8_lossy(&body[..body.len().min(200)]).trim()
            )));
        }
        serde_json::from_slice(&body).map_err(|e| failed(format!("its answer: {e}")))
    };
    tokio::time::timeout(deadline, ask)
        .await
        .unwrap_or_else(|_| Err(failed(format!("no answer in {deadline:?}"))))
}

/// The path a controller serves the changes to volumes' limits on.
pub const LIMITS_PATH: &str = "/limits";

impl NodeOps {
    /// Asks the controller for the changes to the limits of the volumes
    /// published here (a node mirroring a remote controller: it keeps
    /// what it is told and forgets the volumes no longer published here)
    /// and for the changes it offers (a node-local volume's node takes
    /// its volumes': kept in its book, set on their pods, then said
    /// taken). Sets what changed on the pods; returns how many volumes'
    /// limits changed.
    pub async fn refresh_limits(&self, authority: &str) -> Result<usize> {
        let Some(book) = &self.limit_book else {
            return Ok(0);
        };
        let published: std::collections::BTreeSet<String> = self
            .state
            .publishes()
            .iter()
            .map(|r| r.volume_id.to_string())
            .collect();
        if self.limits_mirrored {
            for gone in book.all().into_keys().filter(|k| !published.contains(k)) {
                if let Ok(id) = VolumeId::parse(&gone) {
                    book.forget(&id)?;
                }
            }
        }
        let ids: Vec<String> = match self.limits_mirrored {
            true => published.iter().cloned().collect(),
            false => Vec::new(),
        };
        let said = ask_limits(authority, &ids, &[], ASK_DEADLINE).await?;
        let mut changed = 0;
        for (raw, changes) in said.volumes {
            let Ok(id) = VolumeId::parse(&raw) else {
                continue;
            };
            if !self.limits_mirrored || !published.contains(&raw) || book.get(&id) == changes {
                continue;
            }
            book.set(&id, &changes)?;
            self.relimit(&id).await;
            changed += 1;
        }
        let mut taken = Vec::new();
        for offer in said.offers {
            let Ok(id) = VolumeId::parse(&offer.volume) else {
                continue;
            };
            if self.limits_mirrored || !self.holds(&id).await {
                continue;
            }
            book.change(&id, &offer.changes)?;
            crate::killpoint::hit(crate::killpoint::Step::LimitsTaken);
            let set = self.relimit(&id).await;
            tracing::info!(volume = %id, changes = ?offer.changes, publishes = set,
                "a change to the volume's I/O limits taken from the controller");
            taken.push((offer.volume, offer.generation));
            changed += 1;
        }
        if !taken.is_empty() {
            ask_limits(authority, &[], &taken, ASK_DEADLINE).await?;
        }
        Ok(changed)
    }

    /// Whether volume `id` is this node's (its backend here has it).
    async fn holds(&self, id: &VolumeId) -> bool {
        let Ok(backend) = self.registry.for_volume(id) else {
            return false;
        };
        let Ok(provisioning) = backend.provisioning() else {
            return false;
        };
        matches!(
            provisioning
                .get_volume(id, &crate::plugin::Secrets::default())
                .await,
            Ok(Some(_))
        )
    }

    /// Asks the controller for the changes to `id`'s limits, when this
    /// node asks one and has not asked about `id` yet (its first publish
    /// here): a short wait; a controller that does not answer leaves the
    /// volume's own limits until the next refresh brings its changes.
    pub(super) async fn ask_first(&self, id: &VolumeId) {
        let (Some(from), Some(book)) = (&self.limits_from, &self.limit_book) else {
            return;
        };
        if book.has(id) {
            return;
        }
        if !self.limits_mirrored {
            return;
        }
        let asked = ask_limits(from, &[id.to_string()], &[], FIRST_ASK_DEADLINE).await;
        let kept = asked.and_then(|said| match said.volumes.get(&id.to_string()) {
            Some(changes) => book.set(id, changes),
            None => Ok(()),
        });
        if let Err(e) = kept {
            tracing::warn!(volume = %id, error = %e.message,
                "published with the volume's own I/O limits; a change is taken at the next refresh");
        }
    }
}
