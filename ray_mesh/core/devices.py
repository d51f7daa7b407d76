"""Which device a rank computes on, and making it current for a thread (Ray-free).

Split from :mod:`ray_mesh.core.bootstrap`, which re-exports these names.
"""

from __future__ import annotations

import os

import torch

from ray_mesh.errors import BootstrapError


def pick_device(backend: str | None, local_rank: int, device: str | None = None) -> torch.device:
    """The device this rank computes on: the one given, else cuda:LOCAL_RANK, else cpu."""
    if device is not None:
        dev = torch.device(device)
    elif backend != "gloo" and torch.cuda.is_available():
        dev = torch.device("cuda", local_rank % torch.cuda.device_count())
    else:
        dev = torch.device("cpu")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise BootstrapError(
            f"Device {dev} was asked for but CUDA is not available in this process "
            f"(torch {torch.__version__}, CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r}). Ask for GPUs in the scaling config, "
            f"or run on CPU with backend='gloo'."
        )
    return dev


def default_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def use_device(device: torch.device) -> None:
    """Make ``device`` current for the calling thread (CUDA's current device is per thread)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
