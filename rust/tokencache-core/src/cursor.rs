//! Resumable request cursors: a request keeps its place in the tree between steps, so resuming
//! costs nothing and appending costs O(new tokens), whatever the context length or tree depth.
//!
//! A cursor pins the node where its cached pages end (which protects the whole path, see
//! `cell.rs`) and owns the slots of its uncached tail (less than a page). Moving the pin down as
//! the request grows touches only the new nodes.

use std::borrow::Cow;
use std::sync::Arc;

use crate::cell::{NodeCell, CHILD_UNIT};
use crate::error::{Error, Result};
use crate::handle::NodeHandle;
use crate::inner::Inner;
use crate::node::NodeId;
use crate::shared::Shared;
use crate::tree::RadixTree;
use crate::validate::{first_duplicate, validate_held, validate_pages, validate_shape};

/// Slots a cursor did not keep because the tree already held those tokens. The caller frees
/// `freed[i]` and uses `slots[i]` for position `positions[i]` of request `request[i]`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Dedup {
    pub request: Vec<i64>,
    pub positions: Vec<i64>,
    pub freed: Vec<i64>,
    pub slots: Vec<i64>,
}

impl Dedup {
    pub fn len(&self) -> usize {
        self.freed.len()
    }
    pub fn is_empty(&self) -> bool {
        self.freed.is_empty()
    }
}

pub struct Cursor {
    shared: Arc<Shared>,
    node: NodeId,
    cell: Arc<NodeCell>,
    namespace: Option<String>,
    cached_len: usize,
    pending_tokens: Vec<u32>,
    pending_slots: Vec<i64>,
    released: bool,
}

impl RadixTree {
    /// An empty cursor at the namespace root.
    pub fn cursor(&self, namespace: Option<&str>) -> Cursor {
        let mut inner = self.shared.lock();
        let root = inner.root(namespace);
        inner.pin(root).expect("a live root accepts pins");
        let cell = inner.arena[root].cell.clone();
        Cursor::new(&self.shared, root, cell, namespace.map(str::to_owned), 0)
    }

    /// A cursor at the end of `node`'s path (admission after a match); pins it. O(depth).
    pub fn cursor_at(&self, node: &NodeHandle) -> Result<Cursor> {
        let mut inner = self.shared.lock();
        self.shared.check_handle(&inner, node)?;
        inner.pin(node.id)?;
        let len = inner.path_length(node.id);
        let ns = inner.namespace_of(node.id).map(str::to_owned);
        Ok(Cursor::new(
            &self.shared,
            node.id,
            node.cell.clone(),
            ns,
            len,
        ))
    }

    /// Extend `cursors[i]` with `tokens[offsets[i]..offsets[i + 1]]` under one lock.
    ///
    /// Every check runs before any cursor moves, so a refused batch changes nothing: shapes,
    /// a slot given twice anywhere in the batch (the cursors' uncached tails included), and
    /// per cursor `strict_pages` and `strict_slots`.
    pub fn extend_many(
        &self,
        cursors: &mut [&mut Cursor],
        offsets: &[usize],
        tokens: &[u32],
        slots: &[i64],
    ) -> Result<Dedup> {
        validate_shape(tokens, slots)?;
        if offsets.len() != cursors.len() + 1
            || offsets.first() != Some(&0)
            || offsets.last() != Some(&tokens.len())
            || offsets.windows(2).any(|w| w[0] > w[1])
        {
            return Err(Error::Shape(format!(
                "offsets must be non-decreasing, start at 0, end at {} and have {} entries",
                tokens.len(),
                cursors.len() + 1
            )));
        }
        let mut inner = self.shared.lock();
        for c in cursors.iter() {
            if !Arc::ptr_eq(&c.shared, &self.shared) {
                return Err(Error::ForeignHandle(
                    "cursor belongs to another tree".into(),
                ));
            }
            c.check(&inner)?;
        }
        validate_batch(&inner, cursors, offsets, tokens, slots)?;
        let mut dedup = Dedup::default();
        for (i, c) in cursors.iter_mut().enumerate() {
            let (a, b) = (offsets[i], offsets[i + 1]);
            c.extend_locked(
                &mut inner,
                &tokens[a..b],
                &slots[a..b],
                i as i64,
                &mut dedup,
            )?;
        }
        Ok(dedup)
    }
}

