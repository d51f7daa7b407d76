"""The checkpoint tests' uninterrupted reference (``_ckpt_reference.py``), run beside the block.

The bitwise-resume tests start the reference when their killed run starts, so that its few
seconds of training overlap the run's bring-up, and wait for it once the run is over.
:func:`reference_beside` is that pattern once: the reference's console goes to
``<log_dir>/reference.out``, its process is killed if the block fails, and a reference that
failed fails the test with the tail of that console.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ports import free_port

SCRIPT = Path(__file__).with_name("_ckpt_reference.py")
REPO = SCRIPT.parents[2]


@contextmanager
def reference_beside(out: Path, log_dir: Path, mode: str = "hsdp", steps: int | None = None,
                     timeout_s: float = 300.0) -> Iterator[None]:
    """Run the ``mode`` reference (``hsdp`` or ``diloco``, see ``_ckpt_reference.py``),
    saving to ``out``, while the block runs; after it, wait at most ``timeout_s`` for the
    reference and fail unless it exited 0."""
    args = [*([mode] if mode != "hsdp" else []), str(out), str(free_port()),
            *([str(steps)] if steps is not None else [])]
    log = log_dir / "reference.out"
    with open(log, "w") as console:
        ref = subprocess.Popen([sys.executable, str(SCRIPT), *args], stdout=console,
                               stderr=subprocess.STDOUT,
                               env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        yield
        rc = ref.wait(timeout=timeout_s)
    finally:
        ref.kill()
    assert rc == 0, f"the reference run failed (rc {rc}):\n{log.read_text()[-3000:]}"
