"""Plain-dict views of the record classes of ``ebbtide._core`` (the plan types
bound in python/src/bind_plan.cpp): a record lists its fields in ``_fields``
and, when it is an input, the fields that can be set in ``_settings``."""
from __future__ import annotations

from typing import Any, Callable, Mapping

__all__ = ["as_dict", "make"]

_KINDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def as_dict(value: Any) -> Any:
    """``value`` with each record in it turned into a dict of its ``_fields`` (in
    order), lists element by element; anything else as it is."""
    fields = getattr(value, "_fields", None)
    if fields is not None:
        return {name: as_dict(getattr(value, name)) for name in fields}
    if isinstance(value, list):
        return [as_dict(v) for v in value]
    return value


def _fits(value: Any, kind: type) -> bool:
    if kind is bool:
        return isinstance(value, int)  # True, False, or an int read as one
    if kind in (int, float) and isinstance(value, bool):
        return False
    return isinstance(value, (int, float) if kind is float else kind)


def make(cls: type, settings: Mapping[str, Any], what: str,
         aliases: Mapping[str, Callable[[Any], tuple[str, Any]]] | None = None) -> Any:
    """A new ``cls`` record with ``settings`` applied in order.

    Args:
        cls: a record class of ``ebbtide._core``.
        settings: field name -> value; None keeps the default.
        what: names the settings in messages ("model": "model setting 'x' ...").
        aliases: extra names, each mapped by its function to (field, value).

    Returns:
        The record.

    Raises:
        ValueError: an unknown name, a value of the wrong type, or one the core
            rejects; the message names the setting and the value.
    """
    aliases = aliases or {}
    record = cls()
    for name, value in settings.items():
        if value is None:
            continue
        if name in aliases:
            name, value = aliases[name](value)
        elif name not in cls._settings:
            valid = ", ".join(cls._settings + tuple(aliases))
            raise ValueError(f"unknown {what} setting {name!r} (valid: {valid})")
        kind = type(getattr(record, name))
        if not _fits(value, kind):
            raise ValueError(f"{what} setting {name!r} must be {_KINDS[kind]}, got {value!r}")
        try:
            setattr(record, name, kind(value))
        except TypeError:  # an integer the field cannot hold: negative (unsigned) or too large
            bound = ">= 0" if value < 0 else "smaller"
            raise ValueError(f"{what} setting {name!r} must be {bound}, got {value!r}") from None
    return record
