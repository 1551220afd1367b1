//! Example-based unit tests; the randomized model test lives in tests/model.rs.

use crate::*;

fn build(config: TreeConfig) -> RadixTree {
    RadixTree::new(config).unwrap()
}

fn tree(page_size: usize) -> RadixTree {
    build(TreeConfig {
        page_size,
        ..TreeConfig::default()
    })
}

fn ok(t: &RadixTree) {
    t.check_invariants().unwrap();
}

#[test]
fn insert_match_split() {
    let t = tree(1);
    assert_eq!(
        t.insert(&[1, 2, 3, 4], &[10, 11, 12, 13], None, 0)
            .unwrap()
            .prefix_len,
        0
    );
    ok(&t);
    let m = t.match_prefix(&[1, 2, 9], None);
    assert_eq!((m.length, m.slots.clone()), (2, vec![10, 11]));
    assert_eq!(t.node_count(), 2, "the match split the node");
    ok(&t);
    let r = t.insert(&[1, 2, 3, 5], &[20, 21, 22, 23], None, 0).unwrap();
    assert_eq!(r.prefix_len, 3);
    assert_eq!(t.sizes().total, 5);
    ok(&t);
}

#[test]
fn pages_ignore_partial_tail_and_split_on_page_boundaries() {
    let t = tree(2);
    t.insert(&[1, 2, 3, 4, 5], &[0, 1, 2, 3, 4], None, 0)
        .unwrap();
    assert_eq!(t.sizes().total, 4);
    let m = t.match_prefix(&[1, 2, 3, 9], None);
    assert_eq!(m.length, 2);
    ok(&t);
}

#[test]
fn namespaces_never_share() {
    let t = tree(1);
    t.insert(&[1, 2], &[0, 1], Some("a"), 0).unwrap();
    assert_eq!(t.match_prefix(&[1, 2], None).length, 0);
    assert_eq!(t.match_prefix(&[1, 2], Some("b")).length, 0);
    assert_eq!(t.match_prefix(&[1, 2], Some("a")).length, 2);
    ok(&t);
}

#[test]
fn a_cursor_at_a_match_keeps_its_namespace() {
    let t = tree(1);
    t.insert(&[1, 2], &[0, 1], Some("a"), 0).unwrap();
    t.insert(&[1, 2], &[5, 6], None, 0).unwrap();
    for ns in [Some("a"), None] {
        let m = t.match_prefix(&[1, 2], ns);
        let mut c = t.cursor_at(&m.node).unwrap();
        assert_eq!((c.namespace(), c.length()), (ns, 2));
        // and it extends within that namespace only
        c.extend(&[3], &[if ns.is_some() { 2 } else { 7 }]).unwrap();
        c.release().unwrap();
        assert_eq!(t.match_prefix(&[1, 2, 3], ns).length, 3);
    }
    assert_eq!(t.cursor(Some("b")).namespace(), Some("b"));
    ok(&t);
}

#[test]
fn lock_protects_path_and_evict_skips_it() {
    let t = tree(1);
    let a = t.insert(&[1, 2, 3], &[0, 1, 2], None, 0).unwrap().node;
    t.insert(&[1, 2, 4], &[0, 1, 3], None, 0).unwrap();
    assert_eq!(t.lock(&a).unwrap(), 3);
    ok(&t);
    assert_eq!(
        t.sizes(),
        Sizes {
            evictable: 1,
            protected: 3,
            total: 4
        }
    );
    assert_eq!(t.evict(10), vec![3]);
    assert_eq!(t.unlock(&a).unwrap(), 3);
    assert!(matches!(t.unlock(&a), Err(Error::LockState(_))));
    let mut freed = t.evict(10);
    freed.sort();
    assert_eq!(freed, vec![0, 1, 2]);
    assert!(matches!(t.lock(&a), Err(Error::StaleHandle(_))));
    ok(&t);
}

#[test]
fn lru_order() {
    let t = tree(1);
    t.insert(&[1], &[1], None, 0).unwrap();
    t.insert(&[2], &[2], None, 0).unwrap();
    t.insert(&[3], &[3], None, 0).unwrap();
    t.match_prefix(&[1], None);
    assert_eq!(t.evict(1), vec![2]);
    assert_eq!(t.evict(1), vec![3]);
    assert_eq!(t.evict(1), vec![1]);
}

