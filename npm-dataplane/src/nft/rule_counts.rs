//! The per-rule and per-endpoint counters of the nftables dataplane, read
//! back from the kernel: every NetworkPolicy allow rule of an endpoint chain
//! (`ep_<id>_<in|out>`) carries an anonymous `counter` and the comment
//! `rule <id>`, and the chain's final `policy_denied` drop one too
//! (`chain::endpoint_rules`). `nft -j list table inet <table>` lists them
//! with their handles.
//!
//! The anonymous counters live in their rules: a whole-table replace, or an
//! incremental update that rewrites an endpoint's chain, starts them at 0
//! (the agent's fold counts a total lower than its last reading as a
//! restart), so the packets a rewritten rule counted since the agent's last
//! read are lost; chains an update does not touch keep their counters.

use serde_json::Value;

use super::adopt::{endpoint_chain, listing_items};
use super::{is_missing_table, run_nft, NftDataplane, NftError};
use crate::{KernelCount, RuleCounts};

impl NftDataplane {
    /// The kernel's per-rule allows and per-endpoint denies of the `inet`
    /// table (empty when there is no table).
    pub(crate) fn rule_counts(&self) -> Result<RuleCounts, NftError> {
        let args = ["-j", "list", "table", "inet", self.opts.table.as_str()];
        match run_nft(&self.opts, &args, None) {
            Ok(json) => parse_rule_counts(&format!("nft {}", args.join(" ")), &json),
            Err(e) if is_missing_table(&e) => Ok(RuleCounts::default()),
            Err(e) => Err(e),
        }
    }
}

/// A rule's anonymous counter (`{"counter": {"packets": .., "bytes": ..}}`).
fn anonymous_counter(expr: &[Value]) -> Option<(u64, u64)> {
    expr.iter().find_map(|e| {
        let c = e.get("counter")?.as_object()?;
        Some((c.get("packets")?.as_u64()?, c.get("bytes")?.as_u64()?))
    })
}

/// Whether a rule counts into the named counter ending in `policy_denied`.
fn is_policy_denied(expr: &[Value]) -> bool {
    expr.iter().any(|e| {
        e.get("counter")
            .and_then(Value::as_str)
            .is_some_and(|n| n.ends_with("_policy_denied"))
    })
}

/// A stable id of one nftables rule: its chain name hashed (FNV-1a, 32
/// bits) above its handle.
fn source_of(chain: &str, handle: u64) -> u64 {
    let h = chain
        .bytes()
        .fold(0x811c_9dc5u32, |h, b| (h ^ b as u32).wrapping_mul(0x0100_0193));
    (h as u64) << 32 | (handle & 0xffff_ffff)
}

/// Parses `nft -j list table inet <table>`: the counters of the rules
/// commented `rule <id>` and of the `policy_denied` drops of the endpoint
/// chains (zero counters left out).
pub(crate) fn parse_rule_counts(command: &str, json: &str) -> Result<RuleCounts, NftError> {
    let items = listing_items(command, json)?;
    let mut out = RuleCounts::default();
    for item in items {
        let Some(rule) = item.get("rule") else { continue };
        let Some(chain) = rule.get("chain").and_then(Value::as_str) else {
            continue;
        };
        // `ep_<id>_in_nat`, the original-source copy (`chain::Source`),
        // counts for its endpoint too.
        let Some((endpoint, direction)) = endpoint_chain(chain.strip_suffix("_nat").unwrap_or(chain)) else {
            continue;
        };
        let Some(expr) = rule.get("expr").and_then(Value::as_array) else {
            continue;
        };
        let Some((packets, bytes)) = anonymous_counter(expr) else {
            continue;
        };
        if packets == 0 && bytes == 0 {
            continue;
        }
        let handle = rule.get("handle").and_then(Value::as_u64).unwrap_or(0);
        let count = |key| KernelCount {
            source: source_of(chain, handle),
            key,
            direction,
            packets,
            bytes,
        };
        let rule_id = rule
            .get("comment")
            .and_then(Value::as_str)
            .and_then(|c| c.strip_prefix("rule "))
            .and_then(|n| n.parse::<u32>().ok());
        if let Some(id) = rule_id {
            out.allowed.push(count(id));
        } else if is_policy_denied(expr) {
            out.denied.push(count(endpoint));
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use npm_common::{DIR_EGRESS, DIR_INGRESS};

    #[test]
    fn reads_rule_and_deny_counters() {
        let json = r#"{"nftables": [
          {"metainfo": {}},
          {"rule": {"chain": "ep_7_in", "handle": 3, "comment": "rule 12",
            "expr": [{"counter": "in_policy"}, {"counter": {"packets": 2, "bytes": 120}}, {"return": null}]}},
          {"rule": {"chain": "ep_7_in", "handle": 4,
            "expr": [{"counter": "in_policy_denied"}, {"counter": {"packets": 5, "bytes": 300}}, {"drop": null}]}},
          {"rule": {"chain": "ep_7_in_admin", "handle": 5, "comment": "rule 1",
            "expr": [{"counter": "in_admin_accept"}, {"accept": null}]}},
          {"rule": {"chain": "ep_8_out", "handle": 6, "comment": "rule 13",
            "expr": [{"counter": "out_policy"}, {"counter": {"packets": 0, "bytes": 0}}, {"return": null}]}}
        ]}"#;
        let c = parse_rule_counts("nft", json).unwrap();
        assert_eq!(c.allowed.len(), 1);
        assert_eq!((c.allowed[0].key, c.allowed[0].direction), (12, DIR_INGRESS));
        assert_eq!((c.allowed[0].packets, c.allowed[0].bytes), (2, 120));
        assert_eq!(c.denied.len(), 1);
        assert_eq!((c.denied[0].key, c.denied[0].packets), (7, 5));
        assert_ne!(c.allowed[0].source, c.denied[0].source);
        assert!(parse_rule_counts("nft", "{}").is_err());
        assert_eq!(endpoint_chain("ep_12_out"), Some((12, DIR_EGRESS)));
        assert_eq!(endpoint_chain("ep_12_out_baseline"), None);
    }
}
