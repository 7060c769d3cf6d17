//! Learning DNS answers for ClusterNetworkPolicy `domainNames` peers
//! (experimental, Accept rules only), with `--dns-server`.
//!
//! - [`capture`]: the DNS responses of the trusted servers to this node's
//!   pods, read from an NFQUEUE and held until what they taught is
//!   programmed;
//! - [`learner`]: the answers of one response ([`learner::parse_response`])
//!   and the learned names, each address kept for its TTL and a grace
//!   ([`learner::Learner`]), kept across restarts in a state file;
//! - [`handle`]: the learned names as the capture and the sync loop share
//!   them ([`handle::NamesHandle`]): the sync loop compiles the current
//!   version into `Snapshot::domain_names` and publishes the version it
//!   programmed.

pub mod capture;
pub mod handle;
pub mod learner;

pub use capture::{Capture, CaptureConfig, CaptureError};
pub use handle::NamesHandle;
