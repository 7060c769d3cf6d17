//! What the agent does for each npm-cni request (see [`npm_cni::proto::Request`]):
//! record or drop the facts, wake the sync loop, and answer once a
//! successful sync has programmed the result (bounded by the context's
//! `wait_bound`).

use std::collections::HashSet;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use npm_cni::proto::{self, Detachment, GcRequest, Request, Response};

use super::facts::{Attachment, AttachmentKey, Programmed};
use super::veth;
use super::CniContext;

/// The outcome of waiting for a sync.
enum Waited {
    /// The condition held.
    Done(Arc<Programmed>),
    /// The bound passed.
    TimedOut,
    /// The request's attachment went away while waiting (a DEL or GC).
    Gone,
}

/// Wait until a published [`Programmed`] satisfies `done`, `gone` says the
/// request no longer stands, or `ctx.wait_bound` passes.
async fn wait_for(ctx: &CniContext, done: impl Fn(&Programmed) -> bool, gone: impl Fn() -> bool) -> Waited {
    let mut rx = ctx.facts.subscribe();
    let deadline = tokio::time::Instant::now() + ctx.wait_bound;
    loop {
        {
            let p = rx.borrow_and_update();
            if done(&p) {
                return Waited::Done(p.clone());
            }
        }
        if gone() {
            return Waited::Gone;
        }
        match tokio::time::timeout_at(deadline, rx.changed()).await {
            Ok(Ok(())) => {}
            // The sender lives as long as the handle; either way, stop.
            Ok(Err(_)) | Err(_) => return Waited::TimedOut,
        }
    }
}

/// Serve one request; counts it in `npm_cni_requests_total{command,result}`.
pub async fn handle(ctx: &CniContext, request: Request) -> Response {
    let (command, response) = match request {
        Request::Add(a) => ("add", add(ctx, a).await),
        Request::Check(a) => ("check", check(ctx, &a)),
        Request::Del(d) => ("del", del(ctx, d).await),
        Request::Status => ("status", status(ctx)),
        Request::Gc(gc) => ("gc", gc_request(ctx, gc).await),
    };
    let result = match (&response.ok, response.retry) {
        (true, _) => "ok",
        (false, true) => "retry",
        (false, false) => "error",
    };
    ctx.metrics.cni_request(command, result);
    response
}

fn key_of(container_id: &str, ifname: &str) -> AttachmentKey {
    (container_id.to_string(), ifname.to_string())
}

fn addresses(ips: &[proto::IpConfig]) -> Vec<IpAddr> {
    ips.iter().map(|i| i.address.addr()).collect()
}

async fn add(ctx: &CniContext, a: proto::Attachment) -> Response {
    let started = Instant::now();
    let pod = format!("{}/{}", a.pod.namespace, a.pod.name);
    let (host_interface, ifindex) = match veth::host_veth(&a.host_interfaces) {
        Ok(v) => v,
        Err(e) => {
            tracing::warn!(%pod, uid = %a.pod.uid, container = %a.container_id, error = %e, "CNI ADD refused");
            return Response::error(format!("ADD of pod {pod}: {e}"), false);
        }
    };
    let ips = addresses(&a.ips);
    if ips.is_empty() {
        return Response::error(format!("ADD of pod {pod}: the result has no address"), false);
    }
    let key = key_of(&a.container_id, &a.ifname);
    let uid = a.pod.uid.clone();
    let attachment = Attachment {
        network: a.network,
        container_id: a.container_id,
        ifname: a.ifname,
        netns: a.netns,
        pod: a.pod,
        host_interface: host_interface.clone(),
        ifindex,
        ips: ips.clone(),
        seq: 0,
    };
    let (dropped, facts) = ctx.facts.update(|f| f.add(attachment));
    for d in &dropped {
        tracing::warn!(pod = %d.pod_name(), container = %d.container_id, new_owner = %pod, ips = ?d.ips,
            "an address of an older attachment was handed out again: that attachment is dropped");
    }
    let generation = facts.generation();
    ctx.cache.mark_changed();
    tracing::info!(%pod, %uid, container = %key.0, veth = %host_interface, ifindex, ips = ?ips,
        "CNI ADD: waiting until the endpoint is programmed");
    let waited = wait_for(
        ctx,
        |p| p.generation >= generation && p.endpoints.get(&uid).is_some_and(|e| e.ifindex == ifindex),
        || ctx.facts.current().attachment(&key).is_none(),
    )
    .await;
    let elapsed = started.elapsed();
    match waited {
        Waited::Done(p) => {
            ctx.metrics.cni_add_wait.record(elapsed.as_secs_f64());
            let id = p.endpoints[&uid].id;
            tracing::info!(%pod, %uid, endpoint = id, waited_ms = elapsed.as_secs_f64() * 1e3, "CNI ADD: endpoint programmed");
            Response::ok(Some(id))
        }
        Waited::Gone => {
            tracing::warn!(%pod, %uid, "CNI ADD: the attachment was deleted while waiting");
            Response::error(format!("ADD of pod {pod}: deleted while waiting"), false)
        }
        Waited::TimedOut => {
            let (why, retry) = why_not_programmed(ctx, &pod, &uid);
            tracing::warn!(%pod, %uid, waited_ms = elapsed.as_secs_f64() * 1e3, reason = %why, "CNI ADD: not programmed in time");
            Response::error(format!("pod {pod} (uid {uid}): {why}"), retry)
        }
    }
}

