//! Keeping npm-cni chained: the agent checks the CNI configuration
//! directory every few seconds and puts npm-cni's entry back into the
//! conflist the runtime uses whenever it is missing.
//!
//! The chart's `install-cni` init container chains npm-cni once. Primary
//! CNIs (Calico's install-cni, aws-node, kube-flannel's install-cni,
//! kindnet) write their conflist anew when they restart or upgrade, which
//! drops the entry: from then on new pods would start before they are
//! enforced and report no CNI facts. Each check ([`Chain::check`]) reads the
//! directory as a runtime does (the lexically first configuration file) and,
//! when that conflist lacks the entry (or holds other values), runs the same
//! installer as the init container ([`npm_cni::install::install`]:
//! idempotent, a temporary file renamed over the conflist, the file read
//! again if it changed under it). A deleted conflist is chained again as
//! soon as the primary writes it back.
//!
//! **Polling, not inotify**: a read of one small file every
//! [`DEFAULT_INTERVAL`] costs nothing and cannot miss an event (a rename
//! over the file, a directory replaced by a volume mount, an inotify queue
//! overflow); the `notify` crate is CC0-1.0, which the dependency policy
//! (`xtask/deps-policy.yaml`) does not list.
//!
//! **Reported**: the readiness check [`CHECK_CNI_CHAINED`] fails while the
//! conflist lacks the entry (or there is no usable conflist), with the
//! reason, and after putting the entry back until the next check finds it
//! still there; `npm_cni_chained` is 1 while it holds the entry, and
//! `npm_cni_rechained_total` counts the entries put back. A primary that
//! keeps removing the entry (Cilium with `cni.exclusive=true`, which also
//! renames other CNIs' files) is re-chained each time and keeps the check
//! failing while it removed the entry [`FLAP_LIMIT`] times within
//! [`FLAP_WINDOW`].
//!
//! **Uninstall**: the entry is put back only while npm-cni's binary is in
//! the plugin directory. `npm-agent cleanup` (run once the agents stopped)
//! removes the entries first and the binary last, so an agent that would
//! still run meets either a chained conflist or no binary: it never chains
//! an entry without its binary, nor brings back what cleanup removed.

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use npm_cni::install::{self, Change, Entry, InstallError, InstallOptions, PLUGIN_TYPE};

use crate::telemetry::health::Health;
use crate::telemetry::metrics::Metrics;

/// Name of the readiness check.
pub const CHECK_CNI_CHAINED: &str = "cni-chained";

/// Default time between two checks of the configuration directory.
pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(2);

/// How many re-chains within [`FLAP_WINDOW`] keep the check failing.
pub const FLAP_LIMIT: usize = 3;

/// See [`FLAP_LIMIT`].
pub const FLAP_WINDOW: Duration = Duration::from_secs(300);

/// What the agent keeps chained (`npm-agent run --cni-conf-dir ...`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChainConfig {
    /// The host's CNI configuration directory.
    pub conf_dir: PathBuf,
    /// The host's CNI plugin directory.
    pub bin_dir: PathBuf,
    /// The npm-cni binary copied there when it differs (the image's).
    pub source: PathBuf,
    /// The entry's values (the same as the init container's).
    pub entry: Entry,
    /// Time between two checks.
    pub interval: Duration,
}

/// The state of the checks (one per agent).
pub struct Chain {
    cfg: ChainConfig,
    health: Arc<Health>,
    metrics: Metrics,
    /// When the entry was put back, the last [`FLAP_LIMIT`] times.
    rechained: VecDeque<Instant>,
}

/// What one check found and did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The conflist holds the entry.
    Chained,
    /// The entry was missing from this conflist and was put back.
    Rechained(PathBuf),
    /// Not chained, and not put back (why).
    Unchained(String),
}

impl Chain {
    /// The checks of `cfg`, reporting into `health` and `metrics`.
    pub fn new(cfg: ChainConfig, health: Arc<Health>, metrics: Metrics) -> Chain {
        Chain {
            cfg,
            health,
            metrics,
            rechained: VecDeque::new(),
        }
    }

