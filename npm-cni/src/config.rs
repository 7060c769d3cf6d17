//! The network configuration npm-cni reads on stdin: the standard keys, npm-cni's own keys and their
//! defaults, and the validation that turns a bad configuration into the right CNI error.
//!
//! ```json
//! {"cniVersion":"1.0.0","name":"k8s-pod-network","type":"npm-cni",
//!  "agentSocket":"/run/npm/cni.sock","timeoutSeconds":10,"failOpen":false,
//!  "prevResult":{...}}
//! ```
//!
//! Other keys (`runtimeConfig`, `args`, ...) are tolerated and ignored.

use std::path::PathBuf;
use std::time::Duration;

use serde_json::{Map, Value};

use crate::error::{CniError, ErrorCode};
use crate::proto::{AttachmentId, DEFAULT_SOCKET};
use crate::version;

/// Default of `timeoutSeconds`.
pub const DEFAULT_TIMEOUT_SECONDS: u64 = 10;

/// Largest accepted `timeoutSeconds` (a runtime kills slower plugins long before).
pub const MAX_TIMEOUT_SECONDS: u64 = 600;

/// A decoded and validated network configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct NetConf {
    /// `cniVersion`, one of [`version::SUPPORTED_VERSIONS`].
    pub cni_version: String,
    /// `name` of the network.
    pub name: String,
    /// `type` (normally `npm-cni`).
    pub plugin_type: String,
    /// `agentSocket`: the agent's unix socket.
    pub agent_socket: PathBuf,
    /// `timeoutSeconds`: how long ADD and CHECK wait for the agent.
    pub timeout: Duration,
    /// `failOpen`: let ADD and CHECK succeed when the agent does not answer.
    pub fail_open: bool,
    /// `prevResult`, verbatim.
    pub prev_result: Option<Value>,
    /// `cni.dev/valid-attachments` (GC only).
    pub valid_attachments: Vec<AttachmentId>,
}

impl NetConf {
    /// Decodes and validates the configuration bytes.
    pub fn parse(stdin: &[u8]) -> Result<Self, CniError> {
        let value: Value = serde_json::from_slice(stdin).map_err(|e| {
            CniError::new(
                ErrorCode::DecodingFailure,
                "network configuration on stdin is not valid JSON",
            )
            .with_details(e.to_string())
        })?;
        let Value::Object(obj) = value else {
            return Err(CniError::new(
                ErrorCode::DecodingFailure,
                "network configuration is not a JSON object",
            ));
        };

        let cni_version = match obj.get("cniVersion") {
            None | Some(Value::Null) => {
                return Err(incompatible("cniVersion is missing".to_owned()));
            }
            Some(Value::String(v)) if version::is_supported(v) => v.clone(),
            Some(Value::String(v)) => return Err(incompatible(format!("cniVersion {v:?} is not supported"))),
            Some(other) => return Err(invalid("cniVersion", other, "a version string")),
        };

        let name = required_string(&obj, "name")?;
        if !valid_network_name(&name) {
            return Err(CniError::new(
                ErrorCode::InvalidNetworkConfig,
                format!("invalid network name {name:?}"),
            )
            .with_details("it must start with a letter or digit, followed by letters, digits, '_', '.' or '-'"));
        }
        let plugin_type = required_string(&obj, "type")?;

        let agent_socket = match optional(&obj, "agentSocket") {
            None => PathBuf::from(DEFAULT_SOCKET),
            Some(Value::String(s)) if s.starts_with('/') => PathBuf::from(s),
            Some(other) => return Err(invalid("agentSocket", other, "an absolute path")),
        };

        let timeout_seconds = match optional(&obj, "timeoutSeconds") {
            None => DEFAULT_TIMEOUT_SECONDS,
            Some(v) => match v.as_u64() {
                Some(s) if (1..=MAX_TIMEOUT_SECONDS).contains(&s) => s,
                _ => {
                    return Err(invalid(
                        "timeoutSeconds",
                        v,
                        &format!("an integer from 1 to {MAX_TIMEOUT_SECONDS}"),
                    ))
                }
            },
        };

        let fail_open = match optional(&obj, "failOpen") {
            None => false,
            Some(Value::Bool(b)) => *b,
            Some(other) => return Err(invalid("failOpen", other, "true or false")),
        };

        let prev_result = match optional(&obj, "prevResult") {
            None => None,
            Some(v @ Value::Object(_)) => Some(v.clone()),
            Some(other) => return Err(invalid("prevResult", other, "a result object")),
        };

        let valid_attachments = match optional(&obj, "cni.dev/valid-attachments") {
            None => Vec::new(),
            Some(v) => parse_valid_attachments(v)?,
        };

        Ok(Self {
            cni_version,
            name,
            plugin_type,
            agent_socket,
            timeout: Duration::from_secs(timeout_seconds),
            fail_open,
            prev_result,
            valid_attachments,
        })
    }
}

/// A key's value, `null` counting as absent.
fn optional<'a>(obj: &'a Map<String, Value>, key: &str) -> Option<&'a Value> {
    obj.get(key).filter(|v| !v.is_null())
}

