"""``ray-mesh storage serve`` answers signed S3 requests only (issue "Security, round 3", 4).

Real parts: the server as the CLI starts it (``start_server``: moto's S3 app behind
``storage_guard``) on 127.0.0.1, real signed clients (boto3, pyarrow's S3 filesystem, the
storage check Ray runs are started with), and real unsigned or forged requests over HTTP
(``urllib``). Before, moto's whole server answered: an unsigned ``POST /moto-api/reset``
wiped every bucket, ``GET /moto-api/data.json`` dumped them, an anonymous ``GET`` listed
them, and IAM answered. Now each of these is refused with an S3 error saying what to fix,
and the objects are still there.
"""

from __future__ import annotations

import datetime
import json
import os
import stat
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from ports import free_port

from ray_mesh.checkpointing import check_storage
from ray_mesh.cli.storage import READY, start_server
from ray_mesh.cli.storage_guard import MAX_SKEW_S, load_or_make_key, read_key_file
from ray_mesh.errors import ObjectStoreError, StorageError

REPO = Path(__file__).resolve().parents[2]
BUCKET = "guarded"
OBJECT = "runs/exp/checkpoint_00000001/__0_0.distcp"
WEIGHTS = b"weights that must survive"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    key_file = tmp_path_factory.mktemp("key") / "storage.env"
    srv = start_server("127.0.0.1", free_port(), BUCKET, key_file=str(key_file))
    srv.endpoint = f"http://127.0.0.1:{srv._server.server_address[1]}"
    srv.key_file = key_file
    _client(srv).put_object(Bucket=BUCKET, Key=OBJECT, Body=WEIGHTS)
    yield srv
    srv.stop()


def _client(srv, service: str = "s3", key: tuple[str, str] | None = None):
    import boto3

    key_id, secret = key or srv.key
    return boto3.client(service, endpoint_url=srv.endpoint, region_name="us-east-1",
                        aws_access_key_id=key_id, aws_secret_access_key=secret)


def _still_there(srv) -> None:
    assert _client(srv).get_object(Bucket=BUCKET, Key=OBJECT)["Body"].read() == WEIGHTS


def _http(url: str, method: str = "GET", data: bytes | None = None,
          headers: dict[str, str] | None = None) -> tuple[int, str]:
    req = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


def test_the_key_is_made_private_and_kept_for_the_next_start(server):
    mode = stat.S_IMODE(os.stat(server.key_file).st_mode)
    assert mode == 0o600 and stat.S_IMODE(os.stat(server.key_file.parent).st_mode) & 0o077 == 0
    assert server.made and len(server.key[0]) == 20 and len(server.key[1]) == 40
    assert load_or_make_key(server.key_file) == (server.key, False)  # a restart reuses it
    text = server.key_file.read_text()
    assert f"export AWS_ACCESS_KEY_ID={server.key[0]}\n" in text


def test_signed_clients_work(server, monkeypatch):
    import pyarrow.fs

    from ray_mesh.core.object_store import filesystem

    s3 = _client(server)
    s3.put_object(Bucket=BUCKET, Key="odd names/a b+c=d~.txt", Body=b"hello")
    listed = s3.list_objects_v2(Bucket=BUCKET, Prefix="odd names/")
    assert [o["Key"] for o in listed["Contents"]] == ["odd names/a b+c=d~.txt"]
    fs = pyarrow.fs.S3FileSystem(endpoint_override=server.endpoint.removeprefix("http://"),
                                 scheme="http", access_key=server.key[0],
                                 secret_key=server.key[1])
    with fs.open_output_stream(f"{BUCKET}/big/part.bin") as f:  # a multipart upload
        f.write(b"x" * (6 << 20))
    with fs.open_input_stream(f"{BUCKET}/big/part.bin") as f:
        assert len(f.read()) == 6 << 20
    # What Ray's storage and ray_mesh's checkpoints use: the key from the environment.
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", server.key[0])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", server.key[1])
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    env_fs, root = filesystem(f"s3://{BUCKET}/runs", server.endpoint)
    with env_fs.open_input_stream(f"{root}/exp/checkpoint_00000001/__0_0.distcp") as f:
        assert f.read() == WEIGHTS
    assert check_storage(f"s3://{BUCKET}/runs", endpoint=server.endpoint)