#[test]
fn cached_prefix_len_is_a_question_not_a_use() {
    // match_prefix's length, but the LRU order, the nodes and the hits stay as they were.
    let t = tree(2);
    t.insert(&[1, 2, 3, 4], &[1, 2, 3, 4], None, 0).unwrap();
    t.insert(&[5, 6], &[5, 6], None, 0).unwrap();
    let nodes = t.node_count();
    assert_eq!(t.cached_prefix_len(&[1, 2, 9, 9], None), 2); // ends inside a node: no split
    assert_eq!(t.cached_prefix_len(&[1, 2, 3, 4, 7], None), 4); // a tail under a page
    assert_eq!(t.cached_prefix_len(&[1, 2, 3], None), 2);
    assert_eq!(t.cached_prefix_len(&[1, 2, 3, 4], Some("other")), 0); // never written
    assert_eq!(t.node_count(), nodes);
    assert_eq!(t.match_prefix(&[1, 2, 9, 9], None).length, 2); // the same, with a split
    assert_eq!(t.node_count(), nodes + 1);
    // [5, 6] was asked about after [1, 2, 3, 4] was matched: still the older use.
    t.cached_prefix_len(&[5, 6], None);
    assert_eq!(t.evict(2), vec![5, 6]);
    ok(&t);
}

#[test]
fn cursor_extend_follows_shared_path_and_reports_duplicates() {
    let t = tree(1);
    let mut a = t.cursor(None);
    assert!(a.extend(&[1, 2, 3], &[0, 1, 2]).unwrap().is_empty());
    let mut b = t.cursor(None);
    let d = b.extend(&[1, 2, 7], &[5, 6, 7]).unwrap();
    assert_eq!(
        (d.positions, d.freed, d.slots),
        (vec![0, 1], vec![5, 6], vec![0, 1])
    );
    assert_eq!(b.slots().unwrap(), vec![0, 1, 7]);
    ok(&t);
    assert_eq!(
        t.sizes(),
        Sizes {
            evictable: 0,
            protected: 4,
            total: 4
        }
    );
    a.release().unwrap();
    ok(&t);
    assert_eq!(
        t.sizes(),
        Sizes {
            evictable: 1,
            protected: 3,
            total: 4
        }
    );
    assert!(matches!(a.release(), Err(Error::LockState(_))));
    b.release().unwrap();
    assert_eq!(t.sizes().evictable, 4);
    ok(&t);
}

#[test]
fn cursor_survives_split_by_other_request() {
    let t = tree(1);
    let mut a = t.cursor(None);
    a.extend(&[1, 2, 3, 4], &[0, 1, 2, 3]).unwrap();
    let node = a.node();
    t.match_prefix(&[1, 2], None);
    assert_eq!(a.node(), node);
    a.extend(&[5], &[4]).unwrap();
    assert_eq!(a.tokens().unwrap(), vec![1, 2, 3, 4, 5]);
    ok(&t);
}

#[test]
fn cursor_pending_tail_with_pages() {
    let t = tree(4);
    let mut a = t.cursor(None);
    a.extend(&[1, 2, 3], &[0, 1, 2]).unwrap();
    assert_eq!((a.length(), a.cached_length()), (3, 0));
    a.extend(&[4, 5], &[3, 4]).unwrap();
    assert_eq!((a.length(), a.cached_length()), (5, 4));
    assert_eq!(t.sizes().protected, 4);
    assert_eq!(a.release().unwrap(), vec![4]);
    ok(&t);
}

#[test]
fn truncate_returns_exclusive_slots_only() {
    let t = tree(1);
    let mut a = t.cursor(None);
    a.extend(&[1, 2, 3, 4], &[0, 1, 2, 3]).unwrap();
    let mut b = t.cursor(None);
    b.extend(&[1, 2], &[0, 1]).unwrap();
    assert_eq!(
        a.truncate(3).unwrap(),
        vec![2, 3],
        "tokens 1..2 are shared with b"
    );
    assert_eq!(a.length(), 1);
    ok(&t);
    assert_eq!(t.sizes().total, 2);
    b.release().unwrap();
    a.release().unwrap();
    ok(&t);
}

#[test]
fn truncate_into_partial_page() {
    let t = tree(2);
    let mut a = t.cursor(None);
    a.extend(&[1, 2, 3, 4, 5, 6], &[0, 1, 2, 3, 4, 5]).unwrap();
    assert_eq!(a.truncate(3).unwrap(), vec![3, 4, 5]);
    assert_eq!((a.length(), a.cached_length()), (3, 2));
    assert_eq!(a.slots().unwrap(), vec![0, 1, 2]);
    ok(&t);
    let mut b = t.cursor(None);
    b.extend(&[1, 2], &[0, 1]).unwrap();
    // now [1,2] is shared; cutting into it is refused and changes nothing
    let before = t.pretty_print();
    assert!(matches!(a.truncate(2), Err(Error::PageAlignment(_))));
    assert_eq!(before, t.pretty_print());
    ok(&t);
}

