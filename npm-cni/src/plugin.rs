//! One invocation of the plugin: dispatches `CNI_COMMAND`, talks to the agent and decides what is
//! printed and the exit code. Pure apart from the agent socket and the log writer, so it is tested
//! without a process.

use std::io::{self, Write};

use serde_json::Value;

use crate::config::NetConf;
use crate::env::{AttachmentEnv, Command, Getenv};
use crate::error::{CniError, ErrorCode};
use crate::prev_result::Endpoint;
use crate::proto::{self, Attachment, ClientError, ConnectMode, Detachment, GcRequest, Request, Response};
use crate::version::{self, VersionReply};

/// What the process prints on stdout and the code it exits with.
#[derive(Debug, Clone, PartialEq)]
pub struct Outcome {
    /// The JSON printed on stdout (a result, a version reply or an error), if any.
    pub stdout: Option<Value>,
    /// 0 on success, 1 on error.
    pub exit_code: i32,
}

impl Outcome {
    fn success(stdout: Option<Value>) -> Self {
        Self { stdout, exit_code: 0 }
    }

    fn failure(error: &CniError, cni_version: &str) -> Self {
        Self {
            stdout: Some(error.to_json(cni_version)),
            exit_code: 1,
        }
    }
}

/// Runs one invocation. `read_stdin` is called at most once, and not when `CNI_COMMAND` is unset;
/// human-readable logs go to `log` (stderr in the binary).
pub fn run(getenv: Getenv<'_>, read_stdin: impl FnOnce() -> io::Result<Vec<u8>>, log: &mut dyn Write) -> Outcome {
    let command = match Command::from_env(getenv) {
        Ok(Some(command)) => command,
        Ok(None) => {
            let _ = writeln!(
                log,
                "npm-cni: CNI chained plugin of npm; CNI protocol versions supported: {}",
                version::SUPPORTED_VERSIONS.join(", ")
            );
            let error = CniError::new(
                ErrorCode::InvalidEnvironment,
                "required env variables [CNI_COMMAND] missing",
            );
            return Outcome::failure(&error, version::LATEST);
        }
        Err(error) => return Outcome::failure(&error, version::LATEST),
    };
    let stdin = match read_stdin() {
        Ok(stdin) => stdin,
        Err(e) => {
            let error = CniError::new(
                ErrorCode::IoFailure,
                "error reading the network configuration from stdin",
            )
            .with_details(e.to_string());
            return Outcome::failure(&error, version::LATEST);
        }
    };
    if command == Command::Version {
        let reply = VersionReply::for_input(&stdin);
        return Outcome::success(Some(serde_json::to_value(reply).expect("a version reply serializes")));
    }
    match dispatch(command, getenv, &stdin, log) {
        Ok(stdout) => Outcome::success(stdout),
        Err(error) => {
            let _ = writeln!(log, "npm-cni: {error}");
            Outcome::failure(&error, version::sniff(&stdin))
        }
    }
}

fn dispatch(
    command: Command,
    getenv: Getenv<'_>,
    stdin: &[u8],
    log: &mut dyn Write,
) -> Result<Option<Value>, CniError> {
    match command {
        Command::Add => add(&AttachmentEnv::from_env(getenv, command)?, &NetConf::parse(stdin)?, log).map(Some),
        Command::Check => {
            check(&AttachmentEnv::from_env(getenv, command)?, &NetConf::parse(stdin)?, log).map(|()| None)
        }
        Command::Del => del(&AttachmentEnv::from_env(getenv, command)?, &NetConf::parse(stdin)?, log).map(|()| None),
        Command::Status => status(&NetConf::parse(stdin)?).map(|()| None),
        Command::Gc => gc(&NetConf::parse(stdin)?).map(|()| None),
        Command::Version => unreachable!("VERSION is answered before dispatch"),
    }
}

/// Builds the attachment of ADD and CHECK, which both require a previous result.
fn attachment(env: &AttachmentEnv, conf: &NetConf, command: &str) -> Result<(Attachment, Value), CniError> {
    let pod = env.pod()?;
    let Some(prev_result) = conf.prev_result.clone() else {
        return Err(CniError::new(
            ErrorCode::InvalidNetworkConfig,
            format!("{command}: prevResult is missing"),
        )
        .with_details(
            "npm-cni is a chained plugin: list it after the plugin that creates the pod's interface \
                 (ptp, bridge, ...) in the same conflist",
        ));
    };
    let endpoint = Endpoint::from_prev_result(&prev_result, &env.ifname)?;
    if endpoint.ips.is_empty() {
        return Err(CniError::new(
            ErrorCode::InvalidNetworkConfig,
            format!("{command}: prevResult has no address for interface {}", env.ifname),
        )
        .with_details("npm-cni must run after the plugin that assigns the pod's addresses"));
    }
    let attachment = Attachment {
        network: conf.name.clone(),
        cni_version: conf.cni_version.clone(),
        container_id: env.container_id.clone(),
        ifname: env.ifname.clone(),
        netns: env.netns.clone().unwrap_or_default(),
        pod,
        host_interfaces: endpoint.host_interfaces,
        sandbox_interface: endpoint.sandbox_interface,
        ips: endpoint.ips,
    };
    Ok((attachment, prev_result))
}

