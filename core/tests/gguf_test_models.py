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


def copy_gguf_tokenizer(writer, source: str) -> None:
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


def write_tiny_qwen3moe_gguf(
    path: Path, scheme: str = "gguf_q8_0", hidden: int = 256, experts: int = 4, top_k: int = 2, width: int = 256,
    layers: int = 2, heads: int = 4, kv_heads: int = 2, vocab: int = 512, seed: int = 0,
) -> None:  # fmt: skip
    """A seeded random ``qwen3moe`` GGUF as llama.cpp writes one: per layer a float32 router and stacked
    experts (``ffn_{gate,up,down}_exps``, ``[experts, out, in]``) of ``scheme`` blocks, attention in ``scheme``,
    per-head q/k norms; a placeholder token list (tests pass a real tokenizer)."""
    import gguf

    head_dim = hidden // heads
    writer = gguf.GGUFWriter(str(path), "qwen3moe")
    writer.add_block_count(layers)
    writer.add_context_length(256)
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
    writer.add_token_list([f"t{i}".encode() for i in range(vocab)])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    gen = np.random.default_rng(seed)
    seeds = iter(range(seed, seed + 10_000))
    qtype = gguf.GGMLQuantizationType[scheme[5:].upper()]

    def blocks(out: int, width_in: int) -> np.ndarray:
        return make_quantized_weight(scheme, out, width_in, seed=next(seeds)).data.numpy()

    def vector(name: str, size: int) -> None:
        writer.add_tensor(name, (1.0 + 0.1 * gen.standard_normal(size)).astype(np.float32))

    writer.add_tensor("token_embd.weight", blocks(vocab, hidden), raw_dtype=qtype)
    writer.add_tensor("output.weight", blocks(vocab, hidden), raw_dtype=qtype)
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
