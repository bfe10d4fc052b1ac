"""Sharded (FSDP2 + torch.distributed.checkpoint) checkpoints on CPU ranks (gloo).

One module fixture trains a 2-layer tiny Llama and a LoRA model of it, each `fully_shard`-ed per decoder
layer plus the root, on 2 ranks, saves them, and injects a failure into a third save. The tests then load
the checkpoints on 1 rank and on 2 fresh ranks (and, marked slow, on 4) and check that weights, Adam states,
scheduler, per-rank RNG and the next training step are exactly those of the uninterrupted run; that the
folder is a Hugging Face model (or PEFT adapter) folder; and that the failed save changed nothing.

Workers write what they observe to files and the test process compares, so a failure reads as an assertion.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import random
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file
from tests.helpers.gloo_ranks import enter_rank, leave_rank

from cohort.checkpointing import CheckpointError, latest_checkpoint, load_checkpoint, save_checkpoint
from cohort.checkpointing.dcp import canonical_name, is_sharded

KINDS = ("llama", "lora")
SAVE_WORLD = 2


# --------------------------------------------------------------------------------------- models and steps
def tiny_llama2(seed: int):
    """tests/helpers/tiny_models.py's tiny Llama with 2 layers (several FSDP units) and the LM head tied to
    the embedding, as in SmolLM2."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=64, tie_word_embeddings=True)
    return LlamaForCausalLM(config)


def build(kind: str, seed: int, *, shard: bool = True, wrap_layers: bool = False):
    """The policy (sharded per decoder layer + root, as train.sharding=fsdp does), AdamW and LambdaLR.

    `wrap_layers` puts each decoder layer in torch's activation-checkpoint wrapper, which adds
    `_checkpoint_wrapped_module.` to parameter names: checkpoints must not depend on it.
    """
    model = tiny_llama2(0 if kind == "lora" else seed)  # LoRA: the same frozen base every time
    if kind == "lora":
        import peft

        torch.manual_seed(seed)
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                           init_lora_weights=False))
    layers = model.base_model.model.model.layers if kind == "lora" else model.model.layers
    if wrap_layers:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        for i, layer in enumerate(layers):
            layers[i] = checkpoint_wrapper(layer)
    if shard:
        from torch.distributed.fsdp import fully_shard

        for layer in layers:
            fully_shard(layer)
        fully_shard(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
    return model, opt, sched


def train_step(model, opt, sched, step: int, shares: list[int]) -> None:
    """One optimiser step on the batches of the saving run's ranks in `shares`.

    2 ranks each take their own batch and FSDP averages the gradients; 1 rank takes both batches with the
    loss halved. Halving is exact in floating point, so both compute bit-identical gradients.
    """
    for share in shares:
        g = torch.Generator().manual_seed(1000 * step + share)
        ids = torch.randint(0, 64, (2, 8), generator=g)
        (model(input_ids=ids, labels=ids).loss / len(shares)).backward()
    opt.step()
    sched.step()
    opt.zero_grad()


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor shard (a collective: every rank calls it in the same order)."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def unwrapped(name: str) -> str:
    return name.replace("_checkpoint_wrapped_module.", "")


def snapshot(model, opt, sched) -> dict:
    names = {p: unwrapped(n) for n, p in model.named_parameters()}
    return {
        "params": {unwrapped(n): full(p) for n, p in model.named_parameters()},
        "moments": {names[p]: {k: full(v) for k, v in s.items()} for p, s in opt.state.items()},
        "lr": [g["lr"] for g in opt.param_groups],
        "last_epoch": sched.last_epoch,
    }


def draw() -> list[float]:
    return [random.random(), float(np.random.rand()), *torch.rand(2).tolist()]


def tokenizer():
    from tests.unit.test_checkpoint import tiny_tokenizer

    return tiny_tokenizer()


# ------------------------------------------------------------------------------------------------ workers
def _init(rank: int, world: int, init_file: str) -> None:
    enter_rank()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)


