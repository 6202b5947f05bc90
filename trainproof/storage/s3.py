"""S3 (AWS, MinIO, Ceph…) through s3fs, imported lazily so a local run imports nothing remote.

What this module owns, each rule answering something S3 and S3-compatible servers really do:
- one retry layer: botocore gets ``total_max_attempts=1`` and s3fs ``retries=1``; tenacity in
  ``trainproof.storage.retry`` retries whole operations;
- per-endpoint checksum settings (``when_required`` for non-AWS endpoints);
- create-only writes with ``If-None-Match: *`` (412 → FileExistsError) and a probe that the endpoint honours it,
  on a plain PUT and on a multipart completion; where only the PUT honours it (Ceph RGW 16 completes a multipart
  upload over an existing key and replaces it), a large file's key is claimed by a create-only PUT first;
- the data path (multipart parts, ranged reads of large objects) on a plain boto3 client from worker threads, whose
  sockets release the GIL (measured on Ceph RGW: about twice the throughput of the same calls through s3fs's one
  event-loop thread, bench/RESULTS.md); everything else through s3fs;
- parts that grow with the object, so no upload needs more than S3's 10 000 parts;
- no listing cache (``use_listings_cache=False`` and ``refresh=True`` on every listing);
- no partial object on failure (``pipe_file`` aborts its multipart upload; streamed files are discarded);
- a sweep of unfinished multipart uploads under the run prefix.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator

from trainproof.storage.backend import CHUNK, IN_MEMORY, Entry, FsspecBackend, Source, iter_chunks
from trainproof.storage.digest import FileHasher, digest_bytes
from trainproof.storage.errors import StoreConfigError
from trainproof.storage.limits import redact_url
from trainproof.storage.options import StoreOptions
from trainproof.storage.pieces import Pieces, nbytes
from trainproof.storage.retry import RetryStats, is_transient, retry_or_unavailable
from trainproof.storage.spool import LiveSpool, Spool

log = logging.getLogger("trainproof.storage")



def _is_precondition_failed(exc: BaseException) -> bool:
    while exc is not None:
        response = getattr(exc, "response", None)
        if isinstance(response, dict):
            err = response.get("Error", {})
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if err.get("Code") == "PreconditionFailed" or status == 412:
                return True
        exc = exc.__cause__ or exc.__context__
    return False


def _status(exc: BaseException) -> int | None:
    cause = exc.__cause__
    response = getattr(cause, "response", None)
    return response.get("ResponseMetadata", {}).get("HTTPStatusCode") if isinstance(response, dict) else None


_CREATE_REFUSED = {
    "InvalidBucketName": "{bucket!r} is not a valid bucket name: use 3-63 lowercase letters, digits, '-' and '.'",
    "BucketAlreadyExists": "bucket {bucket!r} already exists and belongs to someone else (bucket names are shared "
                           "by every account): choose another name",
    "InvalidAccessKeyId": "the S3 credentials were refused ({code}): check AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY "
                          "or the profile",
    "AccessDenied": "creating bucket {bucket!r} was refused: these credentials may not create buckets "
                    "(s3:CreateBucket); have it created, then run this again to check access",
}
"""What a refused bucket creation means to the person who asked for it, by S3 error code."""
_CREATE_REFUSED["SignatureDoesNotMatch"] = _CREATE_REFUSED["InvalidAccessKeyId"]

MAX_PARTS = 10_000
"""S3's most parts in one multipart upload."""


class _TooManyParts(Exception):
    """A streamed upload would need more than MAX_PARTS parts (its file grew past the expected size)."""


