//! The state directory's format: which layout of records, journals and
//! intents it holds, and which version of ferrovol wrote it, kept in
//! `<state-dir>/format.json`. A driver reads the formats up to its own
//! and refuses, before it reads anything else there, a directory a newer
//! version wrote: never half of it.
//!
//! Format 1 is what 0.1.0 writes (a directory without the stamp is one of
//! its own, from before the stamp: format 1 too). A change of any record's
//! layout makes a new format; the driver then reads the one before it (a
//! fixture of it is kept under `tests/`) and writes the new stamp once it
//! has started.

use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};
use std::path::Path;

/// The format this driver writes.
pub const FORMAT: u32 = 1;
/// The file the stamp is kept in.
pub const FILE: &str = "format.json";

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stamp {
    /// The layout's number.
    pub format: u32,
    /// The version of ferrovol that last started on it.
    pub written_by: String,
}

/// This driver's own stamp.
pub fn ours() -> Stamp {
    Stamp {
        format: FORMAT,
        written_by: env!("CARGO_PKG_VERSION").to_string(),
    }
}

/// Checks `dir`'s stamp against this driver's formats, then stamps it as
/// this version's (a new directory, one without a stamp, or one of an
/// older format that this version reads). A stamp of a newer format, or
/// one that cannot be read, is an error naming both versions.
pub fn adopt(dir: &Path) -> Result<Stamp> {
    let path = dir.join(FILE);
    let found: Option<Stamp> = match std::fs::read(&path) {
        Ok(bytes) => Some(serde_json::from_slice(&bytes).map_err(|e| {
            Error::precondition(format!(
                "state directory {}: {} cannot be read ({e}); this is ferrovol {}, which writes format {FORMAT}: refusing to start",
                dir.display(),
                FILE,
                env!("CARGO_PKG_VERSION"),
            ))
        })?),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => return Err(Error::io(format!("read {}", path.display()), e)),
    };
    if let Some(s) = &found {
        if s.format > FORMAT {
            return Err(Error::precondition(format!(
                "state directory {} is in format {}, written by ferrovol {}; this is ferrovol {}, which reads formats up to {FORMAT}: refusing to start (start ferrovol {} or newer)",
                dir.display(),
                s.format,
                s.written_by,
                env!("CARGO_PKG_VERSION"),
                s.written_by,
            )));
        }
    }
    let ours = ours();
    if found.as_ref() != Some(&ours) {
        let bytes = serde_json::to_vec(&ours).expect("a stamp serializes");
        crate::records::write(&path, &bytes)?;
        if let Some(s) = &found {
            tracing::info!(from = %s.written_by, format = s.format, "state directory adopted");
        }
    }
    Ok(ours)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_new_directory_is_stamped_and_an_older_one_adopted() {
        let d = tempfile::tempdir().unwrap();
        assert_eq!(adopt(d.path()).unwrap(), ours());
        let read: Stamp =
            serde_json::from_slice(&std::fs::read(d.path().join(FILE)).unwrap()).unwrap();
        assert_eq!(read, ours());
        // An older version of the same format: restamped.
        std::fs::write(d.path().join(FILE), r#"{"format":1,"written_by":"0.0.9"}"#).unwrap();
        adopt(d.path()).unwrap();
        let read: Stamp =
            serde_json::from_slice(&std::fs::read(d.path().join(FILE)).unwrap()).unwrap();
        assert_eq!(read, ours());
    }

    #[test]
    fn a_newer_format_is_refused_naming_both_versions() {
        let d = tempfile::tempdir().unwrap();
        let newer = format!(r#"{{"format":{},"written_by":"9.1.0"}}"#, FORMAT + 1);
        std::fs::write(d.path().join(FILE), &newer).unwrap();
        let e = adopt(d.path()).unwrap_err();
        assert!(e.message.contains("9.1.0"), "{}", e.message);
        assert!(
            e.message.contains(env!("CARGO_PKG_VERSION")),
            "{}",
            e.message
        );
        assert!(e.message.contains("refusing to start"), "{}", e.message);
        // Left as it was.
        assert_eq!(std::fs::read_to_string(d.path().join(FILE)).unwrap(), newer);
        // A stamp that cannot be read is refused too.
        std::fs::write(d.path().join(FILE), "{not json").unwrap();
        let e = adopt(d.path()).unwrap_err();
        assert!(e.message.contains("cannot be read"), "{}", e.message);
    }
}
