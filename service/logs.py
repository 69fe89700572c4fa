"""The daemon's log lines: text for people, or JSON (one object a line) for collectors.
Every line logged while a call runs carries that call's request id, taken from the
client's `x-request-id` metadata or made up here, so one request can be followed
through the log."""

from __future__ import annotations

import contextvars
import dataclasses
import itertools
import json
import logging
import re
import secrets
import sys
import time
from typing import Any, Iterable

REQUEST_ID_HEADER = "x-request-id"
REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)
_GOOD_ID = re.compile(r"[A-Za-z0-9._:/+=-]{1,128}")  # what a client may choose: it goes into logs
_SECRET = re.compile(r"key|token|secret|password|credential", re.IGNORECASE)


# a new id: this process's random half, then a count (a random id per call read the
# kernel's random source every call: 10-15 us on the 2-core machine, the GIL let go)
_OWN_HALF = secrets.token_hex(4)
_COUNT = itertools.count(secrets.randbelow(1 << 32))


def request_id(metadata: Iterable[tuple[str, Any]] | None) -> str:
    """The client's request id, if it sent a sane one, else a new one (16 hex digits)."""
    for name, value in metadata or ():
        if name == REQUEST_ID_HEADER and isinstance(value, str) and _GOOD_ID.fullmatch(value):
            return value
    return f"{_OWN_HALF}{next(_COUNT) & 0xFFFFFFFF:08x}"


class _RequestId(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = REQUEST_ID.get()
        return True


class TextFormatter(logging.Formatter):
    """`time LEVEL logger: message key=value ... request_id=...`"""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = dict(getattr(record, "data", {}))
        if getattr(record, "request_id", None):
            fields["request_id"] = record.request_id
        extra = " ".join(f"{k}={_text(v)}" for k, v in fields.items())
        if not extra:
            return line
        head, newline, trace = line.partition("\n")  # keep a traceback below the fields
        return f"{head} {extra}{newline}{trace}"


def _text(value: Any) -> str:
    if isinstance(value, dict):
        return "{" + " ".join(f"{k}={_text(v)}" for k, v in value.items()) + "}"
    return str(value)


class JsonFormatter(logging.Formatter):
    """One JSON object a line: time, level, logger, message, request_id, the record's
    `data`, and the exception's traceback if any."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
                    + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(), "logger": record.name,
            "message": record.getMessage()}
        if getattr(record, "request_id", None):
            entry["request_id"] = record.request_id
        entry.update(getattr(record, "data", {}))
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


class _Unparsable(logging.Filter):
    """grpc logs each request it cannot parse at ERROR with a traceback (before any handler
    of ours runs, and it answers INTERNAL): a client sending garbage would flood the log.
    One WARNING line each instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.getMessage().startswith("Exception deserializing") and record.exc_info:
            error = record.exc_info[1]
            record.msg, record.args = f"a request could not be parsed (answered INTERNAL): {error}", ()
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            record.exc_info = record.exc_text = None
        return True


def setup(log_format: str, level: str) -> None:
    """Send every logger's lines to stderr in `log_format`: once, in the entry point."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    handler.addFilter(_RequestId())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    logging.getLogger("grpc._common").addFilter(_Unparsable())


def redacted(config: Any) -> dict[str, Any]:
    """A dataclass config as a dict for the log, settings that hold secrets masked."""
    return {k: ("***" if _SECRET.search(k) and v else v)
            for k, v in dataclasses.asdict(config).items()}
