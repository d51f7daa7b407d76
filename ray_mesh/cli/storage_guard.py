"""What stands in front of ``ray-mesh storage serve``'s moto: its key, and a WSGI layer that
serves signed S3 requests only.

Why: moto's server answers every AWS API, its admin API included (``POST /moto-api/reset``
wipes every bucket, ``GET /moto-api/data.json`` dumps them), and checks no credentials. With
``--host`` on the tailnet, any peer could wipe or read every checkpoint, or swap the weights
a run resumes from. So the server

* makes a key at its first start (:func:`load_or_make_key`): a random access key id and
  secret, written once to a private key file (mode 0600, never followed through a symlink)
  and printed once; later starts read it back, so the nodes' environment stays valid;
* serves moto's S3 app alone (:class:`SignedS3Only`), with no route to moto's other
  services or its admin API, and refuses ``/moto-api/`` paths by name;
* accepts a request only when it carries an AWS Signature Version 4 ``Authorization``
  header made with that key for the ``s3`` service, dated within :data:`MAX_SKEW_S`, and, when
  the client signed the body's SHA-256, a body that has it. The signature is recomputed with
  botocore's signer (the AWS SDKs' own rules); clients (boto3, pyarrow's S3 filesystem, so
  Ray's storage) sign with the key given in ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``.

A refusal is an S3 error (``AccessDenied``, ``InvalidAccessKeyId``,
``SignatureDoesNotMatch``, ``RequestTimeTooSkewed``, ``XAmzContentSHA256Mismatch``) whose
message says what to fix; the SDKs and ray_mesh's storage check name it.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import io
import logging
import os
import re
import secrets
import stat
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote, urlsplit
from xml.sax.saxutils import escape

from ray_mesh.core.safe import safe_text
from ray_mesh.errors import RequestRefused, StorageError

logger = logging.getLogger(__name__)
DEFAULT_KEY_FILE = "~/.ray_mesh/storage.env"
KEY_NAMES = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
MAX_SKEW_S = 15 * 60  # AWS's own bound on a signed request's date
SHORT_SECRET = 20
_ID_RE = re.compile(r"^[A-Za-z0-9]{3,128}$")
_SECRET_RE = re.compile(r"^[A-Za-z0-9/+=_.-]{1,128}$")
_AUTH_RE = re.compile(r"^AWS4-HMAC-SHA256 Credential=([^/,\s]+)/(\d{8})/([^/,\s]+)/([^/,\s]+)/"
                      r"aws4_request,\s*SignedHeaders=([a-z0-9;_.-]+),\s*Signature=([0-9a-f]{64})$")
_PAYLOAD_CONSTANTS = ("UNSIGNED-PAYLOAD", "STREAMING-UNSIGNED-PAYLOAD-TRAILER",
                      "STREAMING-AWS4-HMAC-SHA256-PAYLOAD",
                      "STREAMING-AWS4-HMAC-SHA256-PAYLOAD-TRAILER")
_KEY_FIX = ("Set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY to the key `ray-mesh storage "
            "serve` printed when it made it (it is in the server's key file, --key-file)")
Key = tuple[str, str]


def make_key() -> Key:
    """A fresh (access key id, secret): 20 and 40 characters, as AWS's own look."""
    return "RMS" + secrets.token_hex(9)[:17].upper(), secrets.token_urlsafe(30)


def _check_key(key_id: str, secret: str, where: str) -> None:
    if not _ID_RE.match(key_id) or not _SECRET_RE.match(secret):
        raise StorageError(
            f"{where}: AWS_ACCESS_KEY_ID must be 3-128 letters and digits and "
            f"AWS_SECRET_ACCESS_KEY 1-128 of A-Z a-z 0-9 / + = _ . -. Delete the file to "
            f"have a fresh key made, or fix it.")


