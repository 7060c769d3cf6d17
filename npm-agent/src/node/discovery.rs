//! The rules that decide a pod address's host-side interface from what the
//! kernel says (pure functions over one [`KernelView`], no I/O; the
//! resolver in [`interfaces`](super::interfaces) reads the view through
//! netlink).
//!
//! Only a veth host peer is ever an endpoint's interface:
//!
//! - **routed** CNIs (ptp, Calico's `cali*`, AWS's `eni*`, the hand-made
//!   test veths): the FIB entry the route lookup of the pod address matches
//!   (`ip route get fibmatch`) is a unicast route without a gateway (its
//!   scope does not matter: ptp's host routes are scope global, Calico's
//!   scope link) whose one output interface is a veth, and it is the
//!   pod's host route (`/32`, `/128`) or the connected subnet of an address
//!   on that veth (`proto kernel`);
//! - **bridged** CNIs (the reference `bridge`, flannel's `cni0`, kubenet):
//!   the route's output interface is a bridge; the bridge's neighbour entry
//!   of the pod address gives its MAC, the bridge's forwarding database
//!   gives the one port that MAC was learned on, and that port must be a
//!   veth of that bridge.
//!
//! Never an endpoint's interface: an interface that is not a veth (the
//! uplink, a bridge itself, a dummy, a tunnel, `lo`), a device of any
//! default route (the uplink, also when it is a veth, as in a node that is
//! a container), a route through a gateway, a local address (the pod
//! address is the node's own), a multipath route. A veth may hold node
//! addresses (ptp puts the pod's gateway on every host veth): that does not
//! disqualify it, the route to the pod does the deciding.

use std::collections::{HashMap, HashSet};
use std::net::IpAddr;

use super::netlink::{FdbEntry, Link, LinkKind, Lookup, Neighbour, Route};

/// What the kernel says, read once per resolution.
#[derive(Debug, Default)]
pub struct KernelView {
    /// Every interface by index.
    pub links: HashMap<u32, Link>,
    /// Output interfaces of every default route (any table but `local`).
    pub default_oifs: HashSet<u32>,
    /// Neighbour entries by (interface, address) (read only when a route
    /// points at a bridge).
    pub neighbours: HashMap<(u32, IpAddr), Neighbour>,
    /// The bridges' forwarding entries (read with the neighbours).
    pub fdb: Vec<FdbEntry>,
}

/// The `local` routing table.
const TABLE_LOCAL: u32 = 255;

impl KernelView {
    /// The output interfaces of the default routes among `routes`.
    pub fn default_oifs_of(routes: &[Route]) -> HashSet<u32> {
        routes
            .iter()
            .filter(|r| r.dst_len == 0 && r.unicast && r.table != TABLE_LOCAL)
            .flat_map(|r| r.oifs.iter().copied())
            .collect()
    }
}

/// An endpoint's interface.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Found {
    /// Its ifindex.
    pub ifindex: u32,
    /// Its name.
    pub name: String,
    /// The bridge it is a port of (bridged CNIs).
    pub bridge: Option<u32>,
}

/// The first step of one address: its route.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RouteStep {
    /// A veth routed to directly.
    Veth(Found),
    /// A bridge: the neighbour and forwarding entries decide.
    Bridge(u32),
    /// Not an endpoint interface (why).
    Refused(&'static str),
    /// Not known now: a netlink error (keep the previous answer).
    Error(String),
}

