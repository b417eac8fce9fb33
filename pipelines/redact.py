"""Keep secrets out of everything the tool writes: MLflow params and tags, summary.json, logs.

A value is masked when its key looks secret (TOKEN, KEY, SECRET, PASSWORD, CREDENTIAL), when it
assigns such a name inside a string (`export HF_TOKEN=...`), or when it is a URI with credentials
(`https://user:pass@host` keeps the host, not the user and password).
"""

from __future__ import annotations

import re
from typing import Any

MASK = "***"
SECRET_NAME = re.compile(r"(token|secret|passw(or)?d|credential|api[_-]?key|(^|[_.-])key$)", re.IGNORECASE)
ASSIGNMENT = re.compile(r"\b(\w*(?:TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|KEY)\w*)=(\S+)", re.IGNORECASE)
URI_CREDENTIALS = re.compile(r"([a-z][a-z0-9+.-]*://)[^/@\s:]+(:[^/@\s]*)?@", re.IGNORECASE)


def redact_text(text: str) -> str:
    """Mask credentials inside URIs and secret-looking assignments in free text."""
    text = URI_CREDENTIALS.sub(rf"\1{MASK}@", text)
    return ASSIGNMENT.sub(rf"\1={MASK}", text)


def redact(key: str, value: Any) -> Any:
    """`value` as it may be written under `key` (the last dotted component decides)."""
    if value is None:
        return None
    if SECRET_NAME.search(key.rsplit(".", 1)[-1]):
        return MASK
    return redact_text(value) if isinstance(value, str) else value


def redact_mapping(data: dict[str, Any]) -> dict[str, Any]:
    """Every value of a flat mapping, redacted by its key; list values element by element."""
    out = {}
    for key, value in data.items():
        if isinstance(value, list):
            out[key] = [redact(key, v) for v in value]
        else:
            out[key] = redact(key, value)
    return out


def redact_tree(data: Any, key: str = "") -> Any:
    """A nested config (dicts, lists, scalars), every value redacted by its own key."""
    if isinstance(data, dict):
        return {k: redact_tree(v, f"{key}.{k}" if key else str(k)) for k, v in data.items()}
    if isinstance(data, list):
        return [redact_tree(v, key) for v in data]
    return redact(key, data)


def redact_override(override: str) -> str:
    """`key=value` as typed on the command line, its value redacted by its key."""
    key, sep, value = override.partition("=")
    if not sep:
        return redact_text(override)
    masked = redact(key.lstrip("+~"), value)
    return f"{key}={masked}"
