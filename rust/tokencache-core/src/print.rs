//! A human-readable dump of the tree for debugging and tests.

use std::fmt::Write as _;

use crate::inner::Inner;

/// One line per node (first 8 tokens, length, pins, protection), indented by depth, children
/// in id order, then the size counters.
pub(crate) fn pretty_print(inner: &Inner) -> String {
    let mut out = String::new();
    let mut roots: Vec<_> = inner.roots.iter().collect();
    roots.sort_by_key(|(_, id)| **id);
    for (ns, &root) in roots {
        let _ = writeln!(out, "namespace {ns:?}");
        let mut stack = vec![(root, 0usize)];
        while let Some((id, depth)) = stack.pop() {
            let n = &inner.arena[id];
            if !n.is_root {
                let shown: Vec<_> = n.tokens.iter().take(8).collect();
                let more = if n.len() > 8 { " ..." } else { "" };
                let _ = writeln!(
                    out,
                    "{:indent$}{shown:?}{more} len={} pins={} protected={}",
                    "",
                    n.len(),
                    n.cell.pins(),
                    n.counted,
                    indent = 2 * depth
                );
            }
            let mut kids: Vec<_> = n.children.values().copied().collect();
            kids.sort();
            stack.extend(kids.into_iter().rev().map(|c| (c, depth + 1)));
        }
    }
    let _ = writeln!(
        out,
        "total={} evictable={} protected={}",
        inner.sizes.total, inner.sizes.evictable, inner.sizes.protected
    );
    out
}
