//! Learning DNS answers for ClusterNetworkPolicy `domainNames` peers
//! (experimental, Accept rules only), with `--dns-server`.
//!
//! - [`capture`]: the DNS responses of the trusted servers to this node's
//!   pods, read from an NFQUEUE and held until what they taught is
//!   programmed;
//! - [`answers`]: the answers of one response ([`answers::parse_response`]);
//! - [`learner`]: the learned names, each address kept for its TTL (at
//!   least the minimum TTL) and a grace, bounded per name, per namespace
//!   and in total ([`learner::Learner`]), kept across restarts in a state
//!   file;
//! - [`nfqueue`]: the NFQUEUE socket (out-of-order verdicts);
//! - [`rules`]: the iptables rules feeding the queue, kept in place;
//! - [`notrack`]: DNS exempted from conntrack (NodeLocal DNSCache), which
//!   the rules cannot see, detected and reported;
//! - [`handle`]: the learned names as the capture and the sync loop share
//!   them ([`handle::NamesHandle`]): the sync loop compiles the current
//!   version into `Snapshot::domain_names` and publishes the version it
//!   programmed.

pub mod answers;
pub mod capture;
pub mod handle;
pub mod learner;
pub mod nfqueue;
pub mod notrack;
pub mod rules;

pub use capture::{Capture, CaptureConfig, CaptureError};
pub use handle::NamesHandle;
