#!/usr/bin/env bash
# The variants written without a device (sessions 33-36) measured in device calls of
# under ten minutes: `kernels` checks them on the GPU and times them one product or layer at a time, `decode`
# end to end. What each variant is: BENCHMARKS.md, "session 34" and "session 35".
#   kernels: the plugin's grouped-integer and MoE kernel tests on the GPU; the fragment kernel at 1 and 4 rows
#            with 4 / 8 warps;
#            Q4_K / W4A16 GEMVs with and without the pipelined loop; the MoE down GEMV with a token's experts
#            at once (down_experts_at_once).
#   decode:  Llama-3-8B W4A16 and GGUF Q4_K_M batch-1 decode (and 2 / 4 / 8 sequences) against bf16, the
#            H200 defaults (fragment read-ahead of 2, session 35; the gated epilogue from two rows, session 36)
#            against the gated epilogue off and on the GEMVs too, the fragment kernel at one row; Qwen3-30B-A3B
#            batch-1 decode. Session 36 ran these on an H100 (BENCHMARKS.md); the issues' figures are the H200's.
#   prefetch: the fragment kernel's L2 prefetches (fragment_prefetch, session 37) checked on the GPU, timed
#            per product at 1 and 4 rows against the register read-ahead alone and Triton's pipeliner, then
#            an L2 prefetch issued before a few small kernels ahead of a bf16 / W4A16 product
#            (nvidia_h200_l2_prefetch.py: does a weight asked for early come faster?).
#   prefetch-decode: W4A16 decode of 1 and 4 sequences with the L2 prefetches (and at one row, where the
#            word GEMV runs today), against the defaults and bf16 (TILES overrides).
#   wide:    the fragment kernel at one row for wide products (fragment_wide_min_rows=1, session 37), the
#            grouped GEMM with one packed block a tile (gemm_block_k=0, before session 37) and the fragment
#            kernel over GGUF's 32-column blocks (fragment_narrow_blocks=1, session 37) against the defaults:
#            W4A16 and GGUF Q4_K_M decode of 1 and 4 sequences, bf16 beside them.
#   dot:     the integer-dot GEMV (dot_gemv_rows, session 38) checked on the GPU (its dp2a PTX against float64),
#            timed per product at one row against the word / byte GEMVs and the fragment kernel (groups of 128
#            and GGUF's 32), then W4A16 and GGUF Q4_K_M batch-1 decode with it (TILES overrides) against bf16.
#   dot-tiles: the integer-dot GEMV's next variants (session 38): 16 rows a program (x's conversion shared by
#            more rows) per product, then W4A16 / Q4_K_M batch-1 decode with 16 rows and with the words a step
#            ahead (one call measured W4A16 +2.4%, Q4_K_M -4.4%: repeated here), against the defaults.
#   two-level: GGUF K-quants with their own two-level scales (two_level_scales, session 38; on since session
#            39 measured it on H100s: TILES=two_level_scales=0 for the A/B on an H200): the GGUF kernel tests on
#            the GPU (two-level against one-level bit for bit through every kernel), then Q4_K_M decode of 1 and
#            4 sequences with the TILES variant against the defaults, bf16 and the dequantized copy.
#   standin: on an H100, an H200 stand-in (nvidia_sm_partition.py: 96 SMs, an H200's bytes a multiprocessor, where the
#            fast-memory tiles apply): issue 25's batch-1 and 2-sequence figures at the defaults beside the next
#            integer-dot GEMV variants (TILES: W4A16's operands not a step ahead, whose down_proj at 16 rows a program
#            then takes 128 registers against 168 and 666 sm_90 instructions a step against 690 (session 56, offline);
#            8 warps; 32 rows a program and every reduction's operands a step ahead lost there in session 56),
#            then issue 20's Qwen3-30B-A3B batch 1 there (0.601 in session 55, where the H200 gave 0.569).
#   moe-standin: issue 20's batch-1 expert GEMV tiles on the stand-in (96 SMs), where each SM must issue an H200's work:
#            the down GEMV's 4 x 1,024 tile (the default) masks a quarter of its lanes over Qwen3-30B-A3B's 768 columns
#            and sums across threads once an expert; offline sm_90 code (session 56, `sass_shape.py moe-down`) issues
#            per weight element 0.30 instructions a warp at 4 x 1,024, 0.20 at 4 x 256, 0.16 at 8 x 256 (92
#            registers, 256 programs), 0.14 at 16 x 256 (128 programs). One layer's kernels by tile, then batch-1
#            decode with 4 x 256 and 8 x 256 beside the default (separate processes).
#   router-norm: issue 20's MoE router GEMV with the residual norm in its programs (session 58, untimed: one launch a
#            layer fewer; sm_90 code 848 instructions against the norm's 336 and the GEMV's 480, 72 registers): the PDL
#            GPU tests, then Qwen3-30B-A3B batch-1 decode without / with ENGINE_NVIDIA_ROUTER_NORM=1, twice round in one
#            process (STANDIN=1: on the H100 stand-in's 94 SMs).
#   norms:   issue 20's residual norms inside the batch-1 GEMVs on an H200 (session 59, stand-in: the router's +0.6%, then
#            q/k/v's at 20 MiB +1.2%, Qwen3-30B-A3B 0.653 -> 0.675): their GPU tests, then Qwen3-30B-A3B batch 1 with
#            neither / the router's / both, twice round in one process, and Llama-3-8B batch 1 (its 48 MiB q/k/v keeps
#            the norm kernel by default) with q/k/v's forced (`=1`) against the default, processes in turn.
#   moe-tiles: issue 20's batch-1 down GEMV on an H200 (session 57, stand-in: 4 x 256 with 4 early experts 323.8 / 323.9
#            tok/s, 4 x 1,024 with them 298.1, without them 325.2): Qwen3-30B-A3B batch-1 decode at the defaults (4 x 256
#            on fast memory), 4 x 1,024 and 4 x 1,024 without early tiles, twice round in one process.
#   figures: the first call of a session with an H200 (session 60's plan): the three issues' batch-1 figures at the
#            defaults and nothing else, so they fit one call: issue 25 (bf16, W4A16, GGUF Q4_K_M and its dequantized
#            copy), issue 20 (Qwen3-30B-A3B), issue 32 (Llama-3-8B end to end). Then l2-window, then norms.
#   l2-window: whether a latency-bound kernel can fill L2 with the next GEMV's weight while it runs (session 60, no
#            device): `nvidia_l2_window.py`, a q/k/v-sized GEMV, a chain of dependent reads (an attention's length) asking
#            L2 for the o_proj-sized weight after it (prefetch.global.L2, or ::evict_last), then that GEMV; and the next
#            layer's q/k/v asked for before 25 / 75 MB of experts' bytes stream through. At most about 1.8 us a Qwen3-
#            30B-A3B layer for its o_proj (3.1 us for Llama-3-8B's), session 29's estimate of an L2-resident o_proj.
#            Then the kernels' tests of it (`l2_ahead`, session 60) and Qwen3-30B-A3B batch 1 in one process with the
#            decode attention asking L2 for each layer's o_proj (ENGINE_BENCH_L2_AHEAD, a benchmark hook) or not, and
#            the router for the next layer's q/k/v (ENGINE_BENCH_L2_NEXT_QKV) or not. STANDIN=1: on the H100
#            stand-in's 94 SMs.
#   l2-dense: the same A/B for Llama-3-8B batch 1 end to end (issue 32's figure), a process each, alternated.
#   session56: the first call of a session with an H200: issue 25's batch-1 figures and 2 sequences at the defaults (on
#            an H200 the fast-memory tiles: 16 rows a program, the prepared row and, session 56, GPTQ's form from the
#            program-order copy; two rows at 16 rows a program from the copy on every GPU) beside the H100's table
#            (dot_gemv_rows=8,dot_gemv_prepared=0,dot_gemv_program_params_zero_point=0) in one process, the two-row
#            GPU tests before, then issue 32's dense batch-1 end to end and issue 20's Qwen3-30B-A3B batch 1.
#   session54: the first call of a session with an H200: the two-row integer-dot GEMV's GPU tests (dot_gemv_x_rows,
#            session 54: GGUF Q4_K_M 2 sequences +34%, W4A16 +8% on an H100), issue 25's batch-1 figures and 2
#            sequences at the defaults beside one row only (dot_gemv_x_rows=1) and the prepared row (dot_gemv_prepared=1,
#            session 53) in one process, then issue 32's dense batch-1 end to end and issue 20's Qwen3-30B-A3B batch 1.
#   session53: the first call of a session with an H200: the prepared row's GPU tests (its norm kernel in the norm
#            kernel's flat layout since session 53: +0.5% W4A16 on an H100), issue 25's batch-1 figures with it and with
#            it at 16 rows a program beside the defaults in one process, then issue 32's dense batch-1 end to end and
#            issue 20's Qwen3-30B-A3B batch-1 decode at the defaults.
#   session52: the integer-dot GEMV handed its row converted by the norm's kernel (dot_gemv_prepared, session 52; an
#            H100 measured W4A16 -0.5%, Q4_K_M -0.9%: its products are not issue-bound there) after its GPU tests,
#            issue 25's batch-1 figures with it and with the Q6_K LM head in 6 bits beside the defaults in one process
#            (1 and 4 sequences); then issue 20's Qwen3-30B-A3B batch-1 decode (after a 128- and a 2,048-token prompt).
#   session51: GGUF Q4_K_M's mixed q/k/v in one launch (dot_gemv_row_blocks, session 51; no gain on an H100) after
#            its GPU tests, then issue 25's batch-1 figures (bf16, W4A16, Q4_K_M, its dequantized copy) with it and with
#            every Q6_K weight in 6 bits (H100: +4.2% at one row, -4.8% at four sequences) beside the defaults in one
#            process, 1 and 4 sequences; then issue 20's Qwen3-30B-A3B batch-1 decode.
#   session50: session 50's untimed dot-GEMV variants, each beside the defaults in one process for GGUF Q4_K_M and
#            W4A16, 1 and 4 sequences, after their GPU tests: the Q6_K LM head alone in 6 bits (six_bit_min_rows),
#            every Q6_K weight in 6 bits now that 6-bit codes read program-order parameters (six_bit_codes), narrow
#            products at 4 rows a program (dot_gemv_narrow_rows), masked steps' activations as vectors
#            (dot_gemv_vector_masks: down_proj; for W4A16 also capped at 128 registers, where sm_90 code spills 8
#            bytes, to keep four programs a multiprocessor), and the residual norm in the GEMV (dot_gemv_residual_norm: an H100
#            measured -2.2 to -3.8%; the H200's A/B).
#   program-params: the dot GEMV's group parameters from a copy in its programs' order (session 49: on for GGUF's
#            forms since an H100 measured Q4_K_M +3.8%, off for GPTQ's one zero point, W4A16 -4.6%): its GPU tests,
#            then GGUF Q4_K_M and W4A16 batch-1 decode with the copy off for GGUF's forms and on for GPTQ's beside
#            the defaults, one process, twice (the H200's A/B).
#   routing: the MoE routing kernel's packed-key picks (session 48, commit 72926ed, untimed): its GPU tests, then
#            Qwen3-30B-A3B batch-1 decode with the kernel before it (`git show 72926ed~1:plugin_sdk/engine_plugin_sdk/
#            gpu/triton_kernels/moe_kernels.py > .nvcarry/routing_kernel_before.py`) and with the tree's, two rounds.
#   confirm: issue 25's batch-1 figures at the defaults (session 39: two-level scales, the dot GEMV's operands a
#            step ahead), measured only on H100s so far: bf16, W4A16, GGUF Q4_K_M and its dequantized copy, one
#            process, 1 and 4 sequences.
#   next:    the first call of a session with a device (session 40's plan): the GPU tests of the 6-bit codes and of
#            the dot GEMV, `check --one-at-a-time` with the Q6_K LM head in 6 bits, then one process timing issue 25's batch-1 figures at the defaults (bf16, W4A16, Q4_K_M,
#            its dequantized copy; 1 and 4 sequences) with the first variants of `six-bit` and `params` beside them,
#            and single-step products taking two row groups a program (dot_gemv_row_groups=2, session 40); the
#            other variants (6 bits at 4 rows, the scales' L2 prefetch, the register cap) are those parts'.
#   six-bit-rows: the 6-bit codes' GEMM at 2-16 rows after its planes became one vector load a row (session 41,
#            b49caf7; session 41's H100 call before it: Q4_K_M 4 sequences 269 tok/s against 844 in 8 bits, Q5_K_M
#            69 against 465): its GPU tests, then Q4_K_M and Q5_K_M batch-1 and 4-sequence decode with
#            six_bit_codes=1 against the defaults and the dequantized copy. Flip six_bit_codes on where 4 sequences
#            no longer lose (at one row: +3.7% / +17% on an H100).
#   q3:      a Llama-3-8B-shaped GGUF Q3_K_M (Q3_K, with Q4_K / Q5_K / Q6_K where llama.cpp's mix puts them), its
#            Q3_K kept packed on GPUs since session 41 (3-bit codes a byte each; 6 bits with six_bit_codes), against
#            its dequantized copy: the GGUF kernel tests on the GPU, batch-1 and 4-sequence decode.
#   iq4:     the same for a Llama-3-8B-shaped GGUF IQ4_XS (every projection IQ4_XS, the LM head Q6_K), kept packed
#            on GPUs since session 41 (its table values plus 128 as 8-bit codes, Q8_0's form with two-level scales).
#   groups:  the row groups per product (dot_gemv_row_groups 1 / 2 / 3; qkv, o_proj, gate_up; groups of 128 and
#            GGUF's 32 columns), then W4A16 and Q4_K_M batch-1 decode with 2 and 3 groups against the defaults.
#   q5:      a Llama-3-8B-shaped GGUF Q5_K_M (Q5_K, and Q6_K where Q4_K_M puts it), kept packed on GPUs since
#            session 40 (8-bit codes; 6 with six_bit_codes), against its dequantized copy: batch-1 and 4-sequence
#            decode, and the interpreter-checked kernels' GPU tests.
#   six-bit: GGUF's Q6_K kept in 6 bits (six_bit_codes, session 40, written without a device; off until timed):
#            its GPU tests (the 6-bit dp2a PTX against float64, the GEMM, the dense copy), then Q4_K_M batch-1 and
#            4-sequence decode with it at 8 and 4 rows a program (dot_gemv_six_bit_rows) against the defaults,
#            bf16 and the dequantized copy. Its step reads 4.45 GB instead of 4.83.
#   gguf:    why GGUF Q4_K_M runs further from its roofline than W4A16 (0.63 against 0.74 on an H100): its dot
#            GEMVs per product over 32-column blocks with zero scales at 4 / 8 rows, 2 / 4 warps, operands ahead
#            or not (dot_gemv_ahead_all), then its decode with those variants and each one's kernel profile.
#   params:  the integer-dot GEMV's first scales read after the PDL wait (dot_gemv_early_params=0: fewer registers
#            held across it, so more programs a multiprocessor; with dot_gemv_prefetch_params=1 their L2 lines
#            asked for before it; or a cap of 80 registers instead, dot_gemv_max_registers): W4A16 and GGUF
#            Q4_K_M batch-1 decode against the defaults, bf16 beside them.
#   overlap: dual-batch overlap (session 35, --enable-dbo): its GPU tests (two streams, eager and in graphs),
#            then single decode steps of an 8-layer Llama-3-8B (256-1024 sequences of 640 / 2,048 tokens)
#            whole, without attention, and overlapped with 0 / 16 / 32 SMs left to attention.
#   overlap-e2e: issue 32's offline run (1000 x 512 / 256, bf16) whole and with --enable-dbo at 0 / 16 / 32
#            SMs left to attention, each run in its own process.
#   overlap-fp8: the same run with W8A8 products and an FP8 cache, whole and with --enable-dbo at $SMS SMs
#            left to attention (default 16: set SMS to the best of overlap-e2e).
# Usage (repo root, on the device): benchmarks/nvidia_h200_pending.sh figures|l2-window|l2-dense|norms|router-norm|moe-tiles|standin|moe-standin|session56|session54|session53|session52|session51|session50|program-params|routing|next|six-bit-rows|q3|iq4|confirm|groups|q5|six-bit|params|gguf|dot|dot-tiles|two-level|wide|prefetch|prefetch-decode|kernels|decode|overlap|overlap-e2e|overlap-fp8 OUT_DIR
# Each part fits one call of under ten minutes; they do not all fit a session's 30 minutes. In order of what
# they settle: overlap (whether two streams overlap at all, per step), decode (issues 25 and 20 end to end),
# kernels (why, product by product), overlap-e2e and overlap-fp8 (only where overlap gained on steps of
# 512+ sequences). Session 35 ran overlap and kernels on an H100 (BENCHMARKS.md): the overlap lost, so
# overlap-e2e / overlap-fp8 wait for attention kernels that share the GPU; decode is still to run on an H200.
PART=$1; OUT=$2; MODEL=.nvcarry/llama3-8b-dummy; LOGS=/tmp/nvlogs; mkdir -p $LOGS
source benchmarks/nvidia_h200_setup.sh
# a GGUF plan's GPU kernel tests, then its batch-1 and 4-sequence decode (TILES: its variants, default the 6-bit
# codes) against its dequantized copy
gguf_plan() {
  timeout 120 python3 -m pytest -q -p no:cacheprovider plugins/nvidia/tests/test_gguf_grouped.py > $LOGS/$1_tests.log 2>&1
  tail -3 $LOGS/$1_tests.log
  timeout 400 python3 benchmarks/nvidia_h200_quantized.py bench --tokenizer $MODEL --decode $2 ${2}_dequantized \
    --grouped-tiles ${TILES:-six_bit_codes=1} --decode-batch 4 --throughput --json "$OUT/$1_decode.json" > $LOGS/$1_decode.log 2>&1
  grep -E "^decode" $LOGS/$1_decode.log
  python3 benchmarks/decode_variants_table.py "$OUT/$1_decode.json"
}
dense_and_moe() {  # issue 32's dense batch-1 end to end, then issue 20's Qwen3-30B-A3B batch 1, as $1_*.json
  timeout 90 python3 benchmarks/nvidia_h200.py decode --model $MODEL --json "$OUT/$1_dense.json" > $LOGS/$1_dense.log 2>&1
  grep -E "decode_tok_s_graphs|decode_tok_s_end|end_to_end_ratio" $LOGS/$1_dense.log
  timeout 100 python3 benchmarks/nvidia_h200_moe.py decode --tokenizer $MODEL --json "$OUT/$1_moe.json" \
    > $LOGS/$1_moe.log 2>&1
  grep -iE "experts bf16" $LOGS/$1_moe.log
}
if [ "$PART" = kernels ]; then
  timeout 150 python3 -m pytest -q -p no:cacheprovider plugins/nvidia/tests/test_grouped_int_kernels.py \
    plugins/nvidia/tests/test_fragment_kernels.py plugins/nvidia/tests/test_moe_kernels.py > $LOGS/pending_tests.log 2>&1
  tail -6 $LOGS/pending_tests.log
  timeout 200 python3 benchmarks/nvidia_h200_word_gemv.py --rows 1 4 --fragment-warps 4 8 --fragment-depth 2 \
    --json "$OUT/word_gemv.json" > $LOGS/word_gemv.log 2>&1
  grep -E "rows" $LOGS/word_gemv.log | tail -120
  timeout 90 python3 benchmarks/nvidia_h200_quantized.py kernels --kinds int4_g128 gguf_q4_k \
    --gemv "4,1024,4,2" "4,2048,4,2" --gemv-loop-stages 1 3 --gemm-rows --json "$OUT/quantized_kernels.json" \
    > $LOGS/quantized_kernels.log 2>&1
  tail -20 $LOGS/quantized_kernels.log
  timeout 90 python3 benchmarks/nvidia_h200_moe.py kernels --tokens 1 4 8 --tiles --down-gemv 2,1024,4 4,1024,4 \
    --down-at-once --json "$OUT/moe_kernels.json" > $LOGS/moe_kernels.log 2>&1
  tail -8 $LOGS/moe_kernels.log
