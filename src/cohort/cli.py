"""Command line: `cohort train | eval | generate | serve | plot | bench`.

    cohort train recipes/default.yaml loss.epsilon=0.3 train.max_steps=50
    cohort eval  recipes/default.yaml model.name_or_path=runs/default/checkpoints/step-000100
    cohort generate smollm2-135m-instruct "What is 12 + 30?"
    cohort serve smollm2-135m-instruct --port 8000
    cohort plot runs/default

Any CohortError (a bad setting, path, dataset or reward function) prints one clear message and exits with
status 2; it never prints a traceback or leaves a half-written run directory.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import runpy
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from cohort import distributed, trainer  # trainer as a module: tests replace trainer.train
from cohort.checkpointing.interrupted import interrupted_message as checkpoint_interrupted_message
from cohort.config import CohortConfig, dump_config, load_config
from cohort.config.help import render_text
from cohort.config.preflight import check_data_paths, check_model_path, check_paths
from cohort.errors import CohortError, ConfigError
from cohort.evaluation import evaluate
from cohort.policy.model import load_policy
from cohort.run.plot import plot_run
from cohort.run.seeding import set_deterministic
from cohort.serving.server import serve
from cohort.setup import (
    build_components,
    build_engine,
    prompt_token_limit,
    resolve_device,
    resolve_dtype,
    sampling_params_for,
)


def _train(args: argparse.Namespace) -> int:
    if args.help_config is not None:  # every setting (or one section's), from the dataclasses: nothing is loaded
        print(render_text(args.help_config or None), end="")
        return 0
    cfg = load_config(args.recipe, args.overrides)
    if args.resume:  # continuing a run never wipes it, whatever the recipe says about overwrite
        cfg.run.resume, cfg.run.overwrite = True, False
    if args.overwrite:
        cfg.run.overwrite = True
    if args.print_config:
        if os.environ.get("RANK", "0") == "0":  # torchrun: rank 0 alone prints
            print(dump_config(cfg))
        return 0
    check_paths(cfg)  # model path, run directory, resume checkpoint: before any model loads or file changes
    set_deterministic(cfg.train.deterministic)  # before CUDA starts: cuBLAS reads its workspace setting once
    # torchrun: one process per GPU, data parallel; every collective times out after train.dist_timeout_s
    info = distributed.init_from_env(timeout_s=cfg.train.dist_timeout_s)
    try:
        result = trainer.train(cfg)
        distributed.shutdown()
    except KeyboardInterrupt:
        if info.is_main:
            print(interrupted_message(cfg, args), file=sys.stderr)
        return 130
    if not info.is_main:  # rank 0 alone reports and writes the run directory (curves included)
        return 0
    if result.stopped_at is not None:
        print(f"stopped at step {result.stopped_at} (time limit); run directory: {result.run_dir}")
        return 0
    if result.eval_before or result.eval_after:
        print("held-out before -> after: " + "  ".join(
            f"{k} {result.eval_before.get(k, float('nan')):.3f} -> {v:.3f}" for k, v in result.eval_after.items()))
    try:
        for path in plot_run(result.run_dir):
            print(f"curves: {path}")
    except ImportError:
        print("curves: matplotlib is not installed (pip install matplotlib), skipped; `cohort plot` later")
    print(f"run directory: {result.run_dir}")
    return 0


def continue_command(args: argparse.Namespace, *, resume: bool = True) -> str:
    """The command line that continues this run: the same recipe and overrides, plus --resume."""
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    head = f"torchrun --nproc-per-node {world} -m cohort.cli train" if world > 1 else "cohort train"
    parts = ([args.recipe] if args.recipe else []) + list(args.overrides or [])
    return " ".join([head, *(shlex.quote(p) for p in parts), *(["--resume"] if resume else [])])


def interrupted_message(cfg, args: argparse.Namespace) -> str:
    """What Ctrl-C prints: the newest checkpoint (if any) and the exact command that continues the run."""
    restart = continue_command(args, resume=False)
    return checkpoint_interrupted_message(cfg.run.output_dir, resume=continue_command(args), restart=restart,
                                          restart_over_progress=f"{restart} --overwrite")


def _eval(args: argparse.Namespace) -> int:
    cfg = load_config(args.recipe, args.overrides)
    check_model_path(cfg.model.name_or_path, cfg.model.gguf_file)
    check_data_paths(cfg)
    if args.samples and not Path(args.samples).resolve().parent.is_dir():  # fail before the evaluation runs
        raise ConfigError(f"--samples={args.samples!r}: its folder does not exist; create it or pass another path")
    if not (cfg.data.eval_source or cfg.data.eval_size):
        cfg.data.eval_size = 100
    cfg.train.prompts_per_step = 1  # evaluation draws no training batches: any training set size will do
    comp = build_components(cfg)
    samples: list[dict] | None = [] if args.samples else None
    for k, v in evaluate(comp, cfg, samples=samples, progress=lambda line: print(line, flush=True)).items():
        print(f"{k}: {v:.4f}")
    if samples is not None:  # --samples: one JSON line per completion, to read what the model answered
        with open(args.samples, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in samples)
        print(f"samples: {args.samples} ({len(samples)} completions)")
    return 0


def _generate(args: argparse.Namespace) -> int:
    cfg = CohortConfig()
    cfg.generation.max_completion_length = args.max_tokens
    cfg.generation.temperature = args.temperature
    device = resolve_device(args.device)
    model, tok = load_policy(args.model, dtype=resolve_dtype("auto", device), device=device)
    encoded = []
    for prompt in args.prompts:
        text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                       add_generation_prompt=True) if tok.chat_template else prompt
        encoded.append(tok(text, add_special_tokens=False)["input_ids"])
    cfg.data.max_prompt_length = max(len(ids) for ids in encoded)  # the engine is sized for these prompts
    limit = prompt_token_limit(cfg, model)
    if limit < cfg.data.max_prompt_length:
        raise ConfigError(f"--max-tokens={args.max_tokens}: a prompt of {cfg.data.max_prompt_length} tokens plus "
                          f"{args.max_tokens} exceeds the model's context; lower --max-tokens or shorten the prompt")
    engine = build_engine(cfg, model, tok, device)
    for ids in encoded:
        params = sampling_params_for(cfg, tok, n=args.n, seed=args.seed)
        for j, c in enumerate(engine.generate([ids], params)[0]):
            print(f"--- [{j}] ({c.finish_reason}, {len(c.token_ids)} tokens)")
            print(tok.decode(c.token_ids, skip_special_tokens=True))
    return 0


def _plot(args: argparse.Namespace) -> int:
    for path in plot_run(args.run_dir):
        print(path)
    return 0


def _bench(args: argparse.Namespace) -> int:
    script = Path(__file__).resolve().parents[2] / "bench" / f"{args.name}.py"
    if not script.is_file():
        raise CohortError(f"bench name={args.name!r}: no {script}; run it from a source checkout "
                          "(bench/ lives in the repository, not the wheel).")
    sys.argv = [str(script), *args.rest]
    runpy.run_path(str(script), run_name="__main__")
    return 0


def _serve(args: argparse.Namespace) -> int:
    return serve(args)


def _serve_arguments(p: argparse.ArgumentParser) -> None:
    """`cohort serve`'s options (cohort.serving.server reads them)."""
    p.add_argument("model", help="a local model folder or hub id (as cohort train's model.name_or_path)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (0: a free one, printed)")
    p.add_argument("--replicas", type=int, default=1, help="engine replicas, one per visible GPU")
    p.add_argument("--device", default="auto", help="auto | cuda | cpu")
    p.add_argument("--dtype", default="auto", help="auto (bfloat16 on GPU, float32 on CPU, as cohort train) | ...")
    p.add_argument("--load-format", default="auto", choices=("auto", "dummy"),
                   help="dummy: random weights from the config (the trainer pushes real ones)")
    p.add_argument("--max-model-len", type=int, default=None, help="prompt + completion limit of the engine")
    p.add_argument("--kv-cache-fraction", type=float, default=0.8, help="share of free memory for the KV cache")
    p.add_argument("--max-num-seqs", type=int, default=256, help="sequences decoded together")
    p.add_argument("--engine", default="auto", choices=("auto", "cohort", "hf"))
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--served-model-name", default=None, help="the name /v1 endpoints answer to (default: MODEL)")
    p.add_argument("--group-timeout-s", type=float, default=120.0,
                   help="longest a weight-group collective may wait for the trainer")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="the key every request must send as 'Authorization: Bearer KEY' (default: $COHORT_API_KEY, "
                   "else one generated and printed at start; prefer the variable, a command line is visible to "
                   "other users); 'none' turns authentication off (a local experiment only)")
    p.add_argument("--session-timeout-s", type=float, default=300.0,
                   help="a conversation kept between turns (session_id) unused this long is freed (default 300)")
    p.add_argument("--max-sessions", type=int, default=64,
                   help="most conversations kept between turns; beyond it the least recently used is freed")
    p.add_argument("--max-body-mb", type=float, default=16.0, help="largest request body in MiB (larger: 413)")
    p.add_argument("--http-workers", type=int, default=64, help="requests handled at once (threads)")
    p.add_argument("--http-queue", type=int, default=1024,
                   help="connections that may wait for a worker; beyond them a request is answered 503 + Retry-After")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cohort", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train with a YAML recipe and key=value overrides")
    t.add_argument("recipe", nargs="?", help="YAML recipe (default: built-in defaults)")
    t.add_argument("overrides", nargs="*", help="section.field=value")
    t.add_argument("--resume", action="store_true", help="continue from the run directory's last checkpoint")
    t.add_argument("--overwrite", action="store_true", help="replace an existing run directory")
    t.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    t.add_argument("--help-config", nargs="?", const="", metavar="SECTION",
                   help="print every setting (or one section's): key, type, default and help, then exit")
    t.set_defaults(func=_train)
    e = sub.add_parser("eval", help="evaluate a model on a recipe's held-out prompts")
    e.add_argument("recipe", nargs="?")
    e.add_argument("overrides", nargs="*")
    e.add_argument("--samples", metavar="FILE.jsonl", help="also write every prompt, completion and reward here")
    e.set_defaults(func=_eval)
    g = sub.add_parser("generate", help="sample completions for prompts")
    g.add_argument("model")
    g.add_argument("prompts", nargs="+")
    g.add_argument("-n", type=int, default=1)
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--device", default="auto")
    g.set_defaults(func=_generate)
    pl = sub.add_parser("plot", help="write PNG curves of a run's metrics.jsonl")
    pl.add_argument("run_dir")
    pl.set_defaults(func=_plot)
    s = sub.add_parser("serve", help="serve the rollout engine over HTTP: generation on its own GPUs, weights "
                       "pushed by `cohort train` with generation.placement=server (docs/serving.md)")
    _serve_arguments(s)
    s.set_defaults(func=_serve)
    b = sub.add_parser("bench", help="run a benchmark script from bench/ (GPU)")
    b.add_argument("name", help="rollout | grpo_step")
    b.add_argument("rest", nargs=argparse.REMAINDER)
    b.set_defaults(func=_bench)
    return p


