//! The CNI configuration directory as a runtime reads it, and npm-cni's entry in a conflist.
//!
//! Which file a runtime uses: containerd and CRI-O (through libcni) list the files of the directory
//! ending in `.conf`, `.conflist` or `.json`, sort them by name and take the first; only a
//! `.conflist` is read as a list, every other file as one plugin. npm-cni can only be chained in a
//! list, so the installer edits that first file when it is a `.conflist` and refuses otherwise.
//!
//! The edits are byte splices of the `plugins` array: adding appends `,<indent>{...}` after the last
//! element (with the indentation of that element), updating replaces only the values of
//! `agentSocket`, `timeoutSeconds` and `failOpen`, removing cuts an element together with the
//! separator before it. So every other byte stays as it was, and removing what was added gives the
//! original file back byte for byte.

use std::ops::Range;
use std::path::{Path, PathBuf};

use serde_json::Value;

use super::json_text::{self, Member};

/// The `type` of npm-cni's entry, and the name of its binary.
pub const PLUGIN_TYPE: &str = "npm-cni";

/// The file extensions libcni reads from a CNI configuration directory.
pub const CONFIG_EXTENSIONS: [&str; 3] = ["conf", "conflist", "json"];

/// The values of npm-cni's entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// `agentSocket`.
    pub agent_socket: String,
    /// `timeoutSeconds`.
    pub timeout_seconds: u64,
    /// `failOpen`.
    pub fail_open: bool,
}

impl Entry {
    /// The entry's keys with their values as JSON text.
    fn values(&self) -> [(&'static str, String); 3] {
        [
            ("agentSocket", Value::from(self.agent_socket.as_str()).to_string()),
            ("timeoutSeconds", self.timeout_seconds.to_string()),
            ("failOpen", self.fail_open.to_string()),
        ]
    }

    /// The entry as a new element of `plugins`.
    fn element(&self) -> String {
        let mut text = format!("{{\"type\":\"{PLUGIN_TYPE}\"");
        for (key, value) in self.values() {
            text.push_str(&format!(",\"{key}\":{value}"));
        }
        text.push('}');
        text
    }
}

/// The configuration files of `dir` in the order libcni reads them (by name).
pub fn config_files(dir: &Path) -> std::io::Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let path = entry.path();
        let is_config = path
            .extension()
            .and_then(|e| e.to_str())
            .is_some_and(|e| CONFIG_EXTENSIONS.contains(&e));
        // A symlink to a file counts, as for libcni; a dangling one fails when it is read.
        if is_config && !path.is_dir() {
            files.push(path);
        }
    }
    files.sort_by(|a, b| a.file_name().cmp(&b.file_name()));
    Ok(files)
}

/// Whether a runtime reads `path` as a list (only `.conflist` files).
pub fn is_conflist(path: &Path) -> bool {
    path.extension().is_some_and(|e| e == "conflist")
}

/// Why a file cannot be used as a conflist.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Problem {
    /// Not JSON, or not a conflist's shape; the reason.
    Malformed(String),
    /// A single plugin's configuration (a `type`, no `plugins`).
    SinglePlugin,
}

/// A parsed conflist: its text and the spans of its `plugins`.
#[derive(Debug, Clone)]
pub struct Conflist {
    text: String,
    cni_version: Option<String>,
    /// Spans of the elements of `plugins`, with whether each is an npm-cni entry.
    plugins: Vec<(Range<usize>, bool)>,
}

impl Conflist {
    /// Parses a conflist's text.
    pub fn parse(text: String) -> Result<Self, Problem> {
        let value: Value =
            serde_json::from_str(&text).map_err(|e| Problem::Malformed(format!("not valid JSON: {e}")))?;
        let Value::Object(object) = &value else {
            return Err(Problem::Malformed("not a JSON object".into()));
        };
        let list = match object.get("plugins") {
            Some(Value::Array(list)) => list,
            Some(_) => return Err(Problem::Malformed("\"plugins\" is not a list".into())),
            None if object.contains_key("type") => return Err(Problem::SinglePlugin),
            None => return Err(Problem::Malformed("it has no \"plugins\" list".into())),
        };
        if list.is_empty() {
            return Err(Problem::Malformed("its \"plugins\" list is empty".into()));
        }
        let mut types = Vec::with_capacity(list.len());
        for (i, plugin) in list.iter().enumerate() {
            match plugin.get("type") {
                Some(Value::String(t)) if !t.is_empty() => types.push(t.as_str()),
                _ => return Err(Problem::Malformed(format!("plugin {i} of \"plugins\" has no \"type\""))),
            }
        }
        let cni_version = object.get("cniVersion").and_then(Value::as_str).map(str::to_owned);

        let scan_failed = || Problem::Malformed("its text could not be scanned".into());
        let root = json_text::root(&text).ok_or_else(scan_failed)?;
        let members = json_text::object_members(&text, &root).ok_or_else(scan_failed)?;
        // serde_json (like Go's encoding/json) keeps the last of duplicate keys.
        let array = last_member(&members, "plugins").ok_or_else(scan_failed)?;
        let elements = json_text::array_elements(&text, &array.value).ok_or_else(scan_failed)?;
        if elements.len() != types.len() {
            return Err(scan_failed());
        }
        let plugins = elements
            .into_iter()
            .zip(types)
            .map(|(span, t)| (span, t == PLUGIN_TYPE))
            .collect();
        Ok(Self {
            text,
            cni_version,
            plugins,
        })
    }

