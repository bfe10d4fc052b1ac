"""CohortEngine: the in-process rollout engine (continuous batching over a paged, group-shared KV cache).

    engine = CohortEngine(policy_model, tokenizer, eos_token_ids=[tok.eos_token_id])
    completions = engine.generate(prompt_ids, SamplingParams(n=8, max_tokens=512, temperature=1.0))
    ...optimizer step...
    engine.sync_weights()   # nothing to do: the engine reads the policy's parameters in place

The step loop is schedule -> forward (prefill or decode) -> sample -> append/stop -> free finished.
There is no global state: build one engine per data-parallel rank, each on its rank's model replica.

Multi-turn (tool calling): `generate_turns(prompts, params, on_turn_end)` calls `on_turn_end` whenever a
completion ends a model turn; the tokens it returns (tool results, the next assistant header) are appended
and generation continues on the same sequence, whose KV blocks were kept, so only the new tokens are
prefilled. A callback may return a Future (tools running elsewhere): the engine keeps stepping the other
sequences meanwhile.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import random
import time
from collections.abc import Sequence as Seq
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass

import torch

from cohort.engine import launches
from cohort.engine.block_manager import BlockManager
from cohort.engine.config import EngineConfig, context_note
from cohort.engine.model_runner import ModelRunner
from cohort.engine.models.decoder import HFModule, unwrap_model
from cohort.engine.models.registry import engine_supports
from cohort.engine.sampler import Sampler, needs_processing
from cohort.engine.scheduler import ScheduledStep, Scheduler
from cohort.engine.sequence import PrefillUnit, Sequence, Status
from cohort.policy.context import default_block_size, model_context
from cohort.types import Completion, PromptWithInputs, SamplingParams, TurnCallback, TurnEnd


@dataclass
class EngineStats:
    """Counters for tests and benchmarks (cumulative over the engine's life)."""

    prefill_tokens: int = 0
    decode_tokens: int = 0
    prefill_steps: int = 0
    decode_steps: int = 0
    peak_used_blocks: int = 0
    turn_end_seconds: float = 0.0  # host time in multi-turn turn-end callbacks (parsing, inline tools, rendering)


class CohortEngine:
    """Rollout engine implementing cohort.types.RolloutEngine over a HF Llama / Qwen2 / Qwen3 policy."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer=None,
        *,
        eos_token_ids: int | Seq[int] | None = None,
        kv_cache_fraction: float = 0.3,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int | None = None,
        block_size: int | None = None,
        max_model_len: int | None = None,
        num_kv_blocks: int | None = None,
        enforce_eager: bool = False,
        fuse_projections: bool | None = None,
        continuation_delay_steps: int | None = None,
        decode_steps: int | None = None,
        prefill_graph_tokens: int = 4096, record_routes: bool = False, continuation_graph_tokens: int = 2048,
        device: str | torch.device | None = None,
    ) -> None:
        ok, reason = engine_supports(model)
        if not ok:
            raise ValueError(reason)
        hf = unwrap_model(model)
        self.device = self._weights_device(hf, device)
        native, field = model_context(hf.config)
        self.config = EngineConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens or max(16384, max_model_len or native or 4096),
            block_size=block_size or default_block_size(self.device.type),
            # not given: the model's context (4096 when its config names none), lowered to what one sequence
            # can have in the KV pool (fit_context_to_kv); context_note says which
            max_model_len=max_model_len or native or 4096, fit_context_to_kv=max_model_len is None,
            kv_cache_fraction=kv_cache_fraction,
            num_kv_blocks=num_kv_blocks,
            enforce_eager=enforce_eager,
            fuse_projections=fuse_projections,
            continuation_delay_steps=continuation_delay_steps,
            decode_steps=decode_steps,
            prefill_graph_tokens=prefill_graph_tokens, record_routes=record_routes,
            continuation_graph_tokens=continuation_graph_tokens,
        )
        self.tokenizer = tokenizer
        self.eos_token_ids = self._eos_set(eos_token_ids)
        self.runner = ModelRunner(hf, self.config, self.device)
        self._resolve_defaults()
        self.records_routes = self.runner.routes.on  # completions carry routed_experts (router replay)
        self.context_note = context_note(self.config, max_model_len, native, field, self.runner.num_blocks)
        if max_num_batched_tokens is None:  # a prefill step's budget follows the context the pool allowed
            self.config.max_num_batched_tokens = max(16384, self.config.max_model_len)
        self.blocks = BlockManager(self.runner.num_blocks, self.config.block_size)
        self.scheduler = Scheduler(self.config, self.blocks)
        self.sampler = Sampler(self.device)
        exact = getattr(self.runner.net, "exact", None)  # generation.logprob_parity=exact: the trainer's logprobs
        self.sampler.exact_logprobs = None if exact is None else exact.logprobs
        self._warm_sampler()
        self.stats = EngineStats()
        self._inflight: launches.Launch | None = None  # a queued multi-step launch (engine/launches.py)
        self._scheduled: ScheduledStep | None = None  # a decode step scheduled ahead (launches.launch_ahead)
        self._ids = itertools.count()
        self._rng = random.Random()

    @staticmethod
    def _weights_device(hf: HFModule, device: str | torch.device | None) -> torch.device:
        """The device the model's weights are on, after checking that `device` (if given) is of its type."""
        weights_device = hf.get_input_embeddings().weight.device
        requested = torch.device(device) if device is not None else weights_device
        # the engine reads the policy's parameters in place: it cannot compute anywhere else
        if requested.type != weights_device.type:
            raise ValueError(f"device={requested} but the model's weights are on {weights_device}: the engine "
                             "computes with the weights in place; move the model or drop device=.")
        return weights_device

    @staticmethod
    def _eos_set(eos_token_ids: int | Seq[int] | None) -> frozenset[int]:
        """The stop ids every sequence gets (unless ignore_eos), from one id, several or none."""
        if isinstance(eos_token_ids, int):
            eos_token_ids = [eos_token_ids]
        return frozenset(eos_token_ids or ())

    def _warm_sampler(self) -> None:
        """Compile the sampler's CUDA variants at construction (nothing to do on the CPU or without a vocab)."""
        vocab = self.runner.vocab_size
        if self.device.type == "cuda" and vocab:
            # prefill steps sample eagerly at any row count: compile every sampler variant now, not mid-run
            with torch.cuda.device(self.device):
                self.sampler.warm(vocab, self.config.max_num_seqs, self.runner.net.dtype)

    # ---- public API --------------------------------------------------------------------------------
    def generate(self, prompts: Seq[Seq[int]], params: SamplingParams | Seq[SamplingParams], *,
                 max_tokens_each: Seq[Seq[int]] | None = None) -> list[list[Completion]]:
        """`params.n` completions per prompt, in prompt order. `params` may also be one per prompt.
        max_tokens_each: per prompt, one cap per sample (each 1 .. its params.max_tokens): sample j stops after
        max_tokens_each[i][j] tokens, while the group still shares its prompt's KV (a long-tailed workload of
        fixed lengths, bench/long.py). None: every sample stops at max_tokens."""
        per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"got {len(per_prompt)} SamplingParams for {len(prompts)} prompts; pass one or one each.")
        caps = [None] * len(prompts) if max_tokens_each is None else list(max_tokens_each)
        if len(caps) != len(prompts):
            raise ValueError(f"got {len(caps)} lists of max_tokens_each for {len(prompts)} prompts; pass one each.")
        self.runner.ensure_kv_cache()
        try:
            groups = [self._add(i, prompt, p, caps=cap)
                      for i, (prompt, p, cap) in enumerate(zip(prompts, per_prompt, caps))]
            # The device context matters with one engine per rank: Triton and graph capture use the current one.
            with torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext():
                while self.scheduler.has_work():
                    self.step()
        except BaseException:
            self._abort()
            raise
        return [
            [Completion(s.completion_ids, s.logprobs, s.finish_reason or "length",
                        routed_experts=self.runner.routes.result(s)) for s in group]
            for group in groups
        ]

    def generate_turns(self, prompts: Seq[Seq[int]], params: SamplingParams | Seq[SamplingParams],
                       on_turn_end: TurnCallback) -> list[list[Completion]]:
        """Multi-turn `generate`: after each model turn that stops (EOS / stop), `on_turn_end(TurnEnd)` returns
        the context tokens to append (the conversation continues on the same KV blocks), None to end it, or
        a Future of either. `params.max_tokens` caps the whole completion, context tokens included; appended
        tokens must leave room for at least one more sampled token. Completions carry the loss mask (1 for
        sampled tokens, 0 for context) and their number of turns."""
        per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"got {len(per_prompt)} SamplingParams for {len(prompts)} prompts; pass one or one each.")
        self.runner.ensure_kv_cache()
        pending: dict[Future, Sequence] = {}
        try:
            groups = [self._add(i, prompt, p, multi_turn=True)  # a prompt with images keeps them (first turn)
                      for i, (prompt, p) in enumerate(zip(prompts, per_prompt))]
            with torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext():
                while self.scheduler.has_work() or pending:
                    if self.scheduler.has_work():
                        ended = self.step()
                    else:  # every live conversation waits for its tools
                        wait(list(pending), return_when=FIRST_COMPLETED)
                        ended = []
                    paused = [seq for seq in ended if seq.status is Status.PAUSED]
                    if paused:
                        launches.launch_ahead(self)  # the other conversations decode while the callbacks run
                        start = time.perf_counter()
                        replies = self._turn_replies(paused, on_turn_end)
                        self.stats.turn_end_seconds += time.perf_counter() - start
                        for seq, reply in zip(paused, replies):
                            self._end_turn(seq, reply, pending)
                    for future in [f for f in pending if f.done()]:
                        self._continue(pending.pop(future), future.result())
        except BaseException:
            for future in pending:
                future.cancel()
            self._abort()
            raise
        return [
            [Completion(s.completion_ids, s.logprobs, s.finish_reason or "length", mask=list(s.mask), turns=s.turns,
                        routed_experts=self.runner.routes.result(s)) for s in group]
            for group in groups
        ]

    def _resolve_defaults(self) -> None:
        """What depends on the built runner: continuation_delay_steps (EngineConfig: 0 once continued turns are
        graphed, else 8), and on a GPU the collector's freeze."""
        if self.config.continuation_delay_steps is None:
            graphed = self.runner.continuations is not None and self.runner.continuations.use_graphs
            self.config.continuation_delay_steps = 0 if graphed else 8
        if self.device.type == "cuda":
            # The model, tokenizer, graphs and the trainer's state live as long as the run: out of the collector's
            # reach, a full collection no longer walks them (with them, one took tens of milliseconds in the middle
            # of a multi-turn generate call, bench/turns.py). Objects made from now on are collected as usual.
            gc.collect()
            gc.freeze()

    def _turn_replies(self, paused: list[Sequence], on_turn_end: TurnCallback) -> list:
        """The callback's replies to turns that ended in one step: in one call of `on_turn_end.many(turns)` when
        the callback has it (the tools of all those turns then run at once), else one call per turn."""
        turns = [self._turn_end(seq) for seq in paused]
        many = getattr(on_turn_end, "many", None)
        replies = list(many(turns)) if many is not None else [on_turn_end(turn) for turn in turns]
        if len(replies) != len(turns):
            raise ValueError(f"on_turn_end.many returned {len(replies)} replies for {len(turns)} turns; give one each")
        return replies

    def _turn_end(self, seq: Sequence) -> TurnEnd:
        index, sample = seq.request_index
        return TurnEnd(prompt_index=index, sample_index=sample, prompt_ids=seq.token_ids[: seq.num_prompt_tokens],
                       completion_ids=seq.completion_ids, turn_ids=seq.turn_ids, turn=seq.turns,
                       finish_reason=seq.finish_reason or "stop")

    def _end_turn(self, seq: Sequence, reply, pending: dict[Future, Sequence]) -> None:
        if isinstance(reply, Future):
            pending[reply] = seq  # its blocks stay while the tools run
        else:
            self._continue(seq, reply)

    def _continue(self, seq: Sequence, tokens: Seq[int] | None) -> None:
        if not tokens:
            self.scheduler.release(seq)
            return
        room = seq.max_tokens - seq.num_completion_tokens
        if len(tokens) >= room:
            raise ValueError(f"a continuation of {len(tokens)} tokens leaves no room to generate: the completion "
                             f"has {seq.num_completion_tokens} of max_tokens={seq.max_tokens}; end the "
                             "conversation (return None) when the context does not fit.")
        self.scheduler.resume(seq, list(tokens))

    def _abort(self) -> None:
        """Drop every queued, running and paused sequence (after an error) so the next call starts clean."""
        for seq in [*self.scheduler.running, *self.scheduler.paused]:
            self.blocks.free(seq)
        for unit in self.scheduler.waiting:  # continued turns wait in the queue holding their blocks
            self.blocks.free(unit.leader)
        self._inflight = None  # its kernels only touch blocks that later work, queued after it, overwrites
        self._scheduled = None
        self.scheduler.running.clear()
        self.scheduler.paused.clear()
        self.scheduler.waiting.clear()

    def release_kv_cache(self) -> None:
        """Free the KV pool until the next generate (generation.release_kv_during_update)."""
        if self.scheduler.has_work():
            raise RuntimeError("release_kv_cache() while sequences are in flight; call it between generate calls")
        self.runner.release_kv_cache()

    def sync_weights(self) -> None:
        """Called after each optimizer step. In-place weights: nothing to do; fused copies are re-copied."""
        self.runner.sync_weights()

    def refresh_buffers(self) -> None:
        """After the model's buffers were overwritten (a served engine's push: serving/weights.model_tensors):
        rebuild what the engine derives from them, the RoPE tables. An optimizer step never changes them."""
        self.runner.net.refresh_rope()

    def engine_name(self) -> str:
        fused = ", fused qkv/gate-up copies" if self.runner.net.fused else ""
        graphs = f"cuda graphs for {len(self.runner.graphs)} batch sizes" if self.runner.graphs else "eager"
        return f"cohort engine ({self.runner.attention.name}, {graphs}, sampler={'triton' if self.sampler.use_triton else 'torch'}{fused})"

    # ---- internals ---------------------------------------------------------------------------------
    def _add(self, index: int, prompt: Seq[int], params: SamplingParams, multi_turn: bool = False,
             caps: Seq[int] | None = None) -> list[Sequence]:
        self._validate(index, prompt, params)
        if caps is not None and (len(caps) != params.n or not all(1 <= c <= params.max_tokens for c in caps)):
            raise ValueError(f"prompt {index}: max_tokens_each={list(caps)[:8]} must hold n={params.n} caps, each "
                             f"1 .. max_tokens={params.max_tokens}.")
        base = params.seed if params.seed is not None else self._rng.getrandbits(62)
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_token_ids)
        inputs = prompt if isinstance(prompt, PromptWithInputs) else None  # a runtime Protocol check: ~20 us
        seqs = [
            Sequence(seq_id=next(self._ids), token_ids=list(prompt), num_prompt_tokens=len(prompt), params=params,
                     seed=base + index * params.n + j, request_index=(index, j), stop_ids=stop_ids,
                     multi_turn=multi_turn, inputs=inputs, max_tokens=caps[j] if caps is not None else 0)
            for j in range(params.n)
        ]
        # A group must fit one step's sequence limit and the cache; split it (losing some sharing) if not.
        chunk = len(seqs)
        while chunk > 1 and (chunk > self.config.max_num_seqs
                             or self.blocks.blocks_to_prefill(len(prompt), chunk) > self.blocks.num_blocks // 2):
            chunk = (chunk + 1) // 2
        for start in range(0, len(seqs), chunk):
            self.scheduler.add(PrefillUnit(seqs[start : start + chunk]))
        return seqs

    def _validate(self, index: int, prompt: Seq[int], params: SamplingParams) -> None:
        if not prompt:
            raise ValueError(f"prompt {index} is empty; the engine needs at least one token (e.g. BOS).")
        if params.n < 1 or params.max_tokens < 1:
            raise ValueError(f"SamplingParams n={params.n}, max_tokens={params.max_tokens} must both be >= 1.")
        total = len(prompt) + params.max_tokens
        if total > self.config.max_model_len:
            raise ValueError(f"prompt {index}: {len(prompt)} tokens + max_tokens={params.max_tokens} = {total} > "
                             f"max_model_len={self.config.max_model_len}; raise max_model_len or shorten.")
        if self.blocks.blocks_for(total) > self.blocks.num_blocks:
            raise ValueError(f"prompt {index} needs {self.blocks.blocks_for(total)} KV blocks but the cache has "
                             f"{self.blocks.num_blocks}; raise kv_cache_fraction / num_kv_blocks.")

    def step(self) -> list[Sequence]:
        """One scheduler step: forward, sample, append, release finished sequences (returned)."""
        if self._inflight is not None:
            return launches.read(self)
        step, self._scheduled = self._scheduled or self.scheduler.schedule(self.runner.decode_steps), None
        if launches.queue(self, step):
            return launches.read(self)
        if step.is_prefill:
            logits = self.runner.prefill(step.units)
            if step.block_copies:
                self.runner.copy_blocks(step.block_copies)
            # Every sample of a group draws its first token from the leader's last-position logits.
            rows = [u for u, unit in enumerate(step.units) for _ in unit.seqs]
            if len(rows) != len(step.units):
                logits = logits[torch.tensor(rows, device=logits.device)]
            sampled = None
            self.stats.prefill_tokens += sum(unit.num_tokens for unit in step.units)
            self.stats.prefill_steps += 1
        else:
            if not step.seqs:
                return []
            logits, sampled = self.runner.decode(step.seqs, fused_sampling=not needs_processing(step.seqs))
            self.stats.decode_tokens += len(step.seqs)
            self.stats.decode_steps += 1
        self.stats.peak_used_blocks = max(self.stats.peak_used_blocks, self.blocks.num_used_blocks)
        if step.is_prefill or sampled is None:
            tokens, logprobs = self.sampler(logits, step.seqs)
        else:
            tokens, logprobs = sampled
        self.runner.routes.book(step)  # router replay: the routing of the tokens just fed (when recording)
        for seq, token, logprob in zip(step.seqs, tokens, logprobs):
            seq.append(token, logprob, self.tokenizer)
        return self.scheduler.finish(step.seqs)
