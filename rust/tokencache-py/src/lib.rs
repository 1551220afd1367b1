//! Python bindings for tokencache-core: conversion and error mapping only, no logic. Bulk calls
//! release the GIL so worker threads can share one tree.

mod convert;
mod errors;

use numpy::PyArray1;
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use tokencache_core as core;

use convert::{array, token_array};
use errors::{BindingError, IntoPyResult};
use parking_lot::{Mutex, MutexGuard};

/// A generational handle to a tree node. It never keeps the node alive; it holds its tree, where
/// `key` reads the node's tokens.
#[pyclass(module = "tokencache", name = "Node", frozen, eq, hash)]
#[derive(Clone)]
struct PyNode {
    inner: core::NodeHandle,
    tree: core::RadixTree,
}

impl PartialEq for PyNode {
    fn eq(&self, other: &Self) -> bool {
        self.inner == other.inner
    }
}

impl std::hash::Hash for PyNode {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.inner.id().hash(state);
    }
}

#[pymethods]
impl PyNode {
    #[getter]
    fn id(&self) -> u32 {
        self.inner.id().index
    }
    #[getter]
    fn generation(&self) -> u32 {
        self.inner.id().generation
    }
    #[getter]
    fn is_root(&self) -> bool {
        self.inner.is_root()
    }
    fn is_alive(&self) -> bool {
        self.inner.is_alive()
    }
    fn lock_ref(&self) -> u32 {
        self.inner.lock_ref()
    }
    /// The token ids on the edge into this node (SGLang's `TreeNode.key`); empty for a root.
    #[getter]
    fn key<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray1<i64>>> {
        Ok(token_array(py, self.tree.node_key(&self.inner).py_err()?))
    }
    fn __repr__(&self) -> String {
        let id = self.inner.id();
        format!(
            "Node(id={}, generation={}, alive={})",
            id.index,
            id.generation,
            self.is_alive()
        )
    }
}

#[pyclass(module = "tokencache", name = "MatchResult", frozen)]
struct PyMatchResult {
    #[pyo3(get)]
    length: usize,
    #[pyo3(get)]
    slots: Py<PyArray1<i64>>,
    #[pyo3(get)]
    node: Py<PyNode>,
}

#[pymethods]
impl PyMatchResult {
    fn __repr__(&self) -> String {
        format!("MatchResult(length={})", self.length)
    }
}

#[pyclass(module = "tokencache", name = "InsertResult", frozen)]
struct PyInsertResult {
    #[pyo3(get)]
    prefix_len: usize,
    #[pyo3(get)]
    node: Py<PyNode>,
}

#[pymethods]
impl PyInsertResult {
    fn __repr__(&self) -> String {
        format!("InsertResult(prefix_len={})", self.prefix_len)
    }
}

#[pyclass(module = "tokencache", name = "Dedup", frozen)]
struct PyDedup {
    #[pyo3(get)]
    request: Py<PyArray1<i64>>,
    #[pyo3(get)]
    positions: Py<PyArray1<i64>>,
    #[pyo3(get)]
    freed: Py<PyArray1<i64>>,
    #[pyo3(get)]
    slots: Py<PyArray1<i64>>,
    len: usize,
}

#[pymethods]
impl PyDedup {
    fn __len__(&self) -> usize {
        self.len
    }
    fn __repr__(&self) -> String {
        format!("Dedup(len={})", self.len)
    }
}

fn dedup(py: Python<'_>, d: core::Dedup) -> PyDedup {
    PyDedup {
        len: d.len(),
        request: array(py, d.request).unbind(),
        positions: array(py, d.positions).unbind(),
        freed: array(py, d.freed).unbind(),
        slots: array(py, d.slots).unbind(),
    }
}

#[pyclass(module = "tokencache", name = "KVEvent", frozen)]
struct PyKvEvent {
    #[pyo3(get)]
    kind: &'static str,
    #[pyo3(get)]
    page_hashes: Vec<i64>,
    #[pyo3(get)]
    parent_hash: Option<i64>,
    #[pyo3(get)]
    token_ids: Vec<u32>,
    #[pyo3(get)]
    namespace: Option<String>,
    digests: Vec<core::Digest>,
    parent: Option<core::Digest>,
}

#[pymethods]
impl PyKvEvent {
    /// The full 32-byte SHA-256 digest of each page.
    #[getter]
    fn page_digests<'py>(&self, py: Python<'py>) -> Vec<Bound<'py, PyBytes>> {
        self.digests.iter().map(|d| PyBytes::new(py, d)).collect()
    }

    #[getter]
    fn parent_digest<'py>(&self, py: Python<'py>) -> Option<Bound<'py, PyBytes>> {
        self.parent.as_ref().map(|d| PyBytes::new(py, d))
    }

    fn __repr__(&self) -> String {
        format!(
            "KVEvent(kind={:?}, pages={})",
            self.kind,
            self.page_hashes.len()
        )
    }
}

