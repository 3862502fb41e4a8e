//! The node paths a CO sends, checked: staging and target paths must be
//! absolute and normal (the targets themselves are made and removed
//! through the `Host` seam).

use crate::error::{Error, Result};
use std::path::{Path, PathBuf};

/// Longest path accepted (Linux PATH_MAX).
pub const MAX_PATH: usize = 4096;

/// Validates a path from a request: required, absolute, at most PATH_MAX,
/// no `.`/`..` components, no NUL.
pub fn validate(raw: &str, field: &str) -> Result<PathBuf> {
    if raw.is_empty() {
        return Err(Error::invalid(format!("{field} is required")));
    }
    if raw.len() > MAX_PATH {
        return Err(Error::invalid(format!(
            "{field} is longer than {MAX_PATH} bytes"
        )));
    }
    if raw.contains('\0') {
        return Err(Error::invalid(format!("{field} contains NUL")));
    }
    let path = Path::new(raw);
    if !path.is_absolute() {
        return Err(Error::invalid(format!("{field} must be an absolute path")));
    }
    if raw.split('/').any(|c| c == "." || c == "..") || raw.contains("//") {
        return Err(Error::invalid(format!(
            "{field} must be a normal path (no '.', '..' or '//')"
        )));
    }
    let trimmed = if raw.len() > 1 {
        raw.trim_end_matches('/')
    } else {
        raw
    };
    Ok(PathBuf::from(trimmed))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Kind;

    #[test]
    fn validates_paths() {
        assert_eq!(
            validate("/var/lib/kubelet/x/", "p").unwrap(),
            PathBuf::from("/var/lib/kubelet/x")
        );
        for bad in ["", "relative/x", "/a/../etc", "/a/./b", "/a//b", "/a\0b"] {
            assert_eq!(
                validate(bad, "p").unwrap_err().kind,
                Kind::InvalidArgument,
                "{bad:?}"
            );
        }
        assert!(validate(&format!("/{}", "a".repeat(5000)), "p").is_err());
    }
}
