//! Network namespaces and commands for the kernel tests: commands (also
//! inside a namespace), namespaces deleted on drop, threads inside a
//! namespace, IPv4 forwarding held on while a fixture needs it, and the
//! sweep of what a crashed run left (names `<prefix><pid>...` whose process
//! is gone).

use std::os::fd::AsRawFd;
use std::path::Path;
use std::process::Command;

/// Runs a command, panicking with its output on failure; returns its
/// stdout.
pub fn sh(args: &[&str]) -> String {
    let out = Command::new(args[0])
        .args(&args[1..])
        .output()
        .unwrap_or_else(|e| panic!("spawn {args:?}: {e}"));
    assert!(
        out.status.success(),
        "{args:?} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Runs a command, ignoring failure.
pub fn sh_quiet(args: &[&str]) {
    let _ = Command::new(args[0]).args(&args[1..]).output();
}

/// Runs a command in namespace `ns` (`ip netns exec`), panicking if it
/// fails; returns its stdout.
pub fn ns_sh(ns: &str, args: &[&str]) -> String {
    let mut full = vec!["ip", "netns", "exec", ns];
    full.extend_from_slice(args);
    sh(&full)
}

/// Is process `pid` alive?
pub fn pid_alive(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

/// Is `name` (`<prefix><pid>...`) left by a process that is gone?
pub fn pid_gone(name: &str, prefix: &str) -> bool {
    let Some(rest) = name.strip_prefix(prefix) else {
        return false;
    };
    let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
    digits.parse::<u32>().is_ok_and(|p| !pid_alive(p))
}

/// Names `<prefix><pid>...` whose pid is dead: leftovers of a crashed run.
pub fn dead_names(names: impl Iterator<Item = String>, prefix: &str) -> Vec<String> {
    names.filter(|n| pid_gone(n, prefix)).collect()
}

/// Names of the entries of a directory (empty if it cannot be read).
pub fn dir_names(dir: impl AsRef<Path>) -> Vec<String> {
    match std::fs::read_dir(dir) {
        Ok(rd) => rd
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect(),
        Err(_) => Vec::new(),
    }
}

/// Deletes the namespaces named `<prefix><pid>...` whose owning test
/// process is gone (left over by a crashed run).
pub fn clear_netns_leftovers(prefix: &str) {
    for n in dead_names(dir_names("/run/netns").into_iter(), prefix) {
        sh_quiet(&["ip", "netns", "del", &n]);
    }
}

/// Deletes the interfaces named `<prefix><pid>...` whose process is gone.
pub fn clear_stale_links(prefix: &str) {
    for n in dead_names(dir_names("/sys/class/net").into_iter(), prefix) {
        sh_quiet(&["ip", "link", "delete", &n]);
    }
}

/// Removes the entries of `dir` (directories with their contents) named
/// `<prefix><pid>...` whose process is gone.
pub fn clear_stale_dirs(dir: impl AsRef<Path>, prefix: &str) {
    for n in dead_names(dir_names(&dir).into_iter(), prefix) {
        let _ = std::fs::remove_dir_all(dir.as_ref().join(n));
    }
}

/// Deletes the interfaces `links` and the namespaces `namespaces`,
/// ignoring failures (for Drop guards).
pub fn remove_links_and_netns(links: &[String], namespaces: &[String]) {
    for v in links {
        sh_quiet(&["ip", "link", "delete", v]);
    }
    for ns in namespaces {
        sh_quiet(&["ip", "netns", "delete", ns]);
    }
}

/// A network namespace deleted on drop (also on panic).
pub struct Netns {
    /// Its name under /run/netns.
    pub name: String,
}

impl Netns {
    /// Creates `name` (deleting a stale one of the same name first) with
    /// its loopback up.
    pub fn new(name: &str) -> Netns {
        sh_quiet(&["ip", "netns", "del", name]);
        sh(&["ip", "netns", "add", name]);
        sh(&["ip", "-n", name, "link", "set", "lo", "up"]);
        Netns { name: name.to_string() }
    }

    /// Runs a command inside the namespace.
    pub fn exec(&self, args: &[&str]) -> std::process::Output {
        Command::new("ip")
            .args(["netns", "exec", &self.name])
            .args(args)
            .output()
            .unwrap_or_else(|e| panic!("spawn ip netns exec {}: {e}", self.name))
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        sh_quiet(&["ip", "netns", "del", &self.name]);
    }
}

/// Moves the calling thread into namespace `ns` (only this thread).
pub fn enter_netns(ns: &str) {
    let path = format!("/run/netns/{ns}");
    let file = std::fs::File::open(&path).unwrap_or_else(|e| panic!("open {path}: {e}"));
    // SAFETY: setns with a valid, open namespace fd; it changes only the
    // calling thread's network namespace.
    let rc = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
    assert_eq!(rc, 0, "setns {path}: {}", std::io::Error::last_os_error());
}

/// Runs `f` on a new thread that has entered namespace `ns`.
pub fn in_netns<T: Send + 'static>(ns: &str, f: impl FnOnce() -> T + Send + 'static) -> std::thread::JoinHandle<T> {
    let ns = ns.to_string();
    std::thread::spawn(move || {
        enter_netns(&ns);
        f()
    })
}

/// Runs `f` (which may borrow) on a thread inside namespace `ns` and
/// returns its result (a socket opened there stays there: the eBPF
/// dataplane attaches to the interfaces of the calling thread's
/// namespace).
pub fn in_netns_scoped<T: Send>(ns: &str, f: impl FnOnce() -> T + Send) -> T {
    std::thread::scope(|s| {
        s.spawn(|| {
            enter_netns(ns);
            f()
        })
        .join()
        .unwrap_or_else(|_| panic!("thread in netns {ns} panicked"))
    })
}

const FORWARD: &str = "/proc/sys/net/ipv4/ip_forward";

/// How many [`Forwarding`]s live in this process, and the value before the
/// first.
static FORWARDING: std::sync::Mutex<(usize, String)> = std::sync::Mutex::new((0, String::new()));

/// IPv4 forwarding of the root namespace on while it lives, for fixtures
/// whose pods are routed through the root namespace (a Kubernetes node
/// always forwards; a fresh machine may not). Shared by the tests of the
/// process, which run in parallel: the value found before the first is
/// restored after the last, never while another test still needs it.
pub struct Forwarding(());

impl Forwarding {
    /// Switches forwarding on.
    pub fn on() -> Forwarding {
        let mut f = FORWARDING.lock().unwrap_or_else(|e| e.into_inner());
        if f.0 == 0 {
            f.1 = std::fs::read_to_string(FORWARD).unwrap_or_else(|_| "0\n".into());
            std::fs::write(FORWARD, "1\n").expect("enable IPv4 forwarding");
        }
        f.0 += 1;
        Forwarding(())
    }
}

impl Drop for Forwarding {
    fn drop(&mut self) {
        let mut f = FORWARDING.lock().unwrap_or_else(|e| e.into_inner());
        f.0 -= 1;
        if f.0 == 0 {
            let _ = std::fs::write(FORWARD, &f.1);
        }
    }
}
