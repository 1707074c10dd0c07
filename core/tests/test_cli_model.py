"""``engine generate`` and ``engine chat`` with the embedded model, as a user runs them."""

from __future__ import annotations

import io
import os

import pytest

from engine.entrypoints.cli import main
from engine_test_utils import run_cli


@pytest.mark.slow
def test_generate_streams_text(capsys):
    # the CLI's main() in this process: the same code path as the console script, without a second
    # interpreter importing torch and loading the model
    code = main(["generate", "The capital of France is", "--max-tokens", "8", "--temperature", "0",
                 "--kv-cache-memory", "32MiB"])  # fmt: skip
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "Paris" in out.out


@pytest.mark.slow
def test_chat_keeps_history(capsys, monkeypatch):
    stdin = "What is the capital of France?\nRepeat your previous answer word for word.\n/exit\n"
    monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    code = main(["chat", "--temperature", "0", "--max-tokens", "16", "--kv-cache-memory", "32MiB"])
    out = capsys.readouterr()
    assert code == 0, out.err
    replies = [line for line in out.out.splitlines() if line.strip()]
    assert len(replies) >= 2 and "Paris" in replies[0]
    assert "Paris" in out.out.split(replies[0], 1)[1]  # the second answer saw the first


class _Code:
    """Pickles as a call of os.getcwd: what a malicious checkpoint does with os.system."""

    def __reduce__(self):
        return (os.getcwd, ())


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["code", "corrupt"])
def test_a_pickled_weight_file_that_fails_to_load_is_one_line(tmp_path, kind):
    """A pytorch_model.bin holding more than tensors, or a damaged pickle, is refused in one line."""
    import torch
    from tokenizers import Tokenizer, models
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, max_position_embeddings=256, architectures=["LlamaForCausalLM"]
                ).save_pretrained(tmp_path)  # fmt: skip
    # a tokenizer of a few words: the engine loads it before the weights, and a real one (49152 tokens)
    # takes the child a second or two more
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "hi": 3}
    PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")), unk_token="<unk>", bos_token="<s>",
        eos_token="</s>",
    ).save_pretrained(tmp_path)
    weights = tmp_path / "pytorch_model.bin"
    if kind == "code":
        torch.save({"model.embed_tokens.weight": _Code()}, weights)
    else:
        torch.save({"model.embed_tokens.weight": torch.zeros(4, 4)}, weights)
        data = bytearray(weights.read_bytes())
        start = data.find(b"data.pkl") + 60  # into the pickle stream of the zip's first member
        data[start : start + 40] = bytes(b ^ 0x5A for b in data[start : start + 40])
        weights.write_bytes(bytes(data))
    result = run_cli("generate", "hi", "--model", str(tmp_path), "--device", "cpu", "--max-tokens", "2")
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr
    # start-up progress is logged at INFO; everything else on stderr is the one error line
    lines = [line for line in result.stderr.splitlines() if line.strip() and not line.startswith("INFO ")]
    assert len(lines) == 1 and lines[0].startswith("error: cannot read weight file"), result.stderr
    assert "pytorch_model.bin" in lines[0]