#[test]
fn reset_makes_everything_stale() {
    let t = tree(1);
    let mut a = t.cursor(None);
    a.extend(&[1, 2], &[0, 1]).unwrap();
    let mut all = t.reset();
    all.sort();
    assert_eq!(all, vec![0, 1]);
    assert!(matches!(a.extend(&[3], &[2]), Err(Error::StaleHandle(_))));
    assert!(a.release().unwrap().is_empty());
    ok(&t);
}

#[test]
fn events_chain_hashes() {
    let t = build(TreeConfig {
        page_size: 2,
        enable_events: true,
        ..Default::default()
    });
    t.insert(&[1, 2, 3, 4], &[0, 1, 2, 3], None, 0).unwrap();
    t.insert(&[1, 2, 5, 6], &[0, 1, 4, 5], None, 0).unwrap();
    let ev = t.take_events();
    assert_eq!(ev.len(), 2);
    assert_eq!(ev[0].page_digests, chain_digests(None, &[1, 2, 3, 4], 2));
    assert_eq!(
        ev[0].parent_digest, None,
        "a child of the root names no parent"
    );
    assert_eq!(ev[1].parent_digest, Some(ev[0].page_digests[0]));
    t.evict(100);
    let ev = t.take_events();
    assert!(ev.iter().all(|e| e.kind == KvEventKind::Removed));
    assert_eq!(ev.iter().map(|e| e.page_digests.len()).sum::<usize>(), 3);
    t.check_invariants().unwrap();
}

#[test]
fn event_seed_starts_a_namespace_chain() {
    let t = build(TreeConfig {
        page_size: 1,
        enable_events: true,
        ..Default::default()
    });
    t.set_event_seed(Some("salted"), Some([9; 32]));
    t.insert(&[5], &[0], Some("salted"), 0).unwrap();
    t.insert(&[5], &[1], None, 0).unwrap();
    let ev = t.take_events();
    assert_eq!(ev[0].page_digests[0], page_digest(Some(&[9; 32]), &[5]));
    assert_eq!(ev[1].page_digests[0], page_digest(None, &[5]));
    t.reset();
    t.take_events();
    t.insert(&[5], &[0], Some("salted"), 0).unwrap();
    assert_eq!(
        t.take_events()[0].page_digests[0],
        ev[0].page_digests[0],
        "seeds survive reset"
    );
}

#[test]
fn bad_input_is_refused() {
    let t = tree(1);
    assert!(matches!(
        t.insert(&[1, 2], &[0], None, 0),
        Err(Error::Shape(_))
    ));
    assert!(matches!(
        t.insert(&[1], &[-1], None, 0),
        Err(Error::InvalidArgument(_))
    ));
    let other = tree(1);
    let h = other.root();
    assert!(matches!(t.lock(&h), Err(Error::ForeignHandle(_))));
    let strict = build(TreeConfig {
        page_size: 2,
        strict_pages: true,
        ..Default::default()
    });
    assert!(matches!(
        strict.insert(&[1, 2], &[1, 2], None, 0),
        Err(Error::PageAlignment(_))
    ));
    assert_eq!(t.sizes().total, 0);
    ok(&t);
}

#[test]
fn memory_accounting_grows_with_content() {
    let t = tree(1);
    let empty = t.memory_bytes();
    let tokens: Vec<u32> = (0..1000).collect();
    let slots: Vec<i64> = (0..1000).collect();
    t.insert(&tokens, &slots, None, 0).unwrap();
    assert!(t.memory_bytes() >= empty + 12 * 1000);
}

fn tree_with(policy: EvictionPolicy) -> RadixTree {
    build(TreeConfig {
        policy,
        ..TreeConfig::default()
    })
}

#[test]
fn lfu_counts_insertions_not_matches() {
    let t = tree_with(EvictionPolicy::Lfu);
    t.insert(&[1, 2, 3], &[10, 11, 12], None, 0).unwrap();
    t.insert(&[4, 5, 6], &[20, 21, 22], None, 0).unwrap();
    t.insert(&[4, 5, 6], &[30, 31, 32], None, 0).unwrap();
    for _ in 0..3 {
        t.match_prefix(&[1, 2, 3], None);
    }
    assert_eq!(t.evict(1), vec![10, 11, 12], "[4,5,6] was inserted twice");
}

