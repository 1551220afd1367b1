//! Every structural and accounting invariant of the tree, checked from scratch. Tests call this
//! after every operation; it is O(tree size) and never used on a hot path.

use std::collections::BTreeSet;

use rustc_hash::FxHashSet;

use crate::cell::NodeCell;
use crate::config::Sizes;
use crate::inner::Inner;
use crate::node::NodeId;

macro_rules! ensure {
    ($cond:expr, $($fmt:tt)+) => {
        if !$cond {
            return Err(format!($($fmt)+));
        }
    };
}

pub(crate) fn check(inner: &Inner) -> Result<(), String> {
    let page = inner.config.page_size;
    let policy = inner.config.policy;
    let mut sizes = Sizes::default();
    let mut leaves = BTreeSet::new();
    let mut slots_seen = FxHashSet::default();
    let mut reached = 0usize;

    for (ns, &root) in &inner.roots {
        let r = inner
            .arena
            .get(root)
            .ok_or_else(|| format!("root of {ns:?} missing"))?;
        ensure!(
            r.is_root && r.parent.is_none() && r.tokens.is_empty(),
            "bad root for {ns:?}"
        );
        let mut stack: Vec<NodeId> = vec![root];
        while let Some(id) = stack.pop() {
            reached += 1;
            let n = &inner.arena[id];
            ensure!(!n.cell.is_dead(), "live node {id:?} has a dead cell");
            let state = n.cell.load();
            let mut counted_children = 0;
            for (key, &c) in &n.children {
                let child = inner
                    .arena
                    .get(c)
                    .ok_or_else(|| format!("dangling child {c:?}"))?;
                ensure!(
                    child.parent == Some(id),
                    "child {c:?} does not point back to {id:?}"
                );
                ensure!(
                    child.tokens[..page] == key[..],
                    "child {c:?} filed under a wrong key"
                );
                ensure!(
                    child.namespace == n.namespace,
                    "child {c:?} changed namespace"
                );
                counted_children += u64::from(child.counted);
                stack.push(c);
            }
            ensure!(
                NodeCell::protected_children(state) == counted_children,
                "node {id:?} cell counts {} protected children, {} are",
                NodeCell::protected_children(state),
                counted_children
            );
            if n.is_root {
                ensure!(n.leaf_key.is_none(), "a root is in the leaf set");
                continue;
            }
            ensure!(!n.tokens.is_empty(), "empty non-root node {id:?}");
            ensure!(
                n.tokens.len() == n.slots.len(),
                "node {id:?} tokens/slots differ"
            );
            ensure!(
                n.tokens.len() % page == 0,
                "node {id:?} length not page aligned"
            );
            ensure!(
                n.counted == NodeCell::is_protected(state),
                "node {id:?} counted={} but cell protected={}",
                n.counted,
                NodeCell::is_protected(state)
            );
            if inner.config.enable_events {
                ensure!(
                    n.page_hashes.len() == n.len() / page,
                    "node {id:?} hash count"
                );
            }
            for &s in &n.slots {
                ensure!(slots_seen.insert(s), "slot {s} is held twice");
            }
            sizes.total += n.len();
            if n.counted {
                sizes.protected += n.len();
            } else {
                sizes.evictable += n.len();
            }
            let should_be_leaf = n.children.is_empty() && !n.counted;
            if should_be_leaf {
                let key = policy.key(id, n);
                ensure!(
                    n.leaf_key == Some(key),
                    "leaf {id:?} has key {:?}",
                    n.leaf_key
                );
                leaves.insert(key);
            } else {
                ensure!(n.leaf_key.is_none(), "node {id:?} wrongly in the leaf set");
            }
        }
    }
    ensure!(
        reached == inner.arena.len(),
        "{} nodes unreachable",
        inner.arena.len() - reached
    );
    ensure!(
        sizes == inner.sizes,
        "sizes {:?} but recount gives {sizes:?}",
        inner.sizes
    );
    ensure!(
        leaves == inner.leaves,
        "leaf set differs from the evictable leaves"
    );
    if let Some(held) = &inner.held {
        ensure!(
            *held == slots_seen,
            "strict_slots set has {} slots, the nodes hold {}",
            held.len(),
            slots_seen.len()
        );
    }
    Ok(())
}
