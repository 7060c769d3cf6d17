//! Unit tests of audit mode in the agent: the stores keep the annotation,
//! which endpoints are reported, and allow events decided would-deny (the
//! record and the metric) against the enforced and the audited state.

use std::io::Write;
use std::sync::{Arc, Mutex};

use npm_common::{IpKey, Reason};
use npm_policy::model::{Namespace, Pod};
use serde_json::json;

use super::*;
use crate::telemetry::sample;

fn np(name: &str, audit: Option<&str>, app: &str, allow_from: Option<&str>) -> Arc<NetworkPolicy> {
    let mut meta = json!({"name": name, "namespace": "ns1", "resourceVersion": "1",
                          "annotations": {"kubectl.kubernetes.io/last-applied-configuration": "{}"}});
    if let Some(v) = audit {
        meta["annotations"]["npm.io/audit"] = json!(v);
    }
    let ingress = match allow_from {
        Some(f) => json!([{"from": [{"podSelector": {"matchLabels": {"app": f}}}]}]),
        None => json!([]),
    };
    let obj: NetworkPolicy = serde_json::from_value(json!({"metadata": meta, "spec": {
        "podSelector": {"matchLabels": {"app": app}}, "policyTypes": ["Ingress"], "ingress": ingress}}))
    .unwrap();
    // What the agent's store keeps of it.
    Arc::new(crate::k8s::strip(obj))
}

/// Pod `ns1/<name>` on `node` (the kit's, created at 0).
fn pod(name: &str, app: &str, ip: &str) -> Pod {
    Pod {
        created: 0,
        ..npm_testkit::policy::pod("ns1", name, ip, app, "node")
    }
}

fn state(policies: &[Arc<NetworkPolicy>]) -> (Snapshot, Compiled) {
    let mut s = Snapshot::default();
    s.upsert_namespace(Namespace {
        name: "ns1".into(),
        labels: [("kubernetes.io/metadata.name".to_string(), "ns1".to_string())].into(),
    });
    s.upsert_pod(pod("web", "web", "10.0.0.1"));
    s.upsert_pod(pod("client", "client", "10.0.0.2"));
    s.upsert_pod(pod("db", "db", "10.0.0.3"));
    for p in policies {
        let _ = s.upsert_policy(p);
    }
    let c = npm_policy::compile(&s, &opts(), None);
    (s, c)
}

fn opts() -> CompileOptions {
    CompileOptions {
        node_name: "node".into(),
        node_ips: vec!["10.9.9.9".parse().unwrap()],
        allow_host_egress: false,
        report_new: false,
    }
}

fn ep(c: &Compiled, name: &str) -> u32 {
    *c.endpoints.iter().find(|(_, e)| e.pod.name == name).unwrap().0
}

/// An allow event of a new TCP connection `src` -> `dst`:80 at `endpoint`.
fn allow(endpoint: u32, direction: u8, reason: Reason, src: [u8; 4], dst: [u8; 4]) -> DenyEvent {
    DenyEvent {
        endpoint,
        ifindex: 9,
        direction,
        reason: reason as u8,
        protocol: 6,
        family: 4,
        sport: 40000,
        dport: 80,
        src: IpKey::v4(src).addr,
        dst: IpKey::v4(dst).addr,
        ..Default::default()
    }
}

#[test]
fn the_store_keeps_only_the_audit_annotation() {
    let p = np("a", Some("true"), "web", None);
    let kept = p.metadata.annotations.as_ref().unwrap();
    assert_eq!(kept.len(), 1, "{kept:?}");
    assert_eq!(kept["npm.io/audit"], "true");
    assert!(np("b", None, "web", None).metadata.annotations.is_none());
}

