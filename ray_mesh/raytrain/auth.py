"""The cluster's auth token file: private to its owner (0600 in a 0700 directory).

Ray turns token authentication on by default, and an embedded ``ray.init()`` writes a new
token to ``~/.ray/auth_token`` with the process umask (usually 0644: readable by every local
user, who could then run code on the cluster). ray_mesh therefore creates the token itself,
private, before Ray would, and tightens an existing one that others can read
(upstream: ray-auth-token-umask).
"""

from __future__ import annotations

import logging
import os
import secrets
import stat
from pathlib import Path

logger = logging.getLogger(__name__)

TOKEN_PATH_ENV = "RAY_AUTH_TOKEN_PATH"
TOKEN_ENV = "RAY_AUTH_TOKEN"
AUTH_MODE_ENV = "RAY_AUTH_MODE"


def default_token_path() -> Path:
    """Where Ray reads and writes the token by default (upstream: ray-auth-token-umask)."""
    return Path.home() / ".ray" / "auth_token"


def token_path() -> Path:
    explicit = os.environ.get(TOKEN_PATH_ENV)
    return Path(explicit).expanduser() if explicit else default_token_path()


def _tighten(path: Path, mode: int, what: str) -> None:
    current = stat.S_IMODE(path.stat().st_mode)
    if current & 0o077:
        logger.warning("ray_mesh: %s %s had mode %o (readable by other local users); setting "
                       "it to %o.", what, path, current, mode)
        try:
            os.chmod(path, mode)
        except OSError as exc:  # not ours to change: say so, do not stop the run
            logger.warning("ray_mesh: could not change the mode of %s (%s); run `chmod %o %s` "
                           "as its owner.", path, exc, mode, path)


def _create(path: Path) -> None:
    """A new random token at ``path``, 0600, its directory 0700 when this creates it."""
    if not path.parent.exists():
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(path.parent, 0o700)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # another process created it just now
        return
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))  # the format Ray's own generator uses
    os.chmod(path, 0o600)  # whatever the umask


def secure_token_file(create: bool) -> Path | None:
    """Make the token file private; with ``create``, write a new private token if none exists.

    Returns the token file's path, or None when there is no file to guard (token
    authentication disabled, the token given in ``RAY_AUTH_TOKEN``, or no file and
    ``create`` False). The default directory ``~/.ray`` is made 0700; a directory named by
    ``RAY_AUTH_TOKEN_PATH`` is the user's and is only created (0700) when missing.
    """
    if os.environ.get(AUTH_MODE_ENV, "").lower() == "disabled":
        return None
    path = token_path()
    default_dir = path.parent == default_token_path().parent
    if not path.exists():
        if not create or os.environ.get(TOKEN_ENV):
            return None
        try:
            _create(path)
        except OSError as exc:  # e.g. a read-only home: Ray reports the missing token itself
            logger.warning("ray_mesh: could not create the Ray auth token %s (%s).", path, exc)
            return None
    if path.is_file():
        _tighten(path, 0o600, "Ray auth token")
    if default_dir and path.parent.is_dir():
        _tighten(path.parent, 0o700, "Ray token directory")
    return path
