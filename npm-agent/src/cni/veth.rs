//! Which host-side interface of a CNI result is the pod's veth: a routed
//! plugin (`ptp`) lists the veth, a bridged one (`bridge`) the bridge and
//! then the veth. The kind is read from sysfs in the agent's network
//! namespace (the node's): a bridge has a `bridge/` directory; a veth is
//! a link whose netlink `IFLA_INFO_KIND` is `veth` (a vlan, macvlan or
//! ipvlan also has an `iflink` other than its own ifindex, and is not one).

use std::path::Path;

use npm_cni::proto::Interface;

use crate::node::netlink::{LinkKind as NlKind, Netlink};

/// Why no veth was found among the host-side interfaces.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("no veth among the host-side interfaces of the result ({found})")]
pub struct NoVeth {
    /// What each interface turned out to be.
    pub found: String,
}

/// What sysfs says an interface is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LinkKind {
    /// Not in this network namespace.
    Missing,
    /// A bridge.
    Bridge,
    /// A veth with this ifindex.
    Veth(u32),
    /// Anything else (a physical or loopback interface, a vlan, macvlan...).
    Other,
}

fn read_u32(path: &Path) -> Option<u32> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

fn valid_name(name: &str) -> bool {
    !name.is_empty() && name.len() <= 15 && !name.contains('/') && name != "." && name != ".."
}

/// The kind of interface `name` of the agent's network namespace.
pub fn link_kind(name: &str) -> LinkKind {
    if !valid_name(name) {
        return LinkKind::Missing;
    }
    let dir = Path::new("/sys/class/net").join(name);
    let Some(ifindex) = read_u32(&dir.join("ifindex")) else {
        return LinkKind::Missing;
    };
    if dir.join("bridge").is_dir() {
        return LinkKind::Bridge;
    }
    match read_u32(&dir.join("iflink")) {
        Some(peer) if peer != ifindex && netlink_kind_is_veth(ifindex) => LinkKind::Veth(ifindex),
        _ => LinkKind::Other,
    }
}

/// Whether the link dump says `ifindex` is a veth (no answer: it is not).
fn netlink_kind_is_veth(ifindex: u32) -> bool {
    let links = Netlink::open(None).and_then(|mut nl| nl.links());
    match links {
        Ok(links) => links.get(&ifindex).is_some_and(|l| l.kind == Some(NlKind::Veth)),
        Err(e) => {
            tracing::warn!(ifindex, error = %e, "cannot read the link kind; not taken as a veth");
            false
        }
    }
}

/// Whether interface `name` still exists with `ifindex` (a veth that went
/// away, or whose name a new interface took, does not).
pub fn link_alive(name: &str, ifindex: u32) -> bool {
    valid_name(name) && read_u32(&Path::new("/sys/class/net").join(name).join("ifindex")) == Some(ifindex)
}

/// The pod's veth among `interfaces` (the first veth) and its ifindex.
pub fn host_veth(interfaces: &[Interface]) -> Result<(String, u32), NoVeth> {
    let mut found = Vec::new();
    for i in interfaces {
        match link_kind(&i.name) {
            LinkKind::Veth(ifindex) => return Ok((i.name.clone(), ifindex)),
            kind => found.push(format!("{}: {kind:?}", i.name)),
        }
    }
    Err(NoVeth {
        found: if found.is_empty() {
            "none listed".into()
        } else {
            found.join(", ")
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_and_missing_interfaces_are_no_veth() {
        assert_eq!(link_kind("lo"), LinkKind::Other);
        assert_eq!(link_kind("npm-no-such0"), LinkKind::Missing);
        assert_eq!(link_kind("../lo"), LinkKind::Missing);
        assert!(link_alive("lo", 1));
        assert!(!link_alive("lo", 2));
        let err = host_veth(&[Interface {
            name: "lo".into(),
            mac: None,
        }])
        .unwrap_err();
        assert_eq!(err.found, "lo: Other");
        assert_eq!(host_veth(&[]).unwrap_err().found, "none listed");
    }

    fn ip(args: &[&str]) {
        let st = std::process::Command::new("ip").args(args).status().unwrap();
        assert!(st.success(), "ip {args:?}");
    }

    /// A link with a parent (`iflink != ifindex`) that is not a veth (a
    /// macvlan, a macvtap; vlan and ipvlan are not in every kernel) is not
    /// taken for the pod's veth; a veth is.
    #[test]
    fn only_a_veth_is_a_veth() {
        let (veth, peer, mvl, mvt) = ("npmvk-v0", "npmvk-p0", "npmvk-mv0", "npmvk-mt0");
        let _ = std::process::Command::new("ip").args(["link", "del", veth]).status();
        ip(&["link", "add", veth, "type", "veth", "peer", "name", peer]);
        ip(&["link", "add", "link", veth, "name", mvl, "type", "macvlan"]);
        ip(&["link", "add", "link", veth, "name", mvt, "type", "macvtap"]);
        let kinds = [veth, mvl, mvt].map(link_kind);
        ip(&["link", "del", veth]);
        assert!(matches!(kinds[0], LinkKind::Veth(_)), "{kinds:?}");
        assert_eq!(kinds[1], LinkKind::Other, "a macvlan is no veth");
        assert_eq!(kinds[2], LinkKind::Other, "a macvtap is no veth");
    }
}