@pytest.mark.parametrize("method, path", [
    ("POST", "/moto-api/reset"), ("GET", "/moto-api/data.json"), ("GET", "/moto-api/"),
    ("GET", f"/{BUCKET}"), ("GET", f"/{BUCKET}/{OBJECT}"), ("PUT", f"/{BUCKET}/{OBJECT}"),
    ("DELETE", f"/{BUCKET}/{OBJECT}"), ("GET", "/"),
])
def test_unsigned_requests_are_refused(server, method, path):
    status, body = _http(server.endpoint + path, method,
                         data=b"swapped weights" if method in ("PUT", "POST") else None)
    assert status == 403, (status, body[:300])
    assert "<Code>AccessDenied</Code>" in body
    expect = "admin API (/moto-api/) is not served" if "moto-api" in path else \
        "the request is not signed (anonymous requests are refused). Set AWS_ACCESS_KEY_ID"
    assert expect in body
    assert WEIGHTS.decode() not in body
    _still_there(server)


def test_the_admin_api_is_refused_even_signed(server):
    from botocore.auth import S3SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    req = AWSRequest(method="POST", url=server.endpoint + "/moto-api/reset", data=b"")
    S3SigV4Auth(Credentials(*server.key), "s3", "us-east-1").add_auth(req)
    status, body = _http(req.url, "POST", b"", dict(req.headers.items()))
    assert status == 403 and "admin API" in body, body
    _still_there(server)


def test_other_aws_services_are_refused_even_with_the_key(server):
    import botocore.exceptions

    with pytest.raises(botocore.exceptions.ClientError) as err:
        _client(server, "iam").list_users()
    assert err.value.response["ResponseMetadata"]["HTTPStatusCode"] == 403
    with pytest.raises(botocore.exceptions.ClientError):
        _client(server, "sts").get_caller_identity()


@pytest.mark.parametrize("who, code, fix", [
    ("unknown key id", "InvalidAccessKeyId", "does not know the access key id"),
    ("wrong secret", "SignatureDoesNotMatch", "the secret key does not match"),
])
def test_a_wrong_key_is_refused_and_named(server, monkeypatch, who, code, fix):
    import botocore.exceptions

    key = ("AKIAOTHERKEY00000000", server.key[1]) if who == "unknown key id" else \
        (server.key[0], "not-the-secret-of-this-server-0000000000")
    with pytest.raises(botocore.exceptions.ClientError, match=code):
        _client(server, key=key).list_objects_v2(Bucket=BUCKET)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key[0])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", key[1])
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(ObjectStoreError, match=fix):
        check_storage(f"s3://{BUCKET}/runs", endpoint=server.endpoint)
    _still_there(server)


def _signed(server, method: str, path: str, body: bytes, when=None):
    """A request signed with the server's key (at ``when``, default now)."""
    import botocore.auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    req = AWSRequest(method=method, url=server.endpoint + path, data=body)
    signer = botocore.auth.S3SigV4Auth(Credentials(*server.key), "s3", "us-east-1")
    if when is None:
        signer.add_auth(req)
    else:
        real = botocore.auth.get_current_datetime
        botocore.auth.get_current_datetime = lambda: when
        try:
            signer.add_auth(req)
        finally:
            botocore.auth.get_current_datetime = real
    return dict(req.headers.items())


def test_a_signed_request_with_another_body_is_refused(server):
    headers = _signed(server, "PUT", f"/{BUCKET}/{OBJECT}", b"the signed body")
    status, body = _http(server.endpoint + f"/{BUCKET}/{OBJECT}", "PUT", b"swapped weights!",
                         headers)
    assert status == 400 and "XAmzContentSHA256Mismatch" in body, body
    _still_there(server)


