//! Structured locators: several fields (server, share, subdirectory; pool,
//! namespace, image; target, LUN) in one locator, so that a remote backend
//! finds its volume from the id alone and keeps no state.
//!
//! Form: `v1` then `.` and one escaped field each. A field keeps
//! `[A-Za-z0-9-]` as they are; `/` becomes `_s`, `.` `_d`, `_` `_u`, `:` `_c`,
//! an empty field `_e`, and any other byte `_x` and two lowercase hex digits.
//! The result is a valid locator (never `..`, never a leading `-` or `.`),
//! and decoding accepts only what encoding produces, so one set of fields
//! has exactly one locator. Decoded fields are plain strings: a backend
//! still validates each (a host name, a path below its share) before it
//! uses one in a path or on a command line.

use crate::error::{Error, Result};
use crate::id::{is_locator, MAX_LOCATOR_LEN};

const VERSION: &str = "v1";

fn escape_into(out: &mut String, field: &str) {
    if field.is_empty() {
        out.push_str("_e");
        return;
    }
    for b in field.bytes() {
        match b {
            b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'-' => out.push(b as char),
            b'/' => out.push_str("_s"),
            b'.' => out.push_str("_d"),
            b'_' => out.push_str("_u"),
            b':' => out.push_str("_c"),
            other => {
                out.push_str("_x");
                out.push_str(&format!("{other:02x}"));
            }
        }
    }
}

/// Puts `fields` in one locator. Fails (INVALID_ARGUMENT) when the result
/// would be longer than a locator may be, naming the limit.
pub fn join_fields(fields: &[&str]) -> Result<String> {
    let mut out = String::from(VERSION);
    for f in fields {
        out.push('.');
        escape_into(&mut out, f);
    }
    if out.len() > MAX_LOCATOR_LEN {
        return Err(Error::invalid(format!(
            "the volume's location needs {} bytes in its id, more than the {MAX_LOCATOR_LEN} an id allows: use shorter names",
            out.len()
        )));
    }
    debug_assert!(is_locator(&out), "{out}");
    Ok(out)
}

fn unescape(field: &str) -> Option<String> {
    if field == "_e" {
        return Some(String::new());
    }
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'-' => out.push(bytes[i]),
            b'_' => {
                i += 1;
                match bytes.get(i)? {
                    b's' => out.push(b'/'),
                    b'd' => out.push(b'.'),
                    b'u' => out.push(b'_'),
                    b'c' => out.push(b':'),
                    b'x' => {
                        let hex = field.get(i + 1..i + 3)?;
                        if hex.bytes().any(|c| c.is_ascii_uppercase()) {
                            return None;
                        }
                        let v = u8::from_str_radix(hex, 16).ok()?;
                        // Only bytes that have no shorter form are hex-escaped.
                        if v.is_ascii_alphanumeric() || b"-/._:".contains(&v) {
                            return None;
                        }
                        out.push(v);
                        i += 2;
                    }
                    _ => return None,
                }
            }
            _ => return None,
        }
        i += 1;
    }
    if out.is_empty() {
        return None;
    }
    String::from_utf8(out).ok()
}

/// The `n` fields of a locator made by [`join_fields`]. Anything else is a
/// locator this backend never minted: NOT_FOUND, as for any unknown id.
pub fn split_fields(locator: &str, n: usize) -> Result<Vec<String>> {
    let not_ours = || Error::not_found(format!("{locator:?} is not a locator of this backend"));
    let mut parts = locator.split('.');
    if parts.next() != Some(VERSION) {
        return Err(not_ours());
    }
    let fields: Vec<String> = parts
        .map(unescape)
        .collect::<Option<_>>()
        .ok_or_else(not_ours)?;
    if fields.len() != n {
        return Err(not_ours());
    }
    Ok(fields)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Kind;

    #[test]
    fn round_trips_hosts_paths_and_odd_bytes() {
        let cases: &[&[&str]] = &[
            &["10.0.0.1", "/export/k8s", "pvc-1"],
            &["nfs.example.com", "/", ""],
            &["[::1]", "/srv/a_b:c", "é ü"],
            &["rbd", "", "img"],
        ];
        for fields in cases {
            let l = join_fields(fields).unwrap();
            assert!(is_locator(&l), "{l}");
            assert_eq!(split_fields(&l, fields.len()).unwrap(), *fields, "{l}");
        }
        assert_eq!(
            join_fields(&["10.0.0.1", "/export"]).unwrap(),
            "v1.10_d0_d0_d1._sexport"
        );
    }

    #[test]
    fn refuses_what_it_did_not_mint() {
        for bad in [
            "v1.a._x2f", // '/' has a short form
            "v1.a._x4A", // uppercase hex
            "v1.a._x41", // 'A' needs no escape
            "v1.a._q",   // unknown escape
            "v1.a._",    // dangling escape
            "v2.a.b",    // unknown version
            "pvc-1",     // a plain locator
            "v1.a",      // wrong field count
            "v1.a.b.c",  // wrong field count
            "v1.a._xff", // not UTF-8 alone
        ] {
            assert_eq!(
                split_fields(bad, 2).unwrap_err().kind,
                Kind::NotFound,
                "{bad}"
            );
        }
    }

    #[test]
    fn bounded_length() {
        let long = "x".repeat(200);
        assert_eq!(
            join_fields(&["server", &long]).unwrap_err().kind,
            Kind::InvalidArgument
        );
    }
}
