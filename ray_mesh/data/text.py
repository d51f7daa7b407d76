"""Byte-level text for language models: read, pack, measure -- in memory or as Ray Data.

Tokens are bytes (vocab 256): no tokenizer to download, and a model's loss in nats per token
converts straight to bits per byte (divide by ln 2), comparable with the order-0 (unigram)
entropy of the same bytes, :func:`unigram_entropy`. A model under that entropy has learned
more than byte frequencies. Each document ends with :data:`SEPARATOR` (NUL, absent from
text), then the stream is cut into rows of ``seq_len + 1`` tokens (inputs and the next-token
targets of one row overlap by all but one token).

Ray-free except :func:`ray_dataset`, which imports Ray Data when called.
"""

from __future__ import annotations

import functools
import io
import json
import math
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ray_mesh.data.spec import DataSpec, DataSpecError

VOCAB_SIZE = 256
SEPARATOR = 0
"""Appended to every document: the model learns where one file or record ends."""


def documents(raw: bytes, fmt: str, text_key: str = "text", where: str = "<bytes>",
              ) -> Iterator[bytes]:
    """The documents in one file's bytes: the whole file (text), or one per record."""
    if fmt == "text":
        yield raw
        return
    if fmt == "jsonl":
        for n, line in enumerate(raw.splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataSpecError(f"{where} line {n} is not JSON ({exc.msg}); data.format "
                                    f"jsonl wants one JSON object per line.") from exc
            if not isinstance(record, dict) or not isinstance(record.get(text_key), str):
                raise DataSpecError(f"{where} line {n} has no string field {text_key!r}; set "
                                    f"data.text_key to the field that holds the text.")
            yield record[text_key].encode()
        return
    if fmt == "parquet":
        import pyarrow.parquet as pq

        table = pq.read_table(io.BytesIO(raw))
        if text_key not in table.column_names:
            raise DataSpecError(f"{where} has no column {text_key!r} (columns: "
                                f"{table.column_names}); set data.text_key.")
        for value in table.column(text_key).to_pylist():
            if value:
                yield value.encode() if isinstance(value, str) else bytes(value)
        return
    raise DataSpecError(f"data.format {fmt!r} is unknown; use text, jsonl or parquet.")


def encode(doc: bytes) -> np.ndarray:
    """One document's tokens: its bytes, then the separator."""
    out = np.empty(len(doc) + 1, dtype=np.uint8)
    out[:-1] = np.frombuffer(doc, dtype=np.uint8)
    out[-1] = SEPARATOR
    return out


def read_tokens(files: Iterable[Path], fmt: str = "text", text_key: str = "text",
                max_tokens: int | None = None) -> np.ndarray:
    """The token stream of ``files`` in order (uint8), cut at ``max_tokens``."""
    parts: list[np.ndarray] = []
    total = 0
    for path in files:
        for doc in documents(Path(path).read_bytes(), fmt, text_key, str(path)):
            parts.append(encode(doc))
            total += len(parts[-1])
            if max_tokens is not None and total >= max_tokens:
                return np.concatenate(parts)[:max_tokens]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint8)


def pack(tokens: np.ndarray, seq_len: int) -> np.ndarray:
    """Cut a token stream into rows of ``seq_len + 1`` (int64); the remainder is dropped."""
    row = seq_len + 1
    n = len(tokens) // row
    return np.asarray(tokens[: n * row], dtype=np.int64).reshape(n, row)


def unigram_entropy(data: bytes | np.ndarray) -> float:
    """Order-0 entropy in bits per byte: -sum p(b) log2 p(b) over the byte frequencies."""
    arr = np.frombuffer(data, dtype=np.uint8) if isinstance(data, bytes | bytearray) else \
        np.asarray(data).astype(np.int64).ravel()
    if arr.size == 0:
        return 0.0
    counts = np.bincount(arr, minlength=VOCAB_SIZE).astype(np.float64)
    p = counts[counts > 0] / arr.size
    return float(-(p * np.log2(p)).sum())


def bits_per_byte(loss_nats: float) -> float:
    """Cross-entropy per byte-token in nats -> bits per byte."""
    return loss_nats / math.log(2)


