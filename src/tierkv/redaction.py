"""Secrets kept out of what the server shows: /status's configuration, logs, error messages.

Tier options carry credentials (an S3 secret key, a Redis password inside its URL); /status
is readable without a token. Options whose name says they are a secret are replaced whole,
and a URL keeps everything but its userinfo.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import urlsplit

HIDDEN = "***"
# Option names that hold a secret (or half of a credential pair).
SECRET_NAME = re.compile(r"secret|token|password|passwd|credential|access_key|api_key", re.I)


def redacted_url(url: str) -> str:
    """``url`` with its userinfo (user, password, or a token in their place) hidden."""
    try:
        netloc = urlsplit(url).netloc
    except ValueError:
        return HIDDEN  # not a URL it can take apart: show none of it
    if "@" not in netloc:
        return url
    hidden = f"{HIDDEN}@{netloc.rpartition('@')[2]}"
    return url.replace(netloc, hidden, 1)


def redacted_options(options: dict[str, Any]) -> dict[str, Any]:
    """A tier's (or any component's) options with secrets hidden: by name, and in URLs."""
    out: dict[str, Any] = {}
    for name, value in options.items():
        if SECRET_NAME.search(name) and value:
            out[name] = HIDDEN
        elif isinstance(value, str) and "://" in value:
            out[name] = redacted_url(value)
        else:
            out[name] = value
    return out
