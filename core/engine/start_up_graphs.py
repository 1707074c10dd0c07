"""Start-up work on the loaded model, after the KV pool: the decode graphs (on every rank), the speculative
verification graphs, the graphs of lone prompt chunks, and the warm-up steps that compile the platform's
kernels before the first request."""

from __future__ import annotations

import logging

import torch

from engine.config import EngineConfig
from engine.errors import EngineConfigError
from engine.interfaces.platform import Platform
from engine.model_runner import ModelRunner
from engine.models.config import ModelConfig
from engine.parallel.rank_graphs import GraphPlan, build_decode_graphs
from engine.parallel.rank_workers import RankWorkers
from engine.phases import timed_phase
from engine.prefill_graphs import MAX_PREFILL_GRAPH_TOKENS, PrefillGraphs
from engine.verify_graphs import VerifyGraphs
from engine.warm_up import run_warm_up, warm_up_batches

logger = logging.getLogger(__name__)


def capture_and_warm_up(
    config: EngineConfig,
    platform: Platform,
    model_config: ModelConfig,
    runner: ModelRunner,
    max_model_len: int,
    workers: RankWorkers | None = None,
) -> None:
    """Record decode graphs (on every rank, with ``workers``) and run the warm-up steps, as the platform's
    capabilities ask.

    Raises:
        EngineConfigError: the largest step does not fit in the device memory beside the KV cache.
        engine.parallel.mp_workers.WorkerFailed: a rank refused the graphs or failed recording them.
    """
    model, kv_caches, block_size = runner.model, runner.layer_caches, config.cache.block_size
    # a pooling model never decodes: no decode graphs to record, no decode steps to warm up; a target that
    # keeps its layers' inputs for an EAGLE-3 head decodes eagerly (a graph returns the output alone)
    generates = getattr(model, "generates", True)
    graphs = generates and not getattr(model, "aux_hidden_layers", ())
    if not config.enforce_eager and platform.capabilities().graph_capture and graphs:
        runner.decode_graphs = build_decode_graphs(
            config, platform, model_config, model, kv_caches, runner.device, max_model_len, runner.kv_layout,
            lora_slots=runner.lora.config.max_loras if runner.lora is not None else 0,
        )  # fmt: skip
        # DecodeGraphs.capture logs what it captured and how long it took
        logger.info("capturing decode graphs (batches of up to %d sequences)...", config.scheduler.max_num_seqs)
        if workers is None:
            runner.decode_graphs.capture()
        else:
            workers.capture_graphs(GraphPlan.of(runner.decode_graphs), runner.decode_graphs.capture)
        spec = config.speculative_config
        verify_graphs = platform.capabilities().graph_capture_verify
        if spec is not None and verify_graphs and workers is None and runner.lora is None and runner.kv_layout is None:
            runner.verify_graphs = VerifyGraphs(
                model, kv_caches, platform.make_graph_capture(), config.scheduler.max_num_seqs,
                spec.num_speculative_tokens + 1, max_model_len, block_size, runner.device, model_config.sliding_window,
                greedy=runner.sampler.greedy_on_device,
            )  # fmt: skip
            runner.verify_graphs.capture()
        prompt_tokens = min(MAX_PREFILL_GRAPH_TOKENS, config.scheduler.max_num_batched_tokens, max_model_len)
        recorded_prompts = platform.capabilities().graph_capture_prefill and prompt_tokens >= 2
        if recorded_prompts and workers is None and runner.lora is None and runner.kv_layout is None:
            runner.prefill_graphs = PrefillGraphs(
                model, kv_caches, platform.make_graph_capture(), prompt_tokens, max_model_len, block_size,
                runner.device, model_config.sliding_window,
            )  # fmt: skip
            runner.prefill_graphs.capture()
    # (other ranks skip the warm-up: its dummy steps would have to run on every rank)
    if platform.capabilities().warm_up and workers is None:
        batches = warm_up_batches(
            config.scheduler.max_num_batched_tokens, config.scheduler.max_num_seqs, max_model_len,
            block_size, eager_decode=runner.decode_graphs is None and generates,
            whole_prompts=getattr(model, "needs_whole_prompt", False),
        )  # fmt: skip
        try:
            with timed_phase(f"warming up the kernels ({len(batches)} steps of the shapes serving runs)", "warmed up"):
                run_warm_up(
                    model, kv_caches, batches, block_size, runner.device, model_config.sliding_window, runner.kv_layout,
                    greedy=runner.sampler.greedy_on_device if generates else None,
                    mask=runner.mask_every_row if generates else None,
                    lora_slots=runner.lora.config.max_loras if runner.lora is not None else 0,
                )
        except torch.OutOfMemoryError as exc:
            # found at start-up rather than by the first long prompt mid-serving
            raise EngineConfigError(
                f"a step of {config.scheduler.max_num_batched_tokens} tokens does not fit in the device memory "
                "left beside the KV cache; lower --max-num-batched-tokens or --kv-cache-memory"
            ) from exc
