"""Seeded random GGUF files of real layouts, for tests and benchmarks: quantized blocks drawn by
:func:`engine_plugin_sdk.quant.make_quantized_weight`, tensors named and stacked as llama.cpp writes them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from engine_plugin_sdk.quant import make_quantized_weight


def write_qwen3moe_gguf(
    path: str | Path, scheme: str = "gguf_q8_0", hidden: int = 256, experts: int = 4, top_k: int = 2, width: int = 256,
    layers: int = 2, heads: int = 4, kv_heads: int = 2, vocab: int = 512, seed: int = 0,
    embed_scheme: str | None = None, head_scheme: str | None = None, tokenizer_from: str | None = None,
) -> None:  # fmt: skip
    """A seeded random ``qwen3moe`` GGUF as llama.cpp writes one: per layer a float32 router and stacked
    experts (``ffn_{gate,up,down}_exps``, ``[experts, out, in]``) of ``scheme`` blocks, attention in ``scheme``,
    per-head q/k norms; the embedding and the head in ``embed_scheme`` / ``head_scheme`` (default ``scheme``);
    the tokenizer of the GGUF ``tokenizer_from`` (``vocab`` must be its size), else a placeholder token list
    (tests pass a real tokenizer)."""
    import gguf

    head_dim = hidden // heads
    writer = gguf.GGUFWriter(str(path), "qwen3moe")
    writer.add_block_count(layers)
    writer.add_context_length(4096)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(width * 2)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(1000000.0)
    writer.add_expert_count(experts)
    writer.add_expert_used_count(top_k)
    writer.add_expert_feed_forward_length(width)
    if tokenizer_from is not None:
        copy_gguf_tokenizer(writer, tokenizer_from)
    else:
        writer.add_token_list([f"t{i}".encode() for i in range(vocab)])
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
    gen = np.random.default_rng(seed)
    seeds = iter(range(seed, seed + 10_000))
    qtype = gguf.GGMLQuantizationType[scheme[5:].upper()]

    def blocks(out: int, width_in: int, kind: str = scheme) -> np.ndarray:
        return make_quantized_weight(kind, out, width_in, seed=next(seeds)).data.numpy()

    def gguf_type(kind: str) -> gguf.GGMLQuantizationType:
        return gguf.GGMLQuantizationType[kind[5:].upper()]

    def vector(name: str, size: int) -> None:
        writer.add_tensor(name, (1.0 + 0.1 * gen.standard_normal(size)).astype(np.float32))

    for name, kind in (("token_embd.weight", embed_scheme or scheme), ("output.weight", head_scheme or scheme)):
        writer.add_tensor(name, blocks(vocab, hidden, kind), raw_dtype=gguf_type(kind))
    vector("output_norm.weight", hidden)
    for i in range(layers):
        p = f"blk.{i}."
        for name in ("attn_norm", "ffn_norm"):
            vector(p + name + ".weight", hidden)
        for name in ("attn_q_norm", "attn_k_norm"):
            vector(p + name + ".weight", head_dim)
        for name, out, width_in in (("attn_q", heads * head_dim, hidden), ("attn_k", kv_heads * head_dim, hidden),
                                    ("attn_v", kv_heads * head_dim, hidden), ("attn_output", hidden, heads * head_dim)):
            writer.add_tensor(p + name + ".weight", blocks(out, width_in), raw_dtype=qtype)
        # routers wide enough that the chosen experts are clear of ties
        writer.add_tensor(p + "ffn_gate_inp.weight", (0.5 * gen.standard_normal((experts, hidden))).astype(np.float32))
        for name, out, width_in in (("ffn_gate_exps", width, hidden), ("ffn_up_exps", width, hidden), ("ffn_down_exps", hidden, width)):
            writer.add_tensor(p + name + ".weight", np.stack([blocks(out, width_in) for _ in range(experts)]), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def copy_gguf_tokenizer(writer: Any, source: str) -> None:
    """Write ``source``'s tokenizer (its ``tokenizer.ggml.*`` keys: a BPE vocabulary, merges, token types and
    special ids) into ``writer``'s file."""
    from gguf import GGUFReader

    fields = GGUFReader(source).fields

    def value(key: str):
        return fields[key].contents()

    writer.add_tokenizer_model(value("tokenizer.ggml.model"))
    writer.add_tokenizer_pre(value("tokenizer.ggml.pre"))
    writer.add_token_list(value("tokenizer.ggml.tokens"))
    writer.add_token_types(value("tokenizer.ggml.token_type"))
    writer.add_token_merges(value("tokenizer.ggml.merges"))
    writer.add_bos_token_id(value("tokenizer.ggml.bos_token_id"))
    writer.add_eos_token_id(value("tokenizer.ggml.eos_token_id"))