elif [ "$PART" = prefetch ]; then
  timeout 100 python3 -m pytest -q -p no:cacheprovider plugins/nvidia/tests/test_fragment_kernels.py \
    > $LOGS/prefetch_tests.log 2>&1
  tail -3 $LOGS/prefetch_tests.log
  timeout 150 python3 benchmarks/nvidia_h200_l2_prefetch.py --json "$OUT/l2_prefetch.json" > $LOGS/l2_prefetch.log 2>&1
  cat $LOGS/l2_prefetch.log | grep " us "
  timeout 280 python3 benchmarks/nvidia_h200_word_gemv.py --rows 1 4 --fragment-warps 4 8 --fragment-depth 2 \
    --fragment-prefetch 0 4 32 --json "$OUT/word_gemv_prefetch.json" > $LOGS/word_gemv.log 2>&1
  grep -E "rows" $LOGS/word_gemv.log | tail -130
elif [ "$PART" = prefetch-decode ]; then
  timeout 300 python3 benchmarks/nvidia_h200_quantized.py bench --tokenizer $MODEL --decode bf16 w4a16 \
    --decode-batch 4 --grouped-tiles ${TILES:-fragment_prefetch=32 fragment_min_rows=1,fragment_prefetch=32} \
    --throughput --json "$OUT/prefetch_decode.json" > $LOGS/prefetch_decode.log 2>&1
  grep -E "^decode" $LOGS/prefetch_decode.log
