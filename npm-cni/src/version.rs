//! CNI spec versions: which ones npm-cni speaks, comparisons, and the VERSION reply.

use serde::Serialize;

/// The spec versions npm-cni supports, oldest first. 0.3.0 and 0.3.1 have ADD and DEL only (their
/// result lists `ips[].version`, as 0.4.0 does); 0.4.0 is the first with CHECK and prevResult on DEL;
/// 1.1.0 adds STATUS and GC.
pub const SUPPORTED_VERSIONS: &[&str] = &["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"];

/// The first version with `CHECK`.
pub const CHECK_SINCE: &str = "0.4.0";

/// The newest supported version: used in replies when the input names no usable version.
pub const LATEST: &str = "1.1.0";

/// Whether `version` is one of [`SUPPORTED_VERSIONS`].
pub fn is_supported(version: &str) -> bool {
    SUPPORTED_VERSIONS.contains(&version)
}

/// `version >= minimum`, both `MAJOR.MINOR.PATCH`; false if `version` does not parse.
pub fn at_least(version: &str, minimum: &str) -> bool {
    match (parse(version), parse(minimum)) {
        (Some(v), Some(m)) => v >= m,
        _ => false,
    }
}

fn parse(version: &str) -> Option<(u32, u32, u32)> {
    let mut parts = version.split('.').map(|p| p.parse::<u32>().ok());
    let triple = (parts.next()??, parts.next()??, parts.next()??);
    parts.next().is_none().then_some(triple)
}

/// The reply to `CNI_COMMAND=VERSION`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct VersionReply {
    /// The `cniVersion` given on stdin, or [`LATEST`] without one.
    pub cni_version: String,
    /// [`SUPPORTED_VERSIONS`].
    pub supported_versions: Vec<&'static str>,
}

impl VersionReply {
    /// The reply for the (possibly empty or malformed) VERSION input.
    pub fn for_input(stdin: &[u8]) -> Self {
        let requested = serde_json::from_slice::<serde_json::Value>(stdin)
            .ok()
            .and_then(|v| v.get("cniVersion").and_then(|v| v.as_str()).map(str::to_owned))
            .filter(|v| parse(v).is_some());
        Self {
            cni_version: requested.unwrap_or_else(|| LATEST.to_owned()),
            supported_versions: SUPPORTED_VERSIONS.to_vec(),
        }
    }
}

/// The `cniVersion` of a configuration if it is a supported one, for labelling an error result of an
/// input that may not parse.
pub fn sniff(stdin: &[u8]) -> &'static str {
    serde_json::from_slice::<serde_json::Value>(stdin)
        .ok()
        .and_then(|v| {
            let requested = v.get("cniVersion")?.as_str()?.to_owned();
            SUPPORTED_VERSIONS.iter().copied().find(|s| *s == requested)
        })
        .unwrap_or(LATEST)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compares_versions() {
        assert!(at_least("1.1.0", "1.1.0"));
        assert!(at_least("1.10.0", "1.2.0"));
        assert!(!at_least("1.0.0", "1.1.0"));
        assert!(!at_least("1.0", "0.4.0"));
        assert!(!at_least("x", "0.4.0"));
    }

    #[test]
    fn version_reply_echoes_input() {
        assert_eq!(
            VersionReply::for_input(br#"{"cniVersion":"1.0.0"}"#).cni_version,
            "1.0.0"
        );
        assert_eq!(VersionReply::for_input(b"").cni_version, LATEST);
        assert_eq!(sniff(br#"{"cniVersion":"0.4.0"}"#), "0.4.0");
        assert_eq!(sniff(br#"{"cniVersion":"0.3.1"}"#), "0.3.1");
        assert_eq!(sniff(br#"{"cniVersion":"0.3.0"}"#), "0.3.0");
        assert_eq!(sniff(br#"{"cniVersion":"0.2.0"}"#), LATEST);
        assert!(is_supported("0.3.0") && is_supported("0.3.1") && !is_supported("0.2.0"));
        assert_eq!(
            VersionReply::for_input(br#"{"cniVersion":"0.3.1"}"#).supported_versions,
            ["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"]
        );
    }
}
