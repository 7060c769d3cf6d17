//! A tiny blocking REST client for the test API server: just what the runner
//! needs to publish namespaces, pods and NetworkPolicies (plain HTTP/1.1,
//! JSON bodies, one connection per request).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use serde_json::{json, Value};

/// Errors of the REST client.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// Connecting, writing or reading failed.
    #[error("{method} {path}: {source}")]
    Io {
        /// HTTP method.
        method: String,
        /// Request path.
        path: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The server answered with an error status.
    #[error("{method} {path}: HTTP {status}: {body}")]
    Status {
        /// HTTP method.
        method: String,
        /// Request path.
        path: String,
        /// Status code.
        status: u16,
        /// Response body (a Kubernetes Status, usually).
        body: String,
    },
    /// The response could not be parsed.
    #[error("{method} {path}: bad response: {detail}")]
    BadResponse {
        /// HTTP method.
        method: String,
        /// Request path.
        path: String,
        /// What was wrong.
        detail: String,
    },
}

/// A client for one API server address.
#[derive(Clone, Debug)]
pub struct Api {
    addr: SocketAddr,
}

/// The REST path of a namespace.
pub fn namespace_path(name: &str) -> String {
    format!("/api/v1/namespaces/{name}")
}

/// The REST path of a pod.
pub fn pod_path(ns: &str, name: &str) -> String {
    format!("/api/v1/namespaces/{ns}/pods/{name}")
}

/// The REST path of a NetworkPolicy.
pub fn policy_path(ns: &str, name: &str) -> String {
    format!("/apis/networking.k8s.io/v1/namespaces/{ns}/networkpolicies/{name}")
}

impl Api {
    /// A client for the server at `addr`.
    pub fn new(addr: SocketAddr) -> Self {
        Api { addr }
    }

