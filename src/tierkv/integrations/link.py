"""An engine's connection to the tierkv server: short timeouts, back-off, re-registration.

Shared by the engine integrations (the vLLM connector, the SGLang storage backend).

The engine must never wait long on the cache, nor fail because of it. :class:`ServerLink`
runs every RPC with the connector's (short) timeout; when one fails (server down, killed,
overloaded) it logs once and stays away for ``retry_interval`` seconds, during which every
call returns its fallback at once, i.e. the cache behaves as a miss. Where nothing listens at
the endpoint (a killed server's socket file is still there, or a TCP port refuses), the
attempt fails at once instead of retrying the connect until the timeout: a server down costs
the engine one refused connect per ``retry_interval``, not ``timeout`` seconds of its thread.
When the server answers that it does not know the client (it restarted), the link registers
again, once, and retries.

A call that failed without an answer (a timeout: the server stalled, or is gone) keeps the
registration: the server, if it is still there, still holds this client, its engine group
membership and its lookup sessions. Registering again would add a second client for the same
rank to the engine group, and a group whose rank count does not match its world size serves
no lookups; it would also orphan the sessions the scheduler opened for this rank.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import msgspec

from tierkv.client import (
    DEFAULT_REPLY_SPIN,
    Client,
    LeaseExpiredError,
    NotRegisteredError,
    Registration,
    ServerError,
    ServerUnavailableError,
    TierKVError,
    UnauthorizedError,
    default_endpoint,
)
from tierkv.options import OptionError, convert
from tierkv.pool import ShmPool

T = TypeVar("T")

# The settings an integration takes from the environment when its extra config leaves them out.
ENV_DEFAULTS = {"endpoint": "TIERKV_ENDPOINT", "auth_token": "TIERKV_AUTH_TOKEN"}


class LinkSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The settings of an engine's link to its server, which every integration's settings
    extend (they come from the engine's extra config, through :func:`tierkv.options.convert`)."""

    endpoint: str = ""  # default: $TIERKV_ENDPOINT, else the default instance's socket
    auth_token: str = ""  # default: $TIERKV_AUTH_TOKEN
    timeout: float = 2.0  # seconds an RPC may take before the engine treats it as a miss
    retry_interval: float = 5.0  # after a failure, seconds the server is not asked again
    # Map every page of the pool when attaching (MAP_POPULATE): the engine's copies into
    # slots never stop on a page fault (with the server's --prefault, the pages exist).
    populate: bool = True
    # Threads that copy a request's chunks; None: the integration's default (the cores, at
    # most 4, unless the integration knows better: see ServerLink's default_copy_threads).
    copy_threads: int | None = None
    # Microseconds a thread waiting for a reply keeps reading before it sleeps (0: sleep at
    # once): see tierkv.framing.Connection. At most this much CPU per RPC.
    reply_spin_us: int = round(DEFAULT_REPLY_SPIN * 1e6)

    def resolved(self: S) -> S:
        """With the defaults from the environment filled in; raises ValueError naming the
        key for a bad value."""
        _check_seconds("timeout", self.timeout, positive=True)
        _check_seconds("retry_interval", self.retry_interval, positive=False)
        if self.copy_threads is not None and self.copy_threads < 1:
            raise ValueError("copy_threads must be at least 1 (omit it for the default)")
        if self.reply_spin_us < 0:
            raise ValueError("reply_spin_us must be >= 0")
        return msgspec.structs.replace(
            self,
            endpoint=self.endpoint
            or os.environ.get(ENV_DEFAULTS["endpoint"])
            or default_endpoint(),
            auth_token=self.auth_token or os.environ.get(ENV_DEFAULTS["auth_token"], ""),
        )


S = TypeVar("S", bound=LinkSettings)

# The most seconds a link's timeout or retry interval may be: beyond an hour they are a
# mistake (1e12 seconds: every RPC of a stalled server would hold its thread for ever, every
# request then a miss), never a setting.
MAX_LINK_SECONDS = 3600.0


