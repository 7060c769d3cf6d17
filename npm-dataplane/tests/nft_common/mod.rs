//! Helpers of the nftables dataplane tests: the shared namespace, process
//! and compiled-form helpers of `netns_common`, plus a policy-entry builder
//! that numbers rules itself.
#![allow(dead_code)]

#[path = "../netns_common/mod.rs"]
mod netns_common;

pub use netns_common::*;

use npm_policy::compiled::{Compiled, Direction, PolicyEntry};
use npm_policy::model::Protocol;

/// Deletes namespaces named `<prefix><pid>...` whose owning test process is
/// gone (left over by a crashed run).
pub fn clear_leftovers(prefix: &str) {
    clear_netns_leftovers(prefix);
}

/// Adds a policy entry with the next rule id.
pub fn allow(
    c: &mut Compiled,
    endpoint: u32,
    direction: Direction,
    peer: u32,
    proto: Option<Protocol>,
    ports: (u16, u16),
) {
    let rule = c.policy.len() as u32 + 1;
    c.policy.insert(
        PolicyEntry {
            endpoint,
            direction,
            peer,
            protocol: proto,
            ports,
        },
        rule,
    );
}
