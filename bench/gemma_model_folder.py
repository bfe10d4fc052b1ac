"""Build a Gemma-3-270M model folder from its GGUF where this transformers converts the GGUF's tokenizer
wrongly (5.17 builds a character-level one; cohort.policy.model.convert_gguf refuses it), using tokenizer files
converted by a transformers that does it right (5.24, `bench/stage_gemma.sh` leaves them in .gemma/tok/).

    python3 bench/gemma_model_folder.py OUT_DIR TOKENIZER_DIR

Then: cohort train recipes/gemma3_chain_sum.yaml model.name_or_path=OUT_DIR
The weights come from the GGUF as convert_gguf would load them (dequantized, float32).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch


def main() -> None:
    out, tok = Path(sys.argv[1]), Path(sys.argv[2])
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from cohort.policy.model import default_cache_dir, gemma3_270m_gguf_path

    gguf = gemma3_270m_gguf_path(default_cache_dir())
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # a model loaded from a GGUF is not serialisable: copy its weights into a plain one (as convert_gguf)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name),
                                             dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    model.save_pretrained(out)
    for f in tok.iterdir():
        shutil.copy(f, out / f.name)
    text = "The quick brown fox jumps over the lazy dog."
    ids = AutoTokenizer.from_pretrained(out)(text, add_special_tokens=False)["input_ids"]
    print(f"{out}: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters; '{text}' -> {len(ids)} tokens")


if __name__ == "__main__":
    main()
