//! The agents' health as the soak sees it: each agent's `/readyz` and its
//! `npm_held_removals`, polled once a tick. An agent that is not ready, has
//! a removal held, or is down is a disturbance for the oracle (the last
//! good state may be kept), and the time from a fault's end to the first
//! poll with every agent settled is the settle time.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

/// One agent's health at a poll.
#[derive(Clone, Debug, PartialEq)]
pub struct Health {
    /// `/readyz` answered 200.
    pub ready: bool,
    /// `npm_held_removals` (0 when unreadable).
    pub held: u64,
    /// The fullest kernel map (eBPF): its name and entries / capacity.
    pub map_fill: Option<(String, f64)>,
}

impl Health {
    /// Ready with nothing held.
    pub fn settled(&self) -> bool {
        self.ready && self.held == 0
    }
}

/// `GET path` on `addr`: (status, body); `None` when the agent does not
/// answer within a second.
fn get(addr: SocketAddr, path: &str) -> Option<(u16, String)> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(1)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    let req = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    s.write_all(req.as_bytes()).ok()?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).ok()?;
    let text = String::from_utf8_lossy(&raw).to_string();
    let status = text.split_whitespace().nth(1)?.parse().ok()?;
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    Some((status, body))
}

/// The value of the first sample of `family` in a Prometheus text body.
pub fn metric_value(body: &str, family: &str) -> Option<f64> {
    body.lines()
        .filter(|l| !l.starts_with('#'))
        .find(|l| {
            l.strip_prefix(family)
                .is_some_and(|rest| rest.starts_with(' ') || rest.starts_with('{'))
        })
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

/// The samples of `family{map="NAME"}` in a Prometheus text body, by map.
fn map_samples(body: &str, family: &str) -> std::collections::BTreeMap<String, f64> {
    body.lines()
        .filter_map(|l| l.strip_prefix(family)?.strip_prefix("{map=\""))
        .filter_map(|rest| {
            let (name, rest) = rest.split_once("\"}")?;
            Some((name.to_string(), rest.trim().parse().ok()?))
        })
        .collect()
}

/// The fullest map of `npm_map_entries` / `npm_map_capacity` (eBPF agents
/// export them; `None` on nftables).
pub fn fullest_map(body: &str) -> Option<(String, f64)> {
    let capacity = map_samples(body, "npm_map_capacity");
    map_samples(body, "npm_map_entries")
        .into_iter()
        .filter_map(|(name, n)| {
            let cap = *capacity.get(&name)?;
            (cap > 0.0).then(|| (name, n / cap))
        })
        .max_by(|a, b| a.1.total_cmp(&b.1))
}

/// Polls one agent (`None`: it does not answer).
pub fn poll(metrics: SocketAddr) -> Option<Health> {
    let (status, _) = get(metrics, "/readyz")?;
    let body = get(metrics, "/metrics").map(|(_, b)| b).unwrap_or_default();
    let held = metric_value(&body, "npm_held_removals").unwrap_or(0.0);
    Some(Health {
        ready: status == 200,
        held: held as u64,
        map_fill: fullest_map(&body),
    })
}

/// Percentile `p` (0..=100) of `v` (nearest rank; 0 when empty).
pub fn percentile(v: &[f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let rank = ((p / 100.0) * s.len() as f64).ceil().max(1.0) as usize;
    s[rank.min(s.len()) - 1]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_a_metric_and_percentiles() {
        let body = "# HELP npm_held_removals x\nnpm_held_removals_total 9\nnpm_held_removals 2\n";
        assert_eq!(metric_value(body, "npm_held_removals"), Some(2.0));
        assert_eq!(metric_value(body, "npm_nothing"), None);
        assert_eq!(percentile(&[3.0, 1.0, 2.0, 4.0], 50.0), 2.0);
        assert_eq!(percentile(&[3.0, 1.0, 2.0, 4.0], 99.0), 4.0);
        assert_eq!(percentile(&[], 50.0), 0.0);
    }

    #[test]
    fn finds_the_fullest_map() {
        let body = "npm_map_entries{map=\"NPM_CT\"} 512\nnpm_map_capacity{map=\"NPM_CT\"} 1024\n\
                    npm_map_entries{map=\"NPM_POLICY\"} 3\nnpm_map_capacity{map=\"NPM_POLICY\"} 4\n\
                    npm_map_entries{map=\"NPM_ORPHAN\"} 9\n";
        assert_eq!(fullest_map(body), Some(("NPM_POLICY".to_string(), 0.75)));
        assert_eq!(fullest_map("npm_held_removals 0\n"), None);
    }
}
