//! Tests of the registry: the catalogue, the rendering and the named families.

use metrics::Unit;

use super::*;

#[test]
fn public_text_has_no_names() {
    let m = Metrics::new().unwrap();
    m.audit_would_deny("team-a", "secret-policy", "ingress");
    m.connection_cut("team-b", "egress");
    m.ip_conflicts.increment(1);
    let full = m.render();
    assert!(full.contains("secret-policy"), "{full}");
    assert!(
        full.contains("npm_connections_cut_total{namespace=\"team-b\""),
        "{full}"
    );
    assert!(full.contains("# TYPE npm_rule_allowed_packets_total counter"), "{full}");
    let public = m.render_public();
    for f in NAMED_FAMILIES {
        assert!(!public.contains(f), "{f} in {public}");
    }
    assert!(
        !public.contains("secret-policy") && !public.contains("team-a") && !public.contains("team-b"),
        "{public}"
    );
    assert!(public.contains("npm_ip_conflicts_total 1"), "{public}");
    assert!(public.contains("# TYPE npm_ready gauge"), "{public}");
}

#[test]
fn counters_and_labels_render() {
    let m = Metrics::new().unwrap();
    m.pod_event(PodOperation::UpdateWithEmptyIp, 2);
    m.ip_conflicts.increment(1);
    m.programming_latency.record(0.02);
    let mut c = Counters::default();
    c.by_reason
        .insert((npm_common::DIR_EGRESS, Reason::PolicyDenied as u8), (7, 700));
    c.by_reason
        .insert((npm_common::DIR_INGRESS, Reason::AdminDeny as u8), (3, 180));
    m.dataplane_counters(&c);
    let text = m.render();
    assert_eq!(
        sample(
            &text,
            "npm_tier_packets_total{direction=\"ingress\",tier=\"admin\",action=\"deny\"}"
        ),
        Some(3.0)
    );
    assert_eq!(
        sample(
            &text,
            "npm_tier_bytes_total{direction=\"ingress\",tier=\"admin\",action=\"deny\"}"
        ),
        Some(180.0)
    );
    assert_eq!(
        sample(
            &text,
            "npm_packets_total{direction=\"ingress\",reason=\"admin-deny\",verdict=\"denied\"}"
        ),
        Some(3.0)
    );
    assert_eq!(
        sample(
            &text,
            "npm_tier_packets_total{direction=\"egress\",tier=\"baseline\",action=\"accept\"}"
        ),
        Some(0.0),
        "the tier series exist before any CNP decides"
    );
    assert_eq!(
        sample(
            &text,
            "npm_controller_pod_event_total{operation=\"update-with-empty-ip\"}"
        ),
        Some(2.0)
    );
    assert_eq!(
        sample(&text, "npm_controller_pod_event_total{operation=\"create\"}"),
        Some(0.0)
    );
    assert_eq!(sample(&text, "npm_ip_conflicts_total"), Some(1.0));
    assert_eq!(
        sample(
            &text,
            "npm_packets_total{direction=\"egress\",reason=\"policy-denied\",verdict=\"denied\"}"
        ),
        Some(7.0)
    );
    assert_eq!(sample(&text, "npm_programming_latency_seconds_count"), Some(1.0));
    assert_eq!(sample(&text, "npm_ringbuf_events_lost_total"), Some(0.0));
    m.map_fill(&[
        MapFill {
            map: "NPM_POLICY",
            entries: 3,
            capacity: 1 << 20,
            fallbacks: None,
        },
        MapFill {
            map: "NPM_FOLD",
            entries: 9,
            capacity: 1 << 18,
            fallbacks: Some(2),
        },
    ]);
    m.ringbuf_events_lost(12);
    let text = m.render();
    assert_eq!(sample(&text, "npm_map_entries{map=\"NPM_POLICY\"}"), Some(3.0));
    assert_eq!(sample(&text, "npm_map_capacity{map=\"NPM_POLICY\"}"), Some(1048576.0));
    assert_eq!(sample(&text, "npm_fold_fallbacks"), Some(2.0));
    assert_eq!(sample(&text, "npm_ringbuf_events_lost_total"), Some(12.0));
    // Two registries do not share values.
    let other = Metrics::new().unwrap();
    assert_eq!(sample(&other.render(), "npm_ip_conflicts_total"), Some(0.0));
}

/// Every family the registry renders, once each labelled family has a
/// value, is in [`SERIES`] with its type and HELP text, and every entry
/// of [`SERIES`] is rendered: the list cannot drift from the code.
#[test]
fn every_series_is_described_and_listed() {
    let m = Metrics::new().unwrap();
    m.watch_event("pods", "apply");
    m.audit_would_deny("ns", "audited", "ingress");
    m.connection_cut("ns", "ingress");
    m.cni_request("add", "ok");
    m.error("watch");
    m.readiness_failure("lists", true);
    m.attach_mode("tcx");
    m.host_in_mode(false);
    m.compiled_entries("ipcache", 1);
    m.map_full("NPM_POLICY", false);
    m.dns_learning(
        (1, 2),
        &DnsCounts {
            responses: [3, 1, 0, 0, 0, 0, 0, 0, 0],
            ..DnsCounts::default()
        },
    );
    m.map_fill(&[MapFill {
        map: "NPM_POLICY_FRONT",
        entries: 0,
        capacity: 1,
        fallbacks: Some(0),
    }]);
    let mut c = Counters::default();
    c.by_reason
        .insert((npm_common::DIR_INGRESS, Reason::PolicyDenied as u8), (1, 60));
    m.dataplane_counters(&c);
    for h in [&m.sync_duration, &m.programming_latency, &m.cni_add_wait] {
        h.record(0.1);
    }
    let text = m.render();
    let mut rendered = std::collections::BTreeSet::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap();
            let s = SERIES
                .iter()
                .find(|s| s.name == name)
                .unwrap_or_else(|| panic!("{name} is not in SERIES"));
            let want = match s.kind {
                Kind::Counter => "counter",
                Kind::Gauge => "gauge",
                Kind::Histogram => "histogram",
            };
            assert_eq!(kind, want, "{name}");
            assert!(
                text.contains(&format!("# HELP {name} {}", s.help)),
                "{name} has no HELP:\n{text}"
            );
            rendered.insert(name.to_string());
        }
    }
    for s in SERIES {
        assert!(
            rendered.contains(s.name),
            "{} is listed but not rendered:\n{text}",
            s.name
        );
        match s.kind {
            Kind::Counter => assert!(s.name.ends_with("_total"), "{}", s.name),
            _ => assert!(!s.name.ends_with("_total"), "{}", s.name),
        }
        if s.unit == Some(Unit::Seconds) {
            assert!(s.name.ends_with("_seconds"), "{}", s.name);
        }
    }
    let version = format!("npm_build_info{{version=\"{}\"", env!("CARGO_PKG_VERSION"));
    let line = text.lines().find(|l| l.starts_with(&version)).expect("npm_build_info");
    assert!(line.ends_with(" 1"), "{line}");
}
