//! `cargo xtask deps`: the dependency policy of `xtask/deps-policy.yaml`,
//! checked over `cargo metadata` (what cargo-deny's `licenses`, `sources`
//! and `bans` checks do, without building cargo-deny; there are no
//! advisories: no advisory database can be fetched here).
//!
//! The graph checked is the one built for `x86_64-unknown-linux-gnu` (all
//! dependency kinds: normal, build and dev), from `Cargo.lock` (`--locked`).
//! - licences: every package's SPDX expression must be satisfiable with the
//!   allowed identifiers (`OR`: either side, `AND`: both sides, `A WITH
//!   exception` and `A+` as `A`, the legacy `A/B` as `A OR B`); a package
//!   with no `license` field fails;
//! - sources: every package comes from an allowed source (crates.io) or a
//!   path in this repository;
//! - duplicates: a crate present in more than one semver-incompatible
//!   version (`0.22`, `0.23`, `1`, `2`, ...) fails unless the policy lists
//!   that crate with exactly those versions. The list holds the duplicates
//!   that existed when the check was written, so only new ones fail; an
//!   entry that no longer applies is reported so it can be removed.

use std::collections::{BTreeMap, BTreeSet};

use anyhow::{bail, Context, Result};
use serde::Deserialize;

/// The policy file, relative to the workspace root.
pub const POLICY: &str = "xtask/deps-policy.yaml";

/// The host graph: what is built and run here.
const PLATFORM: &str = "x86_64-unknown-linux-gnu";

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Policy {
    licenses: BTreeSet<String>,
    sources: BTreeSet<String>,
    duplicates: BTreeMap<String, BTreeSet<String>>,
}

#[derive(Deserialize)]
struct Metadata {
    packages: Vec<Package>,
}

#[derive(Deserialize)]
struct Package {
    name: String,
    version: String,
    license: Option<String>,
    source: Option<String>,
}

pub fn deps() -> Result<()> {
    let path = crate::root().join(POLICY);
    let text = std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let policy: Policy = serde_yaml::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    let out = crate::cargo()
        .args([
            "metadata",
            "--format-version",
            "1",
            "--locked",
            "--filter-platform",
            PLATFORM,
        ])
        .current_dir(crate::root())
        .output()
        .context("cannot start cargo metadata")?;
    if !out.status.success() {
        bail!("cargo metadata failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    let meta: Metadata = serde_json::from_slice(&out.stdout).context("parsing cargo metadata")?;
    let problems = check(&policy, &meta.packages);
    if !problems.is_empty() {
        for p in &problems {
            eprintln!("xtask: deps: {p}");
        }
        bail!("{} dependency policy violation(s), see {POLICY}", problems.len());
    }
    eprintln!("xtask: deps: {} packages follow {POLICY}", meta.packages.len());
    Ok(())
}

/// The policy's violations (stale duplicate entries are printed, not
/// returned).
fn check(policy: &Policy, packages: &[Package]) -> Vec<String> {
    let mut problems = Vec::new();
    let mut versions: BTreeMap<&str, BTreeSet<String>> = BTreeMap::new();
    for p in packages {
        let id = format!("{} {}", p.name, p.version);
        match &p.license {
            None => problems.push(format!("{id}: no license field")),
            Some(expr) => match licence_allowed(expr, &policy.licenses) {
                Ok(true) => {}
                Ok(false) => problems.push(format!("{id}: licence `{expr}` is not allowed")),
                Err(e) => problems.push(format!("{id}: licence `{expr}`: {e}")),
            },
        }
        if let Some(source) = &p.source {
            if !policy.sources.contains(source) {
                problems.push(format!("{id}: source {source} is not allowed"));
            }
        }
        versions.entry(&p.name).or_default().insert(compatible(&p.version));
    }
    for (name, found) in &versions {
        let allowed = policy.duplicates.get(*name);
        if found.len() > 1 && allowed != Some(found) {
            let found = found.iter().cloned().collect::<Vec<_>>().join(", ");
            problems.push(format!(
                "{name}: versions {found} (unify them, or list them under `duplicates` with the reason)"
            ));
        }
    }
    for (name, listed) in &policy.duplicates {
        if versions.get(name.as_str()) != Some(listed) {
            eprintln!("xtask: deps: note: the `duplicates` entry {name} no longer applies: remove it");
        }
    }
    problems
}

/// The semver-compatible part of a version: `0.22.1` -> `0.22`,
/// `0.0.3` -> `0.0.3`, `2.1.1` -> `2`.
fn compatible(version: &str) -> String {
    let core = version.split(['-', '+']).next().unwrap_or(version);
    let parts: Vec<&str> = core.split('.').collect();
    match parts.as_slice() {
        ["0", "0", patch, ..] => format!("0.0.{patch}"),
        ["0", minor, ..] => format!("0.{minor}"),
        [major, ..] => major.to_string(),
        [] => version.to_string(),
    }
}

/// Whether the SPDX expression can be satisfied with the allowed licences.
fn licence_allowed(expr: &str, allowed: &BTreeSet<String>) -> Result<bool> {
    let spaced = expr.replace('(', " ( ").replace(')', " ) ").replace('/', " OR ");
    let tokens: Vec<&str> = spaced.split_whitespace().collect();
    let mut parser = Spdx {
        tokens: &tokens,
        pos: 0,
        allowed,
    };
    let ok = parser.or()?;
    if parser.pos != tokens.len() {
        bail!("unexpected `{}`", tokens[parser.pos]);
    }
    Ok(ok)
}

/// A recursive-descent evaluator of SPDX license expressions.
struct Spdx<'a> {
    tokens: &'a [&'a str],
    pos: usize,
    allowed: &'a BTreeSet<String>,
}

