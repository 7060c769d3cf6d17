//! The `npm-agent explain` command: asks an agent's `/explain` over plain
//! HTTP/1.1 (the debug listener) and prints the report, the mismatch
//! first. The requests work over any stream ([`get_on`], [`fetch_on`]):
//! `kubectl npm` sends them through the API server's `pods/portforward`.

use std::io::{BufReader, Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use super::observe_client::{read_head, Body};
use super::{DirectionReport, ExplainQuery, ExplainReport};

/// Errors of the explain client.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The agent URL is not `http://HOST:PORT`.
    #[error("--agent {0:?}: want http://HOST:PORT")]
    Url(String),
    /// Connecting, sending or reading failed.
    #[error("explain: talking to {addr}: {source}")]
    Io {
        /// The agent's address.
        addr: String,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// The agent answered with an error.
    #[error("explain: the agent at {addr} answered {status}: {body}")]
    Status {
        /// The agent's address.
        addr: String,
        /// The status line.
        status: String,
        /// The body.
        body: String,
    },
    /// The body is not a report.
    #[error("explain: the agent at {addr} sent an unreadable report: {source}")]
    Decode {
        /// The agent's address.
        addr: String,
        /// The error.
        #[source]
        source: serde_json::Error,
    },
}

/// Percent-encodes a query value.
pub fn encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// The `HOST:PORT` of an `--agent` URL (`http://HOST:PORT`).
pub(crate) fn agent_addr(agent: &str) -> Result<String, ClientError> {
    agent
        .strip_prefix("http://")
        .map(|a| a.trim_end_matches('/'))
        .filter(|a| !a.is_empty() && !a.contains('/'))
        .map(String::from)
        .ok_or_else(|| ClientError::Url(agent.into()))
}

/// An agent's answer to one `GET`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Answer {
    /// The status code (0 when the status line is unreadable).
    pub code: u16,
    /// The status line.
    pub status: String,
    /// The body (a chunked one decoded).
    pub body: String,
}

/// Sends `GET path` over `stream`, any connection to an agent's listener (a
/// TCP connection, or a stream port-forwarded through the API server as
/// `kubectl npm` opens it), and reads the answer to its end (`Connection:
/// close`). `addr` names the agent in errors and the `Host` header.
pub fn get_on<S: Read + Write>(mut stream: S, addr: &str, path: &str) -> Result<Answer, ClientError> {
    let io = |source| ClientError::Io {
        addr: addr.to_string(),
        source,
    };
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .map_err(io)?;
    stream.flush().map_err(io)?;
    let mut r = BufReader::new(stream);
    let (status, chunked) = read_head(&mut r).map_err(io)?;
    let mut raw = Vec::new();
    Body::new(r, chunked).read_to_end(&mut raw).map_err(io)?;
    let code = status
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    Ok(Answer {
        code,
        status,
        body: String::from_utf8_lossy(&raw).into_owned(),
    })
}

/// Asks the agent at `agent` (`http://HOST:PORT`) to explain `q`; returns
/// the report and its raw JSON.
pub fn fetch(agent: &str, q: &ExplainQuery) -> Result<(ExplainReport, String), ClientError> {
    let addr = agent_addr(agent)?;
    let io = |source| ClientError::Io {
        addr: addr.clone(),
        source,
    };
    let s = TcpStream::connect(&addr).map_err(io)?;
    s.set_read_timeout(Some(Duration::from_secs(30))).map_err(io)?;
    fetch_on(s, &addr, q)
}

/// Asks the agent at the other end of `stream` to explain `q` (see
/// [`get_on`]); returns the report and its raw JSON.
pub fn fetch_on<S: Read + Write>(
    stream: S,
    addr: &str,
    q: &ExplainQuery,
) -> Result<(ExplainReport, String), ClientError> {
    let a = get_on(stream, addr, &q.path())?;
    if a.code != 200 {
        return Err(ClientError::Status {
            addr: addr.into(),
            status: a.status,
            body: a.body.trim().into(),
        });
    }
    let report = serde_json::from_str(&a.body).map_err(|source| ClientError::Decode {
        addr: addr.into(),
        source,
    })?;
    Ok((report, a.body))
}

