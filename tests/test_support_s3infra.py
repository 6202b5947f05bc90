"""Tests for tests/support: moto S3 server on loopback + the fault-injecting proxy.

They show the infrastructure works (bytes round-trip, keep-alive, chunked bodies, SigV4 still
valid through the proxy) and that it can fail on purpose (503/500/403, RST, stalls, writes that
land while their response is lost), through boto3 and through s3fs.
"""

from __future__ import annotations

import base64
import errno
import http.client
import os
import socket
import threading
import time
import zlib

import botocore.exceptions
import pytest
from botocore.exceptions import ClientError

from tests.support.timing import budget
from tests.support.faultproxy import Fault, FaultProxy
from tests.support.s3server import S3Server, dummy_aws_env, make_boto3_client

pytestmark = pytest.mark.s3

MiB = 2**20


@pytest.fixture(autouse=True)
def _aws_env(monkeypatch):
    for k, v in dummy_aws_env().items():
        monkeypatch.setenv(k, v)


@pytest.fixture(scope="module")
def s3():
    with S3Server() as srv:
        yield srv


@pytest.fixture
def proxy(s3):
    with FaultProxy(s3.endpoint, seed=0) as p:
        yield p


@pytest.fixture
def bucket(s3):
    return s3.create_bucket()


def _chain(exc: BaseException | None):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _has_reset(exc: BaseException) -> bool:
    return any(
        isinstance(e, ConnectionResetError) or getattr(e, "errno", None) == errno.ECONNRESET
        for e in _chain(exc)
    )


def _exists(s3, bucket, key) -> bool:
    try:
        s3.boto3_client().head_object(Bucket=bucket, Key=key)
        return True
    except ClientError as e:
        assert e.response["ResponseMetadata"]["HTTPStatusCode"] == 404
        return False


def _mpu_put(client, bucket, key, data, part_size=5 * MiB):
    mpu = client.create_multipart_upload(Bucket=bucket, Key=key)
    parts = []
    for i, off in enumerate(range(0, len(data), part_size), start=1):
        r = client.upload_part(
            Bucket=bucket, Key=key, UploadId=mpu["UploadId"], PartNumber=i,
            Body=data[off : off + part_size],
        )
        parts.append({"PartNumber": i, "ETag": r["ETag"]})
    return client.complete_multipart_upload(
        Bucket=bucket, Key=key, UploadId=mpu["UploadId"], MultipartUpload={"Parts": parts}
    )


# -- plumbing: things work ----------------------------------------------------------------------


def test_dummy_env_and_endpoint(s3):
    env = dummy_aws_env()
    assert env["AWS_ACCESS_KEY_ID"] and env["AWS_SECRET_ACCESS_KEY"]
    assert os.environ["AWS_ACCESS_KEY_ID"] == env["AWS_ACCESS_KEY_ID"]
    assert s3.endpoint.startswith("http://127.0.0.1:") and s3.port > 0


def test_small_roundtrip_through_proxy(s3, proxy, bucket):
    c = s3.boto3_client(proxy.endpoint)
    c.put_object(Bucket=bucket, Key="dir/a.bin", Body=b"\x00hello\xff")
    assert c.get_object(Bucket=bucket, Key="dir/a.bin")["Body"].read() == b"\x00hello\xff"
    assert c.head_object(Bucket=bucket, Key="dir/a.bin")["ContentLength"] == 7
    assert [o["Key"] for o in c.list_objects_v2(Bucket=bucket, Prefix="dir/")["Contents"]] == ["dir/a.bin"]
    assert c.get_object(Bucket=bucket, Key="dir/a.bin", Range="bytes=1-5")["Body"].read() == b"hello"
    c.delete_object(Bucket=bucket, Key="dir/a.bin")
    assert not _exists(s3, bucket, "dir/a.bin")
    st = proxy.stats
    assert st.requests == st.forwarded == 6
    assert st.injected_total == 0 and st.upstream_errors == 0
    assert st.connections == 1  # one keep-alive connection for everything
    assert [e.status for e in proxy.events] == [200, 200, 200, 200, 206, 204]


def test_multipart_roundtrip_through_proxy(s3, proxy, bucket):
    data = os.urandom(12 * MiB)
    c = s3.boto3_client(proxy.endpoint)
    _mpu_put(c, bucket, "big.bin", data)
    assert c.get_object(Bucket=bucket, Key="big.bin")["Body"].read() == data
    assert proxy.stats.forwarded == 1 + 3 + 1 + 1


