"""The driver's check of object storage before any worker starts: one line per way it fails.

A run whose bucket cannot hold its checkpoints otherwise fails at the first save, after the
workers started and the first steps ran, inside Ray's wrappers. So the driver asks, in order,
each step bounded:

1. the text: a URI with a valid bucket, an endpoint that is a server URL
   (:func:`ray_mesh.core.object_store.check_location`);
2. the endpoint (when there is one): a TCP connection, so "nothing listens there" and "no
   route" are told apart from S3 errors;
3. the bucket: does it exist (a missing one is named, with how to create it);
4. a write probe: one object with a fresh unique name under the run's prefix is written, read
   back and compared, and deleted. Nothing else is touched: existing checkpoints are never
   read, listed or overwritten. A server that stores other bytes than it was sent (moto
   without credentials keeps the HTTP chunk framing) is caught here, not at resume time.

Errors from S3 are classified by the codes pyarrow reports (``ACCESS_DENIED``,
``INVALID_ACCESS_KEY_ID``, ``SIGNATURE_DOES_NOT_MATCH``); the message never holds a key.
Ray-free: pyarrow only.
"""

from __future__ import annotations

import concurrent.futures
import socket
import uuid
from typing import Any
from urllib.parse import parse_qs, urlsplit

from ray_mesh.core import object_store
from ray_mesh.core.safe import safe_text
from ray_mesh.errors import ObjectStoreError

PROBE_PREFIX = ".ray_mesh_storage_probe_"
CREDENTIALS = ("the AWS credentials this machine uses (AWS_ACCESS_KEY_ID and "
               "AWS_SECRET_ACCESS_KEY, or ~/.aws/credentials; the same on every node)")


def endpoint_of(path: str, endpoint: str | None) -> tuple[str, str, int] | None:
    """(url as shown, host, port) of the S3 server, or None for AWS's own endpoints."""
    if endpoint is None:
        query = parse_qs(urlsplit(path).query)
        if "endpoint_override" not in query:
            return None
        raw = query["endpoint_override"][0]
        scheme = query.get("scheme", ["https"])[0]
        endpoint = raw if "://" in raw else f"{scheme}://{raw}"
    parts = urlsplit(endpoint)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"{parts.scheme}://{parts.netloc}", parts.hostname or "", port


def _check_reachable(where: tuple[str, str, int], path: str, timeout_s: float) -> None:
    url, host, port = where
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except ConnectionRefusedError:
        raise ObjectStoreError(
            f"storage endpoint {url} refused the connection: no S3 server listens on "
            f"{host}:{port}. Start it (e.g. `ray-mesh storage serve --host {host} --port "
            f"{port} --bucket BUCKET`, or MinIO), or fix storage_endpoint for {path}."
        ) from None
    except TimeoutError:
        raise ObjectStoreError(
            f"storage endpoint {url} did not answer within {timeout_s:g} s (unreachable from "
            f"this machine: a wrong address, a firewall, or a node off the network). Fix "
            f"storage_endpoint, or check the route to {host}:{port}."
        ) from None
    except OSError as exc:
        raise ObjectStoreError(
            f"storage endpoint {url} cannot be reached: {exc.strerror or exc}. Fix "
            f"storage_endpoint (host {host}, port {port}) or the network."
        ) from None


def _code(exc: BaseException) -> str:
    text = str(exc)
    for code in ("INVALID_ACCESS_KEY_ID", "SIGNATURE_DOES_NOT_MATCH", "ACCESS_DENIED",
                 "NO_SUCH_BUCKET", "RESOURCE_NOT_FOUND"):
        if code in text:
            return code
    return ""


def _s3_failure(exc: BaseException, what: str, bucket: str, shown: str,
                denied_before: bool) -> ObjectStoreError:
    code = _code(exc)
    if code == "INVALID_ACCESS_KEY_ID":
        return ObjectStoreError(
            f"storage {shown}: the server does not know the access key id in use (AWS Error "
            f"INVALID_ACCESS_KEY_ID when {what}). Set {CREDENTIALS} to a key of this server.")
    if code == "SIGNATURE_DOES_NOT_MATCH":
        return ObjectStoreError(
            f"storage {shown}: the secret key does not match the access key id (AWS Error "
            f"SIGNATURE_DOES_NOT_MATCH). Fix {CREDENTIALS}.")
    if code == "ACCESS_DENIED" and denied_before:
        return ObjectStoreError(
            f"storage {shown}: access to bucket {bucket!r} is denied (wrong credentials, or "
            f"a key without permission on it). Fix {CREDENTIALS}, or grant the key "
            f"s3:ListBucket, s3:GetObject, s3:PutObject and s3:DeleteObject on {bucket!r}.")
    if code == "ACCESS_DENIED":
        return ObjectStoreError(
            f"storage {shown}: bucket {bucket!r} refuses writes ({what} was denied): "
            f"checkpoints could not be saved. Grant the key s3:PutObject and s3:DeleteObject "
            f"there, or use a bucket it may write.")
    if code in ("NO_SUCH_BUCKET", "RESOURCE_NOT_FOUND"):
        return _missing_bucket(bucket, shown)
    return ObjectStoreError(f"storage {shown}: {what} failed: {type(exc).__name__}: "
                            f"{safe_text(exc, 300)}. Check the URI, the bucket and "
                            f"{CREDENTIALS}.")


