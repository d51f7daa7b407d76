"""Does the connected cluster serve Ray's state API, and if it is only slow, wait for it.

Ray Train's run-state tracking (what ``ray-mesh status`` and the dashboard list) is decided
once, on the driver, before ``fit()`` builds its controller callbacks
(``RAY_TRAIN_ENABLE_STATE_TRACKING``, read by ``DataParallelTrainer._create_default_callbacks``;
upstream: ray-train-state-tracking-needs-state-api): it cannot be switched on later. So the
decision rests on whether the state API *exists* (installed, a dashboard on the cluster),
never on whether it answered fast: on a busy head (another Ray job burning the CPUs) the
dashboard can take longer than the first probe's 3 s, and tracking turned off on a slow
answer would lose the run from ``ray-mesh status`` for good.

:func:`classify` sorts a probe's outcome into what a user can act on; :func:`probe` asks
once, bounded; :func:`retry_in_background` keeps asking a slow API with a bounded backoff
and says, in one line, when it answers or that it never did.
"""

from __future__ import annotations

import enum
import itertools
import logging
import threading
import time
from dataclasses import dataclass

logger = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 3.0
# Background retries of a slow API: each try's timeout, and the pause before it, double up
# to a cap; the whole retry stops after RETRY_BUDGET_S (a bounded wait, then one warning).
RETRY_TIMEOUTS_S = (10.0, 20.0, 30.0)
RETRY_PAUSE_S = (1.0, 2.0, 4.0, 8.0, 15.0)
RETRY_BUDGET_S = 180.0


class Verdict(enum.Enum):
    ANSWERS = "answers"
    SLOW = "slow"  # a timeout: the dashboard is there but busy; tracking stays on
    NO_DASHBOARD = "no_dashboard"  # nothing listens where the cluster says it is
    NOT_INSTALLED = "not_installed"  # this Python lacks ray[default]'s state client
    ERROR = "error"  # it answered, with an error

    @property
    def tracking(self) -> bool:
        """Whether run-state tracking is worth turning on for this outcome."""
        return self in (Verdict.ANSWERS, Verdict.SLOW)


@dataclass(frozen=True)
class Probe:
    verdict: Verdict
    url: str
    detail: str
    seconds: float


