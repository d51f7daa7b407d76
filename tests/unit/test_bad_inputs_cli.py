"""Every class of bad input to the real ``ray-mesh`` command: refused on the driver before
Ray starts, exit status != 0, exactly one ``ray-mesh: error:`` line naming the key or flag
and the fix, and no traceback (``-v`` shows one on request).

Each case runs the real command in a fresh process, as ``python -m ray_mesh.cli`` would,
forked from one server that imported it once (``tests/helpers/cli_fork.py``: a new
interpreter per case cost ~5 s of importing torch). The per-case limit is a hang guard
(20 s, stretched on an overloaded machine), not a timing claim; that nothing reached Ray is
checked by Ray's own start-up line being absent.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from cli_fork import CliServer

ROOT = Path(__file__).resolve().parents[2]
REFUSE_WITHIN_S = 20.0
BASE = "name: j\ntrain: t.py:train_loop\nscaling: {num_workers: 2}\n"


def _limit_s() -> float:
    """20 s, times how oversubscribed the CPUs are (helpers share a 2-core box)."""
    load = os.getloadavg()[0] / (os.cpu_count() or 1)
    return REFUSE_WITHIN_S * max(1.0, load)


def _job(folder: Path, text: str | bytes, name: str = "job.yaml") -> str:
    (folder / "t.py").write_text("def train_loop(config):\n    pass\n")
    path = folder / name
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return str(path)


@pytest.fixture(scope="module")
def cli_server():
    server = CliServer()
    yield server
    server.close()


@pytest.fixture
def cli(cli_server):
    def run(args: list[str], cwd: Path, extra_env: dict[str, str] | None = None
            ) -> subprocess.CompletedProcess:
        env = {k: v for k, v in os.environ.items()
               if k not in ("RAY_ADDRESS", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH"))
                                            if p)
        env.update(extra_env or {})
        return cli_server.run(args, cwd, env, _limit_s())
    return run


def _refused(proc: subprocess.CompletedProcess, *words: str) -> str:
    out = proc.stdout + proc.stderr
    errors = [x for x in out.splitlines() if x.startswith("ray-mesh: error:")]
    assert proc.returncode not in (0, None), out[-3000:]
    assert len(errors) == 1, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    assert "Started a local Ray instance" not in out, out[-3000:]  # refused before Ray
    for word in words:
        assert word in errors[0], (word, errors[0])
    return errors[0]


# (case id, job file text, extra CLI args, words the error line must hold)
JOB_CASES = [
    # YAML itself
    ("duplicate-key", BASE + "name: k\n", [], ["'name' appears twice", "line 1", "keep one"]),
    ("not-utf8", b"name: caf\xe9\ntrain: t.py:train_loop\n", [], ["not UTF-8", "line 1"]),
    ("empty-file", "", [], ["empty", "train:"]),
    ("top-level-list", "- a\n- b\n", [], ["top level must be a mapping"]),
    ("syntax", "train: t.py:train_loop\nmesh: {dp_shard: 2\n", [], ["not valid YAML", "line"]),
    ("yaml-deep", BASE + "config: " + "[" * 20_000 + "]" * 20_000 + "\n", [],
     ["refused at line 4", "nests deeper than 64 levels"]),
    ("yaml-digits", BASE + "config: {seed: " + "9" * 5000 + "}\n", [],
     ["refused at line 4", "an integer of 5000 characters", "quote it"]),
    # keys
    ("unknown-key", BASE + "netwrk: {}\n", [], ["'netwrk'", "Did you mean 'network'"]),
    ("unknown-nested-key", BASE + "network: {preflite: true}\n", [], ["'preflite'",
                                                                      "'preflight'"]),
    # booleans must be YAML booleans
    ("bool-as-string", BASE + 'network: {preflight: "false"}\n', [],
     ["network.preflight", "without quotes"]),
    ("bool-as-int", BASE.replace("{num_workers: 2}", "{num_workers: 2, use_gpu: 0}"), [],
     ["scaling.use_gpu", "true, false or auto"]),
    # ints
    ("int-as-float", "train: t.py:train_loop\nscaling: {num_workers: 2.0}\n", [],
     ["scaling.num_workers", "write 2"]),
    ("int-as-string", "train: t.py:train_loop\nscaling: {num_workers: '2'}\n", [],
     ["scaling.num_workers", "without quotes"]),
    ("int-zero", "train: t.py:train_loop\nscaling: {num_workers: 0}\n", [],
     ["scaling.num_workers", "from 1"]),
    ("int-huge", "train: t.py:train_loop\nscaling: {num_workers: 100000000}\n", [],
     ["scaling.num_workers", "100000"]),
    ("int-negative", BASE + "run: {max_failures: -5}\n", [], ["run.max_failures", ">= -1"]),
    # seconds
    ("seconds-word", BASE + "network: {bringup_timeout_s: soon}\n", [],
     ["network.bringup_timeout_s", "seconds > 0"]),
    ("seconds-nan", BASE + "network: {bringup_timeout_s: .nan}\n", [],
     ["network.bringup_timeout_s", "finite"]),
    ("seconds-negative", BASE + "network: {timeout_s: -1}\n", [], ["network.timeout_s"]),
    ("seconds-huge", BASE + "network: {hang_timeout_s: 1.0e+12}\n", [],
     ["network.hang_timeout_s", "604800"]),
    # choices and mappings
    ("placement", BASE.replace("{num_workers: 2}", "{num_workers: 2, placement_strategy: "
                                                   "spread}"), [],
     ["scaling.placement_strategy", "Did you mean 'SPREAD'"]),
    ("backend", BASE + "network: {backend: nccl2}\n", [], ["network.backend", "gloo"]),
    ("resources-word", BASE.replace("{num_workers: 2}", "{num_workers: 2, resources_per_worker:"
                                                        " {CPU: lots}}"), [],
     ["scaling.resources_per_worker", "{CPU: 1"]),
    ("resources-list", BASE.replace("{num_workers: 2}", "{num_workers: 2, resources_per_worker:"
                                                        " [1, 2]}"), [],
     ["scaling.resources_per_worker"]),
    ("config-not-mapping", BASE + "config: 0\n", [], ["config must be a mapping"]),
    ("data-format-list", BASE + "data: {paths: [stdlib], format: [text]}\n", [],
     ["data.format", "text, jsonl, parquet"]),
    # the train reference
    ("train-not-string", "train: 5\n", [], ["train must be a non-empty string", "file.py"]),
    ("train-no-function", "train: t.py\n", [], ["train:", ":function"]),
    ("train-not-py", "train: t_nopy:train_loop\n", [], ["not a .py file"]),
    ("train-outside-folder", "train: ../../../../etc/x.py:f\n", [],
     ["outside the job's folder", "absolute path"]),
    ("train-missing-function", "train: t.py:trian_loop\n", [], ["Did you mean 'train_loop'"]),
    # the interface, on the embedded Ray's only node (this machine)
    ("interface-missing", BASE + "network: {interface: nosuch0}\n", [],
     ["network.interface", "nosuch0", "does not exist"]),
    # storage, checked on the driver before Ray starts
    ("storage-unwritable", BASE + "run: {storage_path: /proc/ray_results}\n", [],
     ["storage_path", "not writable"]),
    ("storage-empty", BASE + "run: {storage_path: ''}\n", [], ["run.storage_path"]),
    ("storage-credentials", BASE + "run: {storage_path: 's3://bkt/runs?access_key=AKIA0&"
                                   "secret_key=SEKRIT&session_token=T0KEN'}\n", [],
     ["run.storage_path", "carries credentials (access_key, secret_key, session_token)",
      "AWS_SECRET_ACCESS_KEY", "secret_key=..."]),
    ("storage-userinfo", BASE, ["--storage-path", "s3://AKIA0:SEKRIT@bkt/runs"],
     ["carries credentials (user:password@)", "s3://...@bkt/runs", "AWS_ACCESS_KEY_ID"]),
    # the mesh against the workers: on the driver, before Ray starts
    ("mesh-vs-workers", BASE + "mesh: {dp_shard: 3}\n", [],
     ["mesh:", "dp_shard=3 x cp=1 x tp=1 = 3 ranks", "2 workers", "scaling.num_workers"]),
    # command-line overrides go through the job's own checks
    ("num-workers-flag", BASE, ["--num-workers", "-2"], ["--num-workers", "from 1"]),
    ("num-workers-flag-float", BASE, ["--num-workers", "2.0"], ["--num-workers",
                                                                "whole number"]),
    ("num-workers-vs-min", BASE + "mesh: hsdp\nrun: {min_workers: 2}\n", ["--num-workers", "1"],
     ["--num-workers 1", "min_workers=2"]),
    ("address-dashboard-url", BASE, ["--address", "http://127.0.0.1:8265"],
     ["--address", "dashboard URL", "127.0.0.1:6379", "auto"]),
    ("address-bad-port", BASE, ["--address", "127.0.0.1:99999"], ["--address", "port"]),
    ("address-open-bracket", BASE, ["--address", "[::1"], ["--address", "[IPv6]:port"]),
]


# One case per class runs in the default tier; the rest of the classes' cases run in the
# opt-in slow tier.
DEFAULT_TIER = {"duplicate-key", "not-utf8", "unknown-nested-key", "bool-as-string",
                "int-as-float", "seconds-nan", "placement", "resources-list",
                "train-outside-folder", "interface-missing", "storage-unwritable",
                "num-workers-flag", "address-dashboard-url", "yaml-deep", "storage-credentials",
                "mesh-vs-workers", "address-open-bracket"}


def _tiered(cases: list, ids: list[str]) -> list:
    return [pytest.param(*c, id=i, marks=() if i in DEFAULT_TIER else pytest.mark.slow)
            for c, i in zip(cases, ids, strict=True)]


@pytest.mark.parametrize("text, args, words",
                         _tiered([c[1:] for c in JOB_CASES], [c[0] for c in JOB_CASES]))
def test_bad_job_file_or_run_flag(cli, tmp_path, text, args, words):
    folder = tmp_path / "a" / "b"
    folder.mkdir(parents=True)
    job = _job(folder, text)
    (folder / "t_nopy").write_text("def train_loop(config):\n    pass\n")
    proc = cli(["run", job, *args], folder)
    _refused(proc, *words)
    assert "SEKRIT" not in proc.stdout + proc.stderr  # a credential is never printed


@pytest.mark.parametrize("target, words", [
    ("{dir}", ["is a directory", "job.yaml"]),
    ("/dev/null", ["not a regular file"]),
    ("{dir}/nope.yaml", ["does not exist"]),
], ids=["directory", "device", "missing"])
def test_run_refuses_what_is_not_a_job_file(cli, tmp_path, target, words):
    _job(tmp_path, BASE)
    _refused(cli(["run", target.format(dir=tmp_path)], tmp_path), *words)


FLAG_CASES = [
    (["plan", "--tp", "0"], ["--tp", "int >= 1"]),
    (["plan", "--layout", "tp_pp", "--pp", "-1"], ["--pp", "int >= 1"]),
    (["plan", "--nodes", "0"], ["--nodes"]),
    (["plan", "--link-mbit", "nan"], ["--link-mbit", "finite"]),
    (["plan", "--layout", "tpp"], ["--layout", "tp_pp"]),
    (["plan", "--address", "http://10.0.0.1:8265"], ["--address", "10.0.0.1:6379"]),
    (["doctor", "--timeout", "0"], ["--timeout", "seconds > 0"]),
    (["doctor", "--timeout", "-5"], ["--timeout", "seconds > 0"]),
    (["doctor", "--timeout", "nan"], ["--timeout", "finite"]),
    (["doctor", "--timeout", "soon"], ["--timeout", "a number"]),
    (["doctor", "--port", "99999"], ["--port", "1 to 65535"]),
    (["doctor", "--port", "0"], ["--port", "1 to 65535"]),
    (["doctor", "--link-probe", "60"], ["--link-probe", "<= 30"]),
    (["doctor", "--interface", ""], ["--interface", "non-empty"]),
    (["doctor", "--address", ""], ["--address", "empty", "auto on purpose"]),
    (["plan", "--address", "[::1:6379"], ["--address", "[IPv6]:port"]),
    (["status", "--timeout", "-1"], ["--timeout", "seconds > 0"]),
    (["status", "--timeout", "inf"], ["--timeout", "finite"]),
    (["run"], ["job"]),
    (["frobnicate"], ["frobnicate"]),
]
DEFAULT_TIER |= {"plan_--tp_0", "doctor_--timeout_nan", "doctor_--port_99999",
                 "status_--timeout_-1", "doctor_--address_"}


@pytest.mark.parametrize("args, words", _tiered(FLAG_CASES, ["_".join(c[0]) for c in FLAG_CASES]))
def test_bad_flags_fail_at_parse_time(cli, tmp_path, args, words):
    line = _refused(cli(args, tmp_path), *words)
    assert "--help" in line


def test_ray_address_env_with_a_dashboard_url(cli, tmp_path):
    job = _job(tmp_path, BASE)
    _refused(cli(["run", job], tmp_path, {"RAY_ADDRESS": "http://127.0.0.1:8265"}),
             "RAY_ADDRESS", "dashboard URL", "127.0.0.1:6379")


@pytest.mark.parametrize("var, value", [("GLOO_SOCKET_IFNAME", "nosuch0"),
                                        ("GLOO_SOCKET_IFNAME", "lo,nosuch0")])
def test_user_set_interface_variable_that_does_not_exist(cli, tmp_path, var, value):
    """On an embedded Ray the workers inherit this environment: checked on the driver."""
    job = _job(tmp_path, BASE)
    _refused(cli(["run", job], tmp_path, {var: value}), var, "nosuch0", f"Unset {var}")


def test_verbose_shows_the_traceback_and_the_line(cli, tmp_path):
    job = _job(tmp_path, BASE + "network: {preflight: 'no'}\n")
    proc = cli(["-v", "run", job], tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "Traceback" in out, out[-3000:]
    assert sum(x.startswith("ray-mesh: error:") for x in out.splitlines()) == 1, out[-3000:]


# ----------------------------------------------------------------------------- plan: no import
STEP_FILE = """\
import pathlib
pathlib.Path(__file__).with_name("IMPORTED").write_text("the step file ran")


