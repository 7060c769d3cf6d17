//! Case loading: the case files of the given paths, their cases (ids
//! unique), and the IPv6 form of CIDR placeholders.

use std::collections::BTreeMap;
use std::path::PathBuf;

use npm_sim::cases::{self, Case};

use super::RunnerError;

/// A loaded case and where it came from.
#[derive(Clone, Debug)]
pub struct LoadedCase {
    /// The file.
    pub path: PathBuf,
    /// The case.
    pub case: Case,
}

/// Expands directories to their `*.yaml` files (sorted).
pub fn case_files(paths: &[PathBuf]) -> Result<Vec<PathBuf>, RunnerError> {
    let mut out = Vec::new();
    for p in paths {
        if p.is_dir() {
            let rd = std::fs::read_dir(p).map_err(|source| RunnerError::Read {
                path: p.clone(),
                source,
            })?;
            let mut files: Vec<PathBuf> = rd
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|f| f.is_file() && matches!(f.extension().and_then(|e| e.to_str()), Some("yaml" | "yml")))
                .collect();
            files.sort();
            out.extend(files);
        } else {
            out.push(p.clone());
        }
    }
    Ok(out)
}

/// Parses a case file (`npm_sim::cases::parse_case_file`; placeholders
/// stay in place).
pub fn parse_text(text: &str) -> Result<Vec<Case>, cases::CaseError> {
    cases::parse_case_file(text)
}

/// Loads every case of the given files/directories (placeholders stay in
/// place; they are resolved when an action runs). Ids must be unique.
pub fn load_cases(paths: &[PathBuf]) -> Result<Vec<LoadedCase>, RunnerError> {
    let mut out: Vec<LoadedCase> = Vec::new();
    let mut seen: BTreeMap<String, PathBuf> = BTreeMap::new();
    for f in case_files(paths)? {
        let text = std::fs::read_to_string(&f).map_err(|source| RunnerError::Read {
            path: f.clone(),
            source,
        })?;
        let parsed = parse_text(&text).map_err(|source| RunnerError::Parse {
            path: f.clone(),
            source,
        })?;
        for case in parsed {
            if let Some(first) = seen.get(&case.id) {
                return Err(RunnerError::DuplicateId {
                    id: case.id.clone(),
                    first: first.clone(),
                    second: f.clone(),
                });
            }
            seen.insert(case.id.clone(), f.clone());
            out.push(LoadedCase { path: f.clone(), case });
        }
    }
    Ok(out)
}

/// Maps an IPv4 prefix length of a placeholder to the IPv6 length that
/// keeps the same containment for the model's addresses (`198.18.n.p` <->
/// `fd00:198:18::n:p`): /0../16 -> x6 (/16 -> /96, /4 -> /24), /24 -> /112,
/// /32 -> /128.
pub fn v6_prefix_for_v4(n: u8) -> u8 {
    match n {
        0..=16 => n * 6,
        17..=24 => 96 + (n - 16) * 2,
        _ => (112 + (n.min(32) - 24) * 2).min(128),
    }
}

/// Rewrites `${CIDR<n>:` placeholders to their IPv6 lengths.
pub fn remap_cidr_placeholders_v6(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(i) = rest.find("${CIDR") {
        out.push_str(&rest[..i + 6]);
        rest = &rest[i + 6..];
        let digits: String = rest.chars().take_while(|c| c.is_ascii_digit()).collect();
        match digits.parse::<u8>() {
            Ok(n) if rest[digits.len()..].starts_with(':') => {
                out.push_str(&v6_prefix_for_v4(n).to_string());
                rest = &rest[digits.len()..];
            }
            _ => {}
        }
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn v6_prefix_mapping_keeps_containment() {
        assert_eq!(v6_prefix_for_v4(32), 128);
        assert_eq!(v6_prefix_for_v4(24), 112);
        assert_eq!(v6_prefix_for_v4(16), 96);
        assert_eq!(v6_prefix_for_v4(4), 24);
        assert_eq!(v6_prefix_for_v4(0), 0);
        assert_eq!(
            remap_cidr_placeholders_v6("a ${CIDR32:x/a} b ${CIDR4:y/b} ${IP:z/c}"),
            "a ${CIDR128:x/a} b ${CIDR24:y/b} ${IP:z/c}"
        );
    }
}
