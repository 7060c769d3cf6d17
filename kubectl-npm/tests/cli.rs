//! `kubectl-npm`'s command line without a cluster: the completion
//! scripts know the commands and the output formats, and a bad timeout
//! is refused with what to give instead.

use std::process::Command;

fn kubectl_npm(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_kubectl-npm"))
        .args(args)
        // No cluster is needed (nor read) for these.
        .env("KUBECONFIG", "/nonexistent")
        .output()
        .expect("run kubectl-npm");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn completion_scripts_know_the_commands_and_output_formats() {
    for shell in ["bash", "zsh", "fish"] {
        let (ok, script, err) = kubectl_npm(&["completion", shell]);
        assert!(ok, "{shell}: {err}");
        for word in [
            "why",
            "observe",
            "status",
            "output",
            "json",
            "yaml",
            "sort-window",
            "idle-timeout",
        ] {
            assert!(script.contains(word), "{shell}: no {word:?} in\n{script}");
        }
    }
    let (ok, _, err) = kubectl_npm(&["completion", "tcsh"]);
    assert!(!ok && err.contains("tcsh"), "{err}");
}

#[test]
fn a_bad_timeout_or_format_is_refused_clearly() {
    let (ok, _, err) = kubectl_npm(&["--idle-timeout", "0", "status"]);
    assert!(!ok && err.contains("want a positive number of seconds"), "{err}");
    let (ok, _, err) = kubectl_npm(&["observe", "--sort-window", "soon"]);
    assert!(!ok && err.contains("want a positive number of seconds"), "{err}");
    let (ok, _, err) = kubectl_npm(&["status", "-o", "xml"]);
    assert!(!ok && err.contains("possible values: text, json, yaml"), "{err}");
}
