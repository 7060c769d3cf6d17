//! An EndpointSlice controller for the netns cluster, doing what kube-controller-manager's
//! does: for every Service with a selector, the ready state of the Pods it selects as
//! `discovery.k8s.io/v1` EndpointSlices, one per address type (IPv4, IPv6) and per set of
//! resolved ports (a named `targetPort` resolves per Pod from its `containerPorts`, so Pods
//! that resolve it differently land in different slices, as upstream), labelled
//! `kubernetes.io/service-name` and `endpointslice.kubernetes.io/managed-by`, owned by the
//! Service, with `nodeName`, `targetRef` and `conditions`.
//!
//! Level-triggered from full lists of Services, Pods and EndpointSlices every interval;
//! when any list fails nothing is written (no slice is ever deleted or emptied from a
//! partial view). Only slices it manages are updated or deleted.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::time::Duration;

use serde_json::{json, Value};

use crate::api::Api;
use crate::kube_proxy::model::{chain_hash, SERVICE_NAME_LABEL};
use crate::poller::{Pass, Poller};

/// The managed-by label and its value.
pub const MANAGED_BY: (&str, &str) = (
    "endpointslice.kubernetes.io/managed-by",
    "endpointslice-controller.k8s.io",
);
/// How often the lists are read.
pub const INTERVAL: Duration = Duration::from_millis(100);

/// Errors of the controller.
#[derive(Debug, thiserror::Error)]
pub enum EndpointSliceError {
    /// The background thread could not be started.
    #[error("starting the EndpointSlice controller thread: {0}")]
    Thread(std::io::Error),
}

fn s<'a>(v: &'a Value, ptr: &str) -> &'a str {
    v.pointer(ptr).and_then(Value::as_str).unwrap_or("")
}

/// Whether a Pod counts as ready: its `Ready` condition when it has one, else phase
/// Running; never while it is being deleted.
pub fn pod_ready(pod: &Value) -> bool {
    if pod.pointer("/metadata/deletionTimestamp").is_some_and(|v| !v.is_null()) {
        return false;
    }
    let cond = pod
        .pointer("/status/conditions")
        .and_then(Value::as_array)
        .and_then(|cs| {
            cs.iter()
                .find(|c| c.get("type").and_then(Value::as_str) == Some("Ready"))
        });
    match cond {
        Some(c) => c.get("status").and_then(Value::as_str) == Some("True"),
        None => s(pod, "/status/phase") == "Running",
    }
}

/// The Pod's port for a Service port's `targetPort` and protocol (a number as is; a name
/// looked up in the Pod's container ports).
fn resolve(pod: &Value, target: &Value, proto: &str) -> Option<u16> {
    if let Some(n) = target.as_u64() {
        return u16::try_from(n).ok().filter(|n| *n > 0);
    }
    let name = target.as_str()?;
    if let Ok(n) = name.parse::<u16>() {
        return Some(n).filter(|n| *n > 0);
    }
    pod.pointer("/spec/containers")?
        .as_array()?
        .iter()
        .flat_map(|c| c.get("ports").and_then(Value::as_array).cloned().unwrap_or_default())
        .find(|p| {
            p.get("name").and_then(Value::as_str) == Some(name)
                && p.get("protocol").and_then(Value::as_str).unwrap_or("TCP") == proto
        })
        .and_then(|p| p.get("containerPort")?.as_u64())
        .and_then(|n| u16::try_from(n).ok())
}

fn selects(selector: &serde_json::Map<String, Value>, pod: &Value) -> bool {
    let labels = pod.pointer("/metadata/labels");
    selector.iter().all(|(k, v)| labels.and_then(|l| l.get(k)) == Some(v))
}