def write_key_file(path: Path, key: Key) -> None:
    """``key`` into a new private file ``path`` (0600; its folder made 0700 if missing)."""
    _check_key(*key, str(path))
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    text = (f"# ray-mesh storage serve's key: export it on every node and the driver\n"
            f"export {KEY_NAMES[0]}={key[0]}\nexport {KEY_NAMES[1]}={key[1]}\n")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def read_key_file(path: Path) -> Key:
    """The key in ``path``: a regular file of this user that no one else may read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        raise StorageError(f"key file {path}: cannot open it ({exc.strerror or exc}; a "
                           f"symlink is refused). Give --key-file a private regular file, or "
                           f"a new path to have a key made there.") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() \
                or st.st_mode & 0o077:
            raise StorageError(
                f"key file {path}: must be a regular file of this user that others can "
                f"neither read nor write (mode {stat.filemode(st.st_mode)}): `chmod 600 "
                f"{path}`, or delete it to have a fresh key made.")
        raw = f.read(4097)
    if len(raw) > 4096:
        raise StorageError(f"key file {path}: larger than 4 KiB, not a key file. Delete it "
                           f"to have a fresh key made.")
    found: dict[str, str] = {}
    for n, line in enumerate(raw.decode("utf-8", "replace").splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, eq, value = line.removeprefix("export ").strip().partition("=")
        if not eq or name not in KEY_NAMES:
            raise StorageError(f"key file {path}, line {n}: expected `export NAME=VALUE` "
                               f"with NAME one of {', '.join(KEY_NAMES)}.")
        found[name] = value.strip()
    if set(found) != set(KEY_NAMES):
        raise StorageError(f"key file {path}: needs both {' and '.join(KEY_NAMES)}. Delete "
                           f"it to have a fresh key made.")
    _check_key(found[KEY_NAMES[0]], found[KEY_NAMES[1]], f"key file {path}")
    if len(found[KEY_NAMES[1]]) < SHORT_SECRET:
        logger.warning("key file %s: the secret has fewer than %d characters and can be "
                       "guessed; delete the file to have a fresh key made", path, SHORT_SECRET)
    return found[KEY_NAMES[0]], found[KEY_NAMES[1]]


def load_or_make_key(path: str | Path) -> tuple[Key, bool]:
    """The server's key from ``path``, made and written there first if the file does not
    exist; (key, made now)."""
    path = Path(path).expanduser()
    if not os.path.lexists(path):
        key = make_key()
        write_key_file(path, key)
        return key, True
    return read_key_file(path), False


# ----------------------------------------------------------------------------- signatures
def _header(environ: dict[str, Any], name: str) -> str:
    wsgi = name.upper().replace("-", "_")
    value = environ.get(wsgi if wsgi in ("CONTENT_TYPE", "CONTENT_LENGTH") else f"HTTP_{wsgi}")
    return " ".join(str(value or "").split())


def _canonical_queries(query: str) -> list[str]:
    """The query as the client sent it, and re-encoded as SigV4 spells it (either signed)."""
    pairs = [p.partition("=") for p in query.split("&") if p] if query else []
    sent = "&".join(sorted(f"{k}={v}" for k, _, v in pairs))
    enc = [(quote(unquote(k), safe="-_.~"), quote(unquote(v), safe="-_.~")) for k, _, v in pairs]
    return list(dict.fromkeys([sent, "&".join(f"{k}={v}" for k, v in sorted(enc))]))


def _signature(secret: str, date: str, region: str, string_to_sign: str) -> str:
    """SigV4's signature, by botocore's own signer (the key derivation of every AWS SDK)."""
    from botocore.auth import SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    request = AWSRequest(method="GET", url="http://signed/")
    request.context["timestamp"] = date
    return SigV4Auth(Credentials("id", secret), "s3", region).signature(string_to_sign, request)


def check_request(environ: dict[str, Any], key: Key,
                  now: datetime.datetime | None = None) -> None:
    """Raise :class:`~ray_mesh.errors.RequestRefused` unless ``environ`` is an S3 request
    signed with ``key`` (the module docstring lists the checks). A body whose hash was
    signed is read and put back."""
    path = environ.get("PATH_INFO", "")
    if path.startswith("/moto-api") or path == "/favicon.ico":
        raise RequestRefused("403 Forbidden", "AccessDenied", "ray-mesh storage serve serves "
                             "the S3 API only: moto's admin API (/moto-api/) is not served.")
    query = environ.get("QUERY_STRING", "")
    if re.search(r"(^|&)(X-Amz-Signature|X-Amz-Credential|Signature|AWSAccessKeyId)=", query):
        raise RequestRefused("403 Forbidden", "AccessDenied", "presigned URLs are not accepted: "
                      "sign the request in its Authorization header (any AWS SDK does).")
    auth = environ.get("HTTP_AUTHORIZATION", "")
    if not auth:
        raise RequestRefused("403 Forbidden", "AccessDenied", f"the request is not signed "
                      f"(anonymous requests are refused). {_KEY_FIX}.")
    m = _AUTH_RE.match(auth.strip())
    if m is None:
        raise RequestRefused("403 Forbidden", "AccessDenied", f"only AWS Signature Version 4 "
                      f"(AWS4-HMAC-SHA256 in the Authorization header) is accepted. {_KEY_FIX}.")
    key_id, day, region, service, signed, given = m.groups()
    if not hmac.compare_digest(key_id.encode(), key[0].encode()):
        raise RequestRefused("403 Forbidden", "InvalidAccessKeyId", f"the access key id is not "
                      f"this server's. {_KEY_FIX}.")
    if service != "s3":
        raise RequestRefused("403 Forbidden", "AccessDenied", f"ray-mesh storage serve serves the "
                      f"S3 API only, not {safe_text(service, 40)!r}.")
    names = signed.split(";")
    payload = _header(environ, "x-amz-content-sha256")
    stamp = _header(environ, "x-amz-date")
    if not {"host", "x-amz-date", "x-amz-content-sha256"} <= set(names):
        raise RequestRefused("403 Forbidden", "AccessDenied", "the signature must cover the host, "
                      "x-amz-date and x-amz-content-sha256 headers (any AWS SDK signs them).")
    try:
        when = datetime.datetime.strptime(stamp, "%Y%m%dT%H%M%SZ").replace(
            tzinfo=datetime.timezone.utc)
    except ValueError:
        raise RequestRefused("403 Forbidden", "AccessDenied", "x-amz-date is not a SigV4 date "
                      "(YYYYMMDDTHHMMSSZ).") from None
    skew = abs(((now or datetime.datetime.now(datetime.timezone.utc)) - when).total_seconds())
    if skew > MAX_SKEW_S or stamp[:8] != day:
        raise RequestRefused("403 Forbidden", "RequestTimeTooSkewed", f"the request is dated "
                      f"{stamp}, {skew:.0f} s from the server's clock (at most {MAX_SKEW_S} s "
                      f"are accepted): fix the clock of the client or the server.")
    if payload not in _PAYLOAD_CONSTANTS and not re.fullmatch(r"[0-9a-f]{64}", payload):
        raise RequestRefused("400 Bad Request", "InvalidArgument", "x-amz-content-sha256 must "
                             "be the body's SHA-256 in hex or one of AWS's payload constants.")
    headers = "".join(f"{n}:{_header(environ, n)}\n" for n in names)
    raw = environ.get("RAW_URI") or environ.get("REQUEST_URI") or path
    raw_path = raw.split("?", 1)[0] if raw.startswith("/") else urlsplit(raw).path or "/"
    uris = list(dict.fromkeys([raw_path, quote(unquote(raw_path), safe="/-_.~")]))
    scope = f"{day}/{region}/s3/aws4_request"
    for uri in uris:
        for q in _canonical_queries(query):
            canonical = "\n".join([environ.get("REQUEST_METHOD", "GET").upper(), uri, q,
                                   headers, signed, payload])
            sts = "\n".join(["AWS4-HMAC-SHA256", stamp, scope,
                             hashlib.sha256(canonical.encode()).hexdigest()])
            if hmac.compare_digest(_signature(key[1], stamp, region, sts), given):
                return _check_body(environ, payload)
    raise RequestRefused("403 Forbidden", "SignatureDoesNotMatch", f"the signature does not match "
                  f"this server's key. {_KEY_FIX}.")


def _check_body(environ: dict[str, Any], payload: str) -> None:
    if payload in _PAYLOAD_CONSTANTS:
        return
    length = environ.get("CONTENT_LENGTH") or ""
    stream = environ["wsgi.input"]
    if length.isdigit():
        body = stream.read(int(length))
    else:  # chunked (the server ends the stream) or no body at all (reading would block)
        body = stream.read() if environ.get("wsgi.input_terminated") else b""
    environ["wsgi.input"] = io.BytesIO(body)
    if not hmac.compare_digest(hashlib.sha256(body).hexdigest(), payload):
        raise RequestRefused("400 Bad Request", "XAmzContentSHA256Mismatch", "the body is not the "
                      "one the client signed (its SHA-256 differs from x-amz-content-sha256).")


class SignedS3Only:
    """WSGI: ``app`` (moto's S3 app) behind :func:`check_request` with ``key``."""

    def __init__(self, app: Callable[..., Iterable[bytes]], key: Key) -> None:
        self.app, self.key = app, key

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]
                 ) -> Iterable[bytes]:
        try:
            check_request(environ, self.key)
        except RequestRefused as no:
            logger.warning("ray-mesh storage: refused %s %s from %s: %s",
                           environ.get("REQUEST_METHOD"),
                           safe_text(environ.get("PATH_INFO", ""), 120),
                           environ.get("REMOTE_ADDR"), no.code)
            body = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{no.code}</Code>'
                    f"<Message>{escape(no.message)}</Message></Error>").encode()
            head = environ.get("REQUEST_METHOD") == "HEAD"
            start_response(no.status, [("Content-Type", "application/xml"),
                                       ("Content-Length", "0" if head else str(len(body)))])
            return [b""] if head else [body]
        return self.app(environ, start_response)
