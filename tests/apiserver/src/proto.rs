//! Minimal decoding of Kubernetes protobuf request bodies.
//!
//! `kubectl create namespace NAME` sends its body as `application/vnd.kubernetes.protobuf`
//! (and does not fall back to JSON on 415), so the server decodes that one shape: the
//! `k8s\0` envelope (`runtime.Unknown`) around a `v1.Namespace` with its metadata name,
//! generateName, labels, annotations and spec finalizers.

use crate::error::ApiError;
use serde_json::{json, Map, Value};

fn bad(msg: &str) -> ApiError {
    ApiError::BadRequest {
        message: format!("protobuf body: {msg}"),
    }
}

/// One protobuf field: number and payload (varint value or length-delimited bytes).
enum Field<'a> {
    Varint,
    Bytes(&'a [u8]),
}

fn read_varint(buf: &[u8], pos: &mut usize) -> Result<u64, ApiError> {
    let mut v = 0u64;
    for shift in (0..64).step_by(7) {
        let b = *buf.get(*pos).ok_or_else(|| bad("truncated varint"))?;
        *pos += 1;
        v |= u64::from(b & 0x7f) << shift;
        if b & 0x80 == 0 {
            return Ok(v);
        }
    }
    Err(bad("varint too long"))
}

fn fields(buf: &[u8]) -> Result<Vec<(u64, Field<'_>)>, ApiError> {
    let mut out = Vec::new();
    let mut pos = 0;
    while pos < buf.len() {
        let tag = read_varint(buf, &mut pos)?;
        let (num, wire) = (tag >> 3, tag & 7);
        match wire {
            0 => {
                read_varint(buf, &mut pos)?;
                out.push((num, Field::Varint));
            }
            1 => pos += 8,
            5 => pos += 4,
            2 => {
                let len = read_varint(buf, &mut pos)? as usize;
                let end = pos
                    .checked_add(len)
                    .filter(|e| *e <= buf.len())
                    .ok_or_else(|| bad("length-delimited field overruns the body"))?;
                out.push((num, Field::Bytes(&buf[pos..end])));
                pos = end;
            }
            _ => return Err(bad("unsupported wire type")),
        }
    }
    if pos > buf.len() {
        return Err(bad("fixed-width field overruns the body"));
    }
    Ok(out)
}

fn string(b: &[u8]) -> Result<String, ApiError> {
    String::from_utf8(b.to_vec()).map_err(|_| bad("string field is not UTF-8"))
}

fn map_entries(entries: &[&[u8]]) -> Result<Map<String, Value>, ApiError> {
    let mut m = Map::new();
    for e in entries {
        let (mut k, mut v) = (String::new(), String::new());
        for (n, f) in fields(e)? {
            match (n, f) {
                (1, Field::Bytes(b)) => k = string(b)?,
                (2, Field::Bytes(b)) => v = string(b)?,
                _ => {}
            }
        }
        m.insert(k, json!(v));
    }
    Ok(m)
}

fn object_meta(buf: &[u8]) -> Result<Value, ApiError> {
    let mut meta = Map::new();
    let (mut labels, mut annotations) = (Vec::new(), Vec::new());
    for (n, f) in fields(buf)? {
        if let Field::Bytes(b) = f {
            if b.is_empty() {
                continue;
            }
            match n {
                1 => {
                    meta.insert("name".into(), json!(string(b)?));
                }
                2 => {
                    meta.insert("generateName".into(), json!(string(b)?));
                }
                3 => {
                    meta.insert("namespace".into(), json!(string(b)?));
                }
                11 => labels.push(b),
                12 => annotations.push(b),
                _ => {}
            }
        }
    }
    if !labels.is_empty() {
        meta.insert("labels".into(), Value::Object(map_entries(&labels)?));
    }
    if !annotations.is_empty() {
        meta.insert("annotations".into(), Value::Object(map_entries(&annotations)?));
    }
    Ok(Value::Object(meta))
}

/// Decode a protobuf-encoded `v1.Namespace` request body into its JSON form.
pub fn decode_namespace(body: &[u8]) -> Result<Value, ApiError> {
    let inner = body
        .strip_prefix(b"k8s\0")
        .ok_or_else(|| bad("missing the k8s protobuf envelope"))?;
    let mut raw = None;
    let mut kind = String::new();
    for (n, f) in fields(inner)? {
        match (n, f) {
            (1, Field::Bytes(tm)) => {
                for (m, g) in fields(tm)? {
                    if let (2, Field::Bytes(k)) = (m, g) {
                        kind = string(k)?;
                    }
                }
            }
            (2, Field::Bytes(r)) => raw = Some(r),
            _ => {}
        }
    }
    if kind != "Namespace" {
        return Err(ApiError::UnsupportedMediaType {
            content_type: format!("application/vnd.kubernetes.protobuf (kind {kind:?})"),
        });
    }
    let raw = raw.ok_or_else(|| bad("envelope has no raw object"))?;
    let mut obj = json!({"apiVersion": "v1", "kind": "Namespace"});
    for (n, f) in fields(raw)? {
        match (n, f) {
            (1, Field::Bytes(m)) => obj["metadata"] = object_meta(m)?,
            (2, Field::Bytes(spec)) => {
                let mut fin = Vec::new();
                for (m, g) in fields(spec)? {
                    if let (1, Field::Bytes(s)) = (m, g) {
                        fin.push(json!(string(s)?));
                    }
                }
                if !fin.is_empty() {
                    obj["spec"] = json!({"finalizers": fin});
                }
            }
            _ => {}
        }
    }
    Ok(obj)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ld(num: u8, payload: &[u8]) -> Vec<u8> {
        let mut v = vec![(num << 3) | 2, payload.len() as u8];
        v.extend_from_slice(payload);
        v
    }

    #[test]
    fn decodes_namespace_envelope() {
        let mut label = ld(1, b"team");
        label.extend(ld(2, b"a"));
        let mut meta = ld(1, b"foo");
        meta.extend(ld(11, &label));
        let ns = ld(1, &meta);
        let mut tm = ld(1, b"v1");
        tm.extend(ld(2, b"Namespace"));
        let mut unknown = ld(1, &tm);
        unknown.extend(ld(2, &ns));
        let mut body = b"k8s\0".to_vec();
        body.extend(unknown);
        let v = decode_namespace(&body).unwrap();
        assert_eq!(v["metadata"]["name"], "foo");
        assert_eq!(v["metadata"]["labels"]["team"], "a");
        assert!(decode_namespace(b"k8s\0\x0a\xff").is_err());
        assert!(decode_namespace(b"nope").is_err());
    }
}
