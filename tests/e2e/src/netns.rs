//! Small helpers around network namespaces: running `ip`, entering a named
//! netns on the current thread, and reading/writing sysctls.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::process::Command;

/// Errors of the netns helpers.
#[derive(Debug, thiserror::Error)]
pub enum NetnsError {
    /// `ip` could not be started.
    #[error("running `ip {args}`: {source}")]
    Spawn {
        /// The arguments.
        args: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// `ip` exited with an error.
    #[error("`ip {args}` failed: {stderr}")]
    Ip {
        /// The arguments.
        args: String,
        /// Its standard error.
        stderr: String,
    },
    /// A named netns could not be opened.
    #[error("opening netns {name}: {source}")]
    Open {
        /// Netns name.
        name: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// setns(2) failed.
    #[error("entering netns {name}: {source}")]
    Setns {
        /// Netns name (or "root").
        name: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// A sysctl could not be read or written.
    #[error("sysctl {key}: {source}")]
    Sysctl {
        /// The sysctl key (dotted).
        key: String,
        /// The I/O error.
        source: std::io::Error,
    },
}

/// Runs `ip <args>` and returns its stdout.
pub fn ip(args: &[&str]) -> Result<String, NetnsError> {
    let joined = args.join(" ");
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|source| NetnsError::Spawn {
            args: joined.clone(),
            source,
        })?;
    if !out.status.success() {
        return Err(NetnsError::Ip {
            args: joined,
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Runs `ip -batch -` with the given command lines (one `ip` command per
/// line, without the leading `ip`), inside `netns` when given, failing on
/// the first error.
pub fn ip_batch(netns: Option<&str>, lines: &[String]) -> Result<(), NetnsError> {
    use std::io::Write;
    let text = lines.join("\n") + "\n";
    let mut cmd = Command::new("ip");
    if let Some(ns) = netns {
        cmd.args(["-n", ns]);
    }
    let mut child = cmd
        .args(["-batch", "-"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .map_err(|source| NetnsError::Spawn {
            args: "-batch -".into(),
            source,
        })?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin.write_all(text.as_bytes()).map_err(|source| NetnsError::Spawn {
            args: "-batch - (stdin)".into(),
            source,
        })?;
    }
    let out = child.wait_with_output().map_err(|source| NetnsError::Spawn {
        args: "-batch -".into(),
        source,
    })?;
    if !out.status.success() {
        return Err(NetnsError::Ip {
            args: format!("-batch [{}]", lines.join("; ")),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    Ok(())
}

/// The path of a named netns.
pub fn netns_path(name: &str) -> PathBuf {
    PathBuf::from("/run/netns").join(name)
}

/// An open handle on a named netns.
#[derive(Debug)]
pub struct NetnsHandle {
    name: String,
    file: File,
}

impl NetnsHandle {
    /// Opens the named netns (`/run/netns/<name>`).
    pub fn open(name: &str) -> Result<Self, NetnsError> {
        let file = File::open(netns_path(name)).map_err(|source| NetnsError::Open {
            name: name.to_string(),
            source,
        })?;
        Ok(NetnsHandle {
            name: name.to_string(),
            file,
        })
    }

    /// Opens the netns the calling thread is in.
    pub fn current() -> Result<Self, NetnsError> {
        // SAFETY: gettid has no preconditions and cannot fail.
        let tid = unsafe { libc::gettid() };
        let path = format!("/proc/self/task/{tid}/ns/net");
        let file = File::open(&path).map_err(|source| NetnsError::Open {
            name: path.clone(),
            source,
        })?;
        Ok(NetnsHandle {
            name: "root".into(),
            file,
        })
    }

    /// Moves the calling thread into this netns.
    pub fn enter(&self) -> Result<(), NetnsError> {
        // SAFETY: setns on a valid, open namespace fd; it only changes the
        // calling thread's network namespace.
        let rc = unsafe { libc::setns(self.file.as_raw_fd(), libc::CLONE_NEWNET) };
        if rc != 0 {
            return Err(NetnsError::Setns {
                name: self.name.clone(),
                source: std::io::Error::last_os_error(),
            });
        }
        Ok(())
    }

    /// The netns name.
    pub fn name(&self) -> &str {
        &self.name
    }
}

fn sysctl_path(key: &str) -> PathBuf {
    PathBuf::from("/proc/sys").join(key.replace('.', "/"))
}

/// Reads a sysctl of the calling thread's netns (`net.ipv4.ip_forward`).
pub fn sysctl_get(key: &str) -> Result<String, NetnsError> {
    std::fs::read_to_string(sysctl_path(key))
        .map(|s| s.trim().to_string())
        .map_err(|source| NetnsError::Sysctl {
            key: key.to_string(),
            source,
        })
}

/// Writes a sysctl of the calling thread's netns.
pub fn sysctl_set(key: &str, value: &str) -> Result<(), NetnsError> {
    std::fs::write(sysctl_path(key), value).map_err(|source| NetnsError::Sysctl {
        key: key.to_string(),
        source,
    })
}
