//! The one place core errors become Python exceptions. The classes are built at import time so
//! each can subclass both `TokenCacheError` and the builtin it refines (ValueError, KeyError...).

use pyo3::exceptions::{PyException, PyKeyError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::GILOnceCell;
use pyo3::types::{PyDict, PyTuple, PyType};
use tokencache_core::Error;

pub(crate) struct Classes {
    pub base: Py<PyType>,
    pub invalid_token: Py<PyType>,
    pub shape: Py<PyType>,
    pub page_alignment: Py<PyType>,
    pub duplicate_slot: Py<PyType>,
    pub duplicate_cursor: Py<PyType>,
    pub cursor_busy: Py<PyType>,
    pub stale: Py<PyType>,
    pub foreign: Py<PyType>,
    pub lock_state: Py<PyType>,
    pub invalid_argument: Py<PyType>,
}

static CLASSES: GILOnceCell<Classes> = GILOnceCell::new();

fn make(
    py: Python<'_>,
    name: &str,
    doc: &str,
    bases: Vec<Bound<'_, PyType>>,
) -> PyResult<Py<PyType>> {
    let dict = PyDict::new(py);
    dict.set_item("__doc__", doc)?;
    dict.set_item("__module__", "tokencache")?;
    let ty = py
        .get_type::<PyType>()
        .call1((name, PyTuple::new(py, bases)?, dict))?;
    Ok(ty.downcast_into::<PyType>()?.unbind())
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    let base = make(
        py,
        "TokenCacheError",
        "Base class of every error tokencache raises.",
        vec![py.get_type::<PyException>()],
    )?;
    let b = || base.bind(py).clone();
    let value = || py.get_type::<PyValueError>();
    let classes = Classes {
        invalid_token: make(
            py,
            "InvalidTokenError",
            "A token id is negative or does not fit in 32 bits.",
            vec![b(), value()],
        )?,
        shape: make(
            py,
            "ShapeError",
            "An array has the wrong dtype, rank, or length (e.g. len(tokens) != len(slots)).",
            vec![b(), value()],
        )?,
        page_alignment: make(
            py,
            "PageAlignmentError",
            "Slots of one page are not one aligned run, or an operation would cut a shared page.",
            vec![b(), value()],
        )?,
        duplicate_slot: make(
            py,
            "DuplicateSlotError",
            "A KV slot given twice in one call, or (with strict_slots=True) a slot the tree \
             already holds for another token.",
            vec![b(), value()],
        )?,
        duplicate_cursor: make(
            py,
            "DuplicateCursorError",
            "The same cursor appears twice in one extend_many batch.",
            vec![b(), value()],
        )?,
        cursor_busy: make(
            py,
            "CursorBusyError",
            "A cursor is in use by a call on another thread (an extend_many in progress).",
            vec![b(), py.get_type::<PyRuntimeError>()],
        )?,
        stale: make(
            py,
            "StaleHandleError",
            "A node handle or cursor refers to a node that was evicted, truncated away or reset.",
            vec![b(), py.get_type::<PyKeyError>()],
        )?,
        foreign: make(
            py,
            "ForeignHandleError",
            "A node handle or cursor belongs to another tree.",
            vec![b(), value()],
        )?,
        lock_state: make(
            py,
            "LockStateError",
            "Unlocking a node that holds no lock, or using a released cursor.",
            vec![b(), py.get_type::<PyRuntimeError>()],
        )?,
        invalid_argument: make(
            py,
            "InvalidArgumentError",
            "Any other invalid argument (negative counts, unknown policy, bad offsets).",
            vec![b(), value()],
        )?,
        base,
    };
    for (name, ty) in [
        ("TokenCacheError", &classes.base),
        ("InvalidTokenError", &classes.invalid_token),
        ("ShapeError", &classes.shape),
        ("PageAlignmentError", &classes.page_alignment),
        ("DuplicateSlotError", &classes.duplicate_slot),
        ("DuplicateCursorError", &classes.duplicate_cursor),
        ("CursorBusyError", &classes.cursor_busy),
        ("StaleHandleError", &classes.stale),
        ("ForeignHandleError", &classes.foreign),
        ("LockStateError", &classes.lock_state),
        ("InvalidArgumentError", &classes.invalid_argument),
    ] {
        m.add(name, ty.bind(py))?;
    }
    let _ = CLASSES.set(py, classes);
    Ok(())
}

fn raise(py: Python<'_>, ty: &Py<PyType>, msg: String) -> PyErr {
    PyErr::from_type(ty.bind(py).clone(), msg)
}

pub(crate) fn to_py(e: Error) -> PyErr {
    Python::with_gil(|py| {
        let c = CLASSES
            .get(py)
            .expect("tokencache._native initialised its exceptions");
        let msg = e.to_string();
        match e {
            Error::InvalidToken { .. } => raise(py, &c.invalid_token, msg),
            Error::Shape(_) => raise(py, &c.shape, msg),
            Error::PageAlignment(_) => raise(py, &c.page_alignment, msg),
            Error::DuplicateSlot(_) => raise(py, &c.duplicate_slot, msg),
            Error::StaleHandle(_) => raise(py, &c.stale, msg),
            Error::ForeignHandle(_) => raise(py, &c.foreign, msg),
            Error::LockState(_) => raise(py, &c.lock_state, msg),
            Error::InvalidArgument(_) => raise(py, &c.invalid_argument, msg),
        }
    })
}

/// Errors of the binding itself: Python objects the core never sees.
pub(crate) enum BindingError {
    DuplicateCursor(String),
    CursorBusy,
}

pub(crate) fn binding_error(e: BindingError) -> PyErr {
    Python::with_gil(|py| {
        let c = CLASSES
            .get(py)
            .expect("tokencache._native initialised its exceptions");
        match e {
            BindingError::DuplicateCursor(msg) => raise(py, &c.duplicate_cursor, msg),
            BindingError::CursorBusy => raise(
                py,
                &c.cursor_busy,
                "cursor is in use by a call on another thread (an extend_many in progress)".into(),
            ),
        }
    })
}

pub(crate) trait IntoPyResult<T> {
    fn py_err(self) -> PyResult<T>;
}

impl<T> IntoPyResult<T> for Result<T, Error> {
    fn py_err(self) -> PyResult<T> {
        self.map_err(to_py)
    }
}