    /// Sends one request; returns the status and the parsed JSON body (Null
    /// when empty, a string when it is not JSON).
    pub fn request_raw(
        &self,
        method: &str,
        path: &str,
        content_type: &str,
        body: Option<&Value>,
    ) -> Result<(u16, Value), ApiError> {
        let io = |source| ApiError::Io {
            method: method.into(),
            path: path.into(),
            source,
        };
        let mut s = TcpStream::connect_timeout(&self.addr, Duration::from_secs(5)).map_err(io)?;
        s.set_read_timeout(Some(Duration::from_secs(30))).map_err(io)?;
        let body = body.map(|b| b.to_string()).unwrap_or_default();
        let req = format!(
            "{method} {path} HTTP/1.1\r\nHost: {}\r\nAccept: application/json\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            self.addr,
            body.len()
        );
        s.write_all(req.as_bytes()).map_err(io)?;
        let mut raw = Vec::new();
        s.read_to_end(&mut raw).map_err(io)?;
        let bad = |detail: String| ApiError::BadResponse {
            method: method.into(),
            path: path.into(),
            detail,
        };
        let split = raw
            .windows(4)
            .position(|w| w == b"\r\n\r\n")
            .ok_or_else(|| bad("no header end".into()))?;
        let head = String::from_utf8_lossy(&raw[..split]).to_string();
        let mut payload = raw[split + 4..].to_vec();
        let status: u16 = head
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| bad(format!("status line {:?}", head.lines().next())))?;
        if head.lines().any(|l| {
            l.to_ascii_lowercase().starts_with("transfer-encoding:") && l.to_ascii_lowercase().contains("chunked")
        }) {
            payload = dechunk(&payload).ok_or_else(|| bad("bad chunked body".into()))?;
        }
        let text = String::from_utf8_lossy(&payload).to_string();
        if !(200..300).contains(&status) {
            return Err(ApiError::Status {
                method: method.into(),
                path: path.into(),
                status,
                body: text,
            });
        }
        if text.trim().is_empty() {
            return Ok((status, Value::Null));
        }
        // Non-JSON bodies (e.g. the agent's /readyz) come back as a string.
        let v = serde_json::from_str(&text).unwrap_or(Value::String(text));
        Ok((status, v))
    }

    fn call(&self, method: &str, path: &str, body: Option<&Value>) -> Result<Value, ApiError> {
        self.request_raw(method, path, "application/json", body).map(|(_, v)| v)
    }

    /// GET.
    pub fn get(&self, path: &str) -> Result<Value, ApiError> {
        self.call("GET", path, None)
    }

    /// GET, `None` on 404.
    pub fn get_opt(&self, path: &str) -> Result<Option<Value>, ApiError> {
        match self.get(path) {
            Ok(v) => Ok(Some(v)),
            Err(ApiError::Status { status: 404, .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// POST to a collection.
    pub fn create(&self, collection: &str, obj: &Value) -> Result<Value, ApiError> {
        self.call("POST", collection, Some(obj))
    }

    /// PUT (replace).
    pub fn replace(&self, path: &str, obj: &Value) -> Result<Value, ApiError> {
        self.call("PUT", path, Some(obj))
    }

    /// PATCH with a JSON merge patch (as the kubelet writes a pod's
    /// status: fields others own, such as the agent's pod conditions, and
    /// the resourceVersion are left alone, so no conflict).
    pub fn merge_patch(&self, path: &str, patch: &Value) -> Result<Value, ApiError> {
        self.request_raw("PATCH", path, "application/merge-patch+json", Some(patch))
            .map(|(_, v)| v)
    }

    /// DELETE; a 404 counts as done.
    pub fn delete(&self, path: &str) -> Result<(), ApiError> {
        match self.call("DELETE", path, None) {
            Ok(_) | Err(ApiError::Status { status: 404, .. }) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Replaces an object's labels (read-modify-write with retries on
    /// conflicts).
    pub fn set_labels(&self, path: &str, labels: &std::collections::BTreeMap<String, String>) -> Result<(), ApiError> {
        let mut last = None;
        for _ in 0..5 {
            let mut obj = self.get(path)?;
            obj["metadata"]["labels"] = json!(labels);
            match self.replace(path, &obj) {
                Ok(_) => return Ok(()),
                Err(e @ ApiError::Status { status: 409, .. }) => last = Some(e),
                Err(e) => return Err(e),
            }
        }
        Err(last.unwrap_or_else(|| ApiError::BadResponse {
            method: "PUT".into(),
            path: path.into(),
            detail: "conflicts".into(),
        }))
    }

    /// Creates or replaces a NetworkPolicy given as a JSON object.
    pub fn apply_policy(&self, policy: &Value, update: bool) -> Result<(), ApiError> {
        let ns = policy["metadata"]["namespace"]
            .as_str()
            .unwrap_or("default")
            .to_string();
        let name = policy["metadata"]["name"].as_str().unwrap_or("").to_string();
        let collection = format!("/apis/networking.k8s.io/v1/namespaces/{ns}/networkpolicies");
        let path = policy_path(&ns, &name);
        if !update {
            return self.create(&collection, policy).map(|_| ());
        }
        match self.get_opt(&path)? {
            None => self.create(&collection, policy).map(|_| ()),
            Some(cur) => {
                let mut obj = policy.clone();
                obj["metadata"]["resourceVersion"] = cur["metadata"]["resourceVersion"].clone();
                self.replace(&path, &obj).map(|_| ())
            }
        }
    }

    /// Deletes every NetworkPolicy of the cluster.
    pub fn delete_all_policies(&self) -> Result<(), ApiError> {
        let list = self.get("/apis/networking.k8s.io/v1/networkpolicies")?;
        for item in list["items"].as_array().cloned().unwrap_or_default() {
            let ns = item["metadata"]["namespace"].as_str().unwrap_or("");
            let name = item["metadata"]["name"].as_str().unwrap_or("");
            self.delete(&policy_path(ns, name))?;
        }
        Ok(())
    }
}

fn dechunk(mut b: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    loop {
        let line_end = b.windows(2).position(|w| w == b"\r\n")?;
        let size_str = std::str::from_utf8(&b[..line_end]).ok()?;
        let size = usize::from_str_radix(size_str.split(';').next()?.trim(), 16).ok()?;
        b = &b[line_end + 2..];
        if size == 0 {
            return Some(out);
        }
        if b.len() < size + 2 {
            return None;
        }
        out.extend_from_slice(&b[..size]);
        b = &b[size + 2..];
    }
}

/// The Pod object the runner publishes: the upstream model's container
/// ports (one container per port and protocol), on node `node`, Running,
/// with its IPs.
pub fn pod_object(
    ns: &str,
    name: &str,
    labels: &std::collections::BTreeMap<String, String>,
    node: &str,
    ips: &[std::net::IpAddr],
) -> Value {
    let mut containers = Vec::new();
    for port in [80u16, 81] {
        for proto in ["TCP", "UDP", "SCTP"] {
            let lower = proto.to_ascii_lowercase();
            containers.push(json!({
                "name": format!("cont-{port}-{lower}"),
                "image": "npm-e2e/netns-server",
                "ports": [{
                    "name": format!("serve-{port}-{lower}"),
                    "containerPort": port,
                    "protocol": proto,
                }],
            }));
        }
    }
    let pod_ips: Vec<Value> = ips.iter().map(|ip| json!({"ip": ip.to_string()})).collect();
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"namespace": ns, "name": name, "labels": labels},
        "spec": {"nodeName": node, "containers": containers},
        "status": {
            "phase": "Running",
            "podIP": ips.first().map(|i| i.to_string()),
            "podIPs": pod_ips,
        },
    })
}
