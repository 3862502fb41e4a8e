//! Per-volume operation guards. A second operation on a busy key is refused
//! at once with ABORTED (never queued), as the CSI spec allows. Keys can be
//! held exclusively or shared, so that publishes of one volume to different
//! targets run side by side while stage and unstage exclude them all.

use crate::error::{Error, Result};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Held {
    Exclusive,
    Shared(usize),
}

/// A table of busy keys.
#[derive(Debug, Default, Clone)]
pub struct OpLocks {
    table: Arc<Mutex<HashMap<String, Held>>>,
}

/// Holds keys until dropped.
#[derive(Debug)]
pub struct OpGuard {
    table: Arc<Mutex<HashMap<String, Held>>>,
    exclusive: Vec<String>,
    shared: Vec<String>,
}

impl OpLocks {
    pub fn new() -> Self {
        Self::default()
    }

    /// Takes every key in `exclusive` exclusively and every key in `shared`
    /// shared, all or nothing. ABORTED names the first busy key.
    pub fn try_lock(&self, exclusive: &[String], shared: &[String]) -> Result<OpGuard> {
        let mut table = self.table.lock().expect("lock table poisoned");
        for key in exclusive {
            if table.contains_key(key) {
                return Err(Error::aborted(format!(
                    "an operation on {key} is already in progress"
                )));
            }
        }
        for key in shared {
            if table.get(key) == Some(&Held::Exclusive) || exclusive.contains(key) {
                return Err(Error::aborted(format!(
                    "an operation on {key} is already in progress"
                )));
            }
        }
        for key in exclusive {
            table.insert(key.clone(), Held::Exclusive);
        }
        for key in shared {
            let entry = table.entry(key.clone()).or_insert(Held::Shared(0));
            if let Held::Shared(n) = entry {
                *n += 1;
            }
        }
        Ok(OpGuard {
            table: self.table.clone(),
            exclusive: exclusive.to_vec(),
            shared: shared.to_vec(),
        })
    }

    /// Takes `keys` exclusively.
    pub fn try_exclusive(&self, keys: &[String]) -> Result<OpGuard> {
        self.try_lock(keys, &[])
    }

    /// How many keys are held (for tests and metrics).
    pub fn held(&self) -> usize {
        self.table.lock().expect("lock table poisoned").len()
    }
}

