//! The operator command line of the `npm-cni` binary (`install`, `uninstall`, `--version`,
//! `--help`), used when it is given arguments; a runtime runs it without any. Flags are parsed by
//! hand: the binary stays a small, fast-starting plugin.

use std::ffi::OsString;
use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

use crate::config::{DEFAULT_TIMEOUT_SECONDS, MAX_TIMEOUT_SECONDS};
use crate::install::{self, Entry, InstallOptions, UninstallOptions};
use crate::proto::DEFAULT_SOCKET;
use crate::version;

/// Exit code of a usage error.
pub const EXIT_USAGE: i32 = 2;

/// The help text.
pub fn usage() -> String {
    format!(
        "npm-cni {pkg}: CNI chained plugin of npm; holds a pod's start until the npm agent has programmed its \
endpoint.

Usage:
  npm-cni                 run as a CNI plugin (CNI_COMMAND and the other CNI_* variables set, the network
                          configuration on stdin), as a container runtime calls it
  npm-cni install --bin-dir DIR --conf-dir DIR [--socket PATH] [--timeout-seconds N] [--fail-open]
                  [--source PATH] [--wait-seconds N]
                          copy the binary to DIR/npm-cni and chain npm-cni last in the conflist the runtime
                          uses (the first configuration file of --conf-dir by name, which must be a
                          .conflist); idempotent
  npm-cni uninstall --bin-dir DIR --conf-dir DIR
                          remove npm-cni from every conflist of --conf-dir, then DIR/npm-cni; idempotent
  npm-cni --version | --help

install options:
  --bin-dir DIR           the host's CNI plugin directory (e.g. /opt/cni/bin)
  --conf-dir DIR          the host's CNI configuration directory (e.g. /etc/cni/net.d)
  --socket PATH           agentSocket: the agent's unix socket [default: {DEFAULT_SOCKET}]
  --timeout-seconds N     timeoutSeconds: how long ADD waits for the agent, 1 to {MAX_TIMEOUT_SECONDS} [default: \
{DEFAULT_TIMEOUT_SECONDS}]
  --fail-open             failOpen: let ADD succeed, unenforced, when the agent does not answer
  --source PATH           the binary to copy [default: this executable, {self_exe}]
  --wait-seconds N        wait up to N seconds for the primary CNI to write its conflist [default: 0]

Flags take their value as --flag VALUE or --flag=VALUE. Exit codes: 0 done, 1 failed (nothing changed
unless the message says so), 2 usage error.
",
        pkg = env!("CARGO_PKG_VERSION"),
        self_exe = install::SELF_EXE,
    )
}

/// The `--version` line.
pub fn version_line() -> String {
    format!(
        "npm-cni {} (CNI spec versions {})",
        env!("CARGO_PKG_VERSION"),
        version::SUPPORTED_VERSIONS.join(", ")
    )
}

/// A parsed command line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Invocation {
    /// `--help`.
    Help,
    /// `--version`.
    Version,
    /// `install ...`.
    Install(InstallOptions),
    /// `uninstall ...`.
    Uninstall(UninstallOptions),
}

/// Parses the arguments (without the program name); `Err` is a usage error's message.
pub fn parse(args: &[OsString]) -> Result<Invocation, String> {
    let args: Vec<&str> = args
        .iter()
        .map(|a| a.to_str().ok_or_else(|| format!("argument {a:?} is not UTF-8")))
        .collect::<Result<_, _>>()?;
    let Some((&command, rest)) = args.split_first() else {
        return Err("no command".into());
    };
    let command = match command {
        "-h" | "--help" | "help" => return Ok(Invocation::Help),
        "-V" | "--version" | "version" => return Ok(Invocation::Version),
        "install" | "uninstall" => command,
        other => return Err(format!("unknown command {other:?}")),
    };
    let mut flags = Flags::default();
    let mut rest = rest.iter();
    while let Some(&arg) = rest.next() {
        if matches!(arg, "-h" | "--help") {
            return Ok(Invocation::Help);
        }
        let (name, inline) = match arg.split_once('=') {
            Some((name, value)) => (name, Some(value)),
            None => (arg, None),
        };
        if name == "--fail-open" {
            flags.fail_open = match inline {
                None | Some("true") => true,
                Some("false") => false,
                Some(other) => return Err(format!("--fail-open takes no value (or true, false), got {other:?}")),
            };
            continue;
        }
        let slot = match (command, name) {
            (_, "--bin-dir") => &mut flags.bin_dir,
            (_, "--conf-dir") => &mut flags.conf_dir,
            ("install", "--socket") => &mut flags.socket,
            ("install", "--timeout-seconds") => &mut flags.timeout_seconds,
            ("install", "--source") => &mut flags.source,
            ("install", "--wait-seconds") => &mut flags.wait_seconds,
            _ => return Err(format!("unknown flag {arg:?} for {command}")),
        };
        let value = match inline {
            Some(value) => value,
            None => rest.next().copied().ok_or_else(|| format!("{name} needs a value"))?,
        };
        if value.is_empty() {
            return Err(format!("{name} needs a non-empty value"));
        }
        if slot.replace(value.to_owned()).is_some() {
            return Err(format!("{name} is given twice"));
        }
    }
    if command == "uninstall" && flags.fail_open {
        return Err("unknown flag \"--fail-open\" for uninstall".into());
    }
    let bin_dir = PathBuf::from(flags.bin_dir.ok_or("--bin-dir is required")?);
    let conf_dir = PathBuf::from(flags.conf_dir.ok_or("--conf-dir is required")?);
    if command == "uninstall" {
        return Ok(Invocation::Uninstall(UninstallOptions { bin_dir, conf_dir }));
    }
    let agent_socket = flags.socket.unwrap_or_else(|| DEFAULT_SOCKET.to_owned());
    if !agent_socket.starts_with('/') {
        return Err(format!("--socket must be an absolute path, got {agent_socket:?}"));
    }
    let timeout_seconds = match flags.timeout_seconds {
        None => DEFAULT_TIMEOUT_SECONDS,
        Some(v) => v
            .parse()
            .ok()
            .filter(|n| (1..=MAX_TIMEOUT_SECONDS).contains(n))
            .ok_or_else(|| {
                format!("--timeout-seconds must be an integer from 1 to {MAX_TIMEOUT_SECONDS}, got {v:?}")
            })?,
    };
    let wait_seconds = match flags.wait_seconds {
        None => 0,
        Some(v) => v
            .parse()
            .map_err(|_| format!("--wait-seconds must be a whole number of seconds, got {v:?}"))?,
    };
    Ok(Invocation::Install(InstallOptions {
        bin_dir,
        conf_dir,
        source: flags.source.map(PathBuf::from),
        entry: Entry {
            agent_socket,
            timeout_seconds,
            fail_open: flags.fail_open,
        },
        wait: Duration::from_secs(wait_seconds),
    }))
}

