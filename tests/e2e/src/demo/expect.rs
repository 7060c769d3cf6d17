//! What the demo expects: the example policies read from their files, the
//! matrices the reference evaluator gives for them on the upstream model,
//! and the protocol names of the command line.

use std::path::Path;

use npm_policy::model::Protocol;
use npm_sim::cases::{self, Action, Matrix, Model};
use serde::Deserialize;
use serde_json::Value;

use super::DemoError;

/// The upstream model's pods, `ns/name`, in x,y,z / a,b,c order.
pub fn model_pods() -> Vec<String> {
    cases::default_pods()
}

pub(super) fn all_reachable(rows: &[String], cols: &[String]) -> Matrix {
    Matrix {
        rows: rows.to_vec(),
        columns: cols.to_vec(),
        cells: vec![vec![true; cols.len()]; rows.len()],
    }
}

/// Reads a multi-document YAML file of NetworkPolicies into JSON objects
/// (empty documents are skipped; any other kind is an error).
pub fn read_policies(path: &Path) -> Result<Vec<Value>, DemoError> {
    let text = std::fs::read_to_string(path).map_err(|source| DemoError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let mut out = Vec::new();
    for (i, doc) in serde_yaml::Deserializer::from_str(&text).enumerate() {
        let err = |message: String| DemoError::Example {
            path: path.to_path_buf(),
            document: i + 1,
            message,
        };
        let v = Value::deserialize(doc).map_err(|e| err(e.to_string()))?;
        if v.is_null() {
            continue;
        }
        if v["kind"] != "NetworkPolicy" || v["apiVersion"] != "networking.k8s.io/v1" {
            return Err(err(format!(
                "want apiVersion networking.k8s.io/v1 kind NetworkPolicy, got {} {}",
                v["apiVersion"], v["kind"]
            )));
        }
        if v["metadata"]["name"].as_str().is_none_or(str::is_empty) {
            return Err(err("metadata.name is missing".into()));
        }
        out.push(v);
    }
    if out.is_empty() {
        return Err(DemoError::Example {
            path: path.to_path_buf(),
            document: 0,
            message: "no NetworkPolicy in the file".into(),
        });
    }
    Ok(out)
}

/// The matrix npm-policy's reference evaluator expects for the upstream
/// model with `policies` (JSON NetworkPolicy objects, as the API server
/// holds them) on `port`/`protocol`.
pub fn expected_matrix(policies: &[Value], protocol: Protocol, port: u16) -> Result<Matrix, String> {
    let mut model = Model::upstream();
    for p in policies {
        let mut clean = p.clone();
        if let Some(m) = clean["metadata"].as_object_mut() {
            m.retain(|k, _| matches!(k.as_str(), "name" | "namespace" | "labels"));
        }
        clean.as_object_mut().map(|o| o.remove("status"));
        let name = format!(
            "{}/{}",
            p["metadata"]["namespace"].as_str().unwrap_or("default"),
            p["metadata"]["name"].as_str().unwrap_or("")
        );
        let action: Action = serde_json::from_value(serde_json::json!({ "create_policy": clean }))
            .map_err(|e| format!("policy {name}: {e}"))?;
        model.apply(&action).map_err(|e| format!("policy {name}: {e}"))?;
    }
    let pods = model_pods();
    Ok(model.probe(&pods, &pods, protocol, port).0)
}

/// The name of a protocol as NetworkPolicy spells it.
pub fn protocol_name(p: Protocol) -> &'static str {
    match p {
        Protocol::Tcp => "TCP",
        Protocol::Udp => "UDP",
        Protocol::Sctp => "SCTP",
    }
}

