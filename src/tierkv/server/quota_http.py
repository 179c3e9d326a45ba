"""The ``/quota`` HTTP endpoints, in LMCache's shape so operators' scripts carry over.

- ``GET /quota``: the default limit, the mode, and every tenant with a quota or with
  chunks (tenants without a quota by tag only: their names are salts)
- ``GET /quota/config`` / ``PUT /quota/config``: the default pool limit (``{"default_limit":
  "unlimited" | bytes | "8GiB"}``, or LMCache-style ``{"default_limit_gb": x}``), the
  default of each tier (``{"default_limits": {"pool": ..., "disk": ...}}``) and the mode
  (``{"mode": "soft" | "hard"}``)
- ``PUT /quota/{tenant}``: ``{"limit_gb": x}`` (GiB) or ``{"limit": bytes | "8GiB"}`` set
  its pool limit, ``{"limits": {"pool": ..., "disk": ...}}`` the tiers named (null: back
  to the default); the tiers not named keep their limits
- ``GET /quota/{tenant}``: its limits (its own or the default's) and usage per tier
- ``DELETE /quota/{tenant}``: its quota removed in every tier (404 if it had none); it gets
  the defaults (``DELETE /quota/config`` is refused: that path is the configuration)

``{tenant}`` is the tenant's name (URL-encoded; it may contain ``/``): the salt, or
``~default`` for the chunks without any. A leading ``=`` is stripped, so ``/quota/=config``
names the tenant whose salt is ``config`` (and ``=`` + any name is that name). Writes pass
the server's usual authorization (token where the server has one, no foreign Origin);
bad values get a 400 with the reason.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from tierkv.priority import sharing_the_gil
from tierkv.server.engine_first import no_gate
from tierkv.server.quota_values import (
    GIB,
    UNLIMITED,
    QuotaError,
    check_name,
    parse_default,
    parse_gb,
    tenant_limits,
    tier_changes,
)
from tierkv.server.quotas import Quotas
from tierkv.web.requests import Authorizer, authorized_body, error_reply


def _json_body(body: bytes) -> Any:
    try:
        return json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise QuotaError(f"body is not valid JSON: {exc}") from None


def _name(raw: str) -> str:
    return check_name(raw[1:] if raw.startswith("=") else raw)


def _unlimited(value: Any) -> bool:
    return isinstance(value, str) and value.strip().lower() == UNLIMITED


def _config_change(doc: Any) -> tuple[dict[str, int | None], str]:
    """(default limit per tier changed, mode or "") from a PUT /quota/config body."""
    if not isinstance(doc, dict) or not doc:
        raise QuotaError(
            'body must be a JSON object such as {"default_limit": "unlimited"} or {"mode": "hard"}'
        )
    fields = ("default_limit", "default_limit_gb", "default_limits", "mode")
    unknown = sorted(set(doc) - set(fields))
    if unknown:
        raise QuotaError(f"unknown field(s) {unknown}; give {', '.join(map(repr, fields))}")
    if len([f for f in fields[:3] if f in doc]) > 1:
        raise QuotaError("give one of 'default_limit', 'default_limit_gb' or 'default_limits'")
    default: dict[str, int | None] = {}
    if "default_limit" in doc:
        default = {"pool": parse_default(doc["default_limit"])}
    elif "default_limit_gb" in doc:
        value = doc["default_limit_gb"]
        default = {"pool": None if value is None else parse_gb(value, "default_limit_gb")}
    elif "default_limits" in doc:
        limits = doc["default_limits"]
        if isinstance(limits, dict):  # "unlimited" where a size could be
            limits = {t: None if _unlimited(v) else v for t, v in limits.items()}
        default = tier_changes(limits, "default_limits")
    mode = doc.get("mode", "")
    if not isinstance(mode, str) or (mode and mode not in ("soft", "hard")):
        raise QuotaError(f"mode must be 'soft' or 'hard', not {mode!r}")
    return default, mode


NO_STORE = {"Cache-Control": "no-store"}


def _listing_json(quotas: Quotas, between: Callable[[], None]) -> bytes:
    """GET /quota's body, encoded a tenant at a time (one encoding of the whole document
    is a C call that holds the GIL throughout: milliseconds with thousands of tenants),
    with the check point ``between`` tenants."""
    doc = quotas.listing(between)
    rows = doc.pop("tenants")
    head = msgspec.json.encode(doc)[:-1]  # without its closing brace
    parts = []
    for row in rows:
        between()
        parts.append(msgspec.json.encode(row))
    return b"".join([head, b',"tenants":[', b",".join(parts), b"]}"])


def add_quota_routes(
    app: FastAPI, quotas: Quotas, authorize: Authorizer, wait_turn: Callable[[], None] = no_gate
) -> None:
    """Add the /quota endpoints to ``app`` (``wait_turn``: the check point of a listing,
    :mod:`tierkv.server.engine_first`)."""

    async def write(request: Request) -> Any:
        """The JSON body of an authorized write, or the reply to send instead."""
        body = await authorized_body(request, authorize)
        return body if isinstance(body, JSONResponse) else _json_body(body)

    @app.get("/quota")
    async def listing() -> Response:
        # Built and encoded off the event loop, a tenant at a time, with the short switch
        # interval, waiting between tenants while an engine's request is in flight.
        with sharing_the_gil():
            body = await run_in_threadpool(_listing_json, quotas, wait_turn)
        return Response(body, media_type="application/json", headers=NO_STORE)

    @app.get("/quota/config")
    def get_config() -> JSONResponse:
        return JSONResponse(quotas.config())

    @app.put("/quota/config")
    async def put_config(request: Request) -> JSONResponse:
        try:
            doc = await write(request)
            if isinstance(doc, JSONResponse):
                return doc
            default, mode = _config_change(doc)
            await run_in_threadpool(quotas.configure, default, mode)
        except QuotaError as exc:
            return error_reply(400, str(exc))
        return JSONResponse(quotas.config())

    @app.delete("/quota/config")
    def delete_config() -> JSONResponse:
        # As GET and PUT: the configuration, not a tenant named "config" (/quota/=config).
        return error_reply(
            405,
            "the quota configuration is not deleted: PUT /quota/config sets its defaults; "
            "the tenant named config is /quota/=config",
        )

    @app.get("/quota/{tenant:path}")
    def get_tenant(tenant: str) -> JSONResponse:
        try:
            name = _name(tenant)
        except QuotaError as exc:
            return error_reply(400, str(exc))
        return JSONResponse(quotas.tenant(name), headers={"Cache-Control": "no-store"})

    @app.put("/quota/{tenant:path}")
    async def put_tenant(tenant: str, request: Request) -> JSONResponse:
        try:
            doc = await write(request)
            if isinstance(doc, JSONResponse):
                return doc
            name = _name(tenant)
            limits = tenant_limits(doc)
            await run_in_threadpool(quotas.set, name, limits)
        except QuotaError as exc:
            return error_reply(400, str(exc))
        limit = quotas.limit_of(name)[0]
        return JSONResponse(
            {
                "tenant": name,
                "limit": limit,
                "limit_gb": None if limit is None else limit / GIB,
                "limits": quotas.tenant(name)["limits"],
            }
        )

    @app.delete("/quota/{tenant:path}")
    async def delete_tenant(tenant: str, request: Request) -> JSONResponse:
        denied = authorize(request)
        if denied is not None:
            return denied
        try:
            name = _name(tenant)
        except QuotaError as exc:
            return error_reply(400, str(exc))
        if not await run_in_threadpool(quotas.delete, name):
            return error_reply(404, f"tenant {name!r} has no quota (it has the default)")
        return JSONResponse({"tenant": name, "deleted": True})
