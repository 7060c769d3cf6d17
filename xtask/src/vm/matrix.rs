//! `cargo xtask vm matrix`: the kernel checks on each row (Debian's 5.10,
//! 6.1 and 6.12 under qemu, the host's kernel directly, and Debian's arm64
//! 6.12 under `qemu-system-aarch64` with cross-built binaries:
//! `debian-arm64`), one list of checks for all ([`checks`]).
//!
//! The host builds the `npm-dataplane` kernel test binary, the agent and
//! the BPF object; one boot per row runs a script of checks in the guest
//! (the test binary with name filters, `NPM_EBPF_OBJECT` set), each check
//! printing `NPM-CHECK <name> <status> <seconds>`; the guests then run the
//! conformance runner's `default-deny*` cases on eBPF and nftables, through
//! ClusterIPs on two nodes ([`conformance_checks`]). Rows below the kernel
//! floor (5.10: no `bpf_ktime_get_coarse_ns`) check instead that the agent
//! refuses to start, naming what is missing.

use std::io::Write;
use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context, Result};

use crate::{cargo, ebpf_object, root};

/// One check: a name and a shell command run in the checkout.
struct Check {
    name: &'static str,
    script: String,
}

/// What a row's kernel offers.
#[derive(Clone, Copy, PartialEq)]
enum Floor {
    /// Below the floor: the agent must refuse.
    Refuses,
    /// No tcx (before 6.6): tc `clsact` filters.
    Clsact,
    /// tcx.
    Tcx,
}

fn row_floor(row: &str) -> Floor {
    match row {
        "debian-5.10" => Floor::Refuses,
        "debian-6.1" => Floor::Clsact,
        _ => Floor::Tcx,
    }
}

pub const ROWS: &[&str] = &["debian-5.10", "debian-6.1", "debian-6.12", "host", "debian-arm64"];

/// The binaries a row runs, as paths: the host's debug builds, or the
/// arm64 cross builds (`crate::arm64`) on the `debian-arm64` row.
struct Bins {
    tests: String,
    agent: String,
    cni: String,
    conformance: String,
}

/// The conformance steps of every guest row (the Debian kernels under
/// qemu, amd64 and arm64): the runner's `default-deny*` cases (ingress,
/// all, UDP, SCTP: 4) on eBPF on one node with pod addresses; the same
/// on eBPF through ClusterIPs on two nodes (two node netns, hand-made veth
/// pods, the test kube-proxy in nftables mode); and the same on nftables
/// through ClusterIPs on two nodes (kube-proxy in iptables mode, as CI's
/// nftables run on the host). Every agent runs with `--attach auto`: tc
/// `clsact` filters on 6.1, tcx on 6.12. The runner's names (netns,
/// links, its work directory) carry its pid, and it removes those of a
/// dead runner first, so a step that crashed leaves nothing for the next;
/// the guest's `/run` and `/tmp` are its own.
fn conformance_checks(bins: &Bins, ci: bool) -> Vec<Check> {
    let run = |dataplane: &str, extra: &str| {
        format!(
            "{} --dataplane {dataplane} --filter default-deny --agent-bin {} --npm-cni-bin {} --cases tests/conformance {extra}",
            bins.conformance, bins.agent, bins.cni
        )
    };
    // Two agents loading the datapath at once, and each node's kube-proxy
    // first pass loading the nf_tables modules of its rules (one module
    // autoload, and one replay of the transaction, each), take longer than
    // the runner's 30 s startup deadline under TCG: 300 s (probe matrices
    // that match are not slowed by it).
    let two_nodes = |kube_proxy: &str| {
        format!("--nodes 2 --cni veth --kube-proxy {kube_proxy} --destination service --deadline-secs 300")
    };
    let services = Check {
        name: "conformance default-deny, eBPF, two nodes through Services",
        script: run("ebpf", &two_nodes("nftables")),
    };
    if ci {
        return vec![services];
    }
    vec![
        Check {
            name: "conformance default-deny, eBPF, one node",
            script: run("ebpf", ""),
        },
        services,
        Check {
            name: "conformance default-deny, nftables, two nodes through Services",
            script: run("nftables", &two_nodes("iptables")),
        },
    ]
}

/// The `dataplane` test binary (built now if needed).
fn dataplane_tests() -> Result<PathBuf> {
    let mut cmd = cargo();
    cmd.arg("test");
    dataplane_test_binary(cmd, "")
}

