"""Pre-quantized checkpoints written from a float HF folder, in the published on-disk layouts (GPTQ, AWQ,
compressed-tensors, FP8), by round-to-nearest; each writer also returns the float folder of exactly the
weights the quantized one stands for, which HF transformers runs as the reference.

The packings are written here independently of the engine's loader (compressed-tensors through its own
package): a loader that misreads a layout does not match.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable

import numpy as np
import torch
from safetensors.torch import load_file, save_file

#: the layer projections quantized; embeddings, norms and the lm_head stay float, as the tools leave them
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: AWQ's order of eight output columns in a word (nibble k holds column AWQ_PACK_ORDER[k])
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def to_int32(words: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit values (in int64) as the int32 words a checkpoint stores (two's complement)."""
    return torch.from_numpy(words.numpy().astype(np.uint32).view(np.int32).copy())


def pack_words(codes: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """Unsigned codes packed ``32 / bits`` to an int32 word along ``dim``, element k at bits ``k * bits``
    (``order``: element k is the ``order[k]``-th of its run, AWQ)."""
    per = 32 // bits
    codes = codes.to(torch.int64)
    if dim == 0:
        codes = codes.T
    rows, cols = codes.shape
    if cols % per:
        codes = torch.cat([codes, torch.zeros(rows, per - cols % per, dtype=torch.int64)], dim=1)
    runs = codes.reshape(rows, -1, per)
    if order is not None:
        runs = runs[:, :, list(order)]
    words = (runs << (torch.arange(per) * bits)).sum(dim=-1)
    words = to_int32(words)
    return words.T.contiguous() if dim == 0 else words


def rtn_groups(w: torch.Tensor, bits: int, group: int, symmetric: bool, columns: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Round-to-nearest of ``w [out, in]`` with the groups of ``columns`` (stored order): codes in that
    order, fp16-representable scales and integer zeros ``[out, groups]``."""
    stored = w[:, columns].unflatten(1, (-1, group))
    top = 2**bits - 1
    if symmetric:
        zeros = torch.full(stored.shape[:2], 2 ** (bits - 1), dtype=torch.float32)
        scales = stored.abs().amax(-1) / (2 ** (bits - 1) - 1)
    else:
        low, high = stored.amin(-1).clamp(max=0), stored.amax(-1).clamp(min=0)
        scales = (high - low) / top
        zeros = (-low / scales.clamp_min(1e-8)).round().clamp(0, top)
    scales = scales.clamp_min(1e-6).half().float()
    codes = (stored / scales.unsqueeze(-1) + zeros.unsqueeze(-1)).round().clamp(0, top)
    return codes.flatten(1), scales, zeros


def dequantized(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int, columns: torch.Tensor) -> torch.Tensor:
    """The float matrix stored codes stand for, back in input order."""
    stored = (codes - zeros.repeat_interleave(group, 1)) * scales.repeat_interleave(group, 1)
    w = torch.empty_like(stored)
    w[:, columns] = stored
    return w


def _write(plain: str, out: str, reference: str, convert: Callable, quant_config: dict) -> tuple[str, str]:
    """Rewrite ``plain``'s projections with ``convert(name, w) -> (tensors, dequantized w)``."""
    tensors = load_file(os.path.join(plain, "model.safetensors"))
    quantized, floats = {}, {}
    for name, tensor in tensors.items():
        module = name.rsplit(".", 1)[0]
        if name.endswith(".weight") and module.rsplit(".", 1)[-1] in PROJECTIONS:
            parts, weight = convert(module, tensor.float())
            quantized.update(parts)
            floats[name] = weight
        else:
            quantized[name] = tensor
            floats[name] = tensor
    for folder, state in ((out, quantized), (reference, floats)):
        os.makedirs(folder, exist_ok=True)
        for file in os.listdir(plain):
            if file != "model.safetensors":
                shutil.copy(os.path.join(plain, file), folder)
        save_file(state, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = quant_config
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f)
    return out, reference


#: projections that read the same input: GPTQ's act order (columns by their input statistics) is the same for them
SHARED_INPUTS = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}


def write_gptq(plain: str, out: str, reference: str, bits: int, group: int, symmetric: bool, act_order: bool,
               v2: bool = False, seed: int = 0, shared_order: bool = False) -> tuple[str, str]:  # fmt: skip
    """AutoGPTQ / GPTQModel's layout: ``qweight [in * bits / 32, out]`` packed along the input,
    ``qzeros [groups, out * bits / 32]`` (each zero minus one unless ``v2``), fp16 ``scales``, ``g_idx``.
    ``shared_order``: projections of one input (:data:`SHARED_INPUTS`) share their act order, as a real
    quantizer's do; otherwise each draws its own (a harder case for a loader)."""
    gen = torch.Generator().manual_seed(seed)
    orders: dict[str, torch.Tensor] = {}

    def convert(module: str, w: torch.Tensor) -> tuple[dict, torch.Tensor]:
        in_features = w.shape[1]
        g = in_features if group == -1 else group
        parent, name = module.rsplit(".", 1)
        key = f"{parent}.{SHARED_INPUTS[name]}" if shared_order and name in SHARED_INPUTS else module
        if act_order and key not in orders:
            orders[key] = torch.randperm(in_features, generator=gen)
        columns = orders[key] if act_order else torch.arange(in_features)
        codes, scales, zeros = rtn_groups(w, bits, g, symmetric, columns)
        g_idx = torch.empty(in_features, dtype=torch.int32)
        g_idx[columns] = (torch.arange(in_features) // g).to(torch.int32)
        # GPTQ stores codes in input order: the column of input i is the stored position of i
        position = torch.empty(in_features, dtype=torch.int64)
        position[columns] = torch.arange(in_features)
        in_order = codes[:, position]
        stored_zeros = zeros.to(torch.int64) - (0 if v2 else 1)
        parts = {
            module + ".qweight": pack_words(in_order.T, bits, dim=0),
            module + ".qzeros": pack_words(stored_zeros.T & (2**bits - 1), bits, dim=1),
            module + ".scales": scales.T.contiguous().half(),
            module + ".g_idx": g_idx,
        }
        return parts, dequantized(codes, scales, zeros, g, columns)

    config = {"quant_method": "gptq", "bits": bits, "group_size": group, "sym": symmetric, "desc_act": act_order}
    if v2:
        config["checkpoint_format"] = "gptq_v2"
    return _write(plain, out, reference, convert, config)


def write_awq(plain: str, out: str, reference: str, group: int = 64) -> tuple[str, str]:
    """AutoAWQ's GEMM layout: ``qweight [in, out / 8]`` and ``qzeros [groups, out / 8]`` packed along the
    output in AWQ's order, fp16 ``scales [groups, out]``; asymmetric."""

    def convert(module: str, w: torch.Tensor) -> tuple[dict, torch.Tensor]:
        columns = torch.arange(w.shape[1])
        codes, scales, zeros = rtn_groups(w, 4, group, False, columns)
        parts = {
            module + ".qweight": pack_words(codes.T, 4, dim=1, order=AWQ_PACK_ORDER),
            module + ".qzeros": pack_words(zeros.T, 4, dim=1, order=AWQ_PACK_ORDER),
            module + ".scales": scales.T.contiguous().half(),
        }
        return parts, dequantized(codes, scales, zeros, group, columns)

    config = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}
    return _write(plain, out, reference, convert, config)


def _ct_config(fmt: str, weights: dict, activations: dict | None = None) -> dict:
    return {
        "quant_method": "compressed-tensors", "format": fmt, "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": activations}},
    }  # fmt: skip