elif [ "$PART" = wide ]; then
  timeout 90 python3 -m pytest -q -p no:cacheprovider plugins/nvidia/tests/test_fragment_gated.py \
    plugins/nvidia/tests/test_gguf_grouped.py plugins/nvidia/tests/test_fragment_kernels.py > $LOGS/wide_tests.log 2>&1
  tail -2 $LOGS/wide_tests.log
  timeout 400 python3 benchmarks/nvidia_h200_quantized.py bench --tokenizer $MODEL --decode bf16 w4a16 gguf_q4_k_m \
    --decode-batch 4 --grouped-tiles ${TILES:-fragment_wide_min_rows=1 gemm_block_k=0 gemm_block_k=128 fragment_narrow_blocks=1,fragment_wide_min_rows=1} --throughput \
    --json "$OUT/wide_decode.json" > $LOGS/wide_decode.log 2>&1
  grep -E "^decode" $LOGS/wide_decode.log
elif [ "$PART" = dot ]; then
  timeout 90 python3 -m pytest -q -p no:cacheprovider plugins/nvidia/tests/test_dot_gemv.py \
    plugins/nvidia/tests/test_grouped_int_kernels.py -k "dot or gemv" > $LOGS/dot_tests.log 2>&1
  tail -2 $LOGS/dot_tests.log
  for group in 128 32; do
    timeout 150 python3 benchmarks/nvidia_h200_word_gemv.py --rows 1 --group $group --fragment-warps 4 \
      --fragment-depth 2 --dot-rows 4 8 --dot-warps 4 8 --json "$OUT/dot_kernels_g$group.json" \
      > $LOGS/dot_kernels_g$group.log 2>&1
    grep -E "one zero point|zero scales" $LOGS/dot_kernels_g$group.log | grep -vE "lm_head.*(bytes|words)"
  done
  timeout 300 python3 benchmarks/nvidia_h200_quantized.py bench --tokenizer $MODEL --decode bf16 w4a16 gguf_q4_k_m \
    --grouped-tiles ${TILES:-dot_gemv_rows=4 dot_gemv_rows=8 dot_gemv_rows=4,fragment_wide_min_rows=0} --throughput \
    --json "$OUT/dot_decode.json" > $LOGS/dot_decode.log 2>&1
  grep -E "^decode" $LOGS/dot_decode.log
