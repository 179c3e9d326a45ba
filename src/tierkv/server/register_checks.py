"""What a REGISTER request must satisfy before a client is registered: pure checks.

:func:`check_register` refuses, with a :class:`~tierkv.server.errors.RequestError` that says
why, a client of another protocol version, a role other than worker or scheduler, a
scheduler without an engine id, names and salts too long or malformed (a name, engine id or
model holding a control character or line break: the server logs them), a rank outside its
world size, a missing model, and (for a worker) a chunk layout this server cannot hold
(:func:`check_layout`: a dtype it does not know, a bad shape or token axis, a chunk of other
than the agreed number of tokens, a chunk larger than the pool), and one whose auth token is
not the server's (the service compares it).
"""

from __future__ import annotations

import math
import re

from tierkv import __version__, dtypes, keys
from tierkv import protocol as p
from tierkv.server.errors import RequestError
from tierkv.tenants import salt_error

MAX_NAME = 256  # characters of a client name or engine id
MAX_MODEL = 1024  # characters of a model identity or tenant salt
# What a logged name may not hold: C0 and C1 controls and Unicode's line breaks.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def check_register(req: p.Register, *, authorized: bool, chunk_size: int, capacity: int) -> int:
    """Check ``req`` (``authorized``: its auth token is the server's) for a server of
    ``chunk_size`` tokens a chunk and a pool of ``capacity`` bytes; the bytes of one of the
    client's chunks (0 for a scheduler, which moves none). The protocol version comes first,
    so that an older client learns to upgrade whatever else is wrong."""
    if req.protocol != p.PROTOCOL_VERSION:
        raise RequestError(
            p.ErrorCode.VERSION,
            f"client speaks protocol {req.protocol}, server {__version__} speaks "
            f"{p.PROTOCOL_VERSION}: upgrade the older side",
        )
    if not authorized:
        raise RequestError(p.ErrorCode.UNAUTHORIZED, "wrong or missing auth token")
    if req.role not in (p.ROLE_WORKER, p.ROLE_SCHEDULER):
        raise RequestError(
            p.ErrorCode.BAD_REQUEST, f"role must be 'worker' or 'scheduler', not {req.role!r}"
        )
    scheduler = req.role == p.ROLE_SCHEDULER
    if scheduler and not req.engine_id:
        raise RequestError(p.ErrorCode.BAD_REQUEST, "a scheduler client needs an engine_id")
    for what, value, limit in (
        ("engine_id", req.engine_id, MAX_NAME),
        ("name", req.name, MAX_NAME),
        ("model", req.model, MAX_MODEL),
        ("tenant_salt", req.tenant_salt, MAX_MODEL),
    ):
        if len(value) > limit:
            raise RequestError(p.ErrorCode.BAD_REQUEST, f"{what} is longer than {limit}")
        if what != "tenant_salt" and _CONTROL.search(value):
            # (the server logs these: a line break in one wrote log lines of the client's)
            raise RequestError(
                p.ErrorCode.BAD_REQUEST, f"{what} holds a control character or line break"
            )
    if why := salt_error("tenant_salt", req.tenant_salt):
        raise RequestError(p.ErrorCode.BAD_REQUEST, why)
    chunk_bytes = (
        0 if scheduler else check_layout(req.layout, req.chunk_tokens, chunk_size, capacity)
    )
    if req.world_size < 1 or not 0 <= req.rank < req.world_size:
        raise RequestError(
            p.ErrorCode.BAD_REQUEST, f"rank {req.rank} outside world size {req.world_size}"
        )
    if not req.model:
        raise RequestError(p.ErrorCode.BAD_REQUEST, "model must name the model")
    return chunk_bytes


def check_layout(layout: p.Layout, chunk_tokens: int, chunk_size: int, capacity: int) -> int:
    """The bytes of one chunk of ``layout`` (``chunk_tokens`` the client's own tokens per
    chunk, 0: the server's ``chunk_size``), if a pool of ``capacity`` bytes can hold it."""
    itemsize = dtypes.itemsize(layout.dtype)
    if not itemsize:
        raise RequestError(
            p.ErrorCode.BAD_REQUEST,
            f"unknown or unsupported dtype {layout.dtype!r}: use a numeric dtype such as "
            "float16, bfloat16, float32, int8 or float8_e4m3fn",
        )
    if not layout.shape or any(d <= 0 for d in layout.shape) or len(layout.shape) > 8:
        raise RequestError(p.ErrorCode.BAD_REQUEST, f"bad chunk shape {layout.shape}")
    if not 0 <= layout.token_axis < len(layout.shape):
        raise RequestError(p.ErrorCode.BAD_REQUEST, f"token_axis {layout.token_axis} out of range")
    tokens = layout.shape[layout.token_axis]
    if chunk_tokens < 0 or chunk_tokens > keys.MAX_CHUNK_TOKENS:
        raise RequestError(
            p.ErrorCode.BAD_REQUEST, f"chunk_tokens must be in 0..{keys.MAX_CHUNK_TOKENS}"
        )
    expected = chunk_tokens or chunk_size
    if tokens != expected:
        what = "the client's chunk_tokens" if chunk_tokens else "this server's chunk size"
        raise RequestError(
            p.ErrorCode.BAD_REQUEST,
            f"chunk shape {layout.shape} has {tokens} tokens on axis "
            f"{layout.token_axis}; {what} is {expected}",
        )
    chunk_bytes = math.prod(layout.shape) * itemsize
    if chunk_bytes > capacity:
        raise RequestError(
            p.ErrorCode.BAD_REQUEST,
            f"one chunk is {chunk_bytes} bytes, larger than the pool ({capacity})",
        )
    return chunk_bytes
