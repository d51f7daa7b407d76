"""Whether a namespace cluster can run on this machine, and if not, why (one sentence)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

from harness.netns.namespaces import run
from harness.netns.wireguard import wireguard_unavailable_reason


def netns_unavailable_reason(tunnel: str = "wireguard") -> str | None:
    """Why a namespace cluster with this ``tunnel`` cannot run here (None when it can).

    Tests skip with this reason locally (CI turns a skip into a failure); a cluster built
    anyway raises the same message."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root (run the tests as root)"
    for tool, pkg in (("ip", "iproute2"), ("nsenter", "util-linux"), ("unshare", "util-linux")):
        if shutil.which(tool) is None:
            return f"the `{tool}` command is not installed (apt-get install -y {pkg})"
    name = f"rmchk{os.getpid()}"
    try:
        run(["ip", "netns", "add", name], timeout=10)
        run(["ip", "netns", "del", name], timeout=10)
    except (RuntimeError, subprocess.TimeoutExpired, OSError) as exc:
        return f"`ip netns add` does not work here: {exc}"
    if tunnel == "wireguard":
        return wireguard_unavailable_reason()
    return None


__all__ = ["netns_unavailable_reason"]