elif [ "$PART" = dot-tiles ]; then
  timeout 150 python3 benchmarks/nvidia_h200_word_gemv.py --rows 1 --fragment-warps --dot-rows 8 16 --dot-warps 4 \
    --json "$OUT/dot_tiles_kernels.json" > $LOGS/dot_tiles_kernels.log 2>&1
  grep -E "one zero point" $LOGS/dot_tiles_kernels.log | grep -E "default|dot"
  timeout 330 python3 benchmarks/nvidia_h200_quantized.py bench --tokenizer $MODEL --decode bf16 w4a16 gguf_q4_k_m \
    --grouped-tiles ${TILES:-dot_gemv_rows=16 dot_gemv_ahead=1 dot_gemv_rows=16,dot_gemv_ahead=1} --throughput \
    --json "$OUT/dot_tiles_decode.json" > $LOGS/dot_tiles_decode.log 2>&1
  grep -E "^decode" $LOGS/dot_tiles_decode.log
elif [ "$PART" = two-level ]; then
  timeout 120 python3 -m pytest -q -p no:cacheprovider plugins/nvidia/tests/test_gguf_grouped.py \
    plugins/nvidia/tests/test_dot_gemv.py > $LOGS/two_level_tests.log 2>&1
  tail -2 $LOGS/two_level_tests.log
  timeout 330 python3 benchmarks/nvidia_h200_quantized.py bench --tokenizer $MODEL --decode bf16 gguf_q4_k_m \
    gguf_q4_k_m_dequantized --decode-batch 4 --grouped-tiles ${TILES:-two_level_scales=0} --throughput \
    --json "$OUT/two_level_decode.json" > $LOGS/two_level_decode.log 2>&1
  grep -E "^decode" $LOGS/two_level_decode.log
