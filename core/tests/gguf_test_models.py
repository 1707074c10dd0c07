"""Tiny GGUF Llama files with quantized matrices, written with gguf's writer, for loader and model tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from engine_plugin_sdk.quant import make_quantized_weight


def write_tiny_llama_gguf(
    path: Path,
    scheme: str = "gguf_q4_k",
    head_scheme: str = "gguf_q6_k",
    hidden: int = 256,
    intermediate: int = 512,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    vocab: int = 512,
) -> None:
    """A seeded random Llama GGUF whose matrices are ``scheme`` (the lm_head ``head_scheme``), with
    float32 norms; its token list is placeholders (tests pass a real tokenizer and prompts of ids)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(layers)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(intermediate)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_token_list([f"t{i}".encode() for i in range(vocab)])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    gen = np.random.default_rng(0)
    seed = iter(range(1000))

    def matrix(name: str, out: int, width: int, kind: str = scheme) -> None:
        data = make_quantized_weight(kind, out, width, seed=next(seed)).data.numpy()
        writer.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType[kind[5:].upper()])

    def vector(name: str) -> None:
        writer.add_tensor(name, (1.0 + 0.1 * gen.standard_normal(hidden)).astype(np.float32))

    matrix("token_embd.weight", vocab, hidden)
    matrix("output.weight", vocab, hidden, head_scheme)
    vector("output_norm.weight")
    head_dim = hidden // heads
    for i in range(layers):
        p = f"blk.{i}."
        vector(p + "attn_norm.weight")
        vector(p + "ffn_norm.weight")
        matrix(p + "attn_q.weight", heads * head_dim, hidden)
        matrix(p + "attn_k.weight", kv_heads * head_dim, hidden)
        matrix(p + "attn_v.weight", kv_heads * head_dim, hidden)
        matrix(p + "attn_output.weight", hidden, heads * head_dim)
        matrix(p + "ffn_gate.weight", intermediate, hidden)
        matrix(p + "ffn_up.weight", intermediate, hidden)
        matrix(p + "ffn_down.weight", hidden, intermediate)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

