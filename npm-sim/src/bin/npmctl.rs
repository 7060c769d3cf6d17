//! `npmctl`: the NetworkPolicy and ClusterNetworkPolicy simulator on YAML
//! files (Namespace, Pod, NetworkPolicy, ClusterNetworkPolicy objects).
//!
//! - `npmctl matrix -f objects.yaml --port 80 --protocol TCP`
//! - `npmctl explain -f ... --from ns/pod --to ns/pod --port 80`
//! - `npmctl ports -f ... --from ns/pod --to ns/pod` (every protocol and
//!   port, in runs decided alike)
//! - `npmctl validate -f ...`
//! - `npmctl compile -f ... [--node N]` (the compiled tables)
//! - `npmctl cases PATH...` (case files or directories of them)
//! - `npmctl lint -f ... [-o json]` (shadowed, overlapping and dead rules)
//! - `npmctl exposure -f ... [--cluster-cidr CIDR]... [-o json]`
//! - `npmctl preview -f current.yaml --apply new.yaml [--delete np/NS/NAME] --flows FILE [-o json]`

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use npm_policy::model::Protocol;
use npm_sim::sim;

#[derive(Parser)]
#[command(name = "npmctl", about = "NetworkPolicy and ClusterNetworkPolicy simulator")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(clap::Args)]
struct Files {
    /// YAML files of Namespace, Pod, NetworkPolicy and ClusterNetworkPolicy
    /// objects.
    #[arg(short = 'f', long = "file", required = true)]
    files: Vec<PathBuf>,
}

#[derive(clap::Args)]
struct Pods {
    /// Source pod, namespace/name.
    #[arg(long)]
    from: String,
    /// Destination pod, namespace/name.
    #[arg(long)]
    to: String,
}

#[derive(clap::Args)]
struct PortArgs {
    /// Destination port.
    #[arg(long, default_value_t = 80)]
    port: u16,
    /// TCP, UDP or SCTP.
    #[arg(long, default_value = "TCP")]
    protocol: String,
}

/// Output format of the analyses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum Output {
    /// Human lines.
    Text,
    /// One JSON document.
    Json,
}

#[derive(Subcommand)]
enum Cmd {
    /// Findings about the policies: shadowed, overlapping or dead
    /// ClusterNetworkPolicy rules, Pass rules without effect, policies and
    /// peers selecting nothing, undefined named ports. Exits 1 when a
    /// finding is an error.
    Lint {
        #[command(flatten)]
        files: Files,
        /// Output format.
        #[arg(short = 'o', long, value_enum, default_value = "text")]
        output: Output,
    },
    /// Per namespace and direction: the pods no policy isolates, and the
    /// rules opening pods to (or towards) addresses outside the cluster.
    Exposure {
        #[command(flatten)]
        files: Files,
        /// The cluster's pod CIDRs (repeatable; default: the /16 or /64 of
        /// each pod address). Addresses outside them, of no pod and no
        /// node, are outside the cluster.
        #[arg(long = "cluster-cidr")]
        cluster_cidrs: Vec<ipnet::IpNet>,
        /// Output format.
        #[arg(short = 'o', long, value_enum, default_value = "text")]
        output: Output,
    },
    /// Replays recorded flows (the agent's flow-log JSON lines, as
    /// `kubectl npm observe -o json` prints them; allowed flows only with
    /// the agent's `--flow-logs-allow`) on the state of `-f` and on that
    /// state with `--apply` applied; lists the flows whose verdict changes.
    Preview {
        /// The current state.
        #[command(flatten)]
        files: Files,
        /// Objects to apply on top (same kind, namespace and name replace).
        #[arg(long = "apply", required_unless_present = "delete")]
        apply: Vec<PathBuf>,
        /// Objects to remove: networkpolicy/NAMESPACE/NAME or
        /// clusternetworkpolicy/NAME (repeatable).
        #[arg(long = "delete")]
        delete: Vec<String>,
        /// The flow records, one JSON object a line (`-`: stdin).
        #[arg(long)]
        flows: PathBuf,
        /// Output format.
        #[arg(short = 'o', long, value_enum, default_value = "text")]
        output: Output,
    },
    /// Reachability matrix over all pods.
    Matrix {
        #[command(flatten)]
        files: Files,
        #[command(flatten)]
        port: PortArgs,
    },
    /// Explain one flow.
    Explain {
        #[command(flatten)]
        files: Files,
        #[command(flatten)]
        pods: Pods,
        #[command(flatten)]
        port: PortArgs,
    },
    /// Every protocol and destination port from one pod to another, in
    /// runs decided alike, with the rule deciding each end.
    Ports {
        #[command(flatten)]
        files: Files,
        #[command(flatten)]
        pods: Pods,
    },
    /// Report invalid policies.
    Validate {
        #[command(flatten)]
        files: Files,
    },
    /// Print the compiled tables for a node.
    Compile {
        #[command(flatten)]
        files: Files,
        /// Node name.
        #[arg(long, default_value = sim::SIM_NODE)]
        node: String,
    },
    /// Run conformance case files against the simulator.
    Cases {
        /// Case files, or directories (their `*.yaml` files, sorted).
        #[arg(required = true)]
        paths: Vec<PathBuf>,
        /// Print every case, not only failures.
        #[arg(short, long)]
        verbose: bool,
    },
}

