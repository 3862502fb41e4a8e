//! Volume and snapshot ids: `<backend>:<locator>`, parsed into typed values
//! and bounded so that no id from a request is ever used raw as a path or a
//! command argument.

use crate::error::{Error, Result};
use std::fmt;

/// `n` random bytes from the kernel's generator (getrandom(2): no file
/// to open, nothing read from `/dev` or `/proc`), as lowercase hex.
#[allow(unsafe_code)] // getrandom(2) through libc: nix has no wrapper for it
pub fn random_hex(n: usize) -> Result<String> {
    let mut buf = vec![0u8; n];
    let mut filled = 0;
    while filled < n {
        let rest = &mut buf[filled..];
        // SAFETY: the kernel writes at most `rest.len()` bytes into `rest`.
        let got = unsafe { libc::getrandom(rest.as_mut_ptr().cast(), rest.len(), 0) };
        if got < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(Error::io("getrandom", e));
        }
        filled += got as usize;
    }
    Ok(buf.iter().map(|b| format!("{b:02x}")).collect())
}

/// CSI's general size limit for strings, which ids must respect.
pub const MAX_ID_LEN: usize = 128;
/// The longest locator a backend may mint.
pub const MAX_LOCATOR_LEN: usize = 100;

/// Whether `name` is a lowercase DNS label: 1-63 of `[a-z0-9-]`, starting and
/// ending with a letter or digit. Backend names take this form.
pub fn is_dns_label(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 63
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !name.starts_with('-')
        && !name.ends_with('-')
}

/// Whether `locator` is safe as one path component and one argument:
/// `[A-Za-z0-9._-]`, starting with a letter or digit, at most
/// [`MAX_LOCATOR_LEN`] bytes. No `/`, no `..`, no leading `-` or `.`.
pub fn is_locator(locator: &str) -> bool {
    !locator.is_empty()
        && locator.len() <= MAX_LOCATOR_LEN
        && locator
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'_' || b == b'-')
        && locator.as_bytes()[0].is_ascii_alphanumeric()
        && !locator.contains("..")
}

fn parse(kind: &str, raw: &str) -> Result<(String, String)> {
    if raw.is_empty() {
        return Err(Error::invalid(format!("{kind} id is required")));
    }
    if raw.len() > MAX_ID_LEN {
        return Err(Error::invalid(format!(
            "{kind} id is longer than {MAX_ID_LEN} bytes"
        )));
    }
    let (backend, locator) = raw
        .split_once(':')
        .ok_or_else(|| Error::not_found(format!("{kind} id {raw:?} is not a ferrovol id")))?;
    if !is_dns_label(backend) || !is_locator(locator) {
        // Ill-formed ids cannot name anything we created: the spec's answer
        // for an id it does not know is NOT_FOUND.
        return Err(Error::not_found(format!(
            "{kind} id {:?} is not a ferrovol id",
            raw.escape_debug().to_string()
        )));
    }
    Ok((backend.to_string(), locator.to_string()))
}

macro_rules! id_type {
    ($name:ident, $kind:literal) => {
        #[doc = concat!("A parsed ", $kind, " id: the backend that owns it and a safe locator.")]
        #[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
        #[serde(try_from = "String", into = "String")]
        pub struct $name {
            backend: String,
            locator: String,
        }

        impl $name {
            /// Builds an id; fails unless both parts are valid.
            pub fn new(backend: &str, locator: &str) -> Result<Self> {
                if !is_dns_label(backend) || !is_locator(locator) || backend.len() + 1 + locator.len() > MAX_ID_LEN {
                    return Err(Error::internal(format!("invalid {} id parts {backend:?}:{locator:?}", $kind)));
                }
                Ok(Self { backend: backend.into(), locator: locator.into() })
            }
            /// Parses an id from a request.
            pub fn parse(raw: &str) -> Result<Self> {
                let (backend, locator) = parse($kind, raw)?;
                Ok(Self { backend, locator })
            }
            pub fn backend(&self) -> &str {
                &self.backend
            }
            /// Safe to use as one path component or command argument.
            pub fn locator(&self) -> &str {
                &self.locator
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{}:{}", self.backend, self.locator)
            }
        }

        impl TryFrom<String> for $name {
            type Error = Error;
            fn try_from(s: String) -> Result<Self> {
                Self::parse(&s)
            }
        }

        impl From<$name> for String {
            fn from(id: $name) -> String {
                id.to_string()
            }
        }
    };
}

id_type!(VolumeId, "volume");
id_type!(SnapshotId, "snapshot");
id_type!(GroupSnapshotId, "group snapshot");

