//! KV events for external indexers: which pages were stored or removed, named by chained,
//! position-aware SHA-256 page digests (a page's digest covers every token before it).
//!
//! The digests are SGLang's own (`mem_cache/cpp_utils/hash_binding.cpp`): SHA-256 of the previous
//! page's 32-byte digest (absent for a namespace's first page, or the namespace's seed) followed
//! by the page's token ids as little-endian u32. An event id is the digest's first 8 bytes read
//! big-endian as a signed integer (SGLang's `hash_str_to_int64`).

use sha2::{Digest as _, Sha256};

pub type Digest = [u8; 32];

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEventKind {
    Stored,
    Removed,
    Cleared,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvEvent {
    pub kind: KvEventKind,
    /// One digest per page of the stored or removed node.
    pub page_digests: Vec<Digest>,
    /// The last page of the parent node, or None when the parent is a namespace root.
    pub parent_digest: Option<Digest>,
    pub token_ids: Vec<u32>,
    pub namespace: Option<String>,
}

impl KvEvent {
    pub fn page_hashes(&self) -> Vec<i64> {
        self.page_digests.iter().map(digest_id).collect()
    }

    pub fn parent_hash(&self) -> Option<i64> {
        self.parent_digest.as_ref().map(digest_id)
    }
}

/// Digest of one page given the digest before it.
pub fn page_digest(prior: Option<&Digest>, page: &[u32]) -> Digest {
    let mut h = Sha256::new();
    if let Some(p) = prior {
        h.update(p);
    }
    for t in page {
        h.update(t.to_le_bytes());
    }
    h.finalize().into()
}

/// Digests of consecutive pages of `tokens`, chained from `prior`.
pub fn chain_digests(prior: Option<Digest>, tokens: &[u32], page_size: usize) -> Vec<Digest> {
    let mut out = Vec::with_capacity(tokens.len() / page_size);
    let mut prev = prior;
    for page in tokens.chunks_exact(page_size) {
        let d = page_digest(prev.as_ref(), page);
        out.push(d);
        prev = Some(d);
    }
    out
}

/// The 64-bit event id of a digest.
pub fn digest_id(d: &Digest) -> i64 {
    u64::from_be_bytes(d[..8].try_into().expect("a digest has 32 bytes")) as i64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digests_are_position_aware_and_seedable() {
        let a = chain_digests(None, &[1, 2, 1, 2], 2);
        assert_ne!(
            a[0], a[1],
            "same page at another position must hash differently"
        );
        assert_eq!(chain_digests(Some(a[0]), &[1, 2], 2)[0], a[1]);
        let seeded = chain_digests(Some([7; 32]), &[1, 2], 2);
        assert_ne!(seeded[0], a[0]);
    }

    #[test]
    fn known_answer() {
        // sha256 of the little-endian u32 token 1: 01 00 00 00
        let d = page_digest(None, &[1]);
        let hex: String = d.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(
            hex,
            "67abdd721024f0ff4e0b3f4c2fc13bc5bad42d0b7851d456d88d203d15aaa450"
        );
        assert_eq!(
            digest_id(&d),
            i64::from_str_radix("67abdd721024f0ff", 16).unwrap()
        );
    }
}