impl Spdx<'_> {
    fn next(&mut self) -> Option<&str> {
        let t = self.tokens.get(self.pos).copied();
        self.pos += 1;
        t
    }

    fn peek(&self) -> Option<&str> {
        self.tokens.get(self.pos).copied()
    }

    fn or(&mut self) -> Result<bool> {
        let mut ok = self.and()?;
        while self.peek() == Some("OR") {
            self.pos += 1;
            ok |= self.and()?;
        }
        Ok(ok)
    }

    fn and(&mut self) -> Result<bool> {
        let mut ok = self.primary()?;
        while self.peek() == Some("AND") {
            self.pos += 1;
            ok &= self.primary()?;
        }
        Ok(ok)
    }

    fn primary(&mut self) -> Result<bool> {
        match self.next() {
            Some("(") => {
                let ok = self.or()?;
                if self.next() != Some(")") {
                    bail!("unbalanced parentheses");
                }
                Ok(ok)
            }
            Some(id) if !matches!(id, ")" | "OR" | "AND" | "WITH") => {
                let id = id.trim_end_matches('+').to_string();
                // An exception only adds permissions to the licence.
                if self.peek() == Some("WITH") {
                    self.pos += 1;
                    if self.next().is_none() {
                        bail!("WITH without an exception");
                    }
                }
                Ok(self.allowed.contains(&id))
            }
            Some(t) => bail!("unexpected `{t}`"),
            None => bail!("unexpected end"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn allowed(expr: &str) -> bool {
        let set = ["MIT", "Apache-2.0", "MPL-2.0"].iter().map(|s| s.to_string()).collect();
        licence_allowed(expr, &set).unwrap()
    }

    #[test]
    fn spdx_expressions() {
        assert!(allowed("MIT"));
        assert!(allowed("MIT OR Apache-2.0"));
        assert!(allowed("MIT/Apache-2.0"));
        assert!(allowed("GPL-3.0 OR MIT"));
        assert!(!allowed("GPL-3.0"));
        assert!(!allowed("MIT AND GPL-3.0"));
        assert!(allowed("(MIT OR GPL-3.0) AND Apache-2.0"));
        assert!(!allowed("(MIT OR Apache-2.0) AND BSD-3-Clause"));
        assert!(allowed("Apache-2.0 WITH LLVM-exception OR GPL-3.0"));
        assert!(allowed("MPL-2.0+"));
        assert!(licence_allowed("MIT OR", &BTreeSet::new()).is_err());
        assert!(licence_allowed("(MIT", &BTreeSet::new()).is_err());
    }

    #[test]
    fn compatible_versions() {
        assert_eq!(compatible("0.22.1"), "0.22");
        assert_eq!(compatible("0.0.3"), "0.0.3");
        assert_eq!(compatible("2.1.1"), "2");
        assert_eq!(compatible("0.9.34+deprecated"), "0.9");
        assert_eq!(compatible("1.0.0-rc.1"), "1");
    }

    fn pkg(name: &str, version: &str) -> Package {
        Package {
            name: name.into(),
            version: version.into(),
            license: Some("MIT".into()),
            source: Some("registry+https://github.com/rust-lang/crates.io-index".into()),
        }
    }

    #[test]
    fn new_duplicates_and_sources_fail() {
        let policy: Policy = serde_yaml::from_str(
            "licenses: [MIT]\nsources: [registry+https://github.com/rust-lang/crates.io-index]\n\
             duplicates: {base64: ['0.22', '0.23']}\n",
        )
        .unwrap();
        let ok = [pkg("base64", "0.22.1"), pkg("base64", "0.23.1"), pkg("syn", "2.0.1")];
        assert!(check(&policy, &ok).is_empty());
        let dup = [pkg("syn", "2.0.1"), pkg("syn", "3.0.0")];
        assert_eq!(check(&policy, &dup).len(), 1);
        let third = [
            pkg("base64", "0.22.1"),
            pkg("base64", "0.23.1"),
            pkg("base64", "0.24.0"),
        ];
        assert_eq!(check(&policy, &third).len(), 1);
        let mut git = pkg("x", "1.0.0");
        git.source = Some("git+https://example.invalid/x".into());
        assert_eq!(check(&policy, &[git]).len(), 1);
        let mut path = pkg("npm-common", "0.1.0");
        path.source = None;
        path.license = None;
        assert_eq!(check(&policy, &[path]).len(), 1, "path crates need a licence too");
    }
}
