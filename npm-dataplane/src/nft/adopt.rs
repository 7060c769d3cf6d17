//! What a previous agent left in the nftables table, read when the
//! dataplane is created ([`NftDataplane::adopted`]), so that a restarted
//! agent's first full sync is guarded against it like the eBPF
//! dataplane's pinned maps: the pod identities the table names (non-empty
//! `id_<n>_v4/_v6` sets: only identities some rule refers to have one, so
//! the isolation and the endpoints carry the guard here), and one record per endpoint chain pair `ep_<id>_in/_out` with
//! its isolation (a chain whose rules count `not_isolated` is not isolated)
//! and its addresses (the egress chain's source checks `ip saddr != A`),
//! and the number of ClusterNetworkPolicy tier rules (the rules of the
//! `ep_<id>_<in|out>_<admin|baseline>` chains: losing most of them at once
//! is a mass removal like losing isolation).
//!
//! The table is replaced atomically by a full sync, so old and new numbers
//! never meet in the kernel: no number needs adopting. The records carry
//! no interface (`ifindex` 0: the listing names interfaces that exist, and
//! kernel conntrack is not keyed by endpoint id), so a restarted agent
//! numbers every endpoint above the adopted ids.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use npm_common::{Reason, DIR_EGRESS, DIR_INGRESS, IDENTITY_FIRST_CIDR, IDENTITY_FIRST_POD};
use serde_json::Value;

use super::{counter_name, NftDataplane, NftError};
use crate::AdoptedEndpoint;

/// What the table held: (pod identities, the endpoint records).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NftAdopted {
    /// Distinct pod identities with a non-empty set (those some rule
    /// refers to).
    pub identities: usize,
    /// One record per endpoint (ids from the chain names).
    pub endpoints: Vec<AdoptedEndpoint>,
    /// Rules of the tier chains (Admin and Baseline, both directions, all
    /// endpoints): one per tier entry and address family.
    pub tier_rules: usize,
    /// The tier chains: one per endpoint, direction and tier with entries
    /// (the endpoint's tier flag).
    pub tier_chains: usize,
}

/// `ep_<id>_<in|out>_<admin|baseline>` -> whether it is a tier chain.
fn is_tier_chain(name: &str) -> bool {
    ["_admin", "_baseline"]
        .iter()
        .any(|t| name.strip_suffix(t).and_then(endpoint_chain).is_some())
}

/// `ep_<id>_<in|out>` -> (id, direction); tier chains and others: `None`.
pub(super) fn endpoint_chain(name: &str) -> Option<(u32, u8)> {
    let rest = name.strip_prefix("ep_")?;
    let (id, dir) = rest.rsplit_once('_')?;
    let d = match dir {
        "in" => DIR_INGRESS,
        "out" => DIR_EGRESS,
        _ => return None,
    };
    Some((id.parse().ok()?, d))
}

/// `id_<n>_v4|v6` -> n.
fn identity_set(name: &str) -> Option<u32> {
    let rest = name.strip_prefix("id_")?;
    let (n, fam) = rest.rsplit_once('_')?;
    matches!(fam, "v4" | "v6").then_some(())?;
    n.parse().ok()
}

/// Whether a rule's expressions count into the named counter `name`.
fn counts_into(expr: &[Value], name: &str) -> bool {
    expr.iter()
        .any(|e| e.get("counter").and_then(Value::as_str) == Some(name))
}

/// The address `A` of a rule `ip[6] saddr != A ...`.
fn source_check(expr: &[Value]) -> Option<IpAddr> {
    expr.iter().find_map(|e| {
        let m = e.get("match")?;
        (m.get("op")?.as_str()? == "!=").then_some(())?;
        let p = m.get("left")?.get("payload")?;
        (p.get("field")?.as_str()? == "saddr").then_some(())?;
        m.get("right")?.as_str()?.parse().ok()
    })
}

/// The objects of an `nft -j list ...` output (`command`, for errors):
/// its `"nftables"` array.
pub(super) fn listing_items(command: &str, json: &str) -> Result<Vec<Value>, NftError> {
    let mut v: Value = serde_json::from_str(json).map_err(|source| NftError::NotJson {
        command: command.to_string(),
        source,
    })?;
    match v.get_mut("nftables").map(Value::take) {
        Some(Value::Array(items)) => Ok(items),
        _ => Err(NftError::BadOutput {
            command: command.to_string(),
            detail: "no \"nftables\" array".into(),
        }),
    }
}

