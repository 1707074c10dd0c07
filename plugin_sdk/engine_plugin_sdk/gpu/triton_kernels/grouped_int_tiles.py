"""Launch parameters of the grouped-integer kernels (:mod:`.grouped_int_launchers`) by target: which kernel takes
how many activation rows, and each one's tiles, read-ahead and splits."""

from __future__ import annotations

from dataclasses import dataclass

import triton

#: the fragment kernel's activation rows at most (the ``mma``'s 8 columns)
FRAGMENT_MAX_ROWS = 8


@dataclass(frozen=True, slots=True)
class GroupedIntTiles:
    """Launch parameters of the grouped-integer GEMM on one target.

    Attributes:
        block_k: reduction columns per tile, fixed at load (the 4-bit codes are paired within blocks of
            it); capped at the largest power of two dividing the weight's group size.
        fp32_block_k: the same for float32 activations, whose tiles take twice the shared memory (at
            128 the larger tiles outgrow an MI300's 64 KiB of LDS).
        gemm_block_k: the grouped GEMM's reduction tile spans packed blocks narrower than this (bf16 / fp16
            activations; GGUF's and GPTQ's 32-column groups), each block's scales broadcast over its columns
            (0: one block a tile, as before). 64 by default from the sm_90 code of the 2-16-row tiles (Triton
            3.6): per 128 columns of 32-column blocks 954 instructions and 168 registers against 1,192 and 140 in
            tiles of one block; 128-column tiles need 255 registers and spill, yet on an H200 (2026-12-05) GGUF
            Q4_K_M decode of 4 sequences on the GEMM ran 532.4 tok/s with them, 501.3 at 64, 426.7 at 32.
        gemm: ``(max_rows, block_m, block_n, num_warps, num_stages)`` by the number of activation rows: the
            first entry whose ``max_rows`` covers them (the last one past them all). ``block_m`` is at
            least 16 (``tl.dot``'s smallest tile).
        min_programs: split the reduction until the output tiles times the splits reach this many
            programs (about two per multiprocessor), ...
        max_split_k: ... into at most this many splits ...
        min_split_blocks: ... of at least this many ``block_k`` tiles each.
        gemv: ``(rows, row_bytes, num_warps, num_stages)`` of the single-row GEMV over 8-bit codes: output
            features per program (1, 2 or 4 unrolled; a larger power of two as one tile, for the
            interpreter), and code bytes of each row read per iteration (a power of two; fewer where a row
            has fewer).
        gemv4: the same for 4-bit codes packed in blocks of ``gemv4_min_block`` columns or more (their own
            kernel, :mod:`.grouped_int4_gemv_kernels`); narrower blocks take ``gemv`` and the byte kernel.
        gemv4_min_block: see ``gemv4``.
        gemv_loop_stages: the unrolled GEMVs' reduction loop past its first tile pipelined this deep by Triton
            (``tl.range``'s ``num_stages``: ``cp.async`` copies through shared memory, ``stages - 1`` iterations
            ahead). The launch's ``num_stages`` in ``gemv`` / ``gemv4`` does not reach a loop without a
            ``tl.dot``, so with 1 each iteration waits for its own tiles.
        dense_rows: products of at least this many rows dequantize the weight into a dense copy in the
            activations' dtype and run the vendor's GEMM on it (0: never). Past some hundreds of rows the
            copy's bytes cost less than dequantizing a tile once per tile of rows inside the grouped GEMM.
        mma_rows: products of 2 to this many bf16 / fp16 rows over 4-bit codes in blocks of
            ``gemv4_min_block`` columns or more take the tensor-core kernel (:mod:`.grouped_int4_mma_kernels`;
            0: never, the default, since its fast path is NVIDIA PTX).
        mma: ``(block_n, num_warps, num_stages)`` of that kernel.
        mma_programs: it splits the reduction until its row tiles times the splits reach this many programs
            (at most ``max_split_k`` splits of ``min_split_blocks`` blocks or more).
        mma_asm: the tensor-core and integer-dot kernels run their inline PTX (the interpreter runs plain ops
            instead).
        fragment_rows: products of ``fragment_min_rows`` to this many (at most 8) bf16 / fp16 rows over
            4-bit codes in blocks of 128 columns or more take the fragment kernel
            (:mod:`.grouped_int4_fragment_kernels`: each word of codes read straight into a tensor-core
            operand) ahead of the GEMVs and ``mma``; 0: never (the default: its fast path is NVIDIA PTX).
        fragment_min_rows: see ``fragment_rows``.
        fragment_warps: warps of its programs (each program 16 output features, its warps splitting the
            reduction) ...
        fragment_narrow_warps: ... or this many when the product has fewer than ``fragment_narrow_programs``
            programs (fewer output features: more warps keep the GPU's memory busy).
        fragment_narrow_programs: see ``fragment_narrow_warps``.
        fragment_depth: how many of its warp's iterations ahead the fragment kernel reads a chunk's words
            (1-3; each further one holds a chunk more in flight through an iteration, for 8 registers a lane).
        fragment_narrow_depth: ... and this many for products of fewer than ``fragment_narrow_programs`` programs
            (0: ``fragment_depth``). 1 made qkv / o_proj / down faster alone at 4 rows on an H100 but W4A16 decode
            of 2 / 4 / 8 sequences 4-6% slower (2026-12-05): inside the graphs the PDL prologue's two chunks pay.
        fragment_prefetch: the fragment kernel asks the L2 cache for each chunk's words this many of its warp's
            iterations before its read-ahead loads them (``prefetch.global.L2``: more bytes in flight without
            registers or barriers; the later load waits for L2, not memory); 0: off. On an H200 (2026-12-05), at
            4 warps a program it sped the narrow products up (down_proj at one row 27.7 -> 22.0 us, o_proj 9.5
            -> 8.1-8.4) and slowed gate_up (26.2 -> 29.1); W4A16 decode of 4 sequences 1,435 against 1,504
            tok/s. (Triton's pipeliner in its place, ``cp.async`` with two block barriers an iteration, ran 5-8
            times slower and was removed.)
        fragment_narrow_blocks: the fragment kernel takes 4-bit codes packed in blocks of 32 or 64 columns too
            (GGUF's Q4_0 / Q4_1 / Q4_K, GPTQ's groups of 32 / 64), each lane's block scales in its operands
            (:mod:`.grouped_int4_fragment_scaled`); off: such blocks take the GEMVs and the grouped GEMM. On an
            H200 (2026-12-05) GGUF Q4_K_M decode of 4 sequences 821.9 against 501.3 tok/s.
        fragment_ahead: the fragment kernel reads each chunk's group scales with its words (``fragment_depth``
            iterations ahead) and its activations one iteration ahead; without it ptxas issues the scales'
            loads amid the iteration that multiplies by them (about 6 registers a lane more at depth 2). Off:
            on an H100 (2026-12-05) down_proj alone ran 6-13% faster, gate_up 1-18% and the LM head up to 9%
            slower, and W4A16 decode of 4 sequences 4.5% slower; Nsight Compute put the kernel's stalls on the words' loads
            (long scoreboard) at the low occupancy of narrow products, not on the scales.
        gated_epilogue: a gate/up product on the fragment kernel (or the integer-dot GEMV) applies its gated
            activation in the product's own launch (:func:`grouped_int_gated_linear`; off: the activation kernel after the product). W4A16
            decode of 4 / 8 sequences 1.4-2.5% faster with it on an H100, 1.9% on an H200 (2026-12-05).
        gemv_gated_epilogue: ... and so does one on the word or byte GEMV (one row). Off: with it the GEMVs ran
            slower (2026-12-05, an H100: W4A16 / Q4_K_M batch-1 decode 1.0 / 1.0-1.7%; an H200: Q4_K_M 1.5%):
            a program's four rows become two pairs far apart.
        dot_gemv_rows: one bf16 / fp16 row over 4-bit codes (any block width) takes the integer-dot GEMV
            (:mod:`.grouped_int_dot_gemv_kernels`: activations rounded to 16-bit integers once a program, codes
            multiplied in their bytes by ``dp2a``) with this many output features a program (a power of two up
            to 64; 0: the word and byte GEMVs), where the fragment kernel does not take it; a gate/up product
            on it applies its activation in the same launch with ``gated_epilogue`` (an even number of rows).
            On an H100 (2026-12-05), 8 rows against the word GEMV and the fragment kernel at one row: qkv 7.9
            against 11.1 us, o_proj 6.4 against 9.4, gate_up 22.9 against 29.0, down 15.1 against 17.4, the LM
            head 91.4 against 125.6 (groups of 128; GGUF's 32-column blocks alike). On an H200, batch-1 decode:
            W4A16 570.7 against 415.3 tok/s (4 rows: 461.0), GGUF Q4_K_M 413.7 against 303.6.
        dot_gemv_8bit: ... and so does one over 8-bit codes in groups of a multiple of 16 columns (GGUF's Q6_K and
            Q8_0, 8-bit GPTQ), a word of four codes two ``dp2a`` (off: the byte GEMV). On an H100 (2026-12-05) GGUF
            Q4_K_M batch-1 decode (its Q6_K tensors) 362.5 against 342.6 tok/s; on an H200 450.0 with it (413.7
            without, an earlier call).
        dot_gemv_ahead: where its reduction takes several steps (down_proj), it reads each step's words and
            activations while the step before multiplies, for 4-bit codes with one zero point (GPTQ / AWQ's
            form). On an H100 (2026-12-05) down_proj 13.7 against 15.5 us, W4A16 batch-1 decode 479.9 against
            465.4 tok/s; with zero scales (GGUF's K-quants) down_proj took 17.4 against 16.4 us and Q4_K_M's
            decode (its Q6_K tensors 8-bit, with it too) 378.5 against 394.9 tok/s, so neither takes it (128
            registers a thread against 96). Its first form read the words alone ahead: on an H200 W4A16 583.9
            against 570.2 tok/s.
        dot_gemv_ahead_all: ... and for zero scales and 8-bit codes too (off: the H100 figures above).
        dot_gemv_early_params: under PDL it reads its first step's group parameters, with its words, before it
            waits for the kernel that writes its activations. What it reads there stays live across the wait:
            sm_90 code (Triton 3.6, 8 rows a program, one step) 127 registers a thread over GGUF's two-level zero
            scales against 80 with them read after the wait (4 programs a multiprocessor against 6: qkv's 768
            need two waves at 4), W4A16's 92 against 79 (5 against 6). On until timed (2026-12-05).
        dot_gemv_early_zero_point_params: ``dot_gemv_early_params`` for 4-bit codes with one zero point (GPTQ / AWQ's
            form; ``dot_gemv_early_params`` then applies to zero scales and 8- and 6-bit codes). Off for the H200's
            tiles: W4A16 batch-1 decode +1.6% on an H200 (2026-12-06, session 43: 595.1 against 585.6 tok/s) and
            +1.5% on an H100 (session 47: 487.1 against 479.8), where GGUF Q4_K_M with every form's scales after
            the wait lost 7% on both (session 47's H100: 387.7 against 415.5).
        dot_gemv_prefetch_params: ... and where it reads them after the wait, it asks the L2 cache for their
            lines before it (W4A16: 80 registers; over GGUF's form 124, the addresses kept across the wait).
        dot_gemv_program_params: it reads the group parameters of zero scales and 8-bit codes (GGUF's forms) from a
            copy in its programs' order, a thread's rows of a group one vector load
            (:mod:`.grouped_int_program_params`: Q4_K 4 loads a step against 32, 95 registers against 127, in
            sm_90 code), kept beside the row-major ones for the other kernels: GGUF Q4_K_M batch-1 decode +3.8%
            on an H100 (2026-12-06, session 49: 438.8 / 438.9 against 422.9 tok/s, two processes). The copies
            (about 8% of a K-quant weight's bytes) are made by the warm-up, after the KV cache took its share of
            the free memory. 6-bit codes (``six_bit_codes``, ``six_bit_min_rows``) take the copy too since
            2026-12-06 (Q6_K's form at 8 rows: 37 loads a step against 16 in sm_90 code; untimed).
        dot_gemv_program_params_zero_point: the same for 4-bit codes with one zero point (GPTQ / AWQ's form:
            20 loads a step become 13, but the row sums then take 42 shuffles against 4: 616 instructions against
            560): W4A16 batch-1 decode 459.3 against 481.5 tok/s on that H100 (-4.6%), so off; again 461.8 against
            485.5 in session 56. Where each SM must take in an H200's bytes (an H100 held to 96 SMs) it gains: 474.3
            against 460.4 (+3.0%), 2 sequences 728.1 against 712.5: the NVIDIA plugin's fast-memory choice.
        dot_gemv_max_registers: the other way to one wave: a cap on its registers a thread (ptxas's
            ``maxnreg``; 0: none). At 80 with its scales read early, sm_90 code spills 4 registers for W4A16
            and 28 over GGUF's form; untimed (2026-12-05).
        two_level_scales: GGUF's K-quants keep their own scales: a uint8 / int8 per group times an fp16 per
            super-block of 256 columns (exact, as the expanded float32 ones), about a byte a group where the
            float32 scale and zero scale took eight (Q4_K: 0.58 bytes a weight instead of 0.75; Q4_K_M's step
            about 4.83 GB instead of 6.06). On an H100 (2026-12-05, two calls) Q4_K_M batch-1 decode 408.1 / 408.7
            against 362.1 / 362.4 tok/s (+12.7%), 4 sequences 832.9 against 862.2 (-3.4%: the fragment kernel's
            extra loads); on in the interpreter, which checks it against the one-level scales bit for bit.
        six_bit_codes: 8-bit codes that all fit 6 bits (GGUF's Q6_K, Q5_0, Q5_1, Q5_K) are kept in 6: their low
            nibbles as 4-bit codes, their high bits in a plane beside
            (:class:`~engine_plugin_sdk.gpu.gemm.GroupedIntWeight`), 6.5 bits a weight with Q6_K's two-level
            scales (its file's size) against 8.6. Q4_K_M keeps the LM head,
            ``attn_v`` and about half of ``ffn_down`` in Q6_K: its Llama-3-8B step reads 4.45 GB instead of 4.83.
            The integer-dot GEMV takes one row, the GEMM the others (the fragment kernels read 4-bit codes only).
            Off until timed (2026-12-05).
        six_bit_min_rows: weights of at least this many rows keep such codes in 6 bits without
            ``six_bit_codes`` (0: none): GGUF Q4_K_M's Q6_K LM head (128,256 rows of Llama-3-8B, 0.56 GB a step in 8
            bits, 0.43 in 6), one long product whose bytes, not its launch, set its time, while the per-layer Q6_K
            weights stay a byte a code. Untimed (2026-12-06).
        dot_gemv_narrow_rows: rows a program of the integer-dot GEMV over products of at most
            ``dot_gemv_narrow_max`` output rows (0: ``dot_gemv_rows``). Why: GGUF Q4_K_M's ``attn_v`` in Q6_K (1,024
            rows of Llama-3-8B, its own launch in half the layers) is 128 programs at 8 rows, fewer than an H100's
            132 multiprocessors, each two steps one after the other: 4.75 us without PDL for 4.5 MB (an H100,
            2026-12-06). Untimed.
        dot_gemv_vector_masks: a reduction whose steps do not divide it (Llama-3-8B's down_proj: 448 slots of
            128 a step) reads its masked step's activations as 16-byte vectors, the mask declared constant over a
            slot's four words. In sm_90 code (Triton 3.6, 8 rows, 4 warps) the activations otherwise take four
            4-byte loads a run: W4A16's down_proj 64 loads against 40 (952 instructions against 912, but 136
            registers against 128: three programs a multiprocessor instead of four), Q4_K's 56 against 32 (113
            registers against 128, four programs either way). Untimed (2026-12-06).
        dot_gemv_row_blocks: one row through a projection of two row blocks in different forms (GGUF Q4_K_M's
            q / k in Q4_K over v in Q6_K, :class:`~engine_plugin_sdk.gpu.gemm.GroupedIntRowBlocks`) takes one launch
            of the integer-dot GEMV (:mod:`.grouped_int_dot_row_blocks`) instead of one a block: v's 128 programs
            (Llama-3-8B at 8 rows) ran 4.75 us of an H100's time without PDL for 4.5 MB in a launch of their own, in
            half the layers. The backend joins such blocks only with it (else the core hands on views of each block's
            product, no copy). Measured on an H100 (2026-12-07, Q4_K_M batch-1 decode, two rounds): 439.1 / 439.3
            against 439.8 / 439.5 tok/s, no gain under PDL; off, the H200's A/B to run.
        dot_gemv_x_rows: up to this many activation rows (2-8 sequences decoding) take the integer-dot GEMV too,
            before the fragment kernel and the GEMM: each row its own programs, launched beside the other rows'
            over the same weight rows, so that the weight comes from memory once and from the L2 cache for the
            rest (1: one row only). Why: at 2-8 rows the fragment kernel and the GEMM are bound by their
            dequantizing, not by memory: GGUF Q4_K_M decode of 2 sequences ran 432 tok/s in all on an H100, below
            its 445 for one. With two rows here: **580** (+34%), W4A16 771 against 711 (+8%); but 4 rows 670
            against 843 (GGUF) and 1,026 against 1,396 (W4A16), 8 rows 728 against 1,588: each row's integer
            work is its own, and past two rows it costs more than the fragment kernel's dequantizing, shared by
            its rows (2026-12-07, session 54, one process each). Row-major parameters (no program-order copy) and
            no fused norm there.
        dot_gemv_x_rows_rows: rows a program of the integer-dot GEMV when several activation rows take it
            (``dot_gemv_x_rows``; 0: ``dot_gemv_rows``). 16 from the program-order copy
            (``dot_gemv_x_rows_program_params``): 2 sequences on an H100 (2026-12-07, session 56, tok/s in all)
            W4A16 777.7 against 758.3 at 8, GGUF Q4_K_M 693.2 against 680.4; on an H100 held to 96 SMs (an H200's
            bytes a multiprocessor) 708.9 against 659.0 and 602.6 against 574.4.
        dot_gemv_x_rows_program_params: several activation rows read the program-order copy of the group
            parameters too, where ``dot_gemv_program_params`` (``_zero_point``) makes one for the weight (each row's
            programs read their weight rows' part of it): one vector load a thread, group and step in place of a load
            a row (sm_90 code, Triton 3.6: Q6_K's down_proj loop at two rows 479 instructions against 679 at 16 rows
            a program, 313 against 407 at 8). GGUF Q4_K_M decode of 2 sequences on an H100 (session 56): 680.4
            against 580.3 tok/s in all at 8 rows (+17%); held to 96 SMs 574.4 against 463.2 (+24%).
        dot_gemv_six_bit_rows: rows a program of the integer-dot GEMV over 6-bit codes (0: ``dot_gemv_rows``).
            sm_90 code (Triton 3.6, Q6_K's form, PDL): 8 rows take 128 registers a thread on a single-step product
            and 157 on down_proj's loop, 4 rows 95 and 96 (8-bit codes at 8 rows: 100 and 80). Untimed.
        dot_gemv_row_groups: where one step takes a product's whole reduction (4- and 8-bit codes over
            ``32 * dot_gemv_warps`` slots: qkv, o_proj, gate_up and the LM head of Llama-3-8B at 4 warps), a program
            takes this many groups of ``dot_gemv_rows`` rows one after another, each group's words read while the
            one before multiplies and the activations converted once for all (1: a group a program). Why: such a
            program reads its words, then multiplies, and has nothing in flight meanwhile; gate_up streamed at
            3.3 TB/s on an H200 (2026-12-05), of about 4.2 a copy moves. Untimed (2026-12-05).
        dot_gemv_warps: warps of its programs (each step takes 32 columns of every row a thread; 8 warps ran
            slower than 4 on every product).
        dot_gemv_residual_norm: the backend takes a layer's residual add and RMS norm into the single-step
            integer-dot GEMV after it (``GemmBackend.add_rms_norm_linear``: qkv and gate_up of Llama-3-8B at 4
            warps): each program sums and normalises the row it reads anyway, one launch fewer each. Why: at
            batch 1 the 64 norm launches of a Llama-3-8B step cost about 55 us of an H100's W4A16 step (+2.6%
            without them, 2026-12-05), their latency, not their bytes. Measured slower on an H100 (2026-12-06,
            batch 1: W4A16 -2.2 / -2.7%, GGUF Q4_K_M -3.4 / -3.8%): each program's share of the norm (about 440
            instructions a thread, 120 registers against 79) costs more than the launch it saves. Off.
        dot_gemv_prepared: the backend takes a layer's residual add and RMS norm before a single-step integer-dot
            GEMV (``GemmBackend.add_rms_norm_linear``, as ``dot_gemv_residual_norm`` does; that one first where both
            are set) into a norm kernel that also writes the row as the GEMV's programs would convert it: each
            slot's int16 pairs, the float32 value of a unit of their integer sums and their sum
            (:mod:`.grouped_int_dot_prepared`). The GEMV's programs then read those instead of converting the row
            each (about 175 of a W4A16 program's 560 instructions a thread in sm_90 code: the absolute maximum,
            the power of two, 32 roundings and packings, the sums). Why: at 8 rows a program the products issue
            some 2,240 warp instructions for 16 KB of codes, about 60% of an SM's issue rate at the H200's
            4.2 TB/s, where gate/up streamed at 3.3 TB/s (2026-12-06). On an H100 (2026-12-07, session 52) it is no
            gain: without PDL gate/up 22.20 -> 21.44 us and q/k/v 6.68 -> 6.62, but the norm 2.05 -> 2.51 us (one
            program of 4 warps, 32 activations a thread, where the norm kernel's 16 warps take 8 columns a thread);
            batch-1 decode W4A16 478.6 against 480.9 tok/s, GGUF Q4_K_M 435.8 against 439.8, 4 sequences alike.
            With the norm kernel's flat layout (session 53: 2.16 us) W4A16 +0.5% (483.0 / 480.7, 487.3 / 485.1 in
            two calls), Q4_K_M -0.2% / 0.0%; 16 rows a program with it slower (-0.3% / -0.8%). Off in this table;
            the NVIDIA plugin turns it on with 16 rows a program where the memory streams at least 30 GB/s a
            multiprocessor (an H200: ``engine_plugin_nvidia.gemm.FAST_MEMORY_DOT_GEMV``): on an H100 held to 96 SMs,
            an H200's bytes a multiprocessor, W4A16 batch 1 +5.4% and GGUF Q4_K_M +14.8% (2026-12-07, session 55).
        fragment_wide_min_rows: products of at least ``fragment_narrow_programs`` programs (wide: gate/up, the
            LM head) take the fragment kernel from this many rows instead of ``fragment_min_rows`` (0: the
            same). On an H200 at one row it beat the word GEMV on those (gate_up 26.2 against 29.0 us, the LM
            head 102 against 126) and lost on the narrow ones (qkv, o_proj, down); W4A16 batch-1 decode with 1
            449.7 against 414.4 tok/s (2026-12-05); the integer-dot GEMV has taken one row since (0 on the H200).
    """

    block_k: int = 128
    fp32_block_k: int = 32
    gemm_block_k: int = 64
    gemm: tuple[tuple[int, int, int, int, int], ...] = (
        (16, 16, 64, 4, 4), (32, 32, 64, 4, 4), (64, 64, 64, 4, 3), (256, 64, 128, 4, 3), (0, 128, 128, 8, 3),
    )  # fmt: skip
    min_programs: int = 264
    max_split_k: int = 16
    min_split_blocks: int = 2
    gemv: tuple[int, int, int, int] = (4, 1024, 4, 2)
    gemv4: tuple[int, int, int, int] = (4, 2048, 4, 2)
    gemv4_min_block: int = 128
    gemv_loop_stages: int = 1
    dense_rows: int = 128
    mma_rows: int = 0
    mma: tuple[int, int, int] = (64, 4, 3)
    mma_programs: int = 528
    mma_asm: bool = True
    fragment_rows: int = 0
    fragment_min_rows: int = 1
    fragment_warps: int = 4
    fragment_narrow_warps: int = 8
    fragment_narrow_programs: int = 1024
    fragment_depth: int = 1
    fragment_narrow_depth: int = 0
    fragment_ahead: bool = False
    fragment_narrow_blocks: bool = False
    fragment_prefetch: int = 0
    gated_epilogue: bool = True
    gemv_gated_epilogue: bool = False
    fragment_wide_min_rows: int = 0
    dot_gemv_rows: int = 0
    dot_gemv_8bit: bool = False
    dot_gemv_ahead: bool = False
    dot_gemv_ahead_all: bool = False
    dot_gemv_early_params: bool = True
    dot_gemv_early_zero_point_params: bool = True
    dot_gemv_prefetch_params: bool = False
    dot_gemv_program_params: bool = False
    dot_gemv_program_params_zero_point: bool = False
    dot_gemv_max_registers: int = 0
    two_level_scales: bool = False
    six_bit_codes: bool = False
    six_bit_min_rows: int = 0
    dot_gemv_narrow_rows: int = 0
    dot_gemv_narrow_max: int = 2048
    dot_gemv_vector_masks: bool = False
    dot_gemv_row_blocks: bool = False
    dot_gemv_six_bit_rows: int = 0
    dot_gemv_x_rows: int = 1
    dot_gemv_x_rows_rows: int = 0
    dot_gemv_x_rows_program_params: bool = False
    dot_gemv_row_groups: int = 1
    dot_gemv_warps: int = 4
    dot_gemv_residual_norm: bool = False
    dot_gemv_prepared: bool = False

    def takes_fragments(self, rows: int, out_features: int) -> bool:
        """Whether ``rows`` activation rows of a product with ``out_features`` features (16 a program) take the
        fragment kernel, where it fits the weight."""
        wide = triton.cdiv(out_features, 16) >= self.fragment_narrow_programs
        least = self.fragment_wide_min_rows if wide and self.fragment_wide_min_rows else self.fragment_min_rows
        return max(1, least) <= rows <= min(self.fragment_rows, FRAGMENT_MAX_ROWS)

    def gemm_tiles(self, rows: int) -> tuple[int, int, int, int]:
        """``(block_m, block_n, num_warps, num_stages)`` for ``rows`` activation rows."""
        for max_rows, *tiles in self.gemm[:-1]:
            if rows <= max_rows:
                return tuple(tiles)  # type: ignore[return-value]
        return tuple(self.gemm[-1][1:])  # type: ignore[return-value]

    def split_k(self, output_tiles: int, k_blocks: int) -> int:
        """How many programs share one output tile's ``k_blocks`` reduction tiles."""
        want = min(self.max_split_k, triton.cdiv(self.min_programs, max(1, output_tiles)))
        return max(1, min(want, k_blocks // max(1, self.min_split_blocks)))


#: the defaults, meant for an H200 (132 SMs: ``min_programs`` is two programs each) and used on every GPU; each
#: choice was timed on Llama-3-8B's shapes (BENCHMARKS.md, "Pre-quantized weights on the H200" and its sessions):
#: from 128 rows the dense copy and cuBLAS (at 256 rows 41 against 65-88 us for qkv); the GEMVs' tiles (4 rows,
#: 1 KiB a row; the word GEMV 2 KiB) took the least time over a layer's four products; the word GEMV only for
#: blocks of 128 columns or more (on Q4_K_M's 32-column blocks batch-1 decode fell from about 280 to 215 tok/s);
#: the tensor-core kernel for 2-16 rows (a layer at 4 rows about twice as fast as the grouped GEMM); ahead of it
#: the fragment kernel for 2-8 rows (a layer's four products at 4 rows 66.8 against 94.7 us on an H200), 4 warps
#: a program from 1,024 programs and 8 below, reading 2 iterations ahead (W4A16 decode of 2 / 4 / 8 sequences
#: +7-10% on an H100, to confirm on an H200); the gated epilogue on the fragment kernel (``gated_epilogue``);
#: GGUF's 32-column blocks on the fragment kernel (Q4_K_M decode of 4 sequences 821.9 against 501.3 tok/s) and
#: in 128-column GEMM tiles (532.4 against 501.3 at 64 and 426.7 at 32 on the GEMM, though they spill); one row
#: of 4-bit codes on the integer-dot GEMV, 8 rows a program, gate/up with its activation (it beat the word and
#: byte GEMVs and the fragment kernel on every product: ``dot_gemv_rows``), and of 8-bit codes too; GGUF's
#: K-quants with their own two-level scales (batch-1 decode +12.7%, 4 sequences -3.4%: ``two_level_scales``); the
#: integer-dot GEMV's operands a step ahead for one-zero-point codes (W4A16 batch-1 +3.1%: ``dot_gemv_ahead``), and
#: their first scales read after its PDL wait (+1.5-1.6%: ``dot_gemv_early_zero_point_params``); GGUF's forms'
#: parameters from a copy in the GEMV's program order (+3.8% Q4_K_M: ``dot_gemv_program_params``); two rows on the
#: integer-dot GEMV too (2 sequences +34% GGUF Q4_K_M, +8% W4A16: ``dot_gemv_x_rows``), at 16 rows a program from
#: the program-order copy (2 sequences +19% GGUF Q4_K_M, +1.6% W4A16 on an H100: ``dot_gemv_x_rows_program_params``).
H200_GROUPED_INT_TILES = GroupedIntTiles(
    mma_rows=16, fragment_rows=8, fragment_min_rows=2, fragment_depth=2, fragment_narrow_blocks=True,
    gemm_block_k=128, dot_gemv_rows=8, dot_gemv_8bit=True, two_level_scales=True, dot_gemv_ahead=True,
    dot_gemv_early_zero_point_params=False, dot_gemv_program_params=True, dot_gemv_x_rows=2, dot_gemv_x_rows_rows=16,
    dot_gemv_x_rows_program_params=True,
)
#: the interpreter runs each program's tile ops as numpy calls: few, large tiles and no split keep it quick
#: (GGUF's 32-column groups cap the reduction tile at 32: 512 output columns a program against 256 halved
#: a 4096-wide product's time there, each numpy call costing about the same whatever its tile)
INTERPRETER_GROUPED_INT_TILES = GroupedIntTiles(
    block_k=128, fp32_block_k=128, gemm=((16, 16, 512, 4, 1), (0, 64, 512, 4, 1)), max_split_k=1,
    gemv=(64, 1024, 4, 1), gemv4=(64, 1024, 4, 1), mma_rows=16, mma_asm=False, fragment_rows=8, fragment_min_rows=2,
    fragment_warps=2, fragment_narrow_warps=2, fragment_narrow_blocks=True, dot_gemv_rows=64, dot_gemv_8bit=True,
    dot_gemv_warps=1, two_level_scales=True, six_bit_codes=True, dot_gemv_program_params=True,
    dot_gemv_residual_norm=True, dot_gemv_row_blocks=True,
)
