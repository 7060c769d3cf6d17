//! The chart's ValidatingAdmissionPolicy (`templates/node-restriction.yaml`)
//! evaluated by table: its match condition, variables and validations, as
//! `helm template` renders them, run by a CEL interpreter (the `cel` crate)
//! on admission requests of the agent of one node and of other users. The
//! test API server does not run admission; this checks what a real API
//! server would decide with these expressions. Also when it is rendered
//! (`nodeRestriction.enabled`: auto by the cluster's version and APIs).

use serde_json::{json, Value};

use crate::chart::{find, template};

const AGENT: &str = "system:serviceaccount:npm-system:rel-npm-agent";
const NODE_CLAIM: &str = "authentication.kubernetes.io/node-name";
const OUR_TAINT: &str = "npm.io/agent-not-ready";

fn policy() -> Value {
    let docs = template(&["nodeRestriction.enabled=true"]);
    let vap = find(&docs, "ValidatingAdmissionPolicy");
    assert_eq!(vap.len(), 1);
    let binding = find(&docs, "ValidatingAdmissionPolicyBinding");
    assert_eq!(binding.len(), 1);
    assert_eq!(binding[0]["spec"]["policyName"], vap[0]["metadata"]["name"]);
    assert_eq!(binding[0]["spec"]["validationActions"][0].as_str(), Some("Deny"));
    serde_json::to_value(vap[0]).unwrap()
}

fn eval(expr: &str, vars: &[(&str, &Value)]) -> cel::Value {
    let program = cel::Program::compile(expr).unwrap_or_else(|e| panic!("{expr}: {e:?}"));
    let mut ctx = cel::Context::default();
    for (name, v) in vars {
        ctx.add_variable(*name, (*v).clone()).unwrap();
    }
    program.execute(&ctx).unwrap_or_else(|e| panic!("{expr}: {e:?}"))
}

/// The policy's decision on `request` (with `object`, `oldObject`):
/// `None` when it does not match (another user), else whether it admits.
fn decide(vap: &Value, request: &Value, object: &Value, old: &Value) -> Option<bool> {
    let base = [("request", request), ("object", object), ("oldObject", old)];
    for c in vap["spec"]["matchConditions"].as_array().unwrap() {
        if eval(c["expression"].as_str().unwrap(), &base) != cel::Value::Bool(true) {
            return None;
        }
    }
    let mut variables = serde_json::Map::new();
    for v in vap["spec"]["variables"].as_array().unwrap() {
        let vars = Value::Object(variables.clone());
        let mut all = base.to_vec();
        all.push(("variables", &vars));
        let value = eval(v["expression"].as_str().unwrap(), &all);
        let value = serde_json::to_value(cel_json(&value)).unwrap();
        variables.insert(v["name"].as_str().unwrap().to_string(), value);
    }
    let vars = Value::Object(variables);
    let mut all = base.to_vec();
    all.push(("variables", &vars));
    Some(
        vap["spec"]["validations"]
            .as_array()
            .unwrap()
            .iter()
            .all(|v| eval(v["expression"].as_str().unwrap(), &all) == cel::Value::Bool(true)),
    )
}

/// A CEL value back to JSON (the variables' values: strings, lists, maps).
fn cel_json(v: &cel::Value) -> Value {
    match v {
        cel::Value::String(s) => json!(s.as_str()),
        cel::Value::Bool(b) => json!(b),
        cel::Value::Int(i) => json!(i),
        cel::Value::UInt(u) => json!(u),
        cel::Value::Null => Value::Null,
        cel::Value::List(l) => Value::Array(l.iter().map(cel_json).collect()),
        cel::Value::Map(m) => Value::Object(m.map.iter().map(|(k, v)| (k.to_string(), cel_json(v))).collect()),
        other => panic!("unexpected CEL value {other:?}"),
    }
}

fn request(user: &str, node_claim: Option<&str>, resource: &str, operation: &str) -> Value {
    let mut u = json!({"username": user, "groups": ["system:serviceaccounts", "system:authenticated"]});
    if let Some(n) = node_claim {
        u["extra"] = json!({ NODE_CLAIM: [n] });
    }
    json!({"userInfo": u, "operation": operation,
           "resource": {"group": "", "version": "v1", "resource": resource}})
}

fn node(name: &str, taints: &[&str], labels: Value) -> Value {
    let taints: Vec<Value> = taints
        .iter()
        .map(|k| json!({"key": k, "effect": "NoSchedule"}))
        .collect();
    let mut n = json!({"apiVersion": "v1", "kind": "Node",
                       "metadata": {"name": name, "labels": labels}, "spec": {}});
    if !taints.is_empty() {
        n["spec"]["taints"] = Value::Array(taints);
    }
    n
}

