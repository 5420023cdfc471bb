"""Validation of the integer arguments layers and models take."""

from __future__ import annotations

import operator

__all__ = ["checked_int"]


def checked_int(name: str, value: object, minimum: int) -> int:
    """``value`` as an int >= ``minimum``; TypeError (not an integer, or a bool) or
    ValueError naming ``name`` otherwise."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got bool")
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value
