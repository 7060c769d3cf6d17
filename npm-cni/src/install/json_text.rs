//! Byte spans in a JSON text: the members of an object and the elements of an array, so that the
//! installer rewrites only the bytes it changes and every other byte of a conflist (keys and their
//! order, number spellings, escapes, indentation) stays as the primary CNI wrote it.
//!
//! It scans text that `serde_json` has already accepted; on anything else it answers `None` rather
//! than guessing.

use std::ops::Range;

/// One `"key": value` of an object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Member {
    /// The key, unescaped.
    pub key: String,
    /// The bytes of the value.
    pub value: Range<usize>,
}

/// The span of the top-level value (the text without surrounding whitespace).
pub(crate) fn root(text: &str) -> Option<Range<usize>> {
    let b = text.as_bytes();
    let start = skip_ws(b, 0);
    let end = value_end(b, start)?;
    (skip_ws(b, end) == b.len()).then_some(start..end)
}

/// The members of the object spanning `object`, in text order.
pub(crate) fn object_members(text: &str, object: &Range<usize>) -> Option<Vec<Member>> {
    let b = text.as_bytes();
    if b.get(object.start) != Some(&b'{') {
        return None;
    }
    let mut members = Vec::new();
    let mut i = skip_ws(b, object.start + 1);
    if b.get(i) == Some(&b'}') {
        return Some(members);
    }
    loop {
        if b.get(i) != Some(&b'"') {
            return None;
        }
        let key_end = string_end(b, i)?;
        let key: String = serde_json::from_str(text.get(i..key_end)?).ok()?;
        i = skip_ws(b, key_end);
        if b.get(i) != Some(&b':') {
            return None;
        }
        let start = skip_ws(b, i + 1);
        let end = value_end(b, start)?;
        members.push(Member { key, value: start..end });
        i = skip_ws(b, end);
        match b.get(i)? {
            b',' => i = skip_ws(b, i + 1),
            b'}' => return Some(members),
            _ => return None,
        }
    }
}

/// The elements of the array spanning `array`, in text order.
pub(crate) fn array_elements(text: &str, array: &Range<usize>) -> Option<Vec<Range<usize>>> {
    let b = text.as_bytes();
    if b.get(array.start) != Some(&b'[') {
        return None;
    }
    let mut elements = Vec::new();
    let mut i = skip_ws(b, array.start + 1);
    if b.get(i) == Some(&b']') {
        return Some(elements);
    }
    loop {
        let end = value_end(b, i)?;
        elements.push(i..end);
        i = skip_ws(b, end);
        match b.get(i)? {
            b',' => i = skip_ws(b, i + 1),
            b']' => return Some(elements),
            _ => return None,
        }
    }
}

/// The whitespace right before `pos` (back to the previous non-blank byte).
pub(crate) fn whitespace_before(text: &str, pos: usize) -> &str {
    let b = text.as_bytes();
    let mut start = pos;
    while start > 0 && is_ws(b[start - 1]) {
        start -= 1;
    }
    &text[start..pos]
}

fn is_ws(c: u8) -> bool {
    matches!(c, b' ' | b'\t' | b'\r' | b'\n')
}

fn skip_ws(b: &[u8], mut i: usize) -> usize {
    while b.get(i).copied().is_some_and(is_ws) {
        i += 1;
    }
    i
}

/// The end of the string starting at `start` (its opening quote).
fn string_end(b: &[u8], start: usize) -> Option<usize> {
    let mut i = start + 1;
    loop {
        match b.get(i)? {
            b'\\' => i += 2,
            b'"' => return Some(i + 1),
            _ => i += 1,
        }
    }
}

/// The end of the value starting at `start`.
fn value_end(b: &[u8], start: usize) -> Option<usize> {
    match b.get(start)? {
        b'"' => string_end(b, start),
        b'{' | b'[' => {
            let mut depth = 0usize;
            let mut i = start;
            loop {
                match b.get(i)? {
                    b'"' => {
                        i = string_end(b, i)?;
                        continue;
                    }
                    b'{' | b'[' => depth += 1,
                    b'}' | b']' => {
                        depth -= 1;
                        if depth == 0 {
                            return Some(i + 1);
                        }
                    }
                    _ => {}
                }
                i += 1;
            }
        }
        _ => {
            let mut i = start;
            while b.get(i).is_some_and(|&c| !is_ws(c) && !matches!(c, b',' | b']' | b'}')) {
                i += 1;
            }
            (i > start).then_some(i)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spans_of_members_and_elements() {
        let text = " {\"a\\\"b\" : [1, \"x]\" ,{\"k\":[]}], \"n\":-1.5e3,\"t\":true}\n";
        let root = root(text).unwrap();
        let members = object_members(text, &root).unwrap();
        let keys: Vec<&str> = members.iter().map(|m| m.key.as_str()).collect();
        assert_eq!(keys, ["a\"b", "n", "t"]);
        assert_eq!(&text[members[1].value.clone()], "-1.5e3");
        let elements = array_elements(text, &members[0].value).unwrap();
        let elements: Vec<&str> = elements.into_iter().map(|r| &text[r]).collect();
        assert_eq!(elements, ["1", "\"x]\"", "{\"k\":[]}"]);
        assert_eq!(whitespace_before(text, members[0].value.start), " ");
        assert!(array_elements(text, &members[1].value).is_none());
        assert!(object_members("{}", &(0..2)).unwrap().is_empty());
        assert!(super::root("{} x").is_none());
    }
}
