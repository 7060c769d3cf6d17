//! Cost of the atomic full replace at scale: 100 endpoints x 50 policy
//! entries (and 1,000 ipcache addresses in 200 identities) rendered and
//! loaded into a namespace, then one entry changed and applied. Prints the
//! measured times; fails if the table is not what was rendered or a load
//! takes unreasonably long.

use std::time::{Duration, Instant};

use npm_common::IDENTITY_FIRST_CIDR;
use npm_dataplane::nft::{render, NftDataplane, NftOptions};
use npm_dataplane::{Dataplane, Interfaces};
use npm_policy::compiled::{Compiled, Direction};
use npm_policy::model::Protocol;

use crate::nft_common::{allow, clear_leftovers, endpoint, ip, Netns};

const NS_PREFIX: &str = "npmnfts";

fn big() -> (Compiled, Interfaces) {
    let mut c = Compiled::default();
    for i in 0..1000u32 {
        let identity = 256 + i % 200;
        ip(
            &mut c,
            &format!("10.{}.{}.{}", 64 + i / 65536, (i / 256) % 256, i % 256),
            identity,
            0,
        );
    }
    for k in 0..20u32 {
        c.cidrs.insert(
            format!("172.{}.0.0/16", 16 + k).parse().unwrap(),
            IDENTITY_FIRST_CIDR + k,
        );
        c.cidrs.insert(
            format!("172.{}.1.0/24", 16 + k).parse().unwrap(),
            IDENTITY_FIRST_CIDR + 100 + k,
        );
    }
    let mut ifs = Interfaces::new();
    for e in 1..=100u32 {
        c.endpoints.insert(
            e,
            endpoint(
                &format!("p{e}"),
                256 + e,
                Some(&format!("10.64.0.{e}")),
                None,
                true,
                true,
            ),
        );
        ifs.insert(e, 1000 + e);
        for j in 0..50u32 {
            let dir = if j % 2 == 0 {
                Direction::Ingress
            } else {
                Direction::Egress
            };
            let peer = if j % 5 == 4 {
                IDENTITY_FIRST_CIDR + (j + e) % 20
            } else {
                256 + (e * 7 + j) % 200
            };
            let proto = [Protocol::Tcp, Protocol::Udp, Protocol::Sctp][(j % 3) as usize];
            let port = 1000 + (j * 13) as u16;
            let ports = if j % 4 == 0 { (port, port + 99) } else { (port, port) };
            allow(&mut c, e, dir, peer, Some(proto), ports);
        }
    }
    (c, ifs)
}

#[test]
fn hundred_endpoints_fifty_entries() {
    clear_leftovers(NS_PREFIX);
    let (compiled, ifs) = big();
    assert_eq!(compiled.policy.len(), 5000);
    let ns = Netns::new(&format!("{NS_PREFIX}{}", std::process::id()));
    let opts = NftOptions {
        table: "npm".into(),
        netns: Some(ns.name.clone()),
    };
    let t = Instant::now();
    let script = render(&compiled, &ifs, &opts);
    let render_time = t.elapsed();

    let mut dp = NftDataplane::new(opts).unwrap();
    let t = Instant::now();
    dp.sync_full(&compiled, &ifs).unwrap();
    let load_time = t.elapsed();

    let listed = dp.list_table().unwrap();
    let chains = listed.matches("\tchain ep_").count();
    let nat = listed.matches("_in_nat {").count();
    // Two per endpoint, and the original-source copy of each isolated
    // ingress chain (`ep_<id>_in_nat`: connections source-NATed here).
    assert_eq!((chains - nat, nat), (200, 100), "endpoint chains in the kernel");
    let policy_rules = listed.matches("counter name \"in_policy\" counter").count()
        + listed.matches("counter name \"out_policy\" counter").count();
    let rendered_rules = script.matches("counter name \"in_policy\" counter").count()
        + script.matches("counter name \"out_policy\" counter").count();
    assert_eq!(policy_rules, rendered_rules);
    assert!(policy_rules >= 5000, "{policy_rules} policy rules");

    let mut next = compiled.clone();
    allow(&mut next, 1, Direction::Ingress, 300, Some(Protocol::Tcp), (7, 7));
    let t = Instant::now();
    dp.apply(&compiled.diff(&next), &next, &ifs).unwrap();
    let apply_time = t.elapsed();
    assert!(dp
        .list_table()
        .unwrap()
        .contains("tcp dport 7 counter name \"in_policy\" counter"));
    assert_eq!((dp.full_loads(), dp.incremental_updates()), (1, 1));

    // An apply that changes nothing does not touch the kernel.
    let t = Instant::now();
    dp.apply(&next.diff(&next), &next, &ifs).unwrap();
    let noop_time = t.elapsed();

    eprintln!(
        "nft scale: 100 endpoints x 50 entries = {policy_rules} rules, script {} KiB: render {:?}, \
         first load {:?}, apply of one change {:?}, no-op apply {:?}",
        script.len() / 1024,
        render_time,
        load_time,
        apply_time,
        noop_time
    );
    assert!(load_time < Duration::from_secs(30) && apply_time < Duration::from_secs(30));
}
