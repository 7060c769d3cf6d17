//! Fault injection: the rules that fail or delay the next matching requests (set through
//! [`crate::TestApiServer::inject`] or `POST /admin/fail|delay`) and how a request takes one.

use super::state::lock;
use super::AppState;
use std::sync::MutexGuard;
use std::time::Duration;

/// What a fault rule does to a matching request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultAction {
    /// Answer this HTTP status (with a Status body) instead of serving the request.
    Fail(u16),
    /// Wait this long before serving the request.
    Delay(Duration),
}

/// A fault applied to the next `count` requests that match.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FaultRule {
    /// How many more requests this rule applies to.
    pub count: u32,
    /// What to do.
    pub action: FaultAction,
    /// Only requests whose path starts with this prefix.
    pub path_prefix: Option<String>,
    /// Only requests of this verb (`get`, `list`, `watch`, `create`, `update`, `patch`,
    /// `delete`, `deletecollection`, `discovery`).
    pub verb: Option<String>,
}

impl FaultRule {
    /// Fail the next `count` requests with HTTP `status`.
    pub fn fail(count: u32, status: u16) -> Self {
        Self {
            count,
            action: FaultAction::Fail(status),
            path_prefix: None,
            verb: None,
        }
    }
    /// Delay the next `count` requests by `delay`.
    pub fn delay(count: u32, delay: Duration) -> Self {
        Self {
            count,
            action: FaultAction::Delay(delay),
            path_prefix: None,
            verb: None,
        }
    }
    /// Restrict to paths starting with `prefix`.
    pub fn path(mut self, prefix: &str) -> Self {
        self.path_prefix = Some(prefix.to_string());
        self
    }
    /// Restrict to one verb (e.g. `list`).
    pub fn verb(mut self, verb: &str) -> Self {
        self.verb = Some(verb.to_string());
        self
    }
    /// Whether the rule still applies and matches this request.
    fn matches(&self, path: &str, verb: &str) -> bool {
        self.count > 0
            && self.path_prefix.as_deref().is_none_or(|p| path.starts_with(p))
            && self.verb.as_deref().is_none_or(|v| v == verb)
    }
}

impl AppState {
    /// Lock the pending fault rules.
    fn faults(&self) -> MutexGuard<'_, Vec<FaultRule>> {
        lock(&self.faults)
    }

    /// Add a fault rule.
    pub fn add_fault(&self, rule: FaultRule) {
        self.faults().push(rule);
    }

    /// Remove all fault rules.
    pub fn clear_faults(&self) {
        self.faults().clear();
    }

    /// Take the first matching fault for this request (decrementing its count).
    pub(super) fn take_fault(&self, path: &str, verb: &str, delay: bool) -> Option<FaultAction> {
        let mut f = self.faults();
        let idx = f
            .iter()
            .position(|r| r.matches(path, verb) && matches!(r.action, FaultAction::Delay(_)) == delay)?;
        f[idx].count -= 1;
        let action = f[idx].action;
        if f[idx].count == 0 {
            f.remove(idx);
        }
        Some(action)
    }
}
