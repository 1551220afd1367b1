//! KV events for external indexers: which pages were stored or removed, named by chained,
//! position-aware SHA-256 page hashes (a page's hash covers every token before it).

use sha2::{Digest, Sha256};

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEventKind {
    Stored,
    Removed,
    Cleared,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvEvent {
    pub kind: KvEventKind,
    pub page_hashes: Vec<u64>,
    pub parent_hash: Option<u64>,
    pub token_ids: Vec<u32>,
    pub namespace: Option<String>,
}

/// Hash of one page given the hash of the page before it (None for the first page).
pub fn page_hash(parent: Option<u64>, namespace: Option<&str>, page: &[u32]) -> u64 {
    let mut h = Sha256::new();
    match parent {
        Some(p) => h.update(p.to_le_bytes()),
        // The namespace seeds the chain, so equal tokens in two namespaces never collide.
        None => h.update(namespace.unwrap_or("").as_bytes()),
    }
    for t in page {
        h.update(t.to_le_bytes());
    }
    let digest = h.finalize();
    u64::from_le_bytes(digest[..8].try_into().expect("sha256 has 32 bytes"))
}

/// Hashes of consecutive pages of `tokens`, chained from `parent`.
pub fn chain_hashes(
    parent: Option<u64>,
    namespace: Option<&str>,
    tokens: &[u32],
    page_size: usize,
) -> Vec<u64> {
    let mut out = Vec::with_capacity(tokens.len() / page_size);
    let mut prev = parent;
    for page in tokens.chunks_exact(page_size) {
        let h = page_hash(prev, namespace, page);
        out.push(h);
        prev = Some(h);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hashes_are_position_and_namespace_aware() {
        let a = chain_hashes(None, None, &[1, 2, 1, 2], 2);
        assert_ne!(
            a[0], a[1],
            "same page at another position must hash differently"
        );
        let b = chain_hashes(None, Some("x"), &[1, 2], 2);
        assert_ne!(a[0], b[0]);
        assert_eq!(chain_hashes(Some(a[0]), None, &[1, 2], 2)[0], a[1]);
    }
}