def _check_seconds(key: str, value: float, *, positive: bool) -> None:
    """Raises ValueError naming ``key`` unless ``value`` is a finite number of seconds, above
    0 (``positive``) or at least 0, and at most :data:`MAX_LINK_SECONDS`: NaN passed a
    ``<= 0`` check, and NaN or an infinite timeout made every request a silent miss."""
    low_ok = value > 0 if positive else value >= 0
    if not (math.isfinite(value) and low_ok and value <= MAX_LINK_SECONDS):
        bound = "above 0" if positive else "at least 0"
        raise ValueError(
            f"{key} must be a finite number of seconds {bound} and at most "
            f"{MAX_LINK_SECONDS:g}, not {value!r}"
        )


class SettingsError(ValueError):
    """A bad value in an engine's extra config for tierkv; the message names the key."""


def settings_from(extra: Mapping[str, Any], cls: type[S], what: str) -> S:
    """``extra`` (the engine's extra config, ``what`` its name in messages) as ``cls``,
    resolved (:meth:`LinkSettings.resolved`); SettingsError naming the key for a bad or
    unknown one."""
    try:
        return convert(dict(extra), cls, what=what).resolved()
    except OptionError as exc:
        raise SettingsError(str(exc)) from None
    except ValueError as exc:
        raise SettingsError(f"{what}.{exc}") from None


