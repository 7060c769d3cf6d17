//! The check on real links and real sysctls, in a network namespace of its
//! own (`npmbnf<pid>`): the bridge-nf-call sysctls are per namespace, so
//! setting them there disturbs no other test and not the host.

use std::process::Command;

use npm_policy::compiled::{Endpoint, PodRef};

use super::*;

struct Ns(String);

impl Ns {
    fn new() -> Ns {
        let ns = Ns(format!("npmbnf{}", std::process::id()));
        let _ = Command::new("ip").args(["netns", "del", &ns.0]).output();
        ns.run(&["ip", "netns", "add", &ns.0], false);
        ns
    }

    fn run(&self, args: &[&str], inside: bool) {
        let mut cmd = Command::new(if inside { "ip" } else { args[0] });
        if inside {
            cmd.args(["netns", "exec", &self.0]).args(args);
        } else {
            cmd.args(&args[1..]);
        }
        let out = cmd.output().unwrap();
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    fn sysctl(&self, name: &str, value: u8) {
        self.run(&["sysctl", "-qw", &format!("{}={value}", name.replace('/', "."))], true);
    }

    fn ifindex(&self, name: &str) -> u32 {
        let out = Command::new("ip")
            .args([
                "netns",
                "exec",
                &self.0,
                "cat",
                &format!("/sys/class/net/{name}/ifindex"),
            ])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).trim().parse().unwrap()
    }
}

impl Drop for Ns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).output();
    }
}

fn endpoint(name: &str, v4: bool, v6: bool) -> Endpoint {
    Endpoint {
        pod: PodRef {
            namespace: "ns".into(),
            name: name.into(),
            uid: name.into(),
        },
        identity: 1,
        ipv4: v4.then(|| "10.0.0.2".parse().unwrap()),
        ipv6: v6.then(|| "fd00::2".parse().unwrap()),
        isolated_ingress: true,
        isolated_egress: false,
        tiers: Default::default(),
        report_new: false,
    }
}

#[test]
fn bridged_endpoints_need_the_sysctl_of_their_family() {
    let ns = Ns::new();
    for args in [
        &["link", "add", "br0", "type", "bridge"][..],
        &["link", "add", "v0", "type", "veth", "peer", "name", "v1"],
        &["link", "set", "v0", "master", "br0"],
        &["link", "add", "r0", "type", "veth", "peer", "name", "r1"],
    ] {
        let mut full = vec!["ip"];
        full.extend_from_slice(args);
        ns.run(&full, true);
    }
    let (bridged, routed) = (ns.ifindex("v0"), ns.ifindex("r0"));
    let mut compiled = Compiled::default();
    compiled.endpoints.insert(1, endpoint("bridged", true, true));
    compiled.endpoints.insert(2, endpoint("routed", true, false));
    let interfaces: Interfaces = [(1, bridged), (2, routed)].into();
    let mut check = BridgeNfCheck::new(Some(ns.0.clone()));

    ns.sysctl(SYSCTL_V4, 1);
    ns.sysctl(SYSCTL_V6, 0);
    let v = check.check(&compiled, &interfaces).unwrap();
    assert_eq!(v.unfiltered, Bridged { v4: 0, v6: 1 });
    let reason = v.problem.expect("IPv6 of the bridged pod is not filtered");
    assert!(reason.contains("net.bridge.bridge-nf-call-ip6tables is 0"), "{reason}");
    assert!(!reason.contains("iptables is"), "{reason}");

    ns.sysctl(SYSCTL_V6, 1);
    assert_eq!(check.check(&compiled, &interfaces).unwrap(), Verdict::default());

    ns.sysctl(SYSCTL_V4, 0);
    let v = check.check(&compiled, &interfaces).unwrap();
    assert_eq!(
        v.unfiltered,
        Bridged { v4: 1, v6: 0 },
        "the routed endpoint needs nothing"
    );
    assert!(v.problem.unwrap().contains("bridge-nf-call-iptables is 0"));

    // Only the routed endpoint: nothing is checked, whatever the sysctls.
    ns.sysctl(SYSCTL_V6, 0);
    let routed_only: Interfaces = [(2, routed)].into();
    assert_eq!(check.check(&compiled, &routed_only).unwrap(), Verdict::default());
    // The port leaves the bridge: looked up again since the set changed.
    ns.run(&["ip", "link", "set", "v0", "nomaster"], true);
    assert_eq!(check.check(&compiled, &interfaces).unwrap(), Verdict::default());
    // The host's own sysctls were never touched by this test (per netns).
    assert_eq!(read_sysctls(Some(&ns.0)).unwrap().v4, Sysctl::Off);
}

#[test]
fn a_missing_module_is_named() {
    let both = Bridged { v4: 2, v6: 1 };
    let missing = Sysctls {
        v4: Sysctl::Missing,
        v6: Sysctl::Missing,
    };
    let v = verdict(both, missing);
    assert_eq!(v.unfiltered, both);
    let reason = v.problem.unwrap();
    assert!(reason.contains("absent (br_netfilter not loaded)"), "{reason}");
    assert!(reason.contains("IPv4") && reason.contains("IPv6"), "{reason}");
    assert_eq!(
        verdict(
            Bridged { v4: 1, v6: 0 },
            Sysctls {
                v4: Sysctl::On,
                v6: Sysctl::Missing
            }
        ),
        Verdict::default()
    );
}