#[test]
fn lfu_inserted_len_skips_own_prefix() {
    let t = tree_with(EvictionPolicy::Lfu);
    t.insert(&[1, 2], &[10, 11], None, 0).unwrap();
    t.insert(&[1, 2], &[10, 11], None, 2).unwrap(); // the same caller again: no new hit
    t.insert(&[3, 4], &[20, 21], None, 0).unwrap();
    assert_eq!(t.evict(1), vec![10, 11]);
}

#[test]
fn record_hits_counts_only_the_nodes_that_end_past_since() {
    // What an insert of the cursor's sequence with inserted_len = since counts: nothing for a
    // node that ends at `since` (the lfu_inserted_len_skips_own_prefix rule).
    for (since, first_evicted) in [(2, vec![10, 11]), (1, vec![90, 91])] {
        let t = tree_with(EvictionPolicy::Lfu);
        let mut a = t.cursor(None);
        a.extend(&[1, 2], &[10, 11]).unwrap(); // one node, one hit, the older
        t.insert(&[9, 9], &[90, 91], None, 0).unwrap(); // one hit, newer
        a.record_hits(since).unwrap(); // since 2: none; since 1: the node ends past it
        a.release().unwrap();
        assert_eq!(t.evict(1), first_evicted, "since {since}");
    }
}

#[test]
fn fifo_split_prefix_is_a_new_node() {
    let t = tree_with(EvictionPolicy::Fifo);
    t.insert(&[1, 2, 3, 4, 5, 6], &[10, 11, 12, 13, 14, 15], None, 0)
        .unwrap();
    t.insert(&[9, 9], &[20, 21], None, 0).unwrap();
    t.match_prefix(&[1, 2, 3], None);
    let mut freed = t.evict(4);
    freed.sort();
    assert_eq!(freed, vec![13, 14, 15, 20, 21]);
}

#[test]
fn cursor_touch_refreshes_the_whole_path_lazily() {
    let t = tree(1);
    let mut a = t.cursor(None);
    a.extend(&[1, 2, 3], &[10, 11, 12]).unwrap();
    let mut b = t.cursor(None);
    b.extend(&[4, 5, 6], &[20, 21, 22]).unwrap();
    a.touch().unwrap();
    a.release().unwrap();
    b.release().unwrap();
    assert_eq!(t.evict(1), vec![20, 21, 22]);
    // the parent inherits its evicted child's stamp
    let mut c = t.cursor(None);
    c.extend(&[7, 8], &[30, 31]).unwrap();
    let mut d = t.cursor(None);
    d.extend(&[7, 8, 9], &[30, 31, 40]).unwrap();
    t.insert(&[5, 5], &[50, 51], None, 0).unwrap();
    d.touch().unwrap();
    c.release().unwrap();
    d.release().unwrap();
    assert_eq!(t.evict(1), vec![10, 11, 12]);
    assert_eq!(t.evict(1), vec![50, 51]);
    t.check_invariants().unwrap();
}

#[test]
fn a_parent_left_a_leaf_by_truncation_is_as_recent_as_its_touched_child() {
    // A cursor's touch stamps only its own node; SGLang would stamp the whole path. Once the
    // child leaves (truncate), the parent must be as recent as that touch made it.
    let t = tree(1);
    let mut c = t.cursor(None);
    c.extend(&[7, 8], &[30, 31]).unwrap();
    let mut d = t.cursor(None);
    d.extend(&[7, 8, 9], &[30, 31, 40]).unwrap();
    t.insert(&[5, 5], &[50, 51], None, 0).unwrap(); // after [7, 8] was last reached
    d.touch().unwrap(); // the whole of [7, 8, 9] used now
    assert_eq!(d.truncate(1).unwrap(), vec![40]);
    c.release().unwrap();
    d.release().unwrap();
    assert_eq!(t.evict(1), vec![50, 51]); // [7, 8] is the more recent leaf
    assert_eq!(t.evict(1), vec![30, 31]);
    t.check_invariants().unwrap();
}

#[test]
fn config_reads_back_what_the_tree_was_built_with() {
    let config = TreeConfig {
        page_size: 4,
        policy: EvictionPolicy::Lfu,
        strict_pages: true,
        ..TreeConfig::default()
    };
    assert_eq!(build(config).config(), config);
}

#[test]
fn a_dropped_cursor_lets_go_of_its_pin() {
    let t = tree(1);
    {
        let mut c = t.cursor(None);
        c.extend(&[1, 2], &[10, 11]).unwrap();
        assert_eq!(t.sizes().protected, 2);
    } // dropped without release()
    assert_eq!(t.sizes().protected, 0);
    assert_eq!(t.evict(2), vec![10, 11]);
    t.check_invariants().unwrap();
}

