//! The object store: objects as JSON, one global revision counter, an event log since the
//! last compaction (for watches and consistent paginated lists), defaulting and validation.
//!
//! This module owns the [`Store`] itself, its revision counter and event log (commit,
//! compaction, the events a watch reads, 410 for compacted revisions) and point reads.
//! Writes live in `write`, lists and continue tokens in `list`, the kinds in `kind` and
//! metadata helpers in `meta`, Service ClusterIP/NodePort allocation in `alloc`, installed
//! CRDs and custom resources in `crd`.

mod alloc;
mod crd;
mod kind;
mod list;
mod meta;
mod write;

pub use alloc::ServiceNetwork;
pub use crd::FieldValidation;
pub use kind::Kind;
pub use list::{ListOpts, ListPage, CONTINUE_EXPIRED};
pub use write::Sub;

pub(crate) use meta::parse_rv;

use crate::error::ApiError;
use meta::set_rv;
use serde_json::Value;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;

/// Watch event types.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventType {
    /// Object created.
    Added,
    /// Object changed.
    Modified,
    /// Object removed.
    Deleted,
}

impl EventType {
    /// The wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            EventType::Added => "ADDED",
            EventType::Modified => "MODIFIED",
            EventType::Deleted => "DELETED",
        }
    }
}

/// One entry of the event log.
#[derive(Debug, Clone)]
pub struct Event {
    /// Revision this change produced.
    pub rev: u64,
    /// Kind of the object.
    pub kind: Kind,
    /// Store key (`ns/name` or `name`).
    pub key: String,
    /// Event type.
    pub ty: EventType,
    /// Object after the change (for deletions: the last state, with the deletion revision).
    pub obj: Arc<Value>,
    /// Object before the change (None for creations).
    pub prev: Option<Arc<Value>>,
}

/// The object store.
#[derive(Debug)]
pub struct Store {
    rev: u64,
    compacted: u64,
    objects: [BTreeMap<String, Arc<Value>>; Kind::ALL.len()],
    ns_counts: [HashMap<String, usize>; Kind::ALL.len()],
    history: VecDeque<Event>,
    max_history: usize,
    /// Whether validation runs on writes.
    pub validation: bool,
    /// What Service ClusterIPs and NodePorts are allocated from.
    pub service_network: ServiceNetwork,
    /// The installed ClusterNetworkPolicy CRD (None: clusternetworkpolicies are not served).
    cnp_crd: Option<Arc<crate::crd::InstalledCrd>>,
    /// How the write being served treats unknown (pruned) fields of a custom resource: set
    /// by the HTTP layer around one write, under the same lock.
    pub field_validation: FieldValidation,
    /// Paths of the fields pruned by the last custom-resource write (for `Warning` headers).
    pub pruned_fields: Vec<String>,
    notify: tokio::sync::watch::Sender<u64>,
}

/// Key of an object in its kind's map.
pub fn key_of(ns: Option<&str>, name: &str) -> String {
    match ns {
        Some(ns) => format!("{ns}/{name}"),
        None => name.to_string(),
    }
}

/// Key prefix of the objects of `kind` in namespace `ns` (empty: all objects of the kind).
fn ns_prefix(kind: Kind, ns: Option<&str>) -> String {
    match (ns, kind.namespaced()) {
        (Some(ns), true) => format!("{ns}/"),
        _ => String::new(),
    }
}

impl Store {
    /// An empty store. `max_history` bounds the event log: older events are compacted away.
    pub fn new(validation: bool, max_history: usize) -> Self {
        let (notify, _) = tokio::sync::watch::channel(1);
        Self {
            rev: 1,
            compacted: 1,
            objects: Default::default(),
            ns_counts: Default::default(),
            history: VecDeque::new(),
            max_history: max_history.max(1),
            validation,
            service_network: ServiceNetwork::default(),
            cnp_crd: None,
            field_validation: FieldValidation::default(),
            pruned_fields: Vec::new(),
            notify,
        }
    }

