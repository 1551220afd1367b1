//! Every refused call names its error and changes nothing: same nodes, slots, sizes and pins.

use crate::*;

fn build(page_size: usize, strict_slots: bool) -> RadixTree {
    RadixTree::new(TreeConfig {
        page_size,
        strict_slots,
        ..TreeConfig::default()
    })
    .unwrap()
}

/// Everything a refusal must leave as it was.
fn snapshot(t: &RadixTree) -> (String, Vec<i64>, Sizes, usize) {
    let mut slots = t.all_slots();
    slots.sort();
    (t.pretty_print(), slots, t.sizes(), t.node_count())
}

fn refused<T: std::fmt::Debug>(t: &RadixTree, r: Result<T>) -> String {
    t.check_invariants().unwrap();
    match r {
        Err(Error::DuplicateSlot(msg)) => msg,
        other => panic!("expected DuplicateSlot, got {other:?}"),
    }
}

#[test]
fn insert_refuses_a_slot_given_twice() {
    for strict in [false, true] {
        let t = build(1, strict);
        t.insert(&[7, 8], &[0, 1], None, 0).unwrap();
        let before = snapshot(&t);
        let msg = refused(&t, t.insert(&[1, 2], &[5, 5], None, 0));
        assert!(msg.contains("slot 5") && msg.contains("[0, 1]"), "{msg}");
        // Duplicates inside the already-cached prefix are refused too (the caller would free
        // the same slot twice), and so are duplicates in an ignored partial page.
        refused(&t, t.insert(&[7, 8, 9], &[3, 3, 4], None, 0));
        let paged = build(2, strict);
        refused(&paged, paged.insert(&[1, 2, 3], &[0, 1, 1], None, 0));
        assert_eq!(snapshot(&t), before);
    }
}

#[test]
fn insert_refuses_inserted_len_past_the_tokens() {
    let t = build(1, false);
    t.insert(&[7, 8], &[0, 1], None, 0).unwrap();
    let before = snapshot(&t);
    let r = t.insert(&[1, 2], &[5, 6], None, 5);
    assert!(matches!(r, Err(Error::InvalidArgument(ref m)) if m.contains("inserted_len 5")));
    assert_eq!(snapshot(&t), before);
    t.insert(&[1, 2], &[5, 6], None, 2).unwrap(); // the whole sequence is fine
    t.check_invariants().unwrap();
}

#[test]
fn cursor_extend_refuses_a_slot_given_twice() {
    let t = build(2, false);
    let mut a = t.cursor(None);
    a.extend(&[1, 2, 3], &[0, 1, 2]).unwrap(); // slot 2 stays in a's uncached tail
    let before = snapshot(&t);
    let msg = refused(&t, a.extend(&[1, 2], &[300, 300]));
    assert!(
        msg.contains("slot 300") && msg.contains("request 0 at [0, 1]"),
        "{msg}"
    );
    let msg = refused(&t, a.extend(&[4], &[2]));
    assert!(msg.contains("uncached tail"), "{msg}");
    assert_eq!(snapshot(&t), before);
    assert_eq!((a.length(), a.slots().unwrap()), (3, vec![0, 1, 2]));
}

#[test]
fn extend_many_refuses_a_slot_shared_by_two_requests() {
    let t = build(1, false);
    let mut a = t.cursor(None);
    let mut b = t.cursor(None);
    a.extend(&[1], &[0]).unwrap();
    let before = snapshot(&t);
    let r = t.extend_many(&mut [&mut a, &mut b], &[0, 2, 3], &[2, 3, 9], &[1, 2, 2]);
    let msg = refused(&t, r);
    assert!(
        msg.contains("request 0 at [1]") && msg.contains("request 1 at [0]"),
        "{msg}"
    );
    assert_eq!(snapshot(&t), before);
    assert_eq!((a.length(), b.length()), (1, 0));
}

#[test]
fn without_strict_slots_a_held_slot_is_accepted() {
    // The documented default: only slots repeated within one call are checked.
    let t = build(1, false);
    t.insert(&[1], &[5], None, 0).unwrap();
    t.insert(&[2], &[5], None, 0).unwrap();
    assert!(t
        .check_invariants()
        .unwrap_err()
        .contains("slot 5 is held twice"));
}

