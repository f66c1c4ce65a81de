"""The errors meant for the user, and how their messages show a value.

A leaf module (it imports nothing from tessera), so that every module can raise
:class:`ConfigError` without importing the configuration it checks, and derive its own error
for the user from :class:`UserError`.
"""

from __future__ import annotations

import sys
from typing import Any

SHOWN_CHARS = 200
"""A value longer than this is cut in an error message, which stays one readable line."""


def shown(value: Any) -> str:
    """`value` as an error message shows it: its repr, an integer beyond 2^100 (31 digits) by its
    digit count (Python refuses to print one of more than 4300), long text cut."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 100:
        try:
            digits = str(len(str(abs(value))))
        except ValueError:  # beyond sys.get_int_max_str_digits()
            digits = f"more than {sys.get_int_max_str_digits()}"
        return f"<integer of {digits} digits>"
    text = repr(value)
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS] + "..."


class Verbatim(str):
    """A value an error message shows as it is, without quotes (a description of a value that
    cannot be shown itself)."""

    def __repr__(self) -> str:
        return str(self)


class UserError(ValueError):
    """Bad input from the user (a config value, a path, a checkpoint, a schedule): its message
    is one line, which the command line prints as ``error: <message>`` with exit status 2 and
    no traceback."""


class ConfigError(UserError):
    """A configuration value breaks a rule. The message is one line meant for the user:
    ``field=value: rule``."""

    def __init__(self, field_name: str, value: Any, rule: str):
        self.field_name, self.value, self.rule = field_name, value, rule
        super().__init__(f"{field_name}={shown(value)}: {rule}")


def require(ok: bool, field_name: str, value: Any, rule: str) -> None:
    """Raise ConfigError(field_name, value, rule) unless `ok`."""
    if not ok:
        raise ConfigError(field_name, value, rule)


NAME_MAX, PATH_MAX = 255, 4096
"""Linux's limits on one path component and a whole path, in bytes (POSIX's NAME_MAX and
PATH_MAX): a longer path fails in the kernel (ENAMETOOLONG) wherever it is first used."""


def check_path(field_name: str, value: str) -> None:
    """A path the run will open or create: no NUL byte, no component over NAME_MAX bytes, at
    most PATH_MAX bytes in all (ConfigError naming the field)."""
    if not isinstance(value, str):
        return  # the field's type check names it
    if "\0" in value:
        raise ConfigError(field_name, value, "must not contain a NUL byte")
    encoded = value.encode("utf-8", "surrogateescape")
    require(len(encoded) <= PATH_MAX, field_name, value,
             f"a path of {len(encoded)} bytes; this system takes at most {PATH_MAX}")
    longest = max((len(part) for part in encoded.split(b"/")), default=0)
    require(longest <= NAME_MAX, field_name, value,
             f"a path component of {longest} bytes; this system takes at most {NAME_MAX}")