def _save_worker(rank: int, world: int, out: str, init_file: str) -> None:
    _init(rank, world, init_file)
    try:
        for kind in KINDS:
            run = Path(out) / kind
            model, opt, sched = build(kind, seed=1)
            for step in (1, 2):
                train_step(model, opt, sched, step, [rank])
                random.seed(10 + rank), np.random.seed(20 + rank), torch.manual_seed(30 + rank)
                save_checkpoint(run, step, model=model, tokenizer=tokenizer(), optimizer=opt, scheduler=sched,
                                trainer_state={"data_position": 4 * step}, keep_last=1)
            torch.save(draw(), run / f"draws-{rank}.pt")  # what the RNG gives right after the save
            saved = snapshot(model, opt, sched)
            train_step(model, opt, sched, 3, [rank])
            saved["next"] = snapshot(model, opt, sched)["params"]
            if rank == 0:
                torch.save(saved, run / "saved.pt")
            if kind == "llama":
                _failing_saves(run, rank, model, opt, sched)
    finally:
        dist.destroy_process_group()
    leave_rank()


def _failing_saves(run: Path, rank: int, model, opt, sched) -> None:
    """Saves of step 3 that fail on one rank at three points; each rank records what it raised."""
    from torch.distributed.checkpoint import FileSystemWriter
    from transformers import LlamaForCausalLM

    def injected(*args, **kwargs):
        raise OSError(f"injected: disk full on rank {rank}")

    cases = {  # name: (what breaks, on which rank, trainer_state)
        "dcp-write": (mock.patch.object(FileSystemWriter, "write_data", injected), 1, {}),
        "hf-export": (mock.patch.object(LlamaForCausalLM, "save_pretrained", injected), 0, {}),
        "trainer-state": (contextlib.nullcontext(), 0, {"not_json": object()}),
    }
    outcomes = {}
    for name, (patch, on_rank, trainer_state) in cases.items():
        with patch if rank == on_rank else contextlib.nullcontext():
            try:
                save_checkpoint(run, 3, model=model, optimizer=opt, scheduler=sched, trainer_state=trainer_state,
                                keep_last=1)
                outcomes[name] = "saved"
            except Exception as e:
                outcomes[name] = f"{type(e).__name__}: {e}"
    torch.save(outcomes, run / f"failed-saves-{rank}.pt")


def _load_worker(rank: int, world: int, out: str, init_file: str) -> None:
    _init(rank, world, init_file)
    try:
        for kind in KINDS:
            run = Path(out) / kind
            # other weights, an optimizer without state yet; 2 fresh ranks also wrap their layers
            model, opt, sched = build(kind, seed=2, wrap_layers=world == 2)
            state = load_checkpoint(latest_checkpoint(run), model=model, optimizer=opt, scheduler=sched)
            loaded = snapshot(model, opt, sched)
            loaded["state"], loaded["draws"] = state, draw()
            # The next step: each rank its own batch when there are as many ranks as saved them; one rank
            # takes both batches. More ranks than saved have no batches of the saving run to compare with.
            if world <= SAVE_WORLD:
                train_step(model, opt, sched, 3, [rank] if world == SAVE_WORLD else list(range(SAVE_WORLD)))
                loaded["next"] = snapshot(model, opt, sched)["params"]
            torch.save(loaded, run / f"loaded-{world}-{rank}.pt")
        if world == 1:
            _load_unsharded_into_sharded(Path(out))
            _load_into_the_wrong_model(Path(out))
            _bf16_model_with_fp32_master_weights(Path(out))
    finally:
        dist.destroy_process_group()
    leave_rank()


def _load_unsharded_into_sharded(out: Path) -> None:
    """An old unsharded checkpoint (saved by the test process) into a sharded model: weights yes, optimizer no."""
    for kind in KINDS:
        path = latest_checkpoint(out / f"unsharded-{kind}")
        model, opt, _ = build(kind, seed=5)
        try:
            load_checkpoint(path, model=model, optimizer=opt, restore_rng=False)
            refused = "loaded"
        except CheckpointError as e:
            refused = str(e)
        load_checkpoint(path, model=model, restore_rng=False)
        torch.save({"refused": refused, "params": {n: full(p) for n, p in model.named_parameters()}},
                   out / f"unsharded-{kind}" / "into-sharded.pt")