#[test]
fn allow_events_an_audited_policy_would_deny() {
    let policies = vec![
        // Audited: only db may reach web.
        np("audit-web", Some("true"), "web", Some("db")),
        // Enforced: client is isolated, web may reach it.
        np("enforce-client", None, "client", Some("web")),
    ];
    let (snapshot, compiled) = state(&policies);
    let (web, client, db) = (ep(&compiled, "web"), ep(&compiled, "client"), ep(&compiled, "db"));
    assert!(
        !compiled.endpoints[&web].isolated_ingress,
        "the audited policy is not enforced"
    );
    assert!(compiled.endpoints[&client].isolated_ingress);
    let mut audit = Audit::new();
    audit.refresh(&policies.clone().into());
    assert_eq!(audit.audited().len(), 1);
    assert!(audit.reports(&snapshot, &compiled.endpoints[&web]));
    assert!(!audit.reports(&snapshot, &compiled.endpoints[&client]));
    assert!(!audit.reports(&snapshot, &compiled.endpoints[&db]));

    let metrics = Metrics::new().unwrap();
    let names = Names::new(Some(&compiled), &snapshot);
    let (w, c, d) = ([10, 0, 0, 1], [10, 0, 0, 2], [10, 0, 0, 3]);
    let events = [
        // client -> web: web is not isolated (allowed), the audit denies.
        allow(web, npm_common::DIR_INGRESS, Reason::NotIsolated, c, w),
        // db -> web: the audited rule allows.
        allow(web, npm_common::DIR_INGRESS, Reason::NotIsolated, d, w),
        // web -> client at client: enforced, allowed; not audited.
        allow(client, npm_common::DIR_INGRESS, Reason::Policy, w, c),
        // web's egress: the audited policy has no egress.
        allow(web, npm_common::DIR_EGRESS, Reason::NotIsolated, w, c),
        // A deny event is not an allow event.
        allow(web, npm_common::DIR_INGRESS, Reason::PolicyDenied, c, w),
        // From the node: always allowed.
        allow(web, npm_common::DIR_INGRESS, Reason::Host, [10, 9, 9, 9], w),
    ];
    let records = audit.would_deny(&events, &names, Some(&compiled), &snapshot, &opts(), &metrics);
    assert_eq!(records.len(), 1, "{records:?}");
    let r = &records[0];
    assert_eq!(r.verdict, "would-deny");
    assert_eq!(r.direction, "ingress");
    assert_eq!(r.policies, vec!["ns1/audit-web".to_string()]);
    assert_eq!(r.pod.as_ref().unwrap().name, "web");
    let buf = Arc::new(Mutex::new(Vec::new()));
    let mut flowlog = FlowLog::with_writer(10, Box::new(Shared(buf.clone())));
    let now = Instant::now();
    let mut limited = Audit::with_rate(1);
    assert_eq!(
        limited.log(&[r.clone(), r.clone()], &mut flowlog, now),
        1,
        "over the rate"
    );
    assert_eq!(limited.log(&records, &mut flowlog, now + Duration::from_secs(1)), 0);
    let line = String::from_utf8(buf.lock().unwrap().clone()).unwrap();
    assert_eq!(line.lines().count(), 2, "{line}");
    assert!(line.contains("\"verdict\":\"would-deny\""), "{line}");
    assert!(line.contains("\"policies\":[\"ns1/audit-web\"]"), "{line}");
    assert!(
        line.contains("\"peer\":{\"kind\":\"pod\",\"namespace\":\"ns1\",\"name\":\"client\"}"),
        "{line}"
    );
    let text = metrics.render();
    assert_eq!(
        sample(
            &text,
            "npm_audit_would_deny_total{namespace=\"ns1\",policy=\"audit-web\",direction=\"ingress\"}"
        ),
        Some(1.0),
        "{text}"
    );

    // The annotation removed: enforced, no longer audited.
    // (An update: a new resourceVersion.)
    let mut unannotated = (*np("audit-web", None, "web", Some("db"))).clone();
    unannotated.metadata.resource_version = Some("2".into());
    let enforced = vec![Arc::new(unannotated), policies[1].clone()];
    let (snapshot, compiled) = state(&enforced);
    audit.refresh(&enforced.clone().into());
    assert!(audit.audited().is_empty());
    assert!(compiled.endpoints[&ep(&compiled, "web")].isolated_ingress);
    let names = Names::new(Some(&compiled), &snapshot);
    let web = ep(&compiled, "web");
    let events = [allow(web, npm_common::DIR_INGRESS, Reason::Policy, d, w)];
    assert!(audit
        .would_deny(&events, &names, Some(&compiled), &snapshot, &opts(), &metrics)
        .is_empty());
}

#[test]
fn a_mistyped_annotation_enforces_the_policy() {
    let policies = vec![np("typo", Some("ture"), "web", Some("db"))];
    let (snapshot, compiled) = state(&policies);
    assert!(compiled.endpoints[&ep(&compiled, "web")].isolated_ingress, "enforced");
    assert_eq!(snapshot.invalid_policies.len(), 1);
    assert!(snapshot.invalid_policies[0].errors[0].contains("npm.io/audit"));
    let mut audit = Audit::new();
    audit.refresh(&policies.clone().into());
    assert!(audit.audited().is_empty());
}

/// A writer into a shared buffer.
struct Shared(Arc<Mutex<Vec<u8>>>);

