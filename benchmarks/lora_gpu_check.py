"""Multi-LoRA end to end on a GPU against HF with each adapter merged by hand (no peft needed there).

A tiny random Llama and three adapters (written by ``lora_throughput.write_adapters``, ranks 8/16/4);
a batch mixing the base and the adapters, more adapters than slots, greedy, in float32 (decode steps
through the CUDA graphs). Prints one line per adapter and ``lora gpu check: N mismatches``.

    python benchmarks/lora_gpu_check.py --device cuda
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch
from lora_throughput import MODULES, write_adapters
from tiny_gpu_models import save_tiny


def merged_reference(base_dir: str, adapter_dir: str | None):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    if adapter_dir is None:
        return model
    config = json.load(open(os.path.join(adapter_dir, "adapter_config.json")))
    scale = config["lora_alpha"] / config["r"]
    tensors = load_file(os.path.join(adapter_dir, "adapter_model.safetensors"))
    params = dict(model.named_parameters())
    with torch.no_grad():
        for key, a in tensors.items():
            if ".lora_A." not in key:
                continue
            b = tensors[key.replace(".lora_A.", ".lora_B.")]
            name = key.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
            params[name] += scale * (b.float() @ a.float())
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tokenizer", default=".nvcarry/llama3-8b-dummy", help="a folder holding a HF tokenizer")
    args = parser.parse_args()

    from engine import LLM, SamplingParams
    from engine.lora import LoRARequest

    root = tempfile.mkdtemp()
    base = save_tiny("llama", os.path.join(root, "base"), args.tokenizer, 0)
    llm = LLM(base, device=args.device, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16, max_num_seqs=16)
    shapes = llm.llm_engine.model_config
    adapters = []
    for index, rank in enumerate((8, 16, 4)):
        path = write_adapters(shapes, 1, rank, os.path.join(root, f"r{index}"), scale=0.15, seed=index)[0]
        adapters.append(LoRARequest(f"a{index}", index + 1, path))
    choices = [None, *adapters]
    prompts = ["The capital of France is", "Once upon a time", "1, 2, 3,", "Paged attention stores the key value cache"]
    all_prompts = [p for p in prompts for _ in choices]
    loras = [c for _ in prompts for c in choices]
    outs = llm.generate(all_prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), lora_request=loras, use_tqdm=False)
    refs = {None: merged_reference(base, None)}
    refs.update({a.lora_name: merged_reference(base, a.lora_path) for a in adapters})
    bad = 0
    for out, lora in zip(outs, loras):
        ids = list(out.prompt_token_ids)
        with torch.no_grad():
            gen = refs[None if lora is None else lora.lora_name].generate(
                torch.tensor([ids]), max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0
            )[0, len(ids):].tolist()
        ok = gen == list(out.outputs[0].token_ids)
        bad += not ok
        print(lora.lora_name if lora else "base", "ok" if ok else f"MISMATCH {gen} vs {list(out.outputs[0].token_ids)}")
    print(f"lora gpu check: {bad} mismatches of {len(outs)}; modules {len(MODULES)}")


if __name__ == "__main__":
    main()
