//! The invocation's environment: `CNI_COMMAND`, `CNI_CONTAINERID`, `CNI_NETNS`, `CNI_IFNAME` and the
//! pod named in `CNI_ARGS`, validated as libcni's skeleton validates them (errors are code 4 and name
//! the variables).

use std::collections::BTreeMap;

use crate::error::{CniError, ErrorCode};
use crate::proto::PodRef;

/// Reads one environment variable; empty counts as unset. The binary passes `std::env::var`.
pub type Getenv<'a> = &'a dyn Fn(&str) -> Option<String>;

/// The CNI operation requested in `CNI_COMMAND`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Command {
    /// `ADD`.
    Add,
    /// `DEL`.
    Del,
    /// `CHECK`.
    Check,
    /// `STATUS` (1.1.0).
    Status,
    /// `GC` (1.1.0).
    Gc,
    /// `VERSION`.
    Version,
}

impl Command {
    /// Reads `CNI_COMMAND`; `None` if unset.
    pub fn from_env(getenv: Getenv<'_>) -> Result<Option<Self>, CniError> {
        let Some(command) = get(getenv, "CNI_COMMAND") else {
            return Ok(None);
        };
        Ok(Some(match command.as_str() {
            "ADD" => Command::Add,
            "DEL" => Command::Del,
            "CHECK" => Command::Check,
            "STATUS" => Command::Status,
            "GC" => Command::Gc,
            "VERSION" => Command::Version,
            other => {
                return Err(CniError::new(
                    ErrorCode::InvalidEnvironment,
                    format!("unknown CNI_COMMAND: {other:?}"),
                ))
            }
        }))
    }
}

/// The attachment parameters of ADD, CHECK and DEL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AttachmentEnv {
    /// `CNI_CONTAINERID`.
    pub container_id: String,
    /// `CNI_NETNS` (required for ADD and CHECK, optional for DEL).
    pub netns: Option<String>,
    /// `CNI_IFNAME`.
    pub ifname: String,
    /// `CNI_ARGS`, raw.
    pub args: Option<String>,
}

impl AttachmentEnv {
    /// Reads and validates the variables `command` requires.
    pub fn from_env(getenv: Getenv<'_>, command: Command) -> Result<Self, CniError> {
        let container_id = get(getenv, "CNI_CONTAINERID");
        let netns = get(getenv, "CNI_NETNS");
        let ifname = get(getenv, "CNI_IFNAME");
        let mut missing = Vec::new();
        if container_id.is_none() {
            missing.push("CNI_CONTAINERID");
        }
        if netns.is_none() && command != Command::Del {
            missing.push("CNI_NETNS");
        }
        if ifname.is_none() {
            missing.push("CNI_IFNAME");
        }
        let (Some(container_id), Some(ifname), true) = (container_id, ifname, missing.is_empty()) else {
            return Err(CniError::new(
                ErrorCode::InvalidEnvironment,
                format!("required env variables [{}] missing", missing.join(",")),
            ));
        };
        validate_container_id(&container_id)?;
        validate_ifname(&ifname)?;
        Ok(Self {
            container_id,
            netns,
            ifname,
            args: get(getenv, "CNI_ARGS"),
        })
    }

    /// Whether `CNI_ARGS` names the pod's namespace and name but not its uid (`K8S_POD_UID`): a
    /// runtime that does not pass the uid (see [`POD_UID_REQUIREMENT`]).
    pub fn lacks_only_pod_uid(&self) -> bool {
        let Ok(args) = parse_cni_args(self.args.as_deref().unwrap_or("")) else {
            return false;
        };
        let has = |key: &str| args.get(key).is_some_and(|v| !v.is_empty());
        has("K8S_POD_NAMESPACE") && has("K8S_POD_NAME") && !has("K8S_POD_UID")
    }

    /// The pod named by `K8S_POD_NAMESPACE`, `K8S_POD_NAME` and `K8S_POD_UID` in `CNI_ARGS`.
    pub fn pod(&self) -> Result<PodRef, CniError> {
        let args = parse_cni_args(self.args.as_deref().unwrap_or(""))?;
        let take = |key: &str| args.get(key).filter(|v| !v.is_empty()).cloned();
        match (take("K8S_POD_NAMESPACE"), take("K8S_POD_NAME"), take("K8S_POD_UID")) {
            (Some(namespace), Some(name), Some(uid)) => Ok(PodRef { namespace, name, uid }),
            (namespace, name, uid) => {
                let missing: Vec<&str> = [
                    ("K8S_POD_NAMESPACE", namespace),
                    ("K8S_POD_NAME", name),
                    ("K8S_POD_UID", uid),
                ]
                .into_iter()
                .filter_map(|(key, value)| value.is_none().then_some(key))
                .collect();
                Err(CniError::new(
                    ErrorCode::InvalidEnvironment,
                    format!("CNI_ARGS lacks {}", missing.join(", ")),
                )
                .with_details(POD_UID_REQUIREMENT))
            }
        }
    }
}

/// What npm-cni requires of the container runtime, in the error of an ADD or CHECK whose `CNI_ARGS`
/// lacks the pod: the uid is what ties the sandbox to exactly one pod object (a pod recreated under
/// the same name is another pod), so npm-cni never guesses it from the name.
pub const POD_UID_REQUIREMENT: &str = "npm-cni needs the pod's namespace, name and uid in CNI_ARGS \
     (K8S_POD_NAMESPACE, K8S_POD_NAME, K8S_POD_UID): the container runtime must pass them, as containerd \
     and CRI-O do; with a runtime that does not pass K8S_POD_UID, set failOpen in npm-cni's entry (pods \
     then start without waiting for enforcement) or remove npm-cni from the conflist";