def part_size_for(size: int, part_size: int) -> int:
    """The part size for an object of ``size`` bytes: ``part_size``, or, when that would take more than
    :data:`MAX_PARTS` parts, the smallest whole number of MiB that fits (a 100 GB state at 8 MiB parts would need
    11 921 parts; it goes up in 10 MiB ones)."""
    if -(-size // part_size) <= MAX_PARTS:
        return part_size
    mib = 2**20
    return -(-size // (MAX_PARTS * mib)) * mib


class S3Backend(FsspecBackend):
    """One s3fs client per store; paths are ``bucket/key`` without the scheme."""

    parallel_ranges = True
    """Large objects are read back and downloaded as parallel ranged GETs (``trainproof.storage.spool``)."""

    uploads_while_written = True
    """A :class:`LiveSpool`'s parts are uploaded as the serialisation writes them (:meth:`_write_live`)."""

    multipart_create_only = False
    """Whether this endpoint refuses (412) a CompleteMultipartUpload with ``If-None-Match: *`` over an existing key,
    as AWS, MinIO and moto do; set by :meth:`probe_create_only`. Until a probe says so (and on servers that replace
    the object instead, like Ceph RGW 16), a create-only multipart write first *claims* its key: a create-only PUT
    of an empty object, which such servers do refuse when the key exists, and only then uploads over its own
    claim. So no create-only write ever replaces an object another writer made; a writer that finds the key taken
    gets FileExistsError, as on AWS (and the commit writes its attempt's copy beside it,
    ``trainproof.storage.commit``)."""

    def __init__(self, options: StoreOptions, stats: RetryStats | None = None) -> None:
        import s3fs  # lazy: only S3 runs pay for aiobotocore

        checksum = options.checksum_mode()
        config = {
            "retries": {"total_max_attempts": 1, "mode": "standard"},
            "connect_timeout": options.connect_timeout,
            "read_timeout": options.read_timeout,
            "request_checksum_calculation": checksum,
            "response_checksum_validation": checksum,
        }
        if options.use_path_style():
            config["s3"] = {"addressing_style": "path"}
        client_kwargs = {"region_name": options.region or "us-east-1"}
        fs = s3fs.S3FileSystem(
            endpoint_url=options.endpoint_url,
            profile=options.profile,
            client_kwargs=client_kwargs,
            config_kwargs=config,
            skip_instance_cache=True,  # one client per store, never shared across threads' stores
            use_listings_cache=False,  # another process writes the same prefix: never trust a cached listing
            max_concurrency=options.concurrency,
        )
        fs.retries = 1  # s3fs would otherwise retry 5× on top of botocore and tenacity
        super().__init__(fs)
        self.options = options
        self.stats = stats
        self._config, self._client, self._client_lock = config, None, threading.Lock()

    def _data(self):
        """The boto3 client of the data path (made on first use; thread-safe, one connection per part in flight)."""
        with self._client_lock:
            if self._client is None:
                import boto3
                from botocore.config import Config

                session = boto3.session.Session(profile_name=self.options.profile)
                self._client = session.client(
                    "s3", endpoint_url=self.options.endpoint_url, region_name=self.options.region or "us-east-1",
                    config=Config(**self._config, max_pool_connections=self.options.concurrency + 4))
            return self._client

    def _call(self, method: str, **kwargs):
        """One data-path request; an S3 error becomes the builtin s3fs would raise (FileNotFoundError,
        PermissionError, an OSError carrying the ClientError as its cause for the retry layer to classify)."""
        from botocore.exceptions import ClientError
        from s3fs.errors import translate_boto_error

        try:
            return getattr(self._data(), method)(**kwargs)
        except ClientError as exc:
            raise translate_boto_error(exc) from exc

    def _part_retry(self, what: str, fn):
        # Part retries are part of the one retry layer: once a part has used its budget the whole write fails
        # with a StoreError, which the store's outer retry does not repeat (attempts never multiply).
        return retry_or_unavailable(self.options.retry, what, fn, self.stats)

    # -- primitives -------------------------------------------------------------------------------------
    def write(self, path: str, data: Source, *, create_only: bool = False) -> tuple[int, str]:
        part = self.options.part_size
        try:
            if isinstance(data, Spool):
                if (sent := self._write_spool(path, data, create_only)) is not None:
                    return sent
                data = data.read_range(0, data.size)
            if isinstance(data, Pieces):
                if data.nbytes >= 2 * part:  # each part joined from the pieces it spans: one part per worker
                    create_only = self._claim(path, create_only)
                    return self._write_multipart(path, data.nbytes, data.read, create_only,
                                                 hash_source=lambda: digest_bytes(data))
                data = data.tobytes()
            if not isinstance(data, (bytes, bytearray, memoryview)):
                return self._write_stream(path, data, self._claim(path, create_only))
            data = bytes(data) if not isinstance(data, bytes) else data
            if len(data) < 2 * part:
                size, sha = len(data), digest_bytes(data)
                self.fs.pipe_file(path, data, mode="create" if create_only else "overwrite")
                return size, sha
            view = memoryview(data)
            create_only = self._claim(path, create_only)
            return self._write_multipart(path, len(data), lambda a, b: bytes(view[a:b]), create_only)
        except FileNotFoundError:
            # s3fs reports a CompleteMultipartUpload whose response was lost as NoSuchUpload (its re-send finds the
            # upload already completed): the object may well be there, with our size (an empty claim is not).  The
            # caller's read-back verify checks its bytes, so claiming it here is safe.
            size = data.size if isinstance(data, Spool) else nbytes(data) if isinstance(data, IN_MEMORY) else None
            if size is not None and self._size(path) == size:
                log.warning("the write of %s reported a lost completion "
                            "but the object exists; verify will check it", path)
                return size, data.sha256 if isinstance(data, Spool) else digest_bytes(data)
            raise
        except OSError as exc:
            if _is_precondition_failed(exc) and not isinstance(exc, FileExistsError):
                raise FileExistsError(f"{path} already exists (412 Precondition Failed)") from exc
            raise

    def _write_spool(self, path: str, data: Spool, create_only: bool) -> tuple[int, str] | None:
        """A spool of two parts or more as a multipart upload, its parts read from the file in parallel (never the
        whole object in memory); a :class:`LiveSpool` still being written, while it is written
        (:meth:`_write_live`). None for a smaller one: the caller sends it in one PUT."""
        part = self.options.part_size
        if isinstance(data, LiveSpool) and not data.done:
            part = part_size_for(max(data.expected, 1), part)
            if data.available(2 * part) >= 2 * part:
                create_only = self._claim(path, create_only)
                sent = self._write_live(path, data, part, create_only)
                if sent is not None:
                    return sent
                # It outgrew its expected size: the finished file, in parts of its own size, over our claim.
                return self._write_multipart(path, data.size, data.read_range, create_only, sha=data.sha256)
        if data.size >= 2 * self.options.part_size:
            create_only = self._claim(path, create_only)
            return self._write_multipart(path, data.size, data.read_range, create_only, sha=data.sha256)
        return None

    def _write_live(self, path: str, data: LiveSpool, part: int, create_only: bool) -> tuple[int, str] | None:
        """Upload a spool while it is being written (its key claimed when needed, :meth:`_claim`): each part of
        ``part`` bytes as soon as they exist, at most ``concurrency`` read and in flight at once, so the upload runs
        beside the serialisation. A file that turns out to need more than :data:`MAX_PARTS` such parts has its
        upload aborted, and None is returned for the finished file to be uploaded instead."""
        slots = threading.Semaphore(self.options.concurrency)  # parts read and in flight: the memory bound
        failed = threading.Event()
        try:
            with self._multipart(path) as (bucket, key, upload_id):

                def put(number: int, start: int, end: int) -> dict:
                    try:
                        body = data.read_range(start, end)
                        if len(body) != end - start:  # the written bytes are in the file: shorter means it shrank
                            raise OSError(f"{path}: part {number} read {len(body)} bytes of {end - start} from the "
                                          "spool; the local file changed while it was uploaded")
                        return self._send_part(bucket, key, upload_id, number, body, "still being written")
                    except BaseException:
                        failed.set()
                        raise
                    finally:
                        slots.release()

                with ThreadPoolExecutor(max_workers=self.options.concurrency) as pool:
                    futures: list = []
                    start = 0
                    while not failed.is_set() and (end := data.available(start + part)) > start:
                        if len(futures) == MAX_PARTS:
                            raise _TooManyParts()
                        slots.acquire()
                        futures.append(pool.submit(put, len(futures) + 1, start, end))
                        start = end
                    parts = [f.result() for f in futures]  # a failed part raises here
                size, sha = data.size, data.sha256  # the writer's: the read-back verification compares with it
                self._complete(path, bucket, key, upload_id, parts, size, create_only)
        except _TooManyParts:
            log.info("%s grew past %d parts of %d bytes while it was uploaded; uploading the finished file",
                     path, MAX_PARTS, part)
            return None
        self.fs.invalidate_cache(path)
        return size, sha

    @contextlib.contextmanager
    def _multipart(self, path: str) -> Iterator[tuple[str, str, str]]:
        """A multipart upload to ``path``: (bucket, key, upload id), aborted when the block raises, so no object
        appears (an abort that fails is left to the start-up sweep of unfinished uploads)."""
        bucket, key, _ = self.fs.split_path(path)
        upload_id = self._call("create_multipart_upload", Bucket=bucket, Key=key)["UploadId"]
        try:
            yield bucket, key, upload_id
        except BaseException:
            try:
                self._call("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id)
            except Exception:  # noqa: BLE001,S110 - the sweep collects what an abort could not
                pass
            raise

    def _send_part(self, bucket: str, key: str, upload_id: str, number: int, body, note: str) -> dict:
        """Upload one part, retried on its own (UploadPart is idempotent); its entry for the completion."""
        out = self._part_retry(f"upload part {number} ({note}) of {key}", lambda: self._call(
            "upload_part", Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=body))
        return {"PartNumber": number, "ETag": out["ETag"]}

    def _claim(self, path: str, create_only: bool) -> bool:
        """Before a create-only write that may end in a multipart completion on an endpoint whose completions are
        not create-only: take the key with a create-only PUT of an empty object (FileExistsError when it exists),
        so the upload that follows replaces only this writer's own claim. Returns the ``create_only`` to pass on
        (False once claimed: the key is ours)."""
        if not create_only or self.multipart_create_only:
            return create_only
        self.fs.pipe_file(path, b"", mode="create")
        return False

    def _write_multipart(self, path: str, size: int, read_range, create_only: bool, *,
                         sha: str | None = None, hash_source=None) -> tuple[int, str]:
        """Concurrent multipart upload of ``size`` bytes read by ``read_range(start, end)`` (a slice of bytes in
        memory, or ``os.pread`` of a spool: at most ``concurrency`` parts are read at a time), each part retried on
        its own (UploadPart is idempotent), and the upload aborted on failure so no object appears. ``sha``: the
        bytes' digest when known (a spool's); otherwise computed in parallel with the upload, by ``hash_source()``
        when given (bytes already in memory, hashed where they lie), else from ``read_range``."""
        part = part_size_for(size, self.options.part_size)
        spans = [(n + 1, off, min(off + part, size)) for n, off in enumerate(range(0, size, part))]

        def whole_sha() -> str:
            digest = FileHasher()
            for start, end in ((s, min(s + part, size)) for s in range(0, size, part)):
                digest.update(read_range(start, end))  # hashlib releases the GIL
            return digest.hexdigest()

        with self._multipart(path) as (bucket, key, upload_id):

            def put(span):
                number, start, end = span
                body = read_range(start, end)  # one part in memory per worker thread
                return self._send_part(bucket, key, upload_id, number, body, f"of {len(spans)}")

            with ThreadPoolExecutor(max_workers=self.options.concurrency + 1) as pool:
                digest = pool.submit(hash_source or whole_sha) if sha is None else None
                parts = list(pool.map(put, spans))
            sha = sha if digest is None else digest.result()
            self._complete(path, bucket, key, upload_id, parts, size, create_only)
        self.fs.invalidate_cache(path)
        return size, sha

    def _complete(self, path, bucket, key, upload_id, parts, size, create_only) -> None:
        match = {"IfNoneMatch": "*"} if create_only else {}
        try:
            self._call("complete_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id,
                       MultipartUpload={"Parts": parts}, **match)
        except Exception as exc:
            # A completion whose response was lost (connection reset, timeout) may have landed: an object of our
            # size is claimed instead of re-uploading everything; the caller's read-back verify checks its bytes.
            if is_transient(exc) and self._size(path) == size:
                log.warning("the write of %s reported a lost completion "
                            "but the object exists; verify will check it", path)
                return
            raise

    def _size(self, path: str) -> int | None:
        try:
            return int(self.fs.info(path, refresh=True)["size"])
        except FileNotFoundError:
            return None

    def _write_stream(self, path: str, data, create_only: bool) -> tuple[int, str]:
        # Not `with fs.open(...)`: s3fs commits a partial object when the block exits on an exception.
        fh = self.fs.open(path, "xb" if create_only else "wb", block_size=self.options.part_size)
        sha, size = FileHasher(), 0
        try:
            for chunk in iter_chunks(data):
                sha.update(chunk)
                fh.write(chunk)
                size += len(chunk)
        except BaseException:
            fh.discard()  # aborts the multipart upload; nothing is published
            raise
        fh.close()
        return size, sha.hexdigest()

    def read(self, path: str) -> bytes:
        return self.fs.cat_file(path)

    def read_range(self, path: str, start: int, end: int) -> bytes:
        bucket, key, _ = self.fs.split_path(path)
        try:
            body = self._call("get_object", Bucket=bucket, Key=key, Range=f"bytes={start}-{end - 1}")["Body"]
        except OSError as exc:
            if _status(exc) == 416:  # the object ends before ``start``: nothing there (it is shorter than claimed)
                return b""
            raise
        try:
            return body.read()
        finally:
            body.close()

    def iter_read(self, path: str) -> Iterator[bytes]:
        # One GET whose body is read chunk by chunk: closing early drops the connection instead of downloading
        # the rest, so hashing or capping never holds the whole object (s3fs's cat_file would).
        from fsspec.asyn import sync

        bucket, key, _ = self.fs.split_path(path)
        body = self.fs.call_s3("get_object", Bucket=bucket, Key=key)["Body"]
        try:
            while block := sync(self.fs.loop, body.read, CHUNK):
                yield block
        finally:
            body.close()

    def listdir(self, path: str, *, prefix: str = "", limit: int | None = None) -> list[Entry]:
        # Our own paginated ListObjectsV2 (s3fs's ls lists every key into memory first): the prefix narrows the
        # listing server-side and ``limit`` stops paging, so a prefix with millions of keys costs one page.
        out: list[Entry] = []
        for entry in self.iterdir(path, prefix=prefix):
            out.append(entry)
            if limit is not None and len(out) > limit:
                break
        return out

    def iterdir(self, path: str, *, prefix: str = "") -> Iterator[Entry]:
        """The children page by page, as they come (``trainproof.storage.backend.StreamsListing``)."""
        bucket, key, _ = self.fs.split_path(path)
        base = f"{key.rstrip('/')}/" if key else ""
        kwargs = {"Bucket": bucket, "Prefix": base + prefix, "Delimiter": "/"}
        while True:
            try:
                page = self.fs.call_s3("list_objects_v2", **kwargs)
            except FileNotFoundError:
                return
            for cp in page.get("CommonPrefixes", []):
                yield Entry(cp["Prefix"][len(base):].rstrip("/"), 0, True, None)
            for obj in page.get("Contents", []):
                name = obj["Key"][len(base):]
                if name:  # not the folder's own "dir/" marker object
                    mtime = obj.get("LastModified")
                    yield Entry(name, int(obj.get("Size") or 0), False,
                                mtime.timestamp() if mtime is not None else None)
            if not page.get("IsTruncated") or not page.get("NextContinuationToken"):
                return
            kwargs["ContinuationToken"] = page["NextContinuationToken"]

    def itertree(self, path: str, *, prefix: str = "", cap: int | None = None) -> Iterator[tuple[str, Entry]]:
        """Every object below ``path``'s folders named ``prefix…``, page by page (``trainproof.storage.backend.
        ListsTrees``); a folder past ``cap`` children is skipped by listing on after its last possible key."""
        bucket, key, _ = self.fs.split_path(path)
        base = f"{key.rstrip('/')}/" if key else ""
        kwargs: dict = {"Bucket": bucket, "Prefix": base + prefix}
        counts: dict[str, int] = {}
        while True:
            try:
                page = self.fs.call_s3("list_objects_v2", **kwargs)
            except FileNotFoundError:
                return
            full = None
            for obj in page.get("Contents", []):
                folder, sep, rest = obj["Key"][len(base):].partition("/")
                if not sep or not rest:  # an object beside the folders, or a folder's own "dir/" marker
                    continue
                counts[folder] = seen = counts.get(folder, 0) + 1
                if cap is not None and seen > cap + 1:
                    full = folder
                    break
                yield folder, _child(rest, obj)
            if full is not None:  # list on after the last key a folder can have ('/' + the last code point)
                kwargs.pop("ContinuationToken", None)
                kwargs["StartAfter"] = f"{base}{full}/\U0010ffff"
                continue
            if not page.get("IsTruncated") or not page.get("NextContinuationToken"):
                return
            kwargs["ContinuationToken"] = page["NextContinuationToken"]

    def exists(self, path: str) -> bool:
        try:
            self.fs.info(path, refresh=True)
            return True
        except FileNotFoundError:
            return False

    def delete_tree(self, path: str) -> None:
        try:
            self.fs.rm(path, recursive=True)
        except FileNotFoundError:
            pass
        self.fs.invalidate_cache(path)

    # -- endpoint checks ----------------------------------------------------------------------------------
    def create_bucket(self, bucket: str) -> bool:
        """Create ``bucket`` (in the configured region on AWS); False when this account already has it.
        StoreConfigError when the name is refused, another account owns it, or creating buckets is not allowed."""
        from botocore.exceptions import ClientError, ParamValidationError
        from s3fs.errors import translate_boto_error

        kwargs: dict[str, Any] = {"Bucket": bucket}
        if self.options.region and self.options.region != "us-east-1" and not self.options.endpoint_url:
            kwargs["CreateBucketConfiguration"] = {"LocationConstraint": self.options.region}
        try:
            try:
                self._data().head_bucket(Bucket=bucket)
                return False
            except ClientError as exc:  # missing, or not ours to look at: creating it says which
                if exc.response.get("Error", {}).get("Code") not in ("404", "NoSuchBucket", "403", "AccessDenied"):
                    raise
            self._data().create_bucket(**kwargs)
        except ParamValidationError:
            raise StoreConfigError(_CREATE_REFUSED["InvalidBucketName"].format(bucket=bucket)) from None
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code", "")
            if code == "BucketAlreadyOwnedByYou":
                return False
            if code in _CREATE_REFUSED:
                raise StoreConfigError(_CREATE_REFUSED[code].format(bucket=bucket, code=code)) from None
            raise translate_boto_error(exc) from exc
        return True

    def check_access(self, bucket: str, prefix: str = "") -> None:
        """Fail fast, with one clear line, on a missing bucket or refused credentials (StoreConfigError).

        A list of at most one key under the run's prefix, not HeadBucket: AWS authorises HeadBucket as an
        unprefixed ``s3:ListBucket``, which a policy scoped to the run's prefix refuses. An unreachable endpoint
        or a 5xx is *not* a configuration error (a MinIO pod may still be starting): the error is re-raised for
        the caller's bounded retry, which ends in StoreUnavailableError (exit 1), never exit 2."""
        where = redact_url(self.options.endpoint_url) if self.options.endpoint_url else "AWS S3"
        try:
            self.fs.call_s3("list_objects_v2", Bucket=bucket, Prefix=f"{prefix}/" if prefix else "", MaxKeys=1)
        except FileNotFoundError:
            raise StoreConfigError(f"bucket '{bucket}' does not exist at "
                                   f"{where}: create it or fix the --store URL") from None
        except PermissionError:
            raise StoreConfigError(
                f"access to bucket '{bucket}' at {where} was refused (403): check AWS_ACCESS_KEY_ID/"
                "AWS_SECRET_ACCESS_KEY, the profile or the IAM role, and the bucket policy") from None
        except Exception as exc:
            name = type(exc).__name__
            if name == "NoCredentialsError":
                raise StoreConfigError(
                    "no AWS credentials found: set "
                    "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or an IAM role") from None
            if "Connect" in name or "Endpoint" in name or isinstance(exc, (ConnectionError, TimeoutError)):
                raise ConnectionError(f"cannot reach the S3 endpoint {where}: if it keeps failing, check "
                                      "AWS_ENDPOINT_URL / --endpoint-url") from None
            raise

    def probe_create_only(self, scratch: str) -> bool:
        """Whether a second create-only PUT of one scratch key is refused (``If-None-Match: *``). Some servers accept
        and silently ignore the header, which would let two writers both commit. When it is refused, also probe a
        multipart completion over that key (:attr:`multipart_create_only`)."""
        key = f"{scratch}/probe-{uuid.uuid4().hex}"
        try:
            try:
                self.write(key, b"1", create_only=True)
                self.write(key, b"2", create_only=True)
            except FileExistsError:  # the second PUT, or our first one re-sent after a lost response
                self.multipart_create_only = self._refuses_completion_over(key)
                return True
            return False
        finally:
            self.delete(key)

    def _refuses_completion_over(self, key: str) -> bool:
        """Whether a CompleteMultipartUpload with ``If-None-Match: *`` over the existing ``key`` is refused (412);
        a refused upload stays open on some servers (moto), so it is aborted either way."""
        bucket, name, _ = self.fs.split_path(key)
        upload = self.fs.call_s3("create_multipart_upload", Bucket=bucket, Key=name)["UploadId"]
        try:
            etag = self.fs.call_s3("upload_part", Bucket=bucket, Key=name, UploadId=upload, PartNumber=1,
                                   Body=b"3")["ETag"]
            self.fs.call_s3("complete_multipart_upload", Bucket=bucket, Key=name, UploadId=upload,
                            MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": etag}]}, IfNoneMatch="*")
        except OSError as exc:
            if not _is_precondition_failed(exc):
                raise
            refused = True
        else:
            refused = False
            log.info("the S3 endpoint %s completes a multipart upload over an existing object despite "
                        "If-None-Match: * (only plain PUTs are create-only there): large files claim their name with "
                        "a create-only PUT before uploading", redact_url(self.options.endpoint_url or "AWS S3"))
        try:
            self.fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=name, UploadId=upload)
        except Exception:  # completed (nothing to abort), or left for the multipart sweep
            pass
        return refused

    def sweep_multipart(self, bucket: str, prefix: str, older_than: float) -> int:
        """Abort unfinished multipart uploads under ``prefix`` started more than ``older_than`` s ago."""
        now, aborted = time.time(), 0
        kwargs = {"Bucket": bucket, "Prefix": prefix.rstrip("/") + "/"}
        while True:
            page = self.fs.call_s3("list_multipart_uploads", **kwargs)
            for up in page.get("Uploads", []):
                started = up.get("Initiated")
                if started is not None and now - started.timestamp() < older_than:
                    continue  # may belong to a live writer
                self.fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=up["Key"], UploadId=up["UploadId"])
                log.warning("aborted an unfinished multipart upload "
                            "of s3://%s/%s (left by a killed writer)", bucket, up["Key"])
                aborted += 1
            if not page.get("IsTruncated"):
                return aborted
            kwargs["KeyMarker"] = page.get("NextKeyMarker")
            kwargs["UploadIdMarker"] = page.get("NextUploadIdMarker")


__all__ = ["S3Backend", "CHUNK"]


def _child(rest: str, obj: dict) -> Entry:
    """The entry a listed object makes in its folder: itself, or (a deeper key) the sub-folder holding it."""
    name, deeper, _ = rest.partition("/")
    if deeper:
        return Entry(name, 0, True, None)
    mtime = obj.get("LastModified")
    return Entry(name, int(obj.get("Size") or 0), False, mtime.timestamp() if mtime is not None else None)