def test_an_old_signed_request_is_not_replayed(server):
    then = datetime.datetime.now(datetime.timezone.utc).replace(tzinfo=None) - \
        datetime.timedelta(seconds=MAX_SKEW_S + 60)
    headers = _signed(server, "DELETE", f"/{BUCKET}/{OBJECT}", b"", when=then)
    status, body = _http(server.endpoint + f"/{BUCKET}/{OBJECT}", "DELETE", None, headers)
    assert status == 403 and "RequestTimeTooSkewed" in body and "fix the clock" in body, body
    _still_there(server)


def test_presigned_urls_are_refused(server):
    url = _client(server).generate_presigned_url(
        "get_object", Params={"Bucket": BUCKET, "Key": OBJECT}, ExpiresIn=60)
    status, body = _http(url)
    assert status == 403 and "presigned URLs are not accepted" in body, body


@pytest.mark.parametrize("problem, match", [
    ("others read", "chmod 600"), ("symlink", "a symlink is refused"),
    ("stray line", "line 2: expected `export NAME=VALUE`"),
    ("one name", "needs both AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"),
    ("bad secret", "AWS_SECRET_ACCESS_KEY 1-128 of"),
])
def test_a_bad_key_file_is_refused_with_the_fix(tmp_path, problem, match):
    path = tmp_path / "storage.env"
    good = "export AWS_ACCESS_KEY_ID=RMSABCDEF0123456789\nexport AWS_SECRET_ACCESS_KEY=s3cr3t" \
           "s3cr3ts3cr3ts3cr3t\n"
    text = {"stray line": "# key\nLD_PRELOAD=/tmp/x.so\n" + good,
            "one name": "AWS_ACCESS_KEY_ID=RMSABCDEF0123456789\n",
            "bad secret": "AWS_ACCESS_KEY_ID=RMSABC\nAWS_SECRET_ACCESS_KEY=\"quoted secret\"\n"
            }.get(problem, good)
    if problem == "symlink":
        (tmp_path / "real").write_text(good)
        os.chmod(tmp_path / "real", 0o600)
        path.symlink_to(tmp_path / "real")
    else:
        path.write_text(text)
        os.chmod(path, 0o644 if problem == "others read" else 0o600)
    with pytest.raises(StorageError, match=match) as err:
        read_key_file(path)
    assert "s3cr3t" not in str(err.value)  # a secret is never shown
    with pytest.raises(StorageError, match=match):
        start_server("127.0.0.1", free_port(), BUCKET, key_file=str(path))


def test_the_cli_prints_the_key_once(tmp_path):
    key_file = tmp_path / "k" / "storage.env"
    banners = []
    for _ in range(2):
        proc = subprocess.Popen(
            [sys.executable, "-m", "ray_mesh.cli", "storage", "serve", "--port",
             str(free_port()), "--key-file", str(key_file)], stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)})
        lines = []
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                lines.append(line)
                if "export AWS_ACCESS_KEY_ID" in line or "the one in" in line:
                    break  # the banner's last line
        finally:
            proc.terminate()
            # It stops within a second of its own CPU; the unit tests run at niceness 10
            # beside the heavy kinds, and beside a busy one this took 33 s (a whole-suite
            # run): the bound is for a hang, not for a slow machine. The rest of its output
            # is kept, so a stop that hangs shows how far it got.
            try:
                rest, _ = proc.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                rest, _ = proc.communicate()
                pytest.fail("storage serve did not stop within 120 s of SIGTERM; its output:"
                            f"\n{''.join(lines)}{rest}")
        assert "ray-mesh storage: stopped" in rest, rest
        banners.append("".join(lines))
        assert lines and lines[0].startswith(READY), banners[-1]
    key = read_key_file(key_file)
    assert f"AWS_SECRET_ACCESS_KEY={key[1]}" in banners[0]
    assert key[1] not in banners[1] and str(key_file) in banners[1]
    json.dumps(banners)  # plain text
