//! The wire protocol between the `npm-cni` plugin and the node's `npm-agent`, and a blocking client.
//!
//! # Transport
//!
//! A unix stream socket (agent flag `--cni-socket PATH`, default [`DEFAULT_SOCKET`]). Each connection
//! carries exactly **one request and one response**, each a single JSON object terminated by `\n`
//! (`serde_json` never emits a raw newline inside a value). The plugin connects, writes the request
//! line and waits for the response line; the agent reads one line, acts, writes one line and closes
//! the connection. A message longer than [`MAX_MESSAGE_BYTES`] is refused by both sides.
//!
//! # Messages
//!
//! A [`Request`] is tagged by `command`: `add`, `check` and `del` carry an attachment (the container id
//! and interface name identify it, as the CNI spec keys attachments), `status` carries nothing and `gc`
//! carries the attachments that are still valid. Every request carries [`PROTO_VERSION`] in `version`;
//! an agent answers a version it does not know with an error.
//!
//! ```json
//! {"version":1,"command":"add","network":"k8s-pod-network","cni_version":"1.0.0",
//!  "container_id":"3f2a...","ifname":"eth0","netns":"/var/run/netns/cni-1234",
//!  "pod":{"namespace":"default","name":"web-0","uid":"7d0c..."},
//!  "host_interfaces":[{"name":"veth2a1b3c4d","mac":"6e:0a:..."}],
//!  "sandbox_interface":{"name":"eth0","mac":"2a:11:..."},
//!  "ips":[{"family":"ipv4","address":"10.22.0.5/24","gateway":"10.22.0.1"}]}
//! {"version":1,"command":"del","network":"k8s-pod-network","container_id":"3f2a...","ifname":"eth0",
//!  "netns":null,"pod":{"namespace":"default","name":"web-0","uid":"7d0c..."},
//!  "host_interfaces":[],"ips":[]}
//! {"version":1,"command":"status"}
//! {"version":1,"command":"gc","network":"k8s-pod-network",
//!  "valid_attachments":[{"container_id":"3f2a...","ifname":"eth0"}]}
//! ```
//!
//! The [`Response`] is the same for every command:
//!
//! ```json
//! {"ok":true,"programmed_endpoint":17}
//! {"ok":false,"error":"pod default/web-0 (uid 7d0c...) is not known yet","retry":true}
//! ```
//!
//! What the agent must do for each command is documented on the [`Request`] variants.
//!
//! # Using it from the agent
//!
//! The codec is runtime-agnostic: [`decode_request`] takes one line, [`encode_response`] gives the bytes
//! to write. With std streams, [`read_request`] and [`write_response`] do the framing. With tokio:
//!
//! ```ignore
//! let (rd, mut wr) = stream.split();
//! let mut line = Vec::new();
//! BufReader::new(rd).take(proto::MAX_MESSAGE_BYTES as u64 + 1).read_until(b'\n', &mut line).await?;
//! let response = match proto::decode_request(&line) {
//!     Ok(request) => handle(request).await,
//!     Err(e) => proto::Response::error(e.to_string(), false),
//! };
//! wr.write_all(&proto::encode_response(&response)).await?;
//! ```
//!
//! The plugin side uses [`exchange`], a blocking client with a hard deadline (no async runtime, so the
//! binary starts in a millisecond).

use std::io::{self, BufRead, BufReader, Read, Write};

use ipnet::IpNet;
use serde::{Deserialize, Serialize};

mod client;

pub use client::{exchange, ClientError, ConnectMode};

/// Default path of the agent's socket, for both the agent flag `--cni-socket` and `agentSocket`.
pub const DEFAULT_SOCKET: &str = "/run/npm/cni.sock";

/// Version of this protocol, sent in every request's `version` field.
pub const PROTO_VERSION: u32 = 1;

/// Largest request or response line either side accepts, newline included.
pub const MAX_MESSAGE_BYTES: usize = 64 * 1024;

/// One message from the plugin to the agent, with the protocol version it was written for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Envelope {
    /// [`PROTO_VERSION`] of the sender.
    pub version: u32,
    /// The command and its arguments.
    #[serde(flatten)]
    pub request: Request,
}

