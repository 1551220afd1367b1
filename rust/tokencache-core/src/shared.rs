//! What every handle to one tree shares: the mutex around its inner state and the queue of
//! protection changes made by lock-free pins, applied whenever the lock is taken.

use std::sync::Arc;

use crossbeam_queue::SegQueue;
use parking_lot::{Mutex, MutexGuard};

use crate::cell::Crossing;
use crate::config::TreeConfig;
use crate::error::{Error, Result};
use crate::handle::NodeHandle;
use crate::inner::Inner;
use crate::node::NodeId;

pub(crate) struct Shared {
    pub id: u64,
    pub config: TreeConfig,
    pub inner: Mutex<Inner>,
    /// Nodes whose protection crossed zero outside the lock, awaiting reconciliation.
    pub dirty: SegQueue<NodeId>,
}

impl Shared {
    /// Take the tree lock with every pending protection change applied.
    pub fn lock(&self) -> MutexGuard<'_, Inner> {
        let mut inner = self.inner.lock();
        self.drain_dirty(&mut inner);
        inner
    }

    /// Apply protection changes queued since the lock was taken.
    pub fn drain_dirty(&self, inner: &mut Inner) {
        while let Some(id) = self.dirty.pop() {
            inner.reconcile(id);
        }
    }

    pub fn handle(&self, inner: &Inner, id: NodeId) -> NodeHandle {
        NodeHandle {
            tree: self.id,
            id,
            cell: inner.arena[id].cell.clone(),
            is_root: inner.arena[id].is_root,
        }
    }

    pub fn check_foreign(&self, h: &NodeHandle) -> Result<()> {
        if h.tree != self.id {
            return Err(Error::ForeignHandle(
                "node handle belongs to another tree".into(),
            ));
        }
        Ok(())
    }

    pub fn check_handle(&self, inner: &Inner, h: &NodeHandle) -> Result<()> {
        self.check_foreign(h)?;
        match inner.arena.get(h.id) {
            Some(n) if Arc::ptr_eq(&n.cell, &h.cell) && !h.cell.is_dead() => Ok(()),
            _ => Err(Error::StaleHandle(format!(
                "node {}:{} was evicted, removed or reset",
                h.id.index, h.id.generation
            ))),
        }
    }

    /// Record a pin change made without the lock.
    pub fn note_crossing(&self, id: NodeId, crossing: Crossing) {
        if crossing != Crossing::None {
            self.dirty.push(id);
        }
    }
}
