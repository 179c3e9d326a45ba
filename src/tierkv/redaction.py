"""Secrets kept out of what the server shows: /status's configuration, logs, error messages.

Tier options carry credentials (an S3 secret key, a Redis password inside its URL); /status
is readable without a token. Options whose name says they are a secret are replaced whole,
and a URL keeps everything but its userinfo and the values of query parameters named as
secrets (redis-py takes ``?password=`` as the password).
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import unquote, urlsplit

HIDDEN = "***"
_DROPPED = str.maketrans("", "", "\t\r\n")
# Option names that hold a secret (or half of a credential pair).
SECRET_NAME = re.compile(r"secret|token|password|passwd|credential|access_key|api_key", re.I)


def redacted_url(url: str) -> str:
    """``url`` with its userinfo (user, password, or a token in their place) and the values
    of its secret query parameters hidden."""
    # Tabs and line breaks are dropped by URL parsers (redis-py's too): a secret's name
    # holding one would be used, and shown.
    url = url.translate(_DROPPED)
    try:
        parts = urlsplit(url)
    except ValueError:
        return HIDDEN  # not a URL it can take apart: show none of it
    # Taken apart as text, not put together by urlunsplit (it rewrites "unix:///path").
    head, mark, tail = url.partition("?")
    if "@" in parts.netloc:
        head = head.replace(parts.netloc, f"{HIDDEN}@{parts.netloc.rpartition('@')[2]}", 1)
    if mark:
        query, hash_mark, fragment = tail.partition("#")
        query = "&".join(_redacted_parameter(p) for p in query.split("&"))
        tail = query + hash_mark + fragment
    return head + mark + tail


def _redacted_parameter(parameter: str) -> str:
    name, equals, value = parameter.partition("=")
    return (
        f"{name}={HIDDEN}" if equals and value and SECRET_NAME.search(unquote(name)) else parameter
    )


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