/// The outcome of one address.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Its interface.
    Found(Found),
    /// Not an endpoint interface, or no route (why).
    Refused(&'static str),
    /// Bridged, and its MAC or port is not learned yet: the kernel is asked
    /// to resolve it (keep the previous answer meanwhile).
    Pending(&'static str),
    /// A netlink error (keep the previous answer).
    Error(String),
}

/// The route step of one address, from its route lookup.
pub fn route_step(view: &KernelView, lookup: &Lookup) -> RouteStep {
    let route = match lookup {
        Err(e) => return RouteStep::Error(e.to_string()),
        Ok(None) => return RouteStep::Refused("no route"),
        Ok(Some(r)) => r,
    };
    if !route.unicast {
        return RouteStep::Refused("not a unicast route (a local address, blackhole, unreachable...)");
    }
    if route.gateway {
        return RouteStep::Refused("a route through a gateway");
    }
    let is_v4 = route.dst.is_none_or(|d| d.is_ipv4());
    let [oif] = route.oifs[..] else {
        return RouteStep::Refused("not exactly one output interface");
    };
    let Some(link) = view.links.get(&oif) else {
        return RouteStep::Error(format!("output interface {oif} is not in the link dump"));
    };
    if view.default_oifs.contains(&oif) {
        return RouteStep::Refused("the device of a default route");
    }
    match link.kind {
        Some(LinkKind::Veth) => {
            let host_len = if is_v4 { 32 } else { 128 };
            if route.dst_len != host_len && !route.proto_kernel {
                return RouteStep::Refused("a subnet route through a veth that no address of it makes");
            }
            RouteStep::Veth(Found {
                ifindex: oif,
                name: link.name.clone(),
                bridge: None,
            })
        }
        Some(LinkKind::Bridge) => RouteStep::Bridge(oif),
        _ => RouteStep::Refused("not a veth (an uplink, dummy, tunnel or lo)"),
    }
}

/// The bridged step of address `ip` behind bridge `bridge`: its MAC from
/// the bridge's neighbour entry, its port from the bridge's forwarding
/// database.
pub fn bridge_step(view: &KernelView, bridge: u32, ip: IpAddr) -> Outcome {
    let Some(mac) = view
        .neighbours
        .get(&(bridge, ip))
        .filter(|n| n.valid)
        .and_then(|n| n.mac.as_ref())
    else {
        return Outcome::Pending("no neighbour entry on the bridge yet");
    };
    let mut ports: Vec<u32> = view
        .fdb
        .iter()
        .filter(|e| &e.mac == mac && !e.local && e.port != bridge)
        .filter(|e| e.bridge.is_none_or(|b| b == bridge))
        .filter(|e| view.links.get(&e.port).is_some_and(|l| l.master == Some(bridge)))
        .map(|e| e.port)
        .collect();
    ports.sort_unstable();
    ports.dedup();
    let [port] = ports[..] else {
        return if ports.is_empty() {
            Outcome::Pending("the pod's MAC is not learned on a port of the bridge yet")
        } else {
            Outcome::Refused("the pod's MAC is learned on several ports")
        };
    };
    match view.links.get(&port) {
        Some(l) if l.kind == Some(LinkKind::Veth) => Outcome::Found(Found {
            ifindex: port,
            name: l.name.clone(),
            bridge: Some(bridge),
        }),
        _ => Outcome::Refused("the bridge port of the pod's MAC is not a veth (an uplink or tunnel)"),
    }
}

/// Whether a previous answer still describes an interface of the view: the
/// same index and name, still a veth, still a port of the same bridge (or
/// of none), not a default-route device.
pub fn still_valid(view: &KernelView, f: &Found) -> bool {
    view.links.get(&f.ifindex).is_some_and(|l| {
        l.name == f.name
            && l.kind == Some(LinkKind::Veth)
            && l.master == f.bridge
            && !view.default_oifs.contains(&f.ifindex)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::node::netlink::NetlinkError;

    fn link(index: u32, name: &str, kind: Option<LinkKind>, master: Option<u32>) -> (u32, Link) {
        (
            index,
            Link {
                index,
                name: name.into(),
                kind,
                master,
            },
        )
    }

    fn view() -> KernelView {
        KernelView {
            links: [
                link(1, "lo", None, None),
                link(2, "eth0", None, None),
                link(3, "veth-a", Some(LinkKind::Veth), None),
                link(4, "cni0", Some(LinkKind::Bridge), None),
                link(5, "veth-b", Some(LinkKind::Veth), Some(4)),
                link(6, "dummy0", Some(LinkKind::Other("dummy".into())), None),
                link(7, "uplink", Some(LinkKind::Veth), None),
                link(8, "vxlan0", Some(LinkKind::Other("vxlan".into())), Some(4)),
            ]
            .into_iter()
            .collect(),
            default_oifs: [7].into_iter().collect(),
            ..KernelView::default()
        }
    }

    fn route(dst: &str, len: u8, oif: u32) -> Route {
        Route {
            unicast: true,
            dst_len: len,
            dst: Some(dst.parse().unwrap()),
            gateway: false,
            oifs: vec![oif],
            proto_kernel: false,
            table: 254,
        }
    }

    #[test]
    fn routed_veth_with_a_host_route_is_found() {
        let v = view();
        let step = route_step(&v, &Ok(Some(route("10.1.0.5", 32, 3))));
        assert!(matches!(step, RouteStep::Veth(Found { ifindex: 3, .. })), "{step:?}");
        assert!(matches!(
            route_step(&v, &Ok(Some(route("fd00::5", 128, 3)))),
            RouteStep::Veth(_)
        ));
    }

    #[test]
    fn everything_but_a_veth_is_refused() {
        let v = view();
        for (r, what) in [
            (route("10.1.0.5", 32, 2), "uplink"),
            (route("10.1.0.5", 32, 6), "dummy"),
            (route("10.1.0.5", 32, 1), "lo"),
            (route("10.1.0.5", 24, 7), "default-route veth"),
            (route("10.1.0.5", 24, 3), "subnet route not from an address"),
            (
                Route {
                    gateway: true,
                    ..route("10.1.0.5", 32, 3)
                },
                "gateway",
            ),
            (
                Route {
                    unicast: false,
                    ..route("10.1.0.5", 32, 3)
                },
                "local",
            ),
            (
                Route {
                    oifs: vec![3, 5],
                    ..route("10.1.0.5", 32, 3)
                },
                "multipath",
            ),
        ] {
            assert!(matches!(route_step(&v, &Ok(Some(r))), RouteStep::Refused(_)), "{what}");
        }
        assert!(matches!(route_step(&v, &Ok(None)), RouteStep::Refused(_)));
        let connected = Route {
            proto_kernel: true,
            ..route("10.1.0.0", 24, 3)
        };
        assert!(matches!(route_step(&v, &Ok(Some(connected))), RouteStep::Veth(_)));
        let err: Lookup = Err(NetlinkError::Decode {
            op: "t",
            detail: "x".into(),
        });
        assert!(matches!(route_step(&v, &err), RouteStep::Error(_)));
    }

    #[test]
    fn bridged_pods_resolve_through_neighbour_and_fdb() {
        let mut v = view();
        let ip: IpAddr = "10.2.0.5".parse().unwrap();
        assert_eq!(
            route_step(&v, &Ok(Some(route("10.2.0.0", 24, 4)))),
            RouteStep::Bridge(4)
        );
        assert!(matches!(bridge_step(&v, 4, ip), Outcome::Pending(_)));
        let mac = vec![2, 0, 0, 0, 0, 5];
        v.neighbours.insert(
            (4, ip),
            Neighbour {
                index: 4,
                ip,
                mac: Some(mac.clone()),
                valid: true,
            },
        );
        assert!(matches!(bridge_step(&v, 4, ip), Outcome::Pending(_)), "not learned yet");
        let entry = |port, local| FdbEntry {
            port,
            bridge: Some(4),
            mac: mac.clone(),
            local,
        };
        v.fdb.push(entry(5, true));
        assert!(
            matches!(bridge_step(&v, 4, ip), Outcome::Pending(_)),
            "local entries do not count"
        );
        v.fdb.push(entry(5, false));
        assert_eq!(
            bridge_step(&v, 4, ip),
            Outcome::Found(Found {
                ifindex: 5,
                name: "veth-b".into(),
                bridge: Some(4)
            })
        );
        v.fdb.push(entry(8, false));
        assert!(matches!(bridge_step(&v, 4, ip), Outcome::Refused(_)), "two ports");
        v.fdb.retain(|e| e.port == 8);
        assert!(matches!(bridge_step(&v, 4, ip), Outcome::Refused(_)), "a vxlan port");
    }

    #[test]
    fn previous_answers_are_checked_against_the_view() {
        let v = view();
        let b = Found {
            ifindex: 5,
            name: "veth-b".into(),
            bridge: Some(4),
        };
        assert!(still_valid(&v, &b));
        assert!(!still_valid(
            &v,
            &Found {
                bridge: None,
                ..b.clone()
            }
        ));
        assert!(!still_valid(
            &v,
            &Found {
                name: "x".into(),
                ..b.clone()
            }
        ));
        assert!(!still_valid(
            &v,
            &Found {
                ifindex: 7,
                name: "uplink".into(),
                bridge: None
            }
        ));
    }
}
