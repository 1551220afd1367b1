//! One error enum for the whole core; the binding maps each variant to a Python exception.

/// Everything the core can refuse. Every failing call leaves the tree unchanged.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// A token id is negative or does not fit in `u32`.
    #[error("token id {value} at index {index} is out of range 0..=4294967295")]
    InvalidToken { index: usize, value: i64 },
    /// Wrong lengths or shapes (tokens vs slots, offsets).
    #[error("{0}")]
    Shape(String),
    /// Slots of a page are not one aligned run, or a truncation would cut a shared page.
    #[error("{0}")]
    PageAlignment(String),
    /// One slot given twice in a call, or (with `strict_slots`) a slot the tree already holds
    /// for another token.
    #[error("{0}")]
    DuplicateSlot(String),
    /// The handle's node was evicted, truncated away or reset.
    #[error("{0}")]
    StaleHandle(String),
    /// The handle belongs to another tree.
    #[error("{0}")]
    ForeignHandle(String),
    /// Unlock of an unlocked node, or use of a released cursor.
    #[error("{0}")]
    LockState(String),
    /// Any other bad argument.
    #[error("{0}")]
    InvalidArgument(String),
}

pub type Result<T> = std::result::Result<T, Error>;
