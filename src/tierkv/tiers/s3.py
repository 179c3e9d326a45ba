"""S3-compatible object-storage tier: one object per chunk (record header + payload), via boto3.

Layout: the chunk with 32-byte key ``k`` is the object ``<prefix><hex(k[:16])>/<hex(k[16:])>``
in ``bucket``: the namespace digest is a "directory", so an operator can list, expire
(lifecycle rules) or delete one namespace's chunks, and chunks of different namespaces never
share an object. The object body is ``header || payload`` (see :mod:`tierkv.tiers.records`).

Copies. A store hands botocore a file-like body over the header and the pool's
``memoryview`` whose ``read`` returns ``memoryview`` slices, which urllib3 passes on to
``socket.sendall``: no copy of the payload (over plain http botocore reads the body once
more to sign its SHA-256; over https the payload is unsigned and TLS encrypts it, as it would
any buffer). A load reads the body straight into the reserved slot with
``http.client.HTTPResponse.readinto`` when the response is the usual urllib3-over-http.client
one; otherwise it falls back to botocore's ``StreamingBody.readinto``, which urllib3
implements with a ``read`` into a temporary ``bytes`` (one copy); both bodies are in
:mod:`tierkv.tiers.s3_body`. botocore's own CRC checksums are left off (``when_required``):
the record header's checksum covers the chunk end to end, and the CRC would cost a pass (and
over https a framing copy) per chunk.

An object found corrupt (bad header, length or checksum) is deleted, with ``If-Match`` on
the ETag it was read with, so a store that replaced it meanwhile is kept (an endpoint that
does not take conditional deletes gets a plain one). An object of another length than the
slot that is itself a whole record of the key is kept (the caller asked for the wrong size).

Every chunk of a batch is one request, run in parallel on a small thread pool
(``max_concurrency``, also the size of the HTTP connection pool). Failures never raise out
of a batch: each item reports its own status. They are counted and logged through the
tier's :class:`~tierkv.tiers.outage.Outage`: one WARNING when the endpoint starts failing,
one INFO line with the count when a request works again (a GET once its body was read: an
endpoint that sends headers and then fails every body is still down). A failed load counts
once in ``errors``, as its ERROR status. A body must come whole within ``read_timeout``
plus its size at ``min_rate`` (:mod:`tierkv.tiers.transfer`): one trickling in, each read
within ``read_timeout``, fails the load (ERROR) and its connection is dropped.
"""

from __future__ import annotations

import http.client
import logging
import re
import urllib.parse
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any, TypeVar

from tierkv.options import Size
from tierkv.redaction import redacted_url
from tierkv.tiers.base import LoadStatus, Tier, TierError, TierUsage
from tierkv.tiers.counts import TierCounts
from tierkv.tiers.records import HEADER_SIZE, byte_view, misfit, pack_header, unpack_header, verify
from tierkv.tiers.registry import register_tier
from tierkv.tiers.s3_body import RecordBody, body_reader, finish, read_exact
from tierkv.tiers.transfer import MIN_RATE, transfer_deadline

try:
    import boto3
    import botocore.config
    import botocore.exceptions
except ImportError:  # pragma: no cover - exercised only without the optional dependency
    boto3 = None

log = logging.getLogger(__name__)

_DELETE_BATCH = 1000  # DeleteObjects' limit
_NOT_FOUND = {"404", "NoSuchKey", "NotFound"}
# What an endpoint without conditional deletes answers to DeleteObject with If-Match.
_NO_CONDITIONAL_DELETE = {"NotImplemented", "InvalidArgument", "InvalidRequest", "501"}
# What follows the prefix in the name of an object this tier writes (see object_key).
_CHUNK_NAME = re.compile(r"[0-9a-f]{32}/[0-9a-f]{32}")
T = TypeVar("T")
R = TypeVar("R")


