"""Multi-turn (tool-calling) generation against single-turn on the same engine, model and prompts.

    python bench/turns.py                      # GPU: SmolLM2-135M architecture, random weights, bf16
    python bench/turns.py --tiny --prompts 4   # CPU harness: 2 layers of width 256, same vocab and workload
    python bench/turns.py --model PATH         # another Llama-family config + tokenizer (weights still scripted)
    python bench/turns.py --served --server-device cuda:1          # + the rows through `cohort serve` on GPU 1
    python bench/turns.py --served --only "= default,served"     # issue 34: served vs colocated multi-turn
    python bench/turns.py --tiny --cpu --prompts 2 --n 2 --steps 1 --served   # CPU smoke of the served rows

Workload (recipes/calculator_agent.yaml): 32 prompts x 8 completions, prompts of ~520 tokens rendered by the
chatml_tools template with the calculator tool and the recipe's two few-shot conversations, at most 160
completion tokens over the whole conversation, up to 3 rounds of tool calls, temperature 1.

A random model never writes a tool call, so the weights are scripted (the cost being measured is host-side,
and the forward still runs every layer at full size): every layer's output projections are zeroed, so the
residual stream is the current token's embedding and the next token depends on the current one only; the
embeddings of a few dozen tokens are one-hot and the LM head maps each to its successor. After the assistant
header the model branches: with probability --p-call it writes a ~30-token "call" turn (the parser turns it
into calculator("34 + 56 - 12 + 78"), whose ~24-token result is appended), else a ~8-token answer; each turn
ends with <|im_end|>. Sampling stays the engine's (Gumbel noise per seed and position), so the branch is
drawn per turn like a real model's choice.

Prints one table: generate seconds per step, process CPU seconds (all threads: the host-side cost), prefill / decode steps, sampled and context tokens, tokens/s
(sampled tokens / generate seconds), turns per completion, and the host seconds spent in the turn-end callbacks
(EngineStats.turn_end_seconds: parsing, inline tools, rendering the continuations), for single-turn (`engine.generate`) and multi-turn
(`TurnLoop.generate`) after the warm-up of each (in process: repeated, up to --warmup calls, until a call captures no
new CUDA graph; the last column counts the captures that still fell in timed calls). The row "single-turn, the multi-turn row's sampled tokens per
completion" samples, with EOS ignored, exactly as many tokens per completion as the default multi-turn row (its
draw is fixed by the seed): the same token work in one turn, so that row against the multi-turn one is the cost
of the turns alone (the decode depth of a conversation's sampled tokens is in both). --only keeps the rows whose name contains one of its
comma-separated substrings.

The multi-turn rows add the host-side paths one at a time, each with all the earlier ones: "before" (per-turn
prefix attention, no continuation delay, uncached renders, an event loop per tool turn), batched prefix
attention, continuation_delay_steps=8, the render cache and tool workers, inline tools (True, then auto); then
launch-ahead (engine/launches.py: the next decode launch queued before the turn-end callbacks, launches chained
while continued turns wait) with one tool hand-off per turn, the turns that end in one engine step running their
tool calls together (TurnLoop's many()), and finally (the default) continued turns prefilled as decode-shaped
CUDA graphs (engine/continuation_graphs.py; on the CPU the same path as the row before), three rows of which vary
continuation_delay_steps (8, 4, 0; the default row takes the engine's: 0 with continuation graphs, else 8).
--profile writes a cProfile of every row's timed calls (slower than the plain rows: compare rows within it);
--trace appends a device-busy report of one extra call per row (bench/device_trace.py). Columns also give the
host seconds in the turn-end callbacks and the garbage collector's pauses (mean and longest per call); the row
"no gc.freeze" undoes, for its calls, the freeze the engine applies on a GPU (what existed when it was built).

--served (bench/turns_served.py) adds three rows through a `cohort serve` subprocess on the same model: the
scripted weights and the tokenizer are saved (save_pretrained) to a temporary folder that the server loads,
the server gets an API key in its environment (COHORT_API_KEY), and it is killed at the end, also on an error.
The client is `RemoteEngine` (no weight push: the server already holds the weights), the workload, seeds,
parser and `TurnLoop` settings are the colocated "(= default)" row's:
    served single-turn                                        RemoteEngine.generate
    served multi-turn: sessions (KV kept between turns)       TurnLoop.generate; each turn sent detached (session_id /
                                                              keep / continue / detach) as soon as it is ready, answers
                                                              long-polled from /sessions/wait (remote/session_turns.py)
    served multi-turn: no sessions (re-prefill every turn)    TurnLoop.generate; each round re-sends every
                                                              conversation (engine/turns_by_regeneration.py)
--server-device: cuda:1 (default when two GPUs are visible; the server then sees only that GPU), cuda (the
in-process GPU, shared) or cpu (the default with --cpu). --server-timeout: seconds to wait for it to start.
Served engine settings: as the in-process engine (max_model_len 1024, kv_cache_fraction 0.3 on a GPU / 0.05 on
the CPU, max_num_seqs max(256, prompts x n), bf16 on a GPU / float32 on the CPU, CUDA graphs, the engine's
defaults for block size, decode steps, batched tokens and continuation_delay_steps; one torch thread on
the CPU), plus --max-sessions max(64, prompts x n) so that no conversation's session is evicted. Differences:
- the KV fraction is of the server device's own free memory (a shared GPU: what the in-process engine left);
- EOS: the server stops on the tokenizer's EOS and the generation config's (cohort.setup.engine.eos_ids), the
  in-process engine on <|im_end|> only; the same token for SmolLM2 (check both with another --model);
- on a GPU the server's RoPE table stays float32 where the in-process model's `.to(bfloat16)` rounded it;
  the scripted weights zero every attention output, so the tokens do not depend on it;
- sessions: a prompt's n conversations open on one prefill of it, sharing its KV blocks, as in process; a
  conversation's next turn goes out as soon as its tool result is ready and joins the server's running batch
  (serving/session_driver.py; continuation_delay_steps as in process), and an ended one is closed from a
  client thread of its own (its blocks released by the driver between two steps), but each turn end and each
  continuation crosses HTTP (a /sessions/wait answer, a /generate request), where in process they are function
  calls between two engine steps: a continuation joins one engine step later than in process;
- no sessions: every later turn is seeded seed + row + 7919 x turn (the re-send path's rule), so its draws, turns
  per completion and token counts differ from the colocated rows (they equal the in-process re-send path);
  with sessions and single-turn, tokens and logprobs equal the colocated rows' (checked on the CPU).
Served rows: process CPU s is the client's plus the server process's (/proc/PID/stat: user + system, all
threads); prefill / decode steps are the server engine's counters (its /health "engine_stats", read before and
after the timed calls).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import itertools
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # device_trace, turns_served live beside this file

RECIPE_FEW_SHOT = [
    {"role": "user", "content": "State the final answer to the following arithmetic problem: 71 - 38 + 12 - 9 =\n\n"
                                "Use the calculator, then give the final answer as a number."},
    {"role": "assistant", "content": "",
     "tool_calls": [{"type": "function", "function": {"name": "calculator",
                                                      "arguments": {"expression": "71 - 38 + 12 - 9"}}}]},
    {"role": "tool", "name": "calculator", "content": "36"},
    {"role": "assistant", "content": "36"},
    {"role": "user", "content": "State the final answer to the following arithmetic problem: 23 + 45 - 17 + 60 =\n\n"
                                "Use the calculator, then give the final answer as a number."},
    {"role": "assistant", "content": "",
     "tool_calls": [{"type": "function", "function": {"name": "calculator",
                                                      "arguments": {"expression": "23 + 45 - 17 + 60"}}}]},
    {"role": "tool", "name": "calculator", "content": "111"},
    {"role": "assistant", "content": "111"},
]
SYSTEM = "You are a careful assistant. Do not compute in your head: call the calculator tool."


def build_prompts(tokenizer, tools, count: int, seed: int = 0):
    import random

    rng = random.Random(seed)
    convs, ids = [], []
    for _ in range(count):
        terms = [rng.randint(10, 99) for _ in range(4)]
        expr = " + ".join(str(t) for t in terms)
        conv = [{"role": "system", "content": SYSTEM}, *RECIPE_FEW_SHOT,
                {"role": "user", "content": f"State the final answer to the following arithmetic problem: {expr} =\n\n"
                                            "Use the calculator, then give the final answer as a number."}]
        convs.append(conv)
        ids.append(list(tokenizer.apply_chat_template(conv, tools=tools, add_generation_prompt=True, tokenize=True,
                                                      return_dict=True)["input_ids"]))
    return convs, ids


def script_model(model, tokenizer, p_call: float, call_len: int = 30, answer_len: int = 8, spread: int = 5):
    """Make `model` follow the token chains described in the module docstring; returns the call chains' first
    ids. `spread` chains of each kind with lengths around call_len / answer_len, so that turns end at different
    steps (continuations trickle in, as with a real model)."""
    start = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=True,
                                          tokenize=True, return_dict=True)["input_ids"][-1]  # "\n" after the header
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    hidden = model.config.hidden_size
    avoid = {start, end, *tokenizer.all_special_ids}
    call_lens = [max(2, call_len + d) for d in range(-spread + 1, spread, 2)][:spread] or [call_len]
    answer_lens = [max(2, answer_len + d) for d in range(-spread + 1, spread, 2)][:spread] or [answer_len]
    # distinctive tokens (the parser finds a call by its first token's text): 4+ letters, no leading space
    pool = iter(t for t in range(3000, 40000)
                if t not in avoid and tokenizer.decode([t]).isalpha() and len(tokenizer.decode([t])) >= 4)
    calls = [[next(pool) for _ in range(n)] for n in call_lens]
    answers = [[next(pool) for _ in range(n)] for n in answer_lens]
    heads_text = [tokenizer.decode([c[0]]) for c in calls]
    for a in answers:
        assert not any(h in tokenizer.decode([*a, end]) for h in heads_text), "an answer chain looks like a call"
    nodes = [start, *(t for c in calls + answers for t in c)]
    if len(nodes) > hidden:
        raise SystemExit(f"hidden size {hidden} < {len(nodes)} scripted tokens; use a wider model or fewer chains")
    edges = {start: [(c[0], math.log(p_call / len(calls))) for c in calls]
             + [(a[0], math.log((1 - p_call) / len(answers))) for a in answers]}
    for chain in calls + answers:
        for a, b in itertools.pairwise(chain):
            edges[a] = [(b, 0.0)]
        edges[chain[-1]] = [(end, 0.0)]
    big = 40.0
    scale = hidden ** -0.5  # RMSNorm turns a one-hot row into sqrt(hidden) at its coordinate
    with torch.no_grad():
        hf = model
        for layer in hf.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        hf.model.norm.weight.fill_(1.0)
        emb, head = hf.model.embed_tokens.weight, hf.lm_head.weight
        for k, node in enumerate(nodes):
            emb[node].zero_()
            emb[node, k] = 1.0
            head[:, k] = 0.0
            for nxt, logp in edges[node]:
                head[nxt, k] = (big + logp) * scale
    return [c[0] for c in calls]


def build(args):
    from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM

    from cohort.agents.templates import apply_chat_template_override
    from cohort.policy.model import resolve_model_path

    path = args.model or resolve_model_path("smollm2-135m-instruct")
    tokenizer = apply_chat_template_override(AutoTokenizer.from_pretrained(path), "chatml_tools")
    config = AutoConfig.from_pretrained(path)
    config.tie_word_embeddings = False
    if args.tiny:
        config.num_hidden_layers, config.hidden_size, config.intermediate_size = 2, 256, 512
        config.num_attention_heads, config.num_key_value_heads, config.head_dim = 4, 1, 64
    device = "cuda" if torch.cuda.is_available() and not args.cpu else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if device == "cpu":
        torch.set_num_threads(1)  # steadier timings on a shared machine; process CPU time counts one compute thread
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype)
    return model.eval(), tokenizer, device


def graph_captures(engine) -> int:
    """CUDA graphs the in-process engine captured so far: continued-turn prefills and prefills (captured the first
    time a padded size occurs) and decode recaptures (0 on the CPU)."""
    runner = engine.runner
    return (getattr(runner.continuations, "captures", 0) + getattr(runner.prefill_graphs, "captures", 0)
            + runner.graph_recaptures)


def measure(name, fn, args, device, *, stats=None, other_cpu=None, profile_path=None, trace_path=None,
            captures=None):
    """One table row: `args.steps` timed calls of `fn` after the warm-up. `stats`: the engine's counters
    (prefill / decode steps; None: '-'), or a function that reads them (the server's, from its /health);
    `other_cpu()`: CPU seconds of another process counted in (the server). `captures()`: the engine's graph
    captures so far; given, the warm-up repeats (up to args.warmup calls) until a call captures no new graph, so
    that no capture (nor the kernel compilation a new size can bring, slowest in a machine's first process) falls
    in a timed call; the row reports the captures that still did."""
    read = stats if callable(stats) else lambda: dict(vars(stats))
    count = captures or (lambda: 0)  # no counter: one warm-up call
    for _ in range(max(1, args.warmup)):  # kernels, allocator, tokenizer caches, graphs of new sizes
        before = count()
        fn()
        if count() == before:
            break
    captured0 = count()
    stats0 = read() if stats is not None else None
    from cohort.agents.placement import GcClock

    times, cpu, gc_s, sampled, context, turns = [], [], [], 0, 0, 0
    profiler = None
    if profile_path:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    for step in range(args.steps):
        if device == "cuda":
            torch.cuda.synchronize()
        if trace_path and step == args.steps - 1:  # the last timed call, traced (bench/device_trace.py)
            from device_trace import device_trace

            with device_trace(trace_path, label=name):
                fn()
        start, cpu_start = time.perf_counter(), time.process_time() + (other_cpu() if other_cpu else 0.0)
        with GcClock() as collector:  # the garbage collector's pauses in this process, any thread
            groups = fn()
        if device == "cuda":
            torch.cuda.synchronize()
        gc_s.append(collector.seconds)
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() + (other_cpu() if other_cpu else 0.0) - cpu_start)
        for c in (c for g in groups for c in g):
            mask = c.mask or [1] * len(c.token_ids)
            sampled += sum(mask)
            context += len(mask) - sum(mask)
            turns += c.turns or 1
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(profile_path)
    k = args.steps
    steps = {"prefill_steps": None, "decode_steps": None, "turn_end_seconds": None}
    if stats0 is not None:
        now = read()
        steps = {key: (now[key] - stats0[key]) / k if key in now and key in stats0 else None for key in steps}
    mean = sum(times) / k
    timed_captures = count() - captured0 if captures is not None else None
    return (name, mean, min(times), min(cpu), steps["prefill_steps"], steps["decode_steps"], sampled / k,
            context / k, sampled / k / mean, turns / k / (args.prompts * args.n), steps["turn_end_seconds"],
            sum(gc_s) / k, max(gc_s), timed_captures)


def colocated_modes(engine, tok, tools, parser, ids, convs, params):
    """(name, fn) of the in-process rows: single-turn, and multi-turn with the host-side paths before / after."""
    import cohort.agents.messages as messages
    import cohort.agents.tools as tools_mod
    import cohort.engine.attention as attention
    import cohort.engine.launches as launches
    from cohort.agents.rollout_loop import TurnLoop, _TurnEnds

    batched, render, run_tools = attention.prefix_sdpa_batched, messages._render, tools_mod.ToolRunner.run
    launch_ahead, chain, many = launches.launch_ahead, launches.chain, _TurnEnds.many

    def chain_unless_waiting(engine, current):  # as before: no chained launch while a continued turn waits
        return None if engine.scheduler.waiting else chain(engine, current)

    def per_turn_prefix(q, out, k_cache, v_cache, batch, scale, window=None, max_elements=0):
        """The attention of continued turns one turn at a time (as before the batched version)."""
        if not hasattr(batch, "host"):  # once per step (one sync), not per layer
            batch.host = list(zip(batch.rows[:, 0].tolist(), batch.positions[:, 0].tolist(), batch.lengths))
        for i, (start, cached, n) in enumerate(batch.host):
            table = batch.tables[i, : -(-(cached + n) // k_cache.shape[1])]
            out[start:start + n] = attention.prefix_sdpa(q[start:start + n], k_cache, v_cache, table, cached, scale,
                                                         window)

    def render_uncached(tokenizer, msgs, schemas, *, generation_prompt, **kwargs):
        return tokenizer.apply_chat_template(msgs, tools=schemas or None, tokenize=False,
                                             add_generation_prompt=generation_prompt, **kwargs)

    def run_with_event_loop(self, calls):  # as before: an event loop per turn, a new thread per sync call
        return tools_mod._run_sync(self.arun(calls)) if calls else []

    continuations = engine.runner.continuations
    default_delay = engine.config.continuation_delay_steps  # 0 with continuation graphs (a GPU), else 8

    def multi_with(delay: int, batched_prefix: bool, fast_host: bool, inline: bool | str, ahead: bool = True,
                   batched_turns: bool = True, continuation_graphs: bool = True):
        def run():
            engine.runner.continuations = continuations if continuation_graphs else None
            engine.scheduler.config.continuation_delay_steps = delay
            attention.prefix_sdpa_batched = batched if batched_prefix else per_turn_prefix
            messages._render = render if fast_host else render_uncached
            tools_mod.ToolRunner.run = run_tools if fast_host else run_with_event_loop
            launches.launch_ahead = launch_ahead if ahead else lambda engine: None
            launches.chain = chain if ahead else chain_unless_waiting
            _TurnEnds.many = many if batched_turns else None  # None: the engine calls back once per turn
            loop = TurnLoop(tok, tools, max_iterations=3, parser=parser, inline_tools=inline)
            try:
                return loop.generate(engine, ids, params, prompts=convs)
            finally:
                attention.prefix_sdpa_batched, messages._render, tools_mod.ToolRunner.run = batched, render, run_tools
                launches.launch_ahead, launches.chain, _TurnEnds.many = launch_ahead, chain, many
                engine.runner.continuations = continuations
        return run

    default_multi = multi_with(default_delay, True, True, "auto")

    def unfrozen():  # as before the engine froze what existed when it was built (gc.freeze, engine.py)
        frozen = gc.get_freeze_count()
        gc.unfreeze()
        try:
            return default_multi()
        finally:
            if frozen:
                gc.freeze()
    caps: list = []

    def single_same_tokens():
        """Single-turn sampling, per completion, as many tokens as the default multi-turn row samples (its draw is
        fixed by the seed): the same token work without turns, so the two rows differ by the turns alone."""
        if not caps:
            caps.extend([max(1, sum(c.mask or [1] * len(c.token_ids))) for c in g] for g in default_multi())
        return engine.generate(ids, dataclasses.replace(params, ignore_eos=True), max_tokens_each=caps)

    return [("single-turn", lambda: engine.generate(ids, params)),
            ("single-turn, the multi-turn row's sampled tokens per completion (EOS ignored)", single_same_tokens),
            ("multi-turn before: per-turn prefix attn, no delay, uncached renders, event loop per turn",
             multi_with(0, False, False, False, ahead=False, batched_turns=False, continuation_graphs=False)),
            ("multi-turn + batched prefix attn", multi_with(0, True, False, False, ahead=False, batched_turns=False, continuation_graphs=False)),
            ("multi-turn + continuation_delay_steps=8", multi_with(8, True, False, False, ahead=False, batched_turns=False, continuation_graphs=False)),
            ("multi-turn + render cache, tool workers", multi_with(8, True, True, False, ahead=False, batched_turns=False, continuation_graphs=False)),
            ("multi-turn + agent.inline_tools", multi_with(8, True, True, True, ahead=False, batched_turns=False, continuation_graphs=False)),
            ("multi-turn + inline_tools=auto, no launch-ahead", multi_with(8, True, True, "auto", ahead=False, batched_turns=False, continuation_graphs=False)),
            ("multi-turn + launch-ahead, one tool hand-off per turn",
             multi_with(8, True, True, "auto", batched_turns=False, continuation_graphs=False)),
            ("multi-turn + launch-ahead, batched turn ends (no continuation graphs)",
             multi_with(8, True, True, "auto", continuation_graphs=False)),
            ("multi-turn + continuation graphs, continuation_delay_steps=8", multi_with(8, True, True, "auto")),
            ("multi-turn + continuation graphs, continuation_delay_steps=4", multi_with(4, True, True, "auto")),
            ("multi-turn + continuation graphs, continuation_delay_steps=0", multi_with(0, True, True, "auto")),
            ("multi-turn + continuation graphs, the collector walking the whole heap (no gc.freeze)", unfrozen),
            ("multi-turn + continuation graphs, inline_tools=auto (= default)", default_multi)]


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a folder with a Llama-family config.json and tokenizer (default: SmolLM2-135M)")
    ap.add_argument("--tiny", action="store_true", help="2 layers of width 256 (the CPU harness)")
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--p-call", type=float, default=0.5, help="probability that a turn calls the tool")
    ap.add_argument("--steps", type=int, default=3, help="timed calls of each mode (after the warm-up)")
    ap.add_argument("--warmup", type=int, default=3, help="at most this many warm-up calls of an in-process row: "
                    "they repeat until a call captures no new CUDA graph")
    ap.add_argument("--profile", help="write a cProfile of each row's timed calls to PROFILE.<row number>")
    ap.add_argument("--trace", help="append a device-busy report (bench/device_trace.py) of one extra call per row "
                    "to TRACE (diagnosis; the profiler slows the host)")
    ap.add_argument("--only", help="comma-separated substrings of the row names to run (e.g. 'single,before')")
    ap.add_argument("--served", action="store_true", help="add the rows served by a `cohort serve` subprocess")
    ap.add_argument("--server-device", help="the server's device (cuda:1, cuda, cpu; default: cuda:1 when two "
                    "GPUs are visible, else the in-process device)")
    ap.add_argument("--server-timeout", type=float, default=300.0, help="seconds to wait for the server to start")
    return ap.parse_args()


def print_table(rows) -> None:
    print("| mode | generate s/step (mean) | min | process CPU s (min) | prefill steps | decode steps | sampled tok | context tok "
          "| sampled tok/s | turns/completion | turn-end callbacks s (mean) | gc s (mean / max) "
          "| graph captures in timed calls |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        steps = " | ".join("-" if v is None else f"{v:.0f}" for v in r[4:6])
        print(f"| {r[0]} | {r[1]:.3f} | {r[2]:.3f} | {r[3]:.3f} | {steps} | {r[6]:.0f} | {r[7]:.0f} "
              f"| {r[8]:.0f} | {r[9]:.2f} | {'-' if r[10] is None else f'{r[10]:.3f}'} | {r[11]:.3f} / {r[12]:.3f} "
              f"| {'-' if r[13] is None else r[13]} |")


def main() -> None:
    args = parse_args()
    from cohort.agents.builtins import calculator
    from cohort.agents.tools import ToolCall
    from cohort.engine import CohortEngine
    from cohort.types import SamplingParams

    model, tok, device = build(args)
    markers = [tok.decode([m]) for m in script_model(model, tok, args.p_call)]
    convs, ids = build_prompts(tok, [calculator], args.prompts)

    def parser(text, tokenizer=None):
        return [ToolCall("calculator", {"expression": "34 + 56 - 12 + 78"})] if any(m in text for m in markers) else []

    t0 = time.perf_counter()
    engine = CohortEngine(model, tok, eos_token_ids=[tok.convert_tokens_to_ids("<|im_end|>")],
                          max_num_seqs=max(256, args.prompts * args.n), max_model_len=1024,
                          kv_cache_fraction=0.3 if device == "cuda" else 0.05)
    setup_s = time.perf_counter() - t0
    params = SamplingParams(n=args.n, max_tokens=args.max_tokens, temperature=1.0, seed=1234)
    keys = args.only.split(",") if args.only else None
    chosen = [m for m in colocated_modes(engine, tok, [calculator], parser, ids, convs, params)
              if keys is None or any(key in m[0] for key in keys)]
    rows = [measure(name, fn, args, device, stats=engine.stats, captures=lambda: graph_captures(engine),
                    profile_path=f"{args.profile}.{i}" if args.profile else None, trace_path=args.trace)
            for i, (name, fn) in enumerate(chosen)]
    notes = []
    if args.served:
        rows += served_rows(args, model, tok, device, (parser, ids, convs, params), keys, notes)
    print(f"device={device} model={'tiny ' if args.tiny else ''}{model.config.num_hidden_layers}L/"
          f"{model.config.hidden_size} {engine.engine_name()} setup={setup_s:.1f}s "
          f"prompt_tokens~{sum(map(len, ids)) // len(ids)} p_call={args.p_call}")
    print(*notes, sep="\n")
    print_table(rows)


def served_rows(args, model, tok, device, workload, keys, notes):
    """The --served rows (bench/turns_served.py); `notes` gets the server's description."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import turns_served

    from cohort.agents.builtins import calculator

    if keys is not None and not any(key in name for name in turns_served.ROW_NAMES for key in keys):
        return []
    with turns_served.served(model, tok, args, device) as (server, where):
        modes = turns_served.served_modes(server, tok, [calculator], *workload)
        rows = [measure(name, fn, args, device, other_cpu=server.cpu_seconds, stats=turns_served.engine_stats(remote))
                for name, fn, remote in modes if keys is None or any(key in name for key in keys)]
        notes.append(f"served: {modes[0][2].engine_name()} on {where}, {server.context}; served rows: process CPU "
                     "= client + server processes, prefill / decode steps the server's engine's (its /health)")
    return rows


if __name__ == "__main__":
    main()
