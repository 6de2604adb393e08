//! One reconcile of one domain: membership from its allocated channel claims, the daemons'
//! state, its status (one writer, server-side apply) and the binding conditions.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::ResourceExt;
use kube::api::{Api, ListParams, Patch, PatchParams};
use kube::runtime::controller::Action;
use serde_json::json;

use crate::crd::{ComputeDomainStatus, Condition, Domain, NOT_READY, READY};
use crate::imex::{self, DOMAIN_UID_LABEL, DaemonState};
use crate::membership::{self, Channel};
use crate::*;

/// The desired binding condition of one channel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Binding {
    Ready,
    Failed { reason: String, message: String },
}

/// Reconciles one domain: finalizer, template, membership, ConfigMap, daemon Pods, status,
/// claim binding conditions.
///
/// # Errors
/// The first failed API call ([`Error::Api`]) or an object that cannot be built
/// ([`Error::Build`]).
pub async fn reconcile<D: Domain>(domain: Arc<D>, ctx: Arc<Context<D>>) -> Result<Action, Error> {
    let ns = domain.namespace().unwrap_or_default();
    let name = domain.name_any();
    let key = format!("{ns}/{name}");
    let Some(uid) = domain.meta().uid.clone() else {
        return Ok(Action::await_change());
    };
    let timeout = ctx.settings.api_timeout;
    let api = Api::<D>::namespaced(ctx.client.clone(), &ns);
    if domain.meta().deletion_timestamp.is_some() {
        return ctx.finalize(&api, &domain, &uid, &key).await;
    }
    if !domain.finalizers().iter().any(|f| f == FINALIZER) {
        let mut finalizers = domain.finalizers().to_vec();
        finalizers.push(FINALIZER.to_owned());
        // The resourceVersion makes a concurrent change of the list fail instead of losing it.
        let patch = json!({"metadata": {"finalizers": finalizers,
                           "resourceVersion": domain.resource_version()}});
        call(
            timeout,
            "add the finalizer to",
            || format!("ComputeDomain {key}"),
            api.patch(&name, &PatchParams::default(), &Patch::Merge(&patch)),
        )
        .await?;
    }
    // The status as the API server has it now, not as the cache had it: indices are kept
    // from it, and a stale copy would renumber a node (NVIDIA #1440).
    let fresh = call(
        timeout,
        "get",
        || format!("ComputeDomain {key}"),
        api.get_status(&name),
    )
    .await?;
    let previous = fresh.domain_status().cloned().unwrap_or_default();
    let mut conditions: Vec<Condition> = Vec::new();
    if let Some(c) = ctx.ensure_template(&domain, &uid, &key).await? {
        conditions.push(c);
    }

    // Membership: the nodes this domain's allocated channel claims are on.
    // Listed, not cached: a cache behind the API server would drop a member for a moment.
    let by_domain = ListParams::default().labels(&format!("{DOMAIN_UID_LABEL}={uid}"));
    let claims: Vec<Arc<ResourceClaim>> = call(
        timeout,
        "list the channel claims of",
        || format!("ComputeDomain {key}"),
        Api::<ResourceClaim>::namespaced(ctx.client.clone(), &ns).list(&by_domain),
    )
    .await?
    .items
    .into_iter()
    .map(Arc::new)
    .collect();
    let daemon_ns = &ctx.settings.daemon.namespace;
    let pods: BTreeMap<String, Pod> = call(
        timeout,
        "list the daemon Pods of",
        || format!("ComputeDomain {key}"),
        Api::<Pod>::namespaced(ctx.client.clone(), daemon_ns).list(&by_domain),
    )
    .await?
    .items
    .into_iter()
    .map(|p| (p.name_any(), p))
    .collect();
    let slices = ctx.slices.state();
    let mut wanted: BTreeMap<String, String> = BTreeMap::new();
    let mut claim_channels: Vec<(Arc<ResourceClaim>, Vec<Channel>)> = Vec::new();
    for claim in claims {
        let channels = membership::channels(&claim);
        for ch in &channels {
            wanted.entry(ch.node.clone()).or_insert_with(|| {
                membership::clique(slices.iter().map(AsRef::as_ref), &ch.pool, &ch.device)
            });
        }
        if !channels.is_empty() {
            claim_channels.push((claim, channels));
        }
    }
    // A member whose channel no longer publishes a clique (registration IN_PROGRESS again, or
    // an unhealthy fabric) keeps the clique it had: its index and its peers' nodes files stay,
    // and it waits, not Ready, for the clique to come back. Another clique is a real move.
    let mut fabric_pending: BTreeMap<String, String> = BTreeMap::new();
    let mut moved: Vec<(String, String, String)> = Vec::new();
    for (node, clique) in &mut wanted {
        let Some(before) = previous.nodes.iter().find(|n| &n.name == node) else {
            continue;
        };
        if before.clique_id.is_empty() || *clique == before.clique_id {
            continue;
        }
        if clique.is_empty() {
            fabric_pending.insert(node.clone(), before.clique_id.clone());
            clique.clone_from(&before.clique_id);
        } else {
            moved.push((node.clone(), before.clique_id.clone(), clique.clone()));
        }
    }
    let refused = ctx.hold(&uid, &key, &wanted);
    let members: BTreeMap<String, String> = wanted
        .iter()
        .filter(|(n, _)| !refused.contains_key(*n))
        .map(|(n, c)| (n.clone(), c.clone()))
        .collect();
    let mut nodes = membership::assign(&previous.nodes, &members);

    // Daemon state per member.
    let mut failures: BTreeMap<String, (String, String)> = BTreeMap::new();
    for node in &mut nodes {
        let pod = pods.get(&imex::pod_name(&uid, &node.name));
        let ip = pod
            .as_ref()
            .and_then(|p| p.status.as_ref()?.pod_ip.clone())
            .unwrap_or_default();
        node.ip_address = ip;
        node.status = NOT_READY.to_owned();
        match imex::daemon_state(pod) {
            DaemonState::Ready(ip) => {
                node.ip_address = ip;
                node.status = READY.to_owned();
            }
            DaemonState::Failed(reason, message) => {
                failures.insert(node.name.clone(), (reason, message));
            }
            DaemonState::Starting => {}
        }
    }

    for node in &mut nodes {
        if fabric_pending.contains_key(&node.name) {
            node.status = NOT_READY.to_owned();
        }
    }

    ctx.apply_config_map(&uid, &key, &nodes).await?;
    ctx.sync_pods(&uid, &key, &nodes, &pods).await?;

    // Domain conditions and events.
    let mut failed_notes: Vec<String> = failures
        .iter()
        .map(|(node, (_, message))| format!("node {node}: {message}"))
        .collect();
    for (node, holder) in &refused {
        failed_notes.push(format!(
            "node {node}: clique or node already serves ComputeDomain {}",
            holder.domain
        ));
    }
    for (node, (reason, message)) in &failures {
        ctx.warn(&domain, &uid, reason, &format!("node {node}: {message}"))
            .await;
    }
    for (node, holder) in &refused {
        let note = format!(
            "a channel claim was allocated on node {node}, whose node or clique {} already \
             serves ComputeDomain {}; the claim gets {FAILED_CONDITION} so it is placed again",
            wanted.get(node).map(String::as_str).unwrap_or_default(),
            holder.domain
        );
        ctx.warn(&domain, &uid, CLIQUE_IN_USE, &note).await;
    }
    if !failed_notes.is_empty() {
        conditions.push(condition(
            DAEMON_FAILED,
            "DaemonCannotStart",
            &failed_notes.join("; "),
        ));
    }
    let fabric_notes: Vec<String> = fabric_pending
        .iter()
        .map(|(node, clique)| {
            let index = nodes
                .iter()
                .find(|n| &n.name == node)
                .map_or(-1, |n| n.index);
            format!(
                "node {node}: its IMEX channel publishes no NVLink clique (the GPUs' fabric \
                 registration is in progress again, or the fabric is unhealthy: see the \
                 devices' gpu.drust.dev/fabric taints); it keeps clique {clique} and index \
                 {index} and is not Ready until the clique is back"
            )
        })
        .collect();
    for note in &fabric_notes {
        ctx.warn(&domain, &uid, FABRIC_NOT_READY, note).await;
    }
    if !fabric_notes.is_empty() {
        conditions.push(condition(
            FABRIC_NOT_READY,
            FABRIC_NOT_READY,
            &fabric_notes.join("; "),
        ));
    }
    for (node, from, to) in &moved {
        let note = format!(
            "node {node}: its IMEX channel now publishes clique {to} instead of {from} (the \
             fabric was re-partitioned): it moves to that clique's nodes file"
        );
        ctx.warn(&domain, &uid, CLIQUE_CHANGED, &note).await;
    }
    let num_nodes = domain.domain_spec().num_nodes;
    let ready_count = nodes.iter().filter(|n| n.status == READY).count();
    let all_ready = !nodes.is_empty()
        && ready_count == nodes.len()
        && (num_nodes <= 0 || i64::try_from(ready_count).unwrap_or(i64::MAX) >= num_nodes);
    let status = ComputeDomainStatus {
        status: if all_ready { READY } else { NOT_READY }.to_owned(),
        nodes: nodes.clone(),
        conditions: keep_transition_times(conditions, &previous.conditions),
    };
    if status != previous {
        let patch = json!({
            "apiVersion": D::api_version(&()),
            "kind": D::kind(&()),
            "status": status,
        });
        call(
            timeout,
            "apply the status of",
            || format!("ComputeDomain {key}"),
            api.patch_status(
                &name,
                &PatchParams::apply(&ctx.settings.field_manager).force(),
                &Patch::Apply(&patch),
            ),
        )
        .await?;
    }

    // Binding conditions on every allocated channel claim.
    let ready: BTreeSet<&str> = nodes
        .iter()
        .filter(|n| n.status == READY)
        .map(|n| n.name.as_str())
        .collect();
    let mut writes = Vec::new();
    for (claim, channels) in &claim_channels {
        let mut desired = Vec::new();
        for ch in channels {
            let binding = if let Some(holder) = refused.get(&ch.node) {
                Some(Binding::Failed {
                    reason: CLIQUE_IN_USE.to_owned(),
                    message: format!(
                        "node {} or its clique already serves ComputeDomain {}",
                        ch.node, holder.domain
                    ),
                })
            } else if let Some((reason, message)) = failures.get(&ch.node) {
                Some(Binding::Failed {
                    reason: reason.clone(),
                    message: message.clone(),
                })
            } else if ready.contains(ch.node.as_str()) {
                Some(Binding::Ready)
            } else {
                None
            };
            if let Some(b) = binding {
                desired.push((ch.clone(), b));
            }
        }
        if !desired.is_empty() && !already_set(claim, &desired) {
            writes.push(ctx.set_bindings(Arc::clone(claim), desired));
        }
    }
    let results: Vec<Result<(), Error>> = futures::stream::iter(writes)
        .buffer_unordered(16)
        .collect()
        .await;
    results.into_iter().collect::<Result<Vec<()>, Error>>()?;
    Ok(Action::requeue(ctx.settings.resync))
}

