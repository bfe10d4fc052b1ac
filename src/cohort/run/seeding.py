"""One seed for every random number generator a run draws from (Python's, NumPy's, torch's), and the switch
that makes a run's arithmetic repeatable (`train.deterministic`)."""

from __future__ import annotations

import os
import random
import warnings

import numpy as np
import torch

# cuBLAS picks among reduction strategies per call unless its workspace is fixed (NVIDIA's cuBLAS docs,
# "Results reproducibility"); the value must be in the environment before the process's first cuBLAS handle.
CUBLAS_WORKSPACE = ":4096:8"


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def set_deterministic(on: bool) -> None:
    """train.deterministic: the same seed, config and hardware give bitwise identical weights.

    Turns on torch's deterministic algorithms (an op without a deterministic implementation raises, naming
    itself, instead of silently varying), cuDNN's deterministic mode without autotuning, and cuBLAS's fixed
    workspace. cohort's own kernels (the engine's Triton attention and sampler, the logprob kernels) use no
    atomics: their reduction order is fixed by the launch shape. Off, nothing is changed (torch's defaults)."""
    if not on:
        return
    if os.environ.get("CUBLAS_WORKSPACE_CONFIG") not in (CUBLAS_WORKSPACE, ":16:8"):
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            warnings.warn(
                "train.deterministic=true: CUDA was initialised before CUBLAS_WORKSPACE_CONFIG was set, so "
                "cuBLAS handles made so far may reduce in varying order; start the process with "
                f"CUBLAS_WORKSPACE_CONFIG={CUBLAS_WORKSPACE} (`cohort train` sets it before any model loads).",
                stacklevel=2)
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACE
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
