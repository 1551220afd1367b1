//! Plain data a tree is built with and reports: its configuration and its size counters.

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TreeConfig {
    pub page_size: usize,
    pub policy: crate::policy::EvictionPolicy,
    pub enable_events: bool,
    /// Require every page's slots to be one aligned run (`slot % page_size` = offset in page).
    /// Off by default: only whole-page shapes are then enforced.
    pub strict_pages: bool,
    /// Refuse a slot the tree already holds for another token (one hash-set entry per cached
    /// token). A slot given twice within one call is refused either way.
    pub strict_slots: bool,
}

impl Default for TreeConfig {
    fn default() -> Self {
        Self {
            page_size: 1,
            policy: crate::policy::EvictionPolicy::Lru,
            enable_events: false,
            strict_pages: false,
            strict_slots: false,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Sizes {
    pub evictable: usize,
    pub protected: usize,
    pub total: usize,
}
