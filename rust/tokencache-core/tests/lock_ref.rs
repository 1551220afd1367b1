//! `NodeHandle::lock_ref`: the locks and pins held on a node itself (SGLang's `lock_ref` of
//! that node, what `pretty_print` and the Python binding report), not those of its subtree.
//! cargo-mutants found no test reading it (docs/MUTATION.md).

use tokencache_core::{RadixTree, TreeConfig};

#[test]
fn lock_ref_counts_locks_and_pins_on_the_node_itself() {
    let tree = RadixTree::new(TreeConfig::default()).unwrap();
    tree.insert(&[1, 2], &[10, 11], None, 0).unwrap();
    tree.insert(&[1, 2, 3, 4], &[10, 11, 12, 13], None, 0)
        .unwrap();
    let leaf = tree.match_prefix(&[1, 2, 3, 4], None).node;
    let parent = tree.match_prefix(&[1, 2], None).node;
    assert_eq!((leaf.lock_ref(), parent.lock_ref()), (0, 0));

    tree.lock(&leaf).unwrap();
    tree.lock(&leaf).unwrap();
    let mut cursor = tree.cursor_at(&leaf).unwrap();
    // Two locks and a pin on the leaf; the parent is protected through it but holds none.
    assert_eq!((leaf.lock_ref(), parent.lock_ref()), (3, 0));
    tree.lock(&parent).unwrap();
    assert_eq!((leaf.lock_ref(), parent.lock_ref()), (3, 1));

    tree.unlock(&leaf).unwrap();
    cursor.release().unwrap();
    tree.unlock(&parent).unwrap();
    assert_eq!((leaf.lock_ref(), parent.lock_ref()), (1, 0));
    tree.unlock(&leaf).unwrap();
    assert_eq!(leaf.lock_ref(), 0);
    tree.check_invariants().unwrap();
}
