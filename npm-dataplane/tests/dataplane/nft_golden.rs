//! Golden tests of the nftables renderer: hand-built compiled policies are
//! rendered and compared with `tests/golden/nft_<name>.nft`; each script is
//! then loaded into a fresh network namespace and `nft list table` is
//! compared with `tests/golden/nft_<name>.list`. `UPDATE_GOLDEN=1`
//! regenerates both files.

use npm_common::{IDENTITY_ANY, IDENTITY_FIRST_CIDR, IDENTITY_HOST, IDENTITY_WORLD};
use npm_dataplane::nft::{render, NftDataplane, NftOptions};
use npm_dataplane::{Dataplane, Interfaces};
use npm_policy::compiled::{Compiled, Direction};
use npm_policy::model::Protocol;

use crate::nft_common::{allow, check_golden, clear_leftovers, endpoint, ip, listing_blocks, normalise_listing, Netns};

const NS_PREFIX: &str = "npmnftg";

const C1: u32 = IDENTITY_FIRST_CIDR;
const C2: u32 = IDENTITY_FIRST_CIDR + 1;
const C3: u32 = IDENTITY_FIRST_CIDR + 2;
const C4: u32 = IDENTITY_FIRST_CIDR + 3;
const C5: u32 = IDENTITY_FIRST_CIDR + 4;
const C6: u32 = IDENTITY_FIRST_CIDR + 5;

/// Pods, host, port ranges, any protocol, host egress, dual stack; endpoint
/// 3 has no interface (no dispatch entry).
fn basic() -> (Compiled, Interfaces) {
    let mut c = Compiled::default();
    c.endpoints
        .insert(1, endpoint("a", 256, Some("10.0.0.1"), None, true, false));
    c.endpoints
        .insert(2, endpoint("b", 257, Some("10.0.0.2"), Some("fd00::2"), false, true));
    c.endpoints
        .insert(3, endpoint("c", 258, Some("10.0.0.3"), None, true, true));
    ip(&mut c, "10.0.0.1", 256, 0);
    ip(&mut c, "10.0.0.2", 257, 0);
    ip(&mut c, "fd00::2", 257, 0);
    ip(&mut c, "10.0.0.3", 258, 0);
    ip(&mut c, "10.0.1.7", 257, 0);
    ip(&mut c, "192.168.1.10", IDENTITY_HOST, 0);
    ip(&mut c, "fd00:ffff::10", IDENTITY_HOST, 0);
    allow(&mut c, 1, Direction::Ingress, 257, Some(Protocol::Tcp), (80, 80));
    allow(&mut c, 1, Direction::Ingress, 257, Some(Protocol::Udp), (5000, 5010));
    allow(
        &mut c,
        1,
        Direction::Ingress,
        IDENTITY_ANY,
        Some(Protocol::Sctp),
        (0, 65535),
    );
    allow(&mut c, 2, Direction::Egress, 256, None, (0, 65535));
    allow(
        &mut c,
        2,
        Direction::Egress,
        IDENTITY_HOST,
        Some(Protocol::Tcp),
        (10250, 10250),
    );
    // An empty range matches nothing and is not rendered.
    allow(&mut c, 2, Direction::Egress, 256, Some(Protocol::Tcp), (9, 8));
    let ifs = Interfaces::from([(1, 10), (2, 11)]);
    (c, ifs)
}

/// ipBlocks with nested excepts, both families, the whole address space.
fn cidr() -> (Compiled, Interfaces) {
    let mut c = Compiled::default();
    c.endpoints
        .insert(5, endpoint("d", 300, Some("10.1.2.5"), Some("fd00::5"), true, true));
    ip(&mut c, "10.1.2.5", 300, C3);
    ip(&mut c, "fd00::5", 300, C6);
    // 10.0.0.0/8 except 10.1.0.0/16; 10.1.0.0/16 except 10.1.2.0/24 (its own ipBlock).
    c.cidrs.insert("10.0.0.0/8".parse().unwrap(), C1);
    c.cidrs.insert("10.1.0.0/16".parse().unwrap(), C2);
    c.cidrs.insert("10.1.2.0/24".parse().unwrap(), C3);
    c.cidrs.insert("0.0.0.0/0".parse().unwrap(), C4);
    c.cidrs.insert("::/0".parse().unwrap(), C5);
    c.cidrs.insert("fd00::/8".parse().unwrap(), C6);
    allow(&mut c, 5, Direction::Ingress, C1, Some(Protocol::Tcp), (0, 65535));
    allow(&mut c, 5, Direction::Egress, C2, Some(Protocol::Udp), (53, 53));
    allow(&mut c, 5, Direction::Egress, C4, Some(Protocol::Tcp), (443, 443));
    allow(&mut c, 5, Direction::Egress, C5, Some(Protocol::Tcp), (8000, 8999));
    allow(
        &mut c,
        5,
        Direction::Ingress,
        IDENTITY_WORLD,
        Some(Protocol::Udp),
        (0, 65535),
    );
    let ifs = Interfaces::from([(5, 20)]);
    (c, ifs)
}