elif [ "$PART" = standin ]; then
  P="python3 benchmarks/nvidia_sm_partition.py --sms 94 run"
  timeout 330 $P benchmarks/nvidia_h200_quantized.py bench --tokenizer $MODEL --decode bf16 w4a16 gguf_q4_k_m \
    --grouped-tiles ${TILES:-dot_gemv_ahead=0 dot_gemv_warps=8} --decode-batch 2 --throughput \
    --json "$OUT/standin_decode.json" > $LOGS/standin_decode.log 2>&1
  grep -E "^decode|green" $LOGS/standin_decode.log
  timeout 150 $P benchmarks/nvidia_h200_moe.py decode --tokenizer $MODEL --json "$OUT/standin_moe.json" > $LOGS/standin_moe.log 2>&1
  grep -iE "green|experts bf16" $LOGS/standin_moe.log
elif [ "$PART" = moe-standin ]; then
  P="python3 benchmarks/nvidia_sm_partition.py --sms 94 run"
  timeout 150 $P benchmarks/nvidia_h200_moe.py kernels --tokens 1 4 --down-gemv 4,1024,4 4,256,4 8,256,4 16,256,4 \
    8,256,8 --gate-up-gemv 2,1024,4 4,512,4 8,256,4 --json "$OUT/moe_standin_kernels.json" > $LOGS/moe_standin_kernels.log 2>&1
  tail -12 $LOGS/moe_standin_kernels.log
  for tile in "" 4,256,4 8,256,4; do
    timeout 110 $P benchmarks/nvidia_h200_moe.py decode --tokenizer $MODEL ${tile:+--down-gemv $tile} \
      --json "$OUT/moe_standin_decode${tile:+_$tile}.json" > $LOGS/moe_standin_decode.log 2>&1
    echo "down ${tile:-default}: $(grep -iE "experts bf16" $LOGS/moe_standin_decode.log)"
  done
elif [ "$PART" = moe-tiles ]; then
  T="default down_gemv=4x1024x4 down_gemv=4x1024x4+down_prefetch=0"
  timeout 400 python3 benchmarks/nvidia_h200_moe.py decode --tokenizer $MODEL --moe-tiles-ab $T $T \
    --json "$OUT/moe_tiles.json" > $LOGS/moe_tiles.log 2>&1
  grep -iE "experts bf16" $LOGS/moe_tiles.log
elif [ "$PART" = figures ]; then
  timeout 300 python3 benchmarks/nvidia_h200_quantized.py bench --tokenizer $MODEL --decode bf16 w4a16 gguf_q4_k_m \
    gguf_q4_k_m_dequantized --throughput --json "$OUT/figures_quantized.json" > $LOGS/figures_quantized.log 2>&1
  grep -E "^decode|Error" $LOGS/figures_quantized.log
  dense_and_moe figures
elif [ "$PART" = l2-window ]; then
  timeout 150 python3 benchmarks/nvidia_l2_window.py --json "$OUT/l2_window.json" > $LOGS/l2_window.log 2>&1
  grep -E "us a segment|Error" $LOGS/l2_window.log
  timeout 60 python3 -m pytest -q -p no:cacheprovider plugins/nvidia/tests/test_decode_kernel.py \
    plugins/nvidia/tests/test_linear_norm.py -k l2 \
    > $LOGS/l2_tests.log 2>&1
  tail -1 $LOGS/l2_tests.log
  RUN=${STANDIN:+python3 benchmarks/nvidia_sm_partition.py --sms 94 run}; A=ENGINE_BENCH_L2_AHEAD; N=ENGINE_BENCH_L2_NEXT_QKV
  timeout 340 ${RUN:-python3} benchmarks/nvidia_h200_moe.py decode --tokenizer $MODEL \
    --env-ab $A=0+$N=0 $A=1+$N=0 $A=0+$N=1 $A=1+$N=1 \
    --json "$OUT/l2_ahead_moe${STANDIN:+_standin}.json" > $LOGS/l2_ahead_moe.log 2>&1
  grep -iE "experts bf16|Error" $LOGS/l2_ahead_moe.log
elif [ "$PART" = l2-dense ]; then
  RUN=${STANDIN:+python3 benchmarks/nvidia_sm_partition.py --sms 94 run}
  for s in 0 1 0 1; do
    ENGINE_BENCH_L2_AHEAD=$s timeout 110 ${RUN:-python3} benchmarks/nvidia_h200.py decode --model $MODEL \
      --json "$OUT/l2_ahead_dense_$s.json" > $LOGS/l2_dense.log 2>&1
    echo "dense L2 ahead $s: $(grep -E "decode_tok_s_graphs|end_to_end_ratio" $LOGS/l2_dense.log | tr -s ' ' | tr '\n' ' ')"
  done
elif [ "$PART" = norms ]; then
  timeout 120 python3 -m pytest -q -p no:cacheprovider plugins/nvidia/tests/test_pdl.py \
    plugins/nvidia/tests/test_linear_norm.py > $LOGS/norms_tests.log 2>&1
  tail -1 $LOGS/norms_tests.log
  R=ENGINE_NVIDIA_ROUTER_NORM; L=ENGINE_NVIDIA_LINEAR_NORM
  V="$R=0+$L=0 $R=1+$L=0 $R=1+$L=1"
  timeout 330 python3 benchmarks/nvidia_h200_moe.py decode --tokenizer $MODEL --env-ab $V $V \
    --json "$OUT/norms_moe.json" > $LOGS/norms_moe.log 2>&1
  grep -iE "experts bf16" $LOGS/norms_moe.log
  for s in 1 default 1 default; do
    if [ $s = 1 ]; then export $L=1; else unset $L; fi
    timeout 100 python3 benchmarks/nvidia_h200.py decode --model $MODEL --json "$OUT/norms_dense_$s.json" \
      > $LOGS/norms_dense.log 2>&1
    echo "dense q/k/v norm $s: $(grep -E "decode_tok_s_graphs|end_to_end_ratio" $LOGS/norms_dense.log | tr -s ' ' | tr '\n' ' ')"
  done
  unset $L