def _load_into_the_wrong_model(out: Path) -> None:
    """The LoRA checkpoint into the plain model: refused with the keys that differ, on every rank."""
    model, opt, _ = build("llama", seed=6)
    try:
        load_checkpoint(latest_checkpoint(out / "lora"), model=model, optimizer=opt)
        outcome = "loaded"
    except CheckpointError as e:
        outcome = str(e)
    (out / "wrong-model.txt").write_text(outcome)


def _bf16_model_with_fp32_master_weights(out: Path) -> None:
    """A bf16 model whose parameters sharding upcast to fp32 (train.master_weights): the export is bf16, as
    an unsharded save writes it, and dcp/ keeps the fp32 master weights exactly."""
    from torch.distributed.fsdp import fully_shard

    model = tiny_llama2(7).to(torch.bfloat16)
    model.config.dtype = torch.bfloat16  # what from_pretrained(dtype=torch.bfloat16) records
    for param in model.parameters():
        param.data = param.data.float()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    master = {n: full(p) for n, p in model.named_parameters()}
    path = save_checkpoint(out / "bf16", 1, model=model, trainer_state={})
    fresh = tiny_llama2(8)
    for layer in fresh.model.layers:
        fully_shard(layer)
    fully_shard(fresh)
    load_checkpoint(path, model=fresh)
    torch.save({"master": master, "export": load_file(path / "model.safetensors"),
                "reloaded": {n: full(p) for n, p in fresh.named_parameters()}}, out / "bf16" / "result.pt")


def _train_worker(rank: int, world: int, out: str, init_file: str, steps: int, resume: bool) -> None:
    """The trainer with train.sharding=fsdp on the toy task, saving every step, resuming when asked."""
    from tests.integration.test_trainer_learns import toy_components, toy_config

    from cohort.trainer import train

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    _init(rank, world, init_file)
    try:
        cfg = toy_config(Path(out), steps=steps)
        cfg.train.device, cfg.train.sharding, cfg.run.resume = "cpu", "fsdp", resume
        train(cfg, toy_components(cfg))
    finally:
        dist.destroy_process_group()
    leave_rank()


def spawn(worker, world: int, out: Path, *args) -> None:
    """Run `worker` on `world` fresh processes joined by a gloo group.

    The processes are forked from a forkserver that imported torch, transformers' Llama and peft once: each
    spawned process would spend ~4 s importing them and ~3 s tearing them down again on 2 cores, which is
    most of this file's runtime. The forkserver itself never ran torch ops, so forking it is safe.
    """
    multiprocessing.set_forkserver_preload(["torch", "transformers.models.llama.modeling_llama", "peft",
                                            "cohort.trainer", "tests.integration.test_trainer_learns",
                                            __name__])  # ignored when the forkserver already runs
    out.mkdir(parents=True, exist_ok=True)
    init = out / f"init-{worker.__name__}-{world}-{'-'.join(map(str, args))}"
    init.unlink(missing_ok=True)
    mp.start_processes(worker, args=(world, str(out), str(init), *args), nprocs=world, join=True,
                       start_method="forkserver")


# ----------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def out(tmp_path_factory) -> Path:
    pytest.importorskip("peft", reason="needs peft (LoRA): pip install peft")
    out = tmp_path_factory.mktemp("dcp")
    for kind in KINDS:  # unsharded checkpoints, as a run without sharding writes them
        model, opt, sched = build(kind, seed=3, shard=False)
        train_step(model, opt, sched, 1, [0])
        save_checkpoint(out / f"unsharded-{kind}", 1, model=model, optimizer=opt, trainer_state={})
        torch.save({n: p.detach().clone() for n, p in model.named_parameters()}, out / f"unsharded-{kind}.pt")
    spawn(_save_worker, SAVE_WORLD, out)
    return out


def saved(out: Path, kind: str) -> dict:
    return torch.load(out / kind / "saved.pt")


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        if isinstance(a[name], dict):
            assert_same(a[name], b[name])
        else:
            assert torch.equal(a[name], b[name]), name