impl Drop for OpGuard {
    fn drop(&mut self) {
        let mut table = match self.table.lock() {
            Ok(t) => t,
            Err(p) => p.into_inner(),
        };
        for key in &self.exclusive {
            table.remove(key);
        }
        for key in &self.shared {
            if let Some(Held::Shared(n)) = table.get_mut(key) {
                *n -= 1;
                if *n == 0 {
                    table.remove(key);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Kind;

    fn k(s: &str) -> String {
        s.to_string()
    }

    #[test]
    fn second_exclusive_is_aborted_and_freed_on_drop() {
        let locks = OpLocks::new();
        let g = locks.try_exclusive(&[k("vol:a")]).unwrap();
        let err = locks.try_exclusive(&[k("vol:a")]).unwrap_err();
        assert_eq!(err.kind, Kind::Aborted);
        assert!(err.message.contains("vol:a"));
        assert!(locks.try_exclusive(&[k("vol:b")]).is_ok());
        drop(g);
        assert_eq!(locks.held(), 0);
        assert!(locks.try_exclusive(&[k("vol:a")]).is_ok());
    }

    #[test]
    fn shared_holders_coexist_but_exclude_exclusive() {
        let locks = OpLocks::new();
        let p1 = locks.try_lock(&[k("t:1")], &[k("vol:a")]).unwrap();
        let p2 = locks.try_lock(&[k("t:2")], &[k("vol:a")]).unwrap();
        assert_eq!(
            locks.try_lock(&[k("t:1")], &[k("vol:a")]).unwrap_err().kind,
            Kind::Aborted
        );
        assert_eq!(
            locks.try_exclusive(&[k("vol:a")]).unwrap_err().kind,
            Kind::Aborted
        );
        drop(p1);
        assert!(locks.try_exclusive(&[k("vol:a")]).is_err());
        drop(p2);
        let stage = locks.try_exclusive(&[k("vol:a")]).unwrap();
        assert!(locks.try_lock(&[k("t:3")], &[k("vol:a")]).is_err());
        drop(stage);
        assert_eq!(locks.held(), 0);
    }

    #[test]
    fn all_or_nothing() {
        let locks = OpLocks::new();
        let _g = locks.try_exclusive(&[k("b")]).unwrap();
        assert!(locks.try_exclusive(&[k("a"), k("b")]).is_err());
        // "a" was not left behind by the failed attempt.
        assert!(locks.try_exclusive(&[k("a")]).is_ok());
    }

    #[test]
    fn concurrent_attempts_admit_exactly_one() {
        let locks = OpLocks::new();
        let barrier = std::sync::Arc::new(std::sync::Barrier::new(8));
        let handles: Vec<_> = (0..8)
            .map(|_| {
                let locks = locks.clone();
                let barrier = barrier.clone();
                std::thread::spawn(move || {
                    barrier.wait();
                    locks.try_exclusive(&[k("vol:x")]).map(|g| {
                        std::thread::sleep(std::time::Duration::from_millis(50));
                        drop(g)
                    })
                })
            })
            .collect();
        let ok = handles
            .into_iter()
            .map(|h| h.join().unwrap())
            .filter(Result::is_ok)
            .count();
        assert_eq!(ok, 1);
    }
}

/// Per-key async mutexes that wait (unlike [`OpLocks`], which refuse): for
/// short critical sections inside a backend, such as "check the image
/// exists, then attach it" against "check it is not attached, then delete
/// it". Entries are dropped when no one holds or waits for them.
#[derive(Debug, Default)]
pub struct KeyedMutex {
    table: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
}

/// Holds one key of a [`KeyedMutex`].
pub struct KeyedGuard<'a> {
    owner: &'a KeyedMutex,
    key: String,
    guard: Option<tokio::sync::OwnedMutexGuard<()>>,
}

impl KeyedMutex {
    pub fn new() -> Self {
        Self::default()
    }

    /// Waits for `key` and holds it until the guard drops.
    pub async fn lock(&self, key: &str) -> KeyedGuard<'_> {
        let m = self
            .table
            .lock()
            .expect("keyed mutex poisoned")
            .entry(key.to_string())
            .or_default()
            .clone();
        let guard = m.lock_owned().await;
        KeyedGuard {
            owner: self,
            key: key.to_string(),
            guard: Some(guard),
        }
    }

    /// Holds several keys, taken in sorted order so two callers asking for
    /// overlapping sets cannot deadlock.
    pub async fn lock_all(&self, keys: &[String]) -> Vec<KeyedGuard<'_>> {
        let mut sorted: Vec<&String> = keys.iter().collect();
        sorted.sort();
        sorted.dedup();
        let mut guards = Vec::with_capacity(sorted.len());
        for k in sorted {
            guards.push(self.lock(k).await);
        }
        guards
    }

    /// How many keys have an entry (held or waited for).
    pub fn len(&self) -> usize {
        self.table.lock().expect("keyed mutex poisoned").len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Drop for KeyedGuard<'_> {
    fn drop(&mut self) {
        drop(self.guard.take());
        let mut table = match self.owner.table.lock() {
            Ok(t) => t,
            Err(p) => p.into_inner(),
        };
        // Only the table's own reference left: nobody holds or waits.
        if table
            .get(&self.key)
            .is_some_and(|m| Arc::strong_count(m) == 1)
        {
            table.remove(&self.key);
        }
    }
}

#[cfg(test)]
mod keyed_tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn same_key_waits_other_keys_do_not() {
        let m = Arc::new(KeyedMutex::new());
        let g = m.lock("a").await;
        let m2 = m.clone();
        let waiter = tokio::spawn(async move {
            let _g = m2.lock("a").await;
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(
            !waiter.is_finished(),
            "second holder of the same key got in"
        );
        let _b = m.lock("b").await;
        drop(g);
        waiter.await.unwrap();
        drop(_b);
        assert!(m.is_empty(), "entries are cleaned up");
    }

    #[tokio::test]
    async fn overlapping_sets_in_any_order_do_not_deadlock() {
        let m = Arc::new(KeyedMutex::new());
        let mut tasks = Vec::new();
        for i in 0..16 {
            let m = m.clone();
            tasks.push(tokio::spawn(async move {
                let keys = if i % 2 == 0 {
                    vec!["x".to_string(), "y".to_string()]
                } else {
                    vec!["y".to_string(), "x".to_string(), "y".to_string()]
                };
                let _g = m.lock_all(&keys).await;
                tokio::task::yield_now().await;
            }));
        }
        let all = async {
            for t in tasks {
                t.await.unwrap();
            }
        };
        tokio::time::timeout(Duration::from_secs(5), all)
            .await
            .expect("deadlock");
        assert!(m.is_empty());
    }
}
