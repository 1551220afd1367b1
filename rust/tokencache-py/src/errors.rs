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
            Error::StaleHandle(_) => raise(py, &c.stale, msg),
            Error::ForeignHandle(_) => raise(py, &c.foreign, msg),
            Error::LockState(_) => raise(py, &c.lock_state, msg),
            Error::InvalidArgument(_) => raise(py, &c.invalid_argument, msg),
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