def load_split(spec: DataSpec, split: str = "train") -> tuple[torch.Tensor, float]:
    """(rows, unigram entropy) of one split in memory: rows are (n, seq_len+1) int64.

    ``split`` is ``train`` (capped at ``max_tokens``) or ``validation`` (``val_tokens``).
    For torchrun and tests; under Ray use :func:`ray_dataset` for training.
    """
    train, val = spec.split()
    files, cap = (train, spec.max_tokens) if split == "train" else (val, spec.val_tokens)
    if split not in ("train", "validation"):
        raise DataSpecError(f"split must be 'train' or 'validation', got {split!r}.")
    if split == "train" and spec.shuffle_seed is not None:
        rng = np.random.default_rng(spec.shuffle_seed)
        files = [files[i] for i in rng.permutation(len(files))]
    tokens = read_tokens(files, spec.format, spec.text_key, cap)
    rows = pack(tokens, spec.seq_len)
    if len(rows) == 0:
        raise DataSpecError(f"data: the {split} split gives no row of {spec.seq_len + 1} "
                            f"tokens ({len(tokens)} tokens read). Add data or lower seq_len.")
    return torch.from_numpy(rows), unigram_entropy(tokens)


def pack_batch(batch: dict[str, Any], *, seq_len: int, fmt: str, text_key: str,
               ) -> dict[str, np.ndarray]:
    """Ray Data ``map_batches`` body: file bytes -> packed rows ``{"tokens": (n, seq+1)}``.

    Each batch of files packs on its own (its remainder, under one row, is dropped), so no
    state crosses batches and the read streams.
    """
    parts = [encode(doc) for raw in batch["bytes"]
             for doc in documents(bytes(raw), fmt, text_key, "a file of data.paths")]
    tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint8)
    return {"tokens": pack(tokens, seq_len)}


def files_holding(files: list[Path], cap: int, seq_len: int) -> list[Path]:
    """A prefix of ``files`` (format ``text``) whose packed rows surely hold ``cap`` tokens.

    A text file gives its size plus one separator in tokens, and each ``map_batches`` batch
    drops under one row (at most ``seq_len`` tokens) when it packs; counting that loss for
    every file (as if each packed alone) makes the bound safe whatever batches Ray forms.
    Without it Ray Data lists, sizes and plans a read of every file before ``limit`` cuts
    the stream (the standard library: ~1,700 files for the ~130 that 2 MB need), work that
    delayed the first batch of the LM benchmark by minutes on a loaded 2-core machine.
    """
    total = 0
    for n, path in enumerate(files, 1):
        total += path.stat().st_size + 1 - seq_len
        if total >= cap:
            return files[:n]
    return files


def ray_dataset(spec: DataSpec, split: str = "train", *, files_per_batch: int = 16,
                resources: dict[str, float] | None = None) -> Any:
    """A streaming Ray Data dataset of packed rows ``{"tokens": int64[seq_len + 1]}``.

    Files are read by Ray Data's read tasks (wherever they run: the paths must exist on every
    node, as the standard library does; ``resources`` go to the read and pack tasks, e.g. a
    node's ``node:<address>`` that keeps them where the files are) and packed in
    ``map_batches``; nothing is materialised on the driver. The file order is shuffled by
    ``shuffle_seed``; of text files, only the prefix that holds the split's token cap is read
    (:func:`files_holding`).
    """
    import ray.data

    # No Ray Data progress bars: the console has ray_mesh's progress line, and without tqdm
    # installed Ray Data only warns that it cannot draw them.
    ray.data.DataContext.get_current().enable_progress_bars = False
    train, val = spec.split()
    files = train if split == "train" else val
    rng = np.random.default_rng(spec.shuffle_seed)
    files = [files[i] for i in rng.permutation(len(files))]
    cap = spec.max_tokens if split == "train" else spec.val_tokens
    if cap is not None and spec.format == "text":
        files = files_holding(files, cap, spec.seq_len)
    ds = ray.data.read_binary_files([str(p) for p in files], resources=resources)
    ds = ds.map_batches(
        functools.partial(pack_batch, seq_len=spec.seq_len, fmt=spec.format,
                          text_key=spec.text_key),
        batch_format="numpy", batch_size=files_per_batch, resources=resources)
    if cap is not None:
        ds = ds.limit(max(1, cap // (spec.seq_len + 1)))
    return ds


def ray_datasets(spec: DataSpec) -> dict[str, Any]:
    """The datasets a job passes to ``TorchTrainer(datasets=...)``: the training rows.

    Validation stays in memory on every worker (:func:`load_split`): it is small, and every
    rank evaluates the same rows each time, which a streaming split does not promise.
    """
    return {"train": ray_dataset(spec, "train")}