def test_chunked_request_bodies_are_forwarded(s3, proxy, bucket):
    """Transport-chunked bodies (plain and carrying an aws-chunked payload with a trailer)."""
    conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=budget(10))
    try:
        conn.request("PUT", f"/{bucket}/plain", body=iter([b"hello ", b"chunked ", b"world"]),
                     encode_chunked=True, headers={"Transfer-Encoding": "chunked"})
        r = conn.getresponse()
        r.read()
        assert r.status == 200

        payload = os.urandom(70_000)
        crc = base64.b64encode(zlib.crc32(payload).to_bytes(4, "big"))
        aws = b"%x\r\n%s\r\n%x\r\n%s\r\n0\r\nx-amz-checksum-crc32:%s\r\n\r\n" % (
            65536, payload[:65536], len(payload) - 65536, payload[65536:], crc)
        conn.request("PUT", f"/{bucket}/aws", body=iter([aws[:1000], aws[1000:]]), encode_chunked=True,
                     headers={"Transfer-Encoding": "chunked", "Content-Encoding": "aws-chunked",
                              "x-amz-content-sha256": "STREAMING-UNSIGNED-PAYLOAD-TRAILER",
                              "x-amz-decoded-content-length": str(len(payload)),
                              "x-amz-trailer": "x-amz-checksum-crc32"})
        r = conn.getresponse()
        r.read()
        assert r.status == 200
    finally:
        conn.close()
    direct = s3.boto3_client()
    assert direct.get_object(Bucket=bucket, Key="plain")["Body"].read() == b"hello chunked world"
    assert direct.get_object(Bucket=bucket, Key="aws")["Body"].read() == payload
    assert proxy.stats.connections == 1


def test_sigv4_signatures_still_validate_through_proxy(s3, proxy, bucket):
    with s3.iam_auth() as (key, secret):
        good = make_boto3_client(proxy.endpoint, key=key, secret=secret)
        good.put_object(Bucket=bucket, Key="signed", Body=b"ok")
        assert good.get_object(Bucket=bucket, Key="signed")["Body"].read() == b"ok"
        fs = s3.s3fs(proxy.endpoint, key=key, secret=secret)
        fs.pipe_file(f"{bucket}/signed-fs", b"ok2", mode="create")
        assert fs.cat_file(f"{bucket}/signed-fs") == b"ok2"
        bad = make_boto3_client(proxy.endpoint, key=key, secret=secret + "x")
        with pytest.raises(ClientError) as ei:
            bad.put_object(Bucket=bucket, Key="unsigned", Body=b"no")
        assert ei.value.response["Error"]["Code"] == "SignatureDoesNotMatch"
    assert not _exists(s3, bucket, "unsigned")


# -- injected faults through boto3 --------------------------------------------------------------


def test_slowdown_is_a_503_and_does_not_forward(s3, proxy, bucket):
    c = s3.boto3_client(proxy.endpoint)  # total_max_attempts=1: no botocore retries
    c.put_object(Bucket=bucket, Key="pre", Body=b"x")
    proxy.set_faults([Fault(kind="slowdown", rate=1.0, methods={"PUT"})], seed=1)
    with pytest.raises(ClientError) as ei:
        c.put_object(Bucket=bucket, Key="k", Body=b"data")
    err = ei.value.response
    assert err["Error"]["Code"] == "SlowDown"
    assert err["ResponseMetadata"]["HTTPStatusCode"] == 503
    assert c.get_object(Bucket=bucket, Key="pre")["Body"].read() == b"x"  # GET not selected
    assert not _exists(s3, bucket, "k")
    st = proxy.stats
    assert st.injected == {"slowdown": 1}
    assert st.requests == 3 and st.forwarded == 2
    assert st.connections == 1  # an injected error response keeps the connection alive


def test_internal_error_is_a_500(s3, proxy, bucket):
    c = s3.boto3_client(proxy.endpoint)
    proxy.set_faults([Fault("internal", methods={"GET", "HEAD"})])
    with pytest.raises(ClientError) as ei:
        c.get_object(Bucket=bucket, Key="nope")
    assert ei.value.response["Error"]["Code"] == "InternalError"
    assert ei.value.response["ResponseMetadata"]["HTTPStatusCode"] == 500
    with pytest.raises(ClientError) as ei:  # HEAD errors have no body: botocore uses the status
        c.head_object(Bucket=bucket, Key="nope")
    assert ei.value.response["ResponseMetadata"]["HTTPStatusCode"] == 500