def assert_resumed(loaded: dict, expected: dict, *, next_step: bool = True) -> None:
    assert_same(loaded["params"], expected["params"])
    assert_same(loaded["moments"], expected["moments"])  # Adam's step, exp_avg, exp_avg_sq, exactly
    assert loaded["lr"] == expected["lr"] and loaded["last_epoch"] == expected["last_epoch"] == 2
    assert loaded["state"]["step"] == 2 and loaded["state"]["data_position"] == 8
    if next_step:
        assert_same(loaded["next"], expected["next"])


# -------------------------------------------------------------------------------------------------- tests
def test_sharded_save_layout(out):
    for kind in KINDS:
        root = out / kind / "checkpoints"
        path = latest_checkpoint(out / kind)
        assert path == root / "step-000002" and (root / "latest").read_text().strip() == "step-000002"
        assert not (root / "step-000001").exists()  # pruned to keep_last=1
        assert (path / "dcp" / ".metadata").is_file() and len(list((path / "dcp").glob("*.distcp"))) == 2
        for name in ("rng.pt", "rng-0.pt", "rng-1.pt", "scheduler.pt", "trainer_state.json", "tokenizer.json"):
            assert (path / name).is_file(), name
        assert not (path / "optimizer.pt").exists()  # the optimizer state is in dcp/
        hf = ("adapter_model.safetensors", "adapter_config.json") if kind == "lora" else ("model.safetensors",
                                                                                          "config.json")
        assert all((path / name).is_file() for name in hf)
        if kind == "lora":
            assert not (path / "model.safetensors").exists()  # only the adapter, as an unsharded save
            # dcp/ too holds only what trains: not the frozen base, nor the tied LM head's second name
            from torch.distributed.checkpoint import FileSystemReader

            keys = FileSystemReader(path / "dcp").read_metadata().state_dict_metadata
            model_keys = [k for k in keys if k.startswith("model.")]
            assert model_keys and all("lora_" in k for k in model_keys), model_keys
        else:  # the tied LM head is not written twice (from_pretrained ties it again)
            assert "lm_head.weight" not in load_file(path / "model.safetensors")


def test_a_save_failing_on_one_rank_raises_on_every_rank_and_changes_nothing(out):
    run = out / "llama"
    outcomes = [torch.load(run / f"failed-saves-{r}.pt") for r in range(SAVE_WORLD)]
    # inside DCP's write on rank 1: DCP tells rank 0, both raise
    assert all(o["dcp-write"].startswith("CheckpointError") for o in outcomes), outcomes
    assert "rank 1: OSError: injected: disk full on rank 1" in outcomes[0]["dcp-write"]
    # rank 0's Hugging Face export: rank 0 raises its error as a CheckpointError naming the folder and the cause,
    # rank 1 hears of it
    assert outcomes[0]["hf-export"].startswith("CheckpointError"), outcomes[0]["hf-export"]
    assert "OSError: injected: disk full on rank 0" in outcomes[0]["hf-export"]
    assert "step-000003" in outcomes[0]["hf-export"] and "`latest` are unchanged" in outcomes[0]["hf-export"]
    assert outcomes[1]["hf-export"].startswith("CheckpointError") and "injected" in outcomes[1]["hf-export"]
    # a trainer_state that is not JSON: refused before anything is written, on every rank
    assert outcomes[0]["trainer-state"].startswith("ConfigError")
    assert outcomes[1]["trainer-state"].startswith("CheckpointError") and "not_json" in outcomes[1]["trainer-state"]
    root = run / "checkpoints"
    assert (root / "latest").read_text().strip() == "step-000002"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-000002"]  # nothing half-written left
    # ...and the previous checkpoint still loads: the load tests below read it after these failures.


def test_hf_export_equals_the_gathered_weights(out):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(latest_checkpoint(out / "llama"))
    assert_same({n: p.detach() for n, p in model.named_parameters()}, saved(out, "llama")["params"])


def test_peft_adapter_export_loads_with_peft(out):
    from peft import PeftModel

    model = PeftModel.from_pretrained(tiny_llama2(0), latest_checkpoint(out / "lora"))
    assert_same({n: p.detach() for n, p in model.named_parameters()}, saved(out, "lora")["params"])


