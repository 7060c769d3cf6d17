//! The numbers a previous agent left in the pinned maps, read once when
//! the dataplane is opened ([`EbpfDataplane::adopted_numbers`]): each pod
//! identity of `NPM_IPCACHE` with the addresses that carry it, each prefix
//! of `NPM_CIDRS` with its CIDR identity, the highest rule id of
//! `NPM_POLICY` and `NPM_TIERS` (one rule id space), and the highest policy
//! subject (a pod identity) of the `NPM_POLICY` and `NPM_TIERS` keys and the endpoint
//! records (`max_subject`: a subject whose keys or records are still in the
//! kernel may have no address left in the ipcache, and must not be given
//! to another identity). A restarted agent keeps those numbers' meaning
//! (`npm_policy::adopt`). After a layout upgrade the new layout's maps are
//! empty: the older layout's program keeps running beside the new one
//! until the first full sync and a packet passes only if both allow it, so
//! its numbers cannot mix with the new ones.

use aya::maps::lpm_trie::LpmTrie;
use aya::maps::{HashMap as BpfHashMap, MapData};
use npm_common::{
    maps, EndpointInfo, IpInfo, IpKey, PolicyKey, PolicyValue, TierValue, IDENTITY_FIRST_CIDR, IDENTITY_FIRST_POD,
    POLICY_KEY_LEN,
};
use npm_policy::adopt::AdoptedNumbers;

use super::errors::{map_err, EbpfError};
use super::{translate, EbpfDataplane};

/// Reads the [`AdoptedNumbers`] of an ipcache, a CIDR trie, a policy
/// trie, a tier trie and the endpoint records `endpoints`. A CIDR key that
/// does not translate back to a prefix is an error (the maps are not
/// npm's layout).
pub(super) fn read_numbers(
    ipcache: &BpfHashMap<MapData, IpKey, IpInfo>,
    cidrs: &LpmTrie<MapData, [u8; 16], u32>,
    policy: &LpmTrie<MapData, [u8; POLICY_KEY_LEN], PolicyValue>,
    tiers: &LpmTrie<MapData, [u8; POLICY_KEY_LEN], TierValue>,
    endpoints: &[(u32, EndpointInfo)],
) -> Result<AdoptedNumbers, EbpfError> {
    let mut out = AdoptedNumbers::default();
    for e in ipcache.iter() {
        let (k, info) = e.map_err(map_err(maps::IPCACHE, "iterate"))?;
        if (IDENTITY_FIRST_POD..IDENTITY_FIRST_CIDR).contains(&info.identity) {
            out.identities
                .entry(info.identity)
                .or_default()
                .insert(translate::ip_from_key(&k));
        }
    }
    for e in cidrs.iter() {
        let (k, id) = e.map_err(map_err(maps::CIDRS, "iterate"))?;
        out.cidrs
            .insert(translate::cidr_from_key(k.prefix_len(), k.data())?, id);
    }
    for e in policy.iter() {
        let (k, v) = e.map_err(map_err(maps::POLICY, "iterate"))?;
        out.max_rule = out.max_rule.max(v.rule);
        let key = PolicyKey {
            prefix_len: k.prefix_len(),
            data: k.data(),
        };
        out.max_subject = out.max_subject.max(key.subject());
    }
    for (_, info) in endpoints {
        out.max_subject = out.max_subject.max(info.subject);
    }
    for e in tiers.iter() {
        let (k, v) = e.map_err(map_err(maps::TIERS, "iterate"))?;
        out.max_rule = out.max_rule.max(v.rule);
        // Tier keys are keyed by subject too.
        let key = PolicyKey {
            prefix_len: k.prefix_len(),
            data: k.data(),
        };
        out.max_subject = out.max_subject.max(key.subject());
    }
    Ok(out)
}

impl EbpfDataplane {
    /// The numbers found in the pinned maps when the dataplane was opened
    /// (empty when the maps were new or could not be read).
    pub fn adopted_numbers(&self) -> &AdoptedNumbers {
        &self.adopted_numbers
    }
}
