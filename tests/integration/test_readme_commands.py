"""Every `cohort ...` command in README.md's code blocks runs as written and exits 0, on the CPU.

The commands are read from the README itself, so a command added there is tested here. Each runs in-process
(`cohort.cli.main`) in a scratch folder that links to `recipes/`, with a tiny model and the toy task appended
as overrides (the README's own keys win: `model.name_or_path=runs/default/checkpoints/...` stays) and one step
for `train`. `cohort train recipes/default.yaml` itself keeps the recipe's step count (12 tiny steps, a few
seconds), so the README's `eval` command finds the very checkpoint it names (step-000012), and `--resume`
gets one step more to continue with. `cohort generate`'s model is the tiny one too. Skipped, each with its
reason: commands that need a GPU (their recipe and overrides are still resolved with --print-config), a
second process (torchrun, `cohort serve`, a trainer that talks to a server) or a downloaded model.
"""

from __future__ import annotations

import importlib.util
import re
import shlex
import shutil
from pathlib import Path

import pytest
import yaml
from tests.helpers.toy_task import write_toy_workspace

from cohort.cli import main

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
GPU_RECIPES = {
    "recipes/chain_sum_gpu.yaml": "needs a GPU (sized for an H100: 32 prompts x 8 completions, compiled layers)",
    "recipes/gemma3_chain_sum.yaml": "needs a GPU and a downloaded model (Gemma-3-270M from five PyPI packages)",
    "recipes/calculator_agent.yaml": "needs a GPU (sized for an H100: tools, multi-turn, 32 prompts x 8)",
}
BASE_RUN = "cohort train recipes/default.yaml"  # the run the README's resume, eval and plot commands read


def readme_commands(text: str | None = None) -> list[str]:
    """The `cohort` / `torchrun` command lines of README.md's shell code blocks, in order, without duplicates:
    comments dropped, `a && b` split, a trailing `&` and leading VAR=value assignments kept as written."""
    text = README.read_text(encoding="utf-8") if text is None else text
    found: list[str] = []
    for block in re.findall(r"^```(?:bash|sh|shell|console)?\n(.*?)^```", text, flags=re.M | re.S):
        for line in block.splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            for part in line.split("&&"):
                words = shlex.split(part.strip().rstrip("&").strip())
                while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
                    words = words[1:]
                if words and words[0] in ("cohort", "torchrun"):
                    found.append(shlex.join(words))
    return list(dict.fromkeys(found))


COMMANDS = readme_commands()


def skip_reason(words: list[str]) -> str | None:
    if words[0] == "torchrun":
        return "starts several processes (torchrun); tests/integration/test_distributed.py runs the ranks on gloo"
    if words[1] == "serve":
        return "starts a server, a second process (tests/integration/test_serving*.py run it)"
    if "generation.placement=server" in words:
        return "trains against a running `cohort serve`, a second process"
    recipe = words[2] if len(words) > 2 else ""
    return GPU_RECIPES.get(recipe)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny model, the toy data and the overrides that put them in place of the recipe's."""
    model_dir, toy = write_toy_workspace(tmp_path_factory.mktemp("ws"))
    overrides = {"model.name_or_path": str(model_dir), "data.source": str(toy), "data.options": "{}",
                 "reward.funcs": "[tests.helpers.toy_task:digit_share]", "reward.reward_weights": "null",
                 "generation.num_generations": "2", "generation.max_completion_length": "4",
                 "train.prompts_per_step": "2", "data.eval_size": "4", "run.report_to": "[jsonl]"}
    return model_dir, overrides


def tiny_argv(words: list[str], tiny, *, steps: int | None) -> list[str]:
    """The README command's arguments with the tiny set-up appended (its own keys kept as written)."""
    model_dir, overrides = tiny
    args = words[1:]
    if args[0] == "generate":  # the model is its first argument: the tiny one, a few tokens on the CPU
        return ["generate", str(model_dir), *args[2:], "--max-tokens", "4", "--device", "cpu"]
    if args[0] not in ("train", "eval"):
        return args
    given = {a.split("=", 1)[0] for a in args if "=" in a and not a.startswith("-")}
    extra = [f"{k}={v}" for k, v in overrides.items() if k not in given]
    if args[0] == "train" and steps is not None:
        extra.append(f"train.max_steps={steps}")
    return [*args, *extra]


def run(argv: list[str], capsys) -> None:
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 0, f"cohort {shlex.join(argv)} exited {code}:\n{err[-3000:]}"


@pytest.fixture(scope="module")
def base_site(tmp_path_factory, tiny):
    """A scratch folder with recipes/ linked in, where the README's default job ran (tiny, 12 steps)."""
    site = tmp_path_factory.mktemp("site")
    (site / "recipes").symlink_to(ROOT / "recipes")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(site)
        code = main(tiny_argv(shlex.split(BASE_RUN), tiny, steps=None))
    assert code == 0, f"{BASE_RUN} exited {code}"
    return site


def test_the_readme_has_its_commands():
    assert BASE_RUN in COMMANDS
    assert len(COMMANDS) >= 10, COMMANDS
    assert any(c.startswith("cohort eval ") for c in COMMANDS) and any(c.startswith("cohort plot ") for c in COMMANDS)
    assert set(GPU_RECIPES) <= {w for c in COMMANDS for w in shlex.split(c)}, "a GPU recipe left the README"


def test_extraction_handles_the_shell_forms():
    text = "```bash\npip install x && cohort train a.yaml k=1   # comment\nCUDA_VISIBLE_DEVICES=1 cohort serve m &\n```\n"
    assert readme_commands(text) == ["cohort train a.yaml k=1", "cohort serve m"]


@pytest.mark.parametrize("command", COMMANDS)
def test_readme_command_runs(command, tiny, base_site, tmp_path, monkeypatch, capsys):
    words = shlex.split(command)
    reason = skip_reason(words)
    if reason is not None:
        recipe = words[2] if len(words) > 2 and words[1] == "train" else None
        # still: the recipe and overrides resolve (their data sources are reasoning-gym's: checked where it is)
        if recipe is not None and (ROOT / recipe).is_file() and importlib.util.find_spec("reasoning_gym"):
            monkeypatch.chdir(ROOT)
            run([*words[1:], "--print-config"], capsys)
        pytest.skip(reason)
    if words[1] == "plot":
        pytest.importorskip("matplotlib", reason="cohort plot needs matplotlib: pip install matplotlib")
    if command == BASE_RUN:  # ran in base_site (the fixture asserts its exit status)
        assert (base_site / "runs" / "default" / "checkpoints" / "step-000012").is_dir()
        return
    site = tmp_path / "site"
    shutil.copytree(base_site, site, symlinks=True)
    monkeypatch.chdir(site)
    steps = None
    if words[1] == "train":  # --resume: one step past the recipe's own count, which the base run trained
        steps = yaml.safe_load((ROOT / words[2]).read_text())["train"]["max_steps"] + 1 if "--resume" in words else 1
    run(tiny_argv(words, tiny, steps=steps), capsys)
    if "--samples" in words:
        assert (site / words[words.index("--samples") + 1]).stat().st_size > 0
    if words[1] == "plot":
        assert (site / words[2] / "curves.png").stat().st_size > 0