/// Where one request's sequence ends in the tree. Pins its path while alive.
///
/// The cursor sits behind a mutex that is only ever tried, never waited on: a call that finds
/// it taken (an `extend_many` holding it on another thread, without the GIL) raises
/// `CursorBusyError` instead of blocking or PyO3's "Already borrowed".
#[pyclass(module = "tokencache", name = "Cursor", frozen)]
struct PyCursor {
    inner: Mutex<core::Cursor>,
}

impl PyCursor {
    fn get(&self) -> PyResult<MutexGuard<'_, core::Cursor>> {
        self.inner
            .try_lock()
            .ok_or_else(|| errors::binding_error(BindingError::CursorBusy))
    }
}

#[pymethods]
impl PyCursor {
    #[getter]
    fn length(&self) -> PyResult<usize> {
        Ok(self.get()?.length())
    }
    #[getter]
    fn cached_length(&self) -> PyResult<usize> {
        Ok(self.get()?.cached_length())
    }
    #[getter]
    fn node(&self) -> PyResult<PyNode> {
        let cursor = self.get()?;
        Ok(PyNode {
            inner: cursor.node(),
            tree: cursor.tree(),
        })
    }
    #[getter]
    fn namespace(&self) -> PyResult<Option<String>> {
        Ok(self.get()?.namespace().map(str::to_owned))
    }
    #[getter]
    fn released(&self) -> PyResult<bool> {
        Ok(self.get()?.is_released())
    }

    fn extend(
        &self,
        py: Python<'_>,
        tokens: &Bound<'_, PyAny>,
        slots: &Bound<'_, PyAny>,
    ) -> PyResult<Option<PyDedup>> {
        let (t, s) = (convert::tokens(tokens)?, convert::slots(slots)?);
        let d = self.get()?.extend(&t, &s).py_err()?;
        Ok((!d.is_empty()).then(|| dedup(py, d)))
    }

    /// Count an LFU hit on each path node that ends past `since` (SGLang's inserted_len).
    fn record_hits(&self, since: i64) -> PyResult<()> {
        let since = count(since, "since")?;
        self.get()?.record_hits(since).py_err()
    }

    /// Mark the whole sequence used now (LRU), in O(1).
    fn touch(&self) -> PyResult<()> {
        self.get()?.touch().py_err()
    }

    fn truncate<'py>(
        &self,
        py: Python<'py>,
        num_tokens: i64,
    ) -> PyResult<Bound<'py, PyArray1<i64>>> {
        let n = count(num_tokens, "num_tokens")?;
        Ok(array(py, self.get()?.truncate(n).py_err()?))
    }

    fn release<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray1<i64>>> {
        Ok(array(py, self.get()?.release().py_err()?))
    }

    fn slots<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray1<i64>>> {
        Ok(array(py, self.get()?.slots().py_err()?))
    }

    fn tokens<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray1<i64>>> {
        Ok(token_array(py, self.get()?.tokens().py_err()?))
    }

    fn __repr__(&self) -> String {
        match self.inner.try_lock() {
            Some(c) => format!(
                "Cursor(length={}, cached_length={}, released={})",
                c.length(),
                c.cached_length(),
                c.is_released()
            ),
            None => "Cursor(busy)".into(),
        }
    }
}

fn count(n: i64, what: &str) -> PyResult<usize> {
    usize::try_from(n).map_err(|_| {
        errors::to_py(core::Error::InvalidArgument(format!(
            "{what} must be non-negative, got {n}"
        )))
    })
}

/// A radix KV-prefix tree (SGLang RadixCache semantics) with resumable cursors.
///
/// Every refused call raises a TokenCacheError subclass and changes nothing. Two checks are
/// opt-in: strict_pages=False (default) accepts any slots for a page, and True raises
/// PageAlignmentError unless each page's slots are one run starting at a multiple of
/// page_size; strict_slots=False (default) refuses only a slot repeated within one call, and
/// True also raises DuplicateSlotError for a slot the tree holds for another token.
#[pyclass(module = "tokencache", name = "RadixTree", frozen)]
struct PyRadixTree {
    inner: core::RadixTree,
}

impl PyRadixTree {
    fn wrap(&self, inner: core::NodeHandle) -> PyNode {
        PyNode {
            inner,
            tree: self.inner.clone(),
        }
    }
}

