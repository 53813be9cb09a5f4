"""Chat-template tokenisation: golden loss-mask spans for the tiny ChatML and Llama-2 tokenizers, truncation, errors,
and (slow) the real SmolLM2 tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest

from polyspec.data.chat import assistant_char_spans, masked_segments, tokenize_conversation
from polyspec.errors import PolyspecError

TOKENIZERS = Path(__file__).parent / "assets" / "tokenizers"

CONV = [
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "The capital of France is Paris."},
    {"role": "user", "content": "And of Germany?"},
    {"role": "assistant", "content": "Berlin ☕."},
]
SYSTEM = {"role": "system", "content": "Be brief."}


@pytest.fixture(scope="module")
def chatml():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TOKENIZERS / "chatml")


@pytest.fixture(scope="module")
def llama2():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TOKENIZERS / "llama2")


@pytest.mark.parametrize("name", ["chatml", "llama2"])
def test_tiny_tokenizers_have_512_tokens(name, request):
    tok = request.getfixturevalue(name)
    assert len(tok) == 512
    assert tok.is_fast and tok.chat_template


def test_chatml_golden_mask(chatml):
    out = tokenize_conversation(chatml, CONV, 512)
    ids, mask = out["input_ids"], out["loss_mask"]
    assert len(ids) == len(mask) and set(mask) == {0, 1}
    assert ids == chatml.apply_chat_template(CONV, tokenize=True)["input_ids"]  # the template's own tokens
    assert masked_segments(chatml, ids, mask) == ["The capital of France is Paris.<|im_end|>", "Berlin ☕.<|im_end|>"]
    assert masked_segments(chatml, ids, mask, value=0) == [
        "<|im_start|>system\nYou are a helpful AI assistant.<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
        "\n<|im_start|>user\nAnd of Germany?<|im_end|>\n<|im_start|>assistant\n",
        "\n",
    ]
    im_end = chatml.convert_tokens_to_ids("<|im_end|>")
    # every <|im_end|> closing an assistant turn is trained, the ones closing system/user turns are not
    assert [m for t, m in zip(ids, mask, strict=True) if t == im_end] == [0, 0, 1, 0, 1]


def test_chatml_with_system_message(chatml):
    out = tokenize_conversation(chatml, [SYSTEM, *CONV[:2]], 512)
    assert masked_segments(chatml, out["input_ids"], out["loss_mask"], value=0)[0] == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert masked_segments(chatml, out["input_ids"], out["loss_mask"]) == ["The capital of France is Paris.<|im_end|>"]


def test_llama2_golden_mask(llama2):
    out = tokenize_conversation(llama2, [SYSTEM, *CONV], 512)
    ids, mask = out["input_ids"], out["loss_mask"]
    assert ids == llama2.apply_chat_template([SYSTEM, *CONV], tokenize=True)["input_ids"]
    # the SentencePiece-style decoder drops the leading space of a decoded run: the token itself carries "▁"
    assert masked_segments(llama2, ids, mask) == ["The capital of France is Paris. </s>", "Berlin ☕. </s>"]
    first = mask.index(1)
    assert llama2.convert_ids_to_tokens(ids[first]).startswith("▁")
    assert masked_segments(llama2, ids, mask, value=0) == [
        "<s> [INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nWhat is the capital of France? [/INST]",
        "<s> [INST] And of Germany? [/INST]",
    ]
    bos, eos = llama2.bos_token_id, llama2.eos_token_id
    assert [m for t, m in zip(ids, mask, strict=True) if t in (bos, eos)] == [0, 1, 0, 1]


def test_llama2_char_spans(llama2):
    full, spans = assistant_char_spans(llama2, CONV)
    assert [full[a:b] for a, b in spans] == [" The capital of France is Paris. </s>", " Berlin ☕. </s>"]


def test_truncation_inside_an_assistant_turn(chatml):
    whole = tokenize_conversation(chatml, CONV, 512)
    n = len(whole["input_ids"])
    for max_length in (5, 30, n - 3, n, n + 10):
        out = tokenize_conversation(chatml, CONV, max_length)
        assert out["input_ids"] == whole["input_ids"][:max_length]
        assert out["loss_mask"] == whole["loss_mask"][:max_length]
    first_assistant = whole["loss_mask"].index(1)
    cut = tokenize_conversation(chatml, CONV, first_assistant + 3)
    assert sum(cut["loss_mask"]) == 3


def test_llama2_template_rejects_bad_alternation(llama2):
    with pytest.raises(PolyspecError, match="refused a conversation with roles user/user"):
        tokenize_conversation(llama2, [CONV[0], CONV[0]], 64)


class _Wrapper:
    """Delegates to a real tokenizer but renders with another template."""

    def __init__(self, tok, template):
        self._tok, self.chat_template, self.is_fast = tok, template, True
        self.name_or_path = "wrapped"

    def apply_chat_template(self, messages, **kw):
        return self._tok.apply_chat_template(messages, chat_template=self.chat_template, **kw)

    def __call__(self, *a, **kw):
        return self._tok(*a, **kw)


def test_template_whose_prefix_is_not_a_prefix_is_refused(chatml):
    # writes the number of messages up front, so a shorter prefix renders differently
    template = "{{ messages|length }}{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"
    with pytest.raises(PolyspecError, match="prefixes"):
        tokenize_conversation(_Wrapper(chatml, template), CONV, 512)


def test_missing_chat_template(chatml):
    with pytest.raises(PolyspecError, match="no chat template"):
        tokenize_conversation(_Wrapper(chatml, None), CONV, 512)


def test_bad_max_length(chatml):
    with pytest.raises(PolyspecError, match="max_length"):
        tokenize_conversation(chatml, CONV, 0)


@pytest.mark.slow
def test_smollm2_golden_mask(smollm2_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    out = tokenize_conversation(tok, CONV, 4096)
    ids, mask = out["input_ids"], out["loss_mask"]
    assert ids == tok.apply_chat_template(CONV, tokenize=True)["input_ids"]
    assert masked_segments(tok, ids, mask) == ["The capital of France is Paris.<|im_end|>", "Berlin ☕.<|im_end|>"]
    unmasked = masked_segments(tok, ids, mask, value=0)
    assert unmasked[0].startswith("<|im_start|>system\n") and unmasked[0].endswith(
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    assert unmasked[1:] == ["\n<|im_start|>user\nAnd of Germany?<|im_end|>\n<|im_start|>assistant\n", "\n"]


def test_tokenizer_assets_rebuild_identically():
    """tests/assets/make_tokenizers.py reproduces the committed files byte for byte."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_tokenizers", TOKENIZERS.parent / "make_tokenizers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for name in ("chatml", "llama2"):
        for fname, text in module.render_files(name).items():
            assert (TOKENIZERS / name / fname).read_text(encoding="utf-8") == text, f"{name}/{fname} differs"