# options of train / eval that take a value (the next argument, or --opt=value), and every flag they know
_VALUE_OPTIONS = {"train": (), "eval": ("--samples",)}
_FLAGS = {"train": ("--resume", "--overwrite", "--print-config", "--help-config", "-h", "--help"),
          "eval": ("--samples", "-h", "--help")}


def _check_flag(command: str, flag: str) -> None:
    name = flag.split("=", 1)[0]
    if name not in _FLAGS[command]:
        close = difflib.get_close_matches(name, _FLAGS[command], n=1, cutoff=0.6)
        hint = f"did you mean {close[0]}?" if close else f"{command} takes {', '.join(_FLAGS[command][:-2])}"
        raise ConfigError(f"cohort {command}: unknown flag {flag!r}: {hint} (settings are section.field=value)")


def _argv_with_recipe_fix(argv: list[str]) -> list[str]:
    """`cohort train|eval`: flags may stand anywhere among the overrides (`cohort train r.yaml --resume
    train.max_steps=6`): they are moved in front of the positionals. A first positional holding '=' is an
    override, so `cohort train key=value` works without a recipe."""
    if not argv or argv[0] not in _VALUE_OPTIONS:
        return argv
    flags, positionals, rest = [], [], argv[1:]
    i = 0
    while i < len(rest):
        a = rest[i]
        if a == "--":  # everything after it is positional
            positionals += rest[i + 1:]
            break
        if a == "--help-config" and argv[0] == "train":  # its SECTION is optional: a recipe or override is not one
            section = rest[i + 1] if i + 1 < len(rest) and rest[i + 1].isidentifier() else ""
            flags.append(f"--help-config={section}")
            i += 2 if section else 1
            continue
        if a.startswith("-") and not ("=" in a and not a.startswith("--")):
            _check_flag(argv[0], a)
            flags.append(a)
            if a in _VALUE_OPTIONS[argv[0]] and i + 1 < len(rest):
                flags.append(rest[i + 1])
                i += 1
        else:
            positionals.append(a)
        i += 1
    if positionals and "=" in positionals[0]:
        positionals.insert(0, "")
    return [argv[0], *flags, *positionals]


