//! The read-only dump (`npm-agent inspect`): [`dump_pinned`] reads the
//! pinned maps of a programmed dataplane without loading a program or
//! touching the tcx links, so the program attached to an endpoint's
//! interface is the same (same program id) before and after. Needs root.

use std::net::{IpAddr, Ipv4Addr};

use crate::ebpf_common::*;
use npm_dataplane::ebpf::{dump_pinned, pinned_link_programs, EbpfError};
use npm_dataplane::Dataplane;
use npm_policy::model::Protocol;

#[test]
fn dump_pinned_reads_state_without_touching_the_links() {
    sweep_leftovers();
    let pins = PinDir::new("ri");
    let dummy = Dummy::new("ri");
    let pod = Ipv4Addr::new(10, 213, 0, 2);
    let peer = Ipv4Addr::new(10, 213, 0, 3);
    let mut dp = pins.open();
    dp.sync_full(
        &policy_for(pod, peer, &[(Protocol::Tcp, 8080)]),
        &ifaces(&[(1, dummy.ifindex)]),
    )
    .expect("sync");

    let before = tcx_prog_ids(&dummy.name);
    assert_eq!(
        (before.0.len(), before.1.len()),
        (1, 1),
        "one program per hook: {before:?}"
    );
    let links_before = pinned_link_programs(&pins.path).expect("pinned links");
    assert_eq!(
        links_before.get(&(dummy.ifindex, "egress")),
        Some(&before.0[0]),
        "egress link (tcx ingress hook) carries the attached program: {links_before:?}"
    );
    assert_eq!(links_before.get(&(dummy.ifindex, "ingress")), Some(&before.1[0]));

    let d = dump_pinned(&pins.path).expect("read-only dump");
    // Same content as the loader's own view of its maps and links.
    assert_eq!(d, dp.dump().expect("loader dump"));
    assert_eq!(d.pin_dir, pins.path);
    assert_eq!(d.endpoints.len(), 1, "{d:?}");
    let ep = &d.endpoints[0];
    assert_eq!((ep.ifindex, ep.ipv4), (dummy.ifindex, Some(pod)));
    assert_eq!(ep.attached, vec!["ingress", "egress"]);
    let ips: Vec<(IpAddr, u32)> = d.ipcache.iter().map(|e| (e.addr, e.identity)).collect();
    assert!(ips.contains(&(IpAddr::V4(pod), 256)), "{ips:?}");
    assert!(ips.contains(&(IpAddr::V4(peer), 300)), "{ips:?}");
    assert!(
        d.policy.iter().any(|p| p.subject == ep.subject
            && p.direction == "ingress"
            && p.peer == 300
            && p.protocol == Some(6)
            && p.ports.0 <= 8080
            && p.ports.1 >= 8080),
        "ingress allow of TCP 8080 from identity 300: {:?}",
        d.policy
    );

    // Nothing was replaced: the same programs are attached, with the loader
    // still running and after it is gone.
    assert_eq!(tcx_prog_ids(&dummy.name), before, "inspect must not swap programs");
    assert_eq!(pinned_link_programs(&pins.path).unwrap(), links_before);
    drop(dp);
    let again = dump_pinned(&pins.path).expect("dump with no loader running");
    assert_eq!(again.endpoints, d.endpoints);
    assert_eq!(again.policy, d.policy);
    assert_eq!(tcx_prog_ids(&dummy.name), before, "links outlive the loader untouched");

    // What inspect used to do, for contrast: opening the loader replaces the
    // attached programs (new ids), which is why inspect must not open it.
    let reopened = pins.open();
    let swapped = tcx_prog_ids(&dummy.name);
    assert_ne!(swapped.0, before.0, "open swaps the egress program");
    assert_ne!(swapped.1, before.1, "open swaps the ingress program");
    assert_eq!(
        dump_pinned(&pins.path).unwrap(),
        reopened.dump().unwrap(),
        "read-only dump agrees with a loader that adopted the links"
    );
}

#[test]
fn dump_pinned_of_an_empty_pin_dir_is_a_clear_error() {
    let pins = PinDir::new("re");
    match dump_pinned(&pins.path) {
        Err(EbpfError::NotPinned { path }) => {
            assert!(path.starts_with(&pins.path), "{path:?}");
        }
        other => panic!("want NotPinned, got {other:?}"),
    }
    // And nothing was created by the attempt.
    assert_eq!(std::fs::read_dir(&pins.path).map(|d| d.count()).unwrap_or(0), 0);
}
