r"""One GRPO step end to end: cohort's trainer against TRL's GRPOTrainer on the same GPU, one table, one run.

    python bench/grpo_step.py                           # 0.5B and 1.5B: TRL defaults, TRL tuned, cohort fast,
                                                        # cohort low-memory
    python bench/grpo_step.py --sizes 0.5b --warmup 1 --steps 2
    python bench/grpo_step.py --sizes 0.5b --runners trl,trl-tuned   # the two TRL rows only
    python bench/grpo_step.py --sizes tiny --prompts 4 --generations 4 --prompt-len 16 --completion-len 16
                                                        # CPU smoke test of every code path (all four rows)

On one H100 (one device call; the TRL/datasets wheels are carried from the ignored .whl/ folder, see
docs/benchmarks.md), all four rows of both sizes, 2 warm-up steps and 2 measured ones so that it fits
10 minutes (estimated from the earlier 394 s for three rows with 3 measured steps, plus TRL tuned):

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/datasets-5.2.0-py3-none-any.whl .whl/dill-0.4.1-py3-none-any.whl \
        .whl/multiprocess-0.70.19-py312-none-any.whl .whl/trl-1.16.0-py3-none-any.whl && \
    PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false \
        python3 bench/grpo_step.py --steps 2 --budget-s 540 --child-timeout-s 200 --out $OUT/grpo_step.json \
        --log $OUT/grpo_step.log

If the --budget-s skips a row, two calls instead (3 measured steps each), the same command with
`--sizes 0.5b --steps 3` and then `--sizes 1.5b --steps 3`.

Workload (identical on both sides): the Qwen2.5 architecture (0.5B or 1.5B) with random bf16 weights; each
step 32 prompts x 8 completions, prompts of exactly 128 tokens (random token ids), completions of exactly
256 tokens (EOS never ends them: cohort `generation.ignore_eos`, TRL `min_new_tokens`), temperature 1, a
cheap length reward, one optimizer update per step, beta = 0 (no reference model), on-policy.
The tokenizer is a word-level one built here (`w0 w1 ...`, one word per model id, EOS = Qwen's 151643), so a
prompt is exactly its 128 words and every id the model can sample decodes; nothing is downloaded.

The TRL side (and how its phases are timed) is in bench/grpo_step_trl.py.
Every (size, runner) pair runs in its own subprocess, one after another, so GPU memory peaks never mix;
the parent prints the table. Peak memory is torch.cuda.max_memory_allocated / max_memory_reserved over the
training steps (reset after setup). Seconds per step are the mean over the steps after `--warmup`.
Phases: generate (cohort: sampling, decode to text, advantages; TRL: tokenise and HF generate, its decode
and advantages fall in "other"), score (reward functions), logprobs (no-grad
forwards before the update: old/reference logprobs; zero on-policy with beta = 0 on both sides), update
(forward, backward and optimizer step), other (the rest of the step). Update MFU = the update's FLOPs as
bench/flops.py counts them (6 per decoder weight per token, the LM head on completion tokens only, causal
attention) / update seconds / peak 989e12 (H100 SXM dense bf16); recomputation under gradient checkpointing
is not counted. Until 2026-11-27 the tables used 6 * all parameters * all tokens, which also counted the LM
head on prompt tokens, whose logits neither trainer computes (the JSON keeps that figure as `mfu_6n`).

Runners (always run in this order, whatever the order given to --runners: the low-memory row's memory
bar is the TRL defaults row's measured peak): `trl` (GRPOTrainer, its defaults: HF generate, gradient
checkpointing, bf16 AdamW states, 8 completions per micro-batch, so 32 accumulation steps); `trl-tuned`
(GRPOTrainer as a TRL user with a big GPU would set it: 32 completions per micro-batch (`--trl-tuned-micro`),
so 8 accumulation steps, gradient checkpointing off, dynamic cache, no continuous batching; see
bench/grpo_step_trl.py); `cohort` (fast: no checkpointing, fp32 master
weights and AdamW, packed micro-batches of `--token-budget` tokens (34,816 on 0.5B: the step's 32 groups of a
128-token prompt and 8 x 256 completion tokens as 2 shared-prompt rows of 16 groups, 51 GiB peak; 12,288 on 1.5B;
rounded up to whole completions per plain micro-batch, see even_budget), logprob
chunks of 8192 tokens, train.keep_logits=true (the LM-head logits kept for the backward, not recomputed; this
row only, not bench/scale.py's or bench/serve.py's), KV pool sized to the workload, decoder layers compiled with
cohort.forward.packing.compile_decoder_layers on CUDA, retried eager if that fails; train.share_prompts at its default,
true: each micro-batch row holds a prompt once with its completions after it, cohort.forward.shared_prompts);
`cohort-plain` (the fast row with train.share_prompts=false: every completion with its own copy of the prompt,
the layout of earlier rounds; opt-in); `cohort-fa4` (the fast row with
model.packed_attention=fa4: the update's packed attention through FlashAttention-4, `pip install flash-attn-4`;
opt-in);
`cohort-lowmem` (plain config fields: model.gradient_checkpointing, train.master_weights=false (bf16 AdamW
moments as TRL, LM-head gradient summed in bf16), train.logprob_chunk_tokens=256, generation.fuse_projections=
false, generation.release_kv_during_update=true, train.optimizer_offload=true (Adam moments in host memory,
streamed per bucket in the step), decoder layers compiled as in the fast row (`--no-lowmem-compile`: eager);
under TRL's measured peak, the largest token budget whose update fits 95% of it by cohort's memory estimate,
and the KV pool the generation phase leaves, at most the workload's). Every cohort row also reports the peak allocated memory of its generate and update
phases.

The table gives every row's speed-up against the TRL defaults row and against the faster of the TRL rows
that ran ("vs faster TRL", naming it): the latter is the ratio that counts (cohort against TRL at its best).
The low-memory row's "within" mark compares its peak with the TRL defaults row's peak.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from unittest import mock

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/'s helpers, also when imported by path
from flops import update_flops
from manifest import record_run

SIZES = {
    "tiny": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "intermediate_size": 128, "vocab_size": 1024},
    "0.5b": {"hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
             "intermediate_size": 4864, "vocab_size": 151936},
    "1.5b": {"hidden_size": 1536, "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2,
             "intermediate_size": 8960, "vocab_size": 151936},
}
FAST_TOKEN_BUDGET = {"tiny": 256, "0.5b": 34816, "1.5b": 12288}
FAST_CHUNK_TOKENS = {"0.5b": 8192, "1.5b": 8192}  # logprob chunk of the fast row (else the trainer's default)
PEAK_FLOPS = 989e12  # H100 SXM, dense bf16
QWEN_EOS = 151643
RUNNERS = ("trl", "trl-tuned", "cohort", "cohort-plain", "cohort-fa4", "cohort-lowmem")
OPT_IN = ("cohort-plain", "cohort-fa4")  # rows run only when --runners names them
TRL_RUNNERS = ("trl", "trl-tuned")
TRL_TUNED_MICRO = 32  # issue 16's TRL tuned setting: 32 completions per micro-batch (8 per step at 32 x 8)
ENGINE_OVERHEAD_GIB = 0.35  # engine beside its KV pool: graph logits (256 rows), prefill transients
ENGINE_PERSISTENT_GIB = 0.1  # of which stays allocated while the pool is released
ENGINE_MAX_MODEL_LEN = 4096  # the engine's length floor of earlier rounds (now prompt + completion): kept as a floor


# ---------------------------------------------------------------------------------------------------------
# Workload pieces shared by both sides


def eos_id(vocab_size: int) -> int:
    return QWEN_EOS if vocab_size > QWEN_EOS else vocab_size - 1


def build_tokenizer(vocab_size: int):
    """Word-level tokenizer with one word per model id ("w17"), EOS at Qwen's id; decodes any sampled id."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    eos = eos_id(vocab_size)
    vocab = {("<|endoftext|>" if i == eos else f"w{i}"): i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                   model_max_length=1 << 20)