/// Parses `nft -j list table inet <table>` (`command`, for errors).
pub(super) fn parse(command: &str, json: &str) -> Result<NftAdopted, NftError> {
    let items = listing_items(command, json)?;
    let mut identities = BTreeSet::new();
    // id -> (seen directions, isolated ingress, isolated egress, v4, v6);
    // a chain is isolated until a rule of it counts `not_isolated`.
    let mut eps: BTreeMap<u32, AdoptedEndpoint> = BTreeMap::new();
    let mut tier_rules = 0;
    let mut tier_chains = 0;
    let not_isolated = |d| counter_name(d, Reason::NotIsolated);
    for item in items {
        if let Some(set) = item.get("set") {
            let name = set.get("name").and_then(Value::as_str).unwrap_or_default();
            let has = set.get("elem").and_then(Value::as_array).is_some_and(|e| !e.is_empty());
            if let Some(n) = identity_set(name).filter(|n| (IDENTITY_FIRST_POD..IDENTITY_FIRST_CIDR).contains(n)) {
                if has {
                    identities.insert(n);
                }
            }
        } else if let Some(chain) = item.get("chain") {
            let name = chain.get("name").and_then(Value::as_str).unwrap_or_default();
            if is_tier_chain(name) {
                tier_chains += 1;
            }
            if let Some((id, d)) = endpoint_chain(name) {
                let ep = eps.entry(id).or_insert(AdoptedEndpoint {
                    ifindex: 0,
                    id,
                    ipv4: None,
                    ipv6: None,
                    isolated_ingress: false,
                    isolated_egress: false,
                    tiered_directions: 0,
                });
                if d == DIR_INGRESS {
                    ep.isolated_ingress = true;
                } else {
                    ep.isolated_egress = true;
                }
            }
        } else if let Some(rule) = item.get("rule") {
            let chain = rule.get("chain").and_then(Value::as_str).unwrap_or_default();
            if is_tier_chain(chain) {
                tier_rules += 1;
                continue;
            }
            let Some((id, d)) = endpoint_chain(chain) else { continue };
            let Some(ep) = eps.get_mut(&id) else { continue };
            let expr = rule
                .get("expr")
                .and_then(Value::as_array)
                .map(Vec::as_slice)
                .unwrap_or_default();
            if counts_into(expr, &not_isolated(d)) {
                if d == DIR_INGRESS {
                    ep.isolated_ingress = false;
                } else {
                    ep.isolated_egress = false;
                }
            }
            if d == DIR_EGRESS {
                match source_check(expr) {
                    Some(IpAddr::V4(a)) => ep.ipv4 = Some(a),
                    Some(IpAddr::V6(a)) => ep.ipv6 = Some(a),
                    None => {}
                }
            }
        }
    }
    Ok(NftAdopted {
        identities: identities.len(),
        endpoints: eps.into_values().collect(),
        tier_rules,
        tier_chains,
    })
}

impl NftDataplane {
    /// What the table held when the dataplane was created (`None`: no
    /// table, or it could not be read).
    pub fn adopted(&self) -> Option<&NftAdopted> {
        self.adopted.as_ref()
    }

    /// Reads what the table holds now (`Ok(None)`: there is no table).
    pub(super) fn read_adopted(&self) -> Result<Option<NftAdopted>, NftError> {
        let table = self.opts.table.as_str();
        let args = ["-j", "list", "table", "inet", table];
        match super::run_nft(&self.opts, &args, None) {
            Ok(json) => Ok(Some(parse(&format!("nft {}", args.join(" ")), &json)?)),
            Err(e) if super::is_missing_table(&e) => Ok(None),
            Err(e) => Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_listing_gives_identities_endpoints_and_isolation() {
        let json = r#"{"nftables": [{"metainfo": {"version": "1.0.6"}},
          {"table": {"family": "inet", "name": "npm"}},
          {"set": {"name": "id_256_v4", "type": "ipv4_addr", "elem": ["10.0.0.1", "10.0.0.2"]}},
          {"set": {"name": "id_257_v4", "type": "ipv4_addr", "elem": []}},
          {"set": {"name": "id_2_v4", "type": "ipv4_addr", "elem": ["10.9.9.9"]}},
          {"set": {"name": "id_258_v6", "type": "ipv6_addr", "elem": ["fd00::1"]}},
          {"chain": {"name": "ep_3_in"}}, {"chain": {"name": "ep_3_out"}},
          {"chain": {"name": "ep_4_in"}}, {"chain": {"name": "ep_4_out"}},
          {"chain": {"name": "base_forward"}},
          {"rule": {"chain": "ep_3_in", "expr": [{"counter": "in_tracked"}, {"return": null}]}},
          {"rule": {"chain": "ep_3_out", "expr": [{"match": {"op": "!=", "left": {"payload": {"protocol": "ip", "field": "saddr"}}, "right": "10.0.0.1"}}, {"counter": "out_spoofed"}, {"drop": null}]}},
          {"rule": {"chain": "ep_3_out", "expr": [{"counter": "out_not_isolated"}, {"return": null}]}},
          {"rule": {"chain": "ep_4_in", "expr": [{"counter": "in_not_isolated"}, {"return": null}]}},
          {"rule": {"chain": "ep_4_out", "expr": [{"counter": "out_not_isolated"}, {"return": null}]}},
          {"chain": {"name": "ep_4_in_admin"}}, {"chain": {"name": "ep_4_out_baseline"}},
          {"rule": {"chain": "ep_4_in_admin", "expr": [{"counter": "in_admin_deny"}, {"drop": null}]}},
          {"rule": {"chain": "ep_3_in_baseline", "expr": [{"counter": "in_not_isolated"}, {"return": null}]}},
          {"rule": {"chain": "ep_4_out_baseline", "expr": [{"counter": "out_baseline_deny"}, {"drop": null}]}},
          {"rule": {"chain": "ep_x_in_admin", "expr": []}}
        ]}"#;
        let a = parse("nft", json).unwrap();
        assert_eq!(a.identities, 2, "non-empty pod identity sets only");
        assert_eq!(a.endpoints.len(), 2, "tier chains are not endpoints");
        assert_eq!(a.tier_rules, 3);
        assert_eq!(a.tier_chains, 2, "ep_4_in_admin, ep_4_out_baseline");
        let e3 = &a.endpoints[0];
        assert_eq!((e3.id, e3.isolated_ingress, e3.isolated_egress), (3, true, false));
        assert_eq!(e3.ipv4, Some("10.0.0.1".parse().unwrap()));
        let e4 = &a.endpoints[1];
        assert_eq!((e4.id, e4.isolated_ingress, e4.isolated_egress), (4, false, false));
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        assert!(matches!(parse("nft", "not json"), Err(NftError::NotJson { .. })));
        assert!(matches!(parse("nft", "{\"x\": 1}"), Err(NftError::BadOutput { .. })));
        assert_eq!(parse("nft", "{\"nftables\": []}").unwrap(), NftAdopted::default());
    }
}
