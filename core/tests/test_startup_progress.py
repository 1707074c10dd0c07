"""Start-up says what it does and how long it took; ``plugins list`` stays cheap; the tokenizer exports."""

from __future__ import annotations

import importlib.metadata
import logging
import os
import subprocess
import sys

import pytest

from engine import LLM
from engine.entrypoints.cli import main


def test_each_start_up_phase_says_what_it_did_and_how_long_it_took(tiny_llama_dir, caplog):
    caplog.set_level(logging.INFO)
    LLM(model=tiny_llama_dir, device="cpu", dtype="float32", kv_cache_memory_bytes=16 << 20, max_model_len=128)
    messages = [r.getMessage() for r in caplog.records]
    for started, finished in [
        (f"loading the tokenizer of {tiny_llama_dir}...", "loaded the tokenizer in "),
        (f"loading the weights of {tiny_llama_dir}...", "loaded the weights in "),
    ]:
        assert started in messages, messages
        assert any(m.startswith(finished) and m.endswith(" s") for m in messages), messages
    assert f"tokenizer files (for tools that load a tokenizer from a folder): {tiny_llama_dir}" in messages


def test_plugins_list_imports_no_torch_on_a_cpu_build():
    if "+cpu" not in importlib.metadata.version("torch"):
        pytest.skip("only a CPU build of torch tells it has no GPU runtime without being imported")
    code = (
        "import sys\n"
        "from engine.entrypoints.cli import main\n"
        "assert main(['plugins', 'list']) == 0\n"
        "heavy = sorted(m for m in ('torch', 'jax', 'triton', 'transformers') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "cpu " in proc.stdout and "CPU-only" in proc.stdout, proc.stdout


def test_export_tokenizer_writes_a_folder_hf_loads(tmp_path, tiny_llama_dir, capsys):
    from transformers import AutoTokenizer

    out = tmp_path / "tok"
    assert main(["export-tokenizer", str(out), "--model", tiny_llama_dir]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    exported = AutoTokenizer.from_pretrained(str(out))
    original = AutoTokenizer.from_pretrained(tiny_llama_dir)
    text = "The capital of France is Paris."
    assert exported.encode(text) == original.encode(text)
    assert os.path.isfile(out / "tokenizer_config.json")


def test_export_tokenizer_refuses_a_missing_model_in_one_line(tmp_path, capsys):
    assert main(["export-tokenizer", str(tmp_path / "tok"), "--model", str(tmp_path / "missing")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "does not exist" in err and len(err.splitlines()) == 1
