//! The `rbd` backend's health as the cluster sees a volume: its image gone,
//! or open by clients that no node it is published to recorded as its own
//! (a mapping left behind on a node, a client outside this driver).

use super::*;
use crate::plugin::health::Finding;
use crate::plugin::HealthReporter;
use std::collections::BTreeSet;

crate::reasons! {
    /// The health reasons only this backend gives (the shared ones are
    /// [`crate::plugin::health::Reason`]'s).
    pub mod reasons {
        /// The rbd image is no longer mapped at the staged device.
        MappingGone,
        /// This node's client was fenced (blocklisted) by a detach while the
        /// volume was staged here.
        ClientFenced,
        /// The Ceph cluster does not answer this node.
        ClusterNotAnswering,
        /// The rbd image is open (watched) by a client that no node the volume
        /// is published to recorded as its own.
        WatchersElsewhere,
    }
}

/// How long apart the image's watchers are read twice before a client is
/// called foreign: a tool's brief open of the image (a resize, a metadata
/// write of this driver's controller) is gone by the second read.
const WATCHERS_AGAIN_AFTER: Duration = Duration::from_secs(2);

/// An address as the kernel shows it (`10.0.0.2:0/3459289423`), without
/// the messenger's `v1:`/`v2:`/`any:` prefix `rbd status` may give it.
fn bare(addr: &str) -> &str {
    ["v1:", "v2:", "any:"]
        .iter()
        .find_map(|p| addr.strip_prefix(p))
        .unwrap_or(addr)
}

#[async_trait::async_trait]
impl HealthReporter for RbdBackend {
    async fn volume_health(&self, id: &VolumeId, secrets: &Secrets) -> Result<Vec<Finding>> {
        let not_found = || Ok(vec![crate::plugin::health::volume_not_found(id)]);
        let Ok(spec) = self.volume_spec(id) else {
            return not_found();
        };
        let creds = self.creds(secrets)?;
        let Some((_, meta)) = self.rbd().describe(&creds, &spec).await? else {
            return not_found();
        };
        if !meta.contains_key(META_NAME) {
            return not_found();
        }
        // A node it is published to that recorded no client yet (not
        // staged yet, or a kernel that shows no address) may hold one
        // watch the records cannot name.
        let unrecorded = meta
            .keys()
            .filter_map(|k| k.strip_prefix(META_NODE))
            .filter(|node| !meta.contains_key(&client_key(node)))
            .count();
        let foreign = self
            .foreign_watchers(&creds, &spec, &meta, unrecorded)
            .await?;
        Ok(watchers_finding(&spec, &foreign).into_iter().collect())
    }
}

impl RbdBackend {
    /// The clients that watch the image (have it open) and that no node
    /// recorded in `meta` as its own, when there are more than `allowed`
    /// of them: read twice, [`WATCHERS_AGAIN_AFTER`] apart, and only those
    /// there both times.
    pub(super) async fn foreign_watchers(
        &self,
        creds: &Creds,
        spec: &Spec,
        meta: &BTreeMap<String, String>,
        allowed: usize,
    ) -> Result<Vec<String>> {
        let recorded: BTreeSet<&str> = meta
            .iter()
            .filter(|(k, _)| k.starts_with(META_CLIENT))
            .map(|(_, v)| bare(v))
            .collect();
        let foreign = |watchers: Vec<String>| -> BTreeSet<String> {
            watchers
                .iter()
                .map(|w| bare(w))
                .filter(|w| !recorded.contains(w))
                .map(str::to_string)
                .collect()
        };
        let first = foreign(self.rbd().watchers(creds, spec).await?);
        if first.len() <= allowed {
            return Ok(Vec::new());
        }
        tokio::time::sleep(WATCHERS_AGAIN_AFTER).await;
        let again = foreign(self.rbd().watchers(creds, spec).await?);
        let both: Vec<String> = first.intersection(&again).cloned().collect();
        Ok(if both.len() > allowed {
            both
        } else {
            Vec::new()
        })
    }
}

/// What foreign watchers of an image mean for its volume.
pub(super) fn watchers_finding(spec: &Spec, foreign: &[String]) -> Option<Finding> {
    if foreign.is_empty() {
        return None;
    }
    Some(Finding::degraded(
        reasons::WatchersElsewhere,
        format!(
            "image {} is open by client(s) {} that no node it is published to recorded as its \
             own: a mapping left on a node, or a client outside this driver; two writers of a \
             single-node volume corrupt it",
            spec.arg(),
            foreign.join(", ")
        ),
    ))
}
