"""Multi-LoRA throughput against the base model, side by side in one run.

Three runs of the same requests (prompts of ~60 tokens, ``--tokens`` greedy output tokens each):
``base`` on an engine without LoRA, ``lora-off`` the base requests on an engine with ``enable_lora``,
and ``lora`` the requests spread evenly over ``--adapters`` adapters of rank ``--rank`` on every
projection (q/k/v/o/gate/up/down), ``max_loras`` = the adapter count. Adapters are written here in the
PEFT format with random weights of the model's shapes.

    python benchmarks/lora_throughput.py                          # CPU, the embedded model
    python benchmarks/lora_throughput.py --model DIR --load-format dummy --device cuda --requests 512
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time

MODULES = {
    "self_attn.q_proj": ("hidden", "q"), "self_attn.k_proj": ("hidden", "kv"), "self_attn.v_proj": ("hidden", "kv"),
    "self_attn.o_proj": ("q", "hidden"), "mlp.gate_proj": ("hidden", "inter"), "mlp.up_proj": ("hidden", "inter"),
    "mlp.down_proj": ("inter", "hidden"),
}  # fmt: skip


def write_adapters(config, count: int, rank: int, root: str, scale: float = 0.02, seed: int = 0) -> list[str]:
    """PEFT adapters with random A and B (standard deviation ``scale``) for every layer projection of a
    Llama-shaped ``config``."""
    import torch
    from safetensors.torch import save_file

    sizes = {
        "hidden": config.hidden_size, "inter": config.intermediate_size,
        "q": config.num_heads * config.head_dim, "kv": config.num_kv_heads * config.head_dim,
    }  # fmt: skip
    paths = []
    for index in range(count):
        generator = torch.Generator().manual_seed(seed + index)
        tensors = {}
        for layer in range(config.num_layers):
            for module, (inp, out) in MODULES.items():
                key = f"base_model.model.model.layers.{layer}.{module}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, sizes[inp], generator=generator) * scale
                tensors[f"{key}.lora_B.weight"] = torch.randn(sizes[out], rank, generator=generator) * scale
        path = os.path.join(root, f"adapter{index}")
        os.makedirs(path)
        save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": [m.split(".")[1] for m in MODULES]}, f)
        paths.append(path)
    return paths


def timed(llm, prompts: list[str], tokens: int, loras: list | None) -> tuple[float, int]:
    from engine import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    started = time.perf_counter()
    outs = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
    return time.perf_counter() - started, sum(len(o.outputs[0].token_ids) for o in outs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from engine import LLM
    from engine.lora import LoRARequest

    prompts = [
        f"Request {i}: summarise the history of the printing press in Europe and its effect on science, "
        f"religion and politics, with dates and names where you know them, in about {100 + i} words."
        for i in range(args.requests)
    ]
    common = dict(
        model=args.model, device=args.device, dtype=args.dtype, load_format=args.load_format,
        max_num_seqs=args.max_num_seqs, enable_prefix_caching=False,
    )  # fmt: skip
    base = LLM(**common)
    lora_llm = LLM(**common, enable_lora=True, max_loras=args.adapters, max_lora_rank=args.rank)
    with tempfile.TemporaryDirectory() as root:
        paths = write_adapters(lora_llm.llm_engine.model_config, args.adapters, args.rank, root)
        adapters = [LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(paths)]
        spread = [adapters[i % len(adapters)] for i in range(len(prompts))]
        runs = {"base": (base, None), "lora-off": (lora_llm, None), "lora": (lora_llm, spread)}
        for llm, loras in runs.values():
            timed(llm, prompts[: args.adapters], 4, loras[: args.adapters] if loras else None)  # warm-up
        best: dict[str, float] = {}
        for _ in range(args.repeats):  # interleaved, so drifts of the machine hit every run alike
            for name, (llm, loras) in runs.items():
                seconds, produced = timed(llm, prompts, args.tokens, loras)
                best[name] = max(best.get(name, 0.0), produced / seconds)
    report = {
        "device": args.device, "host": platform.processor() or platform.machine(), "model": args.model or "embedded",
        "requests": args.requests, "tokens": args.tokens, "adapters": args.adapters, "rank": args.rank,
        **{f"{k}_tok_s": round(v, 1) for k, v in best.items()},
        "lora_vs_base": round(best["lora"] / best["base"], 3), "lora_off_vs_base": round(best["lora-off"] / best["base"], 3),
    }  # fmt: skip
    print(json.dumps(report, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
