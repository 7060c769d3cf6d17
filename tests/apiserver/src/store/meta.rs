//! Object metadata helpers of the store: uids, generated names, creation timestamps and
//! reading/writing `metadata.resourceVersion`.

use crate::error::ApiError;
use serde_json::{json, Value};

/// The current time as RFC 3339 at whole seconds (`creationTimestamp`).
pub(super) fn now_rfc3339() -> String {
    let now = jiff::Timestamp::now();
    jiff::Timestamp::from_second(now.as_second()).unwrap_or(now).to_string()
}

/// A random version-4 UUID (`metadata.uid`).
pub(super) fn new_uid() -> String {
    let mut b: u128 = rand::random();
    b = (b & !(0xf << 76)) | (0x4 << 76);
    b = (b & !(0x3 << 62)) | (0x2 << 62);
    let h = format!("{b:032x}");
    format!(
        "{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}

/// Five random characters appended to `generateName`, from the upstream alphabet.
pub(super) fn random_suffix() -> String {
    const CHARS: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
    (0..5)
        .map(|_| CHARS[rand::random_range(0..CHARS.len())] as char)
        .collect()
}

/// A string field of `metadata`.
pub(super) fn meta_str<'a>(obj: &'a Value, field: &str) -> Option<&'a str> {
    obj.get("metadata")?.get(field)?.as_str()
}

/// The object's `resourceVersion` as a number (0 when missing).
pub(super) fn rv_of(obj: &Value) -> u64 {
    meta_str(obj, "resourceVersion")
        .and_then(|s| s.parse().ok())
        .unwrap_or(0)
}

/// Set the object's `resourceVersion`.
pub(super) fn set_rv(obj: &mut Value, rev: u64) {
    if let Some(m) = obj.get_mut("metadata").and_then(Value::as_object_mut) {
        m.insert("resourceVersion".into(), json!(rev.to_string()));
    }
}

/// Parse a `resourceVersion` parameter (400 when it is not a number).
pub(crate) fn parse_rv(s: &str) -> Result<u64, ApiError> {
    s.parse().map_err(|_| ApiError::BadRequest {
        message: format!("invalid resource version {s:?}"),
    })
}
