"""Checkpoints are verified before anything in them is parsed, and one run at a time uses a run directory
(issue 35).

- A pickle planted in a checkpoint (as `dcp/.metadata`, as `optimizer.pt`, as an extra file) that would write
  a marker file when unpickled: resume refuses with a CheckpointError naming the file and manifest.json, and
  the marker never appears; a sharded checkpoint whose planted `.metadata` is even recorded in a re-written
  manifest is still refused, by the restricted unpickler.
- A changed byte in the weights, a missing optimizer.pt (unless the manifest says run.save_only_model), a
  checkpoint without manifest.json (saved before verification, until `python -m cohort.checkpointing.trust`
  records one), a malformed trainer-state field: one-line CheckpointErrors, nothing loaded.
- A sharded save on 2 ranks writes one manifest covering both ranks' files.
- The run-directory lock: a second `open_run_dir` (or `train`) on a held directory stops naming the holder's
  pid and host; a lock left by a process that died is taken over with a message.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
import socket
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from tests.integration.test_trainer_learns import toy_components
from tests.integration.test_trainer_learns import toy_config as _toy_config

from cohort import checkpointing as ckpt
from cohort.checkpointing import CheckpointError, trust
from cohort.checkpointing.manifest import write_manifest
from cohort.errors import RunDirInUseError
from cohort.run.directory import open_run_dir
from cohort.run.logging import read_jsonl
from cohort.run.state import RunState
from cohort.trainer import train


def toy_config(out: Path, steps: int):
    """The toy job, small (test_faults' size): these tests check what a resume reads, not learning."""
    cfg = _toy_config(out, steps)
    cfg.train.prompts_per_step, cfg.generation.num_generations, cfg.generation.max_completion_length = 2, 4, 6
    return cfg


class _Plant:
    """Unpickling it writes `marker`: the code a crafted checkpoint file would run."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('code ran')",)


def planted(marker: Path) -> bytes:
    return pickle.dumps(_Plant(marker))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """One-step toy runs, each with its checkpoint: unsharded, sharded (FSDP, a world of one), weights only."""
    root = tmp_path_factory.mktemp("runs")
    out = {}
    for kind, change in (("unsharded", {}), ("sharded", {"sharding": "fsdp"}), ("weights-only", {})):
        cfg = toy_config(root / kind, steps=1)
        cfg.run.save_only_model = kind == "weights-only"
        for key, value in change.items():
            setattr(cfg.train, key, value)
        train(cfg, toy_components(cfg))
        out[kind] = root / kind
    if dist.is_initialized():  # the FSDP run's world of one (tests/conftest.py ends those of a test, not a fixture's)
        dist.destroy_process_group()
    return out


def copy_run(runs: dict[str, Path], kind: str, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of a run's folder to tamper with: (the folder holding run/, its checkpoint)."""
    shutil.copytree(runs[kind], tmp_path / kind)
    return tmp_path / kind, ckpt.latest_checkpoint(tmp_path / kind / "run")


def resume(out: Path, steps: int = 2, **train_settings):
    cfg = toy_config(out, steps)
    cfg.run.resume = True
    for key, value in train_settings.items():
        setattr(cfg.train, key, value)
    lines: list[str] = []
    train(cfg, toy_components(cfg), echo=lines.append)
    return lines


def refused(out: Path, *fragments: str, **train_settings) -> str:
    """Resume `out` and expect a one-line CheckpointError holding every fragment; its message."""
    with pytest.raises(CheckpointError) as err:
        resume(out, **train_settings)
    message = str(err.value)
    assert "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    return message


@pytest.fixture
def no_loads(monkeypatch):
    """Record every torch.load, safetensors load, DCP metadata read and trainer-state read: a refused
    checkpoint must have none."""
    from cohort.checkpointing import dcp, weights

    calls: list[str] = []

    def spy(owner, name):
        real = getattr(owner, name)
        monkeypatch.setattr(owner, name, lambda *a, **k: calls.append(name) or real(*a, **k))

    spy(torch, "load")
    spy(weights, "load_file")
    spy(dcp, "read_metadata")
    spy(RunState, "from_trainer_state")
    return calls


# ------------------------------------------------------------------------------------------ planted pickles
def test_planted_dcp_metadata_without_optimizer_is_refused_before_unpickling(runs, tmp_path, no_loads):
    """The finding: optimizer.pt gone and a dcp/.metadata planted made resume unpickle it, on one CPU process."""
    out, path = copy_run(runs, "unsharded", tmp_path)
    marker = tmp_path / "marker"
    (path / "optimizer.pt").unlink()
    (path / "dcp").mkdir()
    (path / "dcp" / ".metadata").write_bytes(planted(marker))
    message = refused(out, "manifest.json", str(path), "start over")
    assert "dcp/.metadata" in message or "optimizer.pt" in message
    for check in (ckpt.has_optimizer_state, lambda p: ckpt.load_checkpoint(p, model=toy_components(
            toy_config(out, 1)).policy)):
        with pytest.raises(CheckpointError):
            check(path)
    assert not marker.exists(), "the planted pickle ran"
    assert no_loads == [], no_loads


def test_planted_pickle_as_optimizer_file_is_refused_before_torch_load(runs, tmp_path, no_loads):
    out, path = copy_run(runs, "unsharded", tmp_path)
    marker = tmp_path / "marker"
    (path / "optimizer.pt").write_bytes(planted(marker))
    refused(out, str(path / "optimizer.pt"), "manifest.json")
    assert not marker.exists() and no_loads == [], no_loads


def test_planted_unlisted_file_is_refused(runs, tmp_path, no_loads):
    out, path = copy_run(runs, "unsharded", tmp_path)
    marker = tmp_path / "marker"
    (path / "rng-1.pt").write_bytes(planted(marker))  # a name the loader would read on rank 1
    refused(out, str(path / "rng-1.pt"), "is not in manifest.json")
    assert not marker.exists() and no_loads == [], no_loads


def test_planted_sharded_metadata_is_refused_even_with_a_rewritten_manifest(runs, tmp_path):
    out, path = copy_run(runs, "sharded", tmp_path)
    marker = tmp_path / "marker"
    (path / "dcp" / ".metadata").write_bytes(planted(marker))
    refused(out, str(path / "dcp" / ".metadata"), "manifest.json", sharding="fsdp")
    assert not marker.exists()
    # Whoever can write the folder can rewrite its manifest too: the restricted unpickler still refuses (and
    # so does `python -m cohort.checkpointing.trust`, which reads the metadata the same way).
    (path / "manifest.json").unlink()
    assert trust.main([str(path)]) == 2 and not (path / "manifest.json").exists()
    write_manifest(path, optimizer_state=True)
    refused(out, "not one of torch.distributed.checkpoint's metadata records", sharding="fsdp")
    with pytest.raises(CheckpointError):
        ckpt.load_checkpoint(path, model=toy_components(toy_config(out, 1)).policy, restore_rng=False)
    assert not marker.exists(), "the planted pickle ran"


# ------------------------------------------------------------------------------------------------ damage
def test_a_changed_byte_in_the_weights_is_refused(runs, tmp_path):
    out, path = copy_run(runs, "unsharded", tmp_path)
    weights = path / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x01  # inside a tensor: safetensors itself would load it
    weights.write_bytes(bytes(data))
    refused(out, str(weights), "damaged or was changed", "SHA-256")
    comp = toy_components(toy_config(out, 1))
    before = {n: p.detach().clone() for n, p in comp.policy.named_parameters()}
    with pytest.raises(CheckpointError):
        ckpt.load_checkpoint(path, model=comp.policy)
    assert all(torch.equal(before[n], p) for n, p in comp.policy.named_parameters()), "weights were loaded"


def test_a_missing_optimizer_file_is_refused_unless_saved_weights_only(runs, tmp_path):
    out, path = copy_run(runs, "unsharded", tmp_path)
    (path / "optimizer.pt").unlink()
    refused(out, str(path / "optimizer.pt"), "is missing")
    assert [r["step"] for r in read_jsonl(out / "run" / "metrics.jsonl")] == [1]  # nothing trained
    # run.save_only_model: the manifest records that no optimizer was saved, so the resume goes on
    out, path = copy_run(runs, "weights-only", tmp_path)
    assert json.loads((path / "manifest.json").read_text())["optimizer_state"] is False
    lines = resume(out)
    assert any("no optimizer state" in line and "restart from zero" in line for line in lines), lines
    assert [r["step"] for r in read_jsonl(out / "run" / "metrics.jsonl")] == [1, 2]


def test_a_checkpoint_without_manifest_is_refused_until_trusted(runs, tmp_path):
    out, path = copy_run(runs, "unsharded", tmp_path)
    (path / "manifest.json").unlink()  # as a checkpoint saved before verification
    refused(out, str(path), "has no manifest.json", f"python -m cohort.checkpointing.trust {path}")
    assert trust.main([str(path)]) == 0
    lines = resume(out)
    assert any("resumed from" in line for line in lines), lines


def test_a_malformed_trainer_state_field_is_a_one_line_error(runs, tmp_path):
    for state, fragments in (({"step": "three", "sampler": {}}, ("'step'", "'three'")),
                             ({"step": 2}, ("'sampler'",)),
                             ({"step": 2, "sampler": {}, "train_time_s": [1]}, ("'train_time_s'", "[1]")),
                             ({"step": True, "sampler": {}}, ("'step'", "True")),
                             ({"step": 1, "sampler": {}, "eval_before": {"acc": "high"}}, ("'eval_before'",))):
        with pytest.raises(CheckpointError) as err:
            RunState.from_trainer_state(state)
        assert "\n" not in str(err.value) and all(f in str(err.value) for f in fragments), str(err.value)
    with pytest.raises(CheckpointError, match="not an object"):
        RunState.from_trainer_state([1, 2])  # type: ignore[arg-type]
    # through a resume: a checkpoint (whose manifest matches it) with a malformed field
    out, path = copy_run(runs, "unsharded", tmp_path)
    state = json.loads((path / "trainer_state.json").read_text())
    (path / "trainer_state.json").write_text(json.dumps({**state, "num_tokens": "many"}))
    (path / "manifest.json").unlink()
    trust.main([str(path)])
    refused(out, "'num_tokens'", "'many'", "trainer_state.json")


# ------------------------------------------------------------------------------------------ sharded manifest
def test_a_two_rank_sharded_save_has_one_manifest_of_both_ranks_files(tmp_path):
    from tests.integration.test_dcp_checkpoint import _train_worker, spawn

    spawn(_train_worker, 2, tmp_path, 1, False)
    path = ckpt.latest_checkpoint(tmp_path / "run")
    listed = json.loads((path / "manifest.json").read_text())["files"]
    on_disk = sorted(p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file())
    assert sorted(listed) == [p for p in on_disk if p != "manifest.json"]
    assert {"dcp/.metadata", "rng-1.pt", "trainer_state.json"} <= set(listed)
    assert len([p for p in listed if p.endswith(".distcp")]) == 2  # one shard file per rank
    assert ckpt.verify_checkpoint(path).optimizer_state
    rank1 = next(p for p in sorted((path / "dcp").glob("__1_*.distcp")))
    data = bytearray(rank1.read_bytes())
    data[-1] ^= 0x01
    rank1.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rank1.name):
        ckpt.verify_checkpoint(path)