/// The checks of `extend_many`, all read-only.
fn validate_batch(
    inner: &Inner,
    cursors: &[&mut Cursor],
    offsets: &[usize],
    tokens: &[u32],
    slots: &[i64],
) -> Result<()> {
    let dup = if cursors.iter().all(|c| c.pending_slots.is_empty()) {
        first_duplicate(slots)
    } else {
        let tails = cursors.iter().flat_map(|c| c.pending_slots.iter());
        first_duplicate(&tails.chain(slots).copied().collect::<Vec<_>>())
    };
    if let Some(s) = dup {
        return Err(duplicate_in_batch(s, cursors, offsets, slots));
    }
    if !inner.config.strict_pages && inner.held.is_none() {
        return Ok(());
    }
    let page = inner.page();
    for (i, c) in cursors.iter().enumerate() {
        let (a, b) = (offsets[i], offsets[i + 1]);
        let (all_tokens, all_slots) = c.with_tail(&tokens[a..b], &slots[a..b]);
        validate_pages(&inner.config, &all_slots[..all_slots.len() / page * page])?;
        validate_held(inner, c.node, &all_tokens, &all_slots)?;
    }
    Ok(())
}

/// Where slot `s` occurs in a batch (the error path only: it scans again).
fn duplicate_in_batch(s: i64, cursors: &[&mut Cursor], offsets: &[usize], slots: &[i64]) -> Error {
    let mut places = Vec::new();
    for (i, c) in cursors.iter().enumerate() {
        if c.pending_slots.contains(&s) {
            places.push(format!("request {i}'s uncached tail"));
        }
        let at: Vec<usize> = (offsets[i]..offsets[i + 1])
            .filter(|&j| slots[j] == s)
            .map(|j| j - offsets[i])
            .collect();
        if !at.is_empty() {
            places.push(format!("request {i} at {at:?}"));
        }
    }
    Error::DuplicateSlot(format!(
        "slot {s} is given more than once in one call ({})",
        places.join(", ")
    ))
}

impl Cursor {
    fn new(
        shared: &Arc<Shared>,
        node: NodeId,
        cell: Arc<NodeCell>,
        namespace: Option<String>,
        cached_len: usize,
    ) -> Self {
        Self {
            shared: shared.clone(),
            node,
            cell,
            namespace,
            cached_len,
            pending_tokens: Vec::new(),
            pending_slots: Vec::new(),
            released: false,
        }
    }

    pub fn length(&self) -> usize {
        self.cached_len + self.pending_tokens.len()
    }

    pub fn cached_length(&self) -> usize {
        self.cached_len
    }

    pub fn namespace(&self) -> Option<&str> {
        self.namespace.as_deref()
    }

    pub fn is_released(&self) -> bool {
        self.released
    }

    pub fn node(&self) -> NodeHandle {
        NodeHandle {
            tree: self.shared.id,
            id: self.node,
            cell: self.cell.clone(),
            is_root: self.cached_len == 0,
        }
    }

    pub fn tree(&self) -> RadixTree {
        RadixTree {
            shared: self.shared.clone(),
        }
    }

    fn check(&self, inner: &Inner) -> Result<()> {
        if self.released {
            return Err(Error::LockState("cursor was released".into()));
        }
        match inner.arena.get(self.node) {
            Some(n) if Arc::ptr_eq(&n.cell, &self.cell) && !self.cell.is_dead() => Ok(()),
            _ => Err(Error::StaleHandle(
                "cursor's node is gone (tree was reset)".into(),
            )),
        }
    }

    /// Append tokens with their slots. Where the tree already holds them (another request
    /// cached the same continuation), the cursor follows the shared path and reports the
    /// caller's slots that became duplicates. A batch of one: refused exactly as
    /// `RadixTree::extend_many` refuses, changing nothing.
    pub fn extend(&mut self, tokens: &[u32], slots: &[i64]) -> Result<Dedup> {
        let tree = self.tree();
        tree.extend_many(&mut [self], &[0, tokens.len()], tokens, slots)
    }

