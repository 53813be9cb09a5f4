"""Rebuild the two tiny test tokenizers in tests/assets/tokenizers/ (deterministic; run from anywhere).

    python tests/assets/make_tokenizers.py

Both have exactly 512 tokens, special tokens included, so they fit the tiny random Llama models of the test suite
(vocab 512):

- ``chatml``: byte-level BPE (GPT-2 style, like SmolLM2), specials ``<|endoftext|>`` (0), ``<|im_start|>`` (1),
  ``<|im_end|>`` (2); ChatML chat template in the style of SmolLM2-Instruct (a default system turn when the
  conversation has none, ``add_generation_prompt`` support); eos = ``<|im_end|>``.
- ``llama2``: SentencePiece-style BPE (``▁`` word marker, byte fallback ``<0x00>``..``<0xFF>``, like Llama-2),
  specials ``<unk>`` (0), ``<s>`` (1), ``</s>`` (2); the Llama-2-chat ``[INST] ... [/INST]`` template with
  ``<<SYS>>`` system handling; bos ``<s>``, eos ``</s>``.

The BPE merges are learned from the small corpus below (written for this purpose). The saved files are plain
``tokenizer.json`` / ``tokenizer_config.json`` / ``special_tokens_map.json`` that
``transformers.AutoTokenizer.from_pretrained(folder)`` loads offline.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

VOCAB_SIZE = 512
HERE = Path(__file__).resolve().parent
OUT = HERE / "tokenizers"

CORPUS = """\
The quick brown fox jumps over the lazy dog. A helpful assistant answers the question of the user.
You are a helpful AI assistant. Answer the question in one short sentence, then explain your reasoning.
What is the capital of France? The capital of France is Paris. Paris is a large city on the river Seine.
Please write a short poem about the sea. The sea is wide and blue, the waves are singing all night long.
How do I sort a list in Python? Use the sorted function, or call the sort method on the list itself.
def add(a, b): return a + b. print(add(2, 3)) prints 5. for item in items: print(item) if item > 0 else None.
Summarize the main ideas of the article in three bullet points. The article says that training data matters.
Translate this sentence into German: good morning, how are you today? Guten Morgen, wie geht es dir heute?
Can you help me plan a trip to the mountains? Sure! Pack warm clothes, water, a map, and check the weather.
The system message tells the assistant how to behave. The user asks, and the assistant replies politely.
Explain speculative decoding: a small draft model proposes tokens and the large target model verifies them.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 100 2024 3.14 42. Dates: Monday, Tuesday, Wednesday, Thursday, Friday.
Thank you very much! You are welcome. Is there anything else I can help you with? No, that is all for now.
Write a function that returns the largest number in a list of numbers, and test it with a few examples.
Once upon a time there was a little robot who wanted to learn how to paint pictures of the morning sky.
Questions and answers, requests and responses, instructions and conversations: this is what chat models see.
[INST] <<SYS>> system prompt <</SYS>> instruction [/INST] answer </s><s> user assistant system im_start im_end
"""


def _corpus_lines() -> list[str]:
    # A fixed, repeated corpus: counts (and so merges) are the same on every run.
    return [line for line in CORPUS.splitlines() if line.strip()] * 4


CHATML_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if loop.first and message['role'] != 'system' -%}"
    "{{- '<|im_start|>system\\nYou are a helpful AI assistant.<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)

LLAMA2_TEMPLATE = (
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set system_message = messages[0]['content'] -%}"
    "{%- set turns = messages[1:] -%}"
    "{%- else -%}"
    "{%- set system_message = none -%}"
    "{%- set turns = messages -%}"
    "{%- endif -%}"
    "{%- for message in turns -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') -}}"
    "{%- endif -%}"
    "{%- if message['role'] == 'user' -%}"
    "{%- if loop.first and system_message is not none -%}"
    "{%- set text = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] -%}"
    "{%- else -%}"
    "{%- set text = message['content'] -%}"
    "{%- endif -%}"
    "{{- bos_token + '[INST] ' + text.strip() + ' [/INST]' -}}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{{- ' ' + message['content'].strip() + ' ' + eos_token -}}"
    "{%- else -%}"
    "{{- raise_exception('Only user and assistant roles are supported after an optional first system message') -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
)


def build_chatml():
    """Byte-level BPE: 3 specials + 256 byte symbols + 253 learned merges = 512 tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus_lines(), trainer=trainer)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "unk_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "add_bos_token": False,
        "add_eos_token": False,
        "model_max_length": 2048,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHATML_TEMPLATE,
    }
    return tok, specials, config


def build_llama2():
    """SentencePiece-style BPE with byte fallback: 3 specials + 256 byte tokens + 253 learned pieces = 512."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    specials = ["<unk>", "<s>", "</s>"]
    byte_tokens = [f"<0x{i:02X}>" for i in range(256)]
    n_learned = VOCAB_SIZE - len(specials) - len(byte_tokens)

    # 1) learn characters + merges on "▁"-marked words.
    learner = Tokenizer(models.BPE())
    learner.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    learner.pre_tokenizer = pre_tokenizers.Split(Regex("▁[^▁]*|[^▁]+"), behavior="isolated")
    trainer = trainers.BpeTrainer(vocab_size=n_learned, show_progress=False)
    learner.train_from_iterator(_corpus_lines(), trainer=trainer)
    learned = json.loads(learner.to_str())["model"]
    pieces = sorted(learned["vocab"].items(), key=lambda kv: kv[1])
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in learned["merges"]]

    # 2) the final model: specials, byte-fallback tokens, then the learned pieces in their learned order.
    vocab: dict[str, int] = {}
    for piece in [*specials, *byte_tokens, *(p for p, _ in pieces)]:
        if piece not in vocab:
            vocab[piece] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "model_max_length": 2048,
        "clean_up_tokenization_spaces": False,
        "legacy": True,
        "chat_template": LLAMA2_TEMPLATE,
    }
    return tok, specials, config


BUILDERS = {"chatml": build_chatml, "llama2": build_llama2}


def render_files(name: str) -> dict[str, str]:
    """The text of each file of tokenizer ``name`` (what :func:`main` writes)."""
    from tokenizers import AddedToken

    tok, specials, config = BUILDERS[name]()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    size = tok.get_vocab_size(with_added_tokens=True)
    if size != VOCAB_SIZE:
        raise SystemExit(f"{name}: built {size} tokens, expected {VOCAB_SIZE}; the corpus is too small")
    special_map = {k: config[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token") if config.get(k)}
    return {
        "tokenizer.json": json.dumps(json.loads(tok.to_str()), indent=1, ensure_ascii=False) + "\n",
        "tokenizer_config.json": json.dumps(config, indent=1, ensure_ascii=False) + "\n",
        "special_tokens_map.json": json.dumps(special_map, indent=1, ensure_ascii=False) + "\n",
    }


def _save(name: str) -> Path:
    folder = OUT / name
    folder.mkdir(parents=True, exist_ok=True)
    for fname, text in render_files(name).items():
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{fname}.")
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, folder / fname)
    return folder


def main() -> None:
    for name in BUILDERS:
        print(f"wrote {_save(name)}")


if __name__ == "__main__":
    main()
