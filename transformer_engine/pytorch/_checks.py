"""Constructor argument checks shared by the modules, the attention modules and TransformerLayer: sizes, epsilons, probabilities.

Each raises before any parameter is allocated, with a message that names the argument, its value,
the rule and, where there is one, the fix (a bare ``ZeroDivisionError`` or a negative-dimension
``RuntimeError`` from deep inside the constructor names none of them).
"""

from __future__ import annotations

import math
import operator

__all__ = ["check_sizes", "check_eps", "check_probability"]


def _is_int(value) -> bool:
    if isinstance(value, bool):
        return False
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def check_sizes(owner: str, **sizes) -> None:
    """Every ``name=value`` must be a positive integer.

    Raises:
        TypeError: a value is not an integer (e.g. a float ``4.0``).
        ValueError: a value is zero or negative.
    """
    for name, value in sizes.items():
        if not _is_int(value):
            raise TypeError(f"{owner}: {name}={value!r} must be a positive integer, got {type(value).__name__}")
        if value < 1:
            raise ValueError(f"{owner}: {name}={value!r} must be a positive integer (>= 1)")


def check_eps(owner: str, eps, name: str = "eps") -> None:
    """``eps`` (added to the variance before the square root) must be a finite number >= 0 (0 is NVIDIA TE's
    too: a constant row then normalizes to inf / NaN, as it does there).

    Raises:
        ValueError: ``eps`` is negative, NaN or infinite.
    """
    try:
        value = float(eps)
    except (TypeError, ValueError):
        raise TypeError(f"{owner}: {name}={eps!r} must be a number >= 0") from None
    if not (math.isfinite(value) and value >= 0.0):
        raise ValueError(
            f"{owner}: {name}={eps!r} must be a finite number >= 0 (it is added to the variance under the square "
            "root); the usual values are 1e-5 to 1e-6"
        )


def check_probability(owner: str, name: str, p) -> None:
    """A dropout probability must lie in [0, 1].

    Raises:
        ValueError: ``p`` is outside [0, 1] or NaN.
    """
    try:
        value = float(p)
    except (TypeError, ValueError):
        raise TypeError(f"{owner}: {name}={p!r} must be a probability in [0, 1]") from None
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{owner}: {name}={p!r} must be a probability in [0, 1]")