fn required_string(obj: &Map<String, Value>, key: &str) -> Result<String, CniError> {
    match optional(obj, key) {
        Some(Value::String(s)) if !s.is_empty() => Ok(s.clone()),
        None => Err(CniError::new(
            ErrorCode::InvalidNetworkConfig,
            format!("network configuration has no {key:?}"),
        )),
        Some(other) => Err(invalid(key, other, "a non-empty string")),
    }
}

fn incompatible(details: String) -> CniError {
    CniError::new(ErrorCode::IncompatibleVersion, "incompatible CNI versions").with_details(format!(
        "{details}; npm-cni supports {}",
        version::SUPPORTED_VERSIONS.join(", ")
    ))
}

fn invalid(key: &str, value: &Value, expected: &str) -> CniError {
    let mut shown = value.to_string();
    if shown.len() > 80 {
        shown.truncate(80);
        shown.push_str("...");
    }
    CniError::new(
        ErrorCode::InvalidNetworkConfig,
        format!("invalid {key:?} in network configuration"),
    )
    .with_details(format!("{key} is {shown}, expected {expected}"))
}

/// The network name rule of libcni: `^[a-zA-Z0-9][a-zA-Z0-9_.-]*$`.
fn valid_network_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphanumeric())
        && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-'))
}

fn parse_valid_attachments(value: &Value) -> Result<Vec<AttachmentId>, CniError> {
    let expected = "a list of {\"containerID\": ..., \"ifname\": ...}";
    let Value::Array(items) = value else {
        return Err(invalid("cni.dev/valid-attachments", value, expected));
    };
    items
        .iter()
        .map(|item| {
            let field = |k: &str| item.get(k).and_then(Value::as_str).map(str::to_owned);
            match (field("containerID"), field("ifname")) {
                (Some(container_id), Some(ifname)) => Ok(AttachmentId { container_id, ifname }),
                _ => Err(invalid("cni.dev/valid-attachments", item, expected)),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn code(stdin: &str) -> u32 {
        NetConf::parse(stdin.as_bytes()).unwrap_err().code.into()
    }

    #[test]
    fn defaults_and_keys() {
        let conf = NetConf::parse(br#"{"cniVersion":"1.0.0","name":"n","type":"npm-cni","runtimeConfig":{}}"#).unwrap();
        assert_eq!(conf.agent_socket, PathBuf::from("/run/npm/cni.sock"));
        assert_eq!(conf.timeout, Duration::from_secs(10));
        assert!(!conf.fail_open);
        assert!(conf.prev_result.is_none());
        let conf = NetConf::parse(
            br#"{"cniVersion":"1.1.0","name":"n","type":"npm-cni","agentSocket":"/tmp/s","timeoutSeconds":2,
                "failOpen":true,"prevResult":{"ips":[]},
                "cni.dev/valid-attachments":[{"containerID":"c","ifname":"eth0"}]}"#,
        )
        .unwrap();
        assert_eq!(conf.agent_socket, PathBuf::from("/tmp/s"));
        assert_eq!(conf.timeout, Duration::from_secs(2));
        assert!(conf.fail_open);
        assert!(conf.prev_result.is_some());
        assert_eq!(
            conf.valid_attachments,
            vec![AttachmentId {
                container_id: "c".into(),
                ifname: "eth0".into()
            }]
        );
    }

    #[test]
    fn errors_have_spec_codes() {
        assert_eq!(code("{not json"), 6);
        assert_eq!(code("[1]"), 6);
        assert_eq!(code(r#"{"name":"n","type":"t"}"#), 1);
        assert_eq!(code(r#"{"cniVersion":"0.2.0","name":"n","type":"t"}"#), 1);
        assert!(NetConf::parse(br#"{"cniVersion":"0.3.1","name":"n","type":"t"}"#).is_ok());
        assert!(NetConf::parse(br#"{"cniVersion":"0.3.0","name":"n","type":"t"}"#).is_ok());
        assert_eq!(code(r#"{"cniVersion":"1.0.0","type":"t"}"#), 7);
        assert_eq!(code(r#"{"cniVersion":"1.0.0","name":"bad name","type":"t"}"#), 7);
        assert_eq!(
            code(r#"{"cniVersion":"1.0.0","name":"n","type":"t","timeoutSeconds":0}"#),
            7
        );
        assert_eq!(
            code(r#"{"cniVersion":"1.0.0","name":"n","type":"t","timeoutSeconds":"5"}"#),
            7
        );
        assert_eq!(
            code(r#"{"cniVersion":"1.0.0","name":"n","type":"t","failOpen":"yes"}"#),
            7
        );
        assert_eq!(
            code(r#"{"cniVersion":"1.0.0","name":"n","type":"t","agentSocket":"rel/s"}"#),
            7
        );
        assert_eq!(
            code(r#"{"cniVersion":"1.0.0","name":"n","type":"t","prevResult":3}"#),
            7
        );
    }
}
