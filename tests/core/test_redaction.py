"""Which option and query parameter names redaction hides (tierkv.redaction): secrets by
their words, separators and case aside (``pass_word``, ``apiKey``, ``accessKeyId`` were
shown), erring on the side of hiding (``max_tokens`` too), and nothing hidden before shown
now. Where it is used (/status, error messages) is in tests/server/test_config.py and
test_http.py."""

from __future__ import annotations

import re
from urllib.parse import parse_qs, parse_qsl

import pytest

from tierkv.redaction import HIDDEN, redacted_options, redacted_url

# The names hidden before: any holding one of these (a substring, any case).
BEFORE = re.compile(r"secret|token|password|passwd|credential|access_key|api_key", re.I)
SECRETS = [
    "token", "auth_token", "access_token", "session_token", "refresh_token", "authToken",
    "X-Amz-Security-Token", "authtoken", "api_tokens", "tokens", "new_token", "token_value",
    "max_auth_token", "ToKen", "password", "Ssl_Password", "dbPassword", "redispassword",
    "PASSword", "pass_word", "passwd", "password_file", "secret", "client_secret",
    "secretKey", "secret_access_key", "aws_secret_access_key", "access_key_id",
    "AWS_ACCESS_KEY_ID", "accessKeyId", "accesskey", "api_key", "apiKey", "API-KEY",
    "x_api_key", "credential", "credentials", "credentials_file", "credential_process",
    # Unicode matched case-insensitively, as the plain match did: a long s, the Kelvin
    # sign, a capital I with a dot.
    "\u017fecret", "pa\u017f\u017fword", "api_\u212aey", "credent\u0130al",
]  # fmt: skip
# The model's tokens (a count, a tokenizer): hidden, on purpose (module doc).
MODEL_TOKENS = ["max_tokens", "maxTokens", "chunk_tokens", "tokens_per_chunk", "tokenizer"]
OTHERS = ["url", "bucket", "region", "username", "user", "db", "key_prefix", "path", "keys"]


@pytest.mark.parametrize("name", SECRETS + MODEL_TOKENS)
def test_a_secrets_name_hides_it(name: str) -> None:
    assert redacted_options({name: "S3cr3t"}) == {name: HIDDEN}
    assert redacted_url(f"redis://h/0?db=1&{name}=S3cr3t") == f"redis://h/0?db=1&{name}={HIDDEN}"


@pytest.mark.parametrize("name", OTHERS)
def test_other_names_are_shown(name: str) -> None:
    assert redacted_options({name: 4096}) == {name: 4096}
    assert redacted_url(f"redis://h/0?{name}=4096") == f"redis://h/0?{name}=4096"


def test_nothing_hidden_before_is_shown() -> None:
    """Whatever the substring match hid stays hidden (and more is hidden: ``pass_word``,
    ``apiKey``, ``accessKeyId``, which it showed)."""
    for name in SECRETS + MODEL_TOKENS + OTHERS:
        if BEFORE.search(name):
            assert redacted_options({name: "v"})[name] == HIDDEN, name
    for name in ("pass_word", "apiKey", "accessKeyId"):
        assert not BEFORE.search(name) and redacted_options({name: "v"})[name] == HIDDEN


def test_semicolons_separate_no_parameter_for_the_urls_readers() -> None:
    """Redaction takes a query apart at ``&`` only: neither urllib (Python 3.10 and later)
    nor redis-py reads a parameter after a ``;`` (see tierkv.redaction's doc). Were that
    to change, a password there would be used and shown."""
    assert parse_qsl("db=0;password=x") == [("db", "0;password=x")]
    assert parse_qs("client_name=a;password=x") == {"client_name": ["a;password=x"]}
    connection = pytest.importorskip("redis.connection")
    parsed = connection.parse_url("redis://h/0?client_name=a;password=x")
    assert "password" not in parsed and parsed["client_name"] == "a;password=x"
    with pytest.raises(ValueError):
        connection.parse_url("redis://h/0?db=0;password=x")  # ("0;password=x" is no db)
