"""What a REGISTER must satisfy (server/register_checks.py), as pure checks: each bad field
gets its error code and a message naming it; a good worker gets its chunk's bytes."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from tierkv import protocol as p
from tierkv.server.errors import RequestError
from tierkv.server.register_checks import MAX_MODEL, MAX_NAME, check_register
from tierkv.tenants import RESERVED

CHUNK, CAPACITY = 256, 64 << 20
LAYOUT = p.Layout([2, 4, CHUNK, 64], "float16", token_axis=2)


def register(**fields: Any) -> p.Register:
    base = p.Register(1, p.PROTOCOL_VERSION, "model", LAYOUT)
    return msgspec.structs.replace(base, **fields)


def check(req: p.Register, authorized: bool = True) -> int:
    return check_register(req, authorized=authorized, chunk_size=CHUNK, capacity=CAPACITY)


def test_a_good_worker_gets_its_chunk_bytes_and_a_scheduler_none() -> None:
    assert check(register()) == 2 * 4 * CHUNK * 64 * 2
    scheduler = register(role=p.ROLE_SCHEDULER, engine_id="e", layout=p.Layout([1], "uint8"))
    assert check(scheduler) == 0  # a scheduler's layout is not looked at
    own = register(layout=p.Layout([16, 8], "bfloat16"), chunk_tokens=16)
    assert check(own) == 16 * 8 * 2  # its own tokens per chunk


@pytest.mark.parametrize(
    ("fields", "authorized", "code", "message"),
    [
        ({"protocol": 0}, False, p.ErrorCode.VERSION, "upgrade the older side"),
        ({}, False, p.ErrorCode.UNAUTHORIZED, "auth token"),
        ({"role": "admin"}, True, p.ErrorCode.BAD_REQUEST, "role must be"),
        ({"role": p.ROLE_SCHEDULER}, True, p.ErrorCode.BAD_REQUEST, "needs an engine_id"),
        ({"name": "n" * (MAX_NAME + 1)}, True, p.ErrorCode.BAD_REQUEST, "name is longer"),
        ({"model": "m" * (MAX_MODEL + 1)}, True, p.ErrorCode.BAD_REQUEST, "model is longer"),
        ({"tenant_salt": sorted(RESERVED)[0]}, True, p.ErrorCode.BAD_REQUEST, "reserved"),
        ({"rank": 2, "world_size": 2}, True, p.ErrorCode.BAD_REQUEST, "outside world size"),
        ({"world_size": 0}, True, p.ErrorCode.BAD_REQUEST, "outside world size"),
        ({"model": ""}, True, p.ErrorCode.BAD_REQUEST, "must name the model"),
        # Logged by the server: a line break wrote log lines of the client's choosing.
        ({"name": "e\n2026-01-01 WARNING x"}, True, p.ErrorCode.BAD_REQUEST, "name holds a"),
        ({"model": "m\r"}, True, p.ErrorCode.BAD_REQUEST, "model holds a control"),
        ({"engine_id": "e\u2028"}, True, p.ErrorCode.BAD_REQUEST, "engine_id holds a"),
        ({"name": "e\x1b[31m"}, True, p.ErrorCode.BAD_REQUEST, "name holds a"),
        ({"layout": p.Layout([4, CHUNK], "object")}, True, p.ErrorCode.BAD_REQUEST, "dtype"),
        ({"layout": p.Layout([0, CHUNK], "int8")}, True, p.ErrorCode.BAD_REQUEST, "bad chunk"),
        ({"layout": p.Layout([CHUNK], "int8", 1)}, True, p.ErrorCode.BAD_REQUEST, "token_axis"),
        ({"layout": p.Layout([CHUNK - 1], "int8")}, True, p.ErrorCode.BAD_REQUEST, "chunk size"),
        ({"chunk_tokens": -1}, True, p.ErrorCode.BAD_REQUEST, "chunk_tokens must be"),
        ({"layout": p.Layout([CHUNK, CAPACITY], "int8")}, True, p.ErrorCode.BAD_REQUEST, "pool"),
    ],
)
def test_each_bad_field_is_refused_with_its_reason(
    fields: dict[str, Any], authorized: bool, code: p.ErrorCode, message: str
) -> None:
    with pytest.raises(RequestError, match=message) as raised:
        check(register(**fields), authorized)
    assert raised.value.code == code