    /// The conflist's `cniVersion`, if it has a string one.
    pub fn cni_version(&self) -> Option<&str> {
        self.cni_version.as_deref()
    }

    /// Whether `plugins` has an npm-cni entry.
    pub fn has_entry(&self) -> bool {
        self.plugins.iter().any(|(_, npm)| *npm)
    }

    /// Whether `plugins` has a plugin other than npm-cni (one to chain after).
    pub fn has_primary(&self) -> bool {
        self.plugins.iter().any(|(_, npm)| !npm)
    }

    /// The text with exactly one npm-cni entry, last in `plugins`, holding `entry`'s values. An
    /// existing entry keeps its other keys and formatting; the text is unchanged if it already
    /// says the same. Requires [`Self::has_primary`].
    pub fn with_entry(&self, entry: &Entry) -> String {
        let last = self.plugins.len() - 1;
        let npm: Vec<usize> = (0..self.plugins.len()).filter(|&i| self.plugins[i].1).collect();
        if npm == [last] {
            return splice(&self.text, self.update_edits(&self.plugins[last].0, entry));
        }
        let element = match npm.first() {
            Some(&i) => {
                let span = self.plugins[i].0.clone();
                let edits = self.update_edits(&span, entry);
                let shift = |r: &Range<usize>| r.start - span.start..r.end - span.start;
                let edits = edits.into_iter().map(|(r, s)| (shift(&r), s)).collect();
                splice(&self.text[span], edits)
            }
            None => entry.element(),
        };
        let Some(anchor) = (0..self.plugins.len()).rev().find(|&i| !self.plugins[i].1) else {
            unreachable!("with_entry requires a primary plugin")
        };
        let at = self.plugins[anchor].0.end;
        let indent = json_text::whitespace_before(&self.text, self.plugins[anchor].0.start);
        let mut edits = self.removal_edits();
        edits.push((at..at, format!(",{indent}{element}")));
        splice(&self.text, edits)
    }

    /// The text without any npm-cni entry.
    pub fn without_entry(&self) -> String {
        splice(&self.text, self.removal_edits())
    }

    /// Edits that set `entry`'s values in the npm-cni element at `span`.
    fn update_edits(&self, span: &Range<usize>, entry: &Entry) -> Vec<(Range<usize>, String)> {
        let members = json_text::object_members(&self.text, span).unwrap_or_default();
        let mut edits = Vec::new();
        let mut missing = String::new();
        for (key, value) in entry.values() {
            match last_member(&members, key) {
                Some(member) => {
                    let current = &self.text[member.value.clone()];
                    let same = current == value
                        || serde_json::from_str::<Value>(current).ok() == serde_json::from_str(&value).ok();
                    if !same {
                        edits.push((member.value.clone(), value));
                    }
                }
                None => missing.push_str(&format!(",\"{key}\":{value}")),
            }
        }
        if !missing.is_empty() {
            // After the last member's value; an npm-cni entry always has at least its "type".
            let at = members.last().map_or(span.start + 1, |m| m.value.end);
            edits.push((at..at, missing));
        }
        edits
    }

    /// Edits that cut every npm-cni element with the separator before it (after it for leading
    /// ones), so that cutting an appended element restores the text it was appended to.
    fn removal_edits(&self) -> Vec<(Range<usize>, String)> {
        let span = |i: usize| self.plugins[i].0.clone();
        let n = self.plugins.len();
        let Some(first_kept) = (0..n).find(|&i| !self.plugins[i].1) else {
            return vec![(span(0).start..span(n - 1).end, String::new())];
        };
        let mut edits = Vec::new();
        if first_kept > 0 {
            edits.push((span(0).start..span(first_kept).start, String::new()));
        }
        for i in first_kept + 1..n {
            if self.plugins[i].1 {
                edits.push((span(i - 1).end..span(i).end, String::new()));
            }
        }
        edits
    }
}

fn last_member<'a>(members: &'a [Member], key: &str) -> Option<&'a Member> {
    members.iter().rev().find(|m| m.key == key)
}

