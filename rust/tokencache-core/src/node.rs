//! Tree nodes in a generational arena: a handle to a removed node can always be told apart from
//! the node that later reuses its slot.

use std::sync::Arc;

use rustc_hash::FxHashMap;
use smallvec::SmallVec;

use crate::cell::NodeCell;

/// Children are keyed by their first page of tokens (one token when page_size is 1).
pub(crate) type PageKey = SmallVec<[u32; 4]>;

/// A node's place in the evictable-leaf set: the eviction policy's two sort keys, then the id.
pub(crate) type LeafKey = (u64, u64, NodeId);

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeId {
    pub index: u32,
    pub generation: u32,
}

#[derive(Debug)]
pub(crate) struct Node {
    pub parent: Option<NodeId>,
    pub children: FxHashMap<PageKey, NodeId>,
    pub tokens: Vec<u32>,
    pub slots: Vec<i64>,
    /// Shared with handles and cursors, so pins need no tree lock.
    pub cell: Arc<NodeCell>,
    /// Whether this node's protection is reflected in sizes, the leaf set and its parent's cell.
    pub counted: bool,
    /// Namespace root: never evicted, never counted, length 0.
    pub is_root: bool,
    pub namespace: u32,
    pub last_access: u64,
    pub hits: u64,
    pub created: u64,
    /// Where this node stands among its parent's children, in insertion order; a split's new
    /// prefix node takes its child's place (as in SGLang's children dict).
    pub sibling_order: u64,
    /// Position-aware page digests, kept only when KV events are on.
    pub page_hashes: Vec<crate::events::Digest>,
    /// This node's key in the evictable-leaf set, when it is in it.
    pub leaf_key: Option<LeafKey>,
}

impl Node {
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_leaf(&self) -> bool {
        self.children.is_empty()
    }
}

#[derive(Debug, Default)]
struct Entry {
    generation: u32,
    node: Option<Node>,
}

/// Nodes by index; a freed index gets a new generation before reuse.
#[derive(Debug, Default)]
pub(crate) struct Arena {
    entries: Vec<Entry>,
    free: Vec<u32>,
    live: usize,
}

impl Arena {
    pub fn insert(&mut self, node: Node) -> NodeId {
        self.live += 1;
        if let Some(index) = self.free.pop() {
            let entry = &mut self.entries[index as usize];
            entry.node = Some(node);
            NodeId {
                index,
                generation: entry.generation,
            }
        } else {
            let index = u32::try_from(self.entries.len()).expect("more than 2^32 nodes");
            self.entries.push(Entry {
                generation: 0,
                node: Some(node),
            });
            NodeId {
                index,
                generation: 0,
            }
        }
    }

    pub fn remove(&mut self, id: NodeId) -> Option<Node> {
        let entry = self.entries.get_mut(id.index as usize)?;
        if entry.generation != id.generation || entry.node.is_none() {
            return None;
        }
        entry.generation = entry.generation.wrapping_add(1);
        self.free.push(id.index);
        self.live -= 1;
        entry.node.take()
    }

    pub fn get(&self, id: NodeId) -> Option<&Node> {
        let entry = self.entries.get(id.index as usize)?;
        (entry.generation == id.generation)
            .then_some(entry.node.as_ref())
            .flatten()
    }

    pub fn get_mut(&mut self, id: NodeId) -> Option<&mut Node> {
        let entry = self.entries.get_mut(id.index as usize)?;
        (entry.generation == id.generation)
            .then_some(entry.node.as_mut())
            .flatten()
    }

    pub fn len(&self) -> usize {
        self.live
    }

    pub fn capacity(&self) -> usize {
        self.entries.capacity()
    }

    pub fn entry_size(&self) -> usize {
        std::mem::size_of::<Entry>()
    }

    pub fn iter(&self) -> impl Iterator<Item = (NodeId, &Node)> {
        self.entries.iter().enumerate().filter_map(|(i, e)| {
            e.node.as_ref().map(|n| {
                (
                    NodeId {
                        index: i as u32,
                        generation: e.generation,
                    },
                    n,
                )
            })
        })
    }

    pub fn clear(&mut self) -> Vec<Node> {
        let mut out = Vec::with_capacity(self.live);
        for (index, entry) in self.entries.iter_mut().enumerate() {
            if let Some(node) = entry.node.take() {
                entry.generation = entry.generation.wrapping_add(1);
                self.free.push(index as u32);
                out.push(node);
            }
        }
        self.live = 0;
        out
    }
}

impl std::ops::Index<NodeId> for Arena {
    type Output = Node;
    fn index(&self, id: NodeId) -> &Node {
        self.get(id)
            .expect("internal: stale node id inside the tree")
    }
}

impl std::ops::IndexMut<NodeId> for Arena {
    fn index_mut(&mut self, id: NodeId) -> &mut Node {
        self.get_mut(id)
            .expect("internal: stale node id inside the tree")
    }
}