@pytest.mark.parametrize("code", ["AccessDenied", "InvalidAccessKeyId"])
def test_forbidden_is_a_403(s3, proxy, bucket, code):
    c = s3.boto3_client(proxy.endpoint)
    proxy.set_faults([Fault("forbidden", code=code)])
    with pytest.raises(ClientError) as ei:
        c.put_object(Bucket=bucket, Key="k", Body=b"x")
    assert ei.value.response["Error"]["Code"] == code
    assert ei.value.response["ResponseMetadata"]["HTTPStatusCode"] == 403
    assert not _exists(s3, bucket, "k")


def test_custom_error_kind(s3, proxy, bucket):
    c = s3.boto3_client(proxy.endpoint)
    proxy.set_faults([Fault("error", status=409, code="ConditionalRequestConflict",
                            message="A conflicting operation occurred.")])
    with pytest.raises(ClientError) as ei:
        c.put_object(Bucket=bucket, Key="k", Body=b"x", IfNoneMatch="*")
    assert ei.value.response["Error"]["Code"] == "ConditionalRequestConflict"
    assert ei.value.response["ResponseMetadata"]["HTTPStatusCode"] == 409


def test_reset_is_a_connection_error_and_nothing_lands(s3, proxy, bucket):
    c = s3.boto3_client(proxy.endpoint)
    proxy.set_faults([Fault("reset", methods={"PUT"})])
    with pytest.raises(botocore.exceptions.ConnectionClosedError) as ei:
        c.put_object(Bucket=bucket, Key="k", Body=b"x" * 1000)
    assert _has_reset(ei.value)  # a real RST, not a clean FIN
    assert not _exists(s3, bucket, "k")
    assert proxy.stats.injected == {"reset": 1} and proxy.stats.forwarded == 0
    proxy.clear_faults()
    c.put_object(Bucket=bucket, Key="k", Body=b"y")  # the client recovers on a new connection
    assert proxy.stats.connections == 2


def test_reset_after_forward_write_lands_then_retry_gets_412(s3, proxy, bucket):
    """The ambiguous write: the create committed, its response was lost, the retry sees 412."""
    c = s3.boto3_client(proxy.endpoint)
    proxy.set_faults([Fault("reset_after_forward", methods={"PUT"}, max_count=1)])
    with pytest.raises(botocore.exceptions.ConnectionClosedError) as ei:
        c.put_object(Bucket=bucket, Key="marker", Body=b"attempt-1", IfNoneMatch="*")
    assert _has_reset(ei.value)
    assert s3.boto3_client().get_object(Bucket=bucket, Key="marker")["Body"].read() == b"attempt-1"
    with pytest.raises(ClientError) as ei:  # max_count=1: the retry goes through
        c.put_object(Bucket=bucket, Key="marker", Body=b"attempt-1", IfNoneMatch="*")
    err = ei.value.response
    assert err["ResponseMetadata"]["HTTPStatusCode"] == 412
    assert err["Error"]["Code"] == "PreconditionFailed"
    assert err["Error"].get("Condition") == "If-None-Match"
    assert proxy.stats.forwarded == 2 and proxy.stats.injected == {"reset_after_forward": 1}


def test_stall_triggers_client_read_timeout(s3, proxy, bucket):
    c = s3.boto3_client(proxy.endpoint, read_timeout=0.3)
    proxy.set_faults([Fault("stall", stall_s=5)])
    t0 = time.monotonic()
    with pytest.raises(botocore.exceptions.ReadTimeoutError):
        c.put_object(Bucket=bucket, Key="k", Body=b"x")
    assert time.monotonic() - t0 < 3
    assert not _exists(s3, bucket, "k")


def test_stall_after_forward_lands(s3, proxy, bucket):
    c = s3.boto3_client(proxy.endpoint, read_timeout=0.3)
    proxy.set_faults([Fault("stall_after_forward", stall_s=5, methods={"PUT"})])
    with pytest.raises(botocore.exceptions.ReadTimeoutError):
        c.put_object(Bucket=bucket, Key="k", Body=b"landed")
    assert s3.boto3_client().get_object(Bucket=bucket, Key="k")["Body"].read() == b"landed"