/// Applies non-overlapping edits (span to replace, replacement) to `text`.
fn splice(text: &str, mut edits: Vec<(Range<usize>, String)>) -> String {
    edits.sort_by_key(|(r, _)| (r.start, r.end));
    let mut out = String::with_capacity(text.len() + 128);
    let mut cursor = 0;
    for (range, replacement) in edits {
        out.push_str(&text[cursor..range.start]);
        out.push_str(&replacement);
        cursor = range.end;
    }
    out.push_str(&text[cursor..]);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(socket: &str, timeout: u64, fail_open: bool) -> Entry {
        Entry {
            agent_socket: socket.into(),
            timeout_seconds: timeout,
            fail_open,
        }
    }

    fn parse(text: &str) -> Conflist {
        Conflist::parse(text.to_owned()).unwrap()
    }

    const PRETTY: &str = "{\n  \"name\": \"k8s\",\n  \"cniVersion\": \"1.0.0\",\n  \"plugins\": [\n    {\n      \"type\": \"ptp\",\n      \"mtu\": 1.50e3\n    },\n    {\"type\": \"portmap\", \"capabilities\": {\"portMappings\": true}}\n  ],\n  \"zz\": \"\\u00e9\"\n}\n";

    #[test]
    fn add_is_idempotent_and_removal_restores_the_bytes() {
        let e = entry("/run/npm/cni.sock", 10, false);
        let added = parse(PRETTY).with_entry(&e);
        assert!(added.starts_with(&PRETTY[..PRETTY.find("}\n  ],").unwrap() + 1]));
        assert!(added.contains(
            "}},\n    {\"type\":\"npm-cni\",\"agentSocket\":\"/run/npm/cni.sock\",\"timeoutSeconds\":10,\"failOpen\":false}\n  ],"
        ));
        let value: Value = serde_json::from_str(&added).unwrap();
        assert_eq!(value["plugins"][2]["type"], "npm-cni");
        assert_eq!(parse(&added).with_entry(&e), added);
        assert_eq!(parse(&added).without_entry(), PRETTY);
        assert_eq!(parse(PRETTY).without_entry(), PRETTY);

        let compact = r#"{"cniVersion":"1.0.0","name":"n","plugins":[{"type":"ptp"}]}"#;
        let added = parse(compact).with_entry(&e);
        assert!(added.ends_with(r#"{"type":"ptp"},{"type":"npm-cni","agentSocket":"/run/npm/cni.sock","timeoutSeconds":10,"failOpen":false}]}"#));
        assert_eq!(parse(&added).without_entry(), compact);
    }

    #[test]
    fn update_changes_only_values_and_keeps_the_entry_last() {
        let text = "{\"plugins\":[{\"type\":\"ptp\"},\n {\"failOpen\": false, \"type\": \"npm-cni\", \"extra\": 1}]}";
        let updated = parse(text).with_entry(&entry("/s", 3, true));
        assert_eq!(
            updated,
            "{\"plugins\":[{\"type\":\"ptp\"},\n {\"failOpen\": true, \"type\": \"npm-cni\", \"extra\": 1,\"agentSocket\":\"/s\",\"timeoutSeconds\":3}]}"
        );
        // An entry that is not last (or several) is moved last, as one.
        let text = r#"{"plugins":[{"type":"npm-cni","timeoutSeconds":5},{"type":"ptp"},{"type":"npm-cni"},{"type":"tuning"}]}"#;
        let moved = parse(text).with_entry(&entry("/s", 5, false));
        assert_eq!(
            moved,
            r#"{"plugins":[{"type":"ptp"},{"type":"tuning"},{"type":"npm-cni","timeoutSeconds":5,"agentSocket":"/s","failOpen":false}]}"#
        );
        assert_eq!(
            parse(text).without_entry(),
            r#"{"plugins":[{"type":"ptp"},{"type":"tuning"}]}"#
        );
        assert_eq!(
            parse(r#"{"plugins":[{"type":"npm-cni"}]}"#).without_entry(),
            r#"{"plugins":[]}"#
        );
    }

    #[test]
    fn problems() {
        let problem = |t: &str| Conflist::parse(t.to_owned()).unwrap_err();
        assert!(matches!(problem("{\"plugins\": [}"), Problem::Malformed(m) if m.contains("line 1")));
        assert_eq!(
            problem(r#"{"cniVersion":"1.0.0","type":"bridge"}"#),
            Problem::SinglePlugin
        );
        assert!(matches!(problem(r#"{"plugins":[]}"#), Problem::Malformed(_)));
        assert!(matches!(
            problem(r#"{"plugins":[{"name":"x"}]}"#),
            Problem::Malformed(_)
        ));
        assert!(!parse(r#"{"plugins":[{"type":"npm-cni"}]}"#).has_primary());
    }
}