class ServerLink:
    """A registered :class:`Client` behind a circuit breaker. Thread-safe."""

    def __init__(
        self,
        settings: LinkSettings,
        register: Callable[[Client], None],
        what: str,
        log: logging.Logger,
        clock: Callable[[], float] = time.monotonic,
        parallel_callbacks: bool = False,
        on_pool: Callable[[ShmPool], Callable[[], None] | None] | None = None,
        default_copy_threads: Callable[[], int | None] = lambda: None,
    ) -> None:
        """``what`` names the engine side in log lines ("scheduler", "worker rank 0");
        ``log`` is the engine's logger for tierkv (where its operators look);
        ``parallel_callbacks`` and ``on_pool`` are the client's (gather/scatter on its copy
        threads; what to do with each pool mapping); ``default_copy_threads()``, asked when
        the client is built, gives its copy threads where the settings leave them out (None:
        the client's default)."""
        self.parallel_callbacks = parallel_callbacks
        self.on_pool = on_pool
        self._default_copy_threads = default_copy_threads
        self.settings = settings
        self._register = register
        self.what = what
        self._log = log
        self._clock = clock
        self._lock = threading.Lock()
        self._client: Client | None = None
        self._registered = False
        self._generation = 0  # registrations made: a call knows which one it ran under
        self._down_until = 0.0
        self._down_since: float | None = None
        self.failures = 0

    def client(self) -> Client | None:
        """The registered client, or None while the server is considered down."""
        return self._registered_client()[0]

    def _registered_client(self) -> tuple[Client | None, int]:
        """:meth:`client`, and the registration it is under (a count)."""
        with self._lock:
            if self._clock() < self._down_until:
                return None, self._generation
            if self._client is None:
                self._client = Client(
                    self.settings.endpoint,
                    timeout=self.settings.timeout,
                    auth_token=self.settings.auth_token,
                    parallel_callbacks=self.parallel_callbacks,
                    populate=self.settings.populate,
                    copy_threads=self.copy_threads(),
                    on_pool=self.on_pool,
                    reply_spin=self.settings.reply_spin_us * 1e-6,
                    # A server that is gone is down for retry_interval at once: the
                    # engine's thread never waits out the timeout on connection attempts.
                    wait_for_server=False,
                )
            client = self._client
            if (self._down_since is not None or not self._registered) and not _socket_present(
                self.settings.endpoint
            ):
                what = "register" if not self._registered else "reconnect"
                self._failed(
                    ServerUnavailableError(
                        f"no socket at {self.settings.endpoint}: is the server running?"
                    ),
                    what,
                )
                return None, self._generation
            if not self._registered:
                try:
                    self._register(client)
                except Exception as exc:
                    self._failed(exc, "register")
                    return None, self._generation
                self._registered = True
                self._generation += 1
                self._back()
            return client, self._generation

    @property
    def generation(self) -> int:
        """Registrations made so far (a new one after each server restart met)."""
        return self._generation

    def copy_threads(self) -> int | None:
        """The copy threads the client is built with (None: the client's default)."""
        if self.settings.copy_threads is not None:
            return self.settings.copy_threads
        return self._default_copy_threads()

    def registration(self) -> Registration | None:
        """The client's current registration (None before it registered)."""
        client = self._client
        return None if client is None else client.registration

    def call(self, what: str, fn: Callable[[Client], T], fallback: T) -> T:
        """``fn(client)``, or ``fallback`` if the server is down or the call fails."""
        for attempt in range(2):
            client, generation = self._registered_client()
            if client is None:
                return fallback
            try:
                result = fn(client)
            except NotRegisteredError:
                # The server restarted (it no longer knows this client): register again and
                # retry once; a second refusal is a miss like any other failure. Calls of
                # other threads that ran under the same registration meet the same refusal:
                # only the first registers again (a second registration would be a second
                # client of this rank), the others retry under the new one.
                with self._lock:
                    if self._generation == generation:
                        self._registered = False
                if attempt:
                    return fallback
                self._log.info(
                    "tierkv %s: server at %s does not know this engine (restarted): "
                    "registering again",
                    self.what,
                    self.settings.endpoint,
                )
                continue
            except UnauthorizedError as exc:
                # A wrong auth token: registering again cannot help. Back off like an
                # unavailable server (one WARNING naming the cause, then plain misses).
                with self._lock:
                    self._failed(exc, what)
                return fallback
            except ServerError as exc:
                # The server answered: this request failed (an expired lock, a bad key), the
                # server itself is fine.
                level = logging.DEBUG if isinstance(exc, LeaseExpiredError) else logging.WARNING
                self._log.log(level, "tierkv %s: %s failed: %s", self.what, what, exc)
                self._answered()
                return fallback
            except Exception as exc:
                with self._lock:
                    self._failed(exc, what)
                return fallback
            self._answered()
            return result
        return fallback

    def _answered(self) -> None:
        if self._down_since is not None:  # rare: take the lock only then
            with self._lock:
                self._back()

    def _back(self) -> None:
        """The server answered (lock held): log its return after an outage."""
        if self._down_since is not None:
            self._log.info(
                "tierkv %s: server at %s is back after %.1f s",
                self.what,
                self.settings.endpoint,
                self._clock() - self._down_since,
            )
            self._down_since = None

    def _failed(self, exc: BaseException, what: str) -> None:
        """Mark the server down (lock held). The registration stays: see the module doc."""
        self.failures += 1
        self._down_until = self._clock() + self.settings.retry_interval
        if self._down_since is None:
            self._down_since = self._clock()
            if isinstance(exc, UnauthorizedError):
                kind = "refused this engine's auth token"
            else:
                kind = "unavailable" if isinstance(exc, TierKVError) else "failing"
            self._log.warning(
                "tierkv %s: server at %s %s (%s during %s); serving without the cache, "
                "retrying every %.1f s",
                self.what,
                self.settings.endpoint,
                kind,
                exc,
                what,
                self.settings.retry_interval,
            )
        else:
            self._log.debug("tierkv %s: %s failed again: %s", self.what, what, exc)

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
            self._registered = False
        if client is not None:
            try:
                client.close()
            except Exception as exc:  # closing is best effort
                self._log.debug("tierkv %s: close failed: %s", self.what, exc)


def _socket_present(endpoint: str) -> bool:
    """False when a local (ipc) endpoint has no socket file: no server, no need to wait for
    a reply that cannot come. Other transports are assumed present."""
    if not endpoint.startswith("ipc://"):
        return True
    path = endpoint[len("ipc://") :]
    return path.startswith("@") or os.path.exists(path)  # "@": Linux abstract socket