def test_load_on_one_rank_reshards_exactly(out):
    spawn(_load_worker, 1, out)
    for kind in KINDS:
        loaded = torch.load(out / kind / "loaded-1-0.pt")
        assert_resumed(loaded, saved(out, kind))
        assert loaded["draws"] == torch.load(out / kind / "draws-0.pt")
    for kind in KINDS:  # an unsharded checkpoint: the weights load into the sharded model, the optimizer not
        result = torch.load(out / f"unsharded-{kind}" / "into-sharded.pt")
        assert "saved unsharded" in result["refused"] and "optimizer=None" in result["refused"]
        assert_same(result["params"], torch.load(out / f"unsharded-{kind}.pt"))
    bf16 = torch.load(out / "bf16" / "result.pt")
    assert all(t.dtype == torch.bfloat16 for t in bf16["export"].values())
    assert_same(bf16["export"], {n: t.to(torch.bfloat16) for n, t in bf16["master"].items()})
    assert_same(bf16["reloaded"], bf16["master"])  # fp32, exactly
    wrong = (out / "wrong-model.txt").read_text()
    assert "does not fit the model" in wrong and "lora_A" in wrong


def test_load_on_two_fresh_ranks_continues_exactly(out):
    spawn(_load_worker, 2, out)
    for kind in KINDS:
        for rank in range(2):
            loaded = torch.load(out / kind / f"loaded-2-{rank}.pt")
            assert_resumed(loaded, saved(out, kind))
            assert loaded["draws"] == torch.load(out / kind / f"draws-{rank}.pt")  # each rank its own RNG


def test_load_on_four_ranks(out):
    spawn(_load_worker, 4, out)
    for kind in KINDS:
        for rank in range(4):
            loaded = torch.load(out / kind / f"loaded-4-{rank}.pt")
            assert_resumed(loaded, saved(out, kind), next_step=False)
            # ranks the saving run did not have start from rank 0's RNG
            assert loaded["draws"] == torch.load(out / kind / f"draws-{rank if rank < 2 else 0}.pt")


def test_sharded_checkpoint_loads_into_an_unsharded_model_in_one_process(out):
    assert not (dist.is_available() and dist.is_initialized())
    for kind in KINDS:
        model, opt, sched = build(kind, seed=4, shard=False)
        state = load_checkpoint(latest_checkpoint(out / kind), model=model, optimizer=opt, scheduler=sched,
                                restore_rng=False)
        loaded = {**snapshot(model, opt, sched), "state": state}
        train_step(model, opt, sched, 3, [0, 1])
        loaded["next"] = {n: p.detach() for n, p in model.named_parameters()}
        assert_resumed(loaded, saved(out, kind))


def test_is_sharded_and_canonical_names():
    assert not is_sharded(tiny_llama2(0))
    assert canonical_name("model.layers.0._orig_mod.self_attn._checkpoint_wrapped_module.q_proj.weight") == \
        "model.layers.0.self_attn.q_proj.weight"


def test_trainer_resumes_a_sharded_run_exactly(tmp_path):
    """Through the trainer: 2 FSDP ranks, 2 steps, stop, resume to 4 == 4 steps straight, metric for metric
    (losses, rewards, gradient norms, entropy: the same floats)."""
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    spawn(_train_worker, 2, straight, 4, False)
    spawn(_train_worker, 2, stopped, 2, False)
    assert (stopped / "run" / "checkpoints" / "step-000002" / "dcp" / ".metadata").is_file()
    spawn(_train_worker, 2, stopped, 4, True)
    from cohort.run.logging import read_jsonl

    a, b = ({r["step"]: r for r in read_jsonl(d / "run" / "metrics.jsonl")} for d in (straight, stopped))
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    for step in (3, 4):
        for key, value in a[step].items():
            if isinstance(value, float) and not key.startswith(("time", "step_time", "train_time")):
                assert value == b[step][key], (step, key, value, b[step][key])  # same ranks: bit for bit