def _missing_bucket(bucket: str, shown: str) -> ObjectStoreError:
    return ObjectStoreError(
        f"storage {shown}: bucket {bucket!r} does not exist. Create it (e.g. `aws s3 mb "
        f"s3://{bucket} --endpoint-url URL`, or `ray-mesh storage serve --bucket {bucket}` "
        f"for a lab server), or fix storage_path.")


def _probe(fs: Any, root: str, bucket: str, shown: str, is_s3: bool) -> None:
    import pyarrow.fs

    denied = False
    if is_s3:
        try:
            info = fs.get_file_info(bucket)
            if info.type == pyarrow.fs.FileType.NotFound:
                raise _missing_bucket(bucket, shown)
        except OSError as exc:
            if _code(exc) != "ACCESS_DENIED":
                raise _s3_failure(exc, "looking up the bucket", bucket, shown, False) from None
            denied = True  # a write below tells bad credentials from missing permission
    else:
        fs.create_dir(root, recursive=True)
    name = f"{root.rstrip('/')}/{PROBE_PREFIX}{uuid.uuid4().hex}"
    token = uuid.uuid4().hex.encode() * 64
    if denied:  # may the key read there? Then the credentials are good and writes refused.
        try:
            fs.get_file_info(name)
            denied = False
        except OSError:
            pass
    try:
        with fs.open_output_stream(name) as f:
            f.write(token)
    except OSError as exc:
        raise _s3_failure(exc, "writing a probe object", bucket, shown, denied) from None
    try:
        with fs.open_input_stream(name) as f:
            back = f.read(len(token) + 4096)
    except OSError as exc:
        back = exc
    try:
        fs.delete_file(name)
        undeletable = None
    except OSError as exc:
        undeletable = exc
    if isinstance(back, OSError):
        raise _s3_failure(back, "reading the probe object back", bucket, shown, denied)
    if back != token:
        raise ObjectStoreError(
            f"storage {shown}: the server returned other bytes than were written ({len(token)} "
            f"bytes written, {len(back)} read back): checkpoints would be corrupt. For moto, set "
            f"{CREDENTIALS} (any values: anonymous uploads keep their chunk framing) and use "
            f"moto[server]>=5.2.5; otherwise check the server.")
    if undeletable is not None:
        raise ObjectStoreError(
            f"storage {shown}: the probe object {name} was written but cannot be deleted "
            f"({_code(undeletable) or type(undeletable).__name__}): Ray deletes old "
            f"checkpoints (num_to_keep) and ray_mesh unfinished ones. Grant s3:DeleteObject, "
            f"then delete that object.")


def check_object_storage(path: str, endpoint: str | None = None, *,
                         timeout_s: float = 60.0) -> None:
    """Refuse (one :class:`ObjectStoreError` line) storage that cannot hold checkpoints.

    ``path`` is a URI (``s3://bucket/runs``, pyarrow's ``?endpoint_override=`` form, or
    another pyarrow scheme); ``endpoint`` the S3 server's URL, if any. Every step is bounded
    by ``timeout_s`` as a whole; see the module docstring for the steps.
    """
    object_store.check_location(path, endpoint)
    shown = safe_text(object_store.shown(path.split("?", 1)[0], endpoint), 300)
    where = endpoint_of(path, endpoint)
    if where is not None:
        _check_reachable(where, shown, min(timeout_s, 10.0))
    is_s3 = urlsplit(path).scheme.lower() == "s3"
    bucket = urlsplit(path).netloc

    def run() -> None:
        fs, root = object_store.filesystem(path, endpoint, timeout_s=min(timeout_s, 20.0),
                                           retries=2) if is_s3 else \
            object_store.filesystem(path, endpoint)
        _probe(fs, root, bucket, shown, is_s3)

    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ray_mesh-probe")
    try:
        pool.submit(run).result(timeout=timeout_s)
    except concurrent.futures.TimeoutError:
        raise ObjectStoreError(
            f"storage {shown}: writing a probe object did not finish in {timeout_s:g} s. "
            f"Check the endpoint, the network and {CREDENTIALS}.") from None
    except ObjectStoreError:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure means "cannot store checkpoints"
        raise ObjectStoreError(
            f"storage {shown} is not writable: {type(exc).__name__}: {safe_text(exc, 300)}. "
            f"Check the URI, the bucket and {CREDENTIALS}.") from None
    finally:
        pool.shutdown(wait=False)