def _exit_now_if_nccl_aborted() -> None:
    """After an aborted NCCL weight group (a server lost mid-push), leave without the interpreter's teardown,
    which can wait forever on that communicator: exit code 75 (serving.liveness.EXIT_SERVER_LOST)."""
    liveness = sys.modules.get("cohort.remote.liveness")
    if liveness is not None and liveness.nccl_group_aborted():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(liveness.EXIT_SERVER_LOST)


_MAX_ERROR_CHARS = 2000  # an error names a value; a huge one (a pasted dataset, an alias bomb) is cut here


def error_line(exc: BaseException) -> str:
    """`cohort: error: <message>`, the message cut to _MAX_ERROR_CHARS characters."""
    message = str(exc)
    if len(message) > _MAX_ERROR_CHARS:
        message = f"{message[:_MAX_ERROR_CHARS]}... ({len(message) - _MAX_ERROR_CHARS:,} more characters)"
    return f"cohort: error: {message}"


def main(argv: Sequence[str] | None = None) -> int:
    try:
        argv = _argv_with_recipe_fix(list(sys.argv[1:] if argv is None else argv))
    except CohortError as exc:
        print(error_line(exc), file=sys.stderr)
        return 2
    args = build_parser().parse_args(argv)
    if getattr(args, "recipe", None) == "":
        args.recipe = None
    try:
        return int(args.func(args) or 0)
    except CohortError as exc:
        print(error_line(exc), file=sys.stderr)
        _exit_now_if_nccl_aborted()
        return 2
    except KeyboardInterrupt:
        print("cohort: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