impl Write for Shared {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The in-memory "kernel" of [`the_sync_loop_reports_audited_endpoints`].
#[derive(Clone, Default)]
struct Mem(Arc<Mutex<Compiled>>);

impl npm_dataplane::Dataplane for Mem {
    fn sync_full(&mut self, c: &Compiled, _: &npm_dataplane::Interfaces) -> Result<(), npm_dataplane::DataplaneError> {
        *self.0.lock().unwrap() = c.clone();
        Ok(())
    }
    fn apply(
        &mut self,
        diff: &npm_policy::compiled::CompiledDiff,
        _: &Compiled,
        _: &npm_dataplane::Interfaces,
    ) -> Result<(), npm_dataplane::DataplaneError> {
        diff.endpoints.apply_to(&mut self.0.lock().unwrap().endpoints);
        Ok(())
    }
    fn counters(&self) -> Result<npm_dataplane::Counters, npm_dataplane::DataplaneError> {
        Ok(Default::default())
    }
}

impl crate::reconcile::AgentDataplane for Mem {}

struct AllFound;

impl crate::node::Resolve for AllFound {
    fn resolve(&mut self, compiled: &Compiled) -> crate::node::Resolved {
        crate::node::Resolved {
            interfaces: compiled.endpoints.keys().map(|&id| (id, 100 + id)).collect(),
            missing: Vec::new(),
        }
    }
}

/// Through the sync loop: the audited policy is not programmed, its pod
/// reports its new connections (`report_new`), the others do not; the
/// annotation removed, the policy is programmed and nobody reports.
#[tokio::test]
async fn the_sync_loop_reports_audited_endpoints() {
    use k8s_openapi::api::core::v1::Namespace as ApiNamespace;
    use kube::runtime::watcher::Event;
    let cache = crate::k8s::Cache::new(Metrics::new().unwrap());
    cache.handle::<ApiNamespace>(Event::Init);
    cache.handle(Event::InitApply(
        serde_json::from_value::<ApiNamespace>(json!({"metadata": {"name": "ns1", "resourceVersion": "1"}})).unwrap(),
    ));
    cache.handle::<ApiNamespace>(Event::InitDone);
    cache.handle::<NetworkPolicy>(Event::Init);
    cache.handle(Event::InitApply(
        (*np("audit-web", Some("true"), "web", Some("db"))).clone(),
    ));
    cache.handle::<NetworkPolicy>(Event::InitDone);
    type ApiPod = crate::k8s::pods::Pod;
    cache.handle::<ApiPod>(Event::Init);
    for (i, (name, ip)) in [("web", "10.0.0.1"), ("db", "10.0.0.3")].iter().enumerate() {
        let p = crate::reconcile::compiler::tests::pod("ns1", name, 2 + i as u64, ip, name, "node");
        cache.handle(Event::InitApply((*p).clone()));
    }
    cache.handle::<ApiPod>(Event::InitDone);
    let dp = Mem::default();
    let mut syncer = crate::reconcile::Syncer::builder(cache.clone(), dp.clone())
        .config(crate::reconcile::SyncConfig {
            compile: opts(),
            ..Default::default()
        })
        .resolver(Box::new(AllFound))
        .build();
    syncer.sync_once().await.unwrap();
    let by_name = |name: &str| {
        let k = dp.0.lock().unwrap();
        k.endpoints.values().find(|e| e.pod.name == name).cloned().unwrap()
    };
    let web = by_name("web");
    assert!(!web.isolated_ingress, "the audited policy is not programmed");
    assert!(web.report_new, "its pod reports its new connections");
    assert!(!by_name("db").report_new);

    let mut enforced = (*np("audit-web", None, "web", Some("db"))).clone();
    enforced.metadata.resource_version = Some("9".into());
    cache.handle(Event::Apply(enforced));
    syncer.sync_once().await.unwrap();
    let web = by_name("web");
    assert!(web.isolated_ingress, "enforced");
    assert!(!web.report_new);

    // Audited again: that opens web's ingress, which the mass-removal
    // guard holds like a lost policy until a direct read of the API server
    // confirms it (there is no client here: it stays held, enforced).
    let mut audited = (*np("audit-web", Some("true"), "web", Some("db"))).clone();
    audited.metadata.resource_version = Some("10".into());
    cache.handle(Event::Apply(audited));
    let held = syncer.sync_once().await.unwrap_err();
    assert!(
        matches!(held, crate::reconcile::SyncError::NoDirectReader { .. }),
        "{held}"
    );
    assert!(by_name("web").isolated_ingress, "held: still enforced");
}
