//! The tree's state behind its lock: the node arena, namespace roots, the evictable-leaf set,
//! size counters and queued KV events, with every structural operation on them (split, descend,
//! add, remove, protection reconciliation). Callers hold `Shared::lock`.

use std::collections::BTreeSet;
use std::sync::Arc;

use rustc_hash::{FxHashMap, FxHashSet};

use crate::cell::{Crossing, NodeCell};
use crate::config::{Sizes, TreeConfig};
use crate::error::Result;
use crate::events::{chain_digests, Digest, KvEvent, KvEventKind};
#[cfg(feature = "fault-injection")]
use crate::fault::Fault;
use crate::node::{Arena, LeafKey, Node, NodeId, PageKey};
use crate::policy::EvictionPolicy;

pub(crate) struct Inner {
    pub arena: Arena,
    pub roots: FxHashMap<Option<String>, NodeId>,
    pub namespaces: Vec<Option<String>>,
    pub leaves: BTreeSet<LeafKey>,
    pub sizes: Sizes,
    pub tick: u64,
    pub events: Vec<KvEvent>,
    pub config: TreeConfig,
    #[cfg(feature = "fault-injection")]
    pub fault: Option<Fault>,
    /// Per namespace: the digest a namespace's first page chains from (SGLang seeds salted
    /// namespaces so their events differ).
    pub event_seeds: FxHashMap<u32, Digest>,
    /// Every slot in the tree, kept only with `strict_slots`.
    pub held: Option<FxHashSet<i64>>,
}

impl Inner {
    pub fn new(config: TreeConfig) -> Self {
        let mut inner = Self {
            arena: Arena::default(),
            roots: FxHashMap::default(),
            namespaces: Vec::new(),
            leaves: BTreeSet::new(),
            sizes: Sizes::default(),
            tick: 0,
            events: Vec::new(),
            config,
            #[cfg(feature = "fault-injection")]
            fault: None,
            event_seeds: FxHashMap::default(),
            held: config.strict_slots.then(FxHashSet::default),
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

    /// The root of a namespace written before (None: one never written holds nothing).
    pub fn existing_root(&self, namespace: Option<&str>) -> Option<NodeId> {
        self.roots.get(&namespace.map(str::to_owned)).copied()
    }

    /// The root of a namespace, created on first use.
    pub fn root(&mut self, namespace: Option<&str>) -> NodeId {
        if let Some(id) = self.existing_root(namespace) {
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
            #[cfg(feature = "fault-injection")]
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
        if let Some(held) = &mut self.held {
            held.extend(&slots);
        }
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

    /// Read-only twin of `descend`: follow whole pages of `tokens` from `start` without
    /// splitting or touching, passing each matched run of tree slots to `seen(run, pos)`;
    /// returns the matched length.
    pub fn walk(
        &self,
        start: NodeId,
        tokens: &[u32],
        seen: &mut dyn FnMut(&[i64], usize),
    ) -> usize {
        let page = self.page();
        let end = tokens.len() / page * page;
        let (mut node, mut pos) = (start, 0);
        while pos < end {
            let Some(&child) = self.arena[node].children.get(&tokens[pos..pos + page]) else {
                break;
            };
            let c = &self.arena[child];
            let matched = common_prefix(&c.tokens, &tokens[pos..end]) / page * page;
            seen(&c.slots[..matched], pos);
            pos += matched;
            if matched < c.len() {
                break;
            }
            node = child;
        }
        pos
    }

    /// Forget slots that just left the tree (`strict_slots` bookkeeping).
    pub fn release_held(&mut self, slots: &[i64]) {
        if let Some(held) = &mut self.held {
            for s in slots {
                held.remove(s);
            }
        }
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
        self.release_held(&node.slots);
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
