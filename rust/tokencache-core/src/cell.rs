//! The per-node atomic word that makes pin/unpin lock-free.
//!
//! A node is *protected* (SGLang: `lock_ref > 0`) when it or any node below it is pinned. Instead
//! of counting pins along the whole path (a walk to the root), each node counts its own pins plus
//! its protected children. Pinning moves one node's word; only a 0 <-> non-zero crossing changes
//! what is protected, and that is reconciled under the tree lock, walking up only through nodes
//! whose state really changes.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::{Error, Result};

/// Set once a node has left the tree; pins on it fail from then on.
const DEAD: u64 = 1 << 63;
/// Low half: direct pins (cursors, locks) held on the node itself.
const PINS_MASK: u64 = 0xFFFF_FFFF;
/// High half (below DEAD): how many children are protected.
pub(crate) const CHILD_UNIT: u64 = 1 << 32;

#[derive(Debug, Default)]
pub struct NodeCell {
    state: AtomicU64,
}

/// What a pin or unpin did to the node's protection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Crossing {
    None,
    BecameProtected,
    BecameUnprotected,
}

impl NodeCell {
    pub(crate) fn with_state(state: u64) -> Self {
        Self {
            state: AtomicU64::new(state),
        }
    }

    pub(crate) fn load(&self) -> u64 {
        self.state.load(Ordering::Acquire)
    }

    pub fn is_dead(&self) -> bool {
        self.load() & DEAD != 0
    }

    /// Direct pins on this node (not counting protected children).
    pub fn pins(&self) -> u32 {
        (self.load() & PINS_MASK) as u32
    }

    pub(crate) fn is_protected(state: u64) -> bool {
        state & !DEAD != 0
    }

    pub(crate) fn protected_children(state: u64) -> u64 {
        (state & !DEAD) >> 32
    }

    pub(crate) fn pin(&self) -> Result<Crossing> {
        let mut cur = self.load();
        loop {
            if cur & DEAD != 0 {
                return Err(Error::StaleHandle(
                    "node was evicted, removed or reset".into(),
                ));
            }
            if cur & PINS_MASK == PINS_MASK {
                return Err(Error::LockState("too many pins on one node".into()));
            }
            match self.state.compare_exchange_weak(
                cur,
                cur + 1,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) if cur == 0 => return Ok(Crossing::BecameProtected),
                Ok(_) => return Ok(Crossing::None),
                Err(actual) => cur = actual,
            }
        }
    }

    pub(crate) fn unpin(&self) -> Result<Crossing> {
        let mut cur = self.load();
        loop {
            if cur & DEAD != 0 {
                return Err(Error::StaleHandle(
                    "node was evicted, removed or reset".into(),
                ));
            }
            if cur & PINS_MASK == 0 {
                return Err(Error::LockState(
                    "unlock of a node that holds no lock".into(),
                ));
            }
            match self.state.compare_exchange_weak(
                cur,
                cur - 1,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) if cur == 1 => return Ok(Crossing::BecameUnprotected),
                Ok(_) => return Ok(Crossing::None),
                Err(actual) => cur = actual,
            }
        }
    }

    /// Count one more or one fewer protected child. Only called under the tree lock.
    pub(crate) fn add_protected_child(&self, up: bool) {
        if up {
            self.state.fetch_add(CHILD_UNIT, Ordering::AcqRel);
        } else {
            self.state.fetch_sub(CHILD_UNIT, Ordering::AcqRel);
        }
    }

    /// Mark dead if the word is exactly `expected` (nobody pinned it meanwhile).
    pub(crate) fn try_kill(&self, expected: u64) -> bool {
        self.state
            .compare_exchange(expected, DEAD, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }

    /// Undo a `try_kill` whose plan was abandoned.
    pub(crate) fn revive(&self, state: u64) {
        self.state.store(state, Ordering::Release);
    }

    pub(crate) fn kill(&self) {
        self.state.fetch_or(DEAD, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pin_crossings() {
        let c = NodeCell::default();
        assert_eq!(c.pin().unwrap(), Crossing::BecameProtected);
        assert_eq!(c.pin().unwrap(), Crossing::None);
        assert_eq!(c.unpin().unwrap(), Crossing::None);
        assert_eq!(c.unpin().unwrap(), Crossing::BecameUnprotected);
        assert!(matches!(c.unpin(), Err(Error::LockState(_))));
    }

    #[test]
    fn child_protection_keeps_node_protected() {
        let c = NodeCell::default();
        c.add_protected_child(true);
        assert_eq!(c.pin().unwrap(), Crossing::None);
        assert_eq!(c.unpin().unwrap(), Crossing::None);
        assert!(NodeCell::is_protected(c.load()));
        assert!(matches!(c.unpin(), Err(Error::LockState(_))));
    }

    #[test]
    fn dead_cells_refuse_pins() {
        let c = NodeCell::default();
        assert!(c.try_kill(0));
        assert!(matches!(c.pin(), Err(Error::StaleHandle(_))));
        assert!(!NodeCell::default().with_pin_then_kill());
    }

    impl NodeCell {
        fn with_pin_then_kill(&self) -> bool {
            self.pin().unwrap();
            self.try_kill(0)
        }
    }
}
