//! What the tree hands out: generational node handles and the results that carry them.

use std::sync::Arc;

use crate::cell::NodeCell;
use crate::node::NodeId;

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
