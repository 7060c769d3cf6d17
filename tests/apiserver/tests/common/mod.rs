//! Helpers shared by the tests that run the real `kubectl` (see [`kubectl_path`]): a temporary
//! directory removed on drop, a kubectl runner bound to one kubeconfig and cache, manifests.
#![allow(dead_code)]

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;

/// A temporary directory removed on drop (also when a test panics).
pub struct TempDir(pub PathBuf);

impl TempDir {
    /// A fresh directory for `tag` in the temp dir (leftovers of crashed runs removed).
    pub fn new(tag: &str) -> Self {
        let base = std::env::temp_dir();
        // Clear leftovers of crashed earlier runs of this test.
        if let Ok(entries) = std::fs::read_dir(&base) {
            for e in entries.flatten() {
                let name = e.file_name().to_string_lossy().to_string();
                let Some(pid) = name.strip_prefix(&format!("npm-testapi-{tag}-")) else {
                    continue;
                };
                // Only directories of processes that are gone (a crashed earlier run).
                if !Path::new("/proc").join(pid).exists() {
                    let _ = std::fs::remove_dir_all(e.path());
                }
            }
        }
        let dir = base.join(format!("npm-testapi-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("create temp dir");
        Self(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Runs the real kubectl ([`kubectl_path`]) with one kubeconfig and cache directory.
pub struct Kubectl {
    /// The kubeconfig.
    pub kubeconfig: PathBuf,
    /// kubectl's cache directory.
    pub cache: PathBuf,
}

/// A kubectl run's outcome.
pub struct Out {
    /// Exit status 0.
    pub ok: bool,
    /// Standard output.
    pub stdout: String,
    /// Standard error.
    pub stderr: String,
}

/// The kubectl to run: `$NPM_KUBECTL`, else `/usr/bin/kubectl` or `/usr/local/bin/kubectl`
/// (where `cargo xtask setup` installs it), else `kubectl` from `PATH`. A missing kubectl
/// fails the test (never skipped).
pub fn kubectl_path() -> PathBuf {
    if let Some(p) = std::env::var_os("NPM_KUBECTL") {
        return PathBuf::from(p);
    }
    ["/usr/bin/kubectl", "/usr/local/bin/kubectl"]
        .iter()
        .map(PathBuf::from)
        .find(|p| p.exists())
        .unwrap_or_else(|| PathBuf::from("kubectl"))
}

impl Kubectl {
    /// Run kubectl with `args`.
    pub fn run(&self, args: &[&str]) -> Out {
        let kubectl = kubectl_path();
        let out = Command::new(&kubectl)
            .arg("--kubeconfig")
            .arg(&self.kubeconfig)
            .arg("--cache-dir")
            .arg(&self.cache)
            .args(args)
            .output()
            .unwrap_or_else(|e| {
                panic!(
                    "running {} (install it with `cargo xtask setup`): {e}",
                    kubectl.display()
                )
            });
        Out {
            ok: out.status.success(),
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        }
    }

    /// Run kubectl, asserting success; its stdout.
    pub fn ok(&self, args: &[&str]) -> String {
        let o = self.run(args);
        assert!(o.ok, "kubectl {args:?} failed: {}{}", o.stdout, o.stderr);
        o.stdout
    }

    /// Run kubectl with `-o json`, asserting success; the parsed output.
    pub fn json(&self, args: &[&str]) -> Value {
        let mut a = args.to_vec();
        a.extend(["-o", "json"]);
        serde_json::from_str(&self.ok(&a)).expect("kubectl printed JSON")
    }
}

/// Write `text` to `dir/name`; the path as a string.
pub fn write(dir: &Path, name: &str, text: &str) -> String {
    let p = dir.join(name);
    std::fs::write(&p, text).expect("write manifest");
    p.to_string_lossy().into_owned()
}
