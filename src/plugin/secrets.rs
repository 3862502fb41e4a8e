//! CSI `secrets` maps as backends receive them: a type whose `Debug` and
//! `Display` never show a value, and which cannot be serialized into the
//! node state or a log by accident.

use std::collections::{BTreeMap, HashMap};
use std::fmt;

/// The secrets a request carried (credentials for rbd, CHAP for iSCSI).
/// Values leave this type only through [`Secrets::get`], and whoever puts
/// one on a command line marks it secret on the command so the exec seam
/// redacts it.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Secrets(BTreeMap<String, String>);

impl Secrets {
    pub fn new(values: BTreeMap<String, String>) -> Self {
        Self(values)
    }

    /// The value of `key`, if the request carried it.
    pub fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).map(String::as_str)
    }

    /// The keys the request carried (keys are names, not secrets).
    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.0.keys().map(String::as_str)
    }

    /// Every value, for redaction lists.
    pub fn values(&self) -> impl Iterator<Item = &str> {
        self.0.values().map(String::as_str)
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }
}

impl From<&HashMap<String, String>> for Secrets {
    fn from(map: &HashMap<String, String>) -> Self {
        Self(map.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
    }
}

impl fmt::Debug for Secrets {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Secrets({} redacted)", self.0.len())
    }
}

impl fmt::Display for Secrets {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn never_prints_values() {
        let s = Secrets::new(BTreeMap::from([
            ("userKey".to_string(), "hunter2-value".to_string()),
            ("password".to_string(), "s3cr3t".to_string()),
        ]));
        for shown in [format!("{s:?}"), format!("{s}"), format!("{:#?}", s)] {
            assert!(
                !shown.contains("hunter2") && !shown.contains("s3cr3t"),
                "{shown}"
            );
            assert!(shown.contains('2'), "the count is shown: {shown}");
        }
        assert_eq!(s.get("password"), Some("s3cr3t"));
        assert_eq!(s.keys().collect::<Vec<_>>(), ["password", "userKey"]);
    }
}