fn event(reporting: Option<&str>, host: Option<&str>) -> Value {
    let mut e = json!({"apiVersion": "v1", "kind": "Event", "metadata": {"name": "p.1", "namespace": "app"},
                       "reason": "PolicyNotFullyEnforced"});
    if let Some(r) = reporting {
        e["reportingInstance"] = json!(r);
    }
    if let Some(h) = host {
        e["source"] = json!({"component": "npm-agent", "host": h});
    }
    e
}

#[test]
fn the_agent_changes_only_its_own_node_and_reports_only_from_it() {
    let vap = policy();
    let labels = json!({"kubernetes.io/hostname": "node-a"});
    let tainted = node("node-a", &[OUR_TAINT, "other/taint"], labels.clone());
    let untainted = node("node-a", &["other/taint"], labels.clone());
    let agent_a = request(AGENT, Some("node-a"), "nodes", "UPDATE");
    let null = Value::Null;
    let nodes: &[(&str, &Value, Value, Value, Option<bool>)] = &[
        (
            "own Node, our taint removed",
            &agent_a,
            untainted.clone(),
            tainted.clone(),
            Some(true),
        ),
        (
            "another Node's taint removed",
            &agent_a,
            node("node-b", &[], labels.clone()),
            node("node-b", &[OUR_TAINT], labels.clone()),
            Some(false),
        ),
        (
            "own Node, a taint added",
            &agent_a,
            tainted.clone(),
            untainted.clone(),
            Some(false),
        ),
        (
            "own Node, a label changed",
            &agent_a,
            node(
                "node-a",
                &["other/taint"],
                json!({"kubernetes.io/hostname": "node-a", "x": "y"}),
            ),
            tainted.clone(),
            Some(false),
        ),
        (
            "own Node, cordoned",
            &agent_a,
            {
                let mut n = tainted.clone();
                n["spec"]["unschedulable"] = json!(true);
                n
            },
            tainted.clone(),
            Some(false),
        ),
        (
            "a token without the node claim",
            &request(AGENT, None, "nodes", "UPDATE"),
            untainted.clone(),
            tainted.clone(),
            Some(false),
        ),
        (
            "another user (not matched)",
            &request("system:node:node-b", None, "nodes", "UPDATE"),
            node("node-x", &["new/taint"], json!({})),
            node("node-x", &[], json!({})),
            None,
        ),
    ];
    for (what, req, obj, old, want) in nodes {
        assert_eq!(decide(&vap, req, obj, old), *want, "{what}");
    }
    let create = request(AGENT, Some("node-a"), "events", "CREATE");
    let events: &[(&str, Value, Option<bool>)] = &[
        (
            "reported from its node",
            event(Some("node-a"), Some("node-a")),
            Some(true),
        ),
        (
            "core Event with source.host only",
            event(None, Some("node-a")),
            Some(true),
        ),
        (
            "reported as another node",
            event(Some("node-b"), Some("node-a")),
            Some(false),
        ),
        ("host of another node", event(None, Some("node-b")), Some(false)),
        ("no reporting instance", event(None, None), Some(false)),
    ];
    for (what, obj, want) in events {
        assert_eq!(decide(&vap, &create, obj, &null), *want, "event {what}");
    }
}

fn pod(node: &str, conditions: Value) -> Value {
    json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "app"},
           "spec": {"nodeName": node},
           "status": {"phase": "Running", "podIPs": [{"ip": "10.0.0.5"}], "conditions": conditions}})
}