fn load(files: &Files) -> Result<npm_policy::model::Snapshot, String> {
    load_paths(&files.files)
}

fn load_paths(files: &[PathBuf]) -> Result<npm_policy::model::Snapshot, String> {
    let mut inputs = Vec::new();
    for f in files {
        let text = std::fs::read_to_string(f).map_err(|e| format!("{}: {e}", f.display()))?;
        inputs.push((f.display().to_string(), text));
    }
    sim::load_snapshot(&inputs).map_err(|e| e.to_string())
}

/// Warns about policies enforced without the parts that cannot be
/// understood (they fail closed).
fn warn_invalid(s: &npm_policy::model::Snapshot) {
    for p in &s.invalid_policies {
        eprintln!(
            "warning: invalid policy {}/{} enforced without the parts that cannot be understood",
            p.namespace, p.name
        );
    }
    for p in &s.invalid_cluster_policies {
        eprintln!(
            "warning: invalid clusternetworkpolicy {} enforced failing closed where it cannot be understood: {}",
            p.name,
            p.errors.join("; ")
        );
    }
}

fn protocol(p: &PortArgs) -> Result<Protocol, String> {
    npm_policy::validate::parse_protocol(&p.protocol.to_uppercase())
        .ok_or_else(|| format!("unsupported protocol {:?}: want TCP, UDP or SCTP", p.protocol))
}

fn json<T: serde::Serialize>(v: &T) -> Result<String, String> {
    serde_json::to_string_pretty(v)
        .map(|s| s + "\n")
        .map_err(|e| e.to_string())
}

