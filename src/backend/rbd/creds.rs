//! cephx credentials: a user and its key, from the CSI secrets or from a
//! keyring file the config names. The key reaches librados in memory, or
//! the command line through a private keyring file written when needed.

use crate::error::{Error, Result};
use crate::exec::Command;
use crate::sync::LockExt;
use std::path::{Path, PathBuf};

/// A cephx user and its key: from a keyring file of the config, or from
/// the CSI secrets (written to a private keyring file only when a command
/// needs one, and removed with the credentials).
pub struct Creds {
    pub user: String,
    source: KeySource,
    /// The cephx keys these credentials carry: redacted from whatever a
    /// command run with them prints (a tool that echoes its keyring).
    keys: Vec<String>,
    /// The private keyring written for the command line, if one was.
    written: std::sync::Mutex<Option<PathBuf>>,
}

enum KeySource {
    File(PathBuf),
    /// The key is `keys[0]`; a keyring for it goes into this directory.
    Secret(PathBuf),
}

impl Drop for Creds {
    fn drop(&mut self) {
        let written = self.written.get_mut().map(|w| w.take());
        if let Ok(Some(path)) = written {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// The `key = ...` values of a keyring file's text.
pub fn keyring_keys(text: &str) -> Vec<String> {
    text.lines()
        .filter_map(|l| {
            let (k, v) = l.split_once('=')?;
            (k.trim() == "key").then(|| v.trim().to_string())
        })
        .filter(|v| !v.is_empty())
        .collect()
}

/// The key of `[client.<user>]` in a keyring file's text.
pub fn keyring_key_for(text: &str, user: &str) -> Option<String> {
    let section = format!("[client.{user}]");
    let mut inside = false;
    for line in text.lines().map(str::trim) {
        if line.starts_with('[') {
            inside = line == section;
            continue;
        }
        if let Some((k, v)) = line.split_once('=') {
            if inside && k.trim() == "key" && !v.trim().is_empty() {
                return Some(v.trim().to_string());
            }
        }
    }
    None
}

/// A cephx user name: `client.` is implied.
pub fn check_user(user: &str) -> Result<()> {
    if user.is_empty()
        || user.len() > 64
        || !user
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
    {
        return Err(Error::invalid(
            "secrets: userID must be 1 to 64 of a-z, A-Z, 0-9, '.', '_', '-'",
        ));
    }
    Ok(())
}

impl Creds {
    /// `cmd` with these credentials' keys marked secret.
    pub(super) fn hidden(&self, cmd: Command) -> Command {
        self.keys.iter().fold(cmd, |c, k| c.secret(k.clone()))
    }

    /// Credentials from a keyring file the config names.
    pub fn from_file(user: &str, keyring: &Path) -> Result<Self> {
        check_user(user)?;
        // Unreadable: rbd will say so; there is no key to hide then.
        let text = std::fs::read_to_string(keyring).unwrap_or_default();
        let mut keys = keyring_keys(&text);
        // The user's own key first: the one a kept connection uses.
        if let Some(own) = keyring_key_for(&text, user) {
            keys.retain(|k| *k != own);
            keys.insert(0, own);
        }
        Ok(Creds {
            user: user.into(),
            source: KeySource::File(keyring.into()),
            keys,
            written: Default::default(),
        })
    }

    /// Credentials from the CSI secrets; a keyring for the command line
    /// goes into `dir` when one is needed.
    pub fn from_key(user: &str, key: &str, dir: &Path) -> Result<Self> {
        check_user(user)?;
        if key.len() < 16
            || key.len() > 128
            || !key
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"+/=".contains(&b))
        {
            return Err(Error::invalid(
                "secrets: userKey is not a cephx key (base64)",
            ));
        }
        Ok(Creds {
            user: user.into(),
            source: KeySource::Secret(dir.into()),
            keys: vec![key.to_string()],
            written: Default::default(),
        })
    }

    /// The cephx key itself, for a connection of the driver's own.
    pub fn key(&self) -> Result<&str> {
        match (&self.source, self.keys.first()) {
            (_, Some(k)) => Ok(k),
            (KeySource::File(path), None) => Err(Error::invalid(format!(
                "keyring {} holds no key the driver can read for client.{}",
                path.display(),
                self.user
            ))),
            (KeySource::Secret(_), None) => Err(Error::internal("credentials without a key")),
        }
    }

    /// A keyring file for the command line: the config's, or a private
    /// one (only root can read it) written for these credentials once.
    pub fn keyring(&self) -> Result<PathBuf> {
        let dir = match &self.source {
            KeySource::File(path) => return Ok(path.clone()),
            KeySource::Secret(dir) => dir,
        };
        let mut written = self.written.locked();
        if let Some(path) = &*written {
            return Ok(path.clone());
        }
        crate::records::private_dir(dir)?;
        let keyring = dir.join(format!("{}.keyring", crate::id::random_hex(12)?));
        // Recorded before the write: a failed write is removed too.
        *written = Some(keyring.clone());
        let body = format!("[client.{}]\n\tkey = {}\n", self.user, self.key()?);
        crate::records::write(&keyring, body.as_bytes())?;
        Ok(keyring)
    }
}
