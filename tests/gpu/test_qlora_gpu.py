"""QLoRA on CUDA (skips without CUDA or bitsandbytes): cohort loads a model folder with model.quantization=nf4, trains
LoRA adapters on the 4-bit base for two steps, and its engine samples with the trainer's weights: on the merged
bf16 copy (the default) or on the 4-bit layers in place, with the KV pool and the copy released during the update
or not, and with a reference model (beta > 0, a frozen copy of the 4-bit policy).

    python3 -m pytest -q tests/gpu/test_qlora_gpu.py     # bitsandbytes from .whl/ (docs/training.md, "QLoRA")
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
bnb = pytest.importorskip("bitsandbytes", reason="needs bitsandbytes: pip install 'cohort-rl[qlora]'")
pytest.importorskip("peft", reason="needs peft (LoRA): pip install peft")

from tests.helpers.engine_checks import nudge_adapters  # noqa: E402
from tests.helpers.tiny_tokenizer import make_tiny_tokenizer  # noqa: E402
from tests.helpers.toy_task import tiny_model, toy_rows  # noqa: E402

from cohort.config import CohortConfig  # noqa: E402
from cohort.data.sources import load_prompt_dataset  # noqa: E402
from cohort.forward.packing import packed_forward_logprobs  # noqa: E402
from cohort.policy.quantized import MergedCopyEngine  # noqa: E402
from cohort.rewards import RewardRunner  # noqa: E402
from cohort.setup import build_components  # noqa: E402
from cohort.trainer import train  # noqa: E402
from cohort.types import SamplingParams  # noqa: E402

pytestmark = pytest.mark.gpu


def _config(tmp_path, folder, mode: str, beta: float, release: bool) -> CohortConfig:
    cfg = CohortConfig()
    cfg.model.name_or_path, cfg.model.quantization = str(folder), "nf4"
    cfg.model.lora_r, cfg.model.lora_alpha = 8, 16
    cfg.data.source, cfg.data.max_prompt_length = toy_rows, 64
    g = cfg.generation
    g.num_generations, g.max_completion_length, g.quantized_engine = 4, 16, mode
    g.release_kv_during_update = release
    cfg.loss.beta = beta
    cfg.train.prompts_per_step, cfg.train.max_steps, cfg.train.learning_rate = 4, 2, 1e-2
    cfg.run.output_dir, cfg.run.report_to = str(tmp_path / "run"), ["jsonl"]
    return cfg


def _mismatch(policy, engine, tok) -> tuple[float, float, float]:
    """(mean, max) |engine logprob - trainer recompute| over sampled tokens, and the mean against the base model
    with the adapters switched off."""
    prompts = [tok(t)["input_ids"] for t in ("Say the digit 3 many times", "Say the digit 7", "hi")]
    groups = engine.generate(prompts, SamplingParams(n=4, max_tokens=16, temperature=1.0, seed=1))
    seqs = [(p, c.token_ids) for p, g in zip(prompts, groups) for c in g]
    sampled = torch.cat([torch.tensor(c.logprobs) for g in groups for c in g])
    with torch.no_grad():
        trainer = packed_forward_logprobs(policy, seqs, compute_entropy=False).logprobs.float().cpu()
        with policy.disable_adapter():
            base = packed_forward_logprobs(policy, seqs, compute_entropy=False).logprobs.float().cpu()
    assert sampled.numel() == trainer.numel() > 0
    diff = (sampled - trainer).abs()
    return diff.mean().item(), diff.max().item(), (base - trainer).abs().mean().item()


@pytest.mark.parametrize("mode, beta, release", [("merged_bf16", 0.0, False), ("merged_bf16", 0.04, True),
                                                 ("4bit", 0.0, False)],
                         ids=["merged", "merged-reference-released", "in-place-4bit"])
def test_two_qlora_steps(tmp_path, mode, beta, release):
    tok = make_tiny_tokenizer()
    folder = tmp_path / "model"
    tiny_model(tok, seed=0).save_pretrained(folder)
    tok.save_pretrained(folder)
    cfg = _config(tmp_path, folder, mode, beta, release)
    data = load_prompt_dataset(toy_rows()).encode(tok, 64)
    # differs within every group, so the advantages and the adapters' gradients are not zero
    rewards = RewardRunner([lambda completions, **kw: [len(c) / 10 for c in completions]])
    comp = build_components(cfg, tokenizer=tok, reward_runner=rewards, train_data=data)
    policy = comp.policy
    four_bit = [m for m in policy.modules() if isinstance(m, bnb.nn.Linear4bit)]  # peft's wrappers are not
    assert len(four_bit) == 7 * policy.get_base_model().config.num_hidden_layers  # every projection is 4-bit
    assert policy.get_input_embeddings().weight.dtype == torch.bfloat16  # the rest stays in model.dtype
    assert isinstance(comp.engine, MergedCopyEngine) == (mode == "merged_bf16")
    assert (comp.reference is not None) == (beta > 0)
    adapters = {n: p.detach().clone() for n, p in policy.named_parameters() if p.requires_grad}
    assert adapters and all("lora_" in n for n in adapters)

    result = train(cfg, comp, echo=print)
    assert len(result.history) == 2 and all(torch.isfinite(torch.tensor(m["loss"])) for m in result.history)
    assert all(not torch.equal(adapters[n], p) for n, p in policy.named_parameters() if p.requires_grad)
    assert all(isinstance(m.weight, bnb.nn.Params4bit) for m in four_bit)  # the base stayed 4-bit

    nudge_adapters(policy)
    comp.engine.sync_weights()  # what the trainer calls after each optimizer step
    mean, worst, base = _mismatch(policy, comp.engine, tok)
    print(f"{mode}: engine vs trainer logprobs mean {mean:.4f} max {worst:.4f}; base model vs trainer {base:.4f}")
    assert mean < 0.03 and worst < 0.5, (mean, worst)
    assert mean < 0.25 * base, (mean, base)  # the sampler has the adapters