def make_step(mesh, config):
    return lambda: None
"""
PLAN_JOB = ("name: j\ntrain: t.py:train_loop\nscaling: {num_workers: 4}\nmesh: auto\n"
            "plan:\n  model: {params: 1000000, layers: 2, hidden: 64, heads: 4}\n"
            "  tokens_per_step: 1024\n  compute_s: 1.0\n  link_mbit: 100\n")
PLAN_ARGS = ["--nodes", "2", "--per-node", "2"]


def test_plan_imports_no_step_file_unless_asked(cli, tmp_path):
    """Importing runs a file's top level: ``ray-mesh plan`` does it only with --import-code,
    and says what it did not do."""
    job = _job(tmp_path, PLAN_JOB + "  step: s.py:make_step\n")
    (tmp_path / "s.py").write_text(STEP_FILE)
    proc = cli(["plan", job, *PLAN_ARGS], tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert not (tmp_path / "IMPORTED").exists(), "the step file was imported"
    assert "did not import plan.step (s.py:make_step)" in out and "--import-code" in out, out
    assert "Started a local Ray instance" not in out
    proc = cli(["plan", job, *PLAN_ARGS, "--import-code"], tmp_path)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert (tmp_path / "IMPORTED").exists() and "imported plan.step" in proc.stdout


def test_plan_refuses_a_model_factory_it_may_not_import(cli, tmp_path):
    job = _job(tmp_path, PLAN_JOB.replace("{params: 1000000, layers: 2, hidden: 64, heads: 4}",
                                          "m.py:make_model"))
    (tmp_path / "m.py").write_text(STEP_FILE.replace("make_step(mesh, config)",
                                                     "make_model(config)"))
    _refused(cli(["plan", job, *PLAN_ARGS], tmp_path), "plan.model", "m.py:make_model",
             "--import-code", "{params, layers, hidden, heads}")
    assert not (tmp_path / "IMPORTED").exists(), "the model file was imported"


# ----------------------------------------------------------------------------- status: hostile
STATUS_FLAG_CASES = [
    (["status", "--max-mb", "0"], ["--max-mb", "from 1 to 4096"]),
    (["status", "--deadline", "0"], ["--deadline", "seconds > 0"]),
    (["status", "--storage", " "], ["--storage", "non-empty"]),
    (["status", "--address", ""], ["--address", "empty", "dashboard URL"]),
    (["status", "--storage", "s3://bkt/runs?secret_key=SEKRIT"],
     ["--storage", "carries credentials (secret_key)", "secret_key=..."]),
]


@pytest.mark.parametrize("args, words", STATUS_FLAG_CASES,
                         ids=["_".join(c[0]) for c in STATUS_FLAG_CASES])
def test_bad_status_flags_fail_at_parse_time(cli, tmp_path, args, words):
    line = _refused(cli(args, tmp_path), *words)
    assert "--help" in line and "SEKRIT" not in line


def test_status_escapes_what_the_cluster_says_in_errors_and_notes(cli, tmp_path):
    """An error page or a run name with escape sequences reaches the terminal escaped."""
    from hostile_dashboard import Dashboard, train_run

    dash = Dashboard()
    try:
        def refuse(h, code: int) -> None:
            body = b"denied\x1b[2J\x1b]0;owned\x07 \r\n"
            h.send_response(code)
            h.send_header("Content-Length", str(len(body)))
            h.end_headers()
            h.wfile.write(body)

        dash.serve(runs=[train_run("r\x1b[31mun")])
        dash.routes["/api/train/v2/runs/v1"] = lambda h: refuse(h, 500)
        proc = cli(["status", "--address", dash.url, "--timeout", "3"], tmp_path)
        out = proc.stdout + proc.stderr
        assert "\x1b" not in out and "\x07" not in out, repr(out[-3000:])
        assert "denied\\x1b[2J\\x1b]0;owned\\x07" in out, out[-3000:]
        dash.routes["/api/v0/nodes"] = lambda h: refuse(h, 403)
        line = _refused(cli(["status", "--address", dash.url, "--timeout", "3"], tmp_path),
                        "refused the request", "403")
        assert "denied\\x1b[2J" in line and "\x1b" not in line, line
    finally:
        dash.close()
