//! Tests of Service allocation: ClusterIPs per family, headless, NodePorts, conflicts,
//! immutability, carry-over on PUT and release on delete.

use super::*;
use crate::store::Sub;

fn store() -> Store {
    let mut s = Store::new(true, 10_000);
    s.create(Kind::Namespace, None, json!({"metadata": {"name": "ns"}}))
        .unwrap();
    s
}

fn svc(name: &str, spec: Value) -> Value {
    json!({"metadata": {"name": name}, "spec": spec})
}

fn create(s: &mut Store, name: &str, spec: Value) -> Result<Value, ApiError> {
    s.create(Kind::Service, Some("ns"), svc(name, spec))
        .map(|o| (*o).clone())
}

fn causes(e: ApiError) -> Vec<(String, String)> {
    match e {
        ApiError::Invalid { causes, .. } => causes.into_iter().map(|c| (c.field, c.message)).collect(),
        other => panic!("expected 422, got {other:?}"),
    }
}

fn ip(o: &Value, i: usize) -> IpAddr {
    o["spec"]["clusterIPs"][i].as_str().unwrap().parse().unwrap()
}

#[test]
fn cluster_ips_by_family_policy() {
    let mut s = store();
    let v4 = create(&mut s, "a", json!({"ports": [{"port": 80}]})).unwrap();
    assert_eq!(v4["spec"]["ipFamilyPolicy"], "SingleStack");
    assert_eq!(v4["spec"]["ipFamilies"], json!(["IPv4"]));
    assert_eq!(v4["spec"]["clusterIP"], v4["spec"]["clusterIPs"][0]);
    let net: IpNet = "10.96.0.0/16".parse().unwrap();
    assert!(net.contains(&ip(&v4, 0)));
    assert_ne!(
        ip(&v4, 0),
        "10.96.0.1".parse::<IpAddr>().unwrap(),
        "the first host is static-only"
    );

    let v6 = create(&mut s, "b", json!({"ipFamilies": ["IPv6"], "ports": [{"port": 80}]})).unwrap();
    assert_eq!(v6["spec"]["ipFamilies"], json!(["IPv6"]));
    assert!("fd00:96::/112".parse::<IpNet>().unwrap().contains(&ip(&v6, 0)));

    let dual = create(
        &mut s,
        "c",
        json!({"ipFamilyPolicy": "PreferDualStack", "ports": [{"port": 80}]}),
    )
    .unwrap();
    assert_eq!(dual["spec"]["ipFamilies"], json!(["IPv4", "IPv6"]));
    assert!(ip(&dual, 0).is_ipv4() && ip(&dual, 1).is_ipv6());

    let dual6 = create(
        &mut s,
        "d",
        json!({"ipFamilyPolicy": "RequireDualStack", "ipFamilies": ["IPv6"], "ports": [{"port": 80}]}),
    )
    .unwrap();
    assert_eq!(dual6["spec"]["ipFamilies"], json!(["IPv6", "IPv4"]));
    assert!(ip(&dual6, 0).is_ipv6() && ip(&dual6, 1).is_ipv4());

    // A given IP decides the family.
    let given = create(
        &mut s,
        "e",
        json!({"clusterIP": "fd00:96::10", "ports": [{"port": 80}]}),
    )
    .unwrap();
    assert_eq!(given["spec"]["ipFamilies"], json!(["IPv6"]));
    assert_eq!(given["spec"]["clusterIPs"], json!(["fd00:96::10"]));

    // Headless: kept as None; without a selector it is dual-stack by default.
    let headless = create(&mut s, "f", json!({"clusterIP": "None"})).unwrap();
    assert_eq!(headless["spec"]["clusterIPs"], json!(["None"]));
    assert_eq!(headless["spec"]["ipFamilyPolicy"], "RequireDualStack");
    let headless = create(&mut s, "g", json!({"clusterIP": "None", "selector": {"app": "x"}})).unwrap();
    assert_eq!(headless["spec"]["ipFamilyPolicy"], "SingleStack");

    // A single-stack cluster refuses RequireDualStack and the other family.
    let mut single = store();
    single.service_network.cidrs = vec!["10.0.0.0/24".parse().unwrap()];
    let e = create(
        &mut single,
        "a",
        json!({"ipFamilyPolicy": "RequireDualStack", "ports": [{"port": 80}]}),
    )
    .unwrap_err();
    assert_eq!(causes(e)[0].0, "spec.ipFamilyPolicy");
    let e = create(
        &mut single,
        "a",
        json!({"ipFamilies": ["IPv6"], "ports": [{"port": 80}]}),
    )
    .unwrap_err();
    assert_eq!(causes(e)[0].0, "spec.ipFamilies[0]");
    let pref = create(
        &mut single,
        "a",
        json!({"ipFamilyPolicy": "PreferDualStack", "ports": [{"port": 80}]}),
    )
    .unwrap();
    assert_eq!(pref["spec"]["ipFamilies"], json!(["IPv4"]));
}