def _chain(exc: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    cur: BaseException | None = exc
    while cur is not None and cur not in out:
        out.append(cur)
        cur = cur.__cause__ or cur.__context__
    return out


def classify(exc: BaseException | None) -> Verdict:
    """What a failed (or, with ``None``, successful) state API call means for the user.

    Ray wraps every transport failure in ``ServerUnavailable`` with the same text
    ("... Make sure dependencies are installed with `pip install ray[default]` ..."), so that
    text says nothing: the cause chain does (a ``requests`` timeout, a refused connection;
    upstream: ray-state-api-error-text).
    """
    if exc is None:
        return Verdict.ANSWERS
    chain = _chain(exc)
    if any(isinstance(e, ImportError) for e in chain) or any(
            isinstance(e, RuntimeError) and "ray[default]" in str(e) for e in chain):
        return Verdict.NOT_INSTALLED  # Ray's own guard when `requests` is missing
    try:
        import requests
        timeouts: tuple[type[BaseException], ...] = (requests.exceptions.Timeout, TimeoutError)
        refused: tuple[type[BaseException], ...] = (requests.exceptions.ConnectionError,
                                                    ConnectionRefusedError)
    except ImportError:
        timeouts, refused = (TimeoutError,), (ConnectionRefusedError,)
    # Timeouts first: requests' ConnectTimeout is also a ConnectionError.
    if any(isinstance(e, timeouts) for e in chain):
        return Verdict.SLOW
    if any(isinstance(e, refused) for e in chain):
        return Verdict.NO_DASHBOARD
    return Verdict.ERROR


def _detail(exc: BaseException) -> str:
    root = _chain(exc)[-1]
    text = str(root).splitlines()[0] if str(root) else ""
    return f"{type(root).__name__}: {text[:200]}" if text else type(root).__name__


def api_url() -> str:
    """The state API's address for the connected cluster (``RAY_API_SERVER_ADDRESS`` wins,
    as in Ray's state client).

    Asked of the connected GCS, not auto-detected: Ray's auto-detection fails with "Found
    multiple active Ray instances" exactly when another Ray job shares the machine."""
    import os

    import ray

    from ray_mesh.private_apis import dashboard_url_from_gcs

    return os.environ.get("RAY_API_SERVER_ADDRESS") or dashboard_url_from_gcs(
        ray.get_runtime_context().gcs_address)


def probe(url: str | None = None, timeout_s: float = PROBE_TIMEOUT_S) -> Probe:
    """Ask once (``list_nodes(limit=1)``), at most about ``timeout_s``; never raises."""
    t0 = time.monotonic()
    try:
        from ray.util.state import list_nodes

        url = url or api_url()
        list_nodes(address=url, limit=1, timeout=int(max(1, timeout_s)),
                   raise_on_missing_output=False)
        return Probe(Verdict.ANSWERS, url, "", time.monotonic() - t0)
    except Exception as exc:  # noqa: BLE001 - classified: every outcome is a verdict
        logger.debug("ray_mesh: state API probe failed", exc_info=True)
        return Probe(classify(exc), url or "", _detail(exc), time.monotonic() - t0)


def message(p: Probe, timeout_s: float = PROBE_TIMEOUT_S) -> str:
    """The one line the driver prints about the first probe (none when it answered)."""
    off = "run-state tracking, which `ray-mesh status` reads, is off."
    p = Probe(p.verdict, p.url or "the cluster's dashboard address", p.detail, p.seconds)
    if p.verdict is Verdict.SLOW:
        return (f"ray_mesh: Ray's state API is slow to answer (no answer from {p.url} within "
                f"{timeout_s:.0f} s: machine busy?): run tracking stays on; retrying in the "
                "background.")
    if p.verdict is Verdict.NO_DASHBOARD:
        return (f"ray_mesh: no Ray dashboard answers at {p.url} (connection refused: the "
                "cluster runs without one, e.g. started with --include-dashboard=false or "
                f"without ray[default] on the head); {off}")
    if p.verdict is Verdict.NOT_INSTALLED:
        return (f"ray_mesh: Ray's state API client is not installed here ({p.detail}: "
                f"install ray[default]); {off}")
    if p.verdict is Verdict.ERROR:
        return f"ray_mesh: Ray's state API at {p.url} answered with an error ({p.detail}); {off}"
    return ""


def retry_in_background(url: str, *, budget_s: float = RETRY_BUDGET_S,
                        timeouts_s: tuple[float, ...] = RETRY_TIMEOUTS_S,
                        pauses_s: tuple[float, ...] = RETRY_PAUSE_S) -> threading.Thread:
    """Keep asking a slow state API (daemon thread, bounded backoff, ``budget_s`` in all);
    log one line when it answers, one warning when it turns out absent or never answers."""

    def run() -> None:
        t0 = time.monotonic()
        for i in itertools.count():
            left = budget_s - (time.monotonic() - t0)
            pause = pauses_s[min(i, len(pauses_s) - 1)]
            if left <= pause:
                break
            time.sleep(pause)
            timeout = min(timeouts_s[min(i, len(timeouts_s) - 1)], max(1.0, left - pause))
            p = probe(url, timeout)
            if p.verdict is Verdict.ANSWERS:
                logger.info("ray_mesh: Ray's state API answers now (%s, after %.0f s): run "
                            "tracking is on; `ray-mesh status` lists this run.",
                            url, time.monotonic() - t0 + PROBE_TIMEOUT_S)
                return
            if p.verdict is not Verdict.SLOW:
                logger.warning("ray_mesh: Ray's state API at %s no longer times out but fails "
                               "(%s: %s): run tracking was left on, but `ray-mesh status` "
                               "cannot list this run.", url, p.verdict.value, p.detail)
                return
        logger.warning("ray_mesh: Ray's state API at %s still did not answer after %.0f s: "
                       "run tracking stays on; `ray-mesh status` lists this run once the "
                       "dashboard answers (is the head overloaded?).", url,
                       time.monotonic() - t0 + PROBE_TIMEOUT_S)

    thread = threading.Thread(target=run, name="ray_mesh-state-api-retry", daemon=True)
    thread.start()
    return thread