/// What the plugin asks of the agent, tagged by `command`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "command", rename_all = "snake_case")]
pub enum Request {
    /// CNI ADD: program the endpoint (attach to the host interface, publish the addresses as the pod's
    /// identity, install every policy that selects the pod) and answer `ok` only once that is done.
    /// Answer an error (with `retry` when waiting could help) if it cannot be done.
    Add(Attachment),
    /// CNI CHECK: answer `ok` if the endpoint of this attachment is programmed, an error otherwise.
    Check(Attachment),
    /// CNI DEL: evict the endpoint and its addresses at once. Idempotent: an unknown attachment is `ok`.
    Del(Detachment),
    /// CNI STATUS: answer `ok` if the agent can serve ADD requests now.
    Status,
    /// CNI GC: forget every attachment of `network` learned through this socket that is not listed.
    Gc(GcRequest),
}

/// A pod's network attachment as the plugin saw it in ADD or CHECK.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Attachment {
    /// The network's `name` from the CNI configuration.
    pub network: String,
    /// `cniVersion` of the configuration the runtime sent.
    pub cni_version: String,
    /// `CNI_CONTAINERID` (the pod sandbox id).
    pub container_id: String,
    /// `CNI_IFNAME`, the interface name inside the pod.
    pub ifname: String,
    /// `CNI_NETNS`, the path of the pod's network namespace.
    pub netns: String,
    /// The pod, from `CNI_ARGS`.
    pub pod: PodRef,
    /// Interfaces of the previous result without a `sandbox`, in result order: the host-side veth of a
    /// routed plugin (`ptp`), or the bridge then the veth of a bridged one (`bridge`). The agent must
    /// verify which of them is a veth host peer before attaching anything.
    pub host_interfaces: Vec<Interface>,
    /// The interface inside the pod named `ifname`, if the previous result lists it.
    pub sandbox_interface: Option<Interface>,
    /// Addresses of the pod: the previous result's IPs on the sandbox interface (or with no interface).
    pub ips: Vec<IpConfig>,
}

/// What the plugin knows in DEL: the attachment key, and the rest as far as the runtime still has it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Detachment {
    /// The network's `name` from the CNI configuration.
    pub network: String,
    /// `CNI_CONTAINERID`.
    pub container_id: String,
    /// `CNI_IFNAME`.
    pub ifname: String,
    /// `CNI_NETNS`, optional in DEL.
    pub netns: Option<String>,
    /// The pod, if `CNI_ARGS` names it.
    pub pod: Option<PodRef>,
    /// Host-side interfaces of `prevResult`, empty without one.
    #[serde(default)]
    pub host_interfaces: Vec<Interface>,
    /// Pod addresses of `prevResult`, empty without one.
    #[serde(default)]
    pub ips: Vec<IpConfig>,
}

/// The arguments of [`Request::Gc`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GcRequest {
    /// The network's `name` from the CNI configuration.
    pub network: String,
    /// The attachments of this network that are still valid (`cni.dev/valid-attachments`).
    pub valid_attachments: Vec<AttachmentId>,
}

/// The key of an attachment: container id and interface name.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct AttachmentId {
    /// `CNI_CONTAINERID`.
    pub container_id: String,
    /// `CNI_IFNAME`.
    pub ifname: String,
}

/// A pod named by the runtime in `CNI_ARGS`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct PodRef {
    /// `K8S_POD_NAMESPACE`.
    pub namespace: String,
    /// `K8S_POD_NAME`.
    pub name: String,
    /// `K8S_POD_UID`.
    pub uid: String,
}

/// An interface of a CNI result.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Interface {
    /// Interface name.
    pub name: String,
    /// Hardware address, as the result gives it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mac: Option<String>,
}

/// Address family of an [`IpConfig`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum IpFamily {
    /// IPv4.
    Ipv4,
    /// IPv6.
    Ipv6,
}

/// One address of the pod, in CIDR notation as the CNI result gives it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IpConfig {
    /// Family of `address`.
    pub family: IpFamily,
    /// Address and prefix length, e.g. `10.22.0.5/24`; the pod's address is `address.addr()`.
    pub address: IpNet,
    /// Gateway of the subnet, if the result has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gateway: Option<std::net::IpAddr>,
}