#[test]
fn cluster_ip_conflicts_range_immutability_and_release() {
    let mut s = store();
    create(&mut s, "a", json!({"clusterIP": "10.96.0.10", "ports": [{"port": 80}]})).unwrap();
    let e = create(&mut s, "b", json!({"clusterIP": "10.96.0.10", "ports": [{"port": 80}]})).unwrap_err();
    let c = causes(e);
    assert_eq!(c[0].0, "spec.clusterIPs[0]");
    assert!(c[0].1.contains("already allocated"), "{c:?}");
    let e = create(&mut s, "b", json!({"clusterIP": "10.97.0.10", "ports": [{"port": 80}]})).unwrap_err();
    assert!(causes(e)[0].1.contains("not in the valid range"));
    assert!(
        s.get(Kind::Service, Some("ns"), "b").is_err(),
        "nothing written on failure"
    );

    // A PUT without the ClusterIP keeps it; changing it is refused.
    let mut put = svc("a", json!({"ports": [{"port": 81}]}));
    let kept = s
        .update(Kind::Service, Some("ns"), "a", put.clone(), Sub::Main)
        .unwrap();
    assert_eq!(kept["spec"]["clusterIP"], "10.96.0.10");
    assert_eq!(kept["spec"]["ports"][0]["port"], 81);
    put["spec"]["clusterIP"] = json!("10.96.0.11");
    let e = s.update(Kind::Service, Some("ns"), "a", put, Sub::Main).unwrap_err();
    assert!(causes(e)
        .iter()
        .any(|(f, m)| f == "spec.clusterIPs[0]" && m.contains("immutable")));

    // Deleting releases the address.
    s.delete(Kind::Service, Some("ns"), "a", None, None).unwrap();
    create(&mut s, "b", json!({"clusterIP": "10.96.0.10", "ports": [{"port": 80}]})).unwrap();
    // Deleting the namespace releases its Services' addresses too.
    s.delete(Kind::Namespace, None, "ns", None, None).unwrap();
    s.create(Kind::Namespace, None, json!({"metadata": {"name": "ns"}}))
        .unwrap();
    create(&mut s, "c", json!({"clusterIP": "10.96.0.10", "ports": [{"port": 80}]})).unwrap();
}

#[test]
fn small_range_allocates_every_address_once_then_reports_full() {
    let mut s = store();
    s.service_network.cidrs = vec!["10.1.0.0/29".parse().unwrap()];
    let mut seen = HashSet::new();
    // /29: 8 addresses minus network, first host and broadcast.
    for i in 0..5 {
        let o = create(&mut s, &format!("s{i}"), json!({"ports": [{"port": 80}]})).unwrap();
        assert!(seen.insert(ip(&o, 0)));
    }
    let e = create(&mut s, "full", json!({"ports": [{"port": 80}]})).unwrap_err();
    assert!(causes(e)[0].1.contains("full"));
    let want: HashSet<IpAddr> = (2..=6).map(|i| format!("10.1.0.{i}").parse().unwrap()).collect();
    assert_eq!(seen, want);
}