    /// Current (latest) revision.
    pub fn rev(&self) -> u64 {
        self.rev
    }

    /// Revision at and above which history is still available.
    pub fn compacted(&self) -> u64 {
        self.compacted
    }

    /// Subscribe to revision changes (the value is the latest revision).
    pub fn subscribe(&self) -> tokio::sync::watch::Receiver<u64> {
        self.notify.subscribe()
    }

    /// Number of objects of a kind.
    pub fn count(&self, kind: Kind) -> usize {
        self.objects[kind.idx()].len()
    }

    /// Drop the event log up to `upto` (default: the current revision).
    /// Returns the new compaction revision.
    pub fn compact(&mut self, upto: Option<u64>) -> u64 {
        let upto = upto.unwrap_or(self.rev).min(self.rev).max(self.compacted);
        while self.history.front().is_some_and(|e| e.rev <= upto) {
            self.history.pop_front();
        }
        self.compacted = upto;
        upto
    }

    fn not_found(kind: Kind, name: &str) -> ApiError {
        ApiError::NotFound {
            resource: kind.resource_ref(),
            group: kind.group().into(),
            name: name.into(),
        }
    }

    fn commit(
        &mut self,
        kind: Kind,
        key: String,
        ty: EventType,
        mut obj: Value,
        prev: Option<Arc<Value>>,
    ) -> Arc<Value> {
        self.rev += 1;
        set_rv(&mut obj, self.rev);
        let obj = Arc::new(obj);
        let ns = key.split_once('/').map(|(ns, _)| ns.to_string());
        match ty {
            EventType::Deleted => {
                if self.objects[kind.idx()].remove(&key).is_some() {
                    if let Some(c) = ns.and_then(|ns| self.ns_counts[kind.idx()].get_mut(&ns)) {
                        *c = c.saturating_sub(1);
                    }
                }
            }
            _ => {
                if self.objects[kind.idx()].insert(key.clone(), obj.clone()).is_none() {
                    if let Some(ns) = ns {
                        *self.ns_counts[kind.idx()].entry(ns).or_default() += 1;
                    }
                }
            }
        }
        self.history.push_back(Event {
            rev: self.rev,
            kind,
            key,
            ty,
            obj: obj.clone(),
            prev,
        });
        if self.history.len() > self.max_history {
            if let Some(e) = self.history.pop_front() {
                self.compacted = e.rev;
            }
        }
        self.notify.send_replace(self.rev);
        obj
    }

    /// 410 Expired when revision `rv` is older than the compaction point.
    fn check_not_compacted(&self, rv: u64) -> Result<(), ApiError> {
        if rv < self.compacted {
            return Err(ApiError::Expired {
                message: format!("too old resource version: {rv} ({})", self.compacted),
            });
        }
        Ok(())
    }

    /// Get one object.
    pub fn get(&self, kind: Kind, ns: Option<&str>, name: &str) -> Result<Arc<Value>, ApiError> {
        self.objects[kind.idx()]
            .get(&key_of(ns, name))
            .cloned()
            .ok_or_else(|| Self::not_found(kind, name))
    }

    /// Events of `kind` after revision `from`, or 410 Expired when `from` is compacted.
    pub fn events_after(&self, kind: Kind, from: u64) -> Result<Vec<Event>, ApiError> {
        self.check_not_compacted(from)?;
        let start = self.history.partition_point(|e| e.rev <= from);
        Ok(self
            .history
            .range(start..)
            .filter(|e| e.kind == kind)
            .cloned()
            .collect())
    }

    /// Current objects of a kind, optionally restricted to a namespace.
    pub fn current(&self, kind: Kind, ns: Option<&str>) -> Vec<Arc<Value>> {
        let prefix = ns_prefix(kind, ns);
        self.objects[kind.idx()]
            .range(prefix.clone()..)
            .take_while(|(k, _)| k.starts_with(&prefix))
            .map(|(_, v)| v.clone())
            .collect()
    }
}
