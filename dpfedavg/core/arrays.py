"""Which array library the core math runs in: numpy for numpy arrays, torch (through its array API) for tensors.

The pure functions of `dpfedavg.core` (the bound of Alg. 1 / Alg. 2 line 9, the noise and the sum of lines
10-12) are written once against the Python array API standard. A numpy input is computed by numpy itself
(bit for bit what these functions computed before they took tensors); a torch tensor by torch on the tensor's
own device, through `array-api-compat` (installed with the ``torch`` extra, imported only when a tensor comes).
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["as_array_like", "astype", "concat", "copy", "namespace", "on_device_of", "row_norms", "to_host"]


def namespace(x: Any) -> Any:
    """The array namespace ``x`` computes in: ``numpy`` for numpy arrays, scalars and lists, else the array API's."""
    if isinstance(x, np.ndarray | np.generic | float | int | list | tuple):
        return np
    from array_api_compat import array_namespace

    return array_namespace(x)


def row_norms(u: Any, keepdims: bool = False) -> Any:
    """``||u||`` over the last axis (one norm per client row)."""
    xp = namespace(u)
    if xp is np:
        u = np.asarray(u)
        if u.dtype.kind == "f":  # np.linalg.norm's own sum of squares, without its copy of conj(u)
            return np.sqrt(np.add.reduce(u * u, axis=-1, keepdims=keepdims))
        return np.linalg.norm(u, axis=-1, keepdims=keepdims)
    return xp.linalg.vector_norm(u, axis=-1, keepdims=keepdims)


def astype(x: Any, dtype: Any) -> Any:
    """``x`` cast to ``dtype`` (numpy's method or the array API's function)."""
    xp = namespace(x)
    return x.astype(dtype) if xp is np else xp.astype(x, dtype)


def concat(arrays: list[Any], axis: int = 0) -> Any:
    """The arrays joined along ``axis`` in their library."""
    xp = namespace(arrays[0])
    return np.concatenate(arrays, axis=axis) if xp is np else xp.concat(arrays, axis=axis)


def copy(x: Any) -> Any:
    """A copy of ``x`` in its own library."""
    xp = namespace(x)
    return np.array(x, copy=True) if xp is np else xp.asarray(x, copy=True)


def on_device_of(a: np.ndarray, like: Any) -> Any:
    """The host array ``a`` in ``like``'s library, dtype and device (one transfer; none for a numpy ``like``)."""
    xp = namespace(like)
    if xp is np:
        return np.asarray(a, dtype=like.dtype)
    return xp.asarray(a, dtype=like.dtype, device=like.device)


def as_array_like(value: Any, like: Any) -> Any:
    """``value`` (a scalar or a host array, e.g. one ``C`` per run) as an array of ``like``'s library and device.

    Scalars stay Python numbers (every library broadcasts them); numpy arrays go to ``like``'s device in
    ``like``'s floating dtype.
    """
    if isinstance(value, float | int) or namespace(like) is np:
        return value
    xp = namespace(like)
    return xp.asarray(np.asarray(value, dtype=np.float64), dtype=like.dtype, device=like.device)


def to_host(x: Any) -> np.ndarray:
    """``x`` as a numpy array (a device tensor crosses to the host here, and only here)."""
    if namespace(x) is np:
        return np.asarray(x)
    from array_api_compat import to_device

    return np.asarray(to_device(x, "cpu"))
