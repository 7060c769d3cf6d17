//! Rate-limited deny flow logs from the datapath's ring buffer.
//!
//! At most `per_sec` deny events are logged per one-second window; the rest
//! are counted, and the count is logged when the window closes.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::time::{Duration, Instant};

use npm_common::{DenyEvent, Reason};

/// The rate limiter and formatter of deny flow logs.
#[derive(Debug)]
pub struct FlowLog {
    per_sec: u32,
    window: Option<Instant>,
    logged: u32,
    suppressed: u64,
}

/// Whether one event may be logged.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Admit {
    /// Log it.
    Log,
    /// Over the rate: count it.
    Suppress,
}

fn addr(family: u8, bytes: [u8; 16]) -> IpAddr {
    if family == 4 {
        IpAddr::V4(Ipv4Addr::new(bytes[12], bytes[13], bytes[14], bytes[15]))
    } else {
        IpAddr::V6(Ipv6Addr::from(bytes))
    }
}

/// One line describing a deny event.
pub fn describe(e: &DenyEvent) -> String {
    let reason = Reason::from_u8(e.reason).map(Reason::name).unwrap_or("unknown");
    let dir = if e.direction == npm_common::DIR_INGRESS {
        "ingress"
    } else {
        "egress"
    };
    format!(
        "deny endpoint={} ifindex={} dir={dir} reason={reason} proto={} {}:{} -> {}:{}",
        e.endpoint,
        e.ifindex,
        e.protocol,
        addr(e.family, e.src),
        e.sport,
        addr(e.family, e.dst),
        e.dport
    )
}

impl FlowLog {
    /// A limiter allowing `per_sec` lines per second.
    pub fn new(per_sec: u32) -> Self {
        FlowLog {
            per_sec,
            window: None,
            logged: 0,
            suppressed: 0,
        }
    }

    /// Decide for one event at `now`. When a window closes with suppressed
    /// events, their count is logged.
    pub fn admit(&mut self, now: Instant) -> Admit {
        let fresh = match self.window {
            None => true,
            Some(start) => now.saturating_duration_since(start) >= Duration::from_secs(1),
        };
        if fresh {
            if self.suppressed > 0 {
                tracing::warn!(
                    suppressed = self.suppressed,
                    "deny flow logs suppressed by the rate limit"
                );
            }
            self.window = Some(now);
            self.logged = 0;
            self.suppressed = 0;
        }
        if self.logged < self.per_sec {
            self.logged += 1;
            Admit::Log
        } else {
            self.suppressed += 1;
            Admit::Suppress
        }
    }

    /// Log what the rate allows of `events`; returns how many were suppressed.
    pub fn log_all(&mut self, events: &[DenyEvent], now: Instant) -> u64 {
        let mut suppressed = 0;
        for e in events {
            match self.admit(now) {
                Admit::Log => tracing::info!(target: "npm::flow", "{}", describe(e)),
                Admit::Suppress => suppressed += 1,
            }
        }
        suppressed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_per_second_window() {
        let mut f = FlowLog::new(3);
        let t0 = Instant::now();
        let events = vec![DenyEvent::default(); 5];
        assert_eq!(f.log_all(&events, t0), 2);
        assert_eq!(f.admit(t0 + Duration::from_millis(999)), Admit::Suppress);
        assert_eq!(f.admit(t0 + Duration::from_secs(1)), Admit::Log);
    }

    #[test]
    fn describes_v4_event() {
        let mut e = DenyEvent {
            endpoint: 7,
            ifindex: 9,
            direction: npm_common::DIR_EGRESS,
            reason: Reason::PolicyDenied as u8,
            protocol: 6,
            family: 4,
            sport: 1234,
            dport: 80,
            ..Default::default()
        };
        e.src = npm_common::IpKey::v4([10, 0, 0, 1]).addr;
        e.dst = npm_common::IpKey::v4([10, 0, 0, 2]).addr;
        assert_eq!(
            describe(&e),
            "deny endpoint=7 ifindex=9 dir=egress reason=policy-denied proto=6 10.0.0.1:1234 -> 10.0.0.2:80"
        );
    }
}
