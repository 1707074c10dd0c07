"""Encoder models (BERT, XLM-RoBERTa) on tiny seeded checkpoints with a real WordPiece tokenizer built
here: embeddings against sentence-transformers (cosine >= 0.9999) and cross-encoder scores against HF
transformers (within 1e-4), in float32, and the CPU's bf16 fast path; prompts computed whole in one step,
batched together."""

from __future__ import annotations

import os
import re

import pytest
import torch
from test_embeddings import st_embeddings

from engine import LLM, PoolingParams, SamplingParams
from engine.errors import InvalidRequestError
from engine_test_utils import assert_all_blocks_free, write_sentence_transformers_files

TEXTS = [
    "The food was delicious and the waiter was kind.",
    "A quick brown fox jumps over the lazy dog!",
    "Paris is the capital of France.",
    "What is the capital of France?",
]
DOCUMENTS = ["Paris is the capital of France.", "Bananas are yellow.", "The lazy dog sleeps."]
SPECIALS = ["[PAD]", "[unused0]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def save_wordpiece_tokenizer(out: str) -> int:
    """A BERT WordPiece tokenizer over the test texts' words (id 1 unused: XLM-R's padding id)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import BertTokenizerFast

    words = sorted({w for t in TEXTS + DOCUMENTS for w in re.findall(r"\w+|[^\w\s]", t.lower())})
    vocab = {tok: i for i, tok in enumerate(SPECIALS + words)}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", 3), ("[SEP]", 4)]
    )
    fast = BertTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", sep_token="[SEP]", cls_token="[CLS]", pad_token="[PAD]", mask_token="[MASK]")
    fast.save_pretrained(out)
    return len(vocab)


def save_encoder(kind: str, out: str, labels: int | None = None, pooling: str = "mean_tokens") -> str:
    import transformers

    os.makedirs(out, exist_ok=True)
    vocab = save_wordpiece_tokenizer(out)
    common = dict(vocab_size=vocab, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256)
    if kind == "bert":
        config = transformers.BertConfig(**common, max_position_embeddings=64, type_vocab_size=2)
        cls = transformers.BertForSequenceClassification if labels else transformers.BertModel
    else:
        config = transformers.XLMRobertaConfig(**common, max_position_embeddings=66, type_vocab_size=1, pad_token_id=1)
        cls = transformers.XLMRobertaForSequenceClassification if labels else transformers.XLMRobertaModel
    if labels:
        config.num_labels = labels
    torch.manual_seed(0)
    model = cls(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
            else:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(out)
    if not labels:
        write_sentence_transformers_files(out, 128, pooling)
    return out


def _llm(path: str, **kwargs) -> LLM:
    return LLM(model=path, device="cpu", dtype="float32", kv_cache_memory_bytes=16 << 20, **kwargs)


@pytest.mark.parametrize(("kind", "pooling"), [("bert", "mean_tokens"), ("bert", "cls_token"), ("xlmr", "mean_tokens")])
def test_encoder_embeddings_match_sentence_transformers(kind, pooling, tmp_path):
    path = save_encoder(kind, str(tmp_path), pooling=pooling)
    expected = st_embeddings(path, TEXTS)
    llm = _llm(path)
    got = torch.stack([torch.tensor(o.outputs.embedding) for o in llm.embed(TEXTS, use_tqdm=False)])
    assert torch.nn.functional.cosine_similarity(got.double(), expected.double()).min() >= 0.9999
    with pytest.raises(InvalidRequestError, match="no LM head"):
        llm.generate(TEXTS[0], SamplingParams(max_tokens=2), use_tqdm=False)
    assert_all_blocks_free(llm)


def test_bf16_embeddings_on_the_cpu_fast_path(tmp_path, monkeypatch):
    """bf16 on the CPU: prepacked products with the up projection's GELU fused in and, on a CPU with AMX,
    attention on tiles; against sentence-transformers in float32 (a bf16 model's cosine) and against the
    same engine with the tile kernels turned off."""
    from engine_plugin_cpu.native_build import amx_usable

    path = save_encoder("bert", str(tmp_path), pooling="mean_tokens")
    expected = st_embeddings(path, TEXTS)

    def embed() -> tuple[torch.Tensor, LLM]:
        llm = LLM(model=path, device="cpu", dtype="bfloat16", kv_cache_memory_bytes=16 << 20)
        outputs = llm.embed(TEXTS, use_tqdm=False)
        return torch.stack([torch.tensor(o.outputs.embedding) for o in outputs]).double(), llm

    got, llm = embed()
    native = llm.llm_engine.model.attention.native
    assert (native is not None and native.amx) == (amx_usable() and native is not None)
    assert torch.nn.functional.cosine_similarity(got, expected.double()).min() >= 0.999
    assert_all_blocks_free(llm)
    monkeypatch.setenv("ENGINE_CPU_AMX", "0")
    plain, llm = embed()
    assert llm.llm_engine.model.attention.native is None or not llm.llm_engine.model.attention.native.amx
    assert torch.nn.functional.cosine_similarity(got, plain).min() >= 0.9995


@pytest.mark.parametrize("kind", ["bert", "xlmr"])
def test_cross_encoder_scores_match_hf(kind, tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = save_encoder(kind, str(tmp_path), labels=1)
    llm = _llm(path)
    scores = [o.outputs.score for o in llm.score(TEXTS[3], DOCUMENTS, use_tqdm=False)]
    hf = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    with torch.no_grad():
        # XLM-RoBERTa has one token type: its tokenizers send none (this BERT tokenizer would)
        batch = tokenizer([TEXTS[3]] * 3, DOCUMENTS, padding=True, return_tensors="pt", return_token_type_ids=kind == "bert")
        logits = hf(**batch).logits[:, 0]
    assert scores == pytest.approx(torch.sigmoid(logits).tolist(), abs=1e-4)
    assert_all_blocks_free(llm)


def test_an_encoder_prompt_is_never_chunked(tmp_path, tiny_llama_dir):
    path = save_encoder("bert", str(tmp_path))
    # an encoder's step budget is the platform's encoder budget unless given (a step is one forward over
    # whole prompts); a decoder's stays the default
    from engine_plugin_cpu.platform import ENCODER_STEP_TOKENS

    assert _llm(path).llm_engine.config.scheduler.max_num_batched_tokens == ENCODER_STEP_TOKENS
    assert _llm(tiny_llama_dir, runner="pooling").llm_engine.config.scheduler.max_num_batched_tokens == 2048
    llm = _llm(path, max_num_batched_tokens=10)
    assert llm.llm_engine.config.scheduler.max_num_batched_tokens == 10
    short = llm.embed(["Bananas are yellow."], use_tqdm=False)  # 6 tokens: fits one step; the next has 12
    assert len(short[0].outputs.embedding) == 128
    with pytest.raises(InvalidRequestError, match="computes a prompt in one step"):
        llm.embed([TEXTS[0]], use_tqdm=False)


def test_a_cls_pooled_step_runs_the_last_layer_past_attention_for_its_cls_rows_only(tmp_path, monkeypatch):
    """CLS pooling reads one row a prompt: the model's last layer takes only those rows past its attention,
    with the same embeddings as the whole step; MEAN pooling (every row) computes every row."""
    path = save_encoder("bert", str(tmp_path), pooling="cls_token")
    llm = _llm(path)
    model = llm.llm_engine.model
    seen: list[torch.Tensor | None] = []
    forward = model.forward

    def spy(*args, **kwargs):
        seen.append(kwargs.get("output_rows"))
        return forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", spy)

    lengths: list[int] = []

    def embed(params: PoolingParams | None = None) -> torch.Tensor:
        outputs = llm.embed(TEXTS, pooling_params=params, use_tqdm=False)
        lengths[:] = [len(o.prompt_token_ids) for o in outputs]
        return torch.stack([torch.tensor(o.outputs.embedding) for o in outputs]).double()

    pruned = embed()
    assert seen and seen[-1] is not None
    assert seen[-1].tolist() == [sum(lengths[:i]) for i in range(len(TEXTS))]  # each prompt's first row
    seen.clear()
    embed(PoolingParams(pooling_type="MEAN"))
    assert seen and all(rows is None for rows in seen)
    monkeypatch.setattr(type(model), "prunes_to_output_rows", False)
    whole = embed()
    assert torch.allclose(pruned, whole, atol=1e-6)
    assert torch.nn.functional.cosine_similarity(pruned, st_embeddings(path, TEXTS).double()).min() >= 0.9999
    assert_all_blocks_free(llm)