/// With `failOpen`, a runtime that names the pod but passes no `K8S_POD_UID` gets the previous
/// result back (the pod starts unenforced until the agent finds its interface from the API's
/// addresses, as without npm-cni); without it, the ADD or CHECK is refused, naming the requirement
/// ([`crate::env::POD_UID_REQUIREMENT`]).
fn uid_fail_open(env: &AttachmentEnv, conf: &NetConf, command: &str, log: &mut dyn Write) -> Option<Value> {
    if !(conf.fail_open && env.lacks_only_pod_uid()) {
        return None;
    }
    let prev_result = conf.prev_result.clone()?;
    let _ = writeln!(
        log,
        "npm-cni: failOpen: {command} of container {} proceeds without the agent: CNI_ARGS lacks K8S_POD_UID \
         (the container runtime does not pass it)",
        env.container_id
    );
    Some(prev_result)
}

fn add(env: &AttachmentEnv, conf: &NetConf, log: &mut dyn Write) -> Result<Value, CniError> {
    if let Some(prev_result) = uid_fail_open(env, conf, "ADD", log) {
        return Ok(prev_result);
    }
    let (attachment, prev_result) = attachment(env, conf, "ADD")?;
    let pod = format!(
        "{}/{} (uid {})",
        attachment.pod.namespace, attachment.pod.name, attachment.pod.uid
    );
    match agent(conf, Request::Add(attachment), ConnectMode::RetryUntilDeadline) {
        Ok(()) => Ok(prev_result),
        Err(AgentFailure::Unanswered(e)) if conf.fail_open => {
            let _ = writeln!(log, "npm-cni: failOpen: ADD of pod {pod} proceeds unenforced: {e}");
            Ok(prev_result)
        }
        Err(failure) => Err(failure.into_cni_error(&format!("ADD of pod {pod}"))),
    }
}

fn check(env: &AttachmentEnv, conf: &NetConf, log: &mut dyn Write) -> Result<(), CniError> {
    // 0.3.x has no CHECK: the spec wants an incompatible-version error for it.
    require_version(conf, version::CHECK_SINCE, "CHECK")?;
    if uid_fail_open(env, conf, "CHECK", log).is_some() {
        return Ok(());
    }
    let (attachment, _) = attachment(env, conf, "CHECK")?;
    let pod = format!("{}/{}", attachment.pod.namespace, attachment.pod.name);
    match agent(conf, Request::Check(attachment), ConnectMode::RetryUntilDeadline) {
        Ok(()) => Ok(()),
        Err(AgentFailure::Unanswered(e)) if conf.fail_open => {
            let _ = writeln!(log, "npm-cni: failOpen: CHECK of pod {pod} passes unverified: {e}");
            Ok(())
        }
        Err(failure) => Err(failure.into_cni_error(&format!("CHECK of pod {pod}"))),
    }
}

/// DEL is best effort (the spec wants it to succeed as far as possible): every failure is logged only.
fn del(env: &AttachmentEnv, conf: &NetConf, log: &mut dyn Write) -> Result<(), CniError> {
    let endpoint = conf
        .prev_result
        .as_ref()
        .map(|prev| Endpoint::from_prev_result(prev, &env.ifname));
    let (host_interfaces, ips) = match endpoint {
        Some(Ok(endpoint)) => (endpoint.host_interfaces, endpoint.ips),
        Some(Err(e)) => {
            let _ = writeln!(log, "npm-cni: DEL ignores an unreadable prevResult: {e}");
            (Vec::new(), Vec::new())
        }
        None => (Vec::new(), Vec::new()),
    };
    let request = Request::Del(Detachment {
        network: conf.name.clone(),
        container_id: env.container_id.clone(),
        ifname: env.ifname.clone(),
        netns: env.netns.clone(),
        pod: env.pod().ok(),
        host_interfaces,
        ips,
    });
    if let Err(failure) = agent(conf, request, ConnectMode::Once) {
        let error = failure.into_cni_error(&format!("DEL of container {}", env.container_id));
        let _ = writeln!(log, "npm-cni: DEL succeeds anyway: {error}");
    }
    Ok(())
}

fn status(conf: &NetConf) -> Result<(), CniError> {
    require_version(conf, "1.1.0", "STATUS")?;
    agent(conf, Request::Status, ConnectMode::Once).map_err(|failure| {
        let error = failure.into_cni_error("STATUS");
        CniError {
            code: ErrorCode::PluginNotAvailable,
            ..error
        }
    })
}

