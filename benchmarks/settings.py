"""The benchmark settings: full runs and ``--quick`` smoke runs, one dict per section."""

from __future__ import annotations

from benchmarks import paired


def config(quick: bool) -> dict:
    if quick:
        return {"runs": 1, "sizes": [4], "step_workers": 4,
                "bringup_modes": ["plain", "ray_mesh", "torchrun"],
                "step_workloads": ["hsdp"],
                "step_contenders": list(paired.CONTENDERS),
                "steps_args": {"batch": 16, "warmup": 3, "steps_per_window": 5, "rounds": 3,
                               "timeout_s": 600},
                "metrics_runs": 1, "metrics_windows": 2,
                "scaling_sizes": [4], "scaling_runs": 1,
                "meshbuild_sizes": [4], "meshbuild_repeats": 1,
                "crossnode_model": {"width": 256, "layers": 2, "steps": 3, "warmup": 1},
                "slowlinks": {"rates": [100], "steps": 2},
                "wireguard": {"rates": [20], "steps": 2, "reps": 1, "width": 256, "layers": 2},
                "recovery_where": ["local"],
                "diloco": {"rates": [20], "steps": 12, "every": 4, "streaming": 2, "overlap": 1,
                           "model": {"max_tokens": 200_000, "warmup": 2}},
                "slow": {"rounds": 3, "steps": 10, "detect_too": False},
                "llm": {"pairs": 1, "steps": 8, "warmup": 3, "workers": 4, "timeout_s": 600},
                # over benchmarks/user_job.py's SETTINGS: sync throughput only, float32 and int8
                "user_job": {"modes": ["sync", "sync_int8"],
                             "sync": {"steps": 20, "alone_counted": 8},
                             "sync_int8": {"steps": 20, "alone_counted": 8,
                                           "compress": "int8"},
                             "warmup": 3, "drops": None, "goodput": False,
                             "whole_twice": False}}
    return {"runs": 3, "sizes": [4, 8], "step_workers": 4,
            "bringup_modes": ["plain", "ray_mesh", "torchrun", "ray_mesh_nopf"],
            "step_workloads": ["hsdp", "tp_pp_mlp"],
            "step_contenders": list(paired.CONTENDERS),
            "steps_args": {"batch": 16, "warmup": 10, "steps_per_window": 20, "rounds": 15,
                           "timeout_s": 900},
            "metrics_runs": 2, "metrics_windows": 5,
            "scaling_sizes": [4, 8, 16], "scaling_runs": 1,
            "meshbuild_sizes": [4, 8, 16], "meshbuild_repeats": 3,
            "crossnode_model": {"width": 512, "layers": 4, "steps": 10, "warmup": 2},
            "slowlinks": {"rates": [1000, 100, 20], "steps": 16},
            # rates: null = unshaped; width x width x layers parameters for the checkpoints
            "wireguard": {"rates": [None, 100, 20], "steps": 8, "reps": 3, "width": 1024,
                          "layers": 8},
            "recovery_where": ["local", "netns"],
            # the LM job; H, compression and the outer optimizer: see docs/diloco.md
            "diloco": {"rates": [100, 20], "steps": 200, "every": 10, "compress": "int8",
                       "streaming": 5, "overlap": 1,
                       "outer_lr": 0.7, "outer_momentum": 0.5, "val_batches": 16,
                       "model": {"batch_size": 8}, "timeout_s": 2400},
            "slow": {"rounds": 10, "steps": 30, "detect_too": True},
            "llm": {"pairs": 5, "steps": 30, "warmup": 5, "workers": 4, "timeout_s": 900},
            "user_job": {}}  # benchmarks/user_job.py's SETTINGS as they are
