"""``engine serve``'s LoRA options: mistakes are one line and a non-zero exit, before the model loads
when the command line alone shows them; a broken adapter fails start-up in one line."""

from __future__ import annotations

import json
import os

import pytest

from engine.entrypoints.cli import main
from engine.entrypoints.lora_args import runtime_lora_updating
from engine_test_utils import run_cli


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--enable-lora", "--lora-modules", "no-equals-sign"], "expected NAME=PATH"),
        (["--enable-lora", "--lora-modules", "name="], "expected NAME=PATH"),
        (["--enable-lora", "--lora-modules", "{not json"], "not valid JSON"),
        (["--enable-lora", "--lora-modules", '{"name": "a"}'], "'path' must be a non-empty string"),
        (["--enable-lora", "--lora-modules", '{"name": "a", "path": "/tmp", "rank": 8}'], "unknown key(s) rank"),
        (["--enable-lora", "--lora-modules", "a=/no/such/folder"], "is not a folder"),
        (["--enable-lora", "--lora-modules", "a=/tmp", "a=/tmp"], "given twice"),
        (["--enable-lora", "--served-model-name", "a", "--lora-modules", "a=/tmp"], "--served-model-name"),
        (["--lora-modules", "a=/tmp"], "--lora-modules needs --enable-lora"),
        (["--max-loras", "2", "--allow-runtime-lora-updating"], "need --enable-lora"),
        (["--enable-lora", "--max-loras", "4", "--max-cpu-loras", "2"], "must be at least max_loras"),
        (["--enable-lora", "--max-lora-rank", "0"], "--max-lora-rank"),
    ],
)
def test_lora_option_mistakes_are_one_line(argv, expected, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["serve", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("engine serve: error:") and len(err.splitlines()) == 1, err
    assert expected in err


def test_runtime_updating_follows_the_flag_or_the_environment(monkeypatch):
    from argparse import Namespace

    for name in ("ENGINE_ALLOW_RUNTIME_LORA_UPDATING", "VLLM_ALLOW_RUNTIME_LORA_UPDATING"):
        monkeypatch.delenv(name, raising=False)
    assert not runtime_lora_updating(Namespace(enable_lora=True, allow_runtime_lora_updating=False))
    assert runtime_lora_updating(Namespace(enable_lora=True, allow_runtime_lora_updating=True))
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    assert runtime_lora_updating(Namespace(enable_lora=True, allow_runtime_lora_updating=False))
    # without LoRA there is nothing to update
    assert not runtime_lora_updating(Namespace(enable_lora=False, allow_runtime_lora_updating=False))
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "0")
    monkeypatch.setenv("ENGINE_ALLOW_RUNTIME_LORA_UPDATING", "1")
    assert runtime_lora_updating(Namespace(enable_lora=True, allow_runtime_lora_updating=False))


@pytest.mark.slow
def test_a_broken_start_up_adapter_is_one_line(tmp_path, tiny_llama_dir, tiny_llama_loras):
    good = tiny_llama_loras["attn-r8"]
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8, "lora_alpha": 16}))
    result = run_cli(
        "serve", "--model", tiny_llama_dir, "--device", "cpu", "--dtype", "float32", "--kv-cache-memory", "32MiB",
        "--enable-lora", "--lora-modules", f"good={good}", f"bad={broken}",
    )  # fmt: skip
    assert result.returncode == 1
    assert "Traceback" not in result.stderr, result.stderr
    # start-up progress is logged at INFO; everything else on stderr is the one error line
    lines = [line for line in result.stderr.splitlines() if line.strip() and not line.startswith("INFO ")]
    assert len(lines) == 1 and lines[0].startswith("error: --lora-modules bad:"), result.stderr
    assert os.fspath(broken) in lines[0] and "adapter_model" in lines[0]
