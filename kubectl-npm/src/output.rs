//! `--output text|json|yaml`.

use std::io::Write;

use serde::Serialize;

use crate::error::NpmError;

/// The output format.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Output {
    /// Human lines.
    #[default]
    Text,
    /// JSON (one document; `observe`: one record a line).
    Json,
    /// YAML (`observe`: one document a record).
    Yaml,
}

/// Prints `value` as `output` says: `text` for [`Output::Text`].
pub fn print<T: Serialize>(value: &T, output: Output, text: impl FnOnce() -> String) -> Result<(), NpmError> {
    let body = match output {
        Output::Text => text(),
        Output::Json => serde_json::to_string_pretty(value).map_err(|e| NpmError::Output(e.to_string()))? + "\n",
        Output::Yaml => serde_yaml::to_string(value).map_err(|e| NpmError::Output(e.to_string()))?,
    };
    write_stdout(body.as_bytes())
}

/// Writes `bytes` to stdout; a reader that left (a closed pipe) is no error.
pub fn write_stdout(bytes: &[u8]) -> Result<(), NpmError> {
    let mut out = std::io::stdout();
    match out.write_all(bytes).and_then(|()| out.flush()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(NpmError::Output(e.to_string())),
        _ => Ok(()),
    }
}
