//! tokencache-core: a radix KV-prefix tree over token ids with resumable request cursors and
//! lock-free pinning. No Python here; `tokencache-py` binds it.
//!
//! - [`RadixTree`]: SGLang `RadixCache` semantics (page-granular match with split, insert,
//!   lock/unlock, eviction of unlocked leaves by policy, exact evictable/protected sizes,
//!   namespaces, KV events).
//! - [`Cursor`]: a request's place in the tree; resume is free, extend is O(new tokens).
//! - Pins are atomic operations on one node (`cell.rs`); the tree is `Send + Sync`.
//!
//! Modules, each depending only on those listed before it: `error`, `events`, `cell` (the
//! per-node atomic word), `node` (arena, leaf keys), `policy`, `config`, `handle` (what callers
//! hold), `inner` (the state behind the lock and every structural step on it), `shared` (the
//! lock and the queue of lock-free pin changes), `validate` (read-only checks before any
//! change), `invariants`, `print`, `schedule` (dfs-weight order), `tree` (the public API),
//! `cursor`. `fault` exists only with the test-only `fault-injection` feature.

mod cell;
mod config;
mod cursor;
mod error;
mod events;
#[cfg(feature = "fault-injection")]
mod fault;
mod handle;
mod inner;
mod invariants;
mod node;
mod policy;
mod print;
mod schedule;
mod shared;
mod tree;
mod validate;

pub use config::{Sizes, TreeConfig};
pub use cursor::{Cursor, Dedup};
pub use error::{Error, Result};
pub use events::{chain_digests, digest_id, page_digest, Digest, KvEvent, KvEventKind};
#[cfg(feature = "fault-injection")]
pub use fault::Fault;
pub use handle::{InsertOutput, MatchOutput, NodeHandle};
pub use node::NodeId;
pub use policy::EvictionPolicy;
pub use tree::RadixTree;

#[cfg(test)]
mod refusal_tests;
#[cfg(test)]
mod tests;