#[test]
fn strict_slots_refuses_a_slot_the_tree_holds_for_another_token() {
    let t = build(1, true);
    t.insert(&[1, 2, 3], &[10, 11, 12], None, 0).unwrap();
    let mut c = t.cursor(None);
    c.extend(&[1, 2], &[10, 11]).unwrap();
    let before = snapshot(&t);
    // A new token, a new namespace, a matched token given another held slot, a cursor.
    refused(&t, t.insert(&[4], &[12], None, 0));
    refused(&t, t.insert(&[1], &[11], Some("fresh"), 0));
    refused(&t, t.insert(&[1, 2], &[10, 12], None, 0));
    refused(&t, c.extend(&[9], &[10]));
    assert_eq!(snapshot(&t), before);
    // The very slots the tree holds for these tokens are fine (a re-insert), as are new ones.
    assert_eq!(
        t.insert(&[1, 2, 3], &[10, 11, 12], None, 0)
            .unwrap()
            .prefix_len,
        3
    );
    assert!(c.extend(&[3], &[12]).unwrap().is_empty());
    // Slots that leave the tree may be given again.
    c.release().unwrap();
    t.insert(&[7], &[20], None, 0).unwrap();
    let mut freed = t.evict(usize::MAX);
    freed.sort();
    assert_eq!(freed, vec![10, 11, 12, 20]);
    t.insert(&[8, 9], &[12, 20], None, 0).unwrap();
    t.check_invariants().unwrap();
}

#[test]
fn strict_slots_follows_truncation_and_reset() {
    let t = build(2, true);
    let mut c = t.cursor(None);
    c.extend(&[1, 2, 3, 4], &[0, 1, 2, 3]).unwrap();
    // Truncating into the last page hands its slots back to the cursor's tail: the slot it
    // drops (3) is the caller's again, the one it keeps (2) is the cursor's, not the tree's.
    assert_eq!(c.truncate(1).unwrap(), vec![3]);
    t.check_invariants().unwrap();
    t.insert(&[9, 9], &[3, 4], None, 0).unwrap();
    t.reset();
    t.insert(&[5, 6], &[0, 1], None, 0).unwrap();
    t.check_invariants().unwrap();
}

#[test]
fn first_duplicate_in_every_regime() {
    use crate::validate::first_duplicate;
    assert_eq!(first_duplicate(&[]), None);
    assert_eq!(first_duplicate(&[3, 1, 3]), Some(3));
    let dense: Vec<i64> = (100..200).chain([150]).collect();
    assert_eq!(first_duplicate(&dense), Some(150));
    assert_eq!(first_duplicate(&dense[..100]), None);
    let wide: Vec<i64> = (0..5000).map(|i| i * 3).chain([4998]).collect(); // heap bitmap
    assert_eq!(first_duplicate(&wide), Some(4998));
    assert_eq!(first_duplicate(&wide[..5000]), None);
    assert_eq!(
        first_duplicate(&[0, 4095, 9, 4095, 1, 2, 3, 4, 5]),
        Some(4095)
    );
    let sparse: Vec<i64> = (0..40)
        .map(|i| i * 1_000_000_007)
        .chain([7_000_000_049])
        .collect();
    assert_eq!(first_duplicate(&sparse), Some(7_000_000_049));
    assert_eq!(first_duplicate(&sparse[..40]), None);
}

#[test]
fn extend_many_refuses_offsets_that_do_not_cover_the_tokens() {
    let t = build(1, false);
    t.insert(&[7, 8], &[0, 1], None, 0).unwrap();
    let (mut a, mut b) = (t.cursor(None), t.cursor(None));
    let before = snapshot(&t);
    let (tokens, slots) = ([1, 2, 3], [5, 6, 7]);
    // Each offsets array is wrong in one way only: its length, its start, its end (short of
    // the tokens or past them), its order.
    for offsets in [&[0, 1][..], &[1, 2, 3], &[0, 1, 2], &[0, 1, 4], &[0, 2, 1]] {
        let r = t.extend_many(&mut [&mut a, &mut b], offsets, &tokens, &slots);
        assert!(
            matches!(r, Err(Error::Shape(ref m)) if m.contains("offsets")),
            "{offsets:?}: {r:?}"
        );
        assert_eq!(snapshot(&t), before, "{offsets:?}");
        assert_eq!((a.length(), b.length()), (0, 0));
    }
    t.extend_many(&mut [&mut a, &mut b], &[0, 1, 3], &tokens, &slots)
        .unwrap();
    assert_eq!(
        (a.tokens().unwrap(), b.tokens().unwrap()),
        (vec![1], vec![2, 3])
    );
}
