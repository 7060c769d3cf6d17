//! The node the agent runs on: its own addresses ([`addresses`]) and the
//! host-side interfaces of its local endpoints ([`interfaces`]).

pub mod addresses;
pub mod interfaces;

pub use addresses::local_addresses;
pub use interfaces::{EndpointError, InterfacePattern, InterfaceResolver, Resolve, Resolved, RouteTarget};
