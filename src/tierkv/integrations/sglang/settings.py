"""Backend settings, read from SGLang's ``--hicache-storage-backend-extra-config``.

SGLang hands the backend the whole extra config; the keys SGLang itself reads there
(``backend_name``, ``module_path``, ``class_name``, ``interface_v1``, ...) are left to it.
Every other key is tierkv's, and optional::

    endpoint        tierkv RPC endpoint (default: $TIERKV_ENDPOINT, else the default
                    instance's local socket)
    auth_token      the server's shared secret, if it has one (default: $TIERKV_AUTH_TOKEN)
    timeout         seconds one RPC may take before the engine treats it as a miss
                    (default 2.0: the engine never waits long on the cache); also the
                    longest ``batch_exists`` waits for pages to come from tiers and peers
    retry_interval  after a failed RPC, seconds during which the server is not asked again
                    (default 5.0); every call in between is a plain miss
    populate        map every page of the pool when attaching (default true)
    copy_threads    threads that copy a batch's pages between the pool and the host pool
                    (default: the cores, at most 4)
    reply_spin_us   microseconds a thread waiting for the server's reply keeps reading
                    before it sleeps (default 100; 0: sleep at once)
    model_id        the model identity in the namespace (default: SGLang's model name)
    tenant          an extra namespace salt: engines with different tenants never share KV
                    (SGLang's per-request ``extra_key`` and cache salt already seed its page
                    hashes, so requests of different keys never share pages either)

A key tierkv does not know is an error: a typo must not silently fall back to a default.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tierkv.integrations.link import LinkSettings, settings_from
from tierkv.integrations.link import SettingsError as SettingsError

WHAT = "hicache-storage-backend-extra-config"

# Keys of the extra config that belong to SGLang (its backend factory and cache controller).
SGLANG_KEYS = frozenset(
    {
        "backend_name",
        "module_path",
        "class_name",
        "interface_v1",
        "interface_v2",
        "prefetch_threshold",
        "prefetch_timeout_base",
        "prefetch_timeout_per_ki_token",
        "hicache_storage_pass_prefix_keys",
    }
)


class BackendSettings(LinkSettings, frozen=True, kw_only=True, forbid_unknown_fields=True):
    model_id: str = ""
    tenant: str = ""

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> BackendSettings:
        ours = {k: v for k, v in dict(extra or {}).items() if k not in SGLANG_KEYS}
        return settings_from(ours, cls, WHAT)
