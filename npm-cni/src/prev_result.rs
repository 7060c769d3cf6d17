//! What npm-cni reads from `prevResult`: the host-side interfaces (those without `sandbox`), the pod's
//! interface named `CNI_IFNAME`, and the pod's addresses. Works on the 0.3.x, 0.4.0 and 1.x result
//! layouts (they differ only in `ips[].version`, which 0.3.x and 0.4.0 require and 1.x dropped: the
//! family comes from the address, and a `version` that contradicts it is a decoding error, since
//! the result would then be ambiguous). The result itself is never modified: the plugin prints it
//! back verbatim.

use std::net::IpAddr;

use ipnet::IpNet;
use serde::Deserialize;
use serde_json::Value;

use crate::error::{CniError, ErrorCode};
use crate::proto::{Interface, IpConfig};

/// The parts of a previous result the agent needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    /// Interfaces without a sandbox, in result order.
    pub host_interfaces: Vec<Interface>,
    /// The sandbox interface named `CNI_IFNAME`, if listed.
    pub sandbox_interface: Option<Interface>,
    /// Addresses on that interface (or on no interface in particular).
    pub ips: Vec<IpConfig>,
}

#[derive(Deserialize)]
struct RawResult {
    #[serde(default)]
    interfaces: Vec<RawInterface>,
    #[serde(default)]
    ips: Vec<RawIp>,
}

#[derive(Deserialize)]
struct RawInterface {
    name: String,
    #[serde(default)]
    mac: Option<String>,
    #[serde(default)]
    sandbox: Option<String>,
}

impl RawInterface {
    fn in_sandbox(&self) -> bool {
        self.sandbox.as_deref().is_some_and(|s| !s.is_empty())
    }

    fn to_interface(&self) -> Interface {
        Interface {
            name: self.name.clone(),
            mac: self.mac.clone().filter(|m| !m.is_empty()),
        }
    }
}

#[derive(Deserialize)]
struct RawIp {
    address: String,
    #[serde(default)]
    gateway: Option<String>,
    #[serde(default)]
    interface: Option<usize>,
    /// `"4"` or `"6"` in 0.3.x and 0.4.0 results; absent in 1.x.
    #[serde(default)]
    version: Option<String>,
}

impl Endpoint {
    /// Extracts the endpoint of interface `ifname` from a previous result.
    pub fn from_prev_result(prev_result: &Value, ifname: &str) -> Result<Self, CniError> {
        let raw: RawResult = RawResult::deserialize(prev_result).map_err(|e| {
            CniError::new(ErrorCode::DecodingFailure, "prevResult is not a CNI result").with_details(e.to_string())
        })?;
        let sandbox_index = raw.interfaces.iter().position(|i| i.in_sandbox() && i.name == ifname);
        let mut ips = Vec::new();
        for (n, ip) in raw.ips.iter().enumerate() {
            let belongs = match ip.interface {
                None => true,
                Some(index) => {
                    let Some(interface) = raw.interfaces.get(index) else {
                        return Err(CniError::new(
                            ErrorCode::DecodingFailure,
                            format!("prevResult ips[{n}] names interface {index}, which does not exist"),
                        ));
                    };
                    match sandbox_index {
                        Some(ours) => index == ours,
                        None => interface.in_sandbox(),
                    }
                }
            };
            if belongs {
                ips.push(parse_ip(n, ip)?);
            }
        }
        Ok(Self {
            host_interfaces: raw
                .interfaces
                .iter()
                .filter(|i| !i.in_sandbox())
                .map(RawInterface::to_interface)
                .collect(),
            sandbox_interface: sandbox_index.map(|i| raw.interfaces[i].to_interface()),
            ips,
        })
    }
}