elif [ "$PART" = router-norm ]; then
  # the MoE router's GEMV with the residual norm in its programs (ENGINE_NVIDIA_ROUTER_NORM, session 58): its GPU
  # test, then batch-1 Qwen3-30B-A3B without / with it, twice round in one process (STANDIN=1: on 94 SMs)
  timeout 120 python3 -m pytest -q -p no:cacheprovider plugins/nvidia/tests/test_pdl.py > $LOGS/router_norm_tests.log 2>&1
  tail -1 $LOGS/router_norm_tests.log
  RUN=${STANDIN:+python3 benchmarks/nvidia_sm_partition.py --sms 94 run}; R=ENGINE_NVIDIA_ROUTER_NORM
  timeout 400 ${RUN:-python3} benchmarks/nvidia_h200_moe.py \
    decode --tokenizer $MODEL --env-ab $R=0 $R=1 $R=0 $R=1 --json "$OUT/router_norm${STANDIN:+_standin}.json" \
    > $LOGS/router_norm.log 2>&1
  grep -iE "experts bf16" $LOGS/router_norm.log
elif [ "$PART" = session56 ]; then
  timeout 100 python3 -m pytest -q -p no:cacheprovider plugins/nvidia/tests/test_dot_gemv_x_rows.py \
    plugins/nvidia/tests/test_dot_gemv_program_params.py > $LOGS/session56_tests.log 2>&1
  tail -1 $LOGS/session56_tests.log
  timeout 300 python3 benchmarks/nvidia_h200_quantized.py bench --tokenizer $MODEL --decode bf16 w4a16 gguf_q4_k_m \
    gguf_q4_k_m_dequantized --grouped-tiles ${TILES:-dot_gemv_rows=8,dot_gemv_prepared=0,dot_gemv_program_params_zero_point=0} \
    --decode-batch 2 --throughput --json "$OUT/session56_decode.json" > $LOGS/session56_decode.log 2>&1
  grep -E "^decode" $LOGS/session56_decode.log
  dense_and_moe session56
elif [ "$PART" = session54 ]; then
  timeout 100 python3 -m pytest -q -p no:cacheprovider plugins/nvidia/tests/test_dot_gemv_x_rows.py \
    plugins/nvidia/tests/test_dot_gemv_residual_norm.py > $LOGS/session54_tests.log 2>&1
  tail -1 $LOGS/session54_tests.log
  timeout 300 python3 benchmarks/nvidia_h200_quantized.py bench --tokenizer $MODEL --decode bf16 w4a16 gguf_q4_k_m \
    gguf_q4_k_m_dequantized --grouped-tiles ${TILES:-dot_gemv_x_rows=1 dot_gemv_prepared=1} --decode-batch 2 \
    --throughput --json "$OUT/session54_decode.json" > $LOGS/session54_decode.log 2>&1
  grep -E "^decode" $LOGS/session54_decode.log
  dense_and_moe session54
elif [ "$PART" = session53 ]; then
  timeout 100 python3 -m pytest -q -p no:cacheprovider plugins/nvidia/tests/test_dot_gemv_residual_norm.py \
    plugins/nvidia/tests/test_decode_kernel.py -m "not slow" > $LOGS/session53_tests.log 2>&1
  tail -1 $LOGS/session53_tests.log
  timeout 280 python3 benchmarks/nvidia_h200_quantized.py bench --tokenizer $MODEL --decode bf16 w4a16 gguf_q4_k_m \
    gguf_q4_k_m_dequantized --grouped-tiles ${TILES:-dot_gemv_prepared=1 dot_gemv_prepared=1,dot_gemv_rows=16} \
    --throughput --json "$OUT/session53_decode.json" > $LOGS/session53_decode.log 2>&1
  grep -E "^decode" $LOGS/session53_decode.log
  dense_and_moe session53
elif [ "$PART" = session52 ]; then
  timeout 100 python3 -m pytest -q -p no:cacheprovider plugins/nvidia/tests/test_dot_gemv_residual_norm.py \
    plugins/nvidia/tests/test_decode_kernel.py -m "not slow" > $LOGS/session52_tests.log 2>&1
  tail -1 $LOGS/session52_tests.log
  timeout 280 python3 benchmarks/nvidia_h200_quantized.py bench --tokenizer $MODEL --decode bf16 w4a16 gguf_q4_k_m \
    gguf_q4_k_m_dequantized --grouped-tiles ${TILES:-dot_gemv_prepared=1 six_bit_min_rows=65536} --decode-batch 4 \
    --throughput --json "$OUT/session52_decode.json" > $LOGS/session52_decode.log 2>&1
  grep -E "^decode" $LOGS/session52_decode.log
  timeout 150 python3 benchmarks/nvidia_h200_moe.py decode --tokenizer $MODEL --long-prompt 2048 \
    --json "$OUT/session52_moe.json" > $LOGS/session52_moe.log 2>&1
  grep -iE "experts bf16" $LOGS/session52_moe.log
elif [ "$PART" = session51 ]; then
  timeout 150 python3 -m pytest -q -p no:cacheprovider plugins/nvidia/tests/test_dot_gemv_row_blocks.py > $LOGS/session51_tests.log 2>&1
  tail -1 $LOGS/session51_tests.log
  timeout 300 python3 benchmarks/nvidia_h200_quantized.py bench --tokenizer $MODEL --decode gguf_q4_k_m bf16 \
    gguf_q4_k_m_dequantized w4a16 --grouped-tiles ${TILES:-dot_gemv_row_blocks=1 six_bit_codes=1} \
    --decode-batch 4 --throughput --json "$OUT/session51_decode.json" > $LOGS/session51_decode.log 2>&1
  grep -E "^decode" $LOGS/session51_decode.log
  timeout 100 python3 benchmarks/nvidia_h200_moe.py decode --tokenizer $MODEL --json "$OUT/session51_moe.json" \
    > $LOGS/session51_moe.log 2>&1
  grep -iE "experts bf16" $LOGS/session51_moe.log
