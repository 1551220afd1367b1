//! The radix tree's public API: token-id prefixes mapped to KV slot indices, with SGLang
//! `RadixCache` semantics (page-granular matching, split on match, namespaces, eviction of
//! unlocked leaves, exact evictable / protected sizes).
//!
//! Structure lives behind one mutex (`shared.rs`, `inner.rs`); pins live in per-node atomics
//! (`cell.rs`), so pinning and unpinning never take the tree lock. Their rare protection changes
//! are queued and reconciled by the next operation that holds the lock, before it reads or
//! changes anything.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crossbeam_queue::SegQueue;
use parking_lot::Mutex;

use crate::cell::NodeCell;
use crate::config::{Sizes, TreeConfig};
use crate::error::{Error, Result};
use crate::events::{Digest, KvEvent, KvEventKind};
#[cfg(feature = "fault-injection")]
use crate::fault::Fault;
use crate::handle::{InsertOutput, MatchOutput, NodeHandle};
use crate::inner::Inner;
use crate::node::{LeafKey, NodeId, PageKey};
use crate::shared::Shared;
use crate::validate::{validate_held, validate_insert};

static NEXT_TREE_ID: AtomicU64 = AtomicU64::new(1);

/// A radix KV-prefix tree. Cloning gives another reference to the same tree.
#[derive(Clone)]
pub struct RadixTree {
    pub(crate) shared: Arc<Shared>,
}

impl RadixTree {
    pub fn new(config: TreeConfig) -> Result<Self> {
        if config.page_size == 0 {
            return Err(Error::InvalidArgument(
                "page_size must be at least 1".into(),
            ));
        }
        Ok(Self {
            shared: Arc::new(Shared {
                id: NEXT_TREE_ID.fetch_add(1, Ordering::Relaxed),
                config,
                inner: Mutex::new(Inner::new(config)),
                dirty: SegQueue::new(),
            }),
        })
    }

    pub fn config(&self) -> TreeConfig {
        self.shared.config
    }

    pub fn root(&self) -> NodeHandle {
        let inner = self.shared.lock();
        let id = inner.roots[&None];
        self.shared.handle(&inner, id)
    }

    /// Longest cached page-aligned prefix of `tokens`; splits the node where it ends inside one.
    pub fn match_prefix(&self, tokens: &[u32], namespace: Option<&str>) -> MatchOutput {
        let mut inner = self.shared.lock();
        let root = inner.root(namespace);
        let mut slots = Vec::new();
        let (node, length) = inner.descend(root, tokens, None, &mut |run, _| {
            slots.extend_from_slice(run)
        });
        #[cfg(feature = "fault-injection")]
        let length = if inner.fault == Some(Fault::ShortMatch) && length > 0 {
            slots.pop();
            length - 1
        } else {
            length
        };
        MatchOutput {
            length,
            slots,
            node: self.shared.handle(&inner, node),
        }
    }

    /// How many leading tokens of `tokens` the tree holds (page aligned): `match_prefix`'s
    /// length, asked as a question. Read only: no node split, no access time or hit counted
    /// (a question is not a use), no slots copied out.
    pub fn cached_prefix_len(&self, tokens: &[u32], namespace: Option<&str>) -> usize {
        let inner = self.shared.lock();
        match inner.existing_root(namespace) {
            Some(root) => inner.walk(root, tokens, &mut |_, _| {}),
            None => 0, // a namespace never written holds nothing
        }
    }