fn parse_ip(n: usize, ip: &RawIp) -> Result<IpConfig, CniError> {
    let bad = |what: &str, value: &str| {
        CniError::new(
            ErrorCode::DecodingFailure,
            format!("prevResult ips[{n}].{what} {value:?} is not valid"),
        )
    };
    let address: IpNet = ip.address.parse().map_err(|_| bad("address", &ip.address))?;
    if let Some(version) = ip.version.as_deref() {
        let family = match address {
            IpNet::V4(_) => "4",
            IpNet::V6(_) => "6",
        };
        if version != family {
            return Err(CniError::new(
                ErrorCode::DecodingFailure,
                format!(
                    "prevResult ips[{n}].version {version:?} does not match address {} (IPv{family})",
                    ip.address
                ),
            ));
        }
    }
    let gateway = match ip.gateway.as_deref().filter(|g| !g.is_empty()) {
        None => None,
        Some(g) => Some(g.parse::<IpAddr>().map_err(|_| bad("gateway", g))?),
    };
    Ok(IpConfig::new(address, gateway))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::IpFamily;
    use serde_json::json;

    #[test]
    fn ptp_result() {
        let prev = json!({
            "cniVersion": "1.0.0",
            "interfaces": [
                {"name": "veth12345678", "mac": "aa:aa:aa:aa:aa:aa"},
                {"name": "eth0", "mac": "bb:bb:bb:bb:bb:bb", "sandbox": "/var/run/netns/p"}
            ],
            "ips": [
                {"address": "10.1.0.5/24", "gateway": "10.1.0.1", "interface": 1},
                {"address": "fd00::5/64", "interface": 1}
            ],
            "routes": [{"dst": "0.0.0.0/0"}],
            "dns": {}
        });
        let e = Endpoint::from_prev_result(&prev, "eth0").unwrap();
        assert_eq!(
            e.host_interfaces,
            vec![Interface {
                name: "veth12345678".into(),
                mac: Some("aa:aa:aa:aa:aa:aa".into())
            }]
        );
        assert_eq!(e.sandbox_interface.unwrap().name, "eth0");
        assert_eq!(e.ips.len(), 2);
        assert_eq!(e.ips[0].family, IpFamily::Ipv4);
        assert_eq!(e.ips[0].gateway, Some("10.1.0.1".parse().unwrap()));
        assert_eq!(e.ips[1].family, IpFamily::Ipv6);
    }

    #[test]
    fn bridge_result_and_other_interfaces() {
        // The bridge plugin lists the bridge, the host veth, then the pod interface; 0.4.0 adds "version".
        let prev = json!({
            "cniVersion": "0.4.0",
            "interfaces": [
                {"name": "cni0", "mac": "cc:cc:cc:cc:cc:cc"},
                {"name": "veth0", "mac": "dd:dd:dd:dd:dd:dd"},
                {"name": "eth0", "mac": "ee:ee:ee:ee:ee:ee", "sandbox": "/var/run/netns/p"},
                {"name": "net1", "sandbox": "/var/run/netns/p"}
            ],
            "ips": [
                {"version": "4", "address": "10.2.0.7/24", "gateway": "10.2.0.1", "interface": 2},
                {"version": "4", "address": "192.168.5.5/24", "interface": 3}
            ]
        });
        let e = Endpoint::from_prev_result(&prev, "eth0").unwrap();
        let names: Vec<_> = e.host_interfaces.iter().map(|i| i.name.as_str()).collect();
        assert_eq!(names, ["cni0", "veth0"]);
        assert_eq!(e.ips.len(), 1);
        assert_eq!(e.ips[0].address.to_string(), "10.2.0.7/24");
    }

    #[test]
    fn spec_0_3_1_result() {
        // The 0.3.x layout: "version" on each address, "interface" an index into "interfaces".
        let prev = json!({
            "cniVersion": "0.3.1",
            "interfaces": [
                {"name": "vethabc", "mac": "aa:aa:aa:aa:aa:01"},
                {"name": "eth0", "mac": "aa:aa:aa:aa:aa:02", "sandbox": "/var/run/netns/p"}
            ],
            "ips": [
                {"version": "4", "interface": 1, "address": "10.3.0.9/24", "gateway": "10.3.0.1"},
                {"version": "6", "interface": 1, "address": "fd03::9/64"}
            ],
            "routes": [{"dst": "0.0.0.0/0", "gw": "10.3.0.1"}],
            "dns": {}
        });
        let e = Endpoint::from_prev_result(&prev, "eth0").unwrap();
        assert_eq!(e.host_interfaces[0].name, "vethabc");
        assert_eq!(e.sandbox_interface.unwrap().name, "eth0");
        let families: Vec<_> = e.ips.iter().map(|i| i.family).collect();
        assert_eq!(families, [IpFamily::Ipv4, IpFamily::Ipv6]);
        // 0.3.0 results may omit the interface index: the address is the pod's.
        let prev = json!({"cniVersion": "0.3.0", "ips": [{"version": "4", "address": "10.3.1.9/24"}]});
        let e = Endpoint::from_prev_result(&prev, "eth0").unwrap();
        assert_eq!(e.ips[0].address.to_string(), "10.3.1.9/24");
        assert!(e.host_interfaces.is_empty() && e.sandbox_interface.is_none());
    }

    #[test]
    fn malformed_results() {
        let code = |v: Value| u32::from(Endpoint::from_prev_result(&v, "eth0").unwrap_err().code);
        assert_eq!(code(json!({"interfaces": "x"})), 6);
        assert_eq!(code(json!({"ips": [{"address": "10.0.0.300/24"}]})), 6);
        assert_eq!(code(json!({"ips": [{"address": "10.0.0.3/24", "interface": 4}]})), 6);
        assert_eq!(code(json!({"ips": [{"address": "10.0.0.3/24", "gateway": "nope"}]})), 6);
        // A version that contradicts the address.
        assert_eq!(code(json!({"ips": [{"version": "6", "address": "10.0.0.3/24"}]})), 6);
        assert_eq!(code(json!({"ips": [{"version": "4", "address": "fd00::3/64"}]})), 6);
        assert_eq!(code(json!({"ips": [{"version": "5", "address": "10.0.0.3/24"}]})), 6);
    }
}
