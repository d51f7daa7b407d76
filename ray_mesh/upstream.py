"""The register of upstream workarounds: what ray_mesh does only because Ray or torch behaves
a certain way, on the versions it was checked on.

:mod:`ray_mesh.private_apis` holds every use of a torch or Ray *internal API*. This module
holds the rest: the places where ray_mesh works around upstream *behaviour* (a log filter,
an environment variable, a bounded wait, a check before ``fit()``; where one needs an
internal, its ``private_apis`` wrapper is named in the entry). Each :class:`Workaround`
names the behaviour and what ray_mesh does about it, the version it was checked on, the
modules that carry it, and when it can go. Each of those modules names its entry beside the
code, as ``upstream: <key>`` in the comment or docstring, so that
``grep -rn "upstream: <key>" ray_mesh`` finds every place of one workaround.

On an upgrade of Ray or torch: bump ``private_apis.CHECKED_RAY`` / ``CHECKED_TORCH`` (and
fix the wrappers ``tests/unit/test_private_apis.py`` names), then read this register: for
each entry of the upgraded component, check whether the new version still behaves as
``what`` says. Where ``remove_when`` holds, remove the workaround at every ``where`` and the
entry; where the behaviour stays, update ``upstream`` to the new version.
``tests/unit/test_upstream_register.py`` holds the register and the code to each other:
every ``where`` names its entry, every ``upstream: <key>`` names an entry, the versions
match ``private_apis``, and a comment naming the checked Ray or torch version with no entry
fails.

Pure data: imports nothing of ray_mesh, nor torch or Ray.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Workaround:
    """One workaround for upstream behaviour.

    Attributes:
        key: a short stable slug; the code names it as ``upstream: <key>``.
        upstream: the component and the version the behaviour was checked on.
        what: the upstream behaviour, and what ray_mesh does about it.
        where: the modules (paths from the repository root) that carry the workaround.
        remove_when: the condition under which the workaround can go.
    """

    key: str
    upstream: str
    what: str
    where: tuple[str, ...]
    remove_when: str


_RAY_TRAIN = "Ray 2.60.0 (Train V2)"
_RAY = "Ray 2.60.0"
_RAY_DATA = "Ray 2.60.0 (Ray Data)"
_TORCH = "torch 2.13.0"

WORKAROUNDS: tuple[Workaround, ...] = (
    # ------------------------------------------------------------------ Ray Train: console
    Workaround(
        key="ray-train-cleaner-no-state-api",
        upstream=_RAY_TRAIN,
        what="Ray Train's placement-group cleaner asks Ray's state API whether the controller "
             "lives and, on a cluster without the dashboard, logs a WARNING at every check "
             "(~45 lines in a short run). A logging filter (SaidOnce) lets the first through "
             "as one explaining line and drops the rest.",
        where=("ray_mesh/raytrain/driver.py",),
        remove_when="Ray Train's cleaner says this once itself (or skips the check without "
                    "a state API), on every Ray ray_mesh supports.",
    ),
    Workaround(
        key="ray-train-embedded-logger-chatter",
        upstream=_RAY_TRAIN,
        what="On a one-machine embedded Ray, Ray Train's autoscaling-coordinator client and "
             "placement-group cleaner log INFO/WARNING lines about an autoscaler and a state "
             "API that are not there. The embedded Ray's processes filter those two loggers "
             "to ERROR (a filter: Ray Train's dictConfig resets their levels).",
        where=("ray_mesh/raytrain/driver.py",),
        remove_when="Ray Train stays quiet about the autoscaler and the state API on a local "
                    "Ray started with ray.init().",
    ),
    Workaround(
        key="ray-train-print-patch-twice",
        upstream=_RAY_TRAIN,
        what="With Ray Train's print patch on, a print in a Train worker is both logged and "
             "echoed: two console lines. ray-mesh run sets RAY_TRAIN_ENABLE_PRINT_PATCH=0 "
             "(handed to replica groups' runners too), and the progress line goes through "
             "logging, which shows once either way.",
        where=("ray_mesh/raytrain/driver.py", "ray_mesh/observability/progress.py",
               "ray_mesh/raytrain/replica_groups.py"),
        remove_when="A print in a Ray Train worker reaches the driver's console once with "
                    "the print patch on.",
    ),
    Workaround(
        key="ray-train-report-queue-of-one",
        upstream=_RAY_TRAIN,
        what="A worker's ray.train.report waits until the controller has taken the previous "
             "one, and the controller looks every RAY_TRAIN_HEALTH_CHECK_INTERVAL_S (2 s by "
             "default): a run that reports every step makes at most ~0.5 steps/s, and an "
             "ended run is seen up to 2 s late. ray-mesh run sets the interval to 0.2 s.",
        where=("ray_mesh/raytrain/driver.py", "ray_mesh/raytrain/replica_groups.py"),
        remove_when="Ray Train takes a report without waiting for the health-check poll.",
    ),
    Workaround(
        key="ray-train-preemption-watcher",
        upstream=_RAY_TRAIN,
        what="Ray Train starts a preemption-watcher actor per worker-group start (~2 s of CPU "
             "importing Ray Train) whose start logs a core-worker error line on every "
             "console, for a flag nothing in ray_mesh reads. ray_mesh sets "
             "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER=0 unless the user set it.",
        where=("ray_mesh/raytrain/driver.py", "ray_mesh/raytrain/replica_groups.py"),
        remove_when="The watcher starts without the error line and costs little, or "
                    "ray_mesh reads its drain flag.",
    ),
    Workaround(
        key="ray-train-report-log-line",
        upstream=_RAY_TRAIN,
        what="Ray Train logs \"Reporting training result ...\" at INFO for every report "
             "through logging.getLogger(__file__), a logger outside ray.train that "
             "LoggingConfig does not reach. Workers filter that logger above INFO.",
        where=("ray_mesh/raytrain/driver.py",),
        remove_when="That line is logged under ray.train (or at DEBUG).",
    ),
    Workaround(
        key="ray-train-failure-policy-record",
        upstream=_RAY_TRAIN,
        what="Ray Train's failure policy logs each decision with the error's whole text twice "
             "and a traceback (~60 lines per lost node). In a replica group's controller a "
             "logging filter makes it one line: the decision, the count, the error's first "
             "line.",
        where=("ray_mesh/raytrain/attempt_watch.py",),
        remove_when="The failure policy logs a decision in a line or two.",
    ),
    Workaround(
        key="ray-data-exclude-resources-warning",
        upstream=_RAY_DATA,
        what="Ray Train's controller itself sets the deprecated "
             "ExecutionOptions.exclude_resources when a job has datasets, and the "
             "deprecation warning reaches the driver's console. Job processes ignore that "
             "one warning.",
        where=("ray_mesh/raytrain/driver.py",),
        remove_when="Ray Train stops using ExecutionOptions.exclude_resources.",
    ),
    # ------------------------------------------------------------ Ray Train: run lifecycle
    Workaround(
        key="ray-train-state-tracking-needs-state-api",
        upstream=_RAY_TRAIN,
        what="RAY_TRAIN_ENABLE_STATE_TRACKING is read once, when fit() builds its callbacks, "
             "and without Ray's state API the TrainStateActor and placement-group cleaner "
             "poll an API that is not there. The driver probes the state API once, bounded, "
             "turns tracking on where it exists (a slow one included) and keeps asking a "
             "slow one in the background.",
        where=("ray_mesh/raytrain/driver.py", "ray_mesh/raytrain/state_api.py"),
        remove_when="Ray Train decides tracking itself from the state API's presence (or can "
                    "turn it on after fit() starts).",
    ),
    Workaround(
        key="ray-state-api-error-text",
        upstream=_RAY,
        what="Ray's state client wraps every transport failure in ServerUnavailable with one "
             "text (\"... pip install ray[default] ...\"). ray_mesh classifies a failed "
             "probe by the cause chain (timeout, refused, not installed), not the text.",
        where=("ray_mesh/raytrain/state_api.py",),
        remove_when="The state client's error says which transport failure happened.",
    ),
    Workaround(
        key="ray-state-api-multiple-instances",
        upstream=_RAY_TRAIN,
        what="Ray Train's own state-API calls (placement-group cleaner, run-state actor) find "
             "the cluster through RAY_ADDRESS or a host scan, which fails with a traceback "
             "per check on a machine running a second Ray instance. Every job process, and "
             "the driver of an embedded Ray, sets RAY_ADDRESS to its own GCS.",
        where=("ray_mesh/raytrain/driver.py", "ray_mesh/cli/runner.py"),
        remove_when="Ray Train's state-API calls use the connected cluster's address.",
    ),
    Workaround(
        key="ray-train-autoscaler-start-deadline",
        upstream=_RAY_TRAIN,
        what="Ray Train's controller creates the autoscaling coordinator actor on its first "
             "resource request and gives it a 5 s ray.get; on a busy machine the start takes "
             "longer and a WARNING with a traceback reaches the console (then it retries). "
             "The driver starts that actor before fit() and waits for it, bounded.",
        where=("ray_mesh/raytrain/driver.py",),
        remove_when="The controller waits for the coordinator's start without logging a "
                    "traceback, or creates it before the first request.",
    ),
    Workaround(
        key="ray-train-no-driver-hook",
        upstream=_RAY_TRAIN,
        what="A BackendConfig gets no hook on the driver before the controller starts. "
             "MeshConfig.train_func_context, which Ray Train reads on the driver when fit() "
             "starts, runs the driver-side set-up (state tracking, controller warm-up, node "
             "probes).",
        where=("ray_mesh/raytrain/backend.py",),
        remove_when="Ray Train gives a BackendConfig a driver-side hook before the controller "
                    "starts.",
    ),
    Workaround(
        key="ray-train-start-waits-forever",
        upstream=_RAY_TRAIN,
        what="Ray Train retries a worker group that cannot start forever "
             "(controller_failure_limit=-1; \"worker group startup timed out\" every 60 s), "
             "e.g. a ScalingConfig asking for resources the cluster lacks or a fixed-size run "
             "that lost a node. ray_mesh checks resources on the driver before fit() and "
             "bounds the retries (failure_config, run.startup_retries), with an error that "
             "names the cause.",
        where=("ray_mesh/raytrain/launch.py", "ray_mesh/raytrain/elastic.py"),
        remove_when="Ray Train refuses unsatisfiable resources at once and bounds start-up "
                    "retries by default.",
    ),
    Workaround(
        key="ray-train-failed-start-leaks-group",
        upstream=_RAY_TRAIN,
        what="When a backend's on_start raises, Ray Train leaks the worker group's placement "
             "group and actors, and the next fit() from the same driver waits forever for "
             "resources. The backend shuts the worker group down before re-raising "
             "(private_apis.v2_worker_group_type).",
        where=("ray_mesh/raytrain/backend.py",),
        remove_when="Ray Train releases a worker group whose backend hook raised.",
    ),
    Workaround(
        key="ray-train-replica-groups-one-worker",
        upstream=_RAY_TRAIN,
        what="Ray Train's controller replaces a failed replica group alone but builds groups "
             "of one worker (replica_group_size=1), too small for a dp_shard x tp mesh. "
             "ray_mesh runs one Ray Train run per replica group, with a coordinator actor.",
        where=("ray_mesh/raytrain/replica_groups.py",),
        remove_when="Ray Train's replica groups hold several workers each and restart one "
                    "group alone (then they can replace the run per group).",
    ),
    Workaround(
        key="ray-train-result-metrics-need-checkpoint",
        upstream=_RAY_TRAIN,
        what="Ray Train keeps a report's metrics in Result only when the report carried a "
             "checkpoint. Rank 0 saves a summary file (the last report included) in the run "
             "directory, and the driver's summary reads it.",
        where=("ray_mesh/observability/report.py", "ray_mesh/raytrain/replica_groups.py"),
        remove_when="Result.metrics holds the last report whether or not it had a checkpoint.",
    ),
    Workaround(
        key="ray-driver-log-tail",
        upstream=_RAY,
        what="A driver prints the workers' output as each node's log monitor publishes it; "
             "ray.shutdown() stops that printing at once (0.5 s of grace only at interpreter "
             "exit), so the last lines of a run, still on their way from a busy node, never "
             "show (a replica group's final progress line, seen in CI). After the fit the "
             "CLI waits, bounded, until each run's last progress line has been printed "
             "(private_apis.watch_worker_output).",
        where=("ray_mesh/cli/console_tail.py",),
        remove_when="Ray prints every line its workers wrote before a driver's ray.shutdown() "
                    "returns.",
    ),
    # -------------------------------------------------------------------- Ray: auth, client
    Workaround(
        key="ray-auth-token-umask",
        upstream=_RAY,
        what="Ray turns token authentication on by default, and an embedded ray.init() writes "
             "~/.ray/auth_token with the process umask (often 0644: readable by every local "
             "user). ray_mesh creates the token itself, 0600 in a 0700 directory, before Ray "
             "would, and tightens an existing one others can read.",
        where=("ray_mesh/raytrain/auth.py", "ray_mesh/cli/runner.py"),
        remove_when="Ray writes the token file 0600 whatever the umask.",
    ),
    Workaround(
        key="ray-auth-default-warning",
        upstream=_RAY,
        what="A new local ray.init() with RAY_AUTH_MODE unset turns token authentication on "
             "and logs a WARNING saying so ('Token authentication is enabled for this Ray "
             "cluster. Set RAY_AUTH_MODE=disabled to opt out'), at every start; with the "
             "mode set it says nothing, but setting it after import ray leaves the driver "
             "without its token. ray-mesh run's embedded start drops that one record "
             "(private_apis.quiet_default_auth_notice).",
        where=("ray_mesh/cli/runner.py", "ray_mesh/private_apis.py"),
        remove_when="Ray logs its default authentication mode below WARNING.",
    ),
    Workaround(
        key="ray-client-token-needs-auth-mode",
        upstream=_RAY,
        what="Ray's client sends the cluster token only with RAY_AUTH_MODE=token (a readable "
             "token file is not enough), and ray.init then retries an unauthenticated "
             "connect for ~20 s, a line a second. ray-mesh run --address pings the GCS first "
             "and names the fix in one line.",
        where=("ray_mesh/cli/runner.py",),
        remove_when="Ray's client sends a token it can read, or fails at once naming it.",
    ),
    # ------------------------------------------------------------------ Ray: data, metrics
    Workaround(
        key="ray-data-no-mesh-split",
        upstream=_RAY_DATA,
        what="Ray Train's DataConfig splits datasets by world rank, so tp/cp/pp peers would "
             "train on different rows, and Ray has no mesh-aware split. MeshDataConfig runs "
             "one ordered streaming_split(dp) per peer position, installed by MeshConfig's "
             "backend (private_apis.replace_run_data_config).",
        where=("ray_mesh/raytrain/data.py",),
        remove_when="Ray's DataConfig splits by a device mesh's dp rank (Ray PR #60439, "
                    "DeviceMeshConfig) on every Ray ray_mesh supports.",
    ),
    Workaround(
        key="ray-data-stream-no-position",
        upstream=_RAY_DATA,
        what="Ray Data cannot checkpoint a streaming split's position. ResumableShard counts "
             "the rows a rank trained on and skips them on resume; replica groups read "
             "samples by index from the dataset materialized once on the driver.",
        where=("ray_mesh/raytrain/data.py", "ray_mesh/data/indexed_ray.py"),
        remove_when="Ray Data saves and restores a split iterator's position.",
    ),
    Workaround(
        key="ray-metrics-gauge-expiry",
        upstream=_RAY,
        what="Ray's metrics agent drops a gauge series not set again within two report "
             "intervals (20 s by default), so a value set once or between sparse reports "
             "vanishes while the run goes on. A daemon thread sets every held gauge again "
             "every 5 s (less for a shorter interval).",
        where=("ray_mesh/observability/export.py",),
        remove_when="Ray keeps a gauge's last value until the process ends (or the series is "
                    "removed).",
    ),
    Workaround(
        key="ray-metric-record-cost",
        upstream=_RAY,
        what="One record into a ray.util.metrics metric costs 10-20 us (2-core VM). The "
             "report recorder does bookkeeping per report and writes Ray's metrics at most "
             "every 2 s.",
        where=("ray_mesh/observability/metrics.py",),
        remove_when="A record costs about a microsecond; then the recorder may write every "
                    "report.",
    ),
    # ---------------------------------------------------------------------- torch: c10d
    Workaround(
        key="torch-store-get-unbounded",
        upstream=_TORCH,
        what="TCPStore.get returns a value whole with no size limit (append grows a key "
             "without bound). The hang watch reads a value's length first over the store's "
             "wire protocol (torch's internal, libuv server) and drops the connection for a "
             "value over its limit; BoundedReader.works falls back to get where the "
             "protocol differs.",
        where=("ray_mesh/observability/store_wire.py",),
        remove_when="TCPStore has a get with a size limit (or a value-length query).",
    ),
    Workaround(
        key="torch-store-binds-all-interfaces",
        upstream=_TORCH,
        what="torch's env:// rendezvous makes rank 0's TCPStore listen on every interface, "
             "and the store has no authentication. ray_mesh binds the port on MASTER_ADDR "
             "itself and hands the socket to TCPStore(master_listen_fd=...), with the "
             "arguments torch's _create_c10d_store uses.",
        where=("ray_mesh/core/rendezvous_store.py",),
        remove_when="torch's rendezvous binds the store to MASTER_ADDR (or takes a bind "
                    "address).",
    ),
    Workaround(
        key="torch-gloo-abort-no-wake",
        upstream=_TORCH,
        what="A blocked gloo collective cannot be interrupted: ProcessGroup.abort does not "
             "wake it. The hang watch sets the watched groups' timeout to hang_timeout_s + "
             "END_GRACE_S so the waiting ranks' collectives raise, and replaces the error "
             "with its report.",
        where=("ray_mesh/observability/hang.py",),
        remove_when="ProcessGroup.abort wakes a blocked gloo collective.",
    ),
    Workaround(
        key="torch-mesh-keeps-groups",
        upstream=_TORCH,
        what="destroy_process_group leaves every DeviceMesh's _pg_registry holding its "
             "groups, so gloo groups and their worker threads live until interpreter exit, "
             "where a worker thread taking the GIL aborts the process (pytorch#179291). "
             "shutdown_mesh frees the groups with the interpreter whole "
             "(private_apis.release_mesh_groups).",
        where=("ray_mesh/core/teardown.py",),
        remove_when="destroy_process_group releases the meshes' groups, and gloo's worker "
                    "threads survive interpreter finalization.",
    ),
    Workaround(
        key="torch-nn-functional-binds-world",
        upstream=_TORCH,
        what="torch.distributed.nn.functional binds group.WORLD as its collectives' default "
             "argument when imported (torch.distributed.fsdp imports it), which keeps the "
             "world group alive for good when the import follows init_process_group. "
             "bind_world_defaults imports it first, so those defaults are None.",
        where=("ray_mesh/core/teardown.py",),
        remove_when="Those functions resolve the default group at call time.",
    ),
    Workaround(
        key="torch-all-gather-single-rename",
        upstream=_TORCH,
        what="torch 2.13 names all_gather_into_tensor all_gather_single (same semantics); "
             "older releases lack the new name. DiLoCo's compression takes whichever exists.",
        where=("ray_mesh/parallel/compress.py",),
        remove_when="ray_mesh requires a torch that has all_gather_single (pyproject's "
                    "torch>=2.6 rises to 2.13).",
    ),
    # ---------------------------------------------------------- torch: parallel, checkpoints
    Workaround(
        key="torch-pipelining-gloo-batch-p2p",
        upstream=_TORCH,
        what="Before pytorch#152938 (torch 2.8), pipelining waited on one Work of a batched "
             "send/recv and every schedule but GPipe deadlocked on gloo (pytorch#132644). "
             "known_hang refuses those schedules on gloo where the fix is missing "
             "(private_apis.has_batch_p2p_wait_fix).",
        where=("ray_mesh/parallel/pp/plan.py",),
        remove_when="ray_mesh requires torch >= 2.8.",
    ),
    Workaround(
        key="torch-full-tensor-merge-warning",
        upstream=_TORCH,
        what="DTensor.full_tensor gathers FSDP + TP parameters innermost dim first and torch "
             "(2.11 on) logs a warning on every rank that it cannot merge the gathers. "
             "full_tensor redistributes outermost dim first: the same two all-gathers and "
             "values, no warning.",
        where=("ray_mesh/parallel/compose.py",),
        remove_when="DTensor.full_tensor gathers _StridedShard + Shard without the warning.",
    ),
    Workaround(
        key="torch-fsdp2-view-output-hook",
        upstream=_TORCH,
        what="FSDP2 hooks its pre-backward all-gather onto a module's outputs; on an output "
             "that is a view, an in-place op by the caller drops the hook and skips the "
             "all-gather (torch warns on every forward). A forward hook registered before "
             "fully_shard's copies a grad-requiring view output.",
        where=("ray_mesh/parallel/fsdp.py",),
        remove_when="FSDP2 keeps its pre-backward hook on a view output changed in place.",
    ),
    Workaround(
        key="torch-dcp-load-unpickles",
        upstream=_TORCH,
        what="DCP's FileSystemReader.read_metadata unpickles .metadata with plain pickle, and "
             "DefaultLoadPlanner.load_bytes reads bytes entries with torch.load("
             "weights_only=False): whoever can write the storage runs code in every loading "
             "rank. ray_mesh reads .metadata with a restricted unpickler and loads through "
             "its own storage reader and a weights_only load planner.",
        where=("ray_mesh/checkpointing/safe_load.py", "ray_mesh/checkpointing/dcp_metadata.py"),
        remove_when="DCP reads its metadata and bytes entries without running code from the "
                    "files.",
    ),
    Workaround(
        key="torch-dcp-single-process-warning",
        upstream=_TORCH,
        what="DCP warns on every save and load without a process group that it assumes a "
             "single process. ray_mesh saves and loads that way on purpose (a group of one "
             "worker, a restore on the driver) and ignores that one warning while no group "
             "exists.",
        where=("ray_mesh/checkpointing/safe_load.py",),
        remove_when="DCP saves and loads without a process group without warning.",
    ),
)