    /// Cache `tokens` -> `slots` (a tail shorter than a page is ignored).
    ///
    /// `inserted_len` (at most `tokens.len()`) is how much of `tokens` this caller inserted
    /// before (SGLang's `InsertParams.inserted_len`): nodes up to there count no new LFU hit.
    /// Refused, changing nothing: a slot given twice, and with `strict_slots` a slot the tree
    /// holds for another token.
    pub fn insert(
        &self,
        tokens: &[u32],
        slots: &[i64],
        namespace: Option<&str>,
        inserted_len: usize,
    ) -> Result<InsertOutput> {
        validate_insert(&self.shared.config, tokens, slots, inserted_len)?;
        let mut inner = self.shared.lock();
        if inner.held.is_some() {
            // An unknown namespace holds nothing yet; look before `root` creates it.
            if let Some(root) = inner.existing_root(namespace) {
                validate_held(&inner, root, tokens, slots)?;
            } else {
                validate_held(&inner, inner.roots[&None], &[], slots)?;
            }
        }
        let end = tokens.len() / inner.page() * inner.page();
        let root = inner.root(namespace);
        let (mut node, prefix_len) =
            inner.descend(root, &tokens[..end], Some(inserted_len), &mut |_, _| {});
        if prefix_len < end {
            node = inner.add_node(
                node,
                tokens[prefix_len..end].to_vec(),
                slots[prefix_len..end].to_vec(),
                false,
            );
            if end > inserted_len {
                inner.hit(node);
            }
        }
        Ok(InsertOutput {
            prefix_len,
            node: self.shared.handle(&inner, node),
        })
    }

    /// Protect `node` and its ancestors (SGLang `inc_lock_ref`); returns tokens newly protected.
    pub fn lock(&self, node: &NodeHandle) -> Result<usize> {
        let mut inner = self.shared.lock();
        self.shared.check_handle(&inner, node)?;
        let before = inner.sizes.protected;
        inner.pin(node.id)?;
        Ok(inner.sizes.protected - before)
    }

    /// Undo one `lock`; returns tokens that became evictable.
    pub fn unlock(&self, node: &NodeHandle) -> Result<usize> {
        let mut inner = self.shared.lock();
        self.shared.check_handle(&inner, node)?;
        let before = inner.sizes.protected;
        inner.unpin(node.id)?;
        Ok(before - inner.sizes.protected)
    }

    /// Lock-free pin: one atomic operation on the node, no tree lock.
    pub fn pin(&self, node: &NodeHandle) -> Result<()> {
        self.shared.check_foreign(node)?;
        let crossing = node.cell.pin()?;
        self.shared.note_crossing(node.id, crossing);
        Ok(())
    }

    /// Lock-free unpin.
    pub fn unpin(&self, node: &NodeHandle) -> Result<()> {
        self.shared.check_foreign(node)?;
        let crossing = node.cell.unpin()?;
        self.shared.note_crossing(node.id, crossing);
        Ok(())
    }

    /// Free at least `num_tokens` (when possible) by removing whole unlocked leaves in policy
    /// order; returns the freed slots for the caller's allocator.
    pub fn evict(&self, num_tokens: usize) -> Vec<i64> {
        let mut inner = self.shared.lock();
        let mut freed = Vec::new();
        while freed.len() < num_tokens {
            let Some(&(_, _, id)) = inner.leaves.first() else {
                break;
            };
            let cell = inner.arena[id].cell.clone();
            if !cell.try_kill(0) {
                // Pinned since the lock was taken: apply that pin and look again.
                self.shared.drain_dirty(&mut inner);
                continue;
            }
            freed.extend(inner.remove_leaf(id));
        }
        freed
    }

    pub fn sizes(&self) -> Sizes {
        self.shared.lock().sizes
    }

    /// Heap bytes the tree holds (nodes, token and slot arrays, child maps, the leaf set):
    /// an accounting of capacities, not an allocator measurement.
    pub fn memory_bytes(&self) -> usize {
        use std::mem::size_of;
        let inner = self.shared.lock();
        let mut bytes = inner.arena.capacity() * inner.arena.entry_size();
        for (_, n) in inner.arena.iter() {
            bytes += n.tokens.capacity() * size_of::<u32>()
                + n.slots.capacity() * size_of::<i64>()
                + n.page_hashes.capacity() * size_of::<Digest>()
                + n.children.capacity() * (size_of::<PageKey>() + size_of::<NodeId>() + 1)
                + size_of::<NodeCell>()
                + 2 * size_of::<usize>();
        }
        let held = inner
            .held
            .as_ref()
            .map_or(0, |h| h.capacity() * (size_of::<i64>() + 1));
        bytes + held + inner.leaves.len() * (size_of::<LeafKey>() + size_of::<usize>())
    }

    pub fn node_count(&self) -> usize {
        let inner = self.shared.lock();
        inner.arena.len() - inner.roots.len()
    }

