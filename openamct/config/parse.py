"""Read a retrain config (.cfg, protobuf text format) into an AMCTRetrainConfig message.

The first step of the config path (parse -> validate -> plan): text in, message out, with the
repeat check (``repeats``) and protobuf's required fields; nothing here knows the model."""

from __future__ import annotations

import os
import re

from google.protobuf import text_format

from openamct.config.errors import ConfigError, locate
from openamct.config.repeats import check_repeats
from openamct.config.retrain_config_pb2 import AMCTRetrainConfig

__all__ = ["ConfigError", "load_config", "locate", "parse_config_bytes", "parse_config_text", "read_config_file"]


def read_config_file(path: str, arg: str) -> bytes:
    """The bytes of a config file; the one place a config path is checked."""
    if not isinstance(path, str):
        raise TypeError(f"{arg} must be a str path, got {type(path).__name__}")
    if not os.path.isfile(path):
        raise ConfigError(f"{arg} {path!r} does not exist or is not a file")
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise ConfigError(f"{arg} {path!r} cannot be read: {exc}") from None


def parse_config_bytes(raw: bytes, where: str) -> tuple[AMCTRetrainConfig, str]:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{where} is not UTF-8 text (byte {exc.start}): save it as UTF-8") from None
    return parse_config_text(text, where), text


def load_config(path: str, arg: str = "config_defination") -> tuple[AMCTRetrainConfig, str]:
    """Parse ``path``; returns (message, text). Errors are ConfigError (a ValueError)."""
    return parse_config_bytes(read_config_file(path, arg), f"{arg} {path!r}")


def parse_config_text(text: str, where: str = "config") -> AMCTRetrainConfig:
    msg = AMCTRetrainConfig()
    try:
        # Merge, not Parse: upstream's sample configs write one layer_name twice in an override
        # block, which Parse refuses; check_repeats below refuses the repeats that change something.
        text_format.Merge(text, msg)
    except text_format.ParseError as exc:
        line, col = getattr(exc, "GetLine", lambda: None)(), getattr(exc, "GetColumn", lambda: None)()
        detail = str(exc)
        if line is not None and not detail.startswith(f"{line}:"):
            detail = f"{line}:{col}: {detail}"
        raise ConfigError(f"{where}: line {detail}") from None
    except (ValueError, OverflowError, RecursionError) as exc:
        raise ConfigError(f"{where}: {type(exc).__name__}: {exc}") from None
    check_repeats(text, msg.DESCRIPTOR, where)
    missing = msg.FindInitializationErrors()
    if missing:
        first = missing[0]
        leaf = first.split(".")[-1]
        parent = re.sub(r"\[\d+\]", "", first.split(".")[-2]) if "." in first else first
        raise ConfigError(f"{where}: {locate(text, parent)}required field {leaf!r} is missing "
                          f"(in {first.rsplit('.', 1)[0] if '.' in first else 'the top level'})")
    return msg
