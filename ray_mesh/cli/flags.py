"""Command-line flags, checked as strictly as job-file keys (Ray-free).

Every numeric flag of ``ray-mesh`` goes through one of these ``type=`` callables, which use
the same readers as the job file (:mod:`ray_mesh.core.values`): ``--timeout 0``, ``nan`` or
``-5``, ``--port 99999``, ``--tp 0`` and ``--num-workers -2`` fail at parse time, before
any connection, and :class:`CliParser` prints one ``ray-mesh: error:`` line naming the flag
and the fix instead of argparse's usage block.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any, NoReturn

from ray_mesh.core.values import MAX_SECONDS, read_int, read_port, read_seconds, read_str


class CliParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line: ``ray-mesh: error: <flag>: <fix>``."""

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"ray-mesh: error: {message.rstrip('.')}. See `{self.prog} "
                         f"--help`.\n")
        sys.exit(2)


def _number(text: str, kind: type) -> float | int:
    try:
        return kind(text)
    except ValueError:
        what = "a whole number" if kind is int else "a number"
        raise argparse.ArgumentTypeError(f"must be {what}; got {text!r}") from None


def int_flag(low: int, high: int | None = None, example: int | None = None
             ) -> Callable[[str], int]:
    """``type=`` for an int flag in ``[low, high]``."""
    def parse(text: str) -> int:
        try:
            return read_int("", _number(text, int), low, high, example=example)  # type: ignore[return-value]
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc).rstrip(".")) from None

    parse.__name__ = "int"
    return parse


def seconds_flag(high: float = MAX_SECONDS) -> Callable[[str], float]:
    """``type=`` for a timeout flag: finite seconds in ``(0, high]``."""
    def parse(text: str) -> float:
        try:
            return read_seconds("", _number(text, float), high=high)  # type: ignore[return-value]
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc).rstrip(".")) from None

    parse.__name__ = "seconds"
    return parse


def positive_number(text: str) -> float:
    """``type=`` for a rate such as ``--link-mbit``: a finite number > 0."""
    value = _number(text, float)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0; got {text!r}")
    return value


def list_flag(item: Callable[[str], Any], name: str) -> Callable[[str], list]:
    """``type=`` for a comma-separated list (``2,2,1``), each item parsed by ``item``."""
    def parse(text: str) -> list:
        parts = [p.strip() for p in text.split(",")]
        if not all(parts) or len(parts) > 1024:
            raise argparse.ArgumentTypeError(f"give {name} as one value or comma-separated "
                                             f"values, e.g. 2,2,1; got {text!r}")
        return [item(p) for p in parts]

    parse.__name__ = name
    return parse


def port_flag(text: str) -> int:
    """``type=`` for a TCP port flag (1-65535)."""
    try:
        return read_port("", _number(text, int))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).rstrip(".")) from None


def name_flag(text: str) -> str:
    """``type=`` for a name flag (``--interface``, ``--resource``): a non-empty string."""
    try:
        return read_str("", text.strip())  # type: ignore[return-value]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).rstrip(".")) from None


def storage_flag(text: str) -> str:
    """``type=`` for ``status --storage``: a path or URI without credentials in it."""
    from ray_mesh.core.object_store import credential_problem

    name = name_flag(text)
    why = credential_problem(name)
    if why:
        raise argparse.ArgumentTypeError(why.rstrip("."))
    return name


def status_address_flag(text: str) -> str:
    """``type=`` for ``status --address``: a GCS address or a dashboard URL, never empty
    (an empty one would read whatever cluster runs on this machine)."""
    if not text.strip():
        raise argparse.ArgumentTypeError(
            "the address is empty: give the head's GCS address (100.64.0.1:6379) or its "
            "dashboard URL (http://100.64.0.1:8265), or leave --address out for the cluster "
            "RAY_ADDRESS names")
    return text


def address_problem(address: str) -> str | None:
    """Why ``address`` cannot be a Ray cluster address for ``ray.init``, or None.

    The usual mistake is the dashboard URL (``http://head:8265``, what ``ray job submit``
    takes); ``ray.init`` wants the GCS address ``head:6379``.
    """
    from ray_mesh.network.interfaces import split_host_port

    if address in ("auto", "local"):
        return None
    if not address:  # ray.init("") means "auto": the Ray running on this machine
        return ("the address is empty (Ray would join whatever runs on this machine): give "
                "the head's GCS address, e.g. 100.64.0.1:6379, or auto on purpose; leave "
                "--address out for an embedded Ray with run")
    if address.startswith(("http://", "https://")):
        host = address.split("://", 1)[1].split("/", 1)[0].rsplit(":", 1)[0] or "<head>"
        return (f"{address!r} is the Ray dashboard URL (what `ray job submit` takes); give "
                f"the cluster's GCS address instead, {host}:6379 (the port `ray start --head` "
                f"printed), or auto for the cluster on this machine")
    target = address[len("ray://"):] if address.startswith("ray://") else address
    if "://" in target:
        return (f"{address!r} is not a Ray address: give host:6379 (the GCS address), "
                f"ray://host:10001 (Ray Client), or auto")
    try:
        split_host_port(target.rstrip("/"), 6379)
    except ValueError as exc:
        return f"{address!r} is not an address: {exc}"
    return None


def address_flag(text: str) -> str:
    """``type=`` for ``--address`` of run, plan and doctor (a GCS address, not a URL)."""
    why = address_problem(text.strip())
    if why:
        raise argparse.ArgumentTypeError(why)
    return text.strip()