impl IpConfig {
    /// An address with its family derived from it.
    pub fn new(address: IpNet, gateway: Option<std::net::IpAddr>) -> Self {
        let family = match address {
            IpNet::V4(_) => IpFamily::Ipv4,
            IpNet::V6(_) => IpFamily::Ipv6,
        };
        Self {
            family,
            address,
            gateway,
        }
    }
}

/// The agent's answer to any request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Response {
    /// The request was carried out (ADD: the endpoint is programmed; CHECK: it is; DEL: it is gone).
    pub ok: bool,
    /// Why not, when `ok` is false.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// The failure is transient (e.g. the pod is not in the agent's cache yet): the runtime should retry.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub retry: bool,
    /// The endpoint id the agent programmed (ADD, CHECK), for logs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub programmed_endpoint: Option<u32>,
}

impl Response {
    /// A success, with the endpoint id if there is one.
    pub fn ok(programmed_endpoint: Option<u32>) -> Self {
        Self {
            ok: true,
            error: None,
            retry: false,
            programmed_endpoint,
        }
    }

    /// A failure with its reason; `retry` marks it transient.
    pub fn error(message: impl Into<String>, retry: bool) -> Self {
        Self {
            ok: false,
            error: Some(message.into()),
            retry,
            programmed_endpoint: None,
        }
    }
}

