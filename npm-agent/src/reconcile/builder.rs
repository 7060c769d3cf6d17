//! Building a [`Syncer`]: its settings, the handles it shares with the
//! rest of the agent (facts, learned names, health, events, the explain
//! view, the flow stream) and its starting state.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Instant;

use super::compiler;
use super::config::{SyncConfig, DIRECT_READ_MIN_BACKOFF};
use super::dataplane::AgentDataplane;
use super::guard::GuardReference;
use super::syncer::Syncer;
use crate::cni::FactsHandle;
use crate::dns::NamesHandle;
use crate::k8s::{Cache, CompleteState};
use crate::node::{InterfaceResolver, Resolve};
use crate::telemetry::events::EventRecorder;
use crate::telemetry::flowlog::FlowLog;
use crate::telemetry::health::Health;

/// Builds a [`Syncer`] ([`Syncer::builder`]). The settings default to
/// [`SyncConfig::default`], the resolver to an [`InterfaceResolver`]
/// without a pattern; without a client, mass deletions stay held (no direct
/// read can confirm them).
pub struct SyncerBuilder<D: AgentDataplane> {
    cfg: SyncConfig,
    cache: Arc<Cache>,
    dataplane: D,
    resolver: Option<Box<dyn Resolve>>,
    client: Option<kube::Client>,
    health: Option<Arc<Health>>,
    node_facts: FactsHandle,
    dns_names: NamesHandle,
    events: Option<EventRecorder>,
    programmed_view: crate::explain::ProgrammedView,
    observe: Option<crate::telemetry::ObserveHub>,
    expect_cni_adds: bool,
    pod_conditions: Option<crate::k8s::pod_conditions::PodConditions>,
}

impl<D: AgentDataplane> SyncerBuilder<D> {
    /// Where each successful sync publishes the state it programmed
    /// (default: a slot nobody reads).
    pub fn programmed_view(mut self, view: crate::explain::ProgrammedView) -> Self {
        self.programmed_view = view;
        self
    }

    /// Where the flow-log records go besides stdout (`/observe`; default:
    /// stdout only).
    pub fn observe(mut self, hub: crate::telemetry::ObserveHub) -> Self {
        self.observe = Some(hub);
        self
    }

    /// The loop's settings.
    pub fn config(mut self, cfg: SyncConfig) -> Self {
        self.cfg = cfg;
        self
    }

    /// How the endpoints' interfaces are found.
    pub fn resolver(mut self, resolver: Box<dyn Resolve>) -> Self {
        self.resolver = Some(resolver);
        self
    }

    /// The client of the mass-deletion guard's direct reads.
    pub fn client(mut self, client: kube::Client) -> Self {
        self.client = Some(client);
        self
    }

    /// The health state the loop writes (default: a fresh [`Health`] with
    /// the default settings, publishing into the cache's metrics).
    pub fn health(mut self, health: Arc<Health>) -> Self {
        self.health = Some(health);
        self
    }

    /// This node's CNI facts (default: none), overlaid on the pods the
    /// loop compiles; every successful sync publishes what it programmed
    /// for them.
    pub fn node_facts(mut self, facts: FactsHandle) -> Self {
        self.node_facts = facts;
        self
    }

    /// The names learned from DNS answers (default: none), compiled as
    /// what `domainNames` peers match; every successful sync publishes the
    /// version it programmed, and the patterns it compiled.
    pub fn dns_names(mut self, names: NamesHandle) -> Self {
        self.dns_names = names;
        self
    }

    /// Where the Kubernetes Events on policies that are not fully
    /// understood go (default: none, they are logged and counted only).
    pub fn events(mut self, events: EventRecorder) -> Self {
        self.events = Some(events);
        self
    }

    /// Whether npm-cni is expected to be chained (default: no): a local
    /// endpoint that appears after the first sync with no CNI ADD is then
    /// logged as suspect and counted
    /// (`npm_cni_endpoints_without_add_total`).
    pub fn expect_cni_adds(mut self, expect: bool) -> Self {
        self.expect_cni_adds = expect;
        self
    }