def test_selection_by_path_skip_first_and_max_count(s3, proxy, bucket):
    c = s3.boto3_client(proxy.endpoint)
    # only CompleteMultipartUpload (POST ...?uploadId=), and only once
    proxy.set_faults([Fault("slowdown", methods={"POST"}, path_contains="uploadId=", max_count=1)])
    data = os.urandom(6 * MiB)
    with pytest.raises(ClientError) as ei:
        _mpu_put(c, bucket, "mpu", data)
    assert ei.value.operation_name == "CompleteMultipartUpload"
    assert not _exists(s3, bucket, "mpu")
    _mpu_put(c, bucket, "mpu", data)  # budget spent
    assert s3.boto3_client().get_object(Bucket=bucket, Key="mpu")["Body"].read() == data
    (_, matched, injected), = proxy.fault_counts()
    assert (matched, injected) == (2, 1)

    proxy.set_faults([Fault("internal", methods={"PUT"}, path_regex=r"/n\d$", skip_first=1, max_count=1)])
    outcomes = []
    for i in range(4):
        try:
            c.put_object(Bucket=bucket, Key=f"n{i}", Body=b"x")
            outcomes.append("ok")
        except ClientError as e:
            outcomes.append(e.response["Error"]["Code"])
    assert outcomes == ["ok", "InternalError", "ok", "ok"]
    assert [_exists(s3, bucket, f"n{i}") for i in range(4)] == [True, False, True, True]


def test_seeded_rate_is_deterministic(s3, proxy, bucket):
    c = s3.boto3_client(proxy.endpoint)
    c.put_object(Bucket=bucket, Key="k", Body=b"x")

    def pattern(seed):
        proxy.set_faults([Fault("slowdown", rate=0.5, methods={"HEAD"})], seed=seed)
        out = []
        for _ in range(40):
            try:
                c.head_object(Bucket=bucket, Key="k")
                out.append(0)
            except ClientError:
                out.append(1)
        return out

    a, b, other = pattern(7), pattern(7), pattern(8)
    assert a == b
    assert a != other
    assert 5 < sum(a) < 35


def test_botocore_retries_recover_from_injected_slowdowns(s3, proxy, bucket):
    c = s3.boto3_client(proxy.endpoint, total_max_attempts=2)  # standard mode: backoff <= 1 s
    proxy.set_faults([Fault("slowdown", methods={"PUT"}, max_count=1)])
    c.put_object(Bucket=bucket, Key="k", Body=b"eventually")
    assert proxy.stats.injected == {"slowdown": 1} and proxy.stats.forwarded == 1
    assert s3.boto3_client().get_object(Bucket=bucket, Key="k")["Body"].read() == b"eventually"


def test_stop_is_bounded_with_idle_and_stalled_connections(s3, bucket):
    p = FaultProxy(s3.endpoint).start()
    c = s3.boto3_client(p.endpoint, read_timeout=30)
    c.put_object(Bucket=bucket, Key="k", Body=b"x")  # leaves an idle keep-alive connection
    p.set_faults([Fault("stall", stall_s=60)])
    errors = []

    def stalled():
        try:
            s3.boto3_client(p.endpoint, read_timeout=30).get_object(Bucket=bucket, Key="k")
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    t = threading.Thread(target=stalled, daemon=True)
    t.start()
    deadline = time.monotonic() + 5
    while p.stats.injected.get("stall", 0) == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    t0 = time.monotonic()
    p.stop()
    assert time.monotonic() - t0 < 3
    t.join(5)
    assert not t.is_alive() and errors


# -- through s3fs (aiobotocore) -----------------------------------------------------------------


def test_s3fs_create_twice_single_put_raises_file_exists(s3, proxy, bucket):
    fs = s3.s3fs(proxy.endpoint)
    path = f"{bucket}/gen-1/COMMIT"
    fs.pipe_file(path, b"first", mode="create")
    with pytest.raises(FileExistsError) as ei:
        fs.pipe_file(path, b"second", mode="create")
    cause = ei.value.__cause__
    assert isinstance(cause, ClientError)
    assert cause.response["Error"]["Code"] == "PreconditionFailed"
    assert cause.response["Error"]["Condition"] == "If-None-Match"
    assert fs.cat_file(path) == b"first"