#[derive(Default)]
struct Flags {
    bin_dir: Option<String>,
    conf_dir: Option<String>,
    socket: Option<String>,
    timeout_seconds: Option<String>,
    source: Option<String>,
    wait_seconds: Option<String>,
    fail_open: bool,
}

/// Runs the command line `args` (without the program name); returns the exit code.
pub fn run(args: &[OsString], out: &mut dyn Write, err: &mut dyn Write) -> i32 {
    let invocation = match parse(args) {
        Ok(invocation) => invocation,
        Err(message) => {
            let _ = writeln!(err, "npm-cni: {message}\n\n{}", usage());
            return EXIT_USAGE;
        }
    };
    match invocation {
        Invocation::Help => {
            let _ = write!(out, "{}", usage());
            0
        }
        Invocation::Version => {
            let _ = writeln!(out, "{}", version_line());
            0
        }
        Invocation::Install(options) => match install::install(&options) {
            Ok(report) => {
                let _ = writeln!(
                    out,
                    "npm-cni: binary {} {}; conflist {} {} (agentSocket {}, timeoutSeconds {}, failOpen {})",
                    report.binary.display(),
                    report.binary_change,
                    report.conflist.display(),
                    report.conflist_change,
                    options.entry.agent_socket,
                    options.entry.timeout_seconds,
                    options.entry.fail_open
                );
                0
            }
            Err(e) => {
                let _ = writeln!(err, "npm-cni install: {e}");
                1
            }
        },
        Invocation::Uninstall(options) => match install::uninstall(&options) {
            Ok(report) => {
                for (path, reason) in &report.skipped {
                    let _ = writeln!(err, "npm-cni uninstall: left {} as it is: {reason}", path.display());
                }
                let conflists: Vec<String> = report.conflists.iter().map(|p| p.display().to_string()).collect();
                let _ = writeln!(
                    out,
                    "npm-cni: removed from {} conflist(s){}{}; binary {}",
                    conflists.len(),
                    if conflists.is_empty() { "" } else { ": " },
                    conflists.join(", "),
                    if report.binary_removed {
                        "removed"
                    } else {
                        "was not installed"
                    }
                );
                0
            }
            Err(e) => {
                let _ = writeln!(err, "npm-cni uninstall: {e}");
                1
            }
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(line: &str) -> Vec<OsString> {
        line.split_whitespace().map(OsString::from).collect()
    }

    #[test]
    fn parses_both_flag_forms_and_defaults() {
        let Ok(Invocation::Install(options)) = parse(&args(
            "install --bin-dir=/b --conf-dir /c --timeout-seconds=3 --fail-open",
        )) else {
            panic!("not an install")
        };
        assert_eq!(
            (options.bin_dir, options.conf_dir, options.source, options.wait),
            ("/b".into(), "/c".into(), None, Duration::ZERO)
        );
        assert_eq!(
            options.entry,
            Entry {
                agent_socket: DEFAULT_SOCKET.into(),
                timeout_seconds: 3,
                fail_open: true
            }
        );
        assert_eq!(
            parse(&args("uninstall --conf-dir /c --bin-dir /b")),
            Ok(Invocation::Uninstall(UninstallOptions {
                bin_dir: "/b".into(),
                conf_dir: "/c".into()
            }))
        );
        assert_eq!(parse(&args("--version")), Ok(Invocation::Version));
        assert_eq!(parse(&args("install --help")), Ok(Invocation::Help));
    }

    #[test]
    fn usage_errors() {
        for line in [
            "bogus",
            "install --conf-dir /c",
            "install --bin-dir /b --conf-dir",
            "install --bin-dir /b --conf-dir /c --socket rel",
            "install --bin-dir /b --conf-dir /c --timeout-seconds 0",
            "install --bin-dir /b --conf-dir /c --wait-seconds soon",
            "install --bin-dir /b --bin-dir /b2 --conf-dir /c",
            "uninstall --bin-dir /b --conf-dir /c --socket /s",
            "uninstall --bin-dir /b --conf-dir /c --fail-open",
        ] {
            assert!(parse(&args(line)).is_err(), "{line}");
        }
    }
}
