//! Reproduces the agent benchmark's churn on the incremental compiler:
//! 10,000 pods in 10 namespaces (100 local), 1,000 policies, then 500 pod
//! creates and 500 policy creates (all selecting the same local pods)
//! applied one by one; prints the time of `Compiler::new` and per-change
//! percentiles. Run:
//! `cargo run --release -p npm-policy --example churn_incremental [changes]`
//! (with `NPM_CHURN_CHECK=1`, the result is compared with `compile()`).

use std::net::IpAddr;
use std::time::Instant;

use npm_policy::compiled::CompileOptions;
use npm_policy::incremental::Compiler;
use npm_policy::model::*;

const PODS: usize = 10_000;
const POLICIES: usize = 1_000;
const NAMESPACES: usize = 10;

fn ip_of(i: usize) -> IpAddr {
    format!("10.{}.{}.{}", 100 + i / 65536, (i / 256) % 256, i % 256)
        .parse()
        .expect("valid address")
}

fn app(x: usize) -> Selector {
    Selector {
        match_labels: [("app".to_string(), format!("g{}", x % 100))].into(),
        match_expressions: vec![],
    }
}

fn pod(ns: &str, i: usize, local: bool) -> Pod {
    Pod {
        uid: format!("uid-{i}"),
        namespace: ns.into(),
        name: format!("p{i}"),
        labels: [("app".to_string(), format!("g{}", i % 100))].into(),
        ips: vec![ip_of(i)],
        node_name: Some(if local { "node-a" } else { "node-b" }.into()),
        phase: PodPhase::Running,
        deleting: false,
        host_network: false,
        ports: vec![],
        created: i as i64,
    }
}

fn policy(ns: &str, name: &str, select: usize, from: usize, port: u16) -> Policy {
    Policy {
        namespace: ns.into(),
        name: name.into(),
        pod_selector: app(select),
        ingress_isolation: true,
        egress_isolation: false,
        ingress: vec![Rule {
            ports: vec![Port {
                protocol: Protocol::Tcp,
                port: PortSpec::Range(port, port),
            }],
            peers: vec![Peer::Pods(app(from))],
        }],
        egress: vec![],
    }
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[((v.len() as f64 - 1.0) * p).round() as usize]
}

fn main() {
    let changes: usize = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(1000);
    let mut s = Snapshot::default();
    for n in 0..NAMESPACES {
        let name = format!("bench{n}");
        let labels = [("kubernetes.io/metadata.name".to_string(), name.clone())].into();
        s.namespaces.insert(name.clone(), Namespace { name, labels });
    }
    for i in 0..PODS {
        let ns = format!("bench{}", i % NAMESPACES);
        let p = pod(&ns, i, i % 100 == 0);
        s.pods.insert((ns, p.name.clone()), p);
    }
    for i in 0..POLICIES {
        let ns = format!("bench{}", i % NAMESPACES);
        let p = policy(&ns, &format!("np{i}"), i, i + 1, 1000 + (i % 100) as u16);
        s.policies.insert((ns, p.name.clone()), p);
    }
    let opts = CompileOptions {
        node_name: "node-a".into(),
        node_ips: vec![],
        allow_host_egress: false,
        report_new: false,
    };
    let t = Instant::now();
    let full = npm_policy::compile(&s, &opts, None);
    let full_ms = t.elapsed().as_secs_f64() * 1e3;
    let t = Instant::now();
    let mut c = Compiler::new(s, opts.clone(), Some(&full));
    let new_ms = t.elapsed().as_secs_f64() * 1e3;
    let (mut pods_ms, mut pols_ms) = (Vec::new(), Vec::new());
    for k in 0..changes {
        let i = PODS + k;
        let t = Instant::now();
        if k % 2 == 0 {
            c.upsert_pod(pod("bench0", i, false));
            pods_ms.push(t.elapsed().as_secs_f64() * 1e3);
        } else {
            c.upsert_policy(policy("bench0", &format!("churn{k}"), 0, k * 10, 2000 + k as u16));
            pols_ms.push(t.elapsed().as_secs_f64() * 1e3);
        }
    }
    let last_pol = *pols_ms.last().unwrap_or(&0.0);
    println!(
        "full compile {full_ms:.1} ms, Compiler::new {new_ms:.1} ms; pod create p50 {:.3} p99 {:.3} ms; \
         policy create p50 {:.3} p99 {:.3} last {last_pol:.3} ms",
        pct(&mut pods_ms, 0.5),
        pct(&mut pods_ms, 0.99),
        pct(&mut pols_ms, 0.5),
        pct(&mut pols_ms, 0.99),
    );
    if std::env::var("NPM_CHURN_CHECK").is_ok_and(|v| v == "1") {
        let want = npm_policy::compile(c.snapshot(), &opts, Some(c.compiled()));
        assert_eq!(want.policy, c.compiled().policy, "policy entries differ from compile()");
        assert_eq!(want.ipcache, c.compiled().ipcache, "ipcache differs from compile()");
        assert_eq!(
            want.endpoints,
            c.compiled().endpoints,
            "endpoints differ from compile()"
        );
        println!("matches compile()");
    }
}