fn gc(conf: &NetConf) -> Result<(), CniError> {
    require_version(conf, "1.1.0", "GC")?;
    let request = Request::Gc(GcRequest {
        network: conf.name.clone(),
        valid_attachments: conf.valid_attachments.clone(),
    });
    agent(conf, request, ConnectMode::Once).map_err(|failure| failure.into_cni_error("GC"))
}

fn require_version(conf: &NetConf, minimum: &str, command: &str) -> Result<(), CniError> {
    if version::at_least(&conf.cni_version, minimum) {
        Ok(())
    } else {
        Err(CniError::new(
            ErrorCode::IncompatibleVersion,
            format!("config version does not allow {command}"),
        )
        .with_details(format!(
            "{command} needs cniVersion {minimum} or later, the config has {}",
            conf.cni_version
        )))
    }
}

/// Why the agent did not carry out a request.
enum AgentFailure {
    /// No answer: unreachable or too slow.
    Unanswered(ClientError),
    /// An answer that is not a response.
    Garbage(ClientError),
    /// A response that refuses.
    Refused(Response),
}

impl AgentFailure {
    fn into_cni_error(self, what: &str) -> CniError {
        match self {
            AgentFailure::Unanswered(e) => CniError::new(ErrorCode::TryAgainLater, format!("{what}: {e}"))
                .with_details(
                    "the npm agent must confirm the pod's network policies before it starts; try again later",
                ),
            AgentFailure::Garbage(e) => CniError::new(ErrorCode::AgentProtocol, format!("{what}: {e}")),
            AgentFailure::Refused(response) => {
                let code = if response.retry {
                    ErrorCode::TryAgainLater
                } else {
                    ErrorCode::AgentRefused
                };
                let reason = response.error.unwrap_or_else(|| "no reason given".to_owned());
                CniError::new(code, format!("{what}: refused by the npm agent: {reason}"))
            }
        }
    }
}