class S3Tier(Tier):
    """Chunks as objects in an S3-compatible bucket.

    Options (the documentation's reference is generated from this list):

        bucket  the bucket
        endpoint_url  for MinIO, Ceph, moto, ... (none: AWS)
        region  the bucket's region
        prefix  the prefix of every object name
        access_key_id  credentials (none: boto3's default credential chain)
        secret_access_key  credentials (none: boto3's default credential chain)
        session_token  credentials (none: boto3's default credential chain)
        max_concurrency  parallel requests per batch
        connect_timeout  seconds a connection may take
        read_timeout  seconds a read may wait
        min_rate  bytes per second below which a GET's body fails: it must come whole
             within ``read_timeout`` plus its size at this rate (a body trickling in,
             each read within ``read_timeout``, held a thread for as long as it lasted)
        retries  botocore's retry attempts after the first
        addressing_style  ``path`` or ``virtual`` (default: ``path`` with an
             ``endpoint_url``, else ``auto``)
        create_bucket  create the bucket at start-up if it does not exist
    """

    name = "s3"
    usage_scans = True  # usage() lists the whole bucket prefix

    def __init__(
        self,
        bucket: str,
        endpoint_url: str | None = None,
        region: str | None = None,
        prefix: str = "tierkv/",
        access_key_id: str | None = None,
        secret_access_key: str | None = None,
        session_token: str | None = None,
        max_concurrency: int = 8,
        connect_timeout: float = 5.0,
        read_timeout: float = 30.0,
        min_rate: Size = MIN_RATE,
        retries: int = 2,
        addressing_style: str | None = None,
        create_bucket: bool = False,
    ) -> None:
        self.check_options(
            bucket=bucket,
            endpoint_url=endpoint_url,
            max_concurrency=max_concurrency,
            access_key_id=access_key_id,
            secret_access_key=secret_access_key,
            addressing_style=addressing_style,
            min_rate=min_rate,
        )
        self.bucket = bucket
        self._read_timeout = read_timeout
        self._min_rate = min_rate
        self.prefix = prefix
        self.endpoint_url = endpoint_url
        style = addressing_style or ("path" if endpoint_url else "auto")
        config_options: dict[str, Any] = {
            "max_pool_connections": max_concurrency,
            "connect_timeout": connect_timeout,
            "read_timeout": read_timeout,
            "retries": {"max_attempts": retries + 1, "mode": "standard"},
            "s3": {"addressing_style": style},
        }
        checksum_options = {
            "request_checksum_calculation": "when_required",
            "response_checksum_validation": "when_required",
        }
        try:
            config = botocore.config.Config(**config_options, **checksum_options)
        except TypeError:  # botocore < 1.36 has neither option, nor default checksums
            config = botocore.config.Config(**config_options)
        try:
            self._client = boto3.session.Session().client(
                "s3",
                endpoint_url=endpoint_url,
                region_name=region,
                aws_access_key_id=access_key_id,
                aws_secret_access_key=secret_access_key,
                aws_session_token=session_token,
                config=config,
            )
        except (botocore.exceptions.BotoCoreError, ValueError) as exc:
            why = str(exc)
            if endpoint_url:  # (a query's secrets: userinfo is refused by check_options)
                why = why.replace(endpoint_url, redacted_url(endpoint_url))
            raise TierError(f"s3 tier: cannot create a client: {why}") from exc
        self._executor = ThreadPoolExecutor(max_concurrency, thread_name_prefix="tierkv-s3")
        self._counts = TierCounts()
        self._last_usage = TierUsage(0, 0, 0)
        self._conditional_delete = True  # until the endpoint or botocore refuses If-Match
        if create_bucket:
            self._ensure_bucket(region)

    @classmethod
    def check_options(cls, **options: Any) -> None:
        if boto3 is None:
            raise TierError("the s3 tier needs boto3: pip install 'tierkv[s3]'")
        if not options.get("bucket"):
            raise TierError("s3 tier: a bucket is required")
        endpoint = options.get("endpoint_url")
        if endpoint is not None:
            parts = urllib.parse.urlsplit(endpoint)
            if parts.scheme not in ("http", "https") or not parts.netloc:
                raise TierError(
                    f"s3 tier: endpoint_url {redacted_url(endpoint)!r} is not an http:// or "
                    "https:// URL"
                )
            if "@" in parts.netloc:  # (shown in botocore's errors and the outage lines)
                raise TierError(
                    f"s3 tier: endpoint_url {redacted_url(endpoint)!r} carries credentials: "
                    "give them as access_key_id and secret_access_key"
                )
        if options.get("max_concurrency", 1) < 1:
            raise TierError(
                f"s3 tier: max_concurrency must be >= 1, got {options['max_concurrency']}"
            )
        if options.get("min_rate", 1) < 1:
            raise TierError(f"s3 tier: min_rate must be >= 1 byte/s, got {options['min_rate']}")
        if (options.get("access_key_id") is None) != (options.get("secret_access_key") is None):
            raise TierError("s3 tier: give both access_key_id and secret_access_key, or neither")
        if options.get("addressing_style") not in (None, "auto", "path", "virtual"):
            raise TierError(
                f"s3 tier: addressing_style {options['addressing_style']!r}: use auto, path or "
                "virtual"
            )

    def _ensure_bucket(self, region: str | None) -> None:
        try:
            self._client.head_bucket(Bucket=self.bucket)
            return
        except botocore.exceptions.ClientError as exc:
            if _error_code(exc) not in _NOT_FOUND:
                raise TierError(f"s3 tier: bucket {self.bucket!r}: {exc}") from exc
        except botocore.exceptions.BotoCoreError as exc:
            self.outage.failed("checking the bucket", exc, 0)
            return
        kwargs: dict[str, Any] = {"Bucket": self.bucket}
        if region and region != "us-east-1":
            kwargs["CreateBucketConfiguration"] = {"LocationConstraint": region}
        try:
            self._client.create_bucket(**kwargs)
        except botocore.exceptions.ClientError as exc:
            if _error_code(exc) not in {"BucketAlreadyOwnedByYou", "BucketAlreadyExists"}:
                raise TierError(f"s3 tier: cannot create bucket {self.bucket!r}: {exc}") from exc

    # -- helpers ---------------------------------------------------------------------------
    def outage_label(self) -> str:
        where = redacted_url(self.endpoint_url) if self.endpoint_url else "AWS"
        return f"s3 tier {where} bucket {self.bucket}"

    def object_key(self, key: bytes) -> str:
        """The object name of a chunk key."""
        return f"{self.prefix}{key[:16].hex()}/{key[16:].hex()}"

    def is_chunk_object(self, name: str) -> bool:
        """Whether ``name`` is one this tier would write (:meth:`object_key`): an object of
        another deployment whose prefix extends this one's (``kv2/...`` or ``kv/other/...``
        under ``kv``) is not."""
        return name.startswith(self.prefix) and (
            _CHUNK_NAME.fullmatch(name, len(self.prefix)) is not None
        )

    def stats(self) -> dict[str, int]:
        """Counters since start: stored, store_failed, loaded, missing, corrupt,
        corrupt_deleted, errors."""
        return self._counts.snapshot()

    def _map(self, fn: Callable[[T], R], items: Sequence[T]) -> list[R]:
        """``fn`` of each item, on the tier's threads; returns (or raises the first item's
        exception) only once every call ended: a load's GETs write into pool slots that the
        caller frees when this returns."""
        if len(items) == 1:
            return [fn(items[0])]
        futures = [self._executor.submit(fn, item) for item in items]
        wait(futures)
        return [future.result() for future in futures]

    # -- Tier ------------------------------------------------------------------------------
    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        return [bool(held) for held in self.presence(keys)]

    def presence(self, keys: Sequence[bytes]) -> list[bool | None]:
        return self._map(self._head, keys)

    def _head(self, key: bytes) -> bool | None:
        """Whether the object exists; None when the request failed."""
        try:
            self._client.head_object(Bucket=self.bucket, Key=self.object_key(key))
        except botocore.exceptions.ClientError as exc:
            if _error_code(exc) in _NOT_FOUND:
                self.outage.ok()
                return False
            self._error("HEAD", key, exc)
            return None
        except (botocore.exceptions.BotoCoreError, OSError) as exc:
            self._error("HEAD", key, exc)
            return None
        self.outage.ok()
        return True

    def store(self, items: Sequence[tuple[bytes, memoryview]]) -> list[bool]:
        results = self._map(self._put, items)
        self._counts.add(stored=sum(results), store_failed=len(results) - sum(results))
        return results

    def _put(self, item: tuple[bytes, memoryview]) -> bool:
        key, view = item
        try:
            payload = byte_view(view)
            body = RecordBody(pack_header(key, payload), payload)
        except (ValueError, TypeError) as exc:
            log.warning("s3 tier: not storing chunk %s: %s", key.hex()[:16], exc)
            return False
        try:
            self._client.put_object(
                Bucket=self.bucket,
                Key=self.object_key(key),
                Body=body,
                ContentLength=len(body),
                ContentType="application/octet-stream",
            )
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError, OSError) as exc:
            self._error("PUT", key, exc)
            return False
        self.outage.ok()
        return True

    def load(self, items: Sequence[tuple[bytes, memoryview]]) -> list[LoadStatus]:
        statuses = self._map(self._get, items)
        self._counts.add_loads(statuses)
        return statuses

    def _get(self, item: tuple[bytes, memoryview]) -> LoadStatus:
        key, view = item
        dest = byte_view(view)
        try:
            response = self._client.get_object(Bucket=self.bucket, Key=self.object_key(key))
        except botocore.exceptions.ClientError as exc:
            if _error_code(exc) in _NOT_FOUND:
                self.outage.ok()
                return LoadStatus.MISSING
            self._error("GET", key, exc, count=False)  # load() counts the ERROR
            return LoadStatus.ERROR
        except (botocore.exceptions.BotoCoreError, OSError) as exc:
            self._error("GET", key, exc, count=False)
            return LoadStatus.ERROR
        try:
            status, corrupt = self._read_record(key, dest, response)
        except (botocore.exceptions.BotoCoreError, OSError, http.client.HTTPException) as exc:
            self._error("GET", key, exc, count=False)
            return LoadStatus.ERROR
        self.outage.ok()  # the body came (headers alone do not show the endpoint works)
        if corrupt:
            self._drop_corrupt(key, response.get("ETag"))
        return status

    def _read_record(
        self, key: bytes, dest: memoryview, response: dict[str, Any]
    ) -> tuple[LoadStatus, bool]:
        """Read a GET response's record into ``dest`` and verify it: the status, and whether
        the stored object is corrupt (to be deleted). Transfer errors raise."""
        body = response["Body"]
        complete = False
        try:
            # None: the endpoint sent the body chunked, without Content-Length (valid HTTP):
            # the record's own header tells its size, and the body must end right after it.
            length = response.get("ContentLength")
            if not isinstance(length, int):
                length = None
            size = HEADER_SIZE + dest.nbytes if length is None else length
            deadline = transfer_deadline(size, self._read_timeout, self._min_rate)
            read_into = body_reader(body, deadline)
            raw_header = memoryview(bytearray(HEADER_SIZE))
            if length is not None and length != HEADER_SIZE + dest.nbytes:
                header = None
                if length >= HEADER_SIZE:
                    if read_exact(read_into, raw_header) != HEADER_SIZE:
                        raise ConnectionError("response body ended early")
                    header = unpack_header(raw_header)
                return LoadStatus.CORRUPT, misfit(log, "s3", header, key, length, dest.nbytes)
            if read_exact(read_into, raw_header) != HEADER_SIZE:
                raise ConnectionError("response body ended early")
            header = unpack_header(raw_header)
            other_size = header is not None and header.key == key and header.length != dest.nbytes
            if length is None and header is not None and other_size:  # kept: see misfit
                size = HEADER_SIZE + header.length
                return LoadStatus.CORRUPT, misfit(log, "s3", header, key, size, dest.nbytes)
            if header is None or header.key != key or header.length != dest.nbytes:
                log.warning("s3 tier: %s has a bad record header; deleting it", key.hex()[:16])
                return LoadStatus.CORRUPT, True
            if read_exact(read_into, dest) != dest.nbytes:
                raise ConnectionError("response body ended early")
            if length is None and read_exact(read_into, memoryview(bytearray(1))) != 0:
                log.warning("s3 tier: %s is longer than its record; deleting it", key.hex()[:16])
                return LoadStatus.CORRUPT, True
            complete = True
            status = verify(header, key, dest)
            if status is not LoadStatus.OK:
                log.warning("s3 tier: %s failed verification; deleting it", key.hex()[:16])
            return status, status is not LoadStatus.OK
        finally:
            finish(body, complete)

    def _drop_corrupt(self, key: bytes, etag: str | None) -> None:
        """Delete an object a load found corrupt, if it is still the one read (``etag``)."""
        request: dict[str, Any] = {"Bucket": self.bucket, "Key": self.object_key(key)}
        conditional = bool(etag) and self._conditional_delete
        if conditional:
            request["IfMatch"] = etag
        try:
            self._client.delete_object(**request)
        except botocore.exceptions.ParamValidationError as exc:
            if conditional:  # a botocore without If-Match on DeleteObject
                self._conditional_delete = False
                self._drop_corrupt(key, None)
            else:
                self._error("DELETE", key, exc)
            return
        except botocore.exceptions.ClientError as exc:
            code = _error_code(exc)
            if code == "PreconditionFailed" or code in _NOT_FOUND:
                log.debug("s3 tier: %s was replaced or removed meanwhile; kept", key.hex()[:16])
                self.outage.ok()
            elif conditional and code in _NO_CONDITIONAL_DELETE:
                self._conditional_delete = False  # the endpoint has no conditional deletes
                self._drop_corrupt(key, None)
            else:
                self._error("DELETE", key, exc)
            return
        except (botocore.exceptions.BotoCoreError, OSError) as exc:
            self._error("DELETE", key, exc)
            return
        self.outage.ok()
        self._counts.add(corrupt_deleted=1)

    def delete(self, keys: Sequence[bytes]) -> int:
        """The chunks removed: those held (a HEAD each, DeleteObjects does not tell) less
        those whose deletion failed, alone or with their whole request."""
        keys = list(dict.fromkeys(keys))  # each once: a key twice was subtracted twice
        if not keys:
            return 0
        held = {self.object_key(k) for k, h in zip(keys, self.contains(keys), strict=True) if h}
        removed = len(held)
        for start in range(0, len(keys), _DELETE_BATCH):
            batch = keys[start : start + _DELETE_BATCH]
            objects = [{"Key": self.object_key(k)} for k in batch]
            try:
                reply = self._client.delete_objects(
                    Bucket=self.bucket, Delete={"Objects": objects, "Quiet": True}
                )
            except (
                botocore.exceptions.BotoCoreError,
                botocore.exceptions.ClientError,
                OSError,
            ) as exc:
                self._counts.add(errors=len(batch))
                self.outage.failed("DeleteObjects", exc, len(batch))
                removed -= sum(1 for obj in objects if obj["Key"] in held)
                continue
            errors = reply.get("Errors", [])
            if len(errors) < len(batch):
                self.outage.ok()
            if errors:
                self._counts.add(errors=len(errors))
                self.outage.failed("deleting " + str(errors[0].get("Key")), errors[0], len(errors))
                removed -= len({e.get("Key") for e in errors} & held)
        return removed

    def usage(self) -> TierUsage:
        """Objects and bytes of this tier's chunks (a listing of the prefix: one request per
        1000 objects; only names of the tier's own format count, see
        :meth:`is_chunk_object`)."""
        objects = stored = 0
        try:
            pages = self._client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=self.prefix
            )
            for page in pages:
                for obj in page.get("Contents", []):
                    if not self.is_chunk_object(str(obj.get("Key", ""))):
                        continue
                    objects += 1
                    stored += int(obj.get("Size", 0))
        except (
            botocore.exceptions.BotoCoreError,
            botocore.exceptions.ClientError,
            OSError,
        ) as exc:
            self._counts.add(errors=1)
            self.outage.failed("listing the objects", exc, 0)
            return self._last_usage
        self.outage.ok()
        self._last_usage = TierUsage(objects, stored, 0)
        return self._last_usage

    def _error(self, op: str, key: bytes, exc: BaseException, count: bool = True) -> None:
        """A request failed: logged through the outage, and counted in ``errors`` unless
        its caller counts it (a load counts its statuses)."""
        if count:
            self._counts.add(errors=1)
        self.outage.failed(f"{op} {key.hex()[:16]}", exc)

    def close(self) -> None:
        self._executor.shutdown(wait=True)
        self._client.close()

    def copies(self) -> str:
        return (
            "store: no copy of the payload (a file-like body returns memoryview slices of the "
            "pool to sendall; over http botocore reads it once more for the SigV4 hash) plus "
            "one checksum read pass. load: no copy (http.client readinto straight into the "
            "slot; 1 copy on the fallback StreamingBody.readinto path) plus one checksum pass."
        )


def _error_code(exc: Any) -> str:
    error = getattr(exc, "response", {}).get("Error", {})
    return str(error.get("Code", ""))


register_tier("s3", S3Tier)