elif [ "$PART" = session50 ]; then
  timeout 150 python3 -m pytest -q -p no:cacheprovider plugins/nvidia/tests/test_dot_gemv.py \
    plugins/nvidia/tests/test_dot_gemv_program_params.py plugins/nvidia/tests/test_dot_gemv_residual_norm.py \
    plugins/nvidia/tests/test_six_bit_codes.py > $LOGS/session50_tests.log 2>&1
  tail -1 $LOGS/session50_tests.log
  timeout 280 python3 benchmarks/nvidia_h200_quantized.py bench --tokenizer $MODEL --decode gguf_q4_k_m \
    --grouped-tiles six_bit_min_rows=65536 six_bit_codes=1 dot_gemv_narrow_rows=4 dot_gemv_vector_masks=1 \
    --decode-batch 4 --throughput --json "$OUT/session50_gguf.json" > $LOGS/session50_gguf.log 2>&1
  grep -E "^decode" $LOGS/session50_gguf.log
  timeout 200 python3 benchmarks/nvidia_h200_quantized.py bench --tokenizer $MODEL --decode w4a16 \
    --grouped-tiles dot_gemv_vector_masks=1 dot_gemv_vector_masks=1,dot_gemv_max_registers=128 \
    dot_gemv_residual_norm=1 --decode-batch 4 --throughput \
    --json "$OUT/session50_w4a16.json" > $LOGS/session50_w4a16.log 2>&1
  grep -E "^decode" $LOGS/session50_w4a16.log
elif [ "$PART" = program-params ]; then
  timeout 60 python3 -m pytest -q -p no:cacheprovider plugins/nvidia/tests/test_dot_gemv_program_params.py > $LOGS/pp_tests.log 2>&1
  tail -1 $LOGS/pp_tests.log
  for round in 1 2; do
    timeout 190 python3 benchmarks/nvidia_h200_quantized.py bench --tokenizer $MODEL --decode gguf_q4_k_m w4a16 \
      --grouped-tiles dot_gemv_program_params=0 dot_gemv_program_params_zero_point=1 --throughput \
      --json "$OUT/program_params_$round.json" > $LOGS/program_params.log 2>&1
    grep -E "^decode" $LOGS/program_params.log
  done
elif [ "$PART" = routing ]; then
  timeout 60 python3 -m pytest -q -p no:cacheprovider plugins/nvidia/tests/test_moe_topk_kernel.py > $LOGS/routing_tests.log 2>&1
  tail -2 $LOGS/routing_tests.log
  for round in 1 2; do
    timeout 85 python3 benchmarks/nvidia_h200_moe.py decode --tokenizer $MODEL \
      --routing-kernel-from .nvcarry/routing_kernel_before.py --json "$OUT/routing_before_$round.json" > $LOGS/routing_before.log 2>&1
    timeout 85 python3 benchmarks/nvidia_h200_moe.py decode --tokenizer $MODEL --json "$OUT/routing_after_$round.json" \
      > $LOGS/routing_after.log 2>&1
    echo "round $round before: $(grep -h 'experts bf16' $LOGS/routing_before.log)"
    echo "round $round after:  $(grep -h 'experts bf16' $LOGS/routing_after.log)"
  done
elif [ "$PART" = confirm ]; then
  timeout 330 python3 benchmarks/nvidia_h200_quantized.py bench --tokenizer $MODEL --decode bf16 w4a16 gguf_q4_k_m \
    gguf_q4_k_m_dequantized --decode-batch 4 --throughput --json "$OUT/confirm_decode.json" > $LOGS/confirm_decode.log 2>&1
  grep -E "^decode" $LOGS/confirm_decode.log
elif [ "$PART" = next ]; then
  timeout 110 python3 -m pytest -q -p no:cacheprovider plugins/nvidia/tests/test_six_bit_codes.py \
    plugins/nvidia/tests/test_dot_gemv.py > $LOGS/next_tests.log 2>&1
  tail -3 $LOGS/next_tests.log
  timeout 100 python3 benchmarks/nvidia_h200_quantized.py check --one-at-a-time --grouped-tiles six_bit_codes=1 \
    --json "$OUT/next_check.json" > $LOGS/next_check.log 2>&1
  grep -E "greedy" $LOGS/next_check.log
  timeout 370 python3 benchmarks/nvidia_h200_quantized.py bench --tokenizer $MODEL --decode bf16 w4a16 gguf_q4_k_m \
    gguf_q4_k_m_dequantized --grouped-tiles ${TILES:-six_bit_codes=1 dot_gemv_early_params=0 dot_gemv_row_groups=2} \
    --decode-batch 4 --throughput --json "$OUT/next_decode.json" > $LOGS/next_decode.log 2>&1
  grep -E "^decode" $LOGS/next_decode.log
  python3 benchmarks/decode_variants_table.py "$OUT/next_decode.json"
elif [ "$PART" = six-bit-rows ]; then
  timeout 100 python3 -m pytest -q -p no:cacheprovider plugins/nvidia/tests/test_six_bit_codes.py > $LOGS/six_rows_tests.log 2>&1
  tail -2 $LOGS/six_rows_tests.log
  timeout 420 python3 benchmarks/nvidia_h200_quantized.py bench --tokenizer $MODEL --decode gguf_q4_k_m gguf_q5_k_m \
    gguf_q4_k_m_dequantized --grouped-tiles ${TILES:-six_bit_codes=1} --decode-batch 4 --throughput \
    --json "$OUT/six_rows_decode.json" > $LOGS/six_rows_decode.log 2>&1
  grep -E "^decode" $LOGS/six_rows_decode.log
  python3 benchmarks/decode_variants_table.py "$OUT/six_rows_decode.json"
elif [ "$PART" = q3 ]; then
  gguf_plan q3 gguf_q3_k_m
elif [ "$PART" = iq4 ]; then
  gguf_plan iq4 gguf_iq4_xs
