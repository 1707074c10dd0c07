"""The packed forms the GPU GEMM keeps grouped-integer weights in: one weight (:class:`GroupedIntWeight`), and a fused
projection's row blocks in different forms joined (:class:`GroupedIntRowBlocks`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class GroupedIntWeight:
    """A grouped-integer weight (``int4_grouped`` / ``int8_grouped``, or a GGUF type repacked exactly into
    that form) in the layout of the Triton weight-only GEMM and GEMV
    (:func:`~engine_plugin_sdk.gpu.triton_kernels.grouped_int_packing.pack_grouped_codes` says it).

    Stored column ``j`` of row ``o`` is ``code * scale - zero_scale`` of its group, or
    ``(code - zero_point) * scale`` when ``zero_scales`` is None.

    6-bit codes (8-bit ones that all fit 6 bits: GGUF's Q6_K) are their low nibbles in the 4-bit layout over
    blocks of 32 columns plus a plane of their high two bits, ``high_bits`` ``[out, in / 4]``: 8 bytes a block,
    ``A`` then ``B``, byte ``k`` of ``A`` holding in bits ``2i, 2i + 1`` the high bits of the block's column ``4 i +
    k`` and ``B`` those of column ``16 + 4 i + k`` (so that ``(A >> 2i) & 0x03030303`` are the high bits of the
    four columns whose low nibbles word ``i`` of the block's codes holds).

    Attributes:
        codes: uint8 row-major codes, ``[out, in]`` (8-bit) or ``[out, in / 2]`` (4-bit, paired within
            each ``block_k`` columns; 6-bit: their low nibbles so).
        scales: ``[out, groups]``, float16 where that holds every scale exactly, else float32.
        zero_scales: ``[out, groups]`` (``zeros * scales``, same dtype rule), or None for one zero point.
        perm: int32 ``[in]`` act-order (stored column ``j`` multiplies input feature ``perm[j]``), or None.
        bits: 4, 6 or 8.
        group_size: columns per group.
        block_k: the kernels' reduction sub-block, fixed by the 4-bit pairing.
        shape: ``(out_features, in_features)``.
        zero_point: every group's zero point in code units, when ``zero_scales`` is None.
        sub_groups: GGUF's K-quants kept in their two-level form: groups per super-block (0: none). ``scales``
            (and ``zero_scales``) are then small integers (uint8 / int8) to multiply by their super-block's
            ``super_scales`` (``super_zero_scales``) ``[out, groups / sub_groups]`` (:mod:`~engine_plugin_sdk.gpu.triton_kernels.grouped_int_params`).
        super_scales: see ``sub_groups``.
        super_zero_scales: see ``sub_groups``.
        high_bits: 6-bit codes' plane of high bits (see above), or None.
        program_params: copies of the group parameters in the one-row GEMV's program order, by ``(rows a
            program, gated)``, built on first use where the tiles ask for them
            (:mod:`~engine_plugin_sdk.gpu.triton_kernels.grouped_int_program_params`).
    """

    codes: torch.Tensor
    scales: torch.Tensor
    zero_scales: torch.Tensor | None
    perm: torch.Tensor | None
    bits: int
    group_size: int
    block_k: int
    shape: tuple[int, int]
    zero_point: int = 0
    sub_groups: int = 0
    super_scales: torch.Tensor | None = None
    super_zero_scales: torch.Tensor | None = None
    high_bits: torch.Tensor | None = None
    program_params: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def nbytes(self) -> int:
        """Device bytes of the packed weight (what one product streams)."""
        parts = (
            self.codes, self.scales, self.zero_scales, self.perm, self.super_scales, self.super_zero_scales,
            self.high_bits,
        )  # fmt: skip
        return sum(t.numel() * t.element_size() for t in parts if t is not None)


@dataclass(frozen=True, slots=True)
class GroupedIntRowBlocks:
    """A projection's row blocks in different grouped-integer forms, joined into one weight
    (:meth:`~engine_plugin_sdk.gpu.gemm.TorchGemmBackend.join_row_blocks`): GGUF Q4_K_M's q / k in Q4_K over v in
    Q6_K. Its product is one ``[..., sum(rows)]`` output; one row takes both blocks in a single launch of the
    integer-dot GEMV (``dot_gemv_row_blocks``), more rows each block's product into its columns.

    Attributes:
        parts: the blocks in output order, each as the GEMM backend's ``prepare_weight`` packed it.
        rows: each block's output features.
    """

    parts: tuple[GroupedIntWeight, ...]
    rows: tuple[int, ...]

    @property
    def shape(self) -> tuple[int, int]:
        """``(out_features, in_features)`` of the stacked projection."""
        return sum(self.rows), self.parts[0].shape[1]

    @property
    def nbytes(self) -> int:
        """Device bytes of the packed blocks (what one product streams)."""
        return sum(part.nbytes for part in self.parts)
