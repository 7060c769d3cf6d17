//! The CNI error result: the well-known codes of the spec, npm-cni's own codes, and the JSON printed.

use serde::Serialize;

/// A well-known (0-99) or npm-cni specific (100+) CNI error code.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(into = "u32")]
pub enum ErrorCode {
    /// 1: the configuration's `cniVersion` is not one this plugin supports.
    IncompatibleVersion,
    /// 4: a required environment variable (or `CNI_ARGS` key) is missing or invalid.
    InvalidEnvironment,
    /// 5: reading stdin failed.
    IoFailure,
    /// 6: the configuration (or its `prevResult`) could not be decoded.
    DecodingFailure,
    /// 7: the configuration decodes but is not valid for this plugin.
    InvalidNetworkConfig,
    /// 11: transient; the runtime should retry (the agent did not answer in time).
    TryAgainLater,
    /// 50: STATUS: the plugin cannot serve ADD requests (the agent is not reachable).
    PluginNotAvailable,
    /// 100: the agent answered and refused the request.
    AgentRefused,
    /// 101: the agent answered something that is not a response of the protocol.
    AgentProtocol,
}

impl From<ErrorCode> for u32 {
    fn from(code: ErrorCode) -> u32 {
        match code {
            ErrorCode::IncompatibleVersion => 1,
            ErrorCode::InvalidEnvironment => 4,
            ErrorCode::IoFailure => 5,
            ErrorCode::DecodingFailure => 6,
            ErrorCode::InvalidNetworkConfig => 7,
            ErrorCode::TryAgainLater => 11,
            ErrorCode::PluginNotAvailable => 50,
            ErrorCode::AgentRefused => 100,
            ErrorCode::AgentProtocol => 101,
        }
    }
}

/// A failed invocation: what the plugin prints on stdout before exiting non-zero.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("CNI error {}: {msg}{}", u32::from(*code), details.as_deref().map(|d| format!(" ({d})")).unwrap_or_default())]
pub struct CniError {
    /// The error code.
    pub code: ErrorCode,
    /// A short message characterizing the error.
    pub msg: String,
    /// A longer description, if any.
    pub details: Option<String>,
}

impl CniError {
    /// An error without details.
    pub fn new(code: ErrorCode, msg: impl Into<String>) -> Self {
        Self {
            code,
            msg: msg.into(),
            details: None,
        }
    }

    /// Adds the longer description.
    pub fn with_details(mut self, details: impl Into<String>) -> Self {
        self.details = Some(details.into());
        self
    }

    /// The error result object of the spec, for the given `cniVersion`.
    pub fn to_json(&self, cni_version: &str) -> serde_json::Value {
        let mut value = serde_json::json!({
            "cniVersion": cni_version,
            "code": self.code,
            "msg": self.msg,
        });
        if let Some(details) = &self.details {
            value["details"] = details.clone().into();
        }
        value
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_json_shape() {
        let e = CniError::new(ErrorCode::InvalidNetworkConfig, "bad").with_details("longer");
        assert_eq!(
            e.to_json("1.0.0"),
            serde_json::json!({"cniVersion":"1.0.0","code":7,"msg":"bad","details":"longer"})
        );
        assert_eq!(
            CniError::new(ErrorCode::TryAgainLater, "x").to_json("1.1.0")["code"],
            11
        );
    }
}
