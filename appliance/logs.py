"""Structured logs: one line per event, logfmt (`key=value`) or JSON, from one handler.

Callers attach fields with `extra={"fields": {...}}` (or the `log_event` helper), so a line
reads `ts=... level=info logger=appliance.cli msg="serving" model=x port=8000` and a log
shipper can index it without regexes. uvicorn's loggers are routed through the same handler.
Prompts and outputs never pass through here unless `server.log_prompts` is set; that
decision is made by the callers.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any, TextIO

_RESERVED = ("ts", "level", "logger", "msg")


def _logfmt_value(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    if text == "" or any(c in text for c in ' ="\\\n\t'):
        return json.dumps(text)
    return text


class StructuredFormatter(logging.Formatter):
    """Renders records as logfmt or JSON lines, with `fields` from `extra` appended."""

    def __init__(self, fmt: str = "logfmt"):
        super().__init__()
        self.json = fmt == "json"

    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        data: dict[str, Any] = {
            "ts": f"{ts}.{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            for k, v in fields.items():
                data[k if k not in _RESERVED else f"field_{k}"] = v
        if record.exc_info:
            data["exc"] = self.formatException(record.exc_info)
        if self.json:
            return json.dumps(data, default=str)
        return " ".join(f"{k}={_logfmt_value(v)}" for k, v in data.items())


def configure_logging(
    level: str = "info", fmt: str = "logfmt", stream: TextIO | None = None
) -> None:
    """Installs one structured handler on the root logger and routes uvicorn's loggers to it."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(StructuredFormatter(fmt))
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        lg = logging.getLogger(name)
        lg.handlers.clear()
        lg.propagate = True
    # Per-request lines come from the app's own access log (no prompts, with timings).
    logging.getLogger("uvicorn.access").setLevel(logging.WARNING)


def log_event(logger: logging.Logger, msg: str, level: int = logging.INFO, **fields: Any) -> None:
    """`log_event(log, "serving", port=8000)` -> `msg=serving port=8000`."""
    logger.log(level, msg, extra={"fields": fields})
