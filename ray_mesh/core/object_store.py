"""Where a run's results live: a local path, a cloud URI, or an S3 bucket at an endpoint.

Ray Train takes storage as ``RunConfig(storage_path=..., storage_filesystem=...)``: with a
``pyarrow.fs`` filesystem given, the path is the one inside it (``s3://bucket/runs`` ->
``bucket/runs``). An S3-compatible server of one's own (MinIO, a home lab's ``ray-mesh
storage serve``) needs its endpoint in that filesystem, so ray_mesh takes two settings, the
way AWS's own tools do (``aws s3 --endpoint-url``):

* ``storage_path: s3://bucket/runs`` and
* ``storage_endpoint: http://HOST:PORT`` (or ``https://``).

:func:`run_storage` turns them into RunConfig's two arguments; :func:`filesystem` into the
filesystem and path that everything else (checkpoints, the layout file, ``ray-mesh status``)
reads and writes through. pyarrow's own form, ``s3://bucket/runs?endpoint_override=HOST:PORT
&scheme=http``, keeps working as a storage_path. Credentials are never settings here: they
come from the standard AWS environment variables or files on each machine
(``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, ``~/.aws/credentials``), and are never
printed or put into what Ray records about a run.

Ray-free; pyarrow (a dependency of Ray) is imported only when a filesystem is built.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import parse_qs, urlsplit

from ray_mesh.errors import StorageURIError

SCHEMES_WITH_ENDPOINT = ("s3",)
BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
PYARROW_QUERY_KEYS = ("endpoint_override", "scheme", "region", "allow_bucket_creation",
                      "allow_bucket_deletion", "access_key", "secret_key", "session_token",
                      "anonymous", "role_arn", "session_name", "external_id",
                      "load_frequency", "force_virtual_addressing", "tls_ca_file_path")
CREDENTIAL_KEYS = ("access_key", "secret_key", "session_token")
"""pyarrow's URI options that are credentials: refused (a storage path is printed, written
into the run's files and recorded by Ray; credentials belong in each machine's AWS
environment variables or ~/.aws)."""


def is_uri(path: str) -> bool:
    """A URI of a remote filesystem (``s3://``, ``gs://``, ...), not a local path."""
    return "://" in path and not path.startswith("file://")


def bucket_problem(bucket: str) -> str | None:
    """Why ``bucket`` cannot be an S3 bucket name, or None (AWS's naming rules)."""
    if not bucket:
        return "it names no bucket (write s3://BUCKET/path)"
    if not BUCKET_RE.match(bucket) or ".." in bucket or re.match(r"^\d+\.\d+\.\d+\.\d+$",
                                                                  bucket):
        return (f"bucket name {bucket!r} is not valid: 3-63 characters, lowercase letters, "
                f"digits, '.' and '-', starting and ending with a letter or digit")
    return None


def _uri_like(path: str) -> bool:
    """A URI, or text that starts like one (``s3:bucket?...``, refused later as malformed)."""
    return is_uri(path) or re.match(r"^[A-Za-z][A-Za-z0-9+.-]+:", path) is not None


def redacted(storage_path: str) -> str:
    """``storage_path`` as it may be printed: a URI's query keeps its option names, never
    their values, and a ``user:password@`` is left out (``s3://bucket/runs?scheme=...``)."""
    if not isinstance(storage_path, str) or not _uri_like(storage_path):
        return storage_path
    shown, _, query = storage_path.partition("?")
    scheme, sep, rest = shown.partition("://")
    netloc, slash, path = rest.partition("/")
    if sep and "@" in netloc:
        shown = f"{scheme}://...@{netloc.rsplit('@', 1)[1]}{slash}{path}"
    names = [part.split("=", 1)[0] for part in query.split("&") if part]
    return shown + ("?" + "&".join(f"{n}=..." for n in names) if query else "")


def credential_problem(storage_path: str) -> str | None:
    """Why ``storage_path`` must not be used as written (it carries credentials), or None."""
    if not isinstance(storage_path, str) or not _uri_like(storage_path):
        return None
    head, _, query = storage_path.partition("?")
    netloc = head.partition("://")[2].partition("/")[0]
    names = {part.split("=", 1)[0] for part in query.split("&") if part}
    found = [k for k in CREDENTIAL_KEYS if k in names] + (["user:password@"] if "@" in netloc
                                                            else [])
    if not found:
        return None
    return (f"storage_path {redacted(storage_path)!r} carries credentials ({', '.join(found)}),"
            f" which would be printed in errors, written into the run's files and recorded by "
            f"Ray: remove them and set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and "
            f"AWS_SESSION_TOKEN) in the environment of every node, or use ~/.aws/credentials.")


def parse_endpoint(endpoint: str, key: str = "storage_endpoint") -> tuple[str, str]:
    """``http://HOST:PORT`` -> (``HOST:PORT``, ``http``); :class:`StorageURIError` otherwise."""
    shown_url = redacted(endpoint) if isinstance(endpoint, str) else endpoint
    example = f"{key}: http://10.0.0.5:9000 (the S3 server's URL: scheme, host and port)"
    if not isinstance(endpoint, str) or not endpoint.strip():
        raise StorageURIError(f"{key} {endpoint!r} is empty; write e.g. {example}.")
    parts = urlsplit(endpoint.strip())
    if parts.scheme not in ("http", "https"):
        raise StorageURIError(f"{key} {shown_url!r} must start with http:// or https://; "
                              f"write e.g. {example}.")
    try:
        port = parts.port
    except ValueError:
        port = -1
    if not parts.hostname or port == -1 or parts.path.strip("/") or parts.query \
            or parts.username or parts.password:
        raise StorageURIError(f"{key} {shown_url!r} is not a server URL (host and optional "
                              f"port only: no path, query or user); write e.g. {example}.")
    return parts.netloc.rsplit("@", 1)[-1], parts.scheme


def check_location(storage_path: str, endpoint: str | None = None) -> None:
    """:class:`StorageURIError` when ``storage_path`` (with ``endpoint``) is malformed.

    Checks only the text: a URI with a scheme and a bucket (S3's naming rules), an
    endpoint only with an ``s3://`` path, never an endpoint given twice.
    """
    if not isinstance(storage_path, str) or not storage_path.strip():
        raise StorageURIError(f"storage_path {storage_path!r} is empty: write a directory or "
                              f"a URI such as s3://bucket/runs.")
    secret = credential_problem(storage_path)
    if secret:  # first: every message below quotes the path
        raise StorageURIError(secret)
    shown_path = redacted(storage_path)
    if endpoint is not None:
        parse_endpoint(endpoint)
    if not is_uri(storage_path):
        if re.match(r"^[A-Za-z][A-Za-z0-9+.-]+:/?[^/]", storage_path):
            raise StorageURIError(
                f"storage_path {shown_path!r} is not a URI (a scheme needs '://'): write "
                f"e.g. s3://bucket/runs, or ./{storage_path.replace(':', '_')} for a directory.")
        if endpoint is not None:
            raise StorageURIError(
                f"storage_endpoint {endpoint} was given, but storage_path {shown_path!r} is "
                f"a local path: write storage_path as s3://BUCKET/path, or drop the endpoint.")
        return
    parts = urlsplit(storage_path)
    scheme = parts.scheme.lower()
    if not re.match(r"^[a-z][a-z0-9+.-]*$", scheme) or not storage_path.startswith(
            f"{parts.scheme}://"):
        raise StorageURIError(f"storage_path {shown_path!r} is not a URI: write "
                              f"SCHEME://BUCKET/path, e.g. s3://bucket/runs.")
    if scheme == "s3":
        why = bucket_problem(parts.netloc)
        if why:
            raise StorageURIError(f"storage_path {shown_path!r}: {why}.")
    query = parse_qs(parts.query, keep_blank_values=True)
    unknown = sorted(k for k in query if k not in PYARROW_QUERY_KEYS)
    if unknown:
        raise StorageURIError(f"storage_path {shown_path!r} has unknown URI options "
                              f"{unknown}: pyarrow takes {list(PYARROW_QUERY_KEYS[:3])} and "
                              f"the like; for an endpoint use storage_endpoint instead.")
    if endpoint is not None:
        if scheme not in SCHEMES_WITH_ENDPOINT:
            raise StorageURIError(f"storage_endpoint is for s3:// storage (any S3-compatible "
                                  f"server), not {scheme}://; drop it or use s3://.")
        if "endpoint_override" in query:
            raise StorageURIError(
                f"storage_path {shown_path!r} names an endpoint_override and "
                f"storage_endpoint {endpoint} is given too: keep one (storage_endpoint).")


def _s3(endpoint: str | None, *, timeout_s: float | None = None,
        retries: int | None = None) -> Any:
    import pyarrow.fs

    kwargs: dict[str, Any] = {}
    if endpoint is not None:
        kwargs["endpoint_override"], kwargs["scheme"] = parse_endpoint(endpoint)
    if timeout_s is not None:
        kwargs["connect_timeout"] = kwargs["request_timeout"] = float(timeout_s)
    if retries is not None:
        kwargs["retry_strategy"] = pyarrow.fs.AwsStandardS3RetryStrategy(max_attempts=retries)
    return pyarrow.fs.S3FileSystem(**kwargs)


def filesystem(storage_path: str, endpoint: str | None = None, *,
               timeout_s: float | None = None, retries: int | None = None) -> tuple[Any, str]:
    """``(pyarrow filesystem, path inside it)`` for a storage location, checked first.

    ``timeout_s``/``retries`` (an S3 endpoint only) bound each request of this filesystem:
    for checks and reads that must not hang; a run's own filesystem keeps pyarrow's defaults.
    """
    import pyarrow.fs

    check_location(storage_path, endpoint)
    if not is_uri(storage_path):
        local = storage_path[len("file://"):] if storage_path.startswith("file://") \
            else storage_path
        return pyarrow.fs.LocalFileSystem(), local
    parts = urlsplit(storage_path)
    if parts.scheme.lower() == "s3" and (endpoint is not None or timeout_s is not None
                                         or retries is not None) and not parts.query:
        return _s3(endpoint, timeout_s=timeout_s, retries=retries), \
            f"{parts.netloc}{parts.path}".rstrip("/")
    return pyarrow.fs.FileSystem.from_uri(storage_path)


def run_storage(storage_path: str | None, endpoint: str | None = None) -> dict[str, Any]:
    """``RunConfig`` keyword arguments for this storage: ``storage_path`` and, with an
    endpoint, ``storage_filesystem`` (``RunConfig(name=..., **run_storage(...))``).

    Without an endpoint the path goes to Ray Train as written (its own resolution); with
    one, an ``S3FileSystem`` at that endpoint and the path inside it. The filesystem holds
    no credentials: each machine resolves its own from the AWS environment or files.

    Stability: stable
    """
    if storage_path is None:
        if endpoint is not None:
            raise StorageURIError("storage_endpoint is set but storage_path is not: write "
                                  "storage_path: s3://BUCKET/path.")
        return {"storage_path": None}
    check_location(storage_path, endpoint)
    if endpoint is None:
        return {"storage_path": storage_path}
    fs, path = filesystem(storage_path, endpoint)
    return {"storage_path": path, "storage_filesystem": fs}


def shown(storage_path: str, endpoint: str | None = None) -> str:
    """The location as a person reads it: ``s3://bucket/runs at http://host:9000``."""
    return f"{storage_path} at {endpoint}" if endpoint else storage_path


def same_location(a: str, b: str) -> bool:
    """Whether two spellings name the same storage: a trailing '/' and pyarrow's URI options
    aside, and ``bucket/runs`` (what Ray records with a custom filesystem) equal to
    ``s3://bucket/runs``."""
    def norm(p: str) -> str:
        p = p.split("?", 1)[0].rstrip("/") if is_uri(p) else p.rstrip("/")
        return p.split("://", 1)[1] if is_uri(p) else p

    return norm(a) == norm(b) and (is_uri(a) or is_uri(b) or a.rstrip("/") == b.rstrip("/"))


__all__ = ["run_storage"]