/// Builds the `dataplane` test binary with `cmd` (a `cargo test` for the
/// wanted target, `label` naming it in errors: `""` or `"arm64 "`) and
/// returns its path, from cargo's JSON messages.
pub(crate) fn dataplane_test_binary(mut cmd: Command, label: &str) -> Result<PathBuf> {
    let out = cmd
        .args([
            "-p",
            "npm-dataplane",
            "--test",
            "dataplane",
            "--no-run",
            "--message-format=json",
        ])
        .current_dir(root())
        .stderr(std::process::Stdio::inherit())
        .output()
        .with_context(|| format!("cargo test --no-run ({label}dataplane)"))?;
    if !out.status.success() {
        bail!("building the {label}npm-dataplane kernel tests failed");
    }
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["reason"] == "compiler-artifact" && v["target"]["name"] == "dataplane")
        .find_map(|v| v["executable"].as_str().map(PathBuf::from))
        .with_context(|| format!("no {label}dataplane test executable in cargo's output"))
}

/// The checks of a row, one list for every row: the kernel tests, the
/// agent, then (the guests) [`conformance_checks`]. The host row runs every
/// attach and Service test and no conformance step (`cargo xtask test`
/// runs the catalogue there); the guests (TCG, minutes per program load)
/// a subset of the tests. The `debian-arm64` row keeps the kernel-test
/// subset it always ran: no tunnel tests (its root has no `wg`) and no
/// nftables Service kernel test.
fn checks(row: &str, bins: &Bins, kubeconfig: &str, ci: bool) -> Vec<Check> {
    let floor = row_floor(row);
    let full = row == "host";
    let arm64 = row == "debian-arm64";
    // The amd64 guests' kernels are Debian's, with every module, and their
    // root (the host's) has `wg`.
    let row_has_modules = !full && !arm64;
    let (tests, agent) = (&bins.tests, &bins.agent);
    let t = |filters: &[&str]| format!("{tests} --test-threads 2 {}", filters.join(" "));
    // The agent as the DaemonSet starts it (`--attach auto`), up to opening
    // the dataplane: the kernel check, then loading the programs (the API
    // server at the kubeconfig's address is never there, so it stops after).
    let agent_cmd = format!(
        "RUST_BACKTRACE=0 NO_COLOR=1 timeout 900 {agent} run --node-name vm --kubeconfig {kubeconfig} --dataplane ebpf \
         --attach auto --pin-dir /sys/fs/bpf/npm-vm"
    );
    match floor {
        Floor::Refuses => vec![Check {
            name: "agent refuses below the floor",
            script: format!(
                "out=$({agent_cmd} 2>&1); rc=$?; rm -rf /sys/fs/bpf/npm-vm; echo \"$out\" | grep -E 'Error|missing' | head -n 3; echo \"agent exit $rc\"; \
                 [ $rc -ne 0 ] && [ $rc -ne 124 ] && echo \"$out\" | grep -q 'cannot run the npm datapath' \
                 && echo \"$out\" | grep -q 'bpf_ktime_get_coarse_ns'"
            ),
        }],
        Floor::Clsact | Floor::Tcx => {
            let attach: &[&str] = match floor {
                _ if full => &["ebpf_attach_modes::"],
                Floor::Tcx => &[
                    "ebpf_attach_modes::the_kernel_has_what_each_mode_needs",
                    "ebpf_attach_modes::tc_detach_leaves_foreign_filters_and_the_qdisc",
                ],
                // The other tests force tcx or assert that it exists.
                _ => &[
                    "ebpf_attach_modes::tc_detach_leaves_foreign_filters_and_the_qdisc",
                    "ebpf_attach_modes::a_plain_reattach_would_duplicate_or_fail_where_the_replace_swaps",
                ],
            };
            let services: &[&str] = match floor {
                _ if full => &["ebpf_services::", "nft_services::"],
                Floor::Tcx if arm64 => &[
                    "ebpf_services::cluster_ip_is_decided_for_the_chosen_backend",
                    "ebpf_services::remote_backends_are_decided_",
                ],
                Floor::Tcx => &[
                    "ebpf_services::cluster_ip_is_decided_for_the_chosen_backend",
                    "ebpf_services::remote_backends_are_decided_",
                    "nft_services::",
                ],
                // Every Service test but those that force tcx (the
                // others attach as the kernel allows; the mark tests run
                // their tc variants).
                _ => &[
                    "ebpf_services::",
                    "nft_services::",
                    "--skip",
                    "ebpf_services::remote_backends_are_decided_where_the_packet_leaves_the_node",
                    "--skip",
                    "_to_its_sender_tcx",
                ],
            };
            // Real IPIP and WireGuard: modules the host kernel lacks, so
            // the tests are ignored in the host's suite and run here.
            let tunnels: &[&str] = if row_has_modules {
                &["ebpf_tunnels::", "--include-ignored"]
            } else {
                &[]
            };
            // One process: a verifier that refuses the full datapath walks
            // it once per process (minutes under TCG), then every load is
            // the reduced one. `--nocapture` for the verified instruction
            // counts.
            let kernel_tests: Vec<&str> = ["ebpf_verifier::"]
                .iter()
                .chain(attach)
                .chain(services)
                .chain(tunnels)
                .chain(&["--nocapture"])
                .copied()
                .collect();
            let mut v = vec![Check {
                name: if row_has_modules {
                    "kernel tests: verifier, attach modes, Services, IPIP and WireGuard"
                } else {
                    "kernel tests: verifier, attach modes, Services"
                },
                script: t(&kernel_tests),
            }];
            // Until it logs `starting` (the dataplane is open: programs
            // loaded) or exits; then stopped.
            v.push(Check {
                name: "agent opens the dataplane (--attach auto)",
                script: format!(
                    "log=/tmp/npm-vm-agent.log; {agent_cmd} >$log 2>&1 & pid=$!; i=0; \
                     while kill -0 $pid 2>/dev/null && ! grep -q ' starting' $log && [ $i -lt 900 ]; do sleep 1; i=$((i+1)); done; \
                     kill $pid 2>/dev/null; wait $pid; rm -rf /sys/fs/bpf/npm-vm; \
                     grep -E 'kernel features checked| starting|Error|missing' $log | cut -c1-240 | head -n 5; \
                     grep -q ' starting' $log"
                ),
            });
            if !full {
                v.extend(conformance_checks(bins, ci));
            }
            v
        }
    }
}