/// Parses `CNI_ARGS` (`K=V;K=V`, empty segments ignored) into a map.
pub fn parse_cni_args(args: &str) -> Result<BTreeMap<String, String>, CniError> {
    args.split(';')
        .filter(|pair| !pair.is_empty())
        .map(|pair| match pair.split_once('=') {
            Some((key, value)) if !key.is_empty() => Ok((key.to_owned(), value.to_owned())),
            _ => Err(CniError::new(
                ErrorCode::InvalidEnvironment,
                format!("CNI_ARGS: invalid pair {pair:?}"),
            )),
        })
        .collect()
}

fn get(getenv: Getenv<'_>, key: &str) -> Option<String> {
    getenv(key).filter(|v| !v.is_empty())
}

/// libcni's rule: an alphanumeric first character, then alphanumerics, `_`, `.` or `-`.
fn validate_container_id(id: &str) -> Result<(), CniError> {
    let mut chars = id.chars();
    let ok = chars.next().is_some_and(|c| c.is_ascii_alphanumeric())
        && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-'));
    if ok {
        Ok(())
    } else {
        Err(CniError::new(ErrorCode::InvalidEnvironment, "invalid characters in CNI_CONTAINERID").with_details(id))
    }
}

/// The spec's interface name rule: 1 to 15 bytes, not `.` or `..`, no `/`, `:` or whitespace.
fn validate_ifname(name: &str) -> Result<(), CniError> {
    let ok = !name.is_empty()
        && name.len() < 16
        && name != "."
        && name != ".."
        && !name.chars().any(|c| c == '/' || c == ':' || c.is_whitespace());
    if ok {
        Ok(())
    } else {
        Err(CniError::new(
            ErrorCode::InvalidEnvironment,
            format!("invalid CNI_IFNAME {name:?}"),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let vars: Vec<(String, String)> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        move |key| vars.iter().find(|(k, _)| k == key).map(|(_, v)| v.clone())
    }

    #[test]
    fn reads_pod_from_cni_args() {
        let getenv = env(&[
            ("CNI_CONTAINERID", "abc"),
            ("CNI_NETNS", "/var/run/netns/x"),
            ("CNI_IFNAME", "eth0"),
            (
                "CNI_ARGS",
                "IgnoreUnknown=1;K8S_POD_NAMESPACE=ns;K8S_POD_NAME=a;K8S_POD_INFRA_CONTAINER_ID=abc;K8S_POD_UID=u-1",
            ),
        ]);
        let attachment = AttachmentEnv::from_env(&getenv, Command::Add).unwrap();
        assert_eq!(
            attachment.pod().unwrap(),
            PodRef {
                namespace: "ns".into(),
                name: "a".into(),
                uid: "u-1".into()
            }
        );
    }

    #[test]
    fn missing_variables_are_named() {
        let getenv = env(&[("CNI_IFNAME", "eth0")]);
        let e = AttachmentEnv::from_env(&getenv, Command::Add).unwrap_err();
        assert_eq!(u32::from(e.code), 4);
        assert!(
            e.msg.contains("CNI_CONTAINERID") && e.msg.contains("CNI_NETNS"),
            "{}",
            e.msg
        );
        let getenv = env(&[("CNI_CONTAINERID", "abc"), ("CNI_IFNAME", "eth0")]);
        assert!(AttachmentEnv::from_env(&getenv, Command::Del).is_ok());
        let getenv = env(&[("CNI_CONTAINERID", "-x"), ("CNI_IFNAME", "eth0"), ("CNI_NETNS", "/n")]);
        assert_eq!(
            u32::from(AttachmentEnv::from_env(&getenv, Command::Add).unwrap_err().code),
            4
        );
        let getenv = env(&[("CNI_CONTAINERID", "x"), ("CNI_IFNAME", "a/b"), ("CNI_NETNS", "/n")]);
        assert_eq!(
            u32::from(AttachmentEnv::from_env(&getenv, Command::Add).unwrap_err().code),
            4
        );
    }

    #[test]
    fn missing_pod_keys_are_named() {
        let attachment = AttachmentEnv {
            container_id: "c".into(),
            netns: None,
            ifname: "eth0".into(),
            args: Some("K8S_POD_NAMESPACE=ns;K8S_POD_NAME=a".into()),
        };
        let e = attachment.pod().unwrap_err();
        assert_eq!(u32::from(e.code), 4);
        assert_eq!(e.msg, "CNI_ARGS lacks K8S_POD_UID");
        // The error names what the runtime must do.
        let details = e.details.as_deref().unwrap();
        assert!(
            details.contains("container runtime must pass") && details.contains("failOpen"),
            "{details}"
        );
        assert!(attachment.lacks_only_pod_uid());
        let named = AttachmentEnv {
            args: Some("K8S_POD_NAMESPACE=ns;K8S_POD_NAME=a;K8S_POD_UID=u".into()),
            ..attachment.clone()
        };
        assert!(!named.lacks_only_pod_uid());
        let no_name = AttachmentEnv {
            args: Some("K8S_POD_NAMESPACE=ns".into()),
            ..attachment
        };
        assert!(!no_name.lacks_only_pod_uid(), "not a pod at all: refused as before");
        assert!(parse_cni_args("A=1;;B=").is_ok());
        assert!(parse_cni_args("A=1;junk").is_err());
    }
}