#[test]
fn node_ports() {
    let mut s = store();
    let a = create(
        &mut s,
        "a",
        json!({"type": "NodePort", "ports": [{"name": "h", "port": 80}, {"name": "d", "port": 53, "protocol": "UDP", "nodePort": 30053}]}),
    )
    .unwrap();
    let np = a["spec"]["ports"][0]["nodePort"].as_u64().unwrap();
    assert!((30000..=32767).contains(&np));
    assert_eq!(a["spec"]["ports"][1]["nodePort"], 30053);
    assert_eq!(a["spec"]["externalTrafficPolicy"], "Cluster");
    // Duplicates across Services and out-of-range ports are refused.
    let e = create(
        &mut s,
        "b",
        json!({"type": "NodePort", "ports": [{"port": 80, "nodePort": 30053}]}),
    )
    .unwrap_err();
    assert!(causes(e)[0].1.contains("already allocated"));
    let e = create(
        &mut s,
        "b",
        json!({"type": "NodePort", "ports": [{"port": 80, "nodePort": 8080}]}),
    )
    .unwrap_err();
    assert!(causes(e)[0].1.contains("valid range"));
    // Within one Service a port number may serve TCP and UDP, not the same protocol twice.
    create(
        &mut s,
        "dns",
        json!({"type": "NodePort", "ports": [{"name": "t", "port": 53, "nodePort": 30054}, {"name": "u", "port": 53, "protocol": "UDP", "nodePort": 30054}]}),
    )
    .unwrap();
    let e = create(
        &mut s,
        "dup",
        json!({"type": "NodePort", "ports": [{"name": "t", "port": 53, "nodePort": 30055}, {"name": "u", "port": 54, "nodePort": 30055}]}),
    )
    .unwrap_err();
    assert_eq!(causes(e)[0].0, "spec.ports[1].nodePort");
    // nodePort on a ClusterIP Service is forbidden.
    let e = create(&mut s, "c", json!({"ports": [{"port": 80, "nodePort": 30100}]})).unwrap_err();
    assert_eq!(causes(e)[0].0, "spec.ports[0].nodePort");
    // A PUT keeps the allocated port of the same port/protocol; a type change to ClusterIP
    // drops them and releases them.
    let put = svc("a", json!({"type": "NodePort", "ports": [{"name": "h", "port": 80}]}));
    let kept = s.update(Kind::Service, Some("ns"), "a", put, Sub::Main).unwrap();
    assert_eq!(kept["spec"]["ports"][0]["nodePort"].as_u64(), Some(np));
    let mut to_cip = (*kept).clone();
    to_cip["spec"]["type"] = json!("ClusterIP");
    to_cip["spec"].as_object_mut().unwrap().remove("externalTrafficPolicy");
    let cip = s.update(Kind::Service, Some("ns"), "a", to_cip, Sub::Main).unwrap();
    assert!(cip["spec"]["ports"][0].get("nodePort").is_none());
    create(
        &mut s,
        "e",
        json!({"type": "NodePort", "ports": [{"port": 80, "nodePort": np}]}),
    )
    .unwrap();
    // Allocation fills a small range exactly.
    let mut small = store();
    small.service_network.node_ports = 31000..=31002;
    let o = create(
        &mut small,
        "x",
        json!({"type": "NodePort", "ports": [{"name": "a", "port": 1}, {"name": "b", "port": 2}, {"name": "c", "port": 3}]}),
    )
    .unwrap();
    let got: HashSet<u64> = (0..3)
        .map(|i| o["spec"]["ports"][i]["nodePort"].as_u64().unwrap())
        .collect();
    assert_eq!(got, HashSet::from([31000, 31001, 31002]));
    let e = create(&mut small, "y", json!({"type": "NodePort", "ports": [{"port": 1}]})).unwrap_err();
    assert!(causes(e)[0].1.contains("full"));
}

#[test]
fn status_writes_keep_allocations() {
    let mut s = store();
    let a = create(&mut s, "a", json!({"type": "NodePort", "ports": [{"port": 80}]})).unwrap();
    let mut st = a.clone();
    st["status"] = json!({"loadBalancer": {"ingress": [{"ip": "192.0.2.1"}]}});
    let after = s.update(Kind::Service, Some("ns"), "a", st, Sub::Status).unwrap();
    assert_eq!(after["spec"], a["spec"]);
    assert_eq!(after["status"]["loadBalancer"]["ingress"][0]["ip"], "192.0.2.1");
}
