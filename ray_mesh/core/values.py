"""Strict typed readers for user values: job-file keys, CLI flags, ``MeshConfig`` options.

One home for "is this an int / a bool / a number of seconds", so a job file, a command-line
flag and the Python API refuse the same bad values with the same words. YAML and argparse
both hand over loosely typed values: ``"false"`` (a string, and truthy), ``2.0`` where an
int is meant, ``.nan`` for seconds, ``0`` for a bool. Each reader raises ``error`` (default
``ValueError``) with a message that starts with ``where`` (the key or flag) and says the fix.
"""

from __future__ import annotations

import math
import reprlib
from typing import Any

from ray_mesh.core.safe import safe_text

MAX_SECONDS = 7 * 24 * 3600.0
"""The longest timeout accepted anywhere (a week): anything longer is a typo or 'never'."""


class _Brief(reprlib.Repr):
    """``repr`` that stops early: a few items per container, three levels, short strings."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel, self.maxstring, self.maxother, self.maxlong = 3, 60, 60, 40
        self.maxlist = self.maxtuple = self.maxdict = self.maxset = self.maxfrozenset = 6

    def repr_int(self, x: int, level: int) -> str:
        if x.bit_length() > 12_000:  # repr() itself raises past 4300 digits
            return f"<an integer of about {int(x.bit_length() * 0.30103)} digits>"
        return super().repr_int(x, level)


_BRIEF = _Brief()


def brief(value: Any, limit: int = 120) -> str:
    """``value`` as an error message may quote it: bounded in size whatever it is.

    A YAML file of a few hundred bytes can hold a list of a billion items (aliases) or a
    thousand levels of nesting, and JSON an integer of thousands of digits; plain ``repr``
    of those takes gigabytes, recurses too deep or raises. Control characters are escaped.
    """
    try:
        text = _BRIEF.repr(value)
    except Exception:  # noqa: BLE001 - a value's own __repr__ failing: name its type
        text = f"<a {type(value).__name__}>"
    return safe_text(text, limit)


def _lead(where: str) -> str:
    """``"<where> must"``, or ``"must"`` for a CLI flag (argparse names the flag itself)."""
    return f"{where} must" if where else "must"


def describe(value: Any) -> str:
    """``value`` as the user wrote it, with a hint where the type is the problem."""
    if isinstance(value, bool):
        return f"{value!r} (a boolean)"
    if isinstance(value, str):
        try:
            float(value)
            return f"{brief(value)} (a string: write the number without quotes)"
        except ValueError:
            pass
        if value.lower() in ("true", "false", "yes", "no", "on", "off"):
            return f"{value!r} (a string: write true or false without quotes)"
        return brief(value)
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return f"{value!r} (a float: write {int(value)})"
    if value is None:
        return "nothing (null)"
    if isinstance(value, list | tuple | dict):
        return f"{brief(value)} (a {type(value).__name__})"
    return brief(value)


def read_int(where: str, value: Any, low: int, high: int | None = None, *,
             example: int | None = None, none_ok: bool = False,
             error: type[Exception] = ValueError) -> int | None:
    """An int in ``[low, high]``; bools, floats and strings are refused, not converted."""
    if value is None and none_ok:
        return None
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= low and (
        high is None or value <= high)
    if not ok:
        bound = f">= {low}" if high is None else f"from {low} to {high}"
        eg = f" (e.g. {example})" if example is not None else ""
        null = ", or null" if none_ok else ""
        raise error(f"{_lead(where)} be an int {bound}{eg}{null}; got {describe(value)}.")
    return value


def read_bool(where: str, value: Any, *, also: tuple[str, ...] = (),
              error: type[Exception] = ValueError) -> bool | str:
    """``True`` or ``False`` (YAML ``true``/``false``), or one of the strings ``also``."""
    if value is True or value is False or (isinstance(value, str) and value in also):
        return value
    words = ["true", "false", *also]
    raise error(f"{_lead(where)} be {', '.join(words[:-1])} or {words[-1]} (true/false are "
                f"YAML booleans, no quotes); got {describe(value)}.")


def read_seconds(where: str, value: Any, *, high: float = MAX_SECONDS, none_ok: bool = False,
                 none_means: str = "", error: type[Exception] = ValueError) -> float | None:
    """A finite number of seconds in ``(0, high]`` (int or float, never a string or bool)."""
    if value is None and none_ok:
        return None
    if (isinstance(value, bool) or not isinstance(value, int | float)
            or not math.isfinite(value) or not 0 < value <= high):
        null = f", or null ({none_means})" if none_ok else ""
        shown = repr(value) if isinstance(value, float) else describe(value)
        raise error(f"{_lead(where)} be a finite number of seconds > 0 and <= {high:g}{null}; "
                    f"got {shown}.")
    return value


def read_str(where: str, value: Any, *, choices: tuple[str, ...] | None = None,
             hint: str = "", none_ok: bool = False,
             error: type[Exception] = ValueError) -> str | None:
    """A non-empty string (one of ``choices`` if given)."""
    if value is None and none_ok:
        return None
    if isinstance(value, str) and value and (choices is None or value in choices):
        return value
    if choices is not None:
        import difflib

        # str() of an integer past 4300 digits raises; only text gets a suggestion.
        close = difflib.get_close_matches(value[:100], choices, n=1) \
            if isinstance(value, str) else []
        if not close and isinstance(value, str):
            close = [c for c in choices if c.lower() == value.lower()]
        mean = f" Did you mean {close[0]!r}?" if close else ""
        raise error(f"{_lead(where)} be one of {', '.join(choices)}; got {describe(value)}."
                    f"{mean}")
    raise error(f"{_lead(where)} be a non-empty string{hint}; got {describe(value)}.")


def read_port(where: str, value: Any, *, error: type[Exception] = ValueError) -> int:
    """A TCP port, 1-65535."""
    return read_int(where, value, 1, 65535, example=29500, error=error)  # type: ignore[return-value]
