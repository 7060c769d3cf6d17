//! The node the agent runs on: its own addresses ([`addresses`], kept
//! current through netlink) and the host-side interfaces of its local
//! endpoints ([`interfaces`], by the rules of [`discovery`]) and its
//! uplinks ([`uplinks`], where `node_exit` goes), all read through the
//! small rtnetlink client of [`netlink`]; and, for nftables, whether
//! bridged endpoints' traffic reaches the table ([`bridge_nf`]).

pub mod addresses;
pub mod bridge_nf;
pub mod discovery;
pub mod interfaces;
pub mod netlink;
pub mod uplinks;

pub use addresses::{AddressState, NodeAddresses};
pub use interfaces::{EndpointError, InterfacePattern, InterfaceResolver, Resolve, Resolved};
