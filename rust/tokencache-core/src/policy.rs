//! Eviction order. The tree keeps exactly the evictable leaves in an ordered set keyed by the
//! policy, so eviction pops from the front and never scans the tree.

use std::str::FromStr;

use crate::error::Error;
use crate::node::{LeafKey, Node, NodeId};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EvictionPolicy {
    /// Least recently used first.
    #[default]
    Lru,
    /// Least frequently used first, then least recently used.
    Lfu,
    /// Oldest inserted first.
    Fifo,
}

impl EvictionPolicy {
    pub fn name(self) -> &'static str {
        match self {
            Self::Lru => "lru",
            Self::Lfu => "lfu",
            Self::Fifo => "fifo",
        }
    }

    pub(crate) fn key(self, id: NodeId, node: &Node) -> LeafKey {
        let (a, b) = match self {
            Self::Lru => (node.last_access, 0),
            Self::Lfu => (node.hits, node.last_access),
            Self::Fifo => (node.created, 0),
        };
        (a, b, id)
    }
}

impl FromStr for EvictionPolicy {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Error> {
        match s.to_ascii_lowercase().as_str() {
            "lru" => Ok(Self::Lru),
            "lfu" => Ok(Self::Lfu),
            "fifo" => Ok(Self::Fifo),
            other => Err(Error::InvalidArgument(format!(
                "unknown eviction policy {other:?} (expected lru, lfu or fifo)"
            ))),
        }
    }
}