    /// The uncached tail followed by `tokens` and `slots`, copied only when there is a tail.
    fn with_tail<'a>(
        &self,
        tokens: &'a [u32],
        slots: &'a [i64],
    ) -> (Cow<'a, [u32]>, Cow<'a, [i64]>) {
        if self.pending_tokens.is_empty() {
            (Cow::Borrowed(tokens), Cow::Borrowed(slots))
        } else {
            (
                Cow::Owned([&self.pending_tokens[..], tokens].concat()),
                Cow::Owned([&self.pending_slots[..], slots].concat()),
            )
        }
    }

    fn extend_locked(
        &mut self,
        inner: &mut Inner,
        tokens: &[u32],
        slots: &[i64],
        request: i64,
        dedup: &mut Dedup,
    ) -> Result<()> {
        let page = inner.page();
        // Whole pages go into the tree; a partial tail stays with the cursor until it fills.
        let (all_tokens, all_slots) = self.with_tail(tokens, slots);
        let end = all_tokens.len() / page * page;
        let base = self.cached_len as i64;
        let hits = Some(0); // everything past the cursor is newly inserted by this request
        let (mut node, pos) = inner.descend(self.node, &all_tokens[..end], hits, &mut |run, at| {
            for (i, (&tree_slot, &ours)) in run.iter().zip(&all_slots[at..]).enumerate() {
                if tree_slot != ours {
                    dedup.request.push(request);
                    dedup.positions.push(base + (at + i) as i64);
                    dedup.freed.push(ours);
                    dedup.slots.push(tree_slot);
                }
            }
        });
        let created = pos < end;
        if created {
            // Born pinned by this cursor: no trip through the evictable-leaf set.
            let (t, s) = (all_tokens[pos..end].to_vec(), all_slots[pos..end].to_vec());
            node = inner.add_node(node, t, s, true);
            inner.hit(node);
        }
        if node != self.node {
            // Pin the new end before letting go of the old one: ancestors stay protected
            // throughout and only the nodes just passed change state.
            if !created {
                inner.pin(node)?;
            }
            inner.unpin(self.node)?;
            self.cell = inner.arena[node].cell.clone();
            self.node = node;
        }
        self.cached_len += end;
        self.pending_tokens = all_tokens[end..].to_vec();
        self.pending_slots = all_slots[end..].to_vec();
        Ok(())
    }

    /// Mark the whole sequence used now, in O(1): only the cursor's node is stamped; ancestors
    /// inherit the stamp when their children leave (see `Inner::adopt_stamp`). This is what an
    /// SGLang re-insert from the root does to LRU order, without the walk.
    pub fn touch(&self) -> Result<()> {
        let mut inner = self.shared.lock();
        self.check(&inner)?;
        if !inner.arena[self.node].is_root {
            inner.touch(self.node);
        }
        Ok(())
    }

    /// Count one LFU hit on every node of the cursor's path that ends past `since`: what
    /// SGLang's insert of the whole sequence with `inserted_len = since` counts. O(nodes past
    /// `since`).
    pub fn record_hits(&self, since: usize) -> Result<()> {
        let mut inner = self.shared.lock();
        self.check(&inner)?;
        let (mut id, mut end) = (self.node, self.cached_len);
        while end > since && !inner.arena[id].is_root {
            inner.hit(id);
            let n = &inner.arena[id];
            end -= n.len();
            id = n.parent.expect("non-root node has a parent");
        }
        Ok(())
    }

    /// Drop the last `num_tokens` tokens. Nodes only this cursor holds leave the tree and their
    /// slots are returned for the caller to free; shared nodes stay cached.
    pub fn truncate(&mut self, num_tokens: usize) -> Result<Vec<i64>> {
        let shared = self.shared.clone();
        let mut inner = shared.lock();
        self.check(&inner)?;
        if num_tokens > self.length() {
            return Err(Error::InvalidArgument(format!(
                "cannot truncate {num_tokens} tokens from a sequence of {}",
                self.length()
            )));
        }
        if num_tokens <= self.pending_tokens.len() {
            let keep = self.pending_tokens.len() - num_tokens;
            self.pending_tokens.truncate(keep);
            return Ok(self.pending_slots.split_off(keep));
        }
        let target = self.length() - num_tokens;
        let aligned = target / inner.page() * inner.page();
        loop {
            let chain = self.chain_above(&inner, aligned);
            let exclusive = exclusive_prefix(&inner, &chain);
            if target > aligned && exclusive < chain.len() {
                return Err(Error::PageAlignment(format!(
                    "truncating to {target} would cut the shared page at {aligned}"
                )));
            }
            // Make a node boundary at `aligned`; a split never changes what is cached.
            let top = *chain.last().expect("target is inside the cached part");
            let top_start =
                self.cached_len - chain.iter().map(|&n| inner.arena[n].len()).sum::<usize>();
            let anchor = if top_start < aligned {
                inner.split(top, aligned - top_start)
            } else {
                inner.arena[top].parent.expect("non-root")
            };
            // Claim the exclusive nodes bottom-up; a concurrent pin makes us re-plan.
            let mut killed = Vec::new();
            for (i, &id) in chain[..exclusive].iter().enumerate() {
                let expected = if i == 0 { 1 } else { CHILD_UNIT };
                if inner.arena[id].cell.try_kill(expected) {
                    killed.push((id, expected));
                } else {
                    break;
                }
            }
            if killed.len() < exclusive {
                for (id, state) in killed {
                    inner.arena[id].cell.revive(state);
                }
                shared.drain_dirty(&mut inner);
                continue;
            }
            inner.pin(anchor)?;
            if exclusive == 0 {
                inner.unpin(self.node)?;
            }
            let mut freed = Vec::new();
            let mut owned_tail = (Vec::new(), Vec::new());
            for (i, &(id, _)) in killed.iter().enumerate() {
                let (tokens, slots) = remove_claimed(&mut inner, id);
                let is_top = i + 1 == killed.len() && exclusive == chain.len();
                let keep = if is_top { target - aligned } else { 0 };
                owned_tail = (tokens[..keep].to_vec(), slots[..keep].to_vec());
                freed.splice(0..0, slots[keep..].iter().copied());
            }
            self.cell = inner.arena[anchor].cell.clone();
            self.node = anchor;
            self.cached_len = aligned;
            freed.extend(std::mem::take(&mut self.pending_slots));
            (self.pending_tokens, self.pending_slots) = owned_tail;
            return Ok(freed);
        }
    }

    /// Nodes on the cursor's path that end after `position`, bottom-up.
    fn chain_above(&self, inner: &Inner, position: usize) -> Vec<NodeId> {
        let mut chain = Vec::new();
        let (mut id, mut end) = (self.node, self.cached_len);
        while end > position {
            chain.push(id);
            let n = &inner.arena[id];
            end -= n.len();
            id = n.parent.expect("cached part ends at a non-root node");
        }
        chain
    }

    /// Unpin and give back the uncached tail's slots (the caller frees them). Lock-free.
    pub fn release(&mut self) -> Result<Vec<i64>> {
        if self.released {
            return Err(Error::LockState("cursor was already released".into()));
        }
        self.released = true;
        self.pending_tokens.clear();
        if !self.cell.is_dead() {
            if let Ok(crossing) = self.cell.unpin() {
                self.shared.note_crossing(self.node, crossing);
            }
        }
        Ok(std::mem::take(&mut self.pending_slots))
    }

    /// Slots of the whole sequence, root to tail. O(length).
    pub fn slots(&self) -> Result<Vec<i64>> {
        let inner = self.shared.lock();
        self.check(&inner)?;
        let mut out = inner.path_slots(self.node);
        out.extend_from_slice(&self.pending_slots);
        Ok(out)
    }

    pub fn tokens(&self) -> Result<Vec<u32>> {
        let inner = self.shared.lock();
        self.check(&inner)?;
        let mut out = inner.path_tokens(self.node);
        out.extend_from_slice(&self.pending_tokens);
        Ok(out)
    }
}