/// The EndpointSlices the controller wants for the full lists of Services and Pods, keyed
/// by `namespace/name`.
pub fn desired_slices(services: &[Value], pods: &[Value]) -> BTreeMap<String, Value> {
    let mut out = BTreeMap::new();
    for svc in services {
        let Some(selector) = svc
            .pointer("/spec/selector")
            .and_then(Value::as_object)
            .filter(|m| !m.is_empty())
        else {
            continue;
        };
        if s(svc, "/spec/type") == "ExternalName" {
            continue;
        }
        let (ns, name) = (s(svc, "/metadata/namespace"), s(svc, "/metadata/name"));
        let mut families: Vec<&str> = svc
            .pointer("/spec/ipFamilies")
            .and_then(Value::as_array)
            .map(|a| a.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        if families.is_empty() {
            families.push("IPv4");
        }
        let svc_ports: Vec<Value> = svc
            .pointer("/spec/ports")
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default();
        for fam in families {
            // Resolved port list -> endpoints.
            let mut groups: BTreeMap<String, (Vec<Value>, Vec<Value>)> = BTreeMap::new();
            for pod in pods
                .iter()
                .filter(|p| s(p, "/metadata/namespace") == ns && selects(selector, p))
            {
                let phase = s(pod, "/status/phase");
                if phase == "Succeeded" || phase == "Failed" {
                    continue;
                }
                let ips: Vec<IpAddr> = pod
                    .pointer("/status/podIPs")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                    .filter_map(|i| i.get("ip")?.as_str()?.parse().ok())
                    .filter(|ip: &IpAddr| ip.is_ipv6() == (fam == "IPv6"))
                    .collect();
                let Some(ip) = ips.first() else { continue };
                let mut ports = Vec::new();
                for p in &svc_ports {
                    let proto = p.get("protocol").and_then(Value::as_str).unwrap_or("TCP");
                    let target = p.get("targetPort").cloned().unwrap_or_else(|| p["port"].clone());
                    if let Some(port) = resolve(pod, &target, proto) {
                        ports.push(json!({"name": p.get("name").and_then(Value::as_str).unwrap_or(""), "port": port, "protocol": proto}));
                    }
                }
                let key = serde_json::to_string(&ports).unwrap_or_default();
                let ready = pod_ready(pod);
                let terminating = pod.pointer("/metadata/deletionTimestamp").is_some_and(|v| !v.is_null());
                let ep = json!({
                    "addresses": [ip.to_string()],
                    "conditions": {"ready": ready, "serving": ready, "terminating": terminating},
                    "nodeName": s(pod, "/spec/nodeName"),
                    "targetRef": {"kind": "Pod", "namespace": ns, "name": s(pod, "/metadata/name"), "uid": s(pod, "/metadata/uid")},
                });
                groups.entry(key).or_insert_with(|| (ports, Vec::new())).1.push(ep);
            }
            if groups.is_empty() {
                // As upstream: a placeholder slice without endpoints or ports.
                groups.insert(String::new(), (Vec::new(), Vec::new()));
            }
            for (key, (ports, mut eps)) in groups {
                eps.sort_by(|a, b| a["addresses"][0].as_str().cmp(&b["addresses"][0].as_str()));
                let slice_name = format!(
                    "{name}-{}",
                    chain_hash(&format!("{fam}/{key}"))[..10].to_ascii_lowercase()
                );
                let slice = json!({
                    "apiVersion": "discovery.k8s.io/v1",
                    "kind": "EndpointSlice",
                    "metadata": {
                        "namespace": ns,
                        "name": slice_name,
                        "labels": {SERVICE_NAME_LABEL: name, MANAGED_BY.0: MANAGED_BY.1},
                        "ownerReferences": [{"apiVersion": "v1", "kind": "Service", "name": name,
                            "uid": s(svc, "/metadata/uid"), "controller": true, "blockOwnerDeletion": true}],
                    },
                    "addressType": fam,
                    "endpoints": eps,
                    "ports": ports,
                });
                out.insert(format!("{ns}/{slice_name}"), slice);
            }
        }
    }
    out
}

/// Whether the stored slice already carries the desired content.
fn same(cur: &Value, want: &Value) -> bool {
    let norm = |v: &Value| v.as_array().cloned().unwrap_or_default();
    cur.get("addressType") == want.get("addressType")
        && norm(&cur["endpoints"]) == norm(&want["endpoints"])
        && norm(&cur["ports"]) == norm(&want["ports"])
        && cur.pointer("/metadata/labels") == want.pointer("/metadata/labels")
}

fn list(api: &Api, path: &str) -> Result<Vec<Value>, String> {
    let v = api.get(path).map_err(|e| e.to_string())?;
    match v.get("items") {
        Some(Value::Array(a)) => Ok(a.clone()),
        Some(Value::Null) => Ok(Vec::new()),
        _ => Err(format!("{path}: not a list")),
    }
}

/// One reconcile pass from full lists: the number of writes, or the first error.
pub fn reconcile_once(api: &Api) -> Result<usize, String> {
    let services = list(api, "/api/v1/services")?;
    let pods = list(api, "/api/v1/pods")?;
    let slices = list(api, "/apis/discovery.k8s.io/v1/endpointslices")?;
    let want = desired_slices(&services, &pods);
    let mut have: BTreeMap<String, Value> = BTreeMap::new();
    for sl in slices {
        if sl
            .pointer("/metadata/labels")
            .and_then(|l| l.get(MANAGED_BY.0))
            .and_then(Value::as_str)
            == Some(MANAGED_BY.1)
        {
            have.insert(
                format!("{}/{}", s(&sl, "/metadata/namespace"), s(&sl, "/metadata/name")),
                sl,
            );
        }
    }
    let mut writes = 0;
    for (key, slice) in &want {
        let (ns, name) = key.split_once('/').unwrap_or(("", key));
        let path = format!("/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices/{name}");
        match have.get(key) {
            Some(cur) if same(cur, slice) => continue,
            Some(cur) => {
                let mut obj = slice.clone();
                obj["metadata"]["resourceVersion"] = cur["metadata"]["resourceVersion"].clone();
                api.replace(&path, &obj).map_err(|e| e.to_string())?;
            }
            None => {
                let coll = format!("/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices");
                api.create(&coll, slice).map_err(|e| e.to_string())?;
            }
        }
        writes += 1;
    }
    let stale: BTreeSet<&String> = have.keys().filter(|k| !want.contains_key(*k)).collect();
    for key in stale {
        let (ns, name) = key.split_once('/').unwrap_or(("", key));
        api.delete(&format!(
            "/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices/{name}"
        ))
        .map_err(|e| e.to_string())?;
        writes += 1;
    }
    Ok(writes)
}

/// The running controller; dropping it stops it (the slices stay, as they would when
/// kube-controller-manager stops).
#[derive(Debug)]
pub struct EndpointSliceController {
    poller: Poller,
}

impl EndpointSliceController {
    /// Start reconciling in the background.
    pub fn start(api: Api) -> Result<EndpointSliceController, EndpointSliceError> {
        let poller = Poller::spawn(
            "endpointslice-controller".into(),
            INTERVAL,
            move || match reconcile_once(&api) {
                Ok(_) => Pass::Done,
                Err(e) => Pass::Failed(e),
            },
        )
        .map_err(EndpointSliceError::Thread)?;
        Ok(EndpointSliceController { poller })
    }

    /// Wait until one full pass succeeded.
    pub fn wait_synced(&self, timeout: Duration) -> bool {
        self.poller.wait_synced(timeout)
    }

    /// The error of the last pass, if it failed.
    pub fn last_error(&self) -> Option<String> {
        self.poller.last_error()
    }

    /// Stop the controller.
    pub fn stop(mut self) {
        self.poller.halt();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(name: &str, ip4: &str, ip6: &str, http_port: u16, ready: Option<bool>) -> Value {
        let mut p = json!({"metadata": {"namespace": "x", "name": name, "uid": format!("u-{name}"), "labels": {"app": "web"}},
            "spec": {"nodeName": "n1", "containers": [{"name": "c", "ports": [{"name": "http", "containerPort": http_port, "protocol": "TCP"}]}]},
            "status": {"phase": "Running", "podIPs": [{"ip": ip4}, {"ip": ip6}]}});
        if let Some(r) = ready {
            p["status"]["conditions"] = json!([{"type": "Ready", "status": if r { "True" } else { "False" }}]);
        }
        p
    }

    #[test]
    fn slices_per_family_and_resolved_ports() {
        let svc = json!({"metadata": {"namespace": "x", "name": "web", "uid": "s1"},
            "spec": {"selector": {"app": "web"}, "ipFamilies": ["IPv4", "IPv6"],
                "ports": [{"name": "h", "port": 80, "targetPort": "http", "protocol": "TCP"}, {"name": "m", "port": 90, "targetPort": 9090, "protocol": "UDP"}]}});
        let pods = vec![
            pod("a", "10.0.0.2", "fd00::2", 8080, None),
            pod("b", "10.0.0.3", "fd00::3", 8080, Some(false)),
            pod("c", "10.0.0.4", "fd00::4", 8081, Some(true)),
            json!({"metadata": {"namespace": "y", "name": "other", "labels": {"app": "web"}}, "status": {"phase": "Running", "podIPs": [{"ip": "10.9.9.9"}]}}),
        ];
        let want = desired_slices(std::slice::from_ref(&svc), &pods);
        // 2 families x 2 resolved port sets (8080 for a and b, 8081 for c).
        assert_eq!(want.len(), 4, "{want:#?}");
        let v4: Vec<&Value> = want.values().filter(|s| s["addressType"] == "IPv4").collect();
        let with_8080 = v4.iter().find(|s| s["ports"][0]["port"] == 8080).unwrap();
        assert_eq!(with_8080["endpoints"].as_array().unwrap().len(), 2);
        assert_eq!(with_8080["endpoints"][0]["addresses"][0], "10.0.0.2");
        assert_eq!(with_8080["endpoints"][0]["conditions"]["ready"], true);
        assert_eq!(with_8080["endpoints"][1]["conditions"]["ready"], false);
        assert_eq!(with_8080["endpoints"][0]["nodeName"], "n1");
        assert_eq!(
            with_8080["ports"][1],
            json!({"name": "m", "port": 9090, "protocol": "UDP"})
        );
        assert_eq!(with_8080["metadata"]["labels"][SERVICE_NAME_LABEL], "web");
        let v6 = want
            .values()
            .find(|s| s["addressType"] == "IPv6" && s["ports"][0]["port"] == 8081)
            .unwrap();
        assert_eq!(v6["endpoints"][0]["addresses"][0], "fd00::4");
        // No selected pod: one placeholder per family; no selector: none.
        assert_eq!(desired_slices(&[svc], &[]).len(), 2);
        let no_sel = json!({"metadata": {"namespace": "x", "name": "manual"}, "spec": {"ports": [{"port": 80}]}});
        assert!(desired_slices(&[no_sel], &pods).is_empty());
    }
}