/// Parses `TCP`, `UDP` or `SCTP` (any case).
pub fn parse_protocol(s: &str) -> Result<Protocol, DemoError> {
    match s.to_ascii_uppercase().as_str() {
        "TCP" => Ok(Protocol::Tcp),
        "UDP" => Ok(Protocol::Udp),
        "SCTP" => Ok(Protocol::Sctp),
        _ => Err(DemoError::Option {
            option: "--protocol",
            message: format!("{s:?}: want TCP, UDP or SCTP"),
        }),
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;
    use crate::demo::{FIRST_EXAMPLE, SECOND_EXAMPLE};

    fn examples() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples")
    }

    fn tmp_file(name: &str, text: &str) -> PathBuf {
        let p = std::env::temp_dir().join(format!("npm-demo-unit-{}-{name}", std::process::id()));
        std::fs::write(&p, text).expect("write");
        p
    }

    #[test]
    fn example_01_expectation_is_the_documented_one() {
        let pols = read_policies(&examples().join(FIRST_EXAMPLE)).expect("example 01");
        assert_eq!(pols.len(), 2);
        let m = expected_matrix(&pols, Protocol::Tcp, 80).expect("matrix");
        // The diagonal (a pod to itself) is not probed.
        for r in &m.rows {
            for c in m.columns.iter().filter(|c| *c != r) {
                let want = match c.as_str() {
                    "x/b" | "x/c" => false,
                    "x/a" => r.starts_with("y/"),
                    _ => true,
                };
                assert_eq!(m.get(r, c), Some(want), "{r} -> {c}");
            }
        }
        // Port 81 is not opened by allow-y-to-a: all of x is isolated.
        let m81 = expected_matrix(&pols, Protocol::Tcp, 81).expect("matrix");
        assert_eq!(m81.get("y/a", "x/a"), Some(false));
        assert_eq!(m81.get("y/a", "z/a"), Some(true));
    }

    #[test]
    fn example_02_blocks_y_except_to_z() {
        let mut pols = read_policies(&examples().join(FIRST_EXAMPLE)).expect("example 01");
        pols.extend(read_policies(&examples().join(SECOND_EXAMPLE)).expect("example 02"));
        let m = expected_matrix(&pols, Protocol::Tcp, 80).expect("matrix");
        assert_eq!(m.get("y/a", "x/a"), Some(false));
        assert_eq!(m.get("y/a", "y/b"), Some(false));
        assert_eq!(m.get("y/a", "z/c"), Some(true));
        assert_eq!(m.get("z/a", "y/b"), Some(true));
    }

    #[test]
    fn bad_example_files_are_clear_errors() {
        let p = tmp_file("pod.yaml", "apiVersion: v1\nkind: Pod\nmetadata: {name: p}\n");
        let e = read_policies(&p).expect_err("a Pod").to_string();
        assert!(e.contains("document 1") && e.contains("kind NetworkPolicy"), "{e}");
        let p2 = tmp_file("empty.yaml", "# nothing\n");
        let e = read_policies(&p2).expect_err("empty").to_string();
        assert!(e.contains("no NetworkPolicy"), "{e}");
        let p3 = tmp_file(
            "noname.yaml",
            "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {namespace: x}\nspec: {podSelector: {}}\n---\n",
        );
        let e = read_policies(&p3).expect_err("no name").to_string();
        assert!(e.contains("metadata.name"), "{e}");
        let e = read_policies(Path::new("/nonexistent/npm-demo.yaml"))
            .expect_err("missing")
            .to_string();
        assert!(e.contains("/nonexistent/npm-demo.yaml"), "{e}");
        for f in [p, p2, p3] {
            let _ = std::fs::remove_file(f);
        }
    }

    #[test]
    fn protocol_names() {
        assert_eq!(parse_protocol("tcp").expect("tcp"), Protocol::Tcp);
        assert_eq!(parse_protocol("SCTP").expect("sctp"), Protocol::Sctp);
        assert!(parse_protocol("icmp")
            .expect_err("icmp")
            .to_string()
            .contains("--protocol"));
        assert_eq!(protocol_name(Protocol::Udp), "UDP");
    }
}