fn agent(conf: &NetConf, request: Request, mode: ConnectMode) -> Result<(), AgentFailure> {
    match proto::exchange(&conf.agent_socket, &request, conf.timeout, mode) {
        Ok(response) if response.ok => Ok(()),
        Ok(response) => Err(AgentFailure::Refused(response)),
        Err(e) if e.is_unanswered() => Err(AgentFailure::Unanswered(e)),
        Err(e) => Err(AgentFailure::Garbage(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run_with(vars: &[(&str, &str)], stdin: &str) -> Outcome {
        let vars: Vec<(String, String)> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        let getenv = move |key: &str| vars.iter().find(|(k, _)| k == key).map(|(_, v)| v.clone());
        let stdin = stdin.as_bytes().to_vec();
        run(&getenv, move || Ok(stdin), &mut Vec::new())
    }

    #[test]
    fn version_and_missing_command() {
        let out = run_with(&[("CNI_COMMAND", "VERSION")], r#"{"cniVersion":"1.0.0"}"#);
        assert_eq!(out.exit_code, 0);
        assert_eq!(
            out.stdout.unwrap(),
            serde_json::json!({"cniVersion":"1.0.0","supportedVersions":["0.3.0","0.3.1","0.4.0","1.0.0","1.1.0"]})
        );
        let out = run_with(&[], "");
        assert_eq!(out.exit_code, 1);
        assert_eq!(out.stdout.unwrap()["code"], 4);
        let out = run_with(&[("CNI_COMMAND", "BOGUS")], "");
        assert_eq!(out.stdout.unwrap()["code"], 4);
    }

    #[test]
    fn status_and_gc_need_1_1() {
        let conf = r#"{"cniVersion":"1.0.0","name":"n","type":"npm-cni","agentSocket":"/nonexistent/s"}"#;
        assert_eq!(run_with(&[("CNI_COMMAND", "STATUS")], conf).stdout.unwrap()["code"], 1);
        assert_eq!(run_with(&[("CNI_COMMAND", "GC")], conf).stdout.unwrap()["code"], 1);
        let conf = conf.replace("1.0.0", "1.1.0");
        let out = run_with(&[("CNI_COMMAND", "STATUS")], &conf);
        assert_eq!((out.exit_code, out.stdout.unwrap()["code"].clone()), (1, 50.into()));
    }

    #[test]
    fn check_needs_0_4_and_0_3_add_del_are_served() {
        let env = [
            ("CNI_CONTAINERID", "c"),
            ("CNI_IFNAME", "eth0"),
            ("CNI_NETNS", "/var/run/netns/x"),
            (
                "CNI_ARGS",
                "IgnoreUnknown=1;K8S_POD_NAMESPACE=ns;K8S_POD_NAME=p;K8S_POD_UID=u",
            ),
        ];
        let with = |command: &'static str| {
            let mut v = env.to_vec();
            v.push(("CNI_COMMAND", command));
            v
        };
        for version in ["0.3.0", "0.3.1"] {
            let conf = format!(
                r#"{{"cniVersion":"{version}","name":"n","type":"npm-cni","agentSocket":"/nonexistent/s",
                   "timeoutSeconds":1,"failOpen":true,
                   "prevResult":{{"cniVersion":"{version}","interfaces":[{{"name":"veth1"}},{{"name":"eth0","sandbox":"/x"}}],
                                 "ips":[{{"version":"4","address":"10.0.0.2/24","interface":1}}]}}}}"#
            );
            // CHECK: 1 (incompatible version), even with failOpen.
            let out = run_with(&with("CHECK"), &conf);
            assert_eq!(out.exit_code, 1, "{version}");
            let error = out.stdout.unwrap();
            assert_eq!(
                (error["code"].clone(), error["cniVersion"].clone()),
                (1.into(), version.into())
            );
            // ADD with failOpen and no agent: prevResult back, unchanged.
            let out = run_with(&with("ADD"), &conf);
            assert_eq!(out.exit_code, 0, "{version}: {:?}", out.stdout);
            assert_eq!(out.stdout.unwrap()["ips"][0]["version"], "4");
            // DEL without an agent succeeds.
            assert_eq!(run_with(&with("DEL"), &conf).exit_code, 0);
        }
        // 0.4.0 reaches the agent for CHECK (none here: 11 try again later).
        let conf = r#"{"cniVersion":"0.4.0","name":"n","type":"npm-cni","agentSocket":"/nonexistent/s","timeoutSeconds":1,
            "prevResult":{"interfaces":[{"name":"eth0","sandbox":"/x"}],"ips":[{"version":"4","address":"10.0.0.2/24","interface":0}]}}"#;
        assert_eq!(run_with(&with("CHECK"), conf).stdout.unwrap()["code"], 11);
    }

    /// A runtime that passes no `K8S_POD_UID`: ADD is refused with the runtime requirement
    /// (code 4) however the agent is doing, and with `failOpen` the pod starts (its previous result
    /// back, the agent not asked).
    #[test]
    fn add_without_pod_uid_names_the_runtime_requirement_or_fails_open() {
        let env = [
            ("CNI_COMMAND", "ADD"),
            ("CNI_CONTAINERID", "c"),
            ("CNI_IFNAME", "eth0"),
            ("CNI_NETNS", "/var/run/netns/x"),
            ("CNI_ARGS", "IgnoreUnknown=1;K8S_POD_NAMESPACE=ns;K8S_POD_NAME=p"),
        ];
        let conf = |fail_open: bool| {
            format!(
                r#"{{"cniVersion":"1.0.0","name":"n","type":"npm-cni","agentSocket":"/nonexistent/s",
                   "timeoutSeconds":1,"failOpen":{fail_open},
                   "prevResult":{{"cniVersion":"1.0.0","interfaces":[{{"name":"veth1"}},{{"name":"eth0","sandbox":"/x"}}],
                                 "ips":[{{"address":"10.0.0.2/24","interface":1}}]}}}}"#
            )
        };
        let out = run_with(&env, &conf(false));
        assert_eq!(out.exit_code, 1);
        let error = out.stdout.unwrap();
        assert_eq!(error["code"], 4, "{error}");
        assert_eq!(error["msg"], "CNI_ARGS lacks K8S_POD_UID", "{error}");
        let details = error["details"].as_str().unwrap();
        assert!(
            details.contains("K8S_POD_UID") && details.contains("container runtime"),
            "{details}"
        );
        let out = run_with(&env, &conf(true));
        assert_eq!(out.exit_code, 0, "{:?}", out.stdout);
        assert_eq!(out.stdout.unwrap()["ips"][0]["address"], "10.0.0.2/24");
        let mut check = env.to_vec();
        check[0] = ("CNI_COMMAND", "CHECK");
        assert_eq!(run_with(&check, &conf(true)).exit_code, 0);
        assert_eq!(run_with(&check, &conf(false)).stdout.unwrap()["code"], 4);
    }

    #[test]
    fn del_without_agent_or_prev_result_succeeds() {
        let conf = r#"{"cniVersion":"1.0.0","name":"n","type":"npm-cni","agentSocket":"/nonexistent/s"}"#;
        let out = run_with(
            &[("CNI_COMMAND", "DEL"), ("CNI_CONTAINERID", "c"), ("CNI_IFNAME", "eth0")],
            conf,
        );
        assert_eq!(
            out,
            Outcome {
                stdout: None,
                exit_code: 0
            }
        );
    }
}