/// Turns a CO-chosen name into a locator: the name itself when it is already
/// a safe locator (so ids stay readable, `pvc-...`), otherwise a digest of it.
/// Backends store the full name beside the volume and compare it, so a
/// digest that happens to equal another name is detected, never confused.
pub fn locator_for_name(name: &str) -> String {
    if is_locator(name) && name.len() <= 64 {
        return name.to_string();
    }
    format!("h-{}", digest_hex(name.as_bytes(), 20))
}

/// Checks a CO-chosen name (volume or snapshot): required, at most 128 bytes,
/// none of the control characters the spec bans.
pub fn validate_name(kind: &str, name: &str) -> Result<()> {
    if name.is_empty() {
        return Err(Error::invalid(format!("{kind} name is required")));
    }
    if name.len() > MAX_ID_LEN {
        return Err(Error::invalid(format!(
            "{kind} name is longer than {MAX_ID_LEN} bytes"
        )));
    }
    let banned = |c: char| {
        let u = c as u32;
        (u <= 0x08)
            || u == 0x0b
            || u == 0x0c
            || (0x0e..=0x1f).contains(&u)
            || (0x7f..=0x9f).contains(&u)
    };
    if name.chars().any(banned) {
        return Err(Error::invalid(format!(
            "{kind} name contains a control character"
        )));
    }
    Ok(())
}

/// The lowercase hex SHA-256 of `data`, cut to `bytes` bytes (32: whole).
pub fn digest_hex(data: &[u8], bytes: usize) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(data)
        .iter()
        .take(bytes)
        .map(|b| format!("{b:02x}"))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn random_hex_is_fresh_hex_of_the_length_asked() {
        let (a, b) = (random_hex(16).unwrap(), random_hex(16).unwrap());
        assert_eq!(a.len(), 32);
        assert!(a
            .bytes()
            .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase()));
        assert_ne!(a, b);
        assert_eq!(random_hex(0).unwrap(), "");
    }
    use crate::error::Kind;

    #[test]
    fn parses_and_displays_round_trip() {
        let id = VolumeId::parse("file:pvc-1234_a.b").unwrap();
        assert_eq!(id.backend(), "file");
        assert_eq!(id.locator(), "pvc-1234_a.b");
        assert_eq!(id.to_string(), "file:pvc-1234_a.b");
        let json = serde_json::to_string(&id).unwrap();
        assert_eq!(json, "\"file:pvc-1234_a.b\"");
        assert_eq!(serde_json::from_str::<VolumeId>(&json).unwrap(), id);
    }

    #[test]
    fn rejects_malformed_and_dangerous_ids() {
        let cases = [
            "file:../etc/passwd",
            "file:a/b",
            "file:..",
            "file:.hidden",
            "file:-rf",
            "File:x",
            "file:",
            ":x",
            "nocolon",
            "file:a b",
            "file:a\0b",
            "-x:y",
            "file:x:y",
        ];
        for raw in cases {
            let err = VolumeId::parse(raw).unwrap_err();
            assert_eq!(err.kind, Kind::NotFound, "{raw}");
        }
        assert_eq!(VolumeId::parse("").unwrap_err().kind, Kind::InvalidArgument);
        assert_eq!(
            VolumeId::parse(&format!("file:{}", "a".repeat(200)))
                .unwrap_err()
                .kind,
            Kind::InvalidArgument
        );
        assert!(serde_json::from_str::<SnapshotId>("\"file:../x\"").is_err());
    }

    #[test]
    fn names_map_to_safe_stable_locators() {
        assert_eq!(locator_for_name("pvc-8f1e"), "pvc-8f1e");
        let odd = locator_for_name("../../etc ünïcode");
        assert!(is_locator(&odd));
        assert!(odd.starts_with("h-"));
        assert_eq!(odd, locator_for_name("../../etc ünïcode"));
        let long = locator_for_name(&"x".repeat(128));
        assert!(is_locator(&long) && long.len() <= MAX_LOCATOR_LEN);
        assert_ne!(locator_for_name("a b"), locator_for_name("a c"));
    }

    #[test]
    fn name_validation_follows_the_spec() {
        assert!(validate_name("volume", "ok name with spaces\tand tab").is_ok());
        assert!(validate_name("volume", "").is_err());
        assert!(validate_name("volume", "bad\u{7}").is_err());
        assert!(validate_name("volume", &"n".repeat(128)).is_ok());
        assert!(validate_name("volume", &"n".repeat(129)).is_err());
    }

    #[test]
    fn dns_labels() {
        assert!(is_dns_label("file"));
        assert!(is_dns_label("lvm-fast2"));
        for bad in ["", "File", "-a", "a-", "a_b", "a.b", &"a".repeat(64)] {
            assert!(!is_dns_label(bad), "{bad}");
        }
    }

    #[test]
    fn digests() {
        assert_eq!(digest_hex(b"abc", 4), "ba7816bf");
        assert_eq!(digest_hex(b"abc", 32).len(), 64);
    }
}