/// Isolated both ways, nothing allowed, IPv6-only endpoint, no host address.
fn deny_all_v6() -> (Compiled, Interfaces) {
    let mut c = Compiled::default();
    c.endpoints
        .insert(9, endpoint("e", 400, None, Some("fd00::9"), true, true));
    ip(&mut c, "fd00::9", 400, 0);
    let ifs = Interfaces::from([(9, 30)]);
    (c, ifs)
}

fn run_case(name: &str, (compiled, ifs): (Compiled, Interfaces)) {
    clear_leftovers(NS_PREFIX);
    let script = render(&compiled, &ifs, &NftOptions::default());
    check_golden(name, "nft", &script);
    // Rendering is deterministic.
    assert_eq!(script, render(&compiled.clone(), &ifs, &NftOptions::default()));

    let ns = Netns::new(&format!("{NS_PREFIX}{}{name}", std::process::id()));
    let table = format!("npm_t{}", std::process::id());
    let mut dp = NftDataplane::new(NftOptions {
        table: table.clone(),
        netns: Some(ns.name.clone()),
    })
    .unwrap();
    dp.sync_full(&compiled, &ifs).unwrap();
    let listed = normalise_listing(&dp.list_table().unwrap(), &table);
    check_golden(name, "list", &listed);
    // Loading again replaces the table (no duplicate objects, same listing).
    dp.sync_full(&compiled, &ifs).unwrap();
    assert_eq!(normalise_listing(&dp.list_table().unwrap(), &table), listed);
    dp.remove().unwrap();
    let err = dp.list_table().unwrap_err();
    assert!(err.to_string().contains("No such file or directory"), "{err}");
}

#[test]
fn golden_basic() {
    run_case("basic", basic());
}

#[test]
fn golden_cidr() {
    run_case("cidr", cidr());
}

#[test]
fn golden_deny_all_v6() {
    run_case("deny_all_v6", deny_all_v6());
}

#[test]
fn empty_compiled_renders_a_loadable_table_without_dispatch() {
    let script = render(&Compiled::default(), &Interfaces::new(), &NftOptions::default());
    assert!(!script.contains("jump"), "{script}");
    let ns = Netns::new(&format!("{NS_PREFIX}{}empty", std::process::id()));
    let mut dp = NftDataplane::new(NftOptions {
        table: "npm".into(),
        netns: Some(ns.name.clone()),
    })
    .unwrap();
    dp.sync_full(&Compiled::default(), &Interfaces::new()).unwrap();
    let listed = dp.list_table().unwrap();
    assert!(listed.contains("chain base_forward"), "{listed}");
    assert!(listed.contains("counter in_policy_denied"), "{listed}");
}