def test_s3fs_create_twice_multipart_raises_file_exists(s3, proxy, bucket):
    fs = s3.s3fs(proxy.endpoint)
    path = f"{bucket}/big.bin"
    data = os.urandom(12 * MiB)
    fs.pipe_file(path, data, mode="create", chunksize=5 * MiB)
    with pytest.raises(FileExistsError) as ei:
        fs.pipe_file(path, data[::-1], mode="create", chunksize=5 * MiB)
    assert ei.value.__cause__.operation_name == "CompleteMultipartUpload"
    assert fs.cat_file(path) == data
    # the 412 happened on CompleteMultipartUpload, then s3fs aborted the upload
    statuses = [(e.method, e.status) for e in proxy.events if "uploadId=" in e.target]
    assert ("POST", 412) in statuses and ("DELETE", 204) in statuses
    assert not s3.boto3_client().list_multipart_uploads(Bucket=bucket).get("Uploads")


def test_s3fs_lost_put_response_is_resent_by_aiohttp_and_reads_as_file_exists(s3, proxy, bucket):
    """aiohttp silently re-sends an idempotent method (PUT/GET/HEAD/DELETE) once after a
    connection reset, below botocore's and s3fs's retry counting.  A create-only PUT whose
    response was lost therefore comes back as FileExistsError on the FIRST call, although the
    object is our own write (DESIGN: "a 412 can be your own write")."""
    fs = s3.s3fs(proxy.endpoint)
    path = f"{bucket}/marker"
    proxy.set_faults([Fault("reset_after_forward", methods={"PUT"}, max_count=1)])
    with pytest.raises(FileExistsError):
        fs.pipe_file(path, b"mine", mode="create")
    assert [(e.method, e.outcome, e.status) for e in proxy.wait_for_events(2)] == [
        ("PUT", "reset_after_forward", None), ("PUT", "forwarded", 412)]
    assert fs.cat_file(path) == b"mine"

    # every attempt loses its response: aiobotocore says EndpointConnectionError ("Could not
    # connect"), s3fs passes it through untranslated, and the write has landed anyway.
    proxy.set_faults([Fault("reset_after_forward", methods={"PUT"})])
    with pytest.raises(botocore.exceptions.EndpointConnectionError) as ei:
        fs.pipe_file(f"{bucket}/marker2", b"mine2", mode="create")
    assert _has_reset(ei.value)
    assert proxy.stats.injected["reset_after_forward"] == 3  # 1 above + 2 (aiohttp re-send)
    proxy.clear_faults()
    assert fs.cat_file(f"{bucket}/marker2") == b"mine2"

    # GETs are re-sent the same way: one reset is invisible to the caller
    proxy.set_faults([Fault("reset", methods={"GET"}, max_count=1)])
    assert fs.cat_file(path) == b"mine"
    assert proxy.stats.injected["reset"] == 1


def test_s3fs_lost_complete_multipart_response(s3, proxy, bucket):
    """POST is not re-sent by aiohttp.  When CompleteMultipartUpload commits but its response is
    lost, s3fs tries to abort the (already completed) upload, gets NoSuchUpload, and raises
    FileNotFoundError -- while the object exists."""
    fs = s3.s3fs(proxy.endpoint)
    path = f"{bucket}/big.bin"
    data = os.urandom(11 * MiB)
    proxy.set_faults([Fault("reset_after_forward", methods={"POST"}, path_contains="uploadId=")])
    with pytest.raises(FileNotFoundError) as ei:
        fs.pipe_file(path, data, mode="create", chunksize=5 * MiB)
    assert ei.value.__cause__.operation_name == "AbortMultipartUpload"
    assert any(isinstance(e, botocore.exceptions.EndpointConnectionError) for e in _chain(ei.value))
    proxy.clear_faults()
    assert fs.cat_file(path) == data


def test_s3fs_error_mapping(s3, proxy, bucket):
    fs = s3.s3fs(proxy.endpoint)
    proxy.set_faults([Fault("slowdown", methods={"PUT"})])
    with pytest.raises(OSError) as ei:
        fs.pipe_file(f"{bucket}/a", b"x")
    assert ei.value.errno == errno.EBUSY
    assert ei.value.__cause__.response["Error"]["Code"] == "SlowDown"
    proxy.set_faults([Fault("forbidden", methods={"PUT"})])
    with pytest.raises(PermissionError):
        fs.pipe_file(f"{bucket}/a", b"x")
    assert proxy.stats.injected == {"slowdown": 1, "forbidden": 1}  # fs.retries=1: no s3fs retries


def test_server_stop_closes_the_port():
    srv = S3Server().start()
    host, port = srv.host, srv.port
    srv.create_bucket()
    srv.stop()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((host, port), timeout=budget(2)).close()