def write_compressed_w4a16(plain: str, out: str, reference: str, group: int = 32, symmetric: bool = True) -> tuple[str, str]:
    """compressed-tensors ``pack-quantized`` W4A16, packed by the compressed-tensors package itself."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    def convert(module: str, w: torch.Tensor) -> tuple[dict, torch.Tensor]:
        columns = torch.arange(w.shape[1])
        codes, scales, zeros = rtn_groups(w, 4, group, symmetric, columns)
        # the package takes signed codes (unsigned minus 8) and adds the offset back as it packs
        parts = {
            module + ".weight_packed": pack_to_int32((codes - 8).to(torch.int8), 4),
            module + ".weight_scale": scales.half(),
            module + ".weight_shape": torch.tensor(list(w.shape)),
        }
        if not symmetric:
            parts[module + ".weight_zero_point"] = pack_to_int32((zeros - 8).to(torch.int8), 4, packed_dim=0)
        return parts, dequantized(codes, scales, zeros, group, columns)

    weights = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": group, "symmetric": symmetric}
    return _write(plain, out, reference, convert, _ct_config("pack-quantized", weights))


def write_compressed_fp8(plain: str, out: str, reference: str, per_channel: bool) -> tuple[str, str]:
    """compressed-tensors ``float-quantized`` FP8 weights, per-tensor or per-channel scales, with static
    per-tensor input scales (which the engine may ignore: it quantizes activations as they come)."""

    def convert(module: str, w: torch.Tensor) -> tuple[dict, torch.Tensor]:
        amax = w.abs().amax(dim=1, keepdim=True) if per_channel else w.abs().amax().reshape(1)
        scale = (amax / 448.0).float()
        data = (w / scale.reshape(-1, 1) if per_channel else w / scale).to(torch.float8_e4m3fn)
        weight = data.float() * (scale.reshape(-1, 1) if per_channel else scale)
        parts = {module + ".weight": data, module + ".weight_scale": scale, module + ".input_scale": torch.tensor([0.02])}
        return parts, weight

    weights = {"num_bits": 8, "type": "float", "strategy": "channel" if per_channel else "tensor", "symmetric": True}
    activations = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}
    return _write(plain, out, reference, convert, _ct_config("float-quantized", weights, activations))


def write_compressed_int8(plain: str, out: str, reference: str) -> tuple[str, str]:
    """compressed-tensors ``int-quantized`` INT8 W8A8: per-channel symmetric weights, dynamic activations."""

    def convert(module: str, w: torch.Tensor) -> tuple[dict, torch.Tensor]:
        scale = (w.abs().amax(dim=1, keepdim=True) / 127.0).half().float()
        data = (w / scale).round().clamp(-128, 127).to(torch.int8)
        return {module + ".weight": data, module + ".weight_scale": scale.half()}, data.float() * scale

    weights = {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True}
    activations = {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}
    return _write(plain, out, reference, convert, _ct_config("int-quantized", weights, activations))


def write_fp8(plain: str, out: str, reference: str, block: int | None = None) -> tuple[str, str]:
    """An FP8 checkpoint (``quant_method: fp8``): per-tensor ``weight_scale``, or DeepSeek-style block-wise
    ``weight_scale_inv`` of ``block x block`` tiles."""

    def convert(module: str, w: torch.Tensor) -> tuple[dict, torch.Tensor]:
        if block is None:
            scale = (w.abs().amax() / 448.0).reshape(())
            data = (w / scale).to(torch.float8_e4m3fn)
            return {module + ".weight": data, module + ".weight_scale": scale}, data.float() * scale
        tiles = w.unflatten(0, (-1, block)).unflatten(2, (-1, block))  # [rb, block, cb, block]
        scale = tiles.abs().amax(dim=(1, 3)) / 448.0
        full = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)
        data = (w / full).to(torch.float8_e4m3fn)
        return {module + ".weight": data, module + ".weight_scale_inv": scale}, data.float() * full

    config = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    if block is not None:
        config["weight_block_size"] = [block, block]
    return _write(plain, out, reference, convert, config)
