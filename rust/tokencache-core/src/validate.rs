//! Input checks that run before a call changes anything, so a refused call leaves the tree
//! exactly as it was.

use crate::config::TreeConfig;
use crate::error::{Error, Result};

/// Reject inputs that would break the tree; nothing is changed before this passes.
pub(crate) fn validate(config: &TreeConfig, tokens: &[u32], slots: &[i64]) -> Result<()> {
    validate_shape(tokens, slots)?;
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
