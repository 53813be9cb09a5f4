"""polyspec.decode.acceptance: the decoder's tokens per target verification, as the train stage logs it."""

from __future__ import annotations

import torch

from polyspec.chain_spec import DraftSpec, TreeShape
from polyspec.decode.acceptance import decoder_acceptance, depth_acceptance, prompt_prefix
from polyspec.decode.chain import ChainDecoder, SamplingParams
from polyspec.decode.head import EagleHead
from polyspec.decode.levels import HeadLevel, ModelLevel
from polyspec.decode.model import Transformer


def test_prompt_prefix_stops_at_the_first_assistant_token():
    assert prompt_prefix([5, 6, 7, 8, 9], [0, 0, 0, 1, 1]) == [5, 6, 7]
    assert prompt_prefix([5, 6, 7], [0, 0, 0]) is None  # no assistant token: nothing to answer
    assert prompt_prefix([5, 6, 7], [1, 1, 1]) is None  # no prompt before it


def _models(tiny_llama_dir):
    target = Transformer.from_pretrained(tiny_llama_dir).eval()
    torch.manual_seed(3)
    head = EagleHead(target.args, target.embed_tokens, target.lm_head).eval()
    return target, head


def _reference(target, head, prompts, k, tree):
    """The same count from a decoder of our own, over fresh copies of the caches."""
    dec = ChainDecoder([ModelLevel(target, "t"), HeadLevel(head, "h")], draft=tree or DraftSpec(k=k), max_seq_len=128)
    new = ver = 0
    for p in prompts:
        res = dec.generate(p, 20, SamplingParams(), seed=0)
        new += len(res.token_ids)
        ver += len(res.level_stats[0].accept_lengths)
    return new, ver


def test_acceptance_counts_tokens_per_target_verification_and_leaves_the_models_stateless(tiny_llama_dir):
    target, head = _models(tiny_llama_dir)
    prompts = [[1, 2, 3, 4], [9, 8, 7, 6, 5, 4, 3]]
    ids = torch.tensor([[3, 1, 4, 1, 5, 9]])
    before = target(ids)[0]
    for k, tree in ((3, None), (3, DraftSpec(tree=TreeShape(top_k=3, depth=3, total_tokens=8)))):
        res = decoder_acceptance(target, head, prompts, max_new_tokens=20, draft=tree or DraftSpec(k=k))
        assert target._cache is None and head._cache is None  # training passes stay stateless
        assert torch.equal(target(ids)[0], before)
        new, ver = _reference(target, head, prompts, k, tree)
        target._cache = head._cache = None
        assert (res.new_tokens, res.verifications, res.prompts) == (new, ver, 2)
        assert res.tokens_per_verification == new / ver
        assert 1.0 <= res.tokens_per_verification <= k + 1
        assert len(res.depth_accept) == (k if tree is None else 0)


def test_depth_acceptance_is_conditional_on_the_earlier_drafts():
    # one prompt, five verifications of 3-token drafts committing 1, 2, 4, 3, then 1 (its last, cut by the budget:
    # left out): draft 1 accepted in 3 of 4, draft 2 in 2 of those 3, draft 3 in 1 of those 2
    assert depth_acceptance([[1, 2, 4, 3, 1]], 3) == (0.75, 2 / 3, 0.5)
    assert depth_acceptance([[1, 1, 4], [2]], 2) == (0.0, 0.0)  # nobody reached draft 2 in a counted verification
    assert depth_acceptance([], 2) == (0.0, 0.0)


def test_the_head_drafts_the_first_answer_token(tiny_llama_dir):
    """The engine prefills the target with the prompt but its last token, so the first verification already checks a
    draft of answer token 0 (head row P - 2): what lab/replay.py's records replay from."""
    target, head = _models(tiny_llama_dir)
    res = ChainDecoder([ModelLevel(target, "t"), HeadLevel(head, "h")], draft=DraftSpec(k=2),
                       max_seq_len=64).generate([1, 2, 3, 4], 1, SamplingParams(), seed=0)
    assert len(res.token_ids) == 1 and res.level_stats[1].tokens_emitted >= 1
