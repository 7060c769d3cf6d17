//! Real traffic through the classifier: a pod network namespace joined to
//! the root netns by a veth pair, the programs attached by the loader on
//! the host side, in each attach mode (tcx links, tc filters). TCP and UDP exchanges are allowed, a map update
//! (a diff that allows nothing) denies new ones while the established TCP
//! connection keeps flowing, and allowing again restores them.
//! Needs root.

use std::io::{BufRead, BufReader, Write};
use std::time::Duration;

use crate::ebpf_common::*;
use npm_common::Reason;
use npm_dataplane::ebpf::AttachMode;
use npm_dataplane::Dataplane;
use npm_policy::model::Protocol;

const TCP_PORT: u16 = 8080;
const UDP_PORT: u16 = 5353;

#[test]
fn veth_traffic_follows_policy_updates_tcx() {
    veth_traffic_follows_policy_updates(AttachMode::Tcx, "ve");
}

#[test]
fn veth_traffic_follows_policy_updates_tc() {
    // npm tc filters: not while `auto` is tested (ebpf_attach_modes).
    let _g = crate::serial();
    veth_traffic_follows_policy_updates(AttachMode::Tc, "vc");
}

fn veth_traffic_follows_policy_updates(mode: AttachMode, tag: &str) {
    sweep_leftovers();
    let pins = PinDir::new(&format!("veth{tag}"));
    let mut net = PodNet::new(tag);
    net.start_servers(TCP_PORT, &[UDP_PORT]);
    net.wait_ready(TCP_PORT, UDP_PORT);

    let mut dp = pins.open_in(mode);
    assert_eq!(dp.attach_mode(), mode);
    let ifs = ifaces(&[(1, net.ifindex)]);
    let allowed = pod_policy(&net, &[(Protocol::Tcp, TCP_PORT), (Protocol::Udp, UDP_PORT)]);
    dp.sync_full(&allowed, &ifs).unwrap();
    assert!(dp.attached().contains(&net.ifindex));
    // Attached in this mode only: one program per hook.
    let (ing, eg) = prog_ids(&net.host_if, mode);
    assert_eq!((ing.len(), eg.len()), (1, 1), "one program per hook");
    let other = if mode == AttachMode::Tc {
        AttachMode::Tcx
    } else {
        AttachMode::Tc
    };
    assert_eq!(
        prog_ids(&net.host_if, other),
        (vec![], vec![]),
        "nothing attached in the other mode"
    );
    if mode == AttachMode::Tc {
        // iproute2's view: npm's filter (priority 1, handle 0x6e706d,
        // direct-action) with the pod-bound program on the egress hook.
        let egress = tc_show(&net.host_if, "egress");
        assert!(
            egress.contains("pref 1 bpf") && egress.contains("handle 0x6e706d"),
            "{egress}"
        );
        assert!(
            egress.contains("to_pod") && egress.contains("direct-action"),
            "{egress}"
        );
        let ingress = tc_show(&net.host_if, "ingress");
        assert!(
            ingress.contains("from_pod") && ingress.contains("handle 0x6e706d"),
            "{ingress}"
        );
    }

    let t = Duration::from_secs(2);
    net.tcp_exchange(TCP_PORT, t).expect("allowed TCP exchange");
    net.udp_exchange(UDP_PORT, t).expect("allowed UDP exchange");

    // A long-lived connection opened while allowed.
    let addr = std::net::SocketAddr::from((net.pod_ip, TCP_PORT));
    let conn = std::net::TcpStream::connect_timeout(&addr, t).expect("long-lived connection");
    conn.set_read_timeout(Some(t)).unwrap();
    let mut w = conn.try_clone().unwrap();
    let mut r = BufReader::new(conn);
    let mut echo = |msg: &str| -> std::io::Result<String> {
        w.write_all(msg.as_bytes())?;
        let mut line = String::new();
        r.read_line(&mut line)?;
        Ok(line)
    };
    assert_eq!(echo("one\n").unwrap(), "one\n");

    let counters = dp.counters().unwrap();
    let get = |d: u8, r: Reason| counters.packets(d, r);
    assert!(get(npm_common::DIR_INGRESS, Reason::Policy) >= 3, "{counters:?}");
    assert!(get(npm_common::DIR_EGRESS, Reason::Tracked) >= 3, "{counters:?}");

    // Isolate and allow nothing.
    let nothing = pod_policy(&net, &[]);
    dp.apply(&allowed.diff(&nothing), &nothing, &ifs).unwrap();
    let _ = dp.poll_deny_events();
    let short = Duration::from_millis(700);
    assert!(
        net.tcp_exchange(TCP_PORT, short).is_err(),
        "new TCP connection must be denied"
    );
    assert!(
        net.udp_exchange(UDP_PORT, short).is_err(),
        "new UDP flow must be denied"
    );
    // Established connections are not re-evaluated.
    assert_eq!(echo("two\n").unwrap(), "two\n");
    let events = dp.poll_deny_events();
    assert!(
        events
            .iter()
            .any(|e| e.reason == Reason::PolicyDenied as u8 && e.dport == TCP_PORT && e.protocol == 6),
        "{events:?}"
    );
    assert!(
        events.iter().any(|e| e.dport == UDP_PORT && e.protocol == 17),
        "{events:?}"
    );

    // Allowed again.
    dp.apply(&nothing.diff(&allowed), &allowed, &ifs).unwrap();
    net.tcp_exchange(TCP_PORT, t).expect("TCP allowed again");
    net.udp_exchange(UDP_PORT, t).expect("UDP allowed again");

    // Detach: nothing enforced any more (not isolated by default).
    let mut gone = allowed.clone();
    gone.endpoints.clear();
    gone.policy.clear();
    dp.apply(&allowed.diff(&gone), &gone, &ifaces(&[])).unwrap();
    assert!(!dp.attached().contains(&net.ifindex));
    let links = std::fs::read_dir(pins.path.join("links")).unwrap().count();
    assert_eq!(links, 0, "links must be unpinned");
    assert_eq!(
        prog_ids_settled(&net.host_if, mode, (0, 0)),
        (vec![], vec![]),
        "programs detached"
    );
    net.tcp_exchange(TCP_PORT, t).expect("TCP passes once detached");
}
