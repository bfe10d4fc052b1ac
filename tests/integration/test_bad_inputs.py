"""The bad-input matrix (issue 14): every case is a `cohort` command line a person could type, and each must end
with exit status 2, one `cohort: error:` line naming the field, the value and the fix (no traceback), no model
loaded where the mistake is visible without one, and no run directory created or changed.

docs/bad_inputs.md is generated from CASES (`python -m tests.integration.test_bad_inputs` rewrites it) and
`test_doc_matches_cases` fails when the two drift apart.
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "bad_inputs.md"


@dataclass(frozen=True)
class Case:
    id: str
    area: str
    args: tuple[str, ...]  # after `cohort train <toy defaults>`; {ws} is the workspace folder, {run} the run dir
    expect: tuple[str, ...]  # fragments of the error: the field, the value and the fix
    loads_model: bool = False  # the mistake only shows once the model (or a reward) has run
    command: str = "train"  # train | eval | raw (args are the whole command line)
    run_dir: str = "none"  # none: no run directory before; run: a finished run; user: a folder of user files
    env: tuple[tuple[str, str], ...] = ()  # environment variables set for the command ({ws} as in args)


C = Case
# YAML's "billion laughs", small: 11 x 11 x 11 x 11 x 11 values from a 200-character override
_LAUGHS = "[&a [x, x, x, x, x, x, x, x, x, x, x], " + ", ".join(
    f"&{x} [{', '.join([f'*{p}'] * 11)}]" for p, x in zip("abc", "bcd")) + ", [" + ", ".join(["*d"] * 11) + "]]"
CASES: list[Case] = [
    # ---- config: ranges, enums, cross-field rules
    C("negative learning rate", "config", ("train.learning_rate=-1e-6",),
      ("train.learning_rate=-1e-06", "use a positive learning rate")),
    C("scale_rewards typo", "config", ("advantage.scale_rewards=grouped",),
      ("advantage.scale_rewards='grouped'", "did you mean 'group'?")),
    C("estimator typo", "config", ("advantage.estimator=rlo",), ("advantage.estimator='rlo'", "did you mean 'rloo'?")),
    C("aggregation typo", "config", ("advantage.multi_objective_aggregation=sum_then_normalise",),
      ("advantage.multi_objective_aggregation='sum_then_normalise'", "did you mean 'sum_then_normalize'?")),
    C("rloo with normalize_then_sum", "config",
      ("advantage.estimator=rloo", "advantage.multi_objective_aggregation=normalize_then_sum"),
      ("advantage.multi_objective_aggregation='normalize_then_sum'", "needs 'sum_then_normalize'")),
    C("negative temperature", "config", ("generation.temperature=-0.5",),
      ("generation.temperature=-0.5", "use 0 (greedy) or more")),
    C("negative top_k", "config", ("generation.top_k=-1",), ("generation.top_k=-1", "use 0 (off)")),
    C("min_p above 1", "config", ("generation.min_p=1.5",), ("generation.min_p=1.5", "use a value in [0, 1]")),
    C("zero repetition penalty", "config", ("generation.repetition_penalty=0",),
      ("generation.repetition_penalty=0.0", "use a positive number")),
    C("top_p zero", "config", ("generation.top_p=0",), ("generation.top_p=0.0", "use a value in (0, 1]")),
    C("one generation per prompt", "config", ("generation.num_generations=1",),
      ("generation.num_generations=1", "use 2 or more")),
    C("mini-batches do not divide", "config", ("train.prompts_per_step=3", "train.mini_batches=2"),
      ("train.mini_batches=2", "divide train.prompts_per_step=3")),
    C("zero steps", "config", ("train.max_steps=0",), ("train.max_steps=0", "use 1 or more")),
    C("zero training time", "config", ("train.max_train_time_s=0",),
      ("train.max_train_time_s=0.0", "use a positive number of seconds")),
    C("adam beta2 of 1", "config", ("train.adam_beta2=1.0",), ("train.adam_beta2=1.0", "use a value in [0, 1)")),
    C("zero gradient clip", "config", ("train.max_grad_norm=0",), ("train.max_grad_norm=0.0", "positive clipping norm")),
    C("negative weight decay", "config", ("train.weight_decay=-0.1",), ("train.weight_decay=-0.1", "use 0 or a positive")),
    C("scheduler typo", "config", ("train.lr_scheduler_type=cosin",),
      ("train.lr_scheduler_type='cosin'", "did you mean 'cosine'?", "use 'constant' or 'cosine'")),
    C("sharding typo", "config", ("train.sharding=fdsp",), ("train.sharding='fdsp'", "did you mean 'fsdp'?")),
    C("unknown device", "config", ("train.device=gpu",), ("train.device='gpu'", "use auto, cpu, cuda")),
    C("dtype typo", "config", ("model.dtype=bf61",), ("model.dtype='bf61'", "did you mean 'bf16'?")),
    C("unknown key", "config", ("train.max_stpes=3",), ("train.max_stpes", "Did you mean 'max_steps'?")),
    C("unknown loss parameter", "config", ("loss.epsilonn=0.3",), ("epsilonn", "epsilon", "loss.<name>=value")),
    C("not a number", "config", ("train.max_steps=abc",), ("train.max_steps='abc'", "give a number")),
    C("truncation side", "config", ("data.truncation=right",), ("data.truncation='right'", "use one of 'left', 'drop'")),
    C("zero prompt length", "config", ("data.max_prompt_length=0",), ("data.max_prompt_length=0", "positive token count")),
    C("context below completion", "config", ("generation.max_model_len=4",),
      ("generation.max_model_len=4", "must exceed the longest completion")),
    C("eval steps without eval data", "config", ("run.eval_steps=5",), ("run.eval_steps=5", "set data.eval_size")),
    C("keep no checkpoint", "config", ("run.save_total_limit=0",), ("run.save_total_limit=0", "keep at least 1")),
    C("negative save interval", "config", ("run.save_steps=-5",), ("run.save_steps=-5", "use 0 (save only at the end)")),
    C("zero eval samples", "config", ("run.eval_num_samples=0",), ("run.eval_num_samples=0", "use 1 (greedy) or more")),
    C("zero eval prompts", "config", ("run.eval_max_prompts=0",), ("run.eval_max_prompts=0", "use a positive number")),
    C("zero eval completion cap", "config", ("run.eval_max_completion_length=0",),
      ("run.eval_max_completion_length=0", "use 1 or more")),
    C("negative eval size", "config", ("data.eval_size=-5",), ("data.eval_size=-5", "use 0 (no held-out split)")),
    C("negative warmup", "config", ("train.warmup_steps=-3",), ("train.warmup_steps=-3", "use 0, a number of")),
    C("zero reward timeout", "config", ("reward.timeout_s=0",), ("reward.timeout_s=0.0", "positive number of seconds")),
    C("report_to typo", "config", ("run.report_to=[jsonll]",), ("run.report_to=['jsonll']", "did you mean 'jsonl'?")),
    C("kv cache fraction above 1", "config", ("generation.kv_cache_fraction=1.5",),
      ("generation.kv_cache_fraction=1.5", "in (0, 1]")),
    C("negative LoRA rank", "config", ("model.lora_r=-4",), ("model.lora_r=-4", "positive LoRA rank")),
    C("4-bit base without LoRA", "config", ("model.quantization=nf4",),
      ("model.quantization='nf4'", "set model.lora_r")),
    C("4-bit base on the CPU", "config", ("model.quantization=nf4", "model.lora_r=16", "train.device=cpu"),
      ("model.quantization='nf4'", "need a CUDA GPU")),
    C("resume and overwrite", "config", ("run.resume=true", "run.overwrite=true"),
      ("run.overwrite=True", "choose one")),
    # ---- data: the source's options, files, columns
    C("option typo (reasoning-gym)", "data", ("data.source=reasoning_gym:chain_sum", "data.options.conversatonal=true"),
      ("data.options.conversatonal=True", "data.source='reasoning_gym:chain_sum'", "did you mean 'conversational'?")),
    C("unknown task setting", "data", ("data.source=reasoning_gym:chain_sum", "data.options.min_term=2"),
      ("data.options.min_term=2", "did you mean 'min_terms'?")),
    C("task settings out of range", "data",
      ("data.source=reasoning_gym:chain_sum", "data.options.min_terms=5", "data.options.max_terms=2"),
      ("data.options=", "max_terms must be >= min_terms", "fix that setting")),
    C("task name typo", "data", ("data.source=reasoning_gym:chain_sun",),
      ("data.source='reasoning_gym:chain_sun'", "did you mean 'reasoning_gym:chain_sum'?")),
    C("option typo (jsonl file)", "data", ("data.options.conversatonal=true",),
      ("data.options.conversatonal=True", "toy.jsonl", "did you mean 'conversational'?")),
    C("option typo (python function)", "data", ("data.source=tests.helpers.toy_task:toy_rows", "data.options.copiez=3"),
      ("data.options.copiez=3", "did you mean 'copies'?")),
    C("option that is a field", "data", ("data.options.prompt_column=question",),
      ("data.options.prompt_column='question'", "set data.prompt_column instead")),
    C("eval options without eval source", "data", ("data.eval_options.size=10",),
      ("data.eval_options={'size': 10}", "set data.eval_source too")),
    C("missing data file", "data", ("data.source=/no/such/prompts.jsonl",),
      ("data.source='/no/such/prompts.jsonl'", "does not exist", "check the path")),
    C("unknown file type", "data", ("data.source={ws}/prompts.txt",), ("prompts.txt", "cohort reads .jsonl")),
    C("broken JSON line", "data", ("data.source={ws}/broken.jsonl",), ("broken.jsonl", "line 2 is not valid JSON")),
    C("empty data file", "data", ("data.source={ws}/empty.jsonl",), ("empty.jsonl", "is empty (0 rows)", "check the path")),
    C("no prompt column", "data", ("data.source={ws}/noprompt.jsonl",),
      ("noprompt.jsonl", "columns found: ['question', 'digit']", "set data.prompt_column=question")),
    C("lone surrogate in a prompt", "data", ("data.source={ws}/surrogate.jsonl",),
      ("surrogate.jsonl", "line 2, column 'prompt', character 5", "lone surrogate", "remove it")),
    C("data file that is not UTF-8", "data", ("data.source={ws}/latin1.jsonl",),
      ("latin1.jsonl", "line 2, column 16 is not UTF-8 (byte 0xe9)", "save the file as UTF-8")),
    C("chat template that raises", "data",
      ("model.chat_template={ws}/no_system.jinja", "data.options.conversational=true", "data.system_prompt=Be brief"),
      ("the chat template of", "raised on row 0", "TemplateError: this template has no system role",
       "drop data.system_prompt"), loads_model=True),
    # ---- rewards
    C("reward name typo", "rewards", ("reward.funcs=[acuracy]",), ("reward.funcs[0]='acuracy'", "did you mean 'accuracy'?")),
    C("reward function missing", "rewards", ("reward.funcs=[tests.helpers.toy_task:digit_shar]",),
      ("reward.funcs[0]='tests.helpers.toy_task:digit_shar'", "has no attribute")),
    C("reward module missing", "rewards", ("reward.funcs=[no_such_pkg.rewards:score]",),
      ("reward.funcs[0]='no_such_pkg.rewards:score'", "Is it on PYTHONPATH?")),
    C("reward setting typo", "rewards", ("reward.funcs=[{soft_overlong_punishment: {max_completion_lenn: 4}}]",),
      ("soft_overlong_punishment.max_completion_lenn=4", "did you mean 'max_completion_length'?")),
    C("no reward function", "rewards", ("reward.funcs=[]",), ("reward.funcs=[]", "give at least one reward function")),
    C("infinite reward weight", "rewards", ("reward.reward_weights=[.inf]",),
      ("reward.reward_weights=[inf]", "use finite numbers")),
    C("one weight too many", "rewards", ("reward.reward_weights=[1.0, 2.0]",),
      ("reward.reward_weights=[1.0, 2.0]", "one weight per reward function")),
    C("reward on_error typo", "rewards", ("reward.on_error=ignore",), ("reward.on_error='ignore'", "use one of 'raise'")),
    C("reward returns too few", "rewards", ("reward.funcs=[tests.helpers.toy_task:wrong_length]",),
      ("wrong_length", "values"), loads_model=True),
    C("reward raises", "rewards", ("reward.funcs=[tests.helpers.toy_task:raises]",),
      ("raises", "reward backend unavailable"), loads_model=True),
    C("reward None for every sample", "rewards", ("reward.funcs=[tests.integration.test_bad_inputs_more:none_for_all]",),
      ("'none_for_all' returned None for all 4 completions", "zero loss", "return a float",
       "0.0 when the function does not apply"), loads_model=True),
    C("reward over its time limit", "rewards",
      ("reward.funcs=[tests.integration.test_bad_inputs_more:sleeps_a_minute]", "reward.timeout_s=0.5"),
      ("'sleeps_a_minute' timed out after 0.5 s", "raise its limit reward.timeout_s"), loads_model=True),
    # ---- model paths and the context
    C("missing model folder", "model", ("model.name_or_path=/no/such/model",),
      ("model.name_or_path='/no/such/model'", "does not exist", "check the path")),
    C("model path is a data file", "model", ("model.name_or_path={ws}/toy.jsonl",),
      ("toy.jsonl", "is a file, not a model folder", "config.json")),
    C("folder without config.json", "model", ("model.name_or_path={ws}/not_a_model",),
      ("not_a_model", "folder without config.json", "Hugging Face model folder")),
    C("missing gguf file", "model", ("model.gguf_file=/no/such/model.gguf",),
      ("model.gguf_file='/no/such/model.gguf'", "does not exist")),
    C("COHORT_CACHE_DIR is a file", "model", ("model.name_or_path={ws}/weights.gguf",),
      ("COHORT_CACHE_DIR=", "toy.jsonl", "is a file, not a folder", "point COHORT_CACHE_DIR at a folder"),
      env=(("COHORT_CACHE_DIR", "{ws}/toy.jsonl"),)),
    C("completion longer than the context", "model", ("generation.max_completion_length=300",),
      ("generation.max_completion_length=300 plus data.max_prompt_length=512", "context of 256 tokens",
       "the largest that fits is 255")),
    C("completion and prompt over the context", "model",
      ("generation.max_completion_length=300", "data.max_prompt_length=64"),
      ("generation.max_completion_length=300 plus data.max_prompt_length=64",
       "exceeds the model's context of 256 tokens (max_position_embeddings)",
       "the largest that fits beside data.max_prompt_length=64 is 192")),
    C("context above the model's", "model", ("generation.max_model_len=512",),
      ("generation.max_model_len=512", "max_position_embeddings) is 256", "use at most 256")),
    C("router replay on a dense model", "model", ("train.router_replay=true",),
      ("train.router_replay=true is not valid", "has no mixture-of-experts layers", "set train.router_replay=false"),
      loads_model=True),
    C("router replay with HF generate", "config", ("train.router_replay=true", "generation.engine=hf"),
      ("train.router_replay=True", "generation.engine=hf (Hugging Face generate) records no routing")),
    C("exact logprob parity with HF generate", "config", ("generation.logprob_parity=exact", "generation.engine=hf"),
      ("generation.logprob_parity='exact' is not valid", "generation.engine='hf'", "generation.logprob_parity=fast")),
    # ---- tools
    C("tool import path", "tools", ("agent.tools=[tests.helpers.toy_task:no_tool]",),
      ("agent.tools[0]='tests.helpers.toy_task:no_tool'", "has no attribute")),
    C("tool parser import path", "tools", ("agent.tool_parser=no_such_pkg:parse",),
      ("agent.tool_parser='no_such_pkg:parse'", "Is it on PYTHONPATH?")),
    # ---- the command line and the run directory
    C("flag typo", "cli", ("--resum",), ("unknown flag '--resum'", "did you mean --resume?")),
    C("missing recipe", "cli", ("train", "{ws}/no_such_recipe.yaml"), ("no_such_recipe.yaml", "does not exist"),
      command="raw"),
    C("recipe is not YAML", "cli", ("train", "{ws}/broken.yaml"), ("broken.yaml", "is not valid YAML"), command="raw"),
    C("recipe is a list", "cli", ("train", "{ws}/list.yaml"), ("list.yaml", "must be a mapping of sections"),
      command="raw"),
    C("recipe is an image", "cli", ("train", "{ws}/picture.yaml"),
      ("picture.yaml", "is not a UTF-8 text file (byte 0x89 at line 1)"), command="raw"),
    C("recipe with NUL bytes", "cli", ("train", "{ws}/nul.yaml"), ("nul.yaml", "is a binary file"), command="raw"),
    C("recipe over 1 MiB", "cli", ("train", "{ws}/huge.yaml"), ("huge.yaml", "over the 1 MiB"), command="raw"),
    C("recipe alias bomb", "cli", ("train", "{ws}/laughs.yaml"),
      ("laughs.yaml", "expands to more than 100,000 values", "aliases"), command="raw"),
    C("override alias bomb", "cli", (f"train.max_steps={_LAUGHS}",),
      ("the override 'train.max_steps' expands to more than 100,000 values", "aliases")),
    C("override without '='", "cli", ("train", "{ws}/ok.yaml", "max_steps"),
      ("'max_steps'", "must look like section.field=value"), command="raw"),
    C("section without field", "cli", ("train=3",), ("'train' names a section", "set one of its fields")),
    C("run directory in use", "cli", (), ("run.output_dir=", "already exists and is not empty", "pass --resume"),
      run_dir="run"),
    C("overwrite a folder that is no run", "cli", ("--overwrite",),
      ("run.overwrite=True refuses to delete", "does not look like a cohort run"), run_dir="user"),
    C("run directory under a file", "cli", ("run.output_dir={ws}/toy.jsonl/run",),
      ("run.output_dir=", "cannot be created", "toy.jsonl' is a file, not a folder", "choose another run.output_dir")),
    C("WORLD_SIZE not a number", "cli", (), ("WORLD_SIZE='two'", "not a whole number", "launch with torchrun"),
      env=(("WORLD_SIZE", "two"),)),
    C("WORLD_SIZE without torchrun", "cli", (),
      ("WORLD_SIZE=2", "MASTER_ADDR and MASTER_PORT are not set", "torchrun --nproc-per-node 2"),
      env=(("WORLD_SIZE", "2"),)),
    C("RANK not a number", "cli", (), ("RANK='first'", "not a whole number"),
      env=(("WORLD_SIZE", "2"), ("RANK", "first"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500"))),
    C("resume from a missing checkpoint", "cli", ("run.resume=/no/such/step-000004",),
      ("run.resume='/no/such/step-000004'", "does not exist", "give a checkpoint folder")),
    C("bad override after --resume", "cli", ("--resume", "train.max_stpes=6"),
      ("train.max_stpes", "Did you mean 'max_steps'?"), run_dir="run"),
    C("eval samples folder missing", "cli", ("--samples", "{ws}/no/such/answers.jsonl"),
      ("--samples=", "its folder does not exist"), command="eval"),
    # ---- cohort serve: the context, before the weights load
    C("serve context above the model's", "serve", ("serve", "{ws}/model", "--max-model-len", "512", "--port", "0"),
      ("--max-model-len=512", "exceeds the model's context of 256 tokens (max_position_embeddings)",
       "the largest that fits is 256"), command="raw"),
    C("serve context over the KV cache", "serve",
      ("serve", "{ws}/model", "--max-model-len", "200", "--kv-cache-fraction", "0.00001", "--port", "0"),
      ("--max-model-len=200", "does not fit the KV cache", "holds 80 tokens", "the largest that fits is 80",
       "raise --kv-cache-fraction"), command="raw"),
]


# ----------------------------------------------------------------------------------------------- the doc
# Cases outside the command line (a served engine's requests, checkpoints on --resume, the run directory, the
# python tool), each run by the test named in its last column; the doc lists them after CASES.
OTHER = [
    ("memory", "`generation.max_completion_length` (with data.max_prompt_length) whose update or one sequence's KV "
     "cache does not fit the GPU by the memory plan's estimate", "`cohort: error:` naming the field, the value and "
     "the largest that fits, before the model loads (a GPU only: on the CPU nothing is checked)",
     "test_bad_inputs_context.py::test_a_completion_over_what_memory_allows_stops_before_the_model_loads"),
    ("serve", "a request without the key, or with a wrong one, on any route (a weight push among them)",
     "401 `invalid_api_key`, one log line; the served weights unchanged",
     "test_serving_security.py::test_a_push_without_the_key_is_refused_and_the_served_tokens_stay"),
    ("serve", "`wait_s` NaN, +-Infinity, negative or not a number", "400 naming `wait_s`, answered at once",
     "test_serving_security.py::test_a_wait_that_is_not_a_finite_positive_number_is_refused_at_once"),
    ("serve", "`temperature` NaN/inf/< 0, `top_p` outside (0, 1], `min_p` outside [0, 1], `top_k` < 0, "
     "`repetition_penalty` <= 0, `n` or `max_tokens` out of range", "400 naming the field, the value and the fix",
     "test_serving_security.py::test_each_out_of_range_sampling_field_is_a_400_naming_it"),
    ("serve", "token ids outside the vocabulary, an empty prompt, prompt + max_tokens over the context",
     "400 naming the field", "test_serving_security.py::test_token_ids_outside_the_vocabulary_and_prompts_beyond_the_context_are_a_400"),
    ("serve", "Content-Length huge / negative / not a number / missing; a body over `--max-body-mb`",
     "413 / 400 / 411 before the body is read", "test_serving_security.py::test_a_bad_content_length_is_refused_before_the_body_is_read"),
    ("serve", "500 concurrent requests", "every one answered (200, or 503 with Retry-After), none reset",
     "test_serving_security.py::test_500_concurrent_clients_are_all_answered_none_reset"),
    ("checkpoint", "a file planted in a checkpoint (`dcp/.metadata`, `optimizer.pt`, an extra file)",
     "`CheckpointError` naming the file before anything is unpickled",
     "test_checkpoint_security.py (planted pickles leave no marker)"),
    ("checkpoint", "a changed byte, a missing `optimizer.pt` (not saved with run.save_only_model), no manifest",
     "`CheckpointError` naming the file and the fix", "test_checkpoint_security.py"),
    ("checkpoint", "a malformed field in trainer_state.json", "one line naming the field and its value",
     "test_checkpoint_security.py"),
    ("run dir", "a second run on an output directory in use", "one line naming the holder's pid and host",
     "test_checkpoint_security.py (the lock)"),
    ("tool", "model-written code that calls setsid(), forks 200 times, reads /proc/<trainer>/environ, kills "
     "the trainer or opens a socket", "contained (bubblewrap mode); the fallback's limits in docs/agents.md",
     "test_tool_sandbox.py"),
]


def render_doc() -> str:
    lines = [
        f"# Bad inputs: what cohort says ({len(CASES) + len(OTHER)} cases, each one run by the tests)",
        "",
        "Every row is a command a person could type; each ends with exit status 2 and one `cohort: error:` line",
        "that names the field, the value and the fix, without a traceback, and leaves no run directory created",
        "or changed. Rows marked *model* fail after the (tiny) model loads, because the mistake shows only then;",
        "every other row fails before any model, data or run directory is touched.",
        "",
        "Generated from `CASES` in `tests/integration/test_bad_inputs.py` (`python -m tests.integration.test_bad_inputs`",
        "rewrites this file; `test_doc_matches_cases` fails when they differ). The toy defaults every `train` row",
        "starts from: a tiny model folder, `data.source=<ws>/toy.jsonl`, 2 steps of 2 prompts x 2 completions.",
        "A row that starts with `NAME=value` runs the command with that environment variable set (and the",
        "torchrun variables and `COHORT_CACHE_DIR` unset otherwise).",
        "",
        "| # | area | input | the message names | when |",
        "|---|---|---|---|---|",
    ]
    for i, c in enumerate(CASES, 1):
        head = {"train": "cohort train ", "eval": "cohort eval ", "raw": "cohort "}[c.command]
        shown = " ".join(a.replace("{ws}", "<ws>") for a in c.args)
        head = "".join(f"{k}={v.replace('{ws}', '<ws>')} " for k, v in c.env) + head
        if c.run_dir != "none":
            shown += f"  (run.output_dir: {'an earlier run' if c.run_dir == 'run' else 'a folder of user files'})"
        expect = "; ".join(f"`{e}`" for e in c.expect).replace("|", "\\|")
        cell = f"`{head}{shown}`".replace("|", "\\|")
        lines.append(f"| {i} | {c.area} | {cell} | {expect} | {'model' if c.loads_model else 'before any work'} |")
    lines += ["", "## Outside the command line", "", "| # | area | input | what happens | the test |", "|---|---|---|---|---|"]
    for i, (area, what, outcome, test) in enumerate(OTHER, len(CASES) + 1):
        lines.append(f"| {i} | {area} | {what} | {outcome} | `{test}` |")
    return "\n".join(lines) + "\n"


def test_doc_matches_cases():
    assert DOC.is_file() and DOC.read_text() == render_doc(), (
        "docs/bad_inputs.md is out of date: run `python -m tests.integration.test_bad_inputs`")


def test_matrix_is_large_and_unique():
    assert len(CASES) >= 40
    assert len({c.id for c in CASES}) == len(CASES)
    assert {c.area for c in CASES} >= {"config", "data", "rewards", "model", "tools", "cli"}


# ----------------------------------------------------------------------------------------- the fixture
@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    from tests.helpers.toy_task import write_toy_workspace

    root = tmp_path_factory.mktemp("bad")
    model_dir, toy = write_toy_workspace(root)
    (root / "prompts.txt").write_text("What is 2 + 2?\n")
    (root / "broken.jsonl").write_text('{"prompt": "Say 1", "digit": "1"}\n{"prompt": "Say 2", "digit": \n')
    (root / "empty.jsonl").write_text("")
    (root / "noprompt.jsonl").write_text(json.dumps({"question": "hi", "digit": "1"}) + "\n")
    (root / "not_a_model").mkdir()
    (root / "not_a_model" / "notes.txt").write_text("weights are elsewhere")
    (root / "broken.yaml").write_text("train: {max_steps: 3\n")
    (root / "list.yaml").write_text("- train\n- data\n")
    (root / "surrogate.jsonl").write_text('{"prompt": "Say 1", "digit": "1"}\n{"prompt": "Say \\ud800 2", "digit": "2"}\n')
    (root / "latin1.jsonl").write_bytes(b'{"prompt": "Say 1", "digit": "1"}\n{"prompt": "caf\xe9 2", "digit": "2"}\n')
    (root / "no_system.jinja").write_text(
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('this template has no system role') }}"
        "{% endif %}{{ m['content'] }}\n{% endfor %}")
    (root / "weights.gguf").write_bytes(b"GGUF" + bytes(60))
    (root / "picture.yaml").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)))
    (root / "nul.yaml").write_bytes(b"train:\n  max_steps: 3\x00\n")
    (root / "huge.yaml").write_text("train: {max_steps: 0}\n" + ("# " + "x" * 98 + "\n") * 11_000)
    laughs = ["a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    laughs += [f"{x}: &{x} [{', '.join([f'*{p}'] * 9)}]" for p, x in zip("abcdefgh", "bcdefghi")]
    (root / "laughs.yaml").write_text("\n".join(laughs) + "\n")
    (root / "ok.yaml").write_text(f"model:\n  name_or_path: {model_dir}\ndata:\n  source: {toy}\n")
    # an earlier run's files (config, metrics, a checkpoint), to check that a refused command leaves them
    # byte for byte as they were (tests/integration/test_cli_errors.py trains and resumes for real)
    earlier = root / "earlier_run"
    step = earlier / "checkpoints" / "step-000002"
    step.mkdir(parents=True)
    (step / "trainer_state.json").write_text(json.dumps({"step": 2}))
    (earlier / "checkpoints" / "latest").write_text("step-000002")
    (earlier / "config.yaml").write_text("train:\n  max_steps: 2\n")
    (earlier / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    user = root / "user_files"
    user.mkdir()
    (user / "thesis.tex").write_text("do not delete")
    import reasoning_gym.factory  # noqa: F401  (imports paid once, not by the first case that needs them)

    import cohort.setup  # noqa: F401

    return {"root": root, "model": model_dir, "toy": toy, "run": earlier, "user": user}


def _defaults(model_dir, toy, out) -> list[str]:
    return [f"model.name_or_path={model_dir}", f"data.source={toy}", "reward.funcs=[tests.helpers.toy_task:digit_share]",
            "train.max_steps=2", "train.prompts_per_step=2", "generation.num_generations=2",
            "generation.max_completion_length=4", f"run.output_dir={out}", "run.report_to=[jsonl]"]


def _snapshot(path: Path) -> dict[str, str] | None:
    if not path.exists():
        return None
    return {str(p.relative_to(path)): (hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir")
            + f":{p.stat().st_mtime_ns}" for p in sorted(path.rglob("*"))}


_ENV = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "COHORT_CACHE_DIR")  # cleared per case


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case: Case, workspace, tmp_path, capsys, monkeypatch):
    from cohort.cli import main
    from cohort.policy import model as policy_model
    from cohort.setup import policy as setup_policy

    loads, reads = [], []
    real_load = setup_policy.load_policy
    monkeypatch.setattr(setup_policy, "load_policy", lambda *a, **k: loads.append(a) or real_load(*a, **k))
    real_read = policy_model._from_pretrained  # every tokenizer or model read from a checkpoint, by any caller
    monkeypatch.setattr(policy_model, "_from_pretrained",
                        lambda loader, path, what, **k: reads.append(what) or real_read(loader, path, what, **k))
    out = {"none": tmp_path / "run", "run": workspace["run"], "user": workspace["user"]}[case.run_dir]
    before = _snapshot(out)
    for name in _ENV:
        monkeypatch.delenv(name, raising=False)
    for name, value in case.env:
        monkeypatch.setenv(name, value.replace("{ws}", str(workspace["root"])))
    args = [a.replace("{ws}", str(workspace["root"])) for a in case.args]
    if case.command == "train":
        argv = ["train", *_defaults(workspace["model"], workspace["toy"], out), *args]
    elif case.command == "eval":
        argv = ["eval", f"model.name_or_path={workspace['model']}", f"data.source={workspace['toy']}", *args]
    else:
        argv = args
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert "cohort: error:" in err and "Traceback" not in err, err
    message = err[err.index("cohort: error:"):]  # a model load may print a progress bar before it
    assert message.count("\n") == 1, f"one line expected: {message}"
    for fragment in case.expect:
        assert fragment in message, (fragment, message)
    assert _snapshot(out) == before, f"{case.id}: the run directory {out} was created or changed"
    assert bool(loads) == case.loads_model, f"{case.id}: model loaded: {bool(loads)}"
    if not case.loads_model:  # failed before the slow part: nothing at all read from the checkpoint
        assert reads == [], f"{case.id}: read before failing: {reads}"


if __name__ == "__main__":
    DOC.write_text(render_doc())
    print(f"wrote {DOC} ({len(CASES)} cases)", file=sys.stderr)


# ------------------------------------------------------------------------- the CLI a person expects
def test_flags_anywhere_among_the_overrides():
    from cohort.cli import _argv_with_recipe_fix, build_parser

    for argv in (["train", "r.yaml", "--resume", "train.max_steps=6"],
                 ["train", "--resume", "r.yaml", "train.max_steps=6"],
                 ["train", "r.yaml", "train.max_steps=6", "--resume"]):
        args = build_parser().parse_args(_argv_with_recipe_fix(argv))
        assert (args.recipe, args.overrides, args.resume) == ("r.yaml", ["train.max_steps=6"], True), argv
    args = build_parser().parse_args(_argv_with_recipe_fix(["train", "train.max_steps=6", "--overwrite"]))
    assert (args.recipe, args.overrides, args.overwrite) == ("", ["train.max_steps=6"], True)
    args = build_parser().parse_args(_argv_with_recipe_fix(["eval", "r.yaml", "--samples", "a.jsonl", "x.y=1"]))
    assert (args.recipe, args.overrides, args.samples) == ("r.yaml", ["x.y=1"], "a.jsonl")


def test_ctrl_c_names_the_checkpoint_and_the_command_that_continues(workspace, tmp_path, capsys, monkeypatch):
    import shlex

    from cohort import trainer
    from cohort.cli import main

    out = tmp_path / "run"
    recipe = workspace["root"] / "ok.yaml"
    overrides = [a for a in _defaults(workspace["model"], workspace["toy"], out) if not a.startswith(("model.", "data."))]
    overrides = [a.replace("train.max_steps=2", "train.max_steps=3") for a in overrides] + ["run.save_steps=1"]
    real_step = trainer._step

    def interrupted_at_2(cfg, comp, sampler, updater, step, *rest, **kw):
        if step == 2:
            raise KeyboardInterrupt
        return real_step(cfg, comp, sampler, updater, step, *rest, **kw)

    monkeypatch.setattr(trainer, "_step", interrupted_at_2)
    assert main(["train", str(recipe), *overrides]) == 130
    err = capsys.readouterr().err
    assert "step-000001" in err, err
    command = err.strip().splitlines()[-1].strip()
    assert command == f"cohort train {shlex.quote(str(recipe))} {' '.join(map(shlex.quote, overrides))} --resume"
    monkeypatch.setattr(trainer, "_step", real_step)
    assert main(shlex.split(command)[1:]) == 0, capsys.readouterr().err
    assert (out / "checkpoints" / "step-000003").is_dir()


def test_ctrl_c_before_any_checkpoint_says_so(workspace, tmp_path, capsys, monkeypatch):
    from cohort import trainer
    from cohort.cli import main

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(trainer, "train", interrupted)
    out = tmp_path / "run"
    assert main(["train", *_defaults(workspace["model"], workspace["toy"], out)]) == 130
    err = capsys.readouterr().err
    assert "interrupted before the first checkpoint" in err and "--resume" not in err, err
    assert err.strip().splitlines()[-1].strip().startswith("cohort train model.name_or_path=")


@pytest.mark.parametrize("truncation", ["left", "drop"])
def test_prompts_longer_than_the_context_are_cut_before_training(workspace, tmp_path, truncation):
    """A prompt that cannot fit beside max_completion_length in generation.max_model_len is truncated or dropped
    by the data stage (counted), the engine is sized within the limit, and training runs: no traceback mid-run."""
    from cohort.config import load_config
    from cohort.setup import build_components
    from cohort.trainer import train

    rows = [{"prompt": f"Say the digit {d} many times", "digit": str(d)} for d in range(10)] * 2
    rows.append({"prompt": "Say the digit 7 " + "and again " * 200, "digit": "7"})
    data = tmp_path / "long.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    overrides = [*_defaults(workspace["model"], data, tmp_path / "run"), "data.max_prompt_length=8000",
                 "generation.max_model_len=64", f"data.truncation={truncation}", "train.max_steps=1"]
    cfg = load_config(None, overrides)
    lines: list[str] = []
    comp = build_components(cfg, echo=lines.append)
    assert any("prompts capped at 60 tokens" in line for line in lines), lines
    assert max(len(ids) for ids in comp.train_data.prompt_ids) <= 60
    stats = comp.train_data.stats
    assert (stats.num_truncated, stats.num_dropped) == ((1, 0) if truncation == "left" else (0, 1))
    assert len(comp.train_data) == (21 if truncation == "left" else 20)
    engine_len = getattr(getattr(comp.engine, "config", None), "max_model_len", None)
    assert engine_len in (None, 64)
    result = train(cfg, comp, echo=lambda *a, **k: None)
    assert result.history and result.history[0]["data/prompts_" + ("truncated" if truncation == "left" else "dropped")] == 1


def test_the_other_cases_name_tests_that_exist():
    """Every row outside the command line names a test file (and test) that exists, so the doc cannot list a
    case nobody runs."""
    for _, _, _, test in OTHER:
        file, _, name = test.split(" ")[0].partition("::")
        path = ROOT / "tests" / "integration" / file
        assert path.is_file(), test
        assert not name or f"def {name}(" in path.read_text(), test
