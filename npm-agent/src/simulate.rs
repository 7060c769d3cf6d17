//! `npm-agent simulate`: the reachability matrix of YAML objects by the
//! compiler's simulator (the reference evaluator of npm-policy; no kernel,
//! no API server).

use std::path::PathBuf;

use anyhow::Context as _;

/// `npm-agent simulate`: print the reachability matrix of the objects in
/// `files` (YAML) for `protocol` and `port`.
pub fn run(files: &[PathBuf], port: u16, protocol: &str) -> anyhow::Result<()> {
    let mut inputs = Vec::new();
    for f in files {
        let text = std::fs::read_to_string(f).with_context(|| format!("reading {}", f.display()))?;
        inputs.push((f.display().to_string(), text));
    }
    let protocol = npm_policy::validate::parse_protocol(protocol)
        .with_context(|| format!("--protocol {:?}: want TCP, UDP or SCTP", protocol))?;
    let snapshot = npm_sim::sim::load_snapshot(&inputs)?;
    for p in &snapshot.invalid_policies {
        eprintln!(
            "invalid policy {}/{} enforced without the parts that cannot be understood: {}",
            p.namespace,
            p.name,
            p.errors.join("; ")
        );
    }
    let matrix = npm_sim::sim::matrix(&snapshot, &npm_sim::sim::sim_options(), protocol, port);
    print!("{}", matrix.render());
    Ok(())
}