fn run(cli: Cli) -> Result<bool, String> {
    let opts = sim::sim_options();
    match cli.cmd {
        Cmd::Lint { files, output } => {
            let s = load(&files)?;
            let findings = npm_policy::analysis::lint::lint(&s, &opts);
            let errors = findings
                .iter()
                .filter(|f| f.severity == npm_policy::analysis::lint::Severity::Error)
                .count();
            match output {
                Output::Json => print!("{}", json(&findings)?),
                Output::Text => {
                    for f in &findings {
                        println!("{f}");
                    }
                    println!("{} findings ({errors} errors)", findings.len());
                }
            }
            Ok(errors == 0)
        }
        Cmd::Exposure {
            files,
            cluster_cidrs,
            output,
        } => {
            let s = load(&files)?;
            warn_invalid(&s);
            let e = npm_policy::analysis::exposure::exposure(&s, &opts, &cluster_cidrs);
            match output {
                Output::Json => print!("{}", json(&e)?),
                Output::Text => print!("{e}"),
            }
            Ok(true)
        }
        Cmd::Preview {
            files,
            apply,
            delete,
            flows,
            output,
        } => {
            let current = load(&files)?;
            let mut all = files.files.clone();
            all.extend(apply);
            let mut new = load_paths(&all)?;
            for d in &delete {
                npm_sim::analysis::delete_object(&mut new, d)?;
            }
            warn_invalid(&new);
            let text = if flows.as_os_str() == "-" {
                std::io::read_to_string(std::io::stdin()).map_err(|e| format!("stdin: {e}"))?
            } else {
                std::fs::read_to_string(&flows).map_err(|e| format!("{}: {e}", flows.display()))?
            };
            let records =
                npm_sim::analysis::parse_flow_records(&text).map_err(|e| format!("{}: {e}", flows.display()))?;
            if records.allowed == 0 {
                eprintln!(
                    "warning: no allowed flow recorded (the agent logs allowed flows only with --flow-logs-allow): \
                     a change that would deny traffic cannot show"
                );
            }
            if records.lost > 0 {
                eprintln!("warning: the stream lost {} records", records.lost);
            }
            let p = npm_policy::analysis::preview::preview(&current, &new, &opts, &records.flows);
            match output {
                Output::Json => print!("{}", json(&p)?),
                Output::Text => print!("{p}"),
            }
            Ok(true)
        }
        Cmd::Matrix { files, port } => {
            let s = load(&files)?;
            warn_invalid(&s);
            print!("{}", sim::matrix(&s, &opts, protocol(&port)?, port.port).render());
            Ok(true)
        }
        Cmd::Explain {
            files,
            pods: Pods { from, to },
            port,
        } => {
            let s = load(&files)?;
            warn_invalid(&s);
            let v = sim::explain(&s, &opts, &from, &to, protocol(&port)?, port.port).map_err(|e| e.to_string())?;
            println!("{from} -> {to} {}/{}: {v}", port.protocol, port.port);
            Ok(true)
        }
        Cmd::Ports {
            files,
            pods: Pods { from, to },
        } => {
            let s = load(&files)?;
            warn_invalid(&s);
            let r = npm_sim::ports::ports(&s, &opts, &from, &to).map_err(|e| e.to_string())?;
            print!("{r}");
            Ok(true)
        }
        Cmd::Validate { files } => {
            let s = load(&files)?;
            let invalid = |p: &&npm_policy::model::Policy| {
                s.invalid_policies
                    .iter()
                    .any(|i| i.namespace == p.namespace && i.name == p.name)
            };
            for p in s.policies.values().filter(|p| !invalid(p)) {
                println!("valid: {}/{}", p.namespace, p.name);
            }
            for p in &s.invalid_policies {
                println!("INVALID: {}/{}", p.namespace, p.name);
                for e in &p.errors {
                    println!("  {e}");
                }
            }
            let invalid_cnp = |n: &str| s.invalid_cluster_policies.iter().any(|i| i.name == n);
            for p in s.cluster_policies.values().filter(|p| !invalid_cnp(&p.name)) {
                println!(
                    "valid: clusternetworkpolicy {} (tier {}, priority {})",
                    p.name,
                    p.tier.name(),
                    p.priority
                );
            }
            for p in &s.invalid_cluster_policies {
                println!("INVALID: clusternetworkpolicy {}", p.name);
                for e in &p.errors {
                    println!("  {e}");
                }
            }
            Ok(s.invalid_policies.is_empty() && s.invalid_cluster_policies.is_empty())
        }
        Cmd::Compile { files, node } => {
            let s = load(&files)?;
            let o = npm_policy::compiled::CompileOptions {
                node_name: node,
                ..opts
            };
            print!("{}", npm_policy::compile(&s, &o, None).render_table());
            Ok(true)
        }
        Cmd::Cases { paths, verbose } => {
            let (mut pass, mut fail) = (0, 0);
            let mut files = Vec::new();
            for path in paths {
                if path.is_dir() {
                    let mut found: Vec<PathBuf> = std::fs::read_dir(&path)
                        .map_err(|e| format!("{}: {e}", path.display()))?
                        .filter_map(|d| d.ok().map(|d| d.path()))
                        .filter(|p| p.is_file() && p.extension().is_some_and(|x| x == "yaml" || x == "yml"))
                        .collect();
                    if found.is_empty() {
                        return Err(format!("{}: no *.yaml case files in this directory", path.display()));
                    }
                    found.sort();
                    files.extend(found);
                } else {
                    files.push(path);
                }
            }
            for path in &files {
                let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
                let cases = npm_sim::cases::parse_case_file(&text).map_err(|e| format!("{}: {e}", path.display()))?;
                for c in &cases {
                    let r = npm_sim::cases::run_case_simulated(c);
                    if r.passed() {
                        pass += 1;
                    } else {
                        fail += 1;
                    }
                    if verbose || !r.passed() {
                        print!("{}", r.report());
                    }
                }
            }
            println!("{pass} passed, {fail} failed");
            Ok(fail == 0)
        }
    }
}

fn main() -> ExitCode {
    match run(Cli::parse()) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("npmctl: {e}");
            ExitCode::from(2)
        }
    }
}