#[test]
fn a_cursors_node_is_the_root_until_it_caches_a_page() {
    let t = tree(2);
    let mut c = t.cursor(None);
    assert!(c.node().is_root());
    c.extend(&[1], &[10]).unwrap(); // a partial page: still at the root
    assert!(c.node().is_root());
    c.extend(&[2], &[11]).unwrap();
    assert!(!c.node().is_root());
    c.release().unwrap();
}

#[test]
fn path_slots_and_length_are_those_from_the_root() {
    let t = tree(1);
    t.insert(&[1, 2, 3], &[10, 11, 12], None, 0).unwrap();
    t.insert(&[1, 2, 4], &[10, 11, 20], None, 0).unwrap();
    let m = t.match_prefix(&[1, 2, 4], None);
    assert_eq!(t.path_slots(&m.node).unwrap(), vec![10, 11, 20]);
    assert_eq!(t.path_length(&m.node).unwrap(), 3);
}

#[test]
fn a_nodes_key_is_the_edge_into_it() {
    let t = tree(2);
    assert_eq!(t.node_key(&t.root()).unwrap(), Vec::<u32>::new());
    let first = t.insert(&[1, 2, 3, 4], &[10, 11, 12, 13], None, 0).unwrap();
    assert_eq!(t.node_key(&first.node).unwrap(), vec![1, 2, 3, 4]);
    // A match ending inside the node splits it: the deeper node keeps its id, its key shortens.
    let m = t.match_prefix(&[1, 2, 9, 9], None);
    assert_eq!(t.node_key(&m.node).unwrap(), vec![1, 2]);
    assert_eq!(t.node_key(&first.node).unwrap(), vec![3, 4]);
    let other = t.insert(&[7, 8], &[20, 21], Some("ns"), 0).unwrap();
    assert_eq!(t.node_key(&other.node).unwrap(), vec![7, 8]);
    let root = t.cursor(Some("ns")).node();
    assert!(root.is_root());
    assert_eq!(t.node_key(&root).unwrap(), Vec::<u32>::new());
    t.reset();
    assert!(matches!(
        t.node_key(&first.node),
        Err(Error::StaleHandle(_))
    ));
    assert!(matches!(
        tree(2).node_key(&t.root()),
        Err(Error::ForeignHandle(_))
    ));
    ok(&t);
}

#[test]
fn pretty_print_shows_each_node_and_the_sizes() {
    let t = tree(1);
    t.insert(&[1, 2, 3], &[10, 11, 12], None, 0).unwrap();
    t.insert(&[1, 2, 4], &[10, 11, 20], None, 0).unwrap();
    let text = t.pretty_print();
    for line in [
        "namespace None",
        "  [1, 2] len=2 pins=0 protected=false",
        "    [3] len=1",
        "    [4] len=1",
        "total=4 evictable=4 protected=0",
    ] {
        assert!(text.contains(line), "{line:?} not in\n{text}");
    }
}

#[test]
fn strict_batch_refusal_changes_nothing() {
    let t = build(TreeConfig {
        page_size: 2,
        strict_pages: true,
        ..Default::default()
    });
    let mut a = t.cursor(None);
    let mut b = t.cursor(None);
    let before = t.pretty_print();
    // a's page is fine, b's is not: nothing may change, a included
    let r = t.extend_many(
        &mut [&mut a, &mut b],
        &[0, 2, 4],
        &[1, 2, 3, 4],
        &[4, 5, 9, 7],
    );
    assert!(matches!(r, Err(Error::PageAlignment(_))));
    assert_eq!((a.length(), b.length()), (0, 0));
    assert_eq!(t.pretty_print(), before);
}

#[test]
fn dfs_weight_order_heavier_subtrees_first() {
    let t = tree(1);
    let a = t.insert(&[1, 2], &[0, 1], None, 0).unwrap().node; // inserted first
    let b = t.insert(&[1, 3], &[2, 3], None, 0).unwrap().node;
    let c = t.insert(&[4], &[4], None, 0).unwrap().node;
    let shared = t.match_prefix(&[1], None).node;
    let root = t.root();
    // [a, b, b, c, shared, root]: subtree [1] weighs 4 (a, b, b, shared), [4] weighs 1
    let order = t
        .dfs_weight_order(&[a.clone(), b.clone(), b.clone(), c, shared, root])
        .unwrap();
    // under [1]: b (2) before a (1); [1]'s own request after its subtree; then [4]; root last
    assert_eq!(order, vec![1, 2, 0, 4, 3, 5]);
    t.unlock(&a).unwrap_err();
    t.check_invariants().unwrap();
}