/// Egress is decided in forward and input, ingress only after source NAT
/// (postrouting, priority srcnat + 1, on the source the pod sees, as the
/// eBPF `to_pod`), and no dispatch is in two hooks a packet crosses.
#[test]
fn ingress_is_decided_after_source_nat_and_only_there() {
    let (c, ifs) = basic();
    let script = render(&c, &ifs, &NftOptions::default());
    // The base chains of both tables (the bridge table's is base_prerouting).
    let base: Vec<(&str, &str)> = script
        .split("\tchain ")
        .filter(|b| b.starts_with("base_") && b.contains(" hook "))
        .map(|b| (b.split_whitespace().next().unwrap_or(""), b))
        .collect();
    let hooks: Vec<(&str, String)> = base
        .iter()
        .map(|(name, body)| {
            let ty = body.lines().nth(1).unwrap_or("").trim().to_string();
            (*name, ty)
        })
        .collect();
    let inet_hooks: Vec<(&str, &str)> = hooks
        .iter()
        .filter(|(n, _)| *n != "base_prerouting")
        .map(|(n, t)| (*n, t.as_str()))
        .collect();
    assert_eq!(
        inet_hooks,
        [
            (
                "base_forward",
                "type filter hook forward priority filter; policy accept;"
            ),
            ("base_input", "type filter hook input priority filter; policy accept;"),
            (
                "base_postrouting",
                "type filter hook postrouting priority srcnat + 1; policy accept;"
            ),
        ],
        "{script}"
    );
    for (name, body) in &base {
        let ingress = body.contains("@dispatch_in") || body.contains("@bridged_in_");
        let egress = body.contains("@dispatch_out") || body.contains("@bridged_out_");
        match *name {
            "base_postrouting" => assert!(ingress && !egress, "{body}"),
            "base_forward" | "base_input" => assert!(egress && !ingress, "{body}"),
            _ => assert!(!ingress && !egress, "{body}"),
        }
    }
}

#[test]
fn nft_failure_reports_command_and_stderr() {
    // A namespace that does not exist: `ip netns exec` fails; the error names the command.
    let mut dp = NftDataplane::new(NftOptions {
        table: "npm".into(),
        netns: Some(format!("{NS_PREFIX}{}missing", std::process::id())),
    })
    .unwrap();
    let err = dp.sync_full(&Compiled::default(), &Interfaces::new()).unwrap_err();
    let text = err.to_string();
    assert!(text.contains("ip netns exec") && text.contains("nft"), "{text}");
}

#[test]
fn incremental_updates_equal_a_fresh_load() {
    let ns = Netns::new(&format!("{NS_PREFIX}{}inc", std::process::id()));
    let opts = |table: &str| NftOptions {
        table: table.into(),
        netns: Some(ns.name.clone()),
    };
    let mut inc = NftDataplane::new(opts("npm_inc")).unwrap();
    let mut fresh = NftDataplane::new(opts("npm_fresh")).unwrap();
    // Transitions between unrelated states and small edits of each.
    let (b, b_ifs) = basic();
    let mut b2 = b.clone();
    b2.ipcache.remove(&"10.0.1.7".parse().unwrap());
    b2.endpoints.remove(&2);
    b2.endpoints.get_mut(&1).unwrap().isolated_egress = true;
    allow(&mut b2, 1, Direction::Egress, IDENTITY_HOST, None, (0, 65535));
    let (c, c_ifs) = cidr();
    let mut c2 = c.clone();
    c2.cidrs.remove(&"10.1.2.0/24".parse().unwrap());
    c2.cidrs.insert("10.128.0.0/9".parse().unwrap(), C6 + 1);
    let mut c2_ifs = c_ifs.clone();
    c2_ifs.insert(5, 21);
    let (d, d_ifs) = deny_all_v6();
    let steps = [
        (b.clone(), b_ifs.clone()),
        (b2, b_ifs.clone()),
        (c, c_ifs.clone()),
        (c2, c2_ifs),
        (d, d_ifs),
        (Compiled::default(), Interfaces::new()),
        (b, b_ifs),
    ];
    inc.sync_full(&steps[0].0, &steps[0].1).unwrap();
    let mut prev = steps[0].0.clone();
    for (i, (next, ifs)) in steps.iter().enumerate().skip(1) {
        inc.apply(&prev.diff(next), next, ifs).unwrap();
        fresh.sync_full(next, ifs).unwrap();
        let got = listing_blocks(&normalise_listing(&inc.list_table().unwrap(), "npm_inc"));
        let want = listing_blocks(&normalise_listing(&fresh.list_table().unwrap(), "npm_fresh"));
        assert_eq!(got, want, "step {i}: incremental table differs from a fresh load");
        prev = next.clone();
    }
    // Every step went through the incremental path (no fallback to a replace).
    assert_eq!(inc.full_loads(), 1);
    assert_eq!(inc.incremental_updates(), steps.len() as u64 - 1);
}
