//! Arrays in, arrays out: numpy arrays (or plain sequences) of token ids and slots become Rust
//! vectors with one bulk pass; results go back as numpy arrays that own the Rust buffer.

use numpy::{PyArray1, PyReadonlyArray1, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::prelude::*;
use tokencache_core::Error;

use crate::errors::to_py;

/// Narrow to u32 in two vectorizable passes (check, then convert); only a failing input pays
/// for finding the offending index.
fn narrow<T: Copy + Into<i128>>(values: &[T]) -> Result<Vec<u32>, Error> {
    let in_range = |v: T| (0..=i128::from(u32::MAX)).contains(&v.into());
    if values.iter().all(|&v| in_range(v)) {
        return Ok(values.iter().map(|&v| v.into() as u32).collect());
    }
    let index = values
        .iter()
        .position(|&v| !in_range(v))
        .expect("an id is out of range");
    let value = values[index].into();
    Err(Error::InvalidToken {
        index,
        value: value.clamp(i64::MIN.into(), i64::MAX.into()) as i64,
    })
}

fn narrow_array<T: Copy + Into<i128> + numpy::Element>(
    a: &PyReadonlyArray1<'_, T>,
) -> Result<Vec<u32>, Error> {
    match a.as_slice() {
        Ok(s) => narrow(s),
        Err(_) => narrow(&a.as_array().to_vec()),
    }
}

/// Token ids as u32, checked: negative or oversized ids raise InvalidTokenError.
pub(crate) fn tokens(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    let out = if let Ok(a) = obj.extract::<PyReadonlyArray1<'_, i64>>() {
        narrow_array(&a)
    } else if let Ok(a) = obj.extract::<PyReadonlyArray1<'_, i32>>() {
        narrow_array(&a)
    } else if let Ok(a) = obj.extract::<PyReadonlyArray1<'_, u32>>() {
        Ok(a.as_array().to_vec())
    } else if let Ok(a) = obj.extract::<PyReadonlyArray1<'_, u64>>() {
        narrow_array(&a)
    } else {
        narrow(&sequence(obj, "tokens")?)
    };
    out.map_err(to_py)
}

/// KV slot indices as i64.
pub(crate) fn slots(obj: &Bound<'_, PyAny>) -> PyResult<Vec<i64>> {
    if let Ok(a) = obj.extract::<PyReadonlyArray1<'_, i64>>() {
        return Ok(match a.as_slice() {
            Ok(s) => s.to_vec(),
            Err(_) => a.as_array().to_vec(),
        });
    }
    if let Ok(a) = obj.extract::<PyReadonlyArray1<'_, i32>>() {
        return Ok(a.as_array().iter().map(|&v| v.into()).collect());
    }
    sequence(obj, "slots")
}

/// Offsets of a ragged batch.
pub(crate) fn offsets(obj: &Bound<'_, PyAny>) -> PyResult<Vec<usize>> {
    let v = slots(obj)?;
    v.iter()
        .map(|&x| usize::try_from(x))
        .collect::<Result<_, _>>()
        .map_err(|_| to_py(Error::Shape("offsets must be non-negative".into())))
}

/// A non-array input: a 1-D sequence of Python ints. Anything else is a ShapeError.
fn sequence(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<i64>> {
    if let Ok(a) = obj.downcast::<PyUntypedArray>() {
        let msg = if a.ndim() != 1 {
            format!("{what} must be a 1-D array, got {} dimensions", a.ndim())
        } else {
            format!("{what} must be an integer array, got dtype {}", a.dtype())
        };
        return Err(to_py(Error::Shape(msg)));
    }
    if obj.is_instance_of::<pyo3::types::PyString>() || obj.is_instance_of::<pyo3::types::PyBytes>()
    {
        return Err(to_py(Error::Shape(format!(
            "{what} must be a sequence of ints"
        ))));
    }
    obj.extract::<Vec<i64>>().map_err(|_| {
        to_py(Error::Shape(format!(
            "{what} must be a 1-D sequence of ints"
        )))
    })
}

pub(crate) fn array<'py>(py: Python<'py>, v: Vec<i64>) -> Bound<'py, PyArray1<i64>> {
    PyArray1::from_vec(py, v)
}

pub(crate) fn token_array<'py>(py: Python<'py>, v: Vec<u32>) -> Bound<'py, PyArray1<i64>> {
    PyArray1::from_vec(py, v.into_iter().map(i64::from).collect())
}
