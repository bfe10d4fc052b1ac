"""Command line: `cohort train | eval | generate | plot | bench`.

    cohort train recipes/default.yaml loss.epsilon=0.3 train.max_steps=50
    cohort eval  recipes/default.yaml model.name_or_path=runs/default/checkpoints/step-000100
    cohort generate smollm2-135m-instruct "What is 12 + 30?"
    cohort plot runs/default

Any CohortError (a bad setting, path, dataset or reward function) prints one clear message and exits with
status 2; it never prints a traceback or leaves a half-written run directory.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from cohort.errors import CohortError, ConfigError


def _train(args: argparse.Namespace) -> int:
    from cohort import distributed
    from cohort.config import dump_config, load_config
    from cohort.trainer import train

    cfg = load_config(args.recipe, args.overrides)
    # torchrun: one process per GPU, data parallel; every collective times out after train.dist_timeout_s
    info = distributed.init_from_env(timeout_s=cfg.train.dist_timeout_s)
    if args.resume:  # continuing a run never wipes it, whatever the recipe says about overwrite
        cfg.run.resume, cfg.run.overwrite = True, False
    if args.overwrite:
        cfg.run.overwrite = True
    if args.print_config:
        if info.is_main:
            print(dump_config(cfg))
        return 0
    result = train(cfg)
    if not info.is_main:  # rank 0 alone reports and writes the run directory (curves included)
        return 0
    if result.stopped_at is not None:
        print(f"stopped at step {result.stopped_at} (time limit); run directory: {result.run_dir}")
        return 0
    if result.eval_before or result.eval_after:
        print("held-out before -> after: " + "  ".join(
            f"{k} {result.eval_before.get(k, float('nan')):.3f} -> {v:.3f}" for k, v in result.eval_after.items()))
    try:
        from cohort.plot import plot_run

        for path in plot_run(result.run_dir):
            print(f"curves: {path}")
    except ImportError:
        print("curves: matplotlib is not installed (pip install matplotlib), skipped; `cohort plot` later")
    print(f"run directory: {result.run_dir}")
    return 0


def _eval(args: argparse.Namespace) -> int:
    from cohort.config import load_config
    from cohort.evaluation import evaluate
    from cohort.setup import build_components

    cfg = load_config(args.recipe, args.overrides)
    if args.samples and not Path(args.samples).resolve().parent.is_dir():  # fail before the evaluation runs
        raise ConfigError(f"--samples={args.samples!r}: its folder does not exist; create it or pass another path")
    if not (cfg.data.eval_source or cfg.data.eval_size):
        cfg.data.eval_size = 100
    cfg.train.prompts_per_step = 1  # evaluation draws no training batches: any training set size will do
    comp = build_components(cfg)
    samples: list[dict] | None = [] if args.samples else None
    for k, v in evaluate(comp, cfg, samples=samples).items():
        print(f"{k}: {v:.4f}")
    if args.samples:  # one JSON line per completion, to read what the model answered
        with open(args.samples, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in samples)
        print(f"samples: {args.samples} ({len(samples)} completions)")
    return 0


def _generate(args: argparse.Namespace) -> int:
    from cohort.config import CohortConfig
    from cohort.model import load_policy
    from cohort.setup import build_engine, resolve_device, resolve_dtype, sampling_params_for

    cfg = CohortConfig()
    cfg.generation.max_completion_length = args.max_tokens
    cfg.generation.temperature = args.temperature
    device = resolve_device(args.device)
    model, tok = load_policy(args.model, dtype=resolve_dtype("auto", device), device=device)
    engine = build_engine(cfg, model, tok, device)
    for prompt in args.prompts:
        text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                       add_generation_prompt=True) if tok.chat_template else prompt
        ids = tok(text, add_special_tokens=False)["input_ids"]
        params = sampling_params_for(cfg, tok, n=args.n, seed=args.seed)
        for j, c in enumerate(engine.generate([ids], params)[0]):
            print(f"--- [{j}] ({c.finish_reason}, {len(c.token_ids)} tokens)")
            print(tok.decode(c.token_ids, skip_special_tokens=True))
    return 0


def _plot(args: argparse.Namespace) -> int:
    from cohort.plot import plot_run

    for path in plot_run(args.run_dir):
        print(path)
    return 0


def _bench(args: argparse.Namespace) -> int:
    import runpy
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "bench" / f"{args.name}.py"
    if not script.is_file():
        raise CohortError(f"bench name={args.name!r}: no {script}; run it from a source checkout "
                          "(bench/ lives in the repository, not the wheel).")
    sys.argv = [str(script), *args.rest]
    runpy.run_path(str(script), run_name="__main__")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cohort", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train with a YAML recipe and key=value overrides")
    t.add_argument("recipe", nargs="?", help="YAML recipe (default: built-in defaults)")
    t.add_argument("overrides", nargs="*", help="section.field=value")
    t.add_argument("--resume", action="store_true", help="continue from the run directory's last checkpoint")
    t.add_argument("--overwrite", action="store_true", help="replace an existing run directory")
    t.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
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
    b = sub.add_parser("bench", help="run a benchmark script from bench/ (GPU)")
    b.add_argument("name", help="rollout | grpo_step")
    b.add_argument("rest", nargs=argparse.REMAINDER)
    b.set_defaults(func=_bench)
    return p


def _argv_with_recipe_fix(argv: list[str]) -> list[str]:
    """Let `cohort train key=value` work without a recipe: a first positional holding '=' is an override."""
    if len(argv) >= 2 and argv[0] in ("train", "eval") and "=" in argv[1] and not argv[1].startswith("-"):
        return [argv[0], "", *argv[1:]]
    return argv


def main(argv: Sequence[str] | None = None) -> int:
    argv = _argv_with_recipe_fix(list(sys.argv[1:] if argv is None else argv))
    args = build_parser().parse_args(argv)
    if getattr(args, "recipe", None) == "":
        args.recipe = None
    try:
        return int(args.func(args) or 0)
    except CohortError as exc:
        print(f"cohort: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("cohort: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
