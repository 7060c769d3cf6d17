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

#[derive(Subcommand)]
enum Cmd {
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
    let mut inputs = Vec::new();
    for f in &files.files {
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

fn run(cli: Cli) -> Result<bool, String> {
    let opts = sim::sim_options();
    match cli.cmd {
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
