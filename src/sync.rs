//! One rule for a std mutex that a panic left poisoned: take the data as
//! it is and go on. What the driver guards this way are maps and queues
//! whose every update is a single insert, remove or push, so no half-made
//! state is behind a poisoned lock, and one panicked task must not turn
//! every later call that touches the same table into a panic.

use std::sync::{Mutex, MutexGuard};

pub trait LockExt<T> {
    /// The guard, poisoned or not.
    fn locked(&self) -> MutexGuard<'_, T>;
}

impl<T> LockExt<T> for Mutex<T> {
    fn locked(&self) -> MutexGuard<'_, T> {
        self.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_poisoned_lock_is_taken_as_it_is() {
        let m = std::sync::Arc::new(Mutex::new(vec![1]));
        let m2 = m.clone();
        let _ = std::thread::spawn(move || {
            let mut v = m2.lock().unwrap();
            v.push(2);
            panic!("poison it");
        })
        .join();
        assert!(m.lock().is_err(), "poisoned");
        assert_eq!(*m.locked(), [1, 2]);
    }
}
