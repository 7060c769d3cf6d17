//! Golden tests: `tests/golden/*.yaml` compiled for node `npm-node` and
//! rendered with `Compiled::render_table`, compared with `*.golden`.
//! `UPDATE_GOLDEN=1 cargo test -p npm-policy --test golden` regenerates.

use std::path::PathBuf;

use npm_policy::compiled::CompileOptions;

#[test]
fn golden() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/golden");
    let update = std::env::var_os("UPDATE_GOLDEN").is_some();
    let mut n = 0;
    let mut paths: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    paths.sort();
    for path in paths {
        let text = std::fs::read_to_string(&path).unwrap();
        let snap = npm_sim::sim::load_snapshot(&[(path.display().to_string(), text)]).unwrap();
        assert!(snap.invalid_policies.is_empty(), "{:?}", snap.invalid_policies);
        let opts = CompileOptions {
            node_name: "npm-node".into(),
            node_ips: vec!["192.168.0.10".parse().unwrap()],
            allow_host_egress: true,
            report_new: false,
        };
        let c = npm_policy::compile(&snap, &opts, None);
        let got = c.render_table();
        // Rendering is deterministic and a recompile with prev is identical.
        assert_eq!(got, npm_policy::compile(&snap, &opts, Some(&c)).render_table());
        let golden = path.with_extension("golden");
        if update {
            std::fs::write(&golden, &got).unwrap();
        } else {
            let want = std::fs::read_to_string(&golden)
                .unwrap_or_else(|e| panic!("{}: {e} (UPDATE_GOLDEN=1 creates it)", golden.display()));
            assert_eq!(got, want, "{} differs; UPDATE_GOLDEN=1 regenerates", golden.display());
        }
        n += 1;
    }
    assert_eq!(n, 2);
}