#[pymethods]
impl PyRadixTree {
    #[new]
    #[pyo3(signature = (
        page_size=1,
        eviction_policy="lru",
        enable_events=false,
        strict_pages=false,
        strict_slots=false,
    ))]
    fn new(
        page_size: i64,
        eviction_policy: &str,
        enable_events: bool,
        strict_pages: bool,
        strict_slots: bool,
    ) -> PyResult<Self> {
        let policy = eviction_policy.parse::<core::EvictionPolicy>().py_err()?;
        if page_size < 1 {
            return Err(errors::to_py(core::Error::InvalidArgument(format!(
                "page_size must be at least 1, got {page_size}"
            ))));
        }
        let config = core::TreeConfig {
            page_size: page_size as usize,
            policy,
            enable_events,
            strict_pages,
            strict_slots,
        };
        Ok(Self {
            inner: core::RadixTree::new(config).py_err()?,
        })
    }

    #[getter]
    fn page_size(&self) -> usize {
        self.inner.config().page_size
    }
    #[getter]
    fn eviction_policy(&self) -> &'static str {
        self.inner.config().policy.name()
    }
    #[getter]
    fn root(&self) -> PyNode {
        self.wrap(self.inner.root())
    }

    #[pyo3(signature = (tokens, namespace=None))]
    fn match_prefix(
        &self,
        py: Python<'_>,
        tokens: &Bound<'_, PyAny>,
        namespace: Option<String>,
    ) -> PyResult<PyMatchResult> {
        let t = convert::tokens(tokens)?;
        let tree = &self.inner;
        let m = py.allow_threads(|| tree.match_prefix(&t, namespace.as_deref()));
        Ok(PyMatchResult {
            length: m.length,
            slots: array(py, m.slots).unbind(),
            node: Py::new(py, self.wrap(m.node))?,
        })
    }

    #[pyo3(signature = (tokens, namespace=None))]
    fn cached_prefix_len(
        &self,
        py: Python<'_>,
        tokens: &Bound<'_, PyAny>,
        namespace: Option<String>,
    ) -> PyResult<usize> {
        let t = convert::tokens(tokens)?;
        let tree = &self.inner;
        Ok(py.allow_threads(|| tree.cached_prefix_len(&t, namespace.as_deref())))
    }

    #[pyo3(signature = (tokens, slots, namespace=None, inserted_len=0))]
    fn insert(
        &self,
        py: Python<'_>,
        tokens: &Bound<'_, PyAny>,
        slots: &Bound<'_, PyAny>,
        namespace: Option<String>,
        inserted_len: i64,
    ) -> PyResult<PyInsertResult> {
        let (t, s) = (convert::tokens(tokens)?, convert::slots(slots)?);
        let inserted_len = count(inserted_len, "inserted_len")?;
        let tree = &self.inner;
        let r = py
            .allow_threads(|| tree.insert(&t, &s, namespace.as_deref(), inserted_len))
            .py_err()?;
        Ok(PyInsertResult {
            prefix_len: r.prefix_len,
            node: Py::new(py, self.wrap(r.node))?,
        })
    }

    fn lock(&self, node: &PyNode) -> PyResult<usize> {
        self.inner.lock(&node.inner).py_err()
    }

    fn unlock(&self, node: &PyNode) -> PyResult<usize> {
        self.inner.unlock(&node.inner).py_err()
    }

    /// Lock-free pin (accounting is applied by the next operation that takes the tree lock).
    fn pin(&self, node: &PyNode) -> PyResult<()> {
        self.inner.pin(&node.inner).py_err()
    }

    fn unpin(&self, node: &PyNode) -> PyResult<()> {
        self.inner.unpin(&node.inner).py_err()
    }

    fn evict<'py>(&self, py: Python<'py>, num_tokens: i64) -> PyResult<Bound<'py, PyArray1<i64>>> {
        let n = count(num_tokens, "num_tokens")?;
        let tree = &self.inner;
        Ok(array(py, py.allow_threads(|| tree.evict(n))))
    }

    fn evictable_size(&self) -> usize {
        self.inner.sizes().evictable
    }
    fn protected_size(&self) -> usize {
        self.inner.sizes().protected
    }
    fn total_size(&self) -> usize {
        self.inner.sizes().total
    }
    fn node_count(&self) -> usize {
        self.inner.node_count()
    }
    fn memory_bytes(&self) -> usize {
        self.inner.memory_bytes()
    }

    fn reset<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i64>> {
        let tree = &self.inner;
        array(py, py.allow_threads(|| tree.reset()))
    }

    fn pretty_print(&self) -> String {
        self.inner.pretty_print()
    }

    fn all_slots<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i64>> {
        let tree = &self.inner;
        array(py, py.allow_threads(|| tree.all_slots()))
    }

    fn path_slots<'py>(
        &self,
        py: Python<'py>,
        node: &PyNode,
    ) -> PyResult<Bound<'py, PyArray1<i64>>> {
        Ok(array(py, self.inner.path_slots(&node.inner).py_err()?))
    }

    fn path_length(&self, node: &PyNode) -> PyResult<usize> {
        self.inner.path_length(&node.inner).py_err()
    }

    /// SGLang's dfs-weight scheduling order of requests whose last nodes are `nodes`.
    fn dfs_weight_order(&self, nodes: Vec<PyRef<'_, PyNode>>) -> PyResult<Vec<usize>> {
        let handles: Vec<core::NodeHandle> = nodes.iter().map(|n| n.inner.clone()).collect();
        self.inner.dfs_weight_order(&handles).py_err()
    }

    fn take_events(&self) -> Vec<PyKvEvent> {
        self.inner
            .take_events()
            .into_iter()
            .map(|e| PyKvEvent {
                kind: match e.kind {
                    core::KvEventKind::Stored => "stored",
                    core::KvEventKind::Removed => "removed",
                    core::KvEventKind::Cleared => "cleared",
                },
                page_hashes: e.page_hashes(),
                parent_hash: e.parent_hash(),
                digests: e.page_digests,
                parent: e.parent_digest,
                token_ids: e.token_ids,
                namespace: e.namespace,
            })
            .collect()
    }

    /// Chain `namespace`'s KV event digests from a 32-byte `seed` (None: from nothing).
    #[pyo3(signature = (namespace, seed))]
    fn set_event_seed(&self, namespace: Option<String>, seed: Option<&[u8]>) -> PyResult<()> {
        let seed = match seed {
            None => None,
            Some(b) => Some(<core::Digest>::try_from(b).map_err(|_| {
                errors::to_py(core::Error::InvalidArgument(format!(
                    "an event seed is a 32-byte SHA-256 digest, got {} bytes",
                    b.len()
                )))
            })?),
        };
        self.inner.set_event_seed(namespace.as_deref(), seed);
        Ok(())
    }

    fn check_invariants(&self) -> PyResult<()> {
        self.inner
            .check_invariants()
            .map_err(pyo3::exceptions::PyAssertionError::new_err)
    }

    #[pyo3(signature = (namespace=None))]
    fn cursor(&self, namespace: Option<String>) -> PyCursor {
        PyCursor {
            inner: Mutex::new(self.inner.cursor(namespace.as_deref())),
        }
    }

    fn cursor_at(&self, node: &PyNode) -> PyResult<PyCursor> {
        Ok(PyCursor {
            inner: Mutex::new(self.inner.cursor_at(&node.inner).py_err()?),
        })
    }

    fn extend_many(
        &self,
        py: Python<'_>,
        cursors: Vec<Bound<'_, PyCursor>>,
        offsets: &Bound<'_, PyAny>,
        tokens: &Bound<'_, PyAny>,
        slots: &Bound<'_, PyAny>,
    ) -> PyResult<PyDedup> {
        let (o, t, s) = (
            convert::offsets(offsets)?,
            convert::tokens(tokens)?,
            convert::slots(slots)?,
        );
        let mut guards = Vec::with_capacity(cursors.len());
        for (i, c) in cursors.iter().enumerate() {
            let Some(guard) = c.get().inner.try_lock() else {
                // Taken: by this very batch (a duplicate) or by a call on another thread.
                let err = match cursors[..i].iter().position(|d| d.is(c)) {
                    Some(j) => BindingError::DuplicateCursor(format!(
                        "cursors[{j}] and cursors[{i}] are the same cursor: a batch extends \
                         each request once"
                    )),
                    None => BindingError::CursorBusy,
                };
                return Err(errors::binding_error(err));
            };
            guards.push(guard);
        }
        let mut inner: Vec<&mut core::Cursor> = guards.iter_mut().map(|g| &mut **g).collect();
        let tree = &self.inner;
        let d = py
            .allow_threads(|| tree.extend_many(&mut inner, &o, &t, &s))
            .py_err()?;
        Ok(dedup(py, d))
    }

    fn __repr__(&self) -> String {
        let s = self.inner.sizes();
        format!(
            "RadixTree(page_size={}, policy={}, total={}, evictable={}, protected={})",
            self.inner.config().page_size,
            self.inner.config().policy.name(),
            s.total,
            s.evictable,
            s.protected
        )
    }
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    errors::register(m)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_class::<PyRadixTree>()?;
    m.add_class::<PyCursor>()?;
    m.add_class::<PyNode>()?;
    m.add_class::<PyMatchResult>()?;
    m.add_class::<PyInsertResult>()?;
    m.add_class::<PyDedup>()?;
    m.add_class::<PyKvEvent>()?;
    Ok(())
}