/// Issue 43: the agent patches `pods/status` (the `npm.io/PolicyEnforced`
/// and `npm.io/PolicyDegraded` conditions) of its own node's pods only,
/// and changes nothing else of their status.
#[test]
fn the_agent_writes_only_npm_conditions_of_its_own_nodes_pods() {
    let vap = policy();
    let mut req = request(AGENT, Some("node-a"), "pods", "UPDATE");
    req["subResource"] = json!("status");
    let ready = json!({"type": "Ready", "status": "False"});
    let enforced = json!({"type": "npm.io/PolicyEnforced", "status": "True", "reason": "Enforced"});
    let not_yet = json!({"type": "npm.io/PolicyEnforced", "status": "False", "reason": "NoInterface"});
    let before = pod("node-a", json!([ready.clone(), not_yet.clone()]));
    let cases: &[(&str, &Value, Value, Value, Option<bool>)] = &[
        (
            "own node's pod, npm condition set",
            &req,
            pod("node-a", json!([ready.clone(), enforced.clone()])),
            before.clone(),
            Some(true),
        ),
        (
            "own node's pod, first npm condition",
            &req,
            pod("node-a", json!([ready.clone(), not_yet.clone()])),
            pod("node-a", json!([ready.clone()])),
            Some(true),
        ),
        (
            "another node's pod",
            &req,
            pod("node-b", json!([ready.clone(), enforced.clone()])),
            pod("node-b", json!([ready.clone(), not_yet.clone()])),
            Some(false),
        ),
        (
            "own node's pod, the kubelet's Ready condition changed",
            &req,
            pod("node-a", json!([{"type": "Ready", "status": "True"}, not_yet.clone()])),
            before.clone(),
            Some(false),
        ),
        (
            "own node's pod, its phase changed",
            &req,
            {
                let mut p = before.clone();
                p["status"]["phase"] = json!("Failed");
                p
            },
            before.clone(),
            Some(false),
        ),
        (
            "own node's pod, its addresses changed",
            &req,
            {
                let mut p = before.clone();
                p["status"]["podIPs"] = json!([{"ip": "10.0.0.6"}]);
                p
            },
            before.clone(),
            Some(false),
        ),
        (
            "a token without the node claim",
            &{
                let mut r = request(AGENT, None, "pods", "UPDATE");
                r["subResource"] = json!("status");
                r
            },
            pod("node-a", json!([ready.clone(), enforced.clone()])),
            before.clone(),
            Some(false),
        ),
    ];
    for (what, req, obj, old, want) in cases {
        assert_eq!(decide(&vap, req, obj, old), *want, "pods/status: {what}");
    }
    let rules = vap["spec"]["matchConstraints"]["resourceRules"].as_array().unwrap();
    assert!(
        rules.iter().any(|r| r["resources"][0] == "pods/status"),
        "pods/status writes are matched: {rules:?}"
    );
}

/// The chart grants `pods/status` patch only with `podConditions.enabled`,
/// and passes the rate limit to the agent.
#[test]
fn pod_conditions_grant_and_flags() {
    let render = |set: &[&str]| -> Vec<Value> {
        template(set)
            .into_iter()
            .map(|d| serde_json::to_value(d).unwrap())
            .collect()
    };
    let of_kind =
        |docs: &[Value], kind: &str| -> Vec<Value> { docs.iter().filter(|d| d["kind"] == kind).cloned().collect() };
    let grants = |docs: &[Value]| {
        of_kind(docs, "ClusterRole").iter().any(|r| {
            r["rules"].as_array().is_some_and(|rules| {
                rules
                    .iter()
                    .any(|x| x["resources"][0] == "pods/status" && x["verbs"][0] == "patch")
            })
        })
    };
    let on = render(&[]);
    assert!(grants(&on));
    let args = serde_json::to_string(&of_kind(&on, "DaemonSet")).unwrap();
    assert!(
        args.contains("--pod-condition-qps=5") && args.contains("--pod-condition-burst=20"),
        "{args}"
    );
    let off = render(&["podConditions.enabled=false"]);
    assert!(!grants(&off));
    let args = serde_json::to_string(&of_kind(&off, "DaemonSet")).unwrap();
    assert!(args.contains("--pod-condition-qps=0"), "{args}");
}

#[test]
fn rendered_by_the_clusters_version() {
    let count = |extra: &[&str]| {
        let chart = crate::chart::chart_dir();
        let mut args = vec!["template", "rel", chart.to_str().unwrap(), "--namespace", "npm-system"];
        args.extend_from_slice(extra);
        let (ok, out, err) = crate::chart::run_helm(&args);
        assert!(ok, "{err}");
        out.matches("kind: ValidatingAdmissionPolicyBinding").count()
    };
    let vap_api = [
        "--api-versions",
        "admissionregistration.k8s.io/v1/ValidatingAdmissionPolicy",
    ];
    let at = |v: &'static str| {
        let mut a = vap_api.to_vec();
        a.extend(["--kube-version", v]);
        a
    };
    assert_eq!(count(&at("1.32.0")), 1, "auto on 1.32 with the API");
    assert_eq!(count(&at("1.31.4")), 0, "auto before the node claim");
    assert_eq!(count(&["--kube-version", "1.33.0"]), 0, "auto without the API");
    let mut off = at("1.33.0");
    off.extend(["--set", "nodeRestriction.enabled=false"]);
    assert_eq!(count(&off), 0);
    assert_eq!(count(&["--set", "nodeRestriction.enabled=true"]), 1);
}
