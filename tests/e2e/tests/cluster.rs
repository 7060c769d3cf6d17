//! The netns cluster without any agent: every pod reaches every other pod on
//! TCP/UDP 80 and 81 (IPv4 and IPv6), crafted SCTP INITs arrive, a closed
//! port is observed as not connected, and teardown leaves nothing behind.

use std::net::SocketAddr;
use std::time::Duration;

use npm_e2e::cluster::{own_links, own_netns, Cluster};
use npm_e2e::probe::{probe_all, Probe, ProbeConfig, Proto};

fn all_pairs(c: &Cluster, ipv6: bool, ports: &[u16], protos: &[Proto]) -> Vec<Probe> {
    let mut v = Vec::new();
    for s in c.pods() {
        for d in c.pods() {
            if s.key() == d.key() {
                continue;
            }
            for &port in ports {
                for &proto in protos {
                    v.push(Probe {
                        src_netns: s.netns.clone(),
                        dst_pod: d.key(),
                        dst: SocketAddr::new(d.ip(ipv6), port),
                        proto,
                    });
                }
            }
        }
    }
    v
}

#[test]
fn cluster_probes_and_teardown() {
    let mut c = Cluster::with_pods(&[("x", "a"), ("x", "b"), ("y", "a"), ("y", "b")]).expect("build the cluster");
    assert_eq!(own_netns().len(), 4, "one netns per pod");
    for key in ["net.ipv4.ip_forward", "net.ipv6.conf.all.forwarding"] {
        assert_eq!(
            npm_e2e::netns::sysctl_get(key).unwrap(),
            "1",
            "{key} on while the cluster lives"
        );
    }
    let cfg = ProbeConfig {
        timeout: Duration::from_secs(1),
        threads: 16,
        sctp_log: c.sctp_log(),
    };

    for ipv6 in [false, true] {
        let probes = all_pairs(&c, ipv6, &[80, 81], &[Proto::Tcp, Proto::Udp, Proto::Sctp]);
        assert_eq!(probes.len(), 4 * 3 * 2 * 3);
        let got = probe_all(&probes, &cfg);
        let failed: Vec<String> = probes
            .iter()
            .zip(&got)
            .filter(|(_, ok)| !**ok)
            .map(|(p, _)| format!("{} -> {} {}", p.src_netns, p.dst, p.proto))
            .collect();
        assert!(failed.is_empty(), "ipv6={ipv6}: unreachable: {failed:?}");
    }

    // A port nobody serves is not connected (the probes can fail), for
    // every protocol: TCP is refused, UDP gets no echo, the SCTP INIT is
    // logged with a different port and so does not count.
    let xa = c.pod("x", "a").expect("x/a").netns.clone();
    let yb = c.pod("y", "b").expect("y/b");
    let dst_pod = yb.key();
    let dst_ip = yb.ip(false);
    let closed: Vec<Probe> = [Proto::Tcp, Proto::Udp]
        .iter()
        .map(|&proto| Probe {
            src_netns: xa.clone(),
            dst_pod: dst_pod.clone(),
            dst: SocketAddr::new(dst_ip, 82),
            proto,
        })
        .collect();
    assert_eq!(probe_all(&closed, &cfg), vec![false, false]);
    // SCTP to a pod that is not the one at that address is not counted.
    let wrong = Probe {
        src_netns: xa.clone(),
        dst_pod: "x/b".into(),
        dst: SocketAddr::new(dst_ip, 80),
        proto: Proto::Sctp,
    };
    assert_eq!(probe_all(&[wrong], &cfg), vec![false]);

    // Pods come and go mid-case.
    c.create_pod("z", "d").expect("create z/d");
    let zd = c.pod("z", "d").expect("z/d");
    assert_eq!(zd.ipv4.to_string(), "198.18.3.4");
    assert_eq!(zd.ipv6.to_string(), "fd00:198:18::3:4");
    let to_zd = Probe {
        src_netns: xa.clone(),
        dst_pod: zd.key(),
        dst: SocketAddr::new(zd.ip(false), 81),
        proto: Proto::Tcp,
    };
    assert_eq!(probe_all(std::slice::from_ref(&to_zd), &cfg), vec![true]);
    c.delete_pod("z", "d").expect("delete z/d");
    assert_eq!(probe_all(std::slice::from_ref(&to_zd), &cfg), vec![false]);
    assert_eq!(own_netns().len(), 4);

    c.teardown().expect("teardown");
    assert!(own_netns().is_empty(), "netns left: {:?}", own_netns());
    assert!(own_links().is_empty(), "links left: {:?}", own_links());
}