def make_prompts(count: int, length: int, vocab_size: int, seed: int = 0) -> list[str]:
    """`count` prompts of exactly `length` random words (never EOS)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size - 1, (count, length), generator=gen)
    ids[ids >= eos_id(vocab_size)] += 1  # skip the EOS id, stay below vocab_size
    return [" ".join(f"w{int(i)}" for i in row) for row in ids]


def prompt_rows(count: int, length: int, vocab_size: int, seed: int = 0) -> list[dict]:
    """The bench's dataset rows ({"prompt": ...}, from make_prompts); the cohort rows' data.source."""
    return [{"prompt": p} for p in make_prompts(count, length, vocab_size, seed)]


def length_reward(completions, **kwargs) -> list[float]:
    """Cheap reward: characters / 1000 (completions have equal token counts but differ in characters)."""
    return [len(c) / 1000.0 for c in completions]


def build_model(size: str, device: torch.device, *, spec: dict | None = None, tie: bool = True):
    """The Qwen2 architecture of `spec` (default SIZES[size]) with random weights, built where it trains: bf16 on
    a GPU, fp32 on the CPU. bench/scale.py builds its untied 7B row with the same function."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    spec = spec or SIZES[size]
    eos = eos_id(spec["vocab_size"])
    # a spec may set its own context (bench/long.py's 32k rows need more than 32,768 positions)
    config = Qwen2Config(**{"max_position_embeddings": 32768, **spec}, rope_theta=1e6, rms_norm_eps=1e-6,
                         tie_word_embeddings=tie, bos_token_id=None, eos_token_id=eos, pad_token_id=eos)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device, torch.no_grad():
            model = Qwen2ForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = eos
    return model