/// The row's script: each check's output, then its marker line.
fn script(checks: &[Check]) -> String {
    let mut s = String::from("echo \"kernel $(uname -r)\"\n");
    for c in checks {
        s.push_str(&format!(
            "echo '== {name}'\nstart=$(date +%s)\n( {cmd} ) </dev/null 2>&1\nrc=$?\necho \"NPM-CHECK {name}|$rc|$(( $(date +%s) - start ))\"\n",
            name = c.name,
            cmd = c.script,
        ));
    }
    s
}

pub fn matrix(only: &[String], ci: bool) -> Result<()> {
    let rows: Vec<&str> = ROWS
        .iter()
        .copied()
        .filter(|r| only.is_empty() || only.iter().any(|o| o == r))
        .collect();
    if rows.is_empty() {
        bail!("no such row: {}", ROWS.join(", "));
    }
    crate::build_ebpf()?;
    let amd64 = rows.iter().any(|r| *r != "debian-arm64");
    let s = |p: PathBuf| p.to_string_lossy().into_owned();
    let arm64 = if rows.contains(&"debian-arm64") {
        let tests = crate::arm64::build_vm_row()?;
        let release = crate::arm64::release_dir();
        Some(Bins {
            tests: s(tests),
            agent: s(release.join("npm-agent")),
            cni: s(release.join("npm-cni")),
            conformance: s(release.join("npm-conformance")),
        })
    } else {
        None
    };
    let amd64 = if amd64 {
        // As `cargo xtask conformance` builds them (the workspace's
        // features: nothing is rebuilt after `cargo xtask test`'s build).
        crate::build_bins(&["npm-agent", "npm-cni", "npm-conformance"])?;
        let debug = root().join("target/debug");
        Some(Bins {
            tests: s(dataplane_tests()?),
            agent: s(debug.join("npm-agent")),
            cni: s(debug.join("npm-cni")),
            conformance: s(debug.join("npm-conformance")),
        })
    } else {
        None
    };
    let dir = root().join("target/vm-matrix");
    std::fs::create_dir_all(&dir)?;
    // An API server that is never there: the agent stops after its kernel
    // check and program load.
    let kubeconfig = dir.join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        "apiVersion: v1\nkind: Config\nclusters:\n- name: none\n  cluster:\n    server: https://127.0.0.1:1\n    \
         insecure-skip-tls-verify: true\ncontexts:\n- name: none\n  context:\n    cluster: none\n    user: none\n\
         current-context: none\nusers:\n- name: none\n  user:\n    token: none\n",
    )?;
    let object = ebpf_object();
    let mut passed = 0;
    let mut failed = 0;
    let mut summary = Vec::new();
    for row in rows {
        let bins = match row {
            "debian-arm64" => arm64.as_ref(),
            _ => amd64.as_ref(),
        }
        .context("the row's binaries were built")?;
        let checks = checks(row, bins, &kubeconfig.to_string_lossy(), ci);
        let script_path = dir.join(format!("{row}.sh"));
        std::fs::write(&script_path, script(&checks))?;
        eprintln!("xtask: vm matrix: row {row}");
        let started = Instant::now();
        let mut results: Vec<(String, i32, String)> = Vec::new();
        let mut insns: Vec<String> = Vec::new();
        let mut kernel = String::new();
        let log_path = dir.join(format!("{row}.log"));
        let mut log = std::fs::File::create(&log_path)?;
        let mut on_line = |l: &str| {
            let _ = writeln!(log, "{l}");
            if let Some(rest) = l.strip_prefix("NPM-CHECK ") {
                let p: Vec<&str> = rest.split('|').collect();
                if p.len() == 3 {
                    results.push((p[0].to_string(), p[1].parse().unwrap_or(-1), p[2].to_string()));
                }
            } else {
                if l.contains("instructions verified") || l.starts_with("datapath: ") {
                    insns.push(l.trim().to_string());
                }
                if let Some(k) = l.strip_prefix("kernel ") {
                    kernel = k.to_string();
                }
                if shown(l) {
                    println!("  {}", l.chars().take(240).collect::<String>());
                }
            }
        };
        let sh = vec!["sh".to_string(), script_path.to_string_lossy().into_owned()];
        let env = [("NPM_EBPF_OBJECT".to_string(), object.to_string_lossy().into_owned())];
        let status = if row == "host" {
            run_host(&sh, &env, &mut on_line)
        } else {
            super::run(row, &sh, &env, &mut on_line)
        };
        let secs = started.elapsed().as_secs_f64();
        println!("  (the row's whole output: {})", log_path.display());
        if let Err(e) = &status {
            println!("  {row}: {e:#}");
        }
        for c in &checks {
            match results.iter().find(|r| r.0 == c.name) {
                Some((_, 0, s)) => {
                    passed += 1;
                    println!("{row}: PASS {} ({s} s)", c.name);
                }
                Some((_, rc, s)) => {
                    failed += 1;
                    println!("{row}: FAIL {} (status {rc}, {s} s)", c.name);
                }
                None => {
                    failed += 1;
                    println!("{row}: FAIL {} (did not run)", c.name);
                }
            }
        }
        summary.push(format!(
            "{row} ({kernel}): {:.0} s{}",
            secs,
            if insns.is_empty() {
                String::new()
            } else {
                format!("; {}", insns.join("; "))
            }
        ));
    }
    for s in &summary {
        println!("{s}");
    }
    println!("{passed} passed, {failed} failed");
    if failed > 0 {
        bail!("{failed} matrix checks failed");
    }
    Ok(())
}