elif [ "$PART" = groups ]; then
  for group in 128 32; do
    timeout 100 python3 benchmarks/nvidia_h200_word_gemv.py --rows 1 --group $group --fragment-warps --dot-rows 8 \
      --dot-warps 4 --dot-row-groups 1 2 3 --shapes qkv o_proj gate_up --json "$OUT/groups_kernels_g$group.json" \
      > $LOGS/groups_kernels_g$group.log 2>&1
    grep -E "dot" $LOGS/groups_kernels_g$group.log
  done
  timeout 330 python3 benchmarks/nvidia_h200_quantized.py bench --tokenizer $MODEL --decode bf16 w4a16 gguf_q4_k_m \
    --grouped-tiles ${TILES:-dot_gemv_row_groups=2 dot_gemv_row_groups=3} --throughput \
    --json "$OUT/groups_decode.json" > $LOGS/groups_decode.log 2>&1
  grep -E "^decode" $LOGS/groups_decode.log
  python3 benchmarks/decode_variants_table.py "$OUT/groups_decode.json"
elif [ "$PART" = q5 ]; then
  gguf_plan q5 gguf_q5_k_m
elif [ "$PART" = six-bit ]; then
  timeout 150 python3 -m pytest -q -p no:cacheprovider plugins/nvidia/tests/test_six_bit_codes.py \
    plugins/nvidia/tests/test_gguf_grouped.py plugins/nvidia/tests/test_dot_gemv.py > $LOGS/six_bit_tests.log 2>&1
  tail -3 $LOGS/six_bit_tests.log
  timeout 400 python3 benchmarks/nvidia_h200_quantized.py bench --tokenizer $MODEL --decode bf16 gguf_q4_k_m \
    gguf_q4_k_m_dequantized --grouped-tiles ${TILES:-six_bit_codes=1 six_bit_codes=1,dot_gemv_six_bit_rows=4} \
    --decode-batch 4 --throughput --json "$OUT/six_bit_decode.json" > $LOGS/six_bit_decode.log 2>&1
  grep -E "^decode" $LOGS/six_bit_decode.log
elif [ "$PART" = gguf ]; then
  timeout 150 python3 benchmarks/nvidia_h200_word_gemv.py --rows 1 --group 32 --fragment-warps --dot-rows 4 8 \
    --dot-warps 2 4 --dot-ahead 0 1 --shapes qkv o_proj gate_up down --json "$OUT/gguf_dot_kernels.json" \
    > $LOGS/gguf_dot_kernels.log 2>&1
  grep -E "zero scales" $LOGS/gguf_dot_kernels.log | grep -E "default|dot"
  timeout 330 python3 benchmarks/nvidia_h200_quantized.py bench --tokenizer $MODEL --decode bf16 gguf_q4_k_m \
    --grouped-tiles ${TILES:-dot_gemv_rows=4 dot_gemv_ahead_all=1 dot_gemv_rows=4,dot_gemv_ahead_all=1} --profile 12 \
    --throughput --json "$OUT/gguf_decode.json" > $LOGS/gguf_decode.log 2>&1
  grep -E "^decode|us/step|grouped_int|gemv|paged|merge|norm" $LOGS/gguf_decode.log
elif [ "$PART" = params ]; then
  timeout 60 python3 -m pytest -q -p no:cacheprovider plugins/nvidia/tests/test_dot_gemv.py -k "after_the_wait" \
    > $LOGS/params_tests.log 2>&1
  tail -1 $LOGS/params_tests.log
  timeout 400 python3 benchmarks/nvidia_h200_quantized.py bench --tokenizer $MODEL --decode bf16 w4a16 gguf_q4_k_m \
    --grouped-tiles ${TILES:-dot_gemv_early_params=0 dot_gemv_early_params=0,dot_gemv_prefetch_params=1 dot_gemv_max_registers=80} \
    --throughput --json "$OUT/params_decode.json" > $LOGS/params_decode.log 2>&1
  grep -E "^decode" $LOGS/params_decode.log
elif [ "$PART" = overlap ]; then
  timeout 150 python3 -m pytest -q -p no:cacheprovider plugins/nvidia/tests/test_step_overlap.py > $LOGS/overlap_tests.log 2>&1
  tail -4 $LOGS/overlap_tests.log
  timeout 300 python3 benchmarks/nvidia_h200_overlap.py --tokenizer $MODEL --json "$OUT/overlap_steps.json" \
    > $LOGS/overlap_steps.log 2>&1
  tail -8 $LOGS/overlap_steps.log
elif [ "$PART" = overlap-e2e ]; then
  for variant in "whole" "dbo 0" "dbo 16" "dbo 32"; do
    set -- $variant; tag="$1${2:+_sms$2}"
    flags=""; [ "$1" = dbo ] && flags="--enable-dbo"
    ENGINE_NVIDIA_DBO_ATTENTION_SMS=${2:-0} timeout 140 python3 benchmarks/nvidia_h200.py throughput --model $MODEL \
      --hf-batch $flags --json "$OUT/throughput_$tag.json" > $LOGS/throughput_$tag.log 2>&1
    echo "throughput [$variant]"; grep -E "engine_output_tok_s|kernels_compiled" $LOGS/throughput_$tag.log
  done
elif [ "$PART" = overlap-fp8 ]; then
  for variant in "whole" "dbo ${SMS:-16}"; do
    set -- $variant; tag="fp8_$1${2:+_sms$2}"
    flags=""; [ "$1" = dbo ] && flags="--enable-dbo"
    ENGINE_NVIDIA_DBO_ATTENTION_SMS=${2:-0} timeout 200 python3 benchmarks/nvidia_h200.py throughput --model $MODEL \
      --hf-batch --quantization fp8 --kv-cache-dtype fp8 $flags --json "$OUT/throughput_$tag.json" \
      > $LOGS/throughput_$tag.log 2>&1
    echo "throughput [fp8 $variant]"; grep -E "engine_output_tok_s|kernels_compiled" $LOGS/throughput_$tag.log
  done
else
  timeout 380 python3 benchmarks/nvidia_h200_quantized.py bench --tokenizer $MODEL --decode bf16 w4a16 gguf_q4_k_m \
    --decode-batch 2 4 8 --grouped-tiles gated_epilogue=0 gemv_gated_epilogue=1 fragment_min_rows=1 \
    --throughput --json "$OUT/quantized_decode.json" > $LOGS/quantized_decode.log 2>&1
  grep -E "^decode" $LOGS/quantized_decode.log
  timeout 110 python3 benchmarks/nvidia_h200_moe.py decode --tokenizer $MODEL > $LOGS/moe_decode.log 2>&1
  echo "moe decode"; tail -3 $LOGS/moe_decode.log
fi
cp $LOGS/*.log "$OUT/" 2>/dev/null
