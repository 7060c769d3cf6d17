//! The node's uplinks: the interfaces where traffic to other nodes leaves
//! this node, which get the eBPF dataplane's `node_exit` program (the
//! deferred egress decision of Service traffic DNATed to a backend on
//! another node; see `npm_common::service`).
//!
//! An uplink is the output interface of a unicast route with a gateway,
//! or of a default route, in any routing table but `local`, in either
//! family: the default-route device, a routed fabric's interface
//! (kindnet, Calico without overlay: `podCIDR via <node> dev eth0`), an
//! overlay device (`via <vtep> dev flannel.1 onlink`, `vxlan.calico`).
//! A device without an Ethernet header (`wireguard`, `ipip`, `sit`, `gre`,
//! `ip6tnl`, `tun`, `vti`, `xfrm`: an L3 tunnel) is an uplink as soon as
//! any unicast route leaves by it, gateway or not (WireGuard's routes have
//! none): what leaves by a tunnel leaves the node. The dataplane puts the
//! L3 variant `node_exit_l3` there (it decides the inner packet, before
//! the encapsulation). Never `lo`, never an interface in `exclude` (the
//! endpoints' host-side interfaces). A wrong choice costs an unmarked
//! packet one load and one compare, never a verdict.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use super::netlink::{Link, LinkKind, Netlink, NetlinkError, Route};

/// The `local` routing table.
const RT_TABLE_LOCAL: u32 = 255;

/// Link kinds that carry no Ethernet header.
const L3_KINDS: [&str; 10] = [
    "wireguard",
    "ipip",
    "sit",
    "gre",
    "ip6gre",
    "ip6tnl",
    "tun",
    "vti",
    "vti6",
    "xfrm",
];

/// The uplinks chosen.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Uplinks {
    /// ifindex -> interface name.
    pub chosen: BTreeMap<u32, String>,
    /// The chosen devices without an Ethernet header (L3 tunnels).
    pub l3: BTreeSet<u32>,
}

/// The uplinks among `links` by the routes `routes` (see the module doc).
pub fn pick_uplinks(links: &HashMap<u32, Link>, routes: &[Route], exclude: &BTreeSet<u32>) -> Uplinks {
    let mut out = Uplinks::default();
    for r in routes {
        if !r.unicast || r.table == RT_TABLE_LOCAL {
            continue;
        }
        for oif in &r.oifs {
            let Some(l) = links.get(oif) else { continue };
            if l.name == "lo" || exclude.contains(oif) {
                continue;
            }
            let l3 = matches!(&l.kind, Some(LinkKind::Other(k)) if L3_KINDS.contains(&k.as_str()));
            if l3 {
                out.l3.insert(*oif);
            } else if !(r.gateway || r.dst.is_none()) {
                continue;
            }
            out.chosen.insert(*oif, l.name.clone());
        }
    }
    out
}

/// Reads the links and routes through `nl` and picks the uplinks.
pub fn read_uplinks(nl: &mut Netlink, exclude: &BTreeSet<u32>) -> Result<Uplinks, NetlinkError> {
    let links = nl.links()?;
    let routes = nl.routes()?;
    Ok(pick_uplinks(&links, &routes, exclude))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn link(index: u32, name: &str, kind: Option<LinkKind>) -> (u32, Link) {
        (
            index,
            Link {
                index,
                name: name.into(),
                kind,
                master: None,
            },
        )
    }

    fn route(dst: Option<&str>, gateway: bool, oif: u32, table: u32) -> Route {
        Route {
            unicast: true,
            dst_len: if dst.is_some() { 24 } else { 0 },
            dst: dst.map(|d| d.parse().unwrap()),
            gateway,
            oifs: vec![oif],
            proto_kernel: false,
            table,
        }
    }

    #[test]
    fn gateways_and_default_routes_pick_ethernet_devices_and_any_route_an_l3_device() {
        let links: HashMap<u32, Link> = [
            link(1, "lo", None),
            link(2, "eth0", None),
            link(3, "flannel.1", Some(LinkKind::Other("vxlan".into()))),
            link(4, "cali123", Some(LinkKind::Veth)),
            link(5, "wg0", Some(LinkKind::Other("wireguard".into()))),
            link(6, "cni0", Some(LinkKind::Bridge)),
            link(7, "veth9", Some(LinkKind::Veth)),
            link(8, "tunl0", Some(LinkKind::Other("ipip".into()))),
        ]
        .into_iter()
        .collect();
        let routes = vec![
            route(None, true, 2, 254),
            route(Some("10.244.1.0"), true, 3, 254),
            // A pod's /32 route and the local bridge subnet: no gateway.
            route(Some("10.244.0.5"), false, 4, 254),
            route(Some("10.244.0.0"), false, 6, 254),
            route(Some("10.245.0.0"), true, 5, 254),
            // WireGuard's routes have no gateway: an L3 device counts all
            // the same (Calico's IPIP routes have one).
            route(Some("10.247.0.0"), false, 5, 1),
            route(Some("10.248.0.0"), true, 8, 254),
            // An endpoint with a gateway route (excluded by the caller).
            route(Some("10.246.0.0"), true, 7, 254),
            // The local table never counts.
            route(Some("127.0.0.0"), true, 1, 255),
        ];
        let got = pick_uplinks(&links, &routes, &BTreeSet::from([7]));
        assert_eq!(
            got.chosen,
            BTreeMap::from([
                (2, "eth0".to_string()),
                (3, "flannel.1".to_string()),
                (5, "wg0".to_string()),
                (8, "tunl0".to_string()),
            ])
        );
        assert_eq!(got.l3, BTreeSet::from([5, 8]));
    }
}
