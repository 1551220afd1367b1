//! Input checks that run before a call changes anything, so a refused call leaves the tree
//! exactly as it was. Each is O(slots given), never O(tree).

use rustc_hash::FxHashSet;

use crate::config::TreeConfig;
use crate::error::{Error, Result};
use crate::inner::Inner;
use crate::node::NodeId;

/// Everything `insert` checks before it takes a step.
pub(crate) fn validate_insert(
    config: &TreeConfig,
    tokens: &[u32],
    slots: &[i64],
    inserted_len: usize,
) -> Result<()> {
    validate_shape(tokens, slots)?;
    if inserted_len > tokens.len() {
        return Err(Error::InvalidArgument(format!(
            "inserted_len {inserted_len} is past the end of the {} tokens given",
            tokens.len()
        )));
    }
    if let Some(s) = first_duplicate(slots) {
        return Err(duplicate_in_call(s, slots));
    }
    validate_pages(config, slots)
}

pub(crate) fn validate_shape(tokens: &[u32], slots: &[i64]) -> Result<()> {
    if tokens.len() != slots.len() {
        return Err(Error::Shape(format!(
            "tokens and slots differ in length ({} != {})",
            tokens.len(),
            slots.len()
        )));
    }
    if let Some(i) = slots.iter().position(|&s| s < 0) {
        return Err(Error::InvalidArgument(format!(
            "slot {} at index {i} is negative",
            slots[i]
        )));
    }
    Ok(())
}

/// With `strict_pages`, each whole page of `slots` (which must start on a page boundary) is one
/// run starting at a multiple of the page size, as a paged KV allocator hands them out.
pub(crate) fn validate_pages(config: &TreeConfig, slots: &[i64]) -> Result<()> {
    if !config.strict_pages || config.page_size == 1 {
        return Ok(());
    }
    let page = config.page_size as i64;
    for (p, run) in slots.chunks_exact(config.page_size).enumerate() {
        if run[0] % page != 0 || run.windows(2).any(|w| w[1] != w[0] + 1) {
            return Err(Error::PageAlignment(format!(
                "slots of page {p} ({run:?}) are not one run starting at a multiple of {page}"
            )));
        }
    }
    Ok(())
}

/// The first slot that occurs twice in `slots` (all non-negative), in O(len): a direct scan
/// for a few slots, a bitmap when the slots are dense (as allocators hand them out; on the
/// stack for a decode step's handful), a hash set otherwise.
pub(crate) fn first_duplicate(slots: &[i64]) -> Option<i64> {
    const STACK_WORDS: usize = 64;
    let n = slots.len();
    if n <= 8 {
        return (1..n)
            .find(|&i| slots[..i].contains(&slots[i]))
            .map(|i| slots[i]);
    }
    let (lo, hi) = slots
        .iter()
        .fold((i64::MAX, i64::MIN), |(lo, hi), &s| (lo.min(s), hi.max(s)));
    let words = ((hi - lo) as u64 / 64 + 1) as usize;
    if words <= STACK_WORDS {
        first_duplicate_in_bitmap(slots, lo, &mut [0u64; STACK_WORDS])
    } else if words <= 4 * n {
        first_duplicate_in_bitmap(slots, lo, &mut vec![0u64; words])
    } else {
        let mut seen = FxHashSet::with_capacity_and_hasher(n, Default::default());
        slots.iter().find(|&&s| !seen.insert(s)).copied()
    }
}

/// `bits` covers `lo..` and starts zeroed.
fn first_duplicate_in_bitmap(slots: &[i64], lo: i64, bits: &mut [u64]) -> Option<i64> {
    for &s in slots {
        let offset = (s - lo) as usize;
        let (word, bit) = (offset / 64, 1u64 << (offset % 64));
        if bits[word] & bit != 0 {
            return Some(s);
        }
        bits[word] |= bit;
    }
    None
}

/// The error for slot `s` found twice in `slots` (the error path only: it scans again).
pub(crate) fn duplicate_in_call(s: i64, slots: &[i64]) -> Error {
    let at: Vec<usize> = (0..slots.len()).filter(|&i| slots[i] == s).collect();
    Error::DuplicateSlot(format!(
        "slot {s} is given more than once in one call (at indices {at:?})"
    ))
}

/// With `strict_slots`: every slot given for `tokens` below `start` must be new to the tree or
/// the very slot the tree holds for that token. Read-only; O(tokens given).
pub(crate) fn validate_held(
    inner: &Inner,
    start: NodeId,
    tokens: &[u32],
    slots: &[i64],
) -> Result<()> {
    let Some(held) = &inner.held else {
        return Ok(());
    };
    let mut bad = None;
    let matched = inner.walk(start, tokens, &mut |run, at| {
        let clash = run
            .iter()
            .zip(&slots[at..])
            .position(|(&tree, &ours)| tree != ours && held.contains(&ours));
        if let (None, Some(i)) = (bad, clash) {
            bad = Some(at + i);
        }
    });
    let bad = bad.or_else(|| (matched..slots.len()).find(|&i| held.contains(&slots[i])));
    match bad {
        None => Ok(()),
        Some(i) => Err(Error::DuplicateSlot(format!(
            "slot {} at index {i} is already held by the tree for another token \
             (strict_slots)",
            slots[i]
        ))),
    }
}
