"""Atomic checkpoints and exact resume.

Layout of one checkpoint, `run_dir/checkpoints/step-000100/`:

    config.json, model.safetensors, ...   the policy in Hugging Face format: the directory itself loads with
                                          `AutoModelForCausalLM.from_pretrained` (for a PEFT model: the
                                          adapter, adapter_config.json + adapter_model.safetensors, which
                                          `peft.AutoPeftModelForCausalLM.from_pretrained` loads)
    tokenizer files                       when a tokenizer is given
    optimizer.pt, scheduler.pt            state dicts, when given
    rng.pt                                Python `random`, NumPy, torch CPU and every CUDA generator
    trainer_state.json                    step plus whatever JSON the trainer passes (data position, ...)
    manifest.json                         every other file's size and SHA-256, and whether the optimizer was
                                          saved; written last, checked before a load reads anything

A policy sharded with FSDP2 (`fully_shard`, see `cohort.checkpointing.dcp`) is saved collectively, by every
rank, and its folder differs in two ways: `dcp/` replaces optimizer.pt (model and optimizer shards written by
torch.distributed.checkpoint, loadable on any number of ranks), and each rank r > 0 adds `rng-{r}.pt` beside
rank 0's rng.pt (also written as rng-0.pt). The Hugging Face files are still there, gathered by rank 0.

Atomicity: everything is written into a hidden sibling `.tmp-step-000100-<id>/`, fsynced, then renamed into
place with `os.replace`, and only then is `checkpoints/latest` (a one-line file naming the directory)
replaced atomically. A crash at any point leaves the previous checkpoint whole and `latest` pointing at it;
hidden temporary directories are never picked up and are swept by the next save. A sharded save keeps the
same guarantee across ranks: rank 0 names the temporary directory, every rank writes into it, and only once
every rank reports success does rank 0 rename it into place and move `latest`.

Verification: `load_checkpoint` (and `has_optimizer_state`) check the folder against manifest.json before
anything in it is parsed; a file missing, changed or not listed, or a checkpoint saved before manifests, is a
CheckpointError naming it (`manifest`; `python -m cohort.checkpointing.trust PATH` records the manifest of an
older checkpoint you trust). DCP's pickled metadata is read by a restricted unpickler (`dcp_reader`).

Modules: `cohort.run.layout` (file names, step folders, `latest_checkpoint`), `saving` (`save_checkpoint`,
unsharded save), `sharded_saving` (the collective FSDP2 save), `atomic` (temporaries, trainer_state.json and
the manifest last, fsync, rename, `latest`), `manifest` (write, verify), `trust` (the command above),
`retention` (`keep_last` pruning), `loading` (`load_checkpoint`), `weights` (safetensors and PEFT adapters
into a live model), `dcp` and `dcp_reader` (sharded state), `rng` (generator state), `contents` (size,
optimizer state present), `errors` (`CheckpointError`). This package's names below are its public API.
"""

from cohort.checkpointing.contents import checkpoint_size, describe_size, has_optimizer_state
from cohort.checkpointing.errors import CheckpointError
from cohort.checkpointing.loading import load_checkpoint
from cohort.checkpointing.manifest import record_manifest, verify_checkpoint
from cohort.checkpointing.saving import save_checkpoint
from cohort.run.layout import (
    LATEST_FILE,
    MANIFEST_FILE,
    OPTIMIZER_FILE,
    RNG_FILE,
    SCHEDULER_FILE,
    TRAINER_STATE_FILE,
    checkpoint_path,
    latest_checkpoint,
)

__all__ = [
    "LATEST_FILE",
    "MANIFEST_FILE",
    "OPTIMIZER_FILE",
    "RNG_FILE",
    "SCHEDULER_FILE",
    "TRAINER_STATE_FILE",
    "CheckpointError",
    "checkpoint_path",
    "checkpoint_size",
    "describe_size",
    "has_optimizer_state",
    "latest_checkpoint",
    "load_checkpoint",
    "record_manifest",
    "save_checkpoint",
    "verify_checkpoint",
]
