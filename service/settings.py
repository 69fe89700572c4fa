"""What a setting is: its declaration (default, one line of help, unit, allowed words),
how a value is read from a TOML file or from text (the environment, flags), how it is
written back for a person, and what is wrong with it. tiercache_service.config declares the
daemon's settings with it; nothing here knows which settings there are."""

from __future__ import annotations

import difflib
import json
import math
import re
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

from tiercache.errors import InvalidArgument

_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "kib": 1 << 10, "m": 1e6, "mb": 1e6, "mib": 1 << 20,
          "g": 1e9, "gb": 1e9, "gib": 1 << 30, "t": 1e12, "tb": 1e12, "tib": 1 << 40}
BYTES, SECONDS = "bytes", "seconds"  # the units the readers treat specially


def parse_bytes(value: Any) -> int:
    """1048576, "1MiB", "1.5 GB" -> bytes."""
    if isinstance(value, int):
        return value
    found = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", str(value))
    if not found or found.group(2).lower() not in _UNITS:
        raise InvalidArgument(f"{value!r} is not a size: write e.g. 4GiB, 512MiB or 1048576")
    return int(float(found.group(1)) * _UNITS[found.group(2).lower()])


def size_text(n: int) -> str:
    """1073741824 -> "1GiB", 64 -> "64": how a size is best written."""
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


def setting(default: Any, help: str, unit: str = "", choices: tuple[str, ...] = (),
            positive: bool = False) -> Any:
    """A declared setting: its default, one line of help, the unit of a number (BYTES
    also reads 4GiB or 512MiB), the words a text setting allows (its default is allowed
    too), and whether 0 is refused (every number must be finite and 0 or more)."""
    return field(default=default, metadata={"help": help, "unit": unit, "choices": choices,
                                            "positive": positive})


_MAX_SECONDS = 86_400
_KINDS = {"int": int, "float": float, "bool": bool, "str": str}
_WORDS = {int: "a whole number", float: "a number", bool: "true or false", str: "text"}
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


@dataclass(frozen=True)
class Setting:
    """One declared setting, as the flags, the file, the environment and the docs see it."""

    name: str
    kind: type  # int, float, bool or str
    default: Any
    help: str
    unit: str
    choices: tuple[str, ...]
    positive: bool

    @property
    def env(self) -> str:
        return "TIERCACHE_" + self.name.upper()

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def what(self) -> str:
        """What a value is: "a size (bytes: 4GiB, 512MiB or 1048576)", "one of lru, flop"."""
        if self.unit == BYTES:
            return "a size (bytes: 4GiB, 512MiB or 1048576)"
        if self.choices:
            return "one of " + ", ".join(self.choices)
        return _WORDS[self.kind] + (f" ({self.unit})" if self.unit else "")

    def text(self, value: Any) -> str:
        """A value as a person writes it: 1GiB, true, 10, ""."""
        if self.unit == BYTES:
            return size_text(value)
        if self.kind is bool:
            return "true" if value else "false"
        if self.kind is float:
            return f"{value:g}"
        return str(value) if value != "" else '""'

    def read(self, raw: Any) -> Any:
        """A value from the file (typed by TOML) or from text (the environment, flags), in
        this setting's type; ValueError says what it is instead."""
        if isinstance(raw, str) and self.kind is not str:
            return self._read_text(raw.strip())
        exact = {int: type(raw) is int, float: type(raw) in (int, float),
                 bool: type(raw) is bool, str: type(raw) is str}[self.kind]
        if not exact:
            raise ValueError(f"is {_toml_what(raw)}, not {self.what}")
        value = self.kind(raw)
        if self.choices and value not in self.choices and value != self.default:
            folded = {c.lower(): c for c in self.choices}
            value = folded.get(value.lower(), value)  # INFO, LRU: a choice in capitals
        return value

    def _read_text(self, raw: str) -> Any:
        try:
            if self.unit == BYTES:
                return parse_bytes(raw)
            if self.kind is bool and raw.lower() in _TRUE + _FALSE:
                return raw.lower() in _TRUE
            if self.kind is not bool:
                return self.kind(raw)
        except (ValueError, InvalidArgument):
            pass
        raise ValueError(f"is not {self.what}")

    def problem(self, value: Any) -> str | None:
        """What is wrong with a value of the right type, naming the setting; None if fine."""
        if self.choices and value not in self.choices and value != self.default:
            return f"{self.name} must be {self.what}"
        if self.kind not in (int, float):
            return None
        if not math.isfinite(value):
            return f"{self.name} must be a finite number"
        if self.positive and value <= 0:
            return f"{self.name} must be positive"
        if value < 0:
            return f"{self.name} must be 0 or more"
        if self.unit == SECONDS and value > _MAX_SECONDS:
            return f"{self.name} is over a day: give at most {_MAX_SECONDS}"
        return None


def declared(config: type) -> tuple[Setting, ...]:
    """The settings of a dataclass whose fields were declared with `setting`."""
    return tuple(Setting(f.name, _KINDS[f.type], f.default, **f.metadata) for f in fields(config))


def _toml_what(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    kinds = ((int, "a whole number"), (float, "a number"), (str, "text"), (list, "a list"),
             (dict, "a table"))
    return next((word for kind, word in kinds if isinstance(value, kind)), "a date or time")


def toml_text(value: Any) -> str:
    """A value as TOML writes it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml_text(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {toml_text(v)}" for k, v in value.items()) + "}"
    return str(value)


@dataclass(frozen=True)
class Source:
    """Where values come from, to name it in errors: a TOML file (`path`), the
    environment or the command line."""

    kind: str  # file, environment or flags
    path: str = ""

    def given(self, s: Setting, raw: Any) -> str:
        """What was written: `FILE: max_workers = true`, `TIERCACHE_X='y'`, `--x 'y'`."""
        if self.kind == "file":
            return f"{self.path}: {s.name} = {toml_text(raw)}"
        return f"{s.env}={raw!r}" if self.kind == "environment" else f"{s.flag} {raw!r}"

    def example(self, s: Setting) -> str:
        """A value that fits, as it is written here: the default, or the first choice."""
        value = s.choices[0] if s.choices and not s.default else s.default
        if self.kind == "file":
            return f"{s.name} = {toml_text(s.text(value) if s.unit == BYTES else value)}"
        if self.kind == "environment":
            return f"{s.env}={s.text(value)}"
        if s.kind is bool:
            return s.flag if value else "--no-" + s.flag.removeprefix("--")
        return f"{s.flag} {s.text(value)}"

    def values(self, given: Mapping[str, Any], settings: Mapping[str, Setting]) -> dict[str, Any]:
        """`given` (setting name -> what was written) read and checked, one at a time."""
        values = {}
        for name, raw in given.items():
            s = settings.get(name)
            if s is None:
                close = difflib.get_close_matches(name, settings, n=1)
                hint = f" (did you mean {close[0]}?)" if close else ""
                raise InvalidArgument(f"{self.path or self.kind}: {name} is not a setting{hint}: "
                                      "tiercache serve --help lists them")
            try:
                value = s.read(raw)
            except ValueError as error:  # of the wrong kind
                raise InvalidArgument(f"{self.given(s, raw)} {error}: "
                                      f"write e.g. {self.example(s)}") from None
            problem = s.problem(value)
            if problem:  # of the right kind, out of range
                raise InvalidArgument(f"{self.given(s, raw)}: {problem}: "
                                      f"write e.g. {self.example(s)}")
            values[name] = value
        return values