def kv_bytes_per_token(model) -> int:
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    itemsize = next(model.parameters()).element_size()
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * itemsize  # K and V


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def peak_memory(device: torch.device) -> dict[str, float]:
    if device.type != "cuda":
        return {"peak_alloc_gib": float("nan"), "peak_reserved_gib": float("nan")}
    return {"peak_alloc_gib": torch.cuda.max_memory_allocated() / 2**30,
            "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30}


# ---------------------------------------------------------------------------------------------------------
# cohort side


class TimedRewards:
    """Wraps a RewardRunner and records the seconds of each call (cohort's time/generate includes scoring)."""

    def __init__(self, runner):
        self.runner, self.seconds = runner, []

    def __call__(self, **kwargs):
        start = time.perf_counter()
        try:
            return self.runner(**kwargs)
        finally:
            self.seconds.append(time.perf_counter() - start)

    def __getattr__(self, name):
        return getattr(self.runner, name)


def _cohort_config(args, lowmem: bool, kv_fraction: float, token_budget: int):
    """The trainer's config for a row. Low memory (all plain config fields): gradient checkpointing, Adam
    moments in bf16 without fp32 masters (TRL's precision; the LM-head gradient summed in bf16 too), small
    logprob chunks, no fused QKV/gate-up copies in the engine, and the KV pool released during the update."""
    from cohort.config import CohortConfig

    cfg = CohortConfig()
    cfg.model.gradient_checkpointing = lowmem
    # setup compiles the decoder layers on CUDA (and the memory estimate it prints knows they are compiled)
    cfg.model.compile_layers = bool(getattr(args, "compile_layers", False))  # bench/scale.py sets its own
    cfg.model.packed_attention = getattr(args, "packed_attention", "torch")  # the cohort-fa4 row: "fa4"
    cfg.train.share_prompts = getattr(args, "share_prompts", True)  # the cohort-plain row: False
    cfg.generation.logprob_parity = getattr(args, "logprob_parity", "fast")  # exact: plain rows, no recompute
    g = cfg.generation
    g.num_generations, g.max_completion_length, g.temperature = args.generations, args.completion_len, 1.0
    g.ignore_eos, g.engine, g.kv_cache_fraction = True, "cohort", kv_fraction
    # The prompts are handed to build_components as train_data; data.source names where they come from
    # (prompt_rows). Left at its default ('reasoning_gym:chain_sum'), validate would need reasoning-gym.
    cfg.data.source = prompt_rows
    cfg.data.max_prompt_length = args.prompt_len
    t = cfg.train
    t.prompts_per_step, t.mini_batches, t.num_iterations = args.prompts, 1, 1
    # --profile-update: one extra step, profiled and left out of the means
    t.max_steps, t.seed = args.warmup + args.steps + int(_profiling(args)), 0
    t.token_budget = token_budget
    if lowmem:
        t.master_weights, t.logprob_chunk_tokens = False, args.lowmem_chunk_tokens
        t.optimizer_offload = args.lowmem_offload
        g.fuse_projections, g.release_kv_during_update = False, args.lowmem_release_kv
    else:
        g.release_kv_during_update = getattr(args, "release_kv", False)  # bench/long.py --release-kv
        if args.chunk_tokens or args.size in FAST_CHUNK_TOKENS:
            t.logprob_chunk_tokens = args.chunk_tokens or FAST_CHUNK_TOKENS[args.size]
    cfg.loss.beta = 0.0
    cfg.run.output_dir = tempfile.mkdtemp(prefix="grpo_step_")
    cfg.run.overwrite, cfg.run.report_to = True, ["jsonl"]
    return cfg


def _lowmem_estimate(args, model, token_budget: int):
    from cohort.policy.memory import estimate_memory

    return estimate_memory(model.config, dtype="bf16", master_weights_fp32=False, lm_head_grad_fp32=False,
                           token_budget=token_budget, gradient_checkpointing=True,
                           chunk_tokens=args.lowmem_chunk_tokens, fused_logprob_kernels=args.device == "cuda",
                           optimizer_offload=args.lowmem_offload)


def _kv_plan(args, model, device, lowmem: bool) -> tuple[float, int, dict]:
    """(kv_cache_fraction, token budget, notes). Fast row: the workload's KV x1.25. Low-memory row under a
    cap (TRL's measured peak): the largest token budget whose update fits 93% of the cap by cohort's memory
    estimate, and a KV pool of what the generation phase leaves (released during the update, so the two
    phases do not add up), at most the workload's."""
    per_token = kv_bytes_per_token(model)
    # kv_tokens: the step's tokens when completions differ in length (bench/long.py's drawn lengths)
    tokens = getattr(args, "kv_tokens", None) or args.prompts * args.generations * (args.prompt_len + args.completion_len)
    need = tokens * per_token
    free = torch.cuda.mem_get_info()[0] if device.type == "cuda" else 4 << 30
    info = {"kv_need_gib": need / 2**30}
    kv, budget = 1.25 * need, (args.token_budget or even_budget(args, FAST_TOKEN_BUDGET[args.size]))
    if lowmem:
        budget = args.lowmem_token_budget or 2048
    if lowmem and args.mem_cap:
        cap = args.mem_cap
        if not args.lowmem_token_budget:
            persistent = ENGINE_PERSISTENT_GIB * 2**30  # the engine's buffers stay through the update
            fits = [b for b in (16384, 8192, 4096, 2048, 1024)
                    if _update_bytes(_lowmem_estimate(args, model, b)) + persistent <= 0.95 * cap]
            budget = fits[0] if fits else 1024
        est = _lowmem_estimate(args, model, budget)
        update = _update_bytes(est)
        generation = est.weights + est.optimizer + ENGINE_OVERHEAD_GIB * 2**30
        left = 0.95 * cap - generation if args.lowmem_release_kv else 0.95 * cap - update
        kv = max(0.25 * need, min(1.05 * need, left))
        info.update(update_estimate_gib=update / 2**30, generation_estimate_wo_kv_gib=generation / 2**30,
                    cap_gib=cap / 2**30)
    # the engine insists on one max-length sequence (prompt + completion, cohort.setup.lengths.engine_model_len)
    kv = max(kv, 1.1 * max(ENGINE_MAX_MODEL_LEN, args.prompt_len + args.completion_len) * per_token)
    info["kv_planned_gib"] = kv / 2**30
    return min(1.0, kv / free), budget, info


def even_budget(args, budget: int) -> int:
    """The fast row's token budget rounded up so the step's completions fill whole micro-batches: 256
    completions of 384 tokens in 32,768-token micro-batches pack as 85 + 85 + 85 + 1 (a fourth pass for one
    completion, which costs a whole pass of host time); 33,024 packs them as 86 + 85 + 85."""
    length = args.prompt_len + args.completion_len
    total = args.prompts * args.generations
    passes = -(-total * length // budget)
    return max(budget, -(-total // passes) * length)


def _update_bytes(est) -> int:
    """The update phase of the estimate: everything but the KV pool."""
    return est.total - est.kv_cache


def run_cohort(args, lowmem: bool) -> dict:
    import cohort.trainer

    device = torch.device(args.device)
    model = build_model(args.size, device)
    tok = build_tokenizer(model.config.vocab_size)
    with ExitStack() as stack:
        stack.enter_context(mock.patch.object(cohort.trainer, "_save", lambda *a, **k: None))  # no checkpoint
        return _train_cohort(args, lowmem, model, tok, device)


def _train_cohort(args, lowmem: bool, model, tok, device) -> dict:
    import cohort.trainer
    from cohort.data.dataset import PromptDataset
    from cohort.rewards import RewardRunner

    kv_fraction, budget, info = _kv_plan(args, model, device, lowmem)
    cfg = _cohort_config(args, lowmem, kv_fraction, budget)
    cfg.train.keep_logits = not lowmem  # the fast row spends memory on a backward without the LM-head recompute
    rows = prompt_rows(args.prompts * cfg.train.max_steps, args.prompt_len, model.config.vocab_size)
    data = PromptDataset(rows, "bench").encode(tok, args.prompt_len)
    rewards = TimedRewards(RewardRunner([length_reward]))
    comp = cohort.trainer.build_components(cfg, policy=model, tokenizer=tok, reward_runner=rewards,
                                           train_data=data, echo=lambda *a: None)
    info["engine"] = comp.engine.engine_name() if hasattr(comp.engine, "engine_name") else type(comp.engine).__name__
    if comp.memory_estimate is not None:  # the plan printed before step 1, to set beside the measured peak
        info["plan_estimate_gib"] = comp.memory_estimate.total / 2**30
    info.update(optimizer=type(comp.optimizer).__name__, token_budget=cfg.train.token_budget,
                share_prompts=cfg.train.share_prompts,
                logprob_chunk_tokens=cfg.train.logprob_chunk_tokens, keep_logits=cfg.train.keep_logits,
                gradient_checkpointing=lowmem,
                release_kv_during_update=cfg.generation.release_kv_during_update, compiled_layers=0)
    if args.compile_layers:  # cohort.forward.packing.compile_decoder_layers (model.compile_layers): fused elementwise work
        from cohort.forward.packing import compile_decoder_layers

        compile_decoder_layers(model)  # idempotent: setup did it on CUDA; the CPU smoke test compiles here
        info["compiled_layers"] = sum(bool(getattr(layer, "_cohort_compiled", False)) for layer in model.model.layers)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    phase_peaks = _PhasePeaks(device)
    with ExitStack() as stack:
        stack.enter_context(phase_peaks.watching(comp))
        if args.profile_update:
            stack.enter_context(_profile_last_call(cohort.trainer.PolicyUpdater, "update", cfg.train.max_steps,
                                                   "update", args.size))
        if args.profile_generate:  # after the peak watcher, so the profile wraps its wrapper
            stack.enter_context(_profile_last_call(comp.engine, "generate", cfg.train.max_steps, "generate",
                                                   args.size))
        result = cohort.trainer.train(cfg, comp, echo=lambda *a: None)
    info["phase_peak_alloc_gib"] = phase_peaks.peaks
    info["profiled_last"] = _profiling(args)
    info["graph_recaptures"] = getattr(getattr(comp.engine, "runner", None), "graph_recaptures", None)
    steps = []
    for m, score in zip(result.history, rewards.seconds):
        gen = m["time/generate"] - score
        phases = {"generate": gen, "score": score, "logprobs": m.get("time/logprobs", 0.0),
                  "update": m["time/update"]}
        steps.append({**phases, "step": m["step_time"], "other": m["step_time"] - sum(phases.values()),
                      "completion_len": m["completions/mean_length"]})
    return {"steps": steps, "num_params": sum(p.numel() for p in model.parameters()), **info,
            **phase_peaks.overall()}


class _HostTimes:
    """Wall time of the update's host-side preparation while entered: micro-batch cutting, masks and engine
    logprobs, the shared-prompt layout (the GPU idles while the first micro-batch's are built)."""

    TARGETS = (("cohort.update", "PolicyUpdater", "_micro_batches"), ("cohort.update", "PolicyUpdater", "_host_tensors"),
               ("cohort.forward.packing", None, "pack_shared_layout"), ("cohort.forward.packing", None, "pack_layout"))

    def __enter__(self):
        import importlib

        self.calls: list[tuple[str, float, float]] = []  # (name, start, ms)
        self.start, self._undo = time.perf_counter(), []
        for module_name, cls, name in self.TARGETS:
            owner = importlib.import_module(module_name)
            owner = getattr(owner, cls) if cls else owner
            original = getattr(owner, name)

            def timed(*a, _f=original, _n=name, **k):
                t = time.perf_counter()
                try:
                    return _f(*a, **k)
                finally:
                    self.calls.append((_n, (t - self.start) * 1e3, (time.perf_counter() - t) * 1e3))
            setattr(owner, name, timed)
            self._undo.append((owner, name, original))
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, original in self._undo:
            setattr(owner, name, original)

    def __str__(self) -> str:
        return ", ".join(f"{n} at +{at:.1f} ms took {ms:.2f} ms" for n, at, ms in self.calls) or "none"


class _GcPauses:
    """Python's garbage-collector passes while it is entered: how many of each generation and the time they held
    the host (a pass over a large heap can leave the GPU idle for milliseconds), with the number of objects the
    collector tracks."""

    def __enter__(self):
        import gc

        self.passes: list[tuple[int, float, float]] = []  # (generation, ms, when it began: ms after entering)
        self._start = self.entered = time.perf_counter()
        self.tracked = len(gc.get_objects())
        gc.callbacks.append(self._callback)
        return self

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.passes.append((info["generation"], (time.perf_counter() - self._start) * 1e3,
                                (self._start - self.entered) * 1e3))

    def __exit__(self, *exc) -> None:
        import gc

        gc.callbacks.remove(self._callback)

    def __str__(self) -> str:
        import gc

        by_gen = {g: [ms for gen, ms, _ in self.passes if gen == g] for g in (0, 1, 2)}
        parts = [f"gen {g}: {len(v)} passes, {sum(v):.2f} ms (largest {max(v, default=0.0):.2f})"
                 for g, v in by_gen.items()]
        when = ", ".join(f"gen {g} {ms:.2f} ms at +{at:.1f}" for g, ms, at in self.passes if ms > 0.5)
        return (f"{'; '.join(parts)}; {self.tracked:,} objects tracked at its start, thresholds {gc.get_threshold()}"
                + (f"; passes over 0.5 ms: {when}" if when else ""))


def _profiling(args) -> bool:
    return bool(args.profile_update or getattr(args, "profile_generate", False))


def _profile_last_call(owner, method: str, last_step: int, label: str, size: str = ""):
    """torch.profiler over the last step's call of `owner.method` (the updater's update or the engine's
    generate); prints the top kernels, the device timeline's idle gaps and every host-device synchronisation
    (where the phase's time goes). `owner` is a class (patched for every instance) or one object. With
    COHORT_BENCH_TRACE_DIR set, the Chrome trace goes there as `{label}-{size}-trace.json.gz` (read the host's
    work in each idle gap with `python bench/trace_gaps.py FILE`)."""
    import contextlib

    original, calls = getattr(owner, method), {"n": 0}
    bound = not isinstance(owner, type)  # an instance's bound method: no self argument to pass on

    def wrapper(*a, **k):
        calls["n"] += 1
        if calls["n"] < last_step:
            return original(*a, **k)
        import warnings
        from collections import Counter

        import trace_gaps
        from torch.profiler import ProfilerActivity, profile

        cuda = torch.cuda.is_available()
        # entered after the profiler has started, so their times count from the phase's own start
        pauses = _GcPauses()
        host = _HostTimes() if label == "update" else contextlib.nullcontext()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof, pauses, host, \
                warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if cuda:  # every host-device synchronisation of the phase, by the line that caused it
                torch.cuda.set_sync_debug_mode("warn")
            try:
                out = original(*a, **k)
            finally:
                if cuda:
                    torch.cuda.set_sync_debug_mode("default")
                    torch.cuda.synchronize()
        # COHORT_BENCH_PROFILE_ROWS=N: the N kernels and operators of most self device time instead (default:
        # the 25 of most total device time, which lists the compiled regions and autograd nodes first)
        rows = int(os.environ.get("COHORT_BENCH_PROFILE_ROWS", "0"))
        table = prof.key_averages().table(sort_by="self_cuda_time_total" if rows else "cuda_time_total",
                                          row_limit=rows or 25, max_name_column_width=90)
        syncs = Counter(f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message))
        lines = [f"  {n} x {where}" for where, n in syncs.most_common(20)]
        gaps = ""
        if os.environ.get("COHORT_BENCH_TRACE_DIR"):
            trace = os.path.join(os.environ["COHORT_BENCH_TRACE_DIR"], f"{label}-{size}-trace.json.gz")
            trace_gaps.save(prof, trace)
            gaps = "\nthe host's work in the idle gaps of >= 0.5 ms:\n" + trace_gaps.host_ops_in_gaps(trace, 500.0)
        print(f"PROFILE-BEGIN {label}\n" + table + "\n" + trace_gaps.summary(prof, f"{label} timeline")
              + f"\n{label} device time by kernel kind:\n" + trace_gaps.categories(prof)
              + f"\nsynchronising calls in the {label}:\n" + ("\n".join(lines) or "  none") + gaps
              + f"\nPython's garbage collector in the {label}: {pauses}"
              + (f"\nthe update's host-side preparation: {host}" if isinstance(host, _HostTimes) else "")
              + "\nPROFILE-END", flush=True)
        return out

    if not last_step:
        return contextlib.nullcontext()
    if bound:
        return mock.patch.object(owner, method, wrapper)
    return mock.patch.object(owner, method, lambda self, *a, **k: wrapper(self, *a, **k))


class _PhasePeaks:
    """Peak allocated GiB of the generate and update phases (max over steps), from torch's peak counter
    reset at each phase's start: tells which phase sets the row's peak."""

    def __init__(self, device: torch.device):
        self.device, self.peaks = device, {"generate": 0.0, "update": 0.0}
        self.alloc = self.reserved = 0.0  # the run's overall peaks, folded in before each reset

    def _wrap(self, name: str, fn):
        def wrapped(*a, **k):
            if self.device.type != "cuda":
                return fn(*a, **k)
            self.note_overall()
            torch.cuda.reset_peak_memory_stats()
            try:
                return fn(*a, **k)
            finally:
                self.peaks[name] = max(self.peaks[name], torch.cuda.max_memory_allocated() / 2**30)
                self.note_overall()
        return wrapped

    def note_overall(self) -> None:
        """Fold the counters since the last reset into the run's overall peaks (resets would lose them)."""
        if self.device.type == "cuda":
            self.alloc = max(self.alloc, torch.cuda.max_memory_allocated() / 2**30)
            self.reserved = max(self.reserved, torch.cuda.max_memory_reserved() / 2**30)

    def overall(self) -> dict[str, float]:
        if self.device.type != "cuda":
            return peak_memory(self.device)
        self.note_overall()
        return {"peak_alloc_gib": self.alloc, "peak_reserved_gib": self.reserved}

    def watching(self, comp):
        import cohort.trainer

        stack = ExitStack()
        stack.enter_context(mock.patch.object(comp.engine, "generate", self._wrap("generate", comp.engine.generate)))
        original = cohort.trainer.PolicyUpdater.update
        stack.enter_context(mock.patch.object(cohort.trainer.PolicyUpdater, "update",
                                              lambda updater, *a, **k: self._wrap("update", original)(updater, *a, **k)))
        return stack


# ---------------------------------------------------------------------------------------------------------
# Parent: run the children, summarise, print


def summarise(args, result: dict, size: str) -> dict:
    """Steady-state means (steps after warmup) and the derived rates; MFU over bench/flops.py's count of
    the update's FLOPs (SIZES[size], tied embeddings as every row here builds them)."""
    steps = result["steps"][:-1] if result.get("profiled_last") else result["steps"]
    steady = steps[args.warmup:] or steps
    mean = {k: sum(s[k] for s in steady) / len(steady)
            for k in ("step", "generate", "score", "logprobs", "update", "other")}
    n = args.prompts * args.generations
    mean["gen_tok_s"] = n * args.completion_len / mean["step"]
    # a row with shared prompts runs each prompt once per group (the budget holds whole groups here: a group
    # of 8 x 256 + 128 tokens is far below every row's budget)
    shared = args.generations if result.get("share_prompts") else 1
    flops = update_flops(SIZES[size], num_params=result["num_params"], tied=True, sequences=n,
                         prompt_len=args.prompt_len, completion_len=args.completion_len, shared=shared)
    mean["mfu"] = flops / mean["update"] / PEAK_FLOPS
    # the count of earlier rounds (6 N per token run, the LM head on prompt tokens too), to compare with them
    tokens = n * (args.prompt_len / shared + args.completion_len)
    mean["mfu_6n"] = 6 * result["num_params"] * tokens / mean["update"] / PEAK_FLOPS
    mean["measured_steps"] = len(steady)
    return mean


def run_child(args, runner: str, size: str, mem_cap: int | None, timeout: float, compile_layers: bool) -> dict:
    out = tempfile.mktemp(suffix=".json")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", runner, "--size", size, "--json", out,
           "--device", args.device, "--warmup", str(args.warmup), "--steps", str(args.steps),
           "--prompts", str(args.prompts), "--generations", str(args.generations),
           "--prompt-len", str(args.prompt_len), "--completion-len", str(args.completion_len),
           "--trl-tuned-micro", str(args.trl_tuned_micro)]
    if mem_cap:
        cmd += ["--mem-cap", str(mem_cap)]
    cmd += ["--lowmem-chunk-tokens", str(args.lowmem_chunk_tokens),
            "--lowmem-release-kv" if args.lowmem_release_kv else "--no-lowmem-release-kv",
            "--lowmem-offload" if args.lowmem_offload else "--no-lowmem-offload"]
    for flag, value in (("--lowmem-token-budget", args.lowmem_token_budget), ("--token-budget", args.token_budget),
                        ("--chunk-tokens", args.chunk_tokens)):
        if value:
            cmd += [flag, str(value)]
    cmd += ["--compile-layers" if compile_layers else "--no-compile-layers", "--logprob-parity", args.logprob_parity]
    if args.profile_update:
        cmd += ["--profile-update"]
    if args.profile_generate:
        cmd += ["--profile-generate"]
    if args.flash_attention_impl:
        cmd += ["--flash-attention-impl", args.flash_attention_impl]
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        log, ok = proc.stdout + proc.stderr, proc.returncode == 0 and os.path.exists(out)
    except subprocess.TimeoutExpired as exc:
        log, ok = f"{exc.stdout or ''}{exc.stderr or ''}\nTIMEOUT after {timeout:.0f} s", False
    wall = time.perf_counter() - start
    if args.log:
        with open(args.log, "a") as fh:
            fh.write(f"\n===== {size} {runner} ({wall:.0f} s) =====\n{log}")
    for chunk in log.split("PROFILE-BEGIN ")[1:]:
        label, _, body = chunk.partition("\n")
        print(f"[{size} {runner}] {label} profile:\n" + body.split("PROFILE-END")[0], flush=True)
    if not ok:
        tail = "\n".join(log.strip().splitlines()[-15:])
        print(f"[{size} {runner}] FAILED after {wall:.0f} s:\n{tail}", flush=True)
        return {"error": tail.splitlines()[-1] if tail else "failed", "wall_s": wall}
    with open(out) as fh:
        result = json.load(fh)
    result["wall_s"] = wall
    result["summary"] = summarise(args, result, size)
    notes = {k: result[k] for k in ("token_budget", "logprob_chunk_tokens", "keep_logits", "kv_planned_gib",
                                    "plan_estimate_gib", "update_estimate_gib", "phase_peak_alloc_gib", "graph_recaptures",
                                    "compiled_layers", "micro_batch", "gradient_accumulation_steps",
                                    "gradient_checkpointing", "model_gradient_checkpointing", "cache_implementation",
                                    "continuous_batching") if k in result}
    print(f"[{size} {runner}] {wall:.0f} s wall: " + json.dumps(result["summary"]) + " " + json.dumps(notes),
          flush=True)
    return result


def fastest_trl(by_runner: dict) -> tuple[str, dict] | None:
    """(name, result) of the TRL row with the fewest seconds per step among those of one size that ran, or
    None: cohort's speed-up against it is the ratio that counts (TRL at its best, not at its defaults)."""
    ran = [(name, by_runner[name]) for name in TRL_RUNNERS if "summary" in by_runner.get(name, {})]
    return min(ran, key=lambda item: item[1]["summary"]["step"]) if ran else None


def _speedup(res: dict, ref: dict | None) -> str:
    """`ref`'s seconds per step over `res`'s, as a table cell; n/a when the reference row did not run."""
    return f"{ref['summary']['step'] / res['summary']['step']:.2f}x" if ref and "summary" in ref else "n/a"


def fmt_row(size: str, runner: str, res: dict, trl: dict | None, best: tuple[str, dict] | None = None) -> str:
    """One table row; `trl` is the TRL defaults row (speed-up and the low-memory row's memory bar), `best`
    the faster TRL row (fastest_trl)."""
    if "summary" not in res:
        why = res.get("error", "?")
        label = "not run" if why.startswith("skipped") else "failed"
        return f"| {size} | {runner} | {label}: {why[:80]} |" + " |" * 11
    s = res["summary"]
    ph = " | ".join(f"{s[k]:.2f}" for k in ("generate", "score", "logprobs", "update", "other"))
    vs_best = f"{_speedup(res, best[1])} ({best[0]})" if best else "n/a"
    within = ""
    if runner == "cohort-lowmem" and trl and trl.get("peak_alloc_gib") == trl.get("peak_alloc_gib"):  # not NaN
        within = (" (within TRL defaults' peak)" if res["peak_alloc_gib"] <= trl["peak_alloc_gib"]
                  else " (over TRL defaults' peak)")
    elif runner == "cohort-lowmem" and "cap_gib" not in res:
        within = " (no memory cap)"
    return (f"| {size} | {runner} | {s['step']:.2f} | {ph} | {s['gen_tok_s'] / 1e3:.1f}k | "
            f"{res['peak_alloc_gib']:.2f}{within} | {res['peak_reserved_gib']:.2f} | {100 * s['mfu']:.1f}% | "
            f"{_speedup(res, trl)} | {vs_best} |")


def table(results: dict) -> str:
    """The markdown table of every (size, runner), then one line per size naming the faster TRL row."""
    head = ("| model | trainer | s/step | generate | score | logprobs | update | other | generated tok/s | "
            "peak alloc GiB | peak reserved GiB | update MFU | vs TRL defaults | vs faster TRL |\n"
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    rows, notes = [], []
    for size, by_runner in results.items():
        best = fastest_trl(by_runner)
        rows += [fmt_row(size, runner, res, by_runner.get("trl"), best) for runner, res in by_runner.items()]
        notes.append(f"{size}: faster TRL row is {best[0]} ({best[1]['summary']['step']:.2f} s/step)" if best
                     else f"{size}: no TRL row ran")
    return "\n".join([head, *rows, "", "vs faster TRL (the ratio that counts): " + "; ".join(notes)])


def runner_order(spec: str) -> list[str]:
    """The runners named in --runners, in RUNNERS order (TRL defaults before the low-memory row, whose memory
    bar is its peak); an unknown name is an error."""
    names = [name.strip() for name in spec.split(",") if name.strip()]
    unknown = [name for name in names if name not in RUNNERS]
    if unknown or not names:
        raise ValueError(f"--runners {spec!r}: unknown or no runner {unknown}; choose from {','.join(RUNNERS)}")
    return [name for name in RUNNERS if name in names]


def parent(args) -> None:
    deadline = time.monotonic() + args.budget_s
    results: dict[str, dict[str, dict]] = {}
    for size in args.sizes.split(","):
        results[size] = {}
        for runner in runner_order(args.runners):
            left = deadline - time.monotonic()
            if left < 30:
                print(f"[{size} {runner}] skipped: {left:.0f} s of --budget-s left", flush=True)
                results[size][runner] = {"error": "skipped (time budget)"}
                continue
            trl = results[size].get("trl", {})
            peak = trl.get("peak_alloc_gib", float("nan"))
            peak = peak if peak == peak else args.mem_cap_gib  # NaN on the CPU or without a TRL row
            cap = int(peak * 2**30) if runner == "cohort-lowmem" and peak else None
            if runner == "cohort-lowmem" and cap is None:
                print(f"[{size} {runner}] no memory cap: no TRL defaults row ran in this call and no --mem-cap-gib, "
                      "so the row plans 2,048-token micro-batches (--lowmem-token-budget) instead of the largest "
                      "that fits under TRL's peak; add the `trl` runner or --mem-cap-gib for the capped row",
                      flush=True)
            # compiled layers under gradient checkpointing still cost ~2.7 ms of host time per layer backward,
            # but eager ones cost more (measured: low-memory 0.5B update 1.43 s compiled vs 2.15 s eager)
            compiled = args.compile_layers and (runner in ("cohort", "cohort-plain", "cohort-fa4")
                                                or (runner == "cohort-lowmem" and args.lowmem_compile))
            res = run_child(args, runner, size, cap, min(left, args.child_timeout_s), compiled)
            left = deadline - time.monotonic()
            if "summary" not in res and compiled and left > 60:  # one retry with eager layers
                res = run_child(args, runner, size, cap, min(left, args.child_timeout_s), False)
                res["retried_without_compile"] = True
            results[size][runner] = res
    print("\n" + table(results), flush=True)
    if args.out:
        faster = {size: (fastest_trl(by_runner) or (None,))[0] for size, by_runner in results.items()}
        with open(args.out, "w") as fh:
            json.dump({"args": vars(args), "results": results, "faster_trl": faster}, fh, indent=1, default=str)
        record_run(f"bench/grpo_step.py: the GRPO step, sizes {args.sizes}, runners {args.runners}", args.out, args.log)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="0.5b,1.5b")
    p.add_argument("--runners", default=",".join(r for r in RUNNERS if r not in OPT_IN))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=3, help="measured steps after warmup")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--completion-len", type=int, default=256)
    p.add_argument("--token-budget", type=int, default=None, help="cohort fast row (default per size)")
    p.add_argument("--trl-tuned-micro", type=int, default=TRL_TUNED_MICRO,
                   help="trl-tuned row: per_device_train_batch_size (completions per micro-batch)")
    p.add_argument("--budget-s", type=float, default=86400.0, help="stop starting children after this long")
    p.add_argument("--chunk-tokens", type=int, default=None, help="cohort fast row: logprob chunk (default 4096)")
    p.add_argument("--lowmem-token-budget", type=int, default=None,
                   help="low-memory row (default: the largest that fits the cap by cohort's estimate)")
    p.add_argument("--lowmem-chunk-tokens", type=int, default=256)
    p.add_argument("--lowmem-release-kv", action=argparse.BooleanOptionalAction, default=True,
                   help="low-memory row: generation.release_kv_during_update")
    p.add_argument("--lowmem-offload", action=argparse.BooleanOptionalAction, default=True,
                   help="low-memory row: train.optimizer_offload (Adam moments in host memory)")
    p.add_argument("--lowmem-compile", action=argparse.BooleanOptionalAction, default=True,
                   help="low-memory row: compile the decoder layers too (with --compile-layers; "
                        "--no-lowmem-compile: eager layers)")
    p.add_argument("--mem-cap-gib", type=float, default=None,
                   help="low-memory row's target peak when no TRL row ran in this run (else TRL's peak)")
    p.add_argument("--compile-layers", action=argparse.BooleanOptionalAction,
                   default=torch.cuda.is_available(), help="cohort rows: torch.compile each decoder layer")
    p.add_argument("--profile-update", action="store_true", help="cohort rows: print the last update's top kernels")
    p.add_argument("--logprob-parity", choices=("fast", "exact"), default="fast", help="cohort rows' parity mode")
    p.add_argument("--profile-generate", action="store_true",
                   help="cohort rows: print the last step's engine.generate top kernels and idle gaps")
    p.add_argument("--child-timeout-s", type=float, default=240.0, help="kill a run after this long")
    p.add_argument("--out", default=None, help="JSON with every step of every run")
    p.add_argument("--log", default=None, help="append every child's output here")
    p.add_argument("--flash-attention-impl", default=None, choices=("FA3", "FA4"),
                   help="every row: torch.nn.attention.activate_flash_attention_impl(this) in the child before the "
                        "model loads (torch's flash-attention ops, so cohort's packed attention and TRL's SDPA, then "
                        "run it); FA4 needs the flash-attn-4 package and the CUTLASS DSL")
    p.add_argument("--child", choices=RUNNERS, help=argparse.SUPPRESS)
    p.add_argument("--size", help=argparse.SUPPRESS)
    p.add_argument("--json", help=argparse.SUPPRESS)
    p.add_argument("--mem-cap", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child is None:
        try:
            runner_order(args.runners)
        except ValueError as exc:
            p.error(str(exc))
        return parent(args)
    if args.flash_attention_impl:  # before any model: torch's flash-attention ops then run this implementation
        import torch.nn.attention as tna

        tna.activate_flash_attention_impl(args.flash_attention_impl)
        print(f"flash attention implementation: {tna.current_flash_attention_impl()}", flush=True)
    if args.child in TRL_RUNNERS:
        from grpo_step_trl import run_trl  # bench/ is the script's folder, so on sys.path

        result = run_trl(args, tuned=args.child == "trl-tuned")
    else:
        args.packed_attention = "fa4" if args.child == "cohort-fa4" else "torch"
        args.share_prompts = args.child != "cohort-plain"
        result = run_cohort(args, lowmem=args.child == "cohort-lowmem")
    with open(args.json, "w") as fh:
        json.dump(result, fh)


if __name__ == "__main__":
    main()
