"""The llm pieces without a process group: model config, text data, the data: job section."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from ray_mesh.cli.job import Job, JobError
from ray_mesh.data.spec import DataSpec, DataSpecError, stdlib_files
from ray_mesh.data.text import (
    SEPARATOR,
    documents,
    encode,
    load_split,
    pack,
    pack_batch,
    unigram_entropy,
)
from ray_mesh.models import PRESETS, Llama, LlamaConfig, ModelConfigError, num_params

ROOT = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------------------- model config
@pytest.mark.parametrize("kwargs, match", [
    ({"dim": 100, "n_heads": 8}, r"n_heads=8 does not divide dim=100.*n_heads in \(1, 2, 4, 5"),
    ({"dim": 96, "n_heads": 6, "n_kv_heads": 4}, r"n_kv_heads=4 does not divide n_heads=6"),
    ({"dim": 60, "n_heads": 4}, r"head_dim = dim/n_heads = 15 is odd"),
    ({"n_layers": 0}, r"model.n_layers must be a positive int"),
    ({"dim": 64.0}, r"model.dim must be a positive int"),
])
def test_model_config_errors_name_the_key_and_fix(kwargs, match):
    with pytest.raises(ModelConfigError, match=match):
        LlamaConfig(**kwargs)


def test_model_config_from_dict_presets_and_typos():
    assert LlamaConfig.from_dict({"preset": "tiny", "dim": 64}).dim == 64
    with pytest.raises(ModelConfigError, match=r"preset 'huge' is unknown"):
        LlamaConfig.from_dict({"preset": "huge"})
    with pytest.raises(ModelConfigError, match=r"unknown key\(s\) \['n_head'\]"):
        LlamaConfig.from_dict({"n_head": 4})


def test_tp_needs_whole_heads_including_kv_heads():
    cfg = LlamaConfig.from_dict({"preset": "small"})  # 6 heads, 2 kv heads
    cfg.check_tp(2)
    with pytest.raises(ModelConfigError, match=r"tp=4 does not divide model n_heads=6"):
        cfg.check_tp(4)
    with pytest.raises(ModelConfigError, match=r"tp=4 does not divide model n_kv_heads=2"):
        LlamaConfig(dim=128, n_heads=8, n_kv_heads=2).check_tp(4)


def test_sequence_longer_than_max_seq_len_is_refused():
    model = Llama(LlamaConfig.from_dict({"preset": "tiny", "max_seq_len": 16}))
    assert model(torch.zeros(2, 16, dtype=torch.long)).shape == (2, 16, 256)
    with pytest.raises(ModelConfigError, match=r"length=17 is longer than the model's "
                                                r"max_seq_len=16.*raise model.max_seq_len"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_model_sizes_gqa_and_tied_embeddings():
    sizes = {name: num_params(Llama(LlamaConfig.from_dict({"preset": name})))
             for name in ("tiny", "small")}
    assert 0.3e6 < sizes["tiny"] < 1.5e6 and 1.2e6 < sizes["small"] < 5e6, sizes
    base = LlamaConfig.from_dict({"preset": "base"})
    assert PRESETS["base"]["dim"] == 512 and base.kv_heads < base.n_heads
    cfg = LlamaConfig.from_dict({"preset": "tiny"})
    model = Llama(cfg)
    assert model.layers[0].attention.wk.out_features == cfg.kv_heads * cfg.head_dim < cfg.dim
    tied = Llama(LlamaConfig.from_dict({"preset": "tiny", "tie_embeddings": True}))
    assert tied.output.weight is tied.tok_embeddings.weight
    assert num_params(tied) == sizes["tiny"] - cfg.vocab_size * cfg.dim


def test_fsdp_wrapped_modules_return_tensors_of_their_own_not_views():
    """nn.Linear on a 3-D input returns a view of its 2-D matmul, tensor parallel the local
    view of a gathered buffer (the llm and fsdp_tp_transformer examples' outputs): wrapped
    with FSDP2 such an output warns on every forward (an in-place op on it would skip FSDP's
    all-gather). apply_fsdp registers own_output on every module it wraps: it copies them."""
    from ray_mesh.parallel.fsdp import own_output

    head = torch.nn.Linear(16, 32)
    x = torch.randn(2, 8, 16)
    assert head(x)._base is not None  # the plain module's output is a view
    head.register_forward_hook(own_output)
    out = head(x)
    assert out._base is None and out.shape == (2, 8, 32)
    with torch.no_grad():  # no grad: nothing for FSDP to hook, no copy
        assert head(x)._base is not None
    view = torch.randn(4, 4, requires_grad=True).view(16)
    pair = own_output(head, (), (view, out))
    assert isinstance(pair, tuple) and all(t._base is None for t in pair)


def test_causal_model_ignores_future_tokens():
    model = Llama(LlamaConfig.from_dict({"preset": "tiny"})).eval()
    x = torch.randint(0, 256, (1, 12))
    y = x.clone()
    y[0, 8:] = (y[0, 8:] + 1) % 256
    with torch.no_grad():
        a, b = model(x), model(y)
    assert torch.allclose(a[0, :8], b[0, :8], atol=1e-6)
    assert not torch.allclose(a[0, 8:], b[0, 8:])


# ----------------------------------------------------------------------------- text
@pytest.mark.parametrize("text, bits", [(b"aaaa", 0.0), (b"abab", 1.0), (b"abcd", 2.0),
                                         (bytes(range(256)), 8.0), (b"aaab", 0.8112781)])
def test_unigram_entropy_of_known_strings(text, bits):
    assert unigram_entropy(text) == pytest.approx(bits, abs=1e-6)
    assert unigram_entropy(np.frombuffer(text, dtype=np.uint8)) == pytest.approx(bits, abs=1e-6)


def test_pack_cuts_rows_of_seq_len_plus_one_and_drops_the_rest():
    rows = pack(np.arange(23, dtype=np.uint8), seq_len=4)
    assert rows.dtype == np.int64 and rows.shape == (4, 5)
    assert rows[1].tolist() == [5, 6, 7, 8, 9] and rows[-1, -1] == 19
    assert encode(b"hi").tolist() == [104, 105, SEPARATOR]
    out = pack_batch({"bytes": np.array([b"abc", b"defgh"], dtype=object)}, seq_len=3,
                     fmt="text", text_key="text")
    assert out["tokens"].tolist() == [[97, 98, 99, 0], [100, 101, 102, 103]]


def test_jsonl_and_parquet_documents(tmp_path):
    lines = b'{"text": "hello"}\n\n{"text": "w\xc3\xb6rld"}\n'
    assert list(documents(lines, "jsonl")) == [b"hello", "wörld".encode()]
    with pytest.raises(DataSpecError, match=r"line 1 has no string field 'body'.*text_key"):
        list(documents(lines, "jsonl", text_key="body"))
    with pytest.raises(DataSpecError, match=r"line 1 is not JSON"):
        list(documents(b"not json\n", "jsonl"))
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["a", "bc"]}), tmp_path / "x.parquet")
    raw = (tmp_path / "x.parquet").read_bytes()
    assert list(documents(raw, "parquet")) == [b"a", b"bc"]


def test_stdlib_split_is_deterministic_and_disjoint():
    files = stdlib_files()
    assert len(files) > 500 and all(f.suffix == ".py" for f in files)
    spec = DataSpec.from_dict({"validation": 0.05, "shuffle_seed": 3})
    train, val = spec.split(files)
    assert not set(train) & set(val) and len(train) + len(val) == len(files)
    assert val == spec.split(files)[1]
    assert val != DataSpec.from_dict({"shuffle_seed": 4}).split(files)[1]
    held = DataSpec.from_dict({"validation": ["*/json/*"]}).split(files)[1]
    assert held and all("/json/" in p.as_posix() for p in held)


def test_stdlib_files_are_the_globs_without_walking_the_installed_packages(monkeypatch):
    """The same files as globbing ``**/*.py`` and dropping site-packages (the split and the
    groups' manifest depend on the list), without entering site-packages: a glob walked
    every installed package on every worker at each start and evaluation."""
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    globbed = sorted(p for p in root.rglob("*.py")
                     if not {"site-packages", "dist-packages"} & set(p.relative_to(root).parts))
    walked: list[str] = []
    real_walk = os.walk

    def walk(top, *args, **kwargs):
        for folder, dirs, names in real_walk(top, *args, **kwargs):
            walked.append(folder)
            yield folder, dirs, names

    monkeypatch.setattr(os, "walk", walk)
    assert stdlib_files() == globbed
    assert walked and not [f for f in walked if "site-packages" in Path(f).parts
                           and "site-packages" not in root.parts]


def test_load_split_small_jsonl_corpus(tmp_path):
    for i in range(4):
        recs = [{"text": f"doc {i}.{j} " * 20} for j in range(5)]
        (tmp_path / f"p{i}.jsonl").write_text("\n".join(json.dumps(r) for r in recs))
    spec = DataSpec.from_dict({"paths": ["*.jsonl"], "format": "jsonl", "seq_len": 16,
                               "validation": ["*p3.jsonl"], "batch_size": 2}, base_dir=tmp_path)
    rows, entropy = load_split(spec, "train")
    assert rows.shape[1] == 17 and rows.dtype == torch.int64 and len(rows) > 10
    assert 1.0 < entropy < 5.0
    val, _ = load_split(spec, "validation")
    assert b"doc 3." in bytes(val[0].to(torch.uint8).tolist())


# ----------------------------------------------------------------------------- DataSpec errors
def test_data_missing_path(tmp_path):
    with pytest.raises(DataSpecError, match=r"data.paths\[1\] = 'nope/\*.txt' matches no file"):
        DataSpec.from_dict({"paths": ["stdlib", "nope/*.txt"]}, base_dir=tmp_path).check()


def test_data_empty_dataset(tmp_path):
    for i in range(3):
        (tmp_path / f"e{i}.txt").write_text("")
    spec = DataSpec.from_dict({"paths": [str(tmp_path)]})
    with pytest.raises(DataSpecError, match=r"training split is empty or too small: 2 files, "
                                            r"0 bytes.*Add data to data.paths"):
        spec.check(dp_size=2)


def test_data_batch_not_divisible_by_dp():
    spec = DataSpec.from_dict({"batch_size": 10})
    with pytest.raises(DataSpecError, match=r"batch_size=10 does not split over the mesh's 4 "
                                            r"data-parallel ranks.*batch_size: 8"):
        spec.check(dp_size=4)
    with pytest.raises(DataSpecError, match=r"batch_tokens=300 is not a whole number"):
        DataSpec.from_dict({"batch_tokens": 300, "seq_len": 128})


def test_data_seq_len_too_long_for_the_model():
    with pytest.raises(DataSpecError, match=r"seq_len=1024 is longer than the model's "
                                            r"max_seq_len=256.*config.model.max_seq_len"):
        DataSpec.from_dict({"seq_len": 1024}).check(max_seq_len=256)


@pytest.mark.parametrize("section, match", [
    ({"seqlen": 4}, r"Unknown key 'seqlen' in 'data'. Did you mean 'seq_len'"),
    ({"format": "csv"}, r"data.format must be one of text, jsonl, parquet; got 'csv'"),
    ({"validation": 1.5}, r"data.validation must be a fraction"),
    ("stdlib", r"'data' must be a mapping"),
])
def test_data_bad_values(section, match):
    with pytest.raises(DataSpecError, match=match):
        DataSpec.from_dict(section)


def _job(**data) -> dict:
    return {"train": "llm.py:train_loop", "mesh": {"dp_shard": -1, "tp": 2},
            "scaling": {"num_workers": 4}, "config": {"model": {"max_seq_len": 256}},
            "data": {"paths": ["stdlib"], **data}}


def test_job_checks_data_against_mesh_and_model():
    job = Job.from_dict(_job(batch_size=8), base_dir=ROOT / "examples")
    assert job.data.global_batch == 8 and job.data.base_dir.endswith("examples")
    with pytest.raises(JobError, match=r"batch_size=7 does not split over the mesh's 2"):
        Job.from_dict(_job(batch_size=7))
    with pytest.raises(JobError, match=r"seq_len=512 is longer than the model's max_seq_len=256"):
        Job.from_dict(_job(seq_len=512))
    assert Job.from_yaml(ROOT / "examples" / "llm.yaml").data.seq_len == 128


def test_bad_data_section_fails_on_the_driver_before_ray_starts(tmp_path):
    job = tmp_path / "bad.yaml"
    job.write_text(f"train: {ROOT / 'examples' / 'llm.py'}:train_loop\n"
                   "mesh: {dp_shard: -1, tp: 2}\nscaling: {num_workers: 4}\n"
                   "data: {paths: [missing_dir/**/*.txt], seq_len: 64}\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_ADDRESS": ""}
    proc = subprocess.run([sys.executable, "-m", "ray_mesh.cli.main", "run", str(job)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "ray-mesh: error: data.paths[0] = 'missing_dir/**/*.txt' matches no file" \
        in proc.stderr, proc.stderr
    # No Ray was started: neither a local instance nor any worker.
    assert "Started a local Ray instance" not in proc.stdout + proc.stderr
    assert not (tmp_path / "ray_results").exists()


def _example():
    import importlib.util

    spec = importlib.util.spec_from_file_location("llm_example_unit", ROOT / "examples" / "llm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_example_schedule_and_step_indexed_batches():
    ex = _example()
    cfg = ex.merged({"steps": 100, "warmup": 10, "min_lr_ratio": 0.1})
    factors = [ex.lr_factor(s, cfg) for s in range(100)]
    assert factors[0] == pytest.approx(0.1) and factors[9] == pytest.approx(1.0)
    assert factors[10] == pytest.approx(1.0) and factors[-1] == pytest.approx(0.1, abs=1e-3)
    assert all(a >= b for a, b in zip(factors[10:-1], factors[11:], strict=True))  # cosine decays
    small = {"data": {"seq_len": 16, "batch_size": 4, "max_tokens": 2000, "val_tokens": 500}}
    x0, y0 = ex.batch(0, small)
    assert x0.shape == (4, 16) and torch.equal(x0[:, 1:], y0[:, :-1])
    assert torch.equal(ex.batch(0, small)[0], x0)       # the step alone decides the batch
    assert not torch.equal(ex.batch(1, small)[0], x0)


def test_data_job_needs_a_cpu_left_for_ray_data():
    from ray.train import ScalingConfig

    from ray_mesh.cli.runner import check_data_resources

    job = Job.from_dict(_job(batch_size=8))
    scaling = ScalingConfig(num_workers=4, resources_per_worker={"CPU": 1})
    with pytest.raises(JobError, match=r"Ray Data.*4 workers take 4 of the cluster's 4 CPUs"
                                       r".*resources_per_worker.CPU"):
        check_data_resources(job, scaling, {"CPU": 4})
    check_data_resources(job, scaling, {"CPU": 6})
    check_data_resources(Job.from_dict({"train": "a:b"}), scaling, {"CPU": 4})  # no data:


def test_ray_dataset_reads_only_the_files_that_hold_the_cap(tmp_path):
    """files_holding: the shortest prefix whose rows hold the cap even if every file packs
    alone (each drops under one row); the in-memory split reads the same prefix."""
    from ray_mesh.data.text import files_holding

    files = []
    for i, size in enumerate([100, 50, 300, 80, 500]):
        f = tmp_path / f"f{i}.txt"
        f.write_bytes(b"x" * size)
        files.append(f)
    # tokens per file: size + 1; minus seq_len 10 lost per file at worst
    assert files_holding(files, 91, 10) == files[:1]
    assert files_holding(files, 92, 10) == files[:2]
    assert files_holding(files, 91 + 41 + 291, 10) == files[:3]
    assert files_holding(files, 10**6, 10) == files
    rows = [pack(np.frombuffer(f.read_bytes() + b"\0", np.uint8), 10)
            for f in files_holding(files, 400, 10)]
    assert sum(len(r) for r in rows) >= 400 // 11


def test_warmup_cosine_schedule():
    from ray_mesh.models.schedule import warmup_cosine

    f = [warmup_cosine(s, warmup=4, total=12, min_ratio=0.1) for s in range(14)]
    assert f[:4] == [0.25, 0.5, 0.75, 1.0]  # linear warm-up, reaching 1 at its last step
    assert f[4] == 1.0 and all(a >= b for a, b in zip(f[4:], f[5:], strict=False))  # decays
    assert f[12] == pytest.approx(0.1) and f[13] == pytest.approx(0.1)  # the floor, held


def test_the_general_runner_wires_no_model_or_corpus_by_special_case():
    """ray_mesh.data and ray_mesh.models are public parts of the package; the runner hands a
    job's data: section over through the job (Job.trainer_inputs), whatever the model."""
    import ast

    tree = ast.parse((ROOT / "ray_mesh" / "cli" / "runner.py").read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not {m for m in imported if m and m.startswith(("ray_mesh.data", "ray_mesh.models"))}
    job = Job.from_dict({"train": "x.py:f", "config": {"steps": 3}})
    assert job.trainer_inputs() == (None, {"steps": 3})