    /// Checks the directory once, re-chains if needed, and reports.
    pub fn check(&mut self) -> Outcome {
        let outcome = self.chain();
        let now = Instant::now();
        while self
            .rechained
            .front()
            .is_some_and(|t| now.saturating_duration_since(*t) > FLAP_WINDOW)
        {
            self.rechained.pop_front();
        }
        let problem = match &outcome {
            Outcome::Unchained(reason) => Some(reason.clone()),
            // Ready again once the next check finds the entry still there.
            Outcome::Rechained(path) => Some(format!(
                "npm-cni's entry was missing from {} and was put back (the primary CNI rewrote it?): pods \
                 started in between were not held until enforced",
                path.display()
            )),
            _ if self.rechained.len() >= FLAP_LIMIT => Some(format!(
                "npm-cni's entry was removed from the primary CNI's conflist {} times in {}s and put back each \
                 time: the primary CNI keeps rewriting it (Cilium: set cni.exclusive=false)",
                self.rechained.len(),
                FLAP_WINDOW.as_secs()
            )),
            _ => None,
        };
        self.metrics
            .cni_chained
            .set(if matches!(outcome, Outcome::Unchained(_)) {
                0.0
            } else {
                1.0
            });
        self.health.set_problem(CHECK_CNI_CHAINED, problem);
        outcome
    }

    fn chain(&mut self) -> Outcome {
        let path = match install::chained(&self.cfg.conf_dir, &self.cfg.entry) {
            Ok((_, true)) => return Outcome::Chained,
            Ok((path, false)) => path,
            Err(e) => return Outcome::Unchained(unusable(&e)),
        };
        let binary = self.cfg.bin_dir.join(PLUGIN_TYPE);
        if !binary.is_file() {
            return Outcome::Unchained(format!(
                "{} lacks npm-cni's entry and {} is missing (removed by npm-agent cleanup?): not chained again",
                path.display(),
                binary.display()
            ));
        }
        let options = InstallOptions {
            bin_dir: self.cfg.bin_dir.clone(),
            conf_dir: self.cfg.conf_dir.clone(),
            source: Some(self.cfg.source.clone()),
            entry: self.cfg.entry.clone(),
            wait: Duration::ZERO,
        };
        match install::install(&options) {
            Ok(report) if report.conflist_change == Change::Unchanged => Outcome::Chained,
            Ok(report) => {
                self.metrics.cni_rechained.increment(1);
                self.rechained.push_back(Instant::now());
                while self.rechained.len() > FLAP_LIMIT {
                    self.rechained.pop_front();
                }
                tracing::warn!(
                    conflist = %report.conflist.display(),
                    "npm-cni's entry was missing from the primary CNI's conflist (rewritten by the primary CNI?); \
                     chained again: pods started in between were not held until enforced"
                );
                Outcome::Rechained(report.conflist)
            }
            Err(e) => {
                tracing::error!(error = %e, "npm-cni could not be chained again");
                Outcome::Unchained(format!(
                    "{} lacks npm-cni's entry and chaining it failed: {e}",
                    path.display()
                ))
            }
        }
    }
}

fn unusable(e: &InstallError) -> String {
    format!("npm-cni is not chained: {e}")
}

/// Checks every [`ChainConfig::interval`] until the task is aborted (with
/// the agent). The first check runs at once.
pub async fn keep_chained(mut chain: Chain) {
    let mut ticks = tokio::time::interval(chain.cfg.interval);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last = None;
    loop {
        ticks.tick().await;
        let outcome = chain.check();
        if let Outcome::Unchained(reason) = &outcome {
            if last.as_ref() != Some(&outcome) {
                tracing::warn!(%reason, "npm-cni is not chained: new pods are not held until enforced");
            }
        }
        last = Some(outcome);
    }
}
