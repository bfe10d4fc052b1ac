"""The collective save of an FSDP2-sharded policy (see `cohort.checkpointing.dcp` for the shards themselves).

Its folder differs from an unsharded one in two ways: `dcp/` replaces optimizer.pt (model and optimizer shards
written by torch.distributed.checkpoint, loadable on any number of ranks), and each rank r > 0 adds
`rng-{r}.pt` beside rank 0's rng.pt (also written as rng-0.pt). The Hugging Face files are still there,
gathered by rank 0. The atomic guarantee holds across ranks: rank 0 names the temporary directory, every rank
writes into it, and only once every rank reports success does rank 0 rename it into place and move `latest`.
Its manifest.json covers the files of every rank: after the barrier every rank hashes a share of the folder's
files (of those it sees) and rank 0 writes the one manifest from all the shares.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from cohort.checkpointing import dcp
from cohort.checkpointing.atomic import (
    complete_and_publish,
    fsync_file,
    sweep_temporaries,
    temporary_dir,
    trainer_state_json,
)
from cohort.checkpointing.errors import CheckpointError
from cohort.checkpointing.manifest import FileEntry, hash_files, scan
from cohort.checkpointing.rng import rng_state
from cohort.run.directory import CHECKPOINTS_DIR
from cohort.run.layout import RNG_FILE, SCHEDULER_FILE, checkpoint_path, rank_rng_file


def save_sharded(run_dir: str | os.PathLike, step: int, model: Any, tokenizer: Any, optimizer: Any,
                 scheduler: Any, trainer_state: Mapping[str, Any], keep_last: int | None) -> Path:
    """The collective save of an FSDP2-sharded model; see the module docstring for what it writes.

    Every rank runs the same collectives in the same order: a broadcast (the temporary directory), DCP's
    save, the gathers of the Hugging Face export, an all-gather of each rank's outcome, an all-gather of
    each rank's listing of the folder, an all-gather of the files' hashes, a broadcast of rank 0's outcome. A step that fails raises on every rank, and nothing outside the hidden temporary directory
    changes until every rank has written its part.
    """
    rank = dist.get_rank()
    root = Path(run_dir) / CHECKPOINTS_DIR
    final = checkpoint_path(run_dir, step)

    # 1. Rank 0 checks the trainer state (before anything is written) and creates the temporary directory.
    def start() -> tuple[str, str]:
        text = trainer_state_json(step, trainer_state)
        root.mkdir(parents=True, exist_ok=True)
        sweep_temporaries(root)
        tmp = temporary_dir(root, final)
        tmp.mkdir()
        return tmp.name, text

    tmp_name, state_text = _on_rank0(rank, f"checkpoint step {step}: starting the save", start)
    tmp = root / tmp_name
    # 2. Every rank writes its shards. DCP shares each rank's outcome before returning, so a failure on one
    #    rank raises on all of them here, and no rank runs ahead into the next collective.
    try:
        dcp.save_sharded_state(tmp, model, optimizer)
    except BaseException:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    # 3. The export's gathers (collective), then the files one rank writes alone. Their failures are caught
    #    so that every rank reaches the exchange of outcomes, which also serves as the barrier.
    error = None
    try:
        dcp.export_hf(tmp, model)
        _write_rank_files(tmp, rank, tokenizer, scheduler)
    except BaseException as e:
        error = e
    outcomes: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(outcomes, None if error is None else f"{type(error).__name__}: {error}")
    failed = {r: msg for r, msg in enumerate(outcomes) if msg is not None}
    if failed:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if error is not None:
            raise error
        raise CheckpointError(f"checkpoint step {step} was not saved: rank(s) failed writing it: {failed}")

    # 4. The manifest covers every rank's files: every rank lists the folder and hashes a share of them.
    known = _hash_shares(tmp, rank, step)
    # 5. Rank 0 completes the directory (trainer_state.json, then the manifest: without them a directory is
    #    incomplete), moves it into place, points `latest` at it and prunes; every rank waits for its outcome.
    _on_rank0(rank, f"checkpoint step {step}: putting it in place",
              lambda: complete_and_publish(tmp, final, state_text, keep_last, optimizer_state=optimizer is not None,
                                           known=known))
    return final


def _hash_shares(tmp: Path, rank: int, step: int) -> dict[str, FileEntry]:
    """The size and SHA-256 of every file written so far, hashed in parallel, gathered on every rank.

    Every rank lists the folder (the exchange of outcomes was the barrier: every rank's files are in it) and
    the listings are shared; each file is hashed by one of the ranks that listed it, so a file is never lost
    to a stale directory listing (NFS caches them) while its writer sees it. A failure on any rank raises on
    every rank.
    """
    world = dist.get_world_size()
    error, listing = None, []
    try:
        listing = sorted(scan(tmp)[0])
    except OSError as e:
        error = f"{type(e).__name__}: {e}"
    listings: list[Any] = [None] * world
    dist.all_gather_object(listings, listing)
    seen = [set(names) for names in listings]
    mine: dict[str, FileEntry] = {}
    if error is None:
        names = sorted(set().union(*seen))
        owners = [[r for r in range(world) if name in seen[r]] for name in names]
        try:
            mine = hash_files(tmp, [n for i, (n, who) in enumerate(zip(names, owners)) if who[i % len(who)] == rank])
        except OSError as e:
            error = f"{type(e).__name__}: {e}"
    shares: list[Any] = [None] * world
    dist.all_gather_object(shares, (mine, error))
    failed = {r: err for r, (_entries, err) in enumerate(shares) if err is not None}
    if failed:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"checkpoint step {step} was not saved: rank(s) failed hashing its files: {failed}")
    return {name: entry for entries, _err in shares for name, entry in entries.items()}


def _on_rank0(rank: int, what: str, fn: Any) -> Any:
    """Run `fn` on rank 0 alone and broadcast its result; when it fails, raise on every rank (the original
    exception on rank 0, a CheckpointError naming it elsewhere), so no rank is left waiting."""
    shared: list[Any] = [None, None]  # [result, rank 0's error]
    error = None
    if rank == 0:
        try:
            shared[0] = fn()
        except BaseException as e:
            error, shared[1] = e, f"{type(e).__name__}: {e}"
    dist.broadcast_object_list(shared, src=0)
    if shared[1] is not None:
        if error is not None:
            raise error
        raise CheckpointError(f"{what} failed on rank 0: {shared[1]}")
    return shared[0]


def _write_rank_files(tmp: Path, rank: int, tokenizer: Any, scheduler: Any) -> None:
    """Each rank's RNG state; rank 0 also writes the tokenizer and the scheduler (the same on every rank)."""
    rng_file = tmp / (RNG_FILE if rank == 0 else rank_rng_file(rank))
    torch.save(rng_state(), rng_file)
    fsync_file(rng_file)  # rank 0 fsyncs the whole tree later; the other ranks flush their own file
    if rank == 0:
        shutil.copyfile(rng_file, tmp / rank_rng_file(0))
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if scheduler is not None:
            torch.save(scheduler.state_dict(), tmp / SCHEDULER_FILE)
