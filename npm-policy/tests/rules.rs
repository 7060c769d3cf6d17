//! Table tests of the semantics: each case tweaks a base policy and checks
//! flows on the upstream model (x, y, z with pods a, b, c) with BOTH the
//! reference evaluator and the datapath lookup on the compiled form.

use std::net::IpAddr;

use npm_policy::compiled::{CompileOptions, Direction};
use npm_policy::evaluate::{evaluate, Flow};
use npm_policy::lookup::lookup;
use npm_policy::model::*;
use npm_sim::cases::Model;

const TCP: u8 = 6;
const UDP: u8 = 17;
const SCTP: u8 = 132;
const ICMP: u8 = 1;
const NODE_IP: &str = "192.168.0.10";

fn sel(pairs: &[(&str, &str)]) -> Selector {
    Selector {
        match_labels: pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
        match_expressions: vec![],
    }
}

/// Base: policy `x/base` selecting x/a, ingress-isolated, no rules.
fn base() -> Policy {
    Policy {
        namespace: "x".into(),
        name: "base".into(),
        pod_selector: sel(&[("pod", "a")]),
        ingress_isolation: true,
        egress_isolation: false,
        ingress: vec![],
        egress: vec![],
    }
}

type Tweak = fn(&mut Policy);

fn rule(peers: Vec<Peer>, ports: Vec<Port>) -> Rule {
    Rule { ports, peers }
}
fn tcp(p: u16) -> Port {
    Port {
        protocol: Protocol::Tcp,
        port: PortSpec::Range(p, p),
    }
}
fn named(n: &str, protocol: Protocol) -> Port {
    Port {
        protocol,
        port: PortSpec::Named(n.into()),
    }
}
fn block(cidr: &str, except: &[&str]) -> Peer {
    Peer::IpBlock(IpBlock {
        cidr: cidr.parse().unwrap(),
        except: except.iter().map(|e| e.parse().unwrap()).collect(),
    })
}

struct Case {
    name: &'static str,
    tweaks: Vec<Tweak>,
    extra: Vec<Policy>,
    /// Changes to the model's pods before compiling.
    pods: Vec<fn(&mut Snapshot)>,
    allow_host_egress: bool,
    /// (from, to, protocol, port, allowed); from/to are `ns/pod`, `ns/pod@6`
    /// (IPv6) or a literal address.
    flows: Vec<(&'static str, &'static str, u8, u16, bool)>,
}

fn addr(m: &Model, s: &str) -> IpAddr {
    if let Some(p) = s.strip_suffix("@6") {
        return m
            .snapshot
            .pods
            .values()
            .find(|x| format!("{}/{}", x.namespace, x.name) == p)
            .unwrap()
            .ips[1];
    }
    m.ip(s).unwrap_or_else(|| s.parse().unwrap())
}

fn run(case: &Case) {
    let mut m = Model::upstream();
    // A hostNetwork pod on the node, with the node's address.
    m.snapshot.pods.insert(
        ("x".into(), "hostnet".into()),
        Pod {
            uid: "hostnet".into(),
            namespace: "x".into(),
            name: "hostnet".into(),
            labels: [("pod".to_string(), "a".to_string())].into(),
            ips: vec![NODE_IP.parse().unwrap()],
            node_name: Some("npm-node".into()),
            phase: PodPhase::Running,
            deleting: false,
            host_network: true,
            ports: vec![],
            created: 1,
        },
    );
    for f in &case.pods {
        f(&mut m.snapshot);
    }
    let mut p = base();
    for t in &case.tweaks {
        t(&mut p);
    }
    for pol in std::iter::once(p).chain(case.extra.iter().cloned()) {
        m.snapshot
            .policies
            .insert((pol.namespace.clone(), pol.name.clone()), pol);
    }
    let opts = CompileOptions {
        node_name: "npm-node".into(),
        node_ips: vec![NODE_IP.parse().unwrap()],
        allow_host_egress: case.allow_host_egress,
        report_new: false,
    };
    let c = npm_policy::compile(&m.snapshot, &opts, None);
    for (i, (from, to, proto, port, want)) in case.flows.iter().enumerate() {
        let (src, dst) = (addr(&m, from), addr(&m, to));
        let v = evaluate(
            &m.snapshot,
            &opts,
            &Flow {
                src,
                dst,
                protocol: *proto,
                dst_port: *port,
            },
        );
        assert_eq!(
            v.allowed, *want,
            "{} flow {i} {from}->{to} {proto}/{port}: evaluator {v}",
            case.name
        );
        let ep = |ip: IpAddr| {
            c.endpoints
                .iter()
                .find(|(_, e)| e.ipv4.map(IpAddr::V4) == Some(ip) || e.ipv6.map(IpAddr::V6) == Some(ip))
                .map(|(id, _)| *id)
        };
        let eg = ep(src).is_none_or(|e| lookup(&c, e, Direction::Egress, dst, *proto, *port).allowed);
        let ing = ep(dst).is_none_or(|e| lookup(&c, e, Direction::Ingress, src, *proto, *port).allowed);
        assert_eq!(
            eg && ing,
            *want,
            "{} flow {i} {from}->{to} {proto}/{port}: compiled\n{}",
            case.name,
            c.render_table()
        );
    }
}