    /// Where each sync attempt's decision of the local pods'
    /// `npm.io/PolicyEnforced` conditions goes (default: none, no
    /// condition is written).
    pub fn pod_conditions(mut self, writer: crate::k8s::pod_conditions::PodConditions) -> Self {
        self.pod_conditions = Some(writer);
        self
    }

    /// The sync loop, with nothing compiled or programmed yet.
    pub fn build(self) -> Syncer<D> {
        let SyncerBuilder {
            cfg,
            cache,
            dataplane,
            resolver,
            client,
            health,
            node_facts,
            dns_names,
            events,
            programmed_view,
            observe,
            expect_cni_adds,
            pod_conditions,
        } = self;
        let resolver = resolver.unwrap_or_else(|| Box::new(InterfaceResolver::new(None)));
        let metrics = cache.metrics().clone();
        if let Some(reduced) = dataplane.reduced_datapath() {
            metrics.datapath_reduced(reduced);
        }
        if let Some(mode) = dataplane.attach_mode() {
            metrics.attach_mode(mode);
        }
        let readiness = health.unwrap_or_else(|| Arc::new(Health::default().with_metrics(metrics.clone())));
        let flowlog = match &observe {
            Some(hub) => FlowLog::with_writer(cfg.flow_logs_per_sec, hub.tee(Box::new(std::io::stdout()))),
            None => FlowLog::new(cfg.flow_logs_per_sec),
        }
        .log_allows(cfg.flow_logs_allow);
        Syncer {
            cache,
            metrics,
            dataplane,
            resolver,
            facts: node_facts.current(),
            node_facts,
            names: dns_names.current(),
            dns_names,
            node_generation: 0,
            client,
            readiness,
            // Replaced by the first sync's rebuild (`programmed` is `None`).
            incremental: compiler::Incremental::new(&CompleteState::default(), &Arc::default(), &cfg.compile, None),
            last_cross_check: Instant::now(),
            cross_check: None,
            rebuild_pending: false,
            trimmed_lists: 0,
            programmed: None,
            guard: GuardReference::default(),
            guard_seeded: false,
            adopted: None,
            adopted_numbers: None,
            need_full: true,
            attempted_ids: None,
            next_direct_read_at: None,
            direct_read_backoff: DIRECT_READ_MIN_BACKOFF,
            known_invalid: BTreeSet::new(),
            known_invalid_cluster: BTreeMap::new(),
            events,
            known_conflicts: BTreeSet::new(),
            flowlog,
            audit: crate::telemetry::audit::Audit::with_rate(cfg.flow_logs_per_sec),
            established: super::established::EstablishedModes::new(cfg.established),
            degraded: Vec::new(),
            programmed_view,
            expect_cni_adds,
            local_endpoints: None,
            deletion_clock: super::expiry::DeletionClock::new(cfg.deleting_claim_slack),
            pod_conditions,
            bridge_nf: cfg
                .bridge_netfilter
                .as_ref()
                .map(|c| crate::node::bridge_nf::BridgeNfCheck::new(c.netns.clone())),
            cfg,
        }
    }
}

impl<D: AgentDataplane> Syncer<D> {
    /// A sync loop over `dataplane`, reading the complete stores of `cache`
    /// and counting into the cache's metrics registry (see
    /// [`SyncerBuilder`] for the rest).
    pub fn builder(cache: Arc<Cache>, dataplane: D) -> SyncerBuilder<D> {
        SyncerBuilder {
            cfg: SyncConfig::default(),
            cache,
            dataplane,
            resolver: None,
            client: None,
            health: None,
            node_facts: FactsHandle::default(),
            dns_names: NamesHandle::default(),
            events: None,
            programmed_view: Default::default(),
            observe: None,
            expect_cni_adds: false,
            pod_conditions: None,
        }
    }
}
