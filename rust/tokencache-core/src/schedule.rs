//! SGLang's `dfs-weight` schedule: an order of waiting requests that keeps requests sharing a
//! prefix together, heaviest shared subtrees first.

use std::cmp::Reverse;
use std::collections::HashMap;

use crate::error::Result;
use crate::handle::NodeHandle;
use crate::inner::Inner;
use crate::node::NodeId;
use crate::shared::Shared;

/// The order for requests whose last nodes are `nodes`: a node's weight is the number of
/// requests in its subtree; walk depth-first from the root (all namespaces share it, as in
/// SGLang), heavier children first (ties in insertion order), listing each node's requests after
/// its subtree. Only the paths above `nodes` are walked. Requests on nodes that no longer exist
/// (SGLang would drop them) come last.
pub(crate) fn dfs_weight_order(
    shared: &Shared,
    inner: &Inner,
    nodes: &[NodeHandle],
) -> Result<Vec<usize>> {
    // None stands for the shared root.
    let mut requests: HashMap<Option<NodeId>, Vec<usize>> = HashMap::new();
    let mut stale = Vec::new();
    for (i, h) in nodes.iter().enumerate() {
        shared.check_foreign(h)?;
        if shared.check_handle(inner, h).is_err() {
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
        kids.sort_by_key(|&c| (Reverse(weight[&Some(c)]), inner.arena[c].sibling_order));
        stack.extend(kids.into_iter().rev().map(|c| (Some(c), false)));
    }
    order.extend(stale);
    Ok(order)
}
