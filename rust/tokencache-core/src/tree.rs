//! The radix tree: token-id prefixes mapped to KV slot indices, with SGLang `RadixCache`
//! semantics (page-granular matching, split on match, namespaces, eviction of unlocked leaves,
//! exact evictable / protected sizes).
//!
//! Structure lives behind one mutex; pins live in per-node atomics (see `cell.rs`), so pinning
//! and unpinning never take the tree lock. Their rare protection changes are queued and
//! reconciled by the next operation that holds the lock, before it reads or changes anything.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crossbeam_queue::SegQueue;
use parking_lot::{Mutex, MutexGuard};
use rustc_hash::FxHashMap;

use crate::cell::{Crossing, NodeCell};
use crate::error::{Error, Result};
use crate::events::{chain_digests, Digest, KvEvent, KvEventKind};
use crate::node::{Arena, Node, NodeId, PageKey};
use crate::policy::{EvictionPolicy, LeafKey};

static NEXT_TREE_ID: AtomicU64 = AtomicU64::new(1);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TreeConfig {
    pub page_size: usize,
    pub policy: EvictionPolicy,
    pub enable_events: bool,
    /// Require every page's slots to be one aligned run (`slot % page_size` = offset in page).
    pub strict_pages: bool,
}

impl Default for TreeConfig {
    fn default() -> Self {
        Self {
            page_size: 1,
            policy: EvictionPolicy::Lru,
            enable_events: false,
            strict_pages: false,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Sizes {
    pub evictable: usize,
    pub protected: usize,
    pub total: usize,
}

/// A generational reference to a node. It does not keep the node alive.
#[derive(Debug, Clone)]
pub struct NodeHandle {
    pub(crate) tree: u64,
    pub(crate) id: NodeId,
    pub(crate) cell: Arc<NodeCell>,
    pub(crate) is_root: bool,
}

impl NodeHandle {
    /// Whether this is a namespace root (the empty prefix).
    pub fn is_root(&self) -> bool {
        self.is_root
    }
    pub fn id(&self) -> NodeId {
        self.id
    }
    pub fn is_alive(&self) -> bool {
        !self.cell.is_dead()
    }
    /// Direct pins and locks on this node.
    pub fn lock_ref(&self) -> u32 {
        self.cell.pins()
    }
}

impl PartialEq for NodeHandle {
    fn eq(&self, other: &Self) -> bool {
        self.tree == other.tree && self.id == other.id
    }
}
impl Eq for NodeHandle {}

#[derive(Debug, Clone)]
pub struct MatchOutput {
    pub length: usize,
    pub slots: Vec<i64>,
    pub node: NodeHandle,
}

#[derive(Debug, Clone)]
pub struct InsertOutput {
    /// Tokens that were already cached; the caller frees its own slots for them.
    pub prefix_len: usize,
    pub node: NodeHandle,
}

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
        while let Some(id) = self.dirty.pop() {
            inner.reconcile(id);
        }
        inner
    }

    pub fn handle(&self, inner: &Inner, id: NodeId) -> NodeHandle {
        NodeHandle {
            tree: self.id,
            id,
            cell: inner.arena[id].cell.clone(),
            is_root: inner.arena[id].is_root,
        }
    }

    pub fn check_handle(&self, inner: &Inner, h: &NodeHandle) -> Result<()> {
        if h.tree != self.id {
            return Err(Error::ForeignHandle(
                "node handle belongs to another tree".into(),
            ));
        }
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

pub(crate) struct Inner {
    pub arena: Arena,
    pub roots: FxHashMap<Option<String>, NodeId>,
    pub namespaces: Vec<Option<String>>,
    pub leaves: BTreeSet<LeafKey>,
    pub sizes: Sizes,
    pub tick: u64,
    pub events: Vec<KvEvent>,
    pub config: TreeConfig,
    pub fault: Option<Fault>,
    /// Per namespace: the digest a namespace's first page chains from (SGLang seeds salted
    /// namespaces so their events differ).
    pub event_seeds: FxHashMap<u32, Digest>,
}

/// Deliberate bugs, planted only by the test harness's self-test to prove it catches them.
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Forget to tell the parent when a node stops being protected.
    SkipParentOnUnprotect,
    /// Report one token too few from every match.
    ShortMatch,
}

impl Inner {
    fn new(config: TreeConfig) -> Self {
        let mut inner = Self {
            arena: Arena::default(),
            roots: FxHashMap::default(),
            namespaces: Vec::new(),
            leaves: BTreeSet::new(),
            sizes: Sizes::default(),
            tick: 0,
            events: Vec::new(),
            config,
            fault: None,
            event_seeds: FxHashMap::default(),
        };
        inner.root(None);
        inner
    }

    pub fn page(&self) -> usize {
        self.config.page_size
    }

    fn next_tick(&mut self) -> u64 {
        self.tick += 1;
        self.tick
    }

    /// The root of a namespace, created on first use.
    pub fn root(&mut self, namespace: Option<&str>) -> NodeId {
        if let Some(&id) = self.roots.get(&namespace.map(str::to_owned)) {
            return id;
        }
        let ns_index = self.namespaces.len() as u32;
        self.namespaces.push(namespace.map(str::to_owned));
        let created = self.next_tick();
        let id = self.arena.insert(Node {
            parent: None,
            children: FxHashMap::default(),
            tokens: Vec::new(),
            slots: Vec::new(),
            cell: Arc::new(NodeCell::default()),
            counted: false,
            is_root: true,
            namespace: ns_index,
            last_access: created,
            hits: 0,
            created,
            sibling_order: 0,
            page_hashes: Vec::new(),
            leaf_key: None,
        });
        self.roots.insert(namespace.map(str::to_owned), id);
        id
    }

    pub fn namespace_of(&self, id: NodeId) -> Option<&str> {
        self.namespaces[self.arena[id].namespace as usize].as_deref()
    }

    /// Put the node in the evictable-leaf set exactly when it belongs there, under its current key.
    pub fn sync_leaf(&mut self, id: NodeId) {
        let policy = self.config.policy;
        let node = &mut self.arena[id];
        if let Some(key) = node.leaf_key.take() {
            self.leaves.remove(&key);
        }
        if !node.is_root && node.is_leaf() && !node.counted {
            let key = policy.key(id, node);
            node.leaf_key = Some(key);
            self.leaves.insert(key);
        }
    }

    /// Mark used now (LRU). Hits (LFU) are counted separately, by insertions only, as SGLang does.
    pub fn touch(&mut self, id: NodeId) {
        let t = self.next_tick();
        let node = &mut self.arena[id];
        node.last_access = t;
        if node.leaf_key.is_some() {
            self.sync_leaf(id);
        }
    }

    pub fn hit(&mut self, id: NodeId) {
        let node = &mut self.arena[id];
        node.hits += 1;
        if node.leaf_key.is_some() && self.config.policy == EvictionPolicy::Lfu {
            self.sync_leaf(id);
        }
    }

    /// Bring sizes, the leaf set and the parent's cell in line with the node's protection,
    /// walking up only while something changes.
    pub fn reconcile(&mut self, mut id: NodeId) {
        loop {
            let Some(node) = self.arena.get_mut(id) else {
                return;
            };
            if node.is_root || node.cell.is_dead() {
                return;
            }
            let protected = NodeCell::is_protected(node.cell.load());
            if protected == node.counted {
                return;
            }
            node.counted = protected;
            let len = node.len();
            let parent = node.parent.expect("non-root node has a parent");
            if protected {
                self.sizes.protected += len;
                self.sizes.evictable -= len;
            } else {
                self.sizes.protected -= len;
                self.sizes.evictable += len;
            }
            self.sync_leaf(id);
            if !protected && self.fault == Some(Fault::SkipParentOnUnprotect) {
                return;
            }
            self.arena[parent].cell.add_protected_child(protected);
            id = parent;
        }
    }

    /// Pin under the lock, applying any protection change at once.
    pub fn pin(&mut self, id: NodeId) -> Result<()> {
        let cell = self.arena[id].cell.clone();
        if cell.pin()? == Crossing::BecameProtected {
            self.reconcile(id);
        }
        Ok(())
    }

    pub fn unpin(&mut self, id: NodeId) -> Result<()> {
        let cell = self.arena[id].cell.clone();
        if cell.unpin()? == Crossing::BecameUnprotected {
            self.reconcile(id);
        }
        Ok(())
    }

    /// A new node under `parent`, unpinned or with one pin (a cursor's), which skips the
    /// evictable-leaf set entirely.
    pub fn add_node(
        &mut self,
        parent: NodeId,
        tokens: Vec<u32>,
        slots: Vec<i64>,
        pinned: bool,
    ) -> NodeId {
        let created = self.next_tick();
        let ns = self.arena[parent].namespace;
        let page_hashes = if self.config.enable_events {
            let prior = self.chain_prior(parent);
            let hashes = chain_digests(prior, &tokens, self.page());
            self.events.push(KvEvent {
                kind: KvEventKind::Stored,
                page_digests: hashes.clone(),
                parent_digest: self.parent_digest(parent),
                token_ids: tokens.clone(),
                namespace: self.namespaces[ns as usize].clone(),
            });
            hashes
        } else {
            Vec::new()
        };
        let key = PageKey::from_slice(&tokens[..self.page()]);
        let len = tokens.len();
        let id = self.arena.insert(Node {
            parent: Some(parent),
            children: FxHashMap::default(),
            tokens,
            slots,
            cell: Arc::new(NodeCell::with_state(u64::from(pinned))),
            counted: pinned,
            is_root: false,
            namespace: ns,
            last_access: created,
            hits: 0,
            created,
            sibling_order: created,
            page_hashes,
            leaf_key: None,
        });
        self.arena[parent].children.insert(key, id);
        self.sizes.total += len;
        if pinned {
            self.sizes.protected += len;
            self.arena[parent].cell.add_protected_child(true);
            self.reconcile(parent);
        } else {
            self.sizes.evictable += len;
            self.sync_leaf(id);
        }
        if self.arena[parent].leaf_key.is_some() {
            self.sync_leaf(parent);
        }
        id
    }

    /// Split `id` after `at` tokens. The new node takes the prefix and becomes the parent; `id`
    /// keeps the suffix, its identity and its pins, so outstanding handles and cursors survive.
    pub fn split(&mut self, id: NodeId, at: usize) -> NodeId {
        let page = self.page();
        let node = &mut self.arena[id];
        debug_assert!(at > 0 && at < node.len() && at % page == 0);
        let tail_tokens = node.tokens.split_off(at);
        let tail_slots = node.slots.split_off(at);
        let head_tokens = std::mem::replace(&mut node.tokens, tail_tokens);
        let head_slots = std::mem::replace(&mut node.slots, tail_slots);
        let tail_hashes = if node.page_hashes.is_empty() {
            Vec::new()
        } else {
            node.page_hashes.split_off(at / page)
        };
        let head_hashes = std::mem::replace(&mut node.page_hashes, tail_hashes);
        let parent = node.parent.expect("roots are never split");
        let counted = node.counted;
        let (hits, ns, sibling_order) = (node.hits, node.namespace, node.sibling_order);
        let child_key = PageKey::from_slice(&node.tokens[..page]);
        let head_key = PageKey::from_slice(&head_tokens[..page]);
        let state = if counted { crate::cell::CHILD_UNIT } else { 0 };
        let mut children = FxHashMap::default();
        children.insert(child_key, id);
        // Like SGLang, the prefix is a new node: fresh creation and access stamps.
        let now = self.next_tick();
        let head = self.arena.insert(Node {
            parent: Some(parent),
            children,
            tokens: head_tokens,
            slots: head_slots,
            cell: Arc::new(NodeCell::with_state(state)),
            counted,
            is_root: false,
            namespace: ns,
            last_access: now,
            hits,
            created: now,
            sibling_order,
            page_hashes: head_hashes,
            leaf_key: None,
        });
        self.arena[id].parent = Some(head);
        self.arena[parent].children.insert(head_key, head);
        head
    }

    /// Follow `tokens` down from `start` over whole pages, splitting where the match ends inside
    /// a node and touching every node passed. `seen(tree_slots, pos)` gets each matched run.
    /// With `hits_after = Some(n)`, a node reached past position `n` counts a hit (SGLang's
    /// insert with `inserted_len = n`); matches count none.
    pub fn descend(
        &mut self,
        start: NodeId,
        tokens: &[u32],
        hits_after: Option<usize>,
        seen: &mut dyn FnMut(&[i64], usize),
    ) -> (NodeId, usize) {
        let page = self.page();
        let end = tokens.len() / page * page;
        let (mut node, mut pos) = (start, 0);
        while pos < end {
            let key = &tokens[pos..pos + page];
            let Some(&child) = self.arena[node].children.get(key) else {
                break;
            };
            let c = &self.arena[child];
            let matched = common_prefix(&c.tokens, &tokens[pos..end]) / page * page;
            seen(&c.slots[..matched], pos);
            let child_len = c.len();
            self.touch(child);
            pos += matched;
            node = if matched < child_len {
                self.split(child, matched)
            } else {
                child
            };
            if hits_after.is_some_and(|n| pos > n) {
                self.hit(node);
            }
            if matched < child_len {
                break;
            }
        }
        (node, pos)
    }

    /// Remove an unpinned leaf (already marked dead) and return its slots.
    pub fn remove_leaf(&mut self, id: NodeId) -> Vec<i64> {
        let page = self.page();
        let node = self.arena.remove(id).expect("live leaf");
        if let Some(key) = node.leaf_key {
            self.leaves.remove(&key);
        }
        let parent = node.parent.expect("leaf has a parent");
        self.adopt_stamp(parent, &node);
        self.arena[parent].children.remove(&node.tokens[..page]);
        if node.counted {
            self.arena[parent].cell.add_protected_child(false);
            self.sizes.protected -= node.len();
        } else {
            self.sizes.evictable -= node.len();
        }
        self.sizes.total -= node.len();
        self.record_removed(parent, &node);
        self.sync_leaf(parent);
        node.slots
    }

    /// The digest a new child of `parent` chains its first page from.
    fn chain_prior(&self, parent: NodeId) -> Option<Digest> {
        let p = &self.arena[parent];
        if p.is_root {
            self.event_seeds.get(&p.namespace).copied()
        } else {
            p.page_hashes.last().copied()
        }
    }

    /// What a child's event names as its parent: nothing under a namespace root (as SGLang).
    fn parent_digest(&self, parent: NodeId) -> Option<Digest> {
        let p = &self.arena[parent];
        (!p.is_root)
            .then(|| p.page_hashes.last().copied())
            .flatten()
    }

    /// Queue the event for a node that just left the tree.
    pub fn record_removed(&mut self, parent: NodeId, node: &Node) {
        if self.config.enable_events {
            self.events.push(KvEvent {
                kind: KvEventKind::Removed,
                page_digests: node.page_hashes.clone(),
                parent_digest: self.parent_digest(parent),
                token_ids: Vec::new(),
                namespace: self.namespaces[node.namespace as usize].clone(),
            });
        }
    }

    /// A parent outlives its removed child with the child's access stamp if newer: a cursor
    /// touches only its own node (O(1)), while SGLang stamps the whole path; both agree on
    /// every node by the time it becomes a leaf.
    pub fn adopt_stamp(&mut self, parent: NodeId, child: &Node) {
        let p = &mut self.arena[parent];
        if child.last_access > p.last_access {
            p.last_access = child.last_access;
        }
    }

    /// Tokens from the namespace root to the end of `id`.
    pub fn path_length(&self, mut id: NodeId) -> usize {
        let mut len = 0;
        while let Some(parent) = self.arena[id].parent {
            len += self.arena[id].len();
            id = parent;
        }
        len
    }

    pub fn path_nodes(&self, mut id: NodeId) -> Vec<NodeId> {
        let mut path = Vec::new();
        while let Some(parent) = self.arena[id].parent {
            path.push(id);
            id = parent;
        }
        path.reverse();
        path
    }

    pub fn path_slots(&self, id: NodeId) -> Vec<i64> {
        let path = self.path_nodes(id);
        let mut out = Vec::with_capacity(path.iter().map(|&n| self.arena[n].len()).sum());
        for n in path {
            out.extend_from_slice(&self.arena[n].slots);
        }
        out
    }

    pub fn path_tokens(&self, id: NodeId) -> Vec<u32> {
        let mut out = Vec::new();
        for n in self.path_nodes(id) {
            out.extend_from_slice(&self.arena[n].tokens);
        }
        out
    }
}

/// Length of the common prefix, compared a block at a time (the hot loop of a long match).
fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    const BLOCK: usize = 16;
    let n = a.len().min(b.len());
    let mut i = 0;
    while i + BLOCK <= n && a[i..i + BLOCK] == b[i..i + BLOCK] {
        i += BLOCK;
    }
    i + a[i..n]
        .iter()
        .zip(&b[i..n])
        .take_while(|(x, y)| x == y)
        .count()
}

/// Reject inputs that would break the tree; nothing is changed before this passes.
pub(crate) fn validate(config: &TreeConfig, tokens: &[u32], slots: &[i64]) -> Result<()> {
    validate_shape(tokens, slots)?;
    validate_pages(config, slots)
}

pub(crate) fn validate_shape(tokens: &[u32], slots: &[i64]) -> Result<()> {
    if tokens.len() != slots.len() {
        return Err(Error::Shape(format!(
            "tokens and slots differ in length ({} != {})",
            tokens.len(),
            slots.len()
        )));
    }
    if let Some(i) = slots.iter().position(|&s| s < 0) {
        return Err(Error::InvalidArgument(format!(
            "slot {} at index {i} is negative",
            slots[i]
        )));
    }
    Ok(())
}

/// With `strict_pages`, each whole page of `slots` (which must start on a page boundary) is one
/// run starting at a multiple of the page size, as a paged KV allocator hands them out.
pub(crate) fn validate_pages(config: &TreeConfig, slots: &[i64]) -> Result<()> {
    if !config.strict_pages || config.page_size == 1 {
        return Ok(());
    }
    let page = config.page_size as i64;
    for (p, run) in slots.chunks_exact(config.page_size).enumerate() {
        if run[0] % page != 0 || run.windows(2).any(|w| w[1] != w[0] + 1) {
            return Err(Error::PageAlignment(format!(
                "slots of page {p} ({run:?}) are not one run starting at a multiple of {page}"
            )));
        }
    }
    Ok(())
}

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
        let (node, mut length) = inner.descend(root, tokens, None, &mut |run, _| {
            slots.extend_from_slice(run)
        });
        if inner.fault == Some(Fault::ShortMatch) && length > 0 {
            length -= 1;
            slots.pop();
        }
        MatchOutput {
            length,
            slots,
            node: self.shared.handle(&inner, node),
        }
    }

    /// Cache `tokens` -> `slots` (a tail shorter than a page is ignored).
    ///
    /// `inserted_len` is how much of `tokens` this caller inserted before (SGLang's
    /// `InsertParams.inserted_len`): nodes up to there do not count another LFU hit.
    pub fn insert(
        &self,
        tokens: &[u32],
        slots: &[i64],
        namespace: Option<&str>,
        inserted_len: usize,
    ) -> Result<InsertOutput> {
        validate(&self.shared.config, tokens, slots)?;
        let mut inner = self.shared.lock();
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
        if node.tree != self.shared.id {
            return Err(Error::ForeignHandle(
                "node handle belongs to another tree".into(),
            ));
        }
        let crossing = node.cell.pin()?;
        self.shared.note_crossing(node.id, crossing);
        Ok(())
    }

    /// Lock-free unpin.
    pub fn unpin(&self, node: &NodeHandle) -> Result<()> {
        if node.tree != self.shared.id {
            return Err(Error::ForeignHandle(
                "node handle belongs to another tree".into(),
            ));
        }
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
                while let Some(d) = self.shared.dirty.pop() {
                    inner.reconcile(d);
                }
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
                + size_of::<crate::cell::NodeCell>()
                + 2 * size_of::<usize>();
        }
        bytes + inner.leaves.len() * (size_of::<LeafKey>() + size_of::<usize>())
    }

    pub fn node_count(&self) -> usize {
        let inner = self.shared.lock();
        inner.arena.len() - inner.roots.len()
    }

    /// Drop everything; returns every slot the tree held. Handles and cursors go stale.
    pub fn reset(&self) -> Vec<i64> {
        let mut inner = self.shared.lock();
        let mut slots = Vec::with_capacity(inner.sizes.total);
        for node in inner.arena.clear() {
            node.cell.kill();
            slots.extend(node.slots);
        }
        let (config, fault) = (inner.config, inner.fault);
        let seeds: Vec<(Option<String>, Digest)> = inner
            .event_seeds
            .iter()
            .map(|(&ns, &d)| (inner.namespaces[ns as usize].clone(), d))
            .collect();
        let had_events = !inner.events.is_empty() || config.enable_events;
        let events = std::mem::take(&mut inner.events);
        *inner = Inner::new(config);
        inner.fault = fault;
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

    pub fn take_events(&self) -> Vec<KvEvent> {
        std::mem::take(&mut self.shared.lock().events)
    }

    pub fn pretty_print(&self) -> String {
        let inner = self.shared.lock();
        let mut out = String::new();
        let mut roots: Vec<_> = inner.roots.iter().collect();
        roots.sort_by_key(|(_, id)| **id);
        for (ns, &root) in roots {
            out.push_str(&format!("namespace {ns:?}\n"));
            let mut stack = vec![(root, 0usize)];
            while let Some((id, depth)) = stack.pop() {
                let n = &inner.arena[id];
                if !n.is_root {
                    let shown: Vec<_> = n.tokens.iter().take(8).collect();
                    let more = if n.len() > 8 { " ..." } else { "" };
                    out.push_str(&format!(
                        "{:indent$}{shown:?}{more} len={} pins={} protected={}\n",
                        "",
                        n.len(),
                        n.cell.pins(),
                        n.counted,
                        indent = 2 * depth
                    ));
                }
                let mut kids: Vec<_> = n.children.values().copied().collect();
                kids.sort();
                stack.extend(kids.into_iter().rev().map(|c| (c, depth + 1)));
            }
        }
        out.push_str(&format!(
            "total={} evictable={} protected={}\n",
            inner.sizes.total, inner.sizes.evictable, inner.sizes.protected
        ));
        out
    }

    /// SGLang's `dfs-weight` schedule order for requests whose last nodes are `nodes`: a node's
    /// weight is the number of requests in its subtree; walk depth-first from the root (all
    /// namespaces share it, as in SGLang), heavier children first (ties in insertion order),
    /// listing each node's requests after its subtree. Only the paths above `nodes` are walked.
    /// Requests on nodes that no longer exist (SGLang would drop them) come last.
    pub fn dfs_weight_order(&self, nodes: &[NodeHandle]) -> Result<Vec<usize>> {
        use std::collections::HashMap;
        let inner = self.shared.lock();
        // None stands for the shared root.
        let mut requests: HashMap<Option<NodeId>, Vec<usize>> = HashMap::new();
        let mut stale = Vec::new();
        for (i, h) in nodes.iter().enumerate() {
            if h.tree != self.shared.id {
                return Err(Error::ForeignHandle(
                    "node handle belongs to another tree".into(),
                ));
            }
            if self.shared.check_handle(&inner, h).is_err() {
                stale.push(i);
            } else {
                let key = (!inner.arena[h.id].is_root).then_some(h.id);
                requests.entry(key).or_default().push(i);
            }
        }
        let mut weight: HashMap<Option<NodeId>, usize> = HashMap::new();
        let mut children: HashMap<Option<NodeId>, Vec<NodeId>> = HashMap::new();
        for (&node, idx) in &requests {
            let mut cur = node;
            while let Some(id) = cur {
                let w = weight.entry(Some(id)).or_insert(0);
                let first_visit = *w == 0;
                *w += idx.len();
                let parent = inner.arena[id].parent.filter(|&p| !inner.arena[p].is_root);
                if first_visit {
                    children.entry(parent).or_default().push(id);
                }
                cur = parent;
            }
            *weight.entry(None).or_insert(0) += idx.len();
        }
        let mut order = Vec::with_capacity(nodes.len());
        let mut stack: Vec<(Option<NodeId>, bool)> = vec![(None, false)];
        while let Some((node, visited)) = stack.pop() {
            if visited {
                order.extend(requests.get(&node).into_iter().flatten());
                continue;
            }
            stack.push((node, true));
            let mut kids = children.remove(&node).unwrap_or_default();
            kids.sort_by_key(|&c| {
                (
                    std::cmp::Reverse(weight[&Some(c)]),
                    inner.arena[c].sibling_order,
                )
            });
            stack.extend(kids.into_iter().rev().map(|c| (Some(c), false)));
        }
        order.extend(stale);
        Ok(order)
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

    #[doc(hidden)]
    pub fn plant_fault(&self, fault: Fault) {
        self.shared.lock().fault = Some(fault);
    }

    /// Raise on the first broken invariant.
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        crate::invariants::check(&self.shared.lock())
    }
}