/// A message that could not be read or decoded.
#[derive(Debug, thiserror::Error)]
pub enum ProtoError {
    /// Reading or writing the socket failed.
    #[error("socket i/o: {0}")]
    Io(#[from] io::Error),
    /// The peer closed the connection before sending a complete line.
    #[error("connection closed before a complete message ({received} bytes received)")]
    Truncated {
        /// Bytes received before the end of the stream.
        received: usize,
    },
    /// The line is longer than [`MAX_MESSAGE_BYTES`].
    #[error("message longer than {MAX_MESSAGE_BYTES} bytes")]
    TooLarge,
    /// The line is not a valid message.
    #[error("invalid message: {source}; received {snippet:?}")]
    Invalid {
        /// The decoder's complaint.
        source: serde_json::Error,
        /// The beginning of what was received.
        snippet: String,
    },
    /// The request was written for a protocol version this side does not speak.
    #[error("unsupported protocol version {0} (this side speaks {PROTO_VERSION})")]
    Version(u32),
}

/// Decodes one request line (with or without its trailing newline).
pub fn decode_request(line: &[u8]) -> Result<Request, ProtoError> {
    let envelope: Envelope = decode(line)?;
    if envelope.version != PROTO_VERSION {
        return Err(ProtoError::Version(envelope.version));
    }
    Ok(envelope.request)
}

/// Encodes a request as one line, newline included.
pub fn encode_request(request: &Request) -> Vec<u8> {
    encode(&Envelope {
        version: PROTO_VERSION,
        request: request.clone(),
    })
}

/// Decodes one response line (with or without its trailing newline).
pub fn decode_response(line: &[u8]) -> Result<Response, ProtoError> {
    decode(line)
}

/// Encodes a response as one line, newline included.
pub fn encode_response(response: &Response) -> Vec<u8> {
    encode(response)
}

/// Reads one request line from a blocking stream (the agent side, std flavour).
pub fn read_request<R: Read>(reader: R) -> Result<Request, ProtoError> {
    decode_request(&read_line(reader)?)
}

/// Writes one response line to a blocking stream and flushes it (the agent side, std flavour).
pub fn write_response<W: Write>(mut writer: W, response: &Response) -> io::Result<()> {
    writer.write_all(&encode_response(response))?;
    writer.flush()
}

fn encode<T: Serialize>(value: &T) -> Vec<u8> {
    // Serializing these plain structs cannot fail: no maps with non-string keys, no custom serializers.
    let mut bytes = serde_json::to_vec(value).expect("protocol messages always serialize");
    bytes.push(b'\n');
    bytes
}

fn decode<T: for<'de> Deserialize<'de>>(line: &[u8]) -> Result<T, ProtoError> {
    if line.len() > MAX_MESSAGE_BYTES {
        return Err(ProtoError::TooLarge);
    }
    let body = line.strip_suffix(b"\n").unwrap_or(line);
    serde_json::from_slice(body).map_err(|source| ProtoError::Invalid {
        source,
        snippet: String::from_utf8_lossy(&body[..body.len().min(120)]).into_owned(),
    })
}

/// Reads up to and including the first newline, refusing more than [`MAX_MESSAGE_BYTES`].
pub(crate) fn read_line<R: Read>(reader: R) -> Result<Vec<u8>, ProtoError> {
    let mut line = Vec::new();
    let mut limited = BufReader::new(reader.take(MAX_MESSAGE_BYTES as u64 + 1));
    limited.read_until(b'\n', &mut line)?;
    if line.len() > MAX_MESSAGE_BYTES {
        return Err(ProtoError::TooLarge);
    }
    if line.last() != Some(&b'\n') {
        return Err(ProtoError::Truncated { received: line.len() });
    }
    Ok(line)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A full attachment, shared with the client's tests.
    pub(super) fn attachment() -> Attachment {
        Attachment {
            network: "net".into(),
            cni_version: "1.0.0".into(),
            container_id: "c1".into(),
            ifname: "eth0".into(),
            netns: "/var/run/netns/x".into(),
            pod: PodRef {
                namespace: "ns".into(),
                name: "a".into(),
                uid: "u".into(),
            },
            host_interfaces: vec![Interface {
                name: "veth1".into(),
                mac: Some("aa:bb:cc:dd:ee:ff".into()),
            }],
            sandbox_interface: Some(Interface {
                name: "eth0".into(),
                mac: None,
            }),
            ips: vec![IpConfig::new(
                "10.1.0.5/24".parse().unwrap(),
                Some("10.1.0.1".parse().unwrap()),
            )],
        }
    }

    #[test]
    fn request_wire_shape() {
        let line = encode_request(&Request::Add(attachment()));
        assert_eq!(line.last(), Some(&b'\n'));
        let value: serde_json::Value = serde_json::from_slice(&line).unwrap();
        assert_eq!(value["version"], 1);
        assert_eq!(value["command"], "add");
        assert_eq!(value["pod"]["uid"], "u");
        assert_eq!(value["host_interfaces"][0]["name"], "veth1");
        assert_eq!(
            value["ips"][0],
            serde_json::json!({"family":"ipv4","address":"10.1.0.5/24","gateway":"10.1.0.1"})
        );
        assert_eq!(decode_request(&line).unwrap(), Request::Add(attachment()));
        let status = encode_request(&Request::Status);
        assert_eq!(status, b"{\"version\":1,\"command\":\"status\"}\n");
        assert_eq!(decode_request(&status).unwrap(), Request::Status);
    }

    #[test]
    fn rejects_other_versions_and_garbage() {
        assert!(matches!(
            decode_request(b"{\"version\":2,\"command\":\"status\"}\n"),
            Err(ProtoError::Version(2))
        ));
        assert!(matches!(decode_request(b"hello\n"), Err(ProtoError::Invalid { .. })));
        assert!(matches!(
            decode_response(b"{\"ok\":\"yes\"}"),
            Err(ProtoError::Invalid { .. })
        ));
        assert!(matches!(
            read_request(&b"{\"version\":1"[..]),
            Err(ProtoError::Truncated { received: 12 })
        ));
        let huge = vec![b' '; MAX_MESSAGE_BYTES + 10];
        assert!(matches!(read_request(&huge[..]), Err(ProtoError::TooLarge)));
    }

    #[test]
    fn response_wire_shape() {
        assert_eq!(
            encode_response(&Response::ok(Some(7))),
            b"{\"ok\":true,\"programmed_endpoint\":7}\n"
        );
        assert_eq!(
            encode_response(&Response::error("no", true)),
            b"{\"ok\":false,\"error\":\"no\",\"retry\":true}\n"
        );
        assert_eq!(decode_response(b"{\"ok\":true}\n").unwrap(), Response::ok(None));
    }
}