impl Drop for Cursor {
    /// A dropped cursor lets go of its pin; its tail slots stay the caller's to free.
    fn drop(&mut self) {
        if !self.released {
            let _ = self.release();
        }
    }
}

/// How many nodes from the bottom of `chain` only this cursor holds: the bottom one carries
/// just our pin and no children; each one above has only that chain below it and no pins.
fn exclusive_prefix(inner: &Inner, chain: &[NodeId]) -> usize {
    let mut count = 0;
    for (i, &id) in chain.iter().enumerate() {
        let n = &inner.arena[id];
        let ok = if i == 0 {
            n.children.is_empty() && n.cell.load() == 1
        } else {
            n.children.len() == 1 && n.cell.load() == CHILD_UNIT
        };
        if !ok || n.is_root {
            break;
        }
        count += 1;
    }
    count
}

/// Remove a node this cursor claimed (marked dead); returns its tokens and slots.
fn remove_claimed(inner: &mut Inner, id: NodeId) -> (Vec<u32>, Vec<i64>) {
    let page = inner.page();
    let node = inner.arena.remove(id).expect("claimed node is live");
    let parent = node.parent.expect("claimed node has a parent");
    inner.adopt_stamp(parent, &node);
    inner.arena[parent].children.remove(&node.tokens[..page]);
    inner.sizes.protected -= node.len();
    inner.sizes.total -= node.len();
    inner.record_removed(parent, &node);
    inner.arena[parent].cell.add_protected_child(false);
    inner.reconcile(parent);
    inner.sync_leaf(parent);
    inner.release_held(&node.slots);
    (node.tokens, node.slots)
}
