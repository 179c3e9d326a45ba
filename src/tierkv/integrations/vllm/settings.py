"""Connector settings, read from vLLM's ``kv_connector_extra_config``.

Every key is optional::

    endpoint        tierkv RPC endpoint (default: $TIERKV_ENDPOINT, else the default
                    instance's local socket)
    auth_token      the server's shared secret, if it has one (default: $TIERKV_AUTH_TOKEN)
    chunk_size      tokens per chunk; must equal the server's --chunk-size (default 256)
    timeout         seconds one RPC may take before the engine treats it as a miss
                    (default 2.0: the engine never waits long on the cache)
    retry_interval  after a failed RPC, seconds during which the server is not asked again
                    (default 5.0); every request in between is a plain miss
    populate        map every page of the pool when attaching (default true), so that stores
                    never stop on page faults (run the server with --prefault)
    copy_threads    threads that copy a step's chunks between the pool and the KV cache
                    (default: 1, vLLM's own thread, for a cache in host memory, whose
                    engine's OpenMP threads hold the other cores; the cores, at most 4, for
                    a cache on a GPU)
    reply_spin_us   microseconds a thread waiting for the server's reply keeps reading
                    before it sleeps (default 100; 0: sleep at once): requests back to back
                    take about half the time on a VM, whose idle cores halt
    page_lock_pool  when the KV cache is on a GPU, page-lock the pool mapping with CUDA
                    (cudaHostRegister) so that chunks cross by DMA (default true; about
                    0.09 s per GiB of pool at start, measured on an H200; ignored for
                    caches in host memory)
    hashes          chunk keys from "vllm" block hashes, "tokens" (token ids hashed by the
                    server), or "auto" (block hashes when they are usable, default)
    model_id        the model identity in the namespace (default: the model path or name,
                    plus its revision)
    tenant          an extra namespace salt: engines with different tenants never share KV
    kv_layout       for attention backends tierkv does not know: "split_last" (K then V along
                    the last axis of a [blocks, heads, tokens, 2*head_size] cache) or "native"
                    (blocks stored as they are, shared only with identical engines);
                    default "auto" (known backends only)
    store_decode    also store the chunks that become full while the request decodes, keyed
                    over prompt + output tokens, so that a later prompt continuing this
                    conversation (the next chat turn) hits them (default false: prompt
                    chunks only, like LMCache's save_decode_cache); lookups still cover
                    only a request's prompt
    async_store     store off the forward pass (default false: on a CPU engine the store
                    thread's copy and GIL compete with the next forward; meant for GPU
                    engines, not measured on one yet): the worker hands each step's
                    stores to its store thread and returns; vLLM keeps a finished request's
                    blocks until its stores have ended, and a preempted request's stores end
                    before the next forward pass. A kv_producer (prefill/decode
                    disaggregation) always stores synchronously: its consumer reads the
                    chunks as soon as the request's output is returned
    kv_events_reannounce_interval
                    with vLLM's KV events on: seconds in which every chunk the pool holds for
                    this engine is announced again (default 30; 0: never), spread over the
                    steps, so that a router that subscribed late (llm-d's indexer has no
                    replay) knows the pool's content within two intervals
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tierkv.integrations.link import LinkSettings, SettingsError, settings_from

WHAT = "kv_connector_extra_config"

HASH_MODES = ("auto", "vllm", "tokens")
KV_LAYOUTS = ("auto", "native", "split_last")


class ConnectorSettings(LinkSettings, frozen=True, kw_only=True, forbid_unknown_fields=True):
    chunk_size: int = 256
    hashes: str = "auto"
    model_id: str = ""
    tenant: str = ""
    kv_layout: str = "auto"
    store_decode: bool = False
    async_store: bool = False
    page_lock_pool: bool = True
    kv_events_reannounce_interval: float = 30.0

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> ConnectorSettings:
        """Validate the extra config; unknown keys are an error (a typo must not pass)."""
        settings = settings_from(extra or {}, cls, WHAT)
        if settings.chunk_size <= 0:
            raise SettingsError(f"{WHAT}.chunk_size must be positive")
        if not settings.kv_events_reannounce_interval >= 0:  # NaN too
            raise SettingsError(f"{WHAT}.kv_events_reannounce_interval must not be negative")
        if settings.hashes not in HASH_MODES:
            raise SettingsError(
                f"kv_connector_extra_config.hashes must be one of {HASH_MODES}, "
                f"not {settings.hashes!r}"
            )
        if settings.kv_layout not in KV_LAYOUTS:
            raise SettingsError(
                f"kv_connector_extra_config.kv_layout must be one of {KV_LAYOUTS}, "
                f"not {settings.kv_layout!r}"
            )
        return settings


def stores_async(settings: ConnectorSettings, *, can_load: bool, can_save: bool) -> bool:
    """Whether stores run on the worker's store thread. Not for a producer-only engine
    (``kv_producer``): with prefill/decode disaggregation the decode engine looks the prompt
    up as soon as the prefill request's output is returned, so the stores must have
    committed by then (read-your-writes), which only a synchronous store guarantees."""
    producer_only = can_save and not can_load
    return settings.async_store and can_save and not producer_only
