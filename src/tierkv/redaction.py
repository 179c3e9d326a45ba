"""Secrets kept out of what the server shows: /status's configuration, logs, error messages.

Tier options carry credentials (an S3 secret key, a Redis password inside its URL); /status
is readable without a token. Options whose name says they are a secret are replaced whole,
and a URL keeps everything but its userinfo and the values of query parameters named as
secrets (redis-py takes ``?password=`` as the password).

A name says it is a secret (:func:`is_secret_name`) by its words, separators and case aside
(``dbPassword``, ``pass_word``, ``apiKey``, ``accessKeyId``, ``X-Amz-Security-Token``):
one holding ``secret``, ``token``, ``password``, ``passwd``, ``credential``, ``access_key``
or ``api_key``. It errs on the side of hiding: ``max_tokens`` is hidden too (a count of the
model's tokens; telling every such name from a credential's is guesswork, and a guess that
shows a secret is not worth a count shown).

Query parameters are taken apart at ``&`` only, as their readers do: redis-py reads its URL's
query with :func:`urllib.parse.parse_qs`, which splits at ``&`` only (since Python 3.10 and
3.9.2; ``separator=";"`` would have to be asked for), so in ``?db=0;password=x`` nothing
reads a password: ``0;password=x`` is the value of ``db`` (redis-py refuses it), and under
a name not a secret such a value is no secret to anything that reads it either.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import unquote, urlsplit

HIDDEN = "***"
_DROPPED = str.maketrans("", "", "\t\r\n")
# Words that make a name a secret's wherever they are in it (separators and case aside).
SECRET_WORDS = re.compile(r"secret|token|password|passwd|credential|access_?key|api_?key")
_SECRET_ANYWHERE = re.compile(SECRET_WORDS.pattern, re.IGNORECASE)
# A name's words: runs of letters or digits, split where camelCase starts a word.
_WORD = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|[0-9]+")


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


def is_secret_name(name: str) -> bool:
    """Whether an option or query parameter named ``name`` holds a secret (or half of a
    credential pair), by its words (see the module doc), or as a plain match in any case
    (Unicode's too: a long s for an s, a Kelvin sign for a k)."""
    words = "".join(w.lower() for w in _WORD.findall(name))
    return bool(SECRET_WORDS.search(words) or _SECRET_ANYWHERE.search(name))


def _redacted_parameter(parameter: str) -> str:
    name, equals, value = parameter.partition("=")
    return f"{name}={HIDDEN}" if equals and value and is_secret_name(unquote(name)) else parameter


def redacted_options(options: dict[str, Any]) -> dict[str, Any]:
    """A tier's (or any component's) options with secrets hidden: by name, and in URLs."""
    out: dict[str, Any] = {}
    for name, value in options.items():
        if is_secret_name(name) and value:
            out[name] = HIDDEN
        elif isinstance(value, str) and "://" in value:
            out[name] = redacted_url(value)
        else:
            out[name] = value
    return out