/// Why the endpoint of pod `pod` (`namespace/name`) with `uid` was not
/// programmed, and whether waiting longer could help.
fn why_not_programmed(ctx: &CniContext, pod: &str, uid: &str) -> (String, bool) {
    if !ctx.cache.all_listed() {
        return (
            "the agent has not completed its first full list of pods, namespaces and policies yet".into(),
            true,
        );
    }
    let (ns, name) = pod.split_once('/').unwrap_or(("", pod));
    let pods = ctx.cache.pods.lock().unwrap_or_else(|e| e.into_inner());
    let object = pods
        .complete()
        .and_then(|m| m.get(&(ns.to_string(), name.to_string())).cloned());
    drop(pods);
    let bound = ctx.wait_bound;
    match object {
        None => ("is not in the agent's cache yet".into(), true),
        Some(p) if !p.has_runtime_uid(uid) => (
            format!(
                "the agent's cache holds a pod of that name with uid {:?} (an older pod?)",
                p.metadata.uid.as_deref().unwrap_or("")
            ),
            true,
        ),
        Some(p) if p.spec.as_ref().and_then(|s| s.node_name.as_deref()) != Some(ctx.node_name.as_str()) => (
            format!(
                "is scheduled to node {:?}, not to this node {:?}",
                p.spec.as_ref().and_then(|s| s.node_name.as_deref()).unwrap_or(""),
                ctx.node_name
            ),
            false,
        ),
        Some(_) => (
            format!("endpoint not programmed within {bound:?}: the sync is failing or held (see the agent's log)"),
            true,
        ),
    }
}

fn check(ctx: &CniContext, a: &proto::Attachment) -> Response {
    let pod = format!("{}/{}", a.pod.namespace, a.pod.name);
    let facts = ctx.facts.current();
    let Some(rec) = facts.attachment(&key_of(&a.container_id, &a.ifname)) else {
        return Response::error(
            format!(
                "CHECK of pod {pod}: the agent has no attachment of container {}",
                a.container_id
            ),
            false,
        );
    };
    if rec.pod.uid != a.pod.uid || addresses(&a.ips) != rec.ips {
        return Response::error(
            format!(
                "CHECK of pod {pod}: the agent's attachment is of pod uid {} with addresses {:?}",
                rec.pod.uid, rec.ips
            ),
            false,
        );
    }
    let programmed = ctx.facts.programmed();
    match programmed.endpoints.get(&rec.pod.uid) {
        Some(e) if e.ifindex == rec.ifindex && facts.current(&rec.pod.uid) == Some(rec) => Response::ok(Some(e.id)),
        _ => Response::error(format!("CHECK of pod {pod}: the endpoint is not programmed"), true),
    }
}

/// Wait (bounded) until a sync of facts generation `generation` or later
/// was applied: what a DEL or GC answers after.
async fn wait_evicted(ctx: &CniContext, generation: u64, what: &str) -> Response {
    match wait_for(ctx, |p| p.generation >= generation, || false).await {
        Waited::Done(_) => Response::ok(None),
        _ => Response::error(
            format!("{what}: eviction not programmed within {:?}", ctx.wait_bound),
            true,
        ),
    }
}