/// The lines of a row's output shown on the terminal (all of them go to
/// `target/vm-matrix/<row>.log`; a rejected load prints the whole verifier
/// log).
fn shown(l: &str) -> bool {
    let t = l.trim_start();
    t.starts_with("test ")
        || t.starts_with("== ")
        || t.starts_with("kernel ")
        || t.starts_with("agent exit")
        || t.starts_with("Error")
        || t.contains("instructions verified")
        || t.starts_with("datapath: ")
        || t.contains("panicked at")
        || t.contains("load (verifier)")
        || t.contains("BPF program is too large")
        || t.starts_with("processed ")
        || t.contains("kernel features checked")
        || t.starts_with("xtask:")
}

/// The host row: the same script, run directly.
fn run_host(command: &[String], env: &[(String, String)], line: &mut dyn FnMut(&str)) -> Result<i32> {
    use std::io::{BufRead, BufReader};
    let mut child = Command::new(&command[0])
        .args(&command[1..])
        .envs(env.iter().cloned())
        .current_dir(root())
        .stdout(std::process::Stdio::piped())
        .spawn()?;
    let reader = BufReader::new(child.stdout.take().expect("piped"));
    for l in reader.lines() {
        line(&l?);
    }
    Ok(child.wait()?.code().unwrap_or(-1))
}