fn direction_lines(d: &DirectionReport) -> String {
    let mut s = format!("  {}\n", d.text);
    if !d.local {
        return s;
    }
    if let (Some(ep), Some(subject)) = (d.endpoint, d.subject) {
        s.push_str(&format!("    endpoint {ep}, subject {subject}\n"));
    }
    let named: Vec<String> = d
        .policies
        .iter()
        .map(|p| {
            let who = match (&p.namespace, p.priority) {
                (Some(ns), _) => format!("{}/{}", ns, p.name),
                (None, Some(prio)) => format!("{} {} (priority {prio})", p.tier.as_deref().unwrap_or("?"), p.name),
                (None, None) => format!("{} {}", p.tier.as_deref().unwrap_or("?"), p.name),
            };
            let rule = match (&p.rule, &p.rule_name) {
                (Some(r), Some(n)) => format!(" {r} {n:?}"),
                (Some(r), None) => format!(" {r}"),
                _ => String::new(),
            };
            format!("{} {who}{rule} ({})", p.kind, p.effect)
        })
        .collect();
    s.push_str(&format!(
        "    agent: {} ({}){}\n",
        d.verdict,
        d.reason.as_deref().unwrap_or("?"),
        if named.is_empty() {
            String::new()
        } else {
            format!(": {}", named.join(", "))
        }
    ));
    match (&d.kernel, &d.kernel_error) {
        (Some(k), _) => s.push_str(&format!(
            "    kernel: {} ({}) by program {} on ifindex {}, dry run\n",
            k.verdict, k.reason, k.program_id, k.ifindex
        )),
        (None, Some(e)) => s.push_str(&format!("    kernel: unknown: {e}\n")),
        (None, None) => s.push_str("    kernel: null (nftables: no dry run)\n"),
    }
    s
}

/// The text form: the mismatch first, then the verdict and each direction.
pub fn render(r: &ExplainReport) -> String {
    let mut s = String::new();
    if let Some(m) = &r.mismatch {
        s.push_str(&format!("{m}\n"));
    }
    let end = |i: usize, ip: &std::net::IpAddr| match r.directions.get(i).and_then(|d| d.pod.as_deref()) {
        Some(pod) => format!("{pod} ({ip})"),
        None => ip.to_string(),
    };
    s.push_str(&format!(
        "{} {} -> {} {} {}\n",
        if r.verdict == "allow" { "ALLOWED" } else { "DENIED" },
        end(0, &r.from),
        end(1, &r.to),
        r.protocol,
        r.port
    ));
    for d in &r.directions {
        s.push_str(&direction_lines(d));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_and_encoding() {
        assert!(matches!(
            fetch("localhost:1", &ExplainQuery::default()),
            Err(ClientError::Url(_))
        ));
        assert!(matches!(
            fetch("http://", &ExplainQuery::default()),
            Err(ClientError::Url(_))
        ));
        assert_eq!(encode("x/a b"), "x%2Fa%20b");
        assert_eq!(encode("fd00::1"), "fd00%3A%3A1");
    }

    /// A local direction names its endpoint and the subject whose policy
    /// entries govern it; a remote one names neither.
    #[test]
    fn a_local_direction_names_its_endpoint_and_subject() {
        let dir = |direction: &str, local: bool| DirectionReport {
            direction: direction.into(),
            pod: Some("y/b".into()),
            local,
            endpoint: local.then_some(7),
            subject: local.then_some(300),
            node: Some("node-a".into()),
            verdict: "allow".into(),
            reason: Some("Policy".into()),
            text: format!("{direction} of y/b: allowed"),
            policies: Vec::new(),
            kernel: None,
            kernel_error: None,
            mismatch: None,
        };
        let ends = ("10.0.0.1".parse().unwrap(), "10.0.0.2".parse().unwrap());
        let report =
            ExplainReport::of_directions(ends, "TCP".into(), 80, vec![dir("egress", false), dir("ingress", true)]);
        let text = render(&report);
        assert_eq!(text.matches("    endpoint 7, subject 300\n").count(), 1, "{text}");
        let ingress = text.split_once("ingress of y/b").expect("the ingress lines").1;
        assert!(ingress.contains("endpoint 7, subject 300"), "{text}");
        // The JSON carries both, and an older agent's report (without them) still reads.
        let json = serde_json::to_value(&report).unwrap();
        assert_eq!(json["directions"][1]["subject"], 300);
        assert!(json["directions"][0].get("subject").is_none());
        let mut old = json.clone();
        old["directions"][1].as_object_mut().unwrap().remove("subject");
        old["directions"][1].as_object_mut().unwrap().remove("endpoint");
        let back: ExplainReport = serde_json::from_value(old).unwrap();
        assert_eq!((back.directions[1].endpoint, back.directions[1].subject), (None, None));
    }
}