# ------------------------------------------------------------------------------------------------- lock
def test_a_second_run_on_a_held_directory_stops_naming_the_holder(tmp_path):
    run = tmp_path / "run"
    with open_run_dir(run, resume=False, overwrite=False) as held:
        (held / "metrics.jsonl").write_text('{"step": 1}\n')
        for flags in ({"resume": True, "overwrite": False}, {"resume": False, "overwrite": True},
                      {"resume": False, "overwrite": False}):
            with pytest.raises(RunDirInUseError) as err, open_run_dir(run, **flags):
                pass
            message = str(err.value)
            assert "\n" not in message and f"pid {os.getpid()}" in message, message
            assert f"host {socket.gethostname()}" in message and "choose another output_dir" in message
        cfg = toy_config(tmp_path, steps=1)  # the Python API (and so `cohort train` and the TRL facade)
        with pytest.raises(RunDirInUseError):
            train(cfg, toy_components(cfg))
        assert (held / "metrics.jsonl").read_text() == '{"step": 1}\n'  # the holder's files untouched
        assert (held / ".cohort.lock").is_file()
    assert not (run / ".cohort.lock").exists()  # released and removed on exit


def test_the_lock_of_a_process_that_died_is_taken_over(tmp_path):
    run = tmp_path / "run"
    read, write = os.pipe()
    child = os.fork()  # a process of its own (an flock excludes other open files, in any process)
    if child == 0:
        try:
            held = open_run_dir(run, resume=False, overwrite=False)
            held.__enter__()
            os.write(write, b"held")
            time.sleep(60)
        finally:
            os._exit(0)
    try:
        assert os.read(read, 4) == b"held"
        with pytest.raises(RunDirInUseError, match=f"pid {child} on host {socket.gethostname()}"), open_run_dir(
                run, resume=True, overwrite=False):
            pass
    finally:
        os.kill(child, signal.SIGKILL)  # no clean-up runs, the lock file stays; the kernel releases the flock
        os.waitpid(child, 0)
        os.close(read), os.close(write)
    assert (run / ".cohort.lock").is_file()
    lines: list[str] = []
    with open_run_dir(run, resume=True, overwrite=False, echo=lines.append):
        assert json.loads((run / ".cohort.lock").read_text())["pid"] == os.getpid()
    assert len(lines) == 1 and f"pid {child}" in lines[0] and "takes the lock over" in lines[0], lines


def test_a_stale_lock_file_with_a_dead_pid_is_taken_over(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / ".cohort.lock").write_text(json.dumps({"pid": 2**22 + 12345, "host": "gone", "started": "then"}))
    lines: list[str] = []
    with open_run_dir(run, resume=False, overwrite=False, echo=lines.append) as held:
        assert held == run  # a folder holding only a stale lock counts as empty
    assert lines and "pid 4206649 on host gone" in lines[0], lines