async fn del(ctx: &CniContext, d: Detachment) -> Response {
    let started = Instant::now();
    let key = key_of(&d.container_id, &d.ifname);
    let ((removed, changed), facts) = ctx.facts.update(|f| f.del(&key, d.pod.as_ref()));
    let pod = removed
        .as_ref()
        .map(|a| a.pod_name())
        .or_else(|| d.pod.as_ref().map(|p| format!("{}/{}", p.namespace, p.name)))
        .unwrap_or_default();
    if !changed {
        tracing::debug!(%pod, container = %d.container_id, "CNI DEL of an unknown attachment");
        return Response::ok(None);
    }
    ctx.cache.mark_changed();
    tracing::info!(%pod, container = %d.container_id, known = removed.is_some(),
        "CNI DEL: evicting the pod's endpoint and addresses");
    let response = wait_evicted(ctx, facts.generation(), &format!("DEL of pod {pod}")).await;
    if response.ok {
        tracing::info!(%pod, waited_ms = started.elapsed().as_secs_f64() * 1e3, "CNI DEL: evicted");
    }
    response
}

/// STATUS: see [`super::status`] for what it means.
fn status(ctx: &CniContext) -> Response {
    match super::status::answer(ctx.readiness.first_sync_done(), &ctx.sync_marker) {
        Ok(()) => Response::ok(None),
        Err(why) => Response::error(why, true),
    }
}

async fn gc_request(ctx: &CniContext, gc: GcRequest) -> Response {
    let valid: HashSet<AttachmentKey> = gc
        .valid_attachments
        .iter()
        .map(|v| key_of(&v.container_id, &v.ifname))
        .collect();
    let (removed, facts) = ctx.facts.update(|f| {
        f.remove_where(|a| a.network == gc.network && !valid.contains(&key_of(&a.container_id, &a.ifname)))
    });
    if removed.is_empty() {
        return Response::ok(None);
    }
    ctx.cache.mark_changed();
    for a in &removed {
        tracing::info!(pod = %a.pod_name(), container = %a.container_id, network = %gc.network,
            "CNI GC: attachment no longer valid; evicting");
    }
    wait_evicted(ctx, facts.generation(), "GC").await
}

/// How often [`maintain`] looks at the facts.
pub const MAINTAIN_INTERVAL: Duration = Duration::from_secs(2);

/// Keep the facts true, forever: an attachment whose veth is gone (its
/// sandbox went away without a DEL reaching the agent, e.g. while it was
/// down) is dropped and its pod tombstoned; a tombstone goes once the pod
/// object is gone (or is another pod of that name).
pub async fn maintain(ctx: CniContext) {
    let mut tick = tokio::time::interval(MAINTAIN_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        prune(&ctx);
    }
}

/// One pass of [`maintain`].
pub fn prune(ctx: &CniContext) {
    if ctx.readiness.first_sync_done() {
        // STATUS of a restarted agent reads it; written once.
        if let Err(e) = ctx.sync_marker.record() {
            tracing::debug!(error = %e, "sync marker not written");
        }
    }
    let facts = ctx.facts.current();
    let dead: HashSet<AttachmentKey> = facts
        .attachments()
        .filter(|a| !veth::link_alive(&a.host_interface, a.ifindex))
        .map(|a| key_of(&a.container_id, &a.ifname))
        .collect();
    let gone: HashSet<String> = {
        let pods = ctx.cache.pods.lock().unwrap_or_else(|e| e.into_inner());
        match pods.complete() {
            None => HashSet::new(),
            Some(pods) => facts
                .tombstones()
                .filter(|t| {
                    pods.get(&(t.namespace.clone(), t.name.clone()))
                        .is_none_or(|p| !p.has_runtime_uid(&t.uid))
                })
                .map(|t| t.uid.clone())
                .collect(),
        }
    };
    if dead.is_empty() && gone.is_empty() {
        return;
    }
    let ((removed, lifted), _) = ctx.facts.update(|f| {
        let removed = f.remove_where(|a| dead.contains(&key_of(&a.container_id, &a.ifname)));
        let lifted = f.lift_tombstones(|p| gone.contains(&p.uid));
        (removed, lifted)
    });
    for a in &removed {
        tracing::warn!(pod = %a.pod_name(), container = %a.container_id, veth = %a.host_interface,
            "the veth of a CNI attachment is gone without a DEL; evicting the pod's endpoint");
    }
    for p in &lifted {
        tracing::debug!(pod = %format!("{}/{}", p.namespace, p.name), uid = %p.uid, "tombstone lifted: the pod object is gone");
    }
    if !removed.is_empty() {
        ctx.cache.mark_changed();
    }
}