/// A condition with `lastTransitionTime` now (replaced by the previous one when unchanged).
pub(crate) fn condition(type_: &str, reason: &str, message: &str) -> Condition {
    Condition {
        type_: type_.to_owned(),
        status: "True".to_owned(),
        reason: reason.to_owned(),
        message: message.to_owned(),
        last_transition_time: now(),
    }
}

pub(crate) fn now() -> String {
    serde_json::to_value(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
        k8s_openapi::jiff::Timestamp::now(),
    ))
    .ok()
    .and_then(|v| v.as_str().map(str::to_owned))
    .unwrap_or_default()
}

fn keep_transition_times(mut next: Vec<Condition>, previous: &[Condition]) -> Vec<Condition> {
    for c in &mut next {
        if let Some(p) = previous
            .iter()
            .find(|p| p.type_ == c.type_ && p.status == c.status)
        {
            c.last_transition_time = p.last_transition_time.clone();
        }
    }
    next
}

/// Whether every desired binding condition is already on the claim with the same status
/// and reason.
fn already_set(claim: &ResourceClaim, desired: &[(Channel, Binding)]) -> bool {
    let devices = claim
        .status
        .as_ref()
        .and_then(|s| s.devices.as_ref())
        .map(Vec::as_slice)
        .unwrap_or_default();
    desired.iter().all(|(ch, b)| {
        let Some(entry) = devices.iter().find(|d| {
            d.driver == ch.driver
                && d.pool == ch.pool
                && d.device == ch.device
                && d.share_id == ch.share_id
        }) else {
            return false;
        };
        let (type_, reason) = match b {
            Binding::Ready => (READY_CONDITION, "DaemonReady"),
            Binding::Failed { reason, .. } => (FAILED_CONDITION, reason.as_str()),
        };
        entry
            .conditions
            .iter()
            .flatten()
            .any(|c| c.type_ == type_ && c.status == "True" && c.reason == reason)
    })
}