    /// Drop everything; returns every slot the tree held. Handles and cursors go stale.
    pub fn reset(&self) -> Vec<i64> {
        let mut inner = self.shared.lock();
        let mut slots = Vec::with_capacity(inner.sizes.total);
        // A fresh `Inner` below starts a fresh `strict_slots` set.
        for node in inner.arena.clear() {
            node.cell.kill();
            slots.extend(node.slots);
        }
        let config = inner.config;
        #[cfg(feature = "fault-injection")]
        let fault = inner.fault;
        let seeds: Vec<(Option<String>, Digest)> = inner
            .event_seeds
            .iter()
            .map(|(&ns, &d)| (inner.namespaces[ns as usize].clone(), d))
            .collect();
        let had_events = !inner.events.is_empty() || config.enable_events;
        let events = std::mem::take(&mut inner.events);
        *inner = Inner::new(config);
        #[cfg(feature = "fault-injection")]
        {
            inner.fault = fault;
        }
        for (ns, d) in seeds {
            let root = inner.root(ns.as_deref());
            let idx = inner.arena[root].namespace;
            inner.event_seeds.insert(idx, d);
        }
        if had_events && config.enable_events {
            inner.events = events;
            inner.events.push(KvEvent {
                kind: KvEventKind::Cleared,
                page_digests: Vec::new(),
                parent_digest: None,
                token_ids: Vec::new(),
                namespace: None,
            });
        }
        slots
    }

    pub fn all_slots(&self) -> Vec<i64> {
        let inner = self.shared.lock();
        let mut out = Vec::with_capacity(inner.sizes.total);
        for (_, n) in inner.arena.iter() {
            out.extend_from_slice(&n.slots);
        }
        out
    }

    pub fn path_slots(&self, node: &NodeHandle) -> Result<Vec<i64>> {
        let inner = self.shared.lock();
        self.shared.check_handle(&inner, node)?;
        Ok(inner.path_slots(node.id))
    }

    pub fn path_length(&self, node: &NodeHandle) -> Result<usize> {
        let inner = self.shared.lock();
        self.shared.check_handle(&inner, node)?;
        Ok(inner.path_length(node.id))
    }

    /// The tokens on the edge into `node`, SGLang's `TreeNode.key`: empty for a namespace root.
    /// A later split shortens the edge into the deeper node, so this is the key as it is now.
    pub fn node_key(&self, node: &NodeHandle) -> Result<Vec<u32>> {
        let inner = self.shared.lock();
        self.shared.check_handle(&inner, node)?;
        Ok(inner.arena[node.id].tokens.clone())
    }

    pub fn take_events(&self) -> Vec<KvEvent> {
        std::mem::take(&mut self.shared.lock().events)
    }

    pub fn pretty_print(&self) -> String {
        crate::print::pretty_print(&self.shared.lock())
    }

    /// SGLang's `dfs-weight` schedule order for requests whose last nodes are `nodes`: a node's
    /// weight is the number of requests in its subtree; walk depth-first from the root (all
    /// namespaces share it, as in SGLang), heavier children first (ties in insertion order),
    /// listing each node's requests after its subtree. Only the paths above `nodes` are walked.
    /// Requests on nodes that no longer exist (SGLang would drop them) come last.
    pub fn dfs_weight_order(&self, nodes: &[NodeHandle]) -> Result<Vec<usize>> {
        crate::schedule::dfs_weight_order(&self.shared, &self.shared.lock(), nodes)
    }

    /// Chain `namespace`'s KV event digests from `seed` (None: from nothing). Pages already
    /// stored keep their digests, so set it before the namespace is used.
    pub fn set_event_seed(&self, namespace: Option<&str>, seed: Option<Digest>) {
        let mut inner = self.shared.lock();
        let root = inner.root(namespace);
        let ns = inner.arena[root].namespace;
        match seed {
            Some(d) => inner.event_seeds.insert(ns, d),
            None => inner.event_seeds.remove(&ns),
        };
    }

    /// Plant a deliberate bug (the model test's self-test).
    #[cfg(feature = "fault-injection")]
    pub fn plant_fault(&self, fault: Fault) {
        self.shared.lock().fault = Some(fault);
    }

    /// Raise on the first broken invariant.
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        crate::invariants::check(&self.shared.lock())
    }
}
