"""EBBTIDE_* settings, read through the core's one table (cpp/src/util/settings.cpp).

An argument given by the caller wins and is checked against the row of the
setting it backs; otherwise the environment variable is parsed by the core;
otherwise the caller's default applies. Errors are ValueError naming the
argument or the variable and the value."""
from typing import Any, Optional

from ebbtide import _core


def resolve(name: str, argument: Any, what: str) -> Optional[Any]:
    """`argument` checked as setting `name` (errors name `what`), or the
    variable's value when `argument` is None, or None when that is unset."""
    if argument is not None:
        return _core.check_setting(name, argument, what)
    return _core.env_setting(name)


def table() -> list:
    """Every setting with its kind, default and meaning, in documentation order."""
    return list(_core.settings())