fn case(name: &'static str, tweaks: Vec<Tweak>, flows: Vec<(&'static str, &'static str, u8, u16, bool)>) -> Case {
    Case {
        name,
        tweaks,
        extra: vec![],
        pods: vec![],
        allow_host_egress: false,
        flows,
    }
}

/// Gives pod `ns/name` of the model an extra container port.
fn add_port(s: &mut Snapshot, ns: &str, name: &str, port_name: &str, port: u16, protocol: Protocol) {
    s.pods
        .get_mut(&(ns.to_string(), name.to_string()))
        .expect("model pod")
        .ports
        .push(ContainerPort {
            name: Some(port_name.into()),
            port,
            protocol,
        });
}

#[test]
fn rules_table() {
    let cases = vec![
        case(
            "isolated, no rules: deny all ingress",
            vec![],
            vec![
                ("x/b", "x/a", TCP, 80, false),
                ("y/a", "x/a", UDP, 53, false),
                ("x/a", "x/b", TCP, 80, true),
                ("y/a", "x/b", TCP, 80, true),
            ],
        ),
        case(
            "ingress [{}] allows everything",
            vec![|p| p.ingress = vec![Rule::default()]],
            vec![("z/c", "x/a", SCTP, 9, true), ("8.8.8.8", "x/a", TCP, 1, true)],
        ),
        case(
            "egress-only policy leaves ingress open",
            vec![|p| {
                p.ingress_isolation = false;
                p.egress_isolation = true;
            }],
            vec![
                ("y/a", "x/a", TCP, 80, true),
                ("x/a", "y/a", TCP, 80, false),
                ("x/a", NODE_IP, TCP, 80, false),
            ],
        ),
        case(
            "pod selector peer: policy namespace only",
            vec![|p| p.ingress = vec![rule(vec![Peer::Pods(sel(&[("pod", "b")]))], vec![])]],
            vec![
                ("x/b", "x/a", TCP, 80, true),
                ("y/b", "x/a", TCP, 80, false),
                ("x/c", "x/a", TCP, 80, false),
            ],
        ),
        case(
            "namespace selector peer",
            vec![|p| p.ingress = vec![rule(vec![Peer::Namespaces(sel(&[("ns", "y")]))], vec![])]],
            vec![
                ("y/a", "x/a", TCP, 80, true),
                ("y/c", "x/a", UDP, 81, true),
                ("x/b", "x/a", TCP, 80, false),
                ("z/a", "x/a", TCP, 80, false),
            ],
        ),
        case(
            "empty namespace selector: every namespace, no external",
            vec![|p| p.ingress = vec![rule(vec![Peer::Namespaces(Selector::default())], vec![])]],
            vec![
                ("z/b", "x/a", TCP, 80, true),
                ("x/b", "x/a", TCP, 80, true),
                ("8.8.8.8", "x/a", TCP, 80, false),
            ],
        ),
        case(
            "pod AND namespace in one peer",
            vec![|p| {
                p.ingress = vec![rule(
                    vec![Peer::PodsInNamespaces {
                        namespaces: sel(&[("ns", "y")]),
                        pods: sel(&[("pod", "b")]),
                    }],
                    vec![],
                )]
            }],
            vec![
                ("y/b", "x/a", TCP, 80, true),
                ("y/a", "x/a", TCP, 80, false),
                ("x/b", "x/a", TCP, 80, false),
                ("z/b", "x/a", TCP, 80, false),
            ],
        ),
        case(
            "two peers OR",
            vec![|p| {
                p.ingress = vec![rule(
                    vec![Peer::Namespaces(sel(&[("ns", "z")])), Peer::Pods(sel(&[("pod", "c")]))],
                    vec![],
                )]
            }],
            vec![
                ("z/a", "x/a", TCP, 80, true),
                ("x/c", "x/a", TCP, 80, true),
                ("x/b", "x/a", TCP, 80, false),
                ("y/c", "x/a", TCP, 80, false),
            ],
        ),
        case(
            "ipBlock with except matches pod IPs",
            vec![|p| p.ingress = vec![rule(vec![block("198.18.2.0/24", &["198.18.2.2/32"])], vec![])]],
            vec![
                ("y/a", "x/a", TCP, 80, true),
                ("y/c", "x/a", TCP, 80, true),
                ("y/b", "x/a", TCP, 80, false),
                ("z/a", "x/a", TCP, 80, false),
                ("198.18.2.77", "x/a", TCP, 80, true),
            ],
        ),
        case(
            "ipBlock 0.0.0.0/0 matches pods and outside; not IPv6",
            vec![|p| p.ingress = vec![rule(vec![block("0.0.0.0/0", &[])], vec![])]],
            vec![
                ("z/c", "x/a", TCP, 80, true),
                ("8.8.8.8", "x/a", TCP, 80, true),
                ("z/c@6", "x/a@6", TCP, 80, false),
                ("2001:db8::1", "x/a@6", TCP, 80, false),
            ],
        ),
        case(
            "ipBlock ::/0 matches IPv6 only",
            vec![|p| p.ingress = vec![rule(vec![block("::/0", &["fd00:198:18::2:0/112"])], vec![])]],
            vec![
                ("z/c@6", "x/a@6", TCP, 80, true),
                ("y/c@6", "x/a@6", TCP, 80, false),
                ("z/c", "x/a", TCP, 80, false),
                ("8.8.8.8", "x/a", TCP, 80, false),
            ],
        ),
        case(
            "numeric port: protocol defaults to TCP and must match",
            vec![|p| p.ingress = vec![rule(vec![], vec![tcp(80)])]],
            vec![
                ("y/a", "x/a", TCP, 80, true),
                ("y/a", "x/a", TCP, 81, false),
                ("y/a", "x/a", UDP, 80, false),
                ("y/a", "x/a", SCTP, 80, false),
            ],
        ),
        case(
            "port range endPort inclusive",
            vec![|p| {
                p.ingress = vec![rule(
                    vec![],
                    vec![Port {
                        protocol: Protocol::Udp,
                        port: PortSpec::Range(80, 81),
                    }],
                )]
            }],
            vec![
                ("y/a", "x/a", UDP, 80, true),
                ("y/a", "x/a", UDP, 81, true),
                ("y/a", "x/a", UDP, 82, false),
                ("y/a", "x/a", UDP, 79, false),
                ("y/a", "x/a", TCP, 80, false),
            ],
        ),
        case(
            "protocol without port: every port of it",
            vec![|p| {
                p.ingress = vec![rule(
                    vec![],
                    vec![Port {
                        protocol: Protocol::Sctp,
                        port: PortSpec::All,
                    }],
                )]
            }],
            vec![
                ("y/a", "x/a", SCTP, 80, true),
                ("y/a", "x/a", SCTP, 65535, true),
                ("y/a", "x/a", TCP, 80, false),
            ],
        ),
        case(
            "ingress named port: name AND protocol on the selected pod, any peer",
            vec![|p| {
                p.ingress = vec![rule(
                    vec![block("198.18.0.0/16", &[])],
                    vec![named("serve-81-udp", Protocol::Udp)],
                )]
            }],
            vec![
                ("y/a", "x/a", UDP, 81, true),
                ("y/a", "x/a", TCP, 81, false),
                ("y/a", "x/a", UDP, 80, false),
            ],
        ),
        case(
            "ingress named port with no peers",
            vec![|p| p.ingress = vec![rule(vec![], vec![named("serve-80-sctp", Protocol::Sctp)])]],
            vec![
                ("z/a", "x/a", SCTP, 80, true),
                ("z/a", "x/a", TCP, 80, false),
                ("8.8.8.8", "x/a", SCTP, 80, true),
            ],
        ),
        case(
            "ingress named port with the wrong protocol matches nothing",
            vec![|p| p.ingress = vec![rule(vec![], vec![named("serve-80-udp", Protocol::Tcp)])]],
            vec![("z/a", "x/a", TCP, 80, false), ("z/a", "x/a", UDP, 80, false)],
        ),
        case(
            "egress named port resolves on the destination pod",
            vec![|p| {
                p.ingress_isolation = false;
                p.egress_isolation = true;
                p.egress = vec![rule(
                    vec![Peer::Namespaces(sel(&[("ns", "y")]))],
                    vec![named("serve-81-tcp", Protocol::Tcp)],
                )];
            }],
            vec![
                ("x/a", "y/a", TCP, 81, true),
                ("x/a", "y/a", TCP, 80, false),
                ("x/a", "y/a", UDP, 81, false),
                ("x/a", "z/a", TCP, 81, false),
            ],
        ),
        case(
            "egress named port to an ipBlock matches nothing, pods included",
            vec![|p| {
                p.ingress_isolation = false;
                p.egress_isolation = true;
                p.egress = vec![rule(
                    vec![block("0.0.0.0/0", &[])],
                    vec![named("serve-80-tcp", Protocol::Tcp)],
                )];
            }],
            vec![
                ("x/a", "y/a", TCP, 80, false),
                ("x/a", "x/b", TCP, 80, false),
                ("x/a", "8.8.8.8", TCP, 80, false),
            ],
        ),
        case(
            // Upstream e2e "should allow egress access on one named port".
            "egress named port with an empty to: any pod resolving the name",
            vec![|p| {
                p.ingress_isolation = false;
                p.egress_isolation = true;
                p.egress = vec![rule(vec![], vec![named("serve-80-tcp", Protocol::Tcp)])];
            }],
            vec![
                ("x/a", "y/a", TCP, 80, true),
                ("x/a", "x/b", TCP, 80, true),
                ("x/a@6", "z/c@6", TCP, 80, true),
                ("x/a", "y/a", TCP, 81, false),
                ("x/a", "y/a", UDP, 80, false),
                ("x/a", "8.8.8.8", TCP, 80, false),
                ("x/a", NODE_IP, TCP, 80, false),
            ],
        ),
        Case {
            name: "egress named port with an empty to resolves per destination pod",
            tweaks: vec![|p| {
                p.ingress_isolation = false;
                p.egress_isolation = true;
                p.egress = vec![rule(vec![], vec![named("web", Protocol::Tcp)])];
            }],
            extra: vec![],
            pods: vec![
                |s| add_port(s, "y", "a", "web", 8080, Protocol::Tcp),
                |s| add_port(s, "y", "b", "web", 9090, Protocol::Tcp),
                |s| add_port(s, "y", "c", "web", 8080, Protocol::Udp),
            ],
            allow_host_egress: false,
            flows: vec![
                ("x/a", "y/a", TCP, 8080, true),
                ("x/a", "y/a", TCP, 9090, false),
                ("x/a", "y/b", TCP, 9090, true),
                ("x/a", "y/b", TCP, 8080, false),
                ("x/a", "y/c", TCP, 8080, false),
                ("x/a", "y/c", UDP, 8080, false),
                ("x/a", "z/a", TCP, 8080, false),
                ("x/a", "8.8.8.8", TCP, 8080, false),
                ("x/a", "8.8.8.8", TCP, 9090, false),
                // Unrelated ports stay closed.
                ("x/a", "y/a", TCP, 80, false),
            ],
        },
        case(
            "policyTypes [Ingress, Egress] without egress rules denies egress",
            vec![|p| {
                p.egress_isolation = true;
                p.ingress = vec![Rule::default()];
            }],
            vec![
                ("x/a", "x/b", TCP, 80, false),
                ("x/a", "8.8.8.8", UDP, 53, false),
                ("x/b", "x/a", TCP, 80, true),
            ],
        ),
        case(
            "egress rules are ignored without Egress in policyTypes",
            vec![|p| p.egress = vec![rule(vec![], vec![tcp(80)])]],
            vec![("x/a", "y/a", TCP, 81, true), ("y/a", "x/a", TCP, 80, false)],
        ),
        case(
            "ICMP matches only rules without ports",
            vec![|p| {
                p.ingress = vec![
                    rule(vec![Peer::Pods(sel(&[("pod", "b")]))], vec![]),
                    rule(vec![], vec![tcp(80)]),
                ]
            }],
            vec![
                ("x/b", "x/a", ICMP, 0, true),
                ("y/b", "x/a", ICMP, 0, false),
                ("y/b", "x/a", TCP, 80, true),
            ],
        ),
        case(
            "ingress from the node always allowed; egress to it governed by policy",
            vec![|p| p.egress_isolation = true],
            vec![(NODE_IP, "x/a", TCP, 10250, true), ("x/a", NODE_IP, TCP, 6443, false)],
        ),
        case(
            "hostNetwork pods are not selected and are the node",
            vec![|p| p.ingress = vec![rule(vec![Peer::Pods(sel(&[("pod", "a")]))], vec![])]],
            vec![
                (NODE_IP, "x/b", TCP, 80, true),
                ("x/b", NODE_IP, TCP, 80, true),
                ("x/a", "x/a", TCP, 80, true),
            ],
        ),
        case(
            "dual-stack: selectors match both families",
            vec![|p| p.ingress = vec![rule(vec![Peer::Pods(sel(&[("pod", "b")]))], vec![tcp(80)])]],
            vec![
                ("x/b@6", "x/a@6", TCP, 80, true),
                ("x/c@6", "x/a@6", TCP, 80, false),
                ("x/b", "x/a", TCP, 80, true),
            ],
        ),
        case(
            "NotIn matches absent keys, Exists matches empty values",
            vec![|p| {
                p.pod_selector = Selector::default();
                p.ingress = vec![rule(
                    vec![Peer::Namespaces(Selector {
                        match_labels: Default::default(),
                        match_expressions: vec![Requirement {
                            key: "ns".into(),
                            operator: Operator::NotIn,
                            values: vec!["y".into()],
                        }],
                    })],
                    vec![],
                )];
            }],
            vec![
                ("z/a", "x/b", TCP, 80, true),
                ("y/a", "x/b", TCP, 80, false),
                ("x/c", "x/b", TCP, 80, true),
            ],
        ),
    ];
    for c in &cases {
        run(c);
    }
    // Union of policies and host egress, which need extra settings.
    let mut more = base();
    more.name = "more".into();
    more.ingress = vec![rule(vec![Peer::Pods(sel(&[("pod", "c")]))], vec![tcp(81)])];
    run(&Case {
        name: "union of two policies",
        tweaks: vec![|p| p.ingress = vec![rule(vec![Peer::Pods(sel(&[("pod", "b")]))], vec![tcp(80)])]],
        extra: vec![more],
        pods: vec![],
        allow_host_egress: false,
        flows: vec![
            ("x/b", "x/a", TCP, 80, true),
            ("x/c", "x/a", TCP, 81, true),
            ("x/b", "x/a", TCP, 81, false),
            ("x/c", "x/a", TCP, 80, false),
        ],
    });
    run(&Case {
        name: "allow_host_egress",
        tweaks: vec![|p| p.egress_isolation = true],
        extra: vec![],
        pods: vec![],
        allow_host_egress: true,
        flows: vec![("x/a", NODE_IP, TCP, 6443, true), ("x/a", "x/b", TCP, 80, false)],
    });
}
