"""decode/batch.py: prompts answered together, rows refilled as answers end, equal each prompt's own batch-1 run."""

from __future__ import annotations

import pytest
import torch

from polyspec.errors import PolyspecError


@pytest.fixture(scope="module")
def chain(tiny_llama_dir):
    from polyspec.decode.generate import load_model_folder

    return load_model_folder(tiny_llama_dir, device="cpu", dtype="float32")


def _ar(chain, prompt: list[int], max_new: int, eos: set[int]) -> list[int]:
    from polyspec.decode.chain import SamplingParams
    from polyspec.decode.generate import build_decoder

    dec = build_decoder(chain, "ar", max_seq_len=len(prompt) + max_new + 8)
    return list(dec.generate(prompt, max_new, SamplingParams(), eos_token_ids=eos).token_ids)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(5, 500, (n,), generator=g).tolist() for n in (7, 1, 19, 12, 3)]


def test_greedy_batch_equals_each_prompts_ar_output(chain):
    from polyspec.decode.batch import generate_batch

    model, prompts = chain.models["target"], _prompts()
    refs = [_ar(chain, p, 12, set()) for p in prompts]
    out = generate_batch(model, prompts, max_new_tokens=12, eos_token_ids=set())
    assert [r.token_ids for r in out] == refs
    assert all(len(r.token_ids) == 12 and not r.stopped_at_eos for r in out)


def test_rows_stop_at_their_own_eos_and_the_rest_go_on(chain):
    from polyspec.decode.batch import generate_batch

    model, prompts = chain.models["target"], _prompts()
    free = generate_batch(model, prompts, max_new_tokens=10, eos_token_ids=set())
    eos = {free[2].token_ids[3]}  # a token row 2 emits 4th: that row must end there; others end at their own first
    refs = [_ar(chain, p, 10, eos) for p in prompts]
    out = generate_batch(model, prompts, max_new_tokens=10, eos_token_ids=eos)
    assert [r.token_ids for r in out] == refs
    assert out[2].stopped_at_eos and len(out[2].token_ids) <= 4
    for r in out:
        assert r.stopped_at_eos == (r.token_ids[-1] in eos)
        assert r.stopped_at_eos or len(r.token_ids) == 10


@pytest.mark.parametrize("batch_size", [1, 2, 3])
def test_refilled_rows_equal_each_prompts_ar_output(chain, batch_size):
    """Fewer rows than prompts: each row takes the next prompt when its answer ends (at EOS or at the cap), so rows
    hold prompts of different lengths at different slots; every answer still equals its own batch-1 run, and on_done
    reports each prompt once with its token count."""
    from polyspec.decode.batch import generate_batch

    model, prompts = chain.models["target"], _prompts() * 2
    free = generate_batch(model, prompts, max_new_tokens=9, eos_token_ids=set())
    eos = {free[0].token_ids[2], free[3].token_ids[5]}  # some rows end early, so refills happen mid-batch
    refs = [_ar(chain, p, 9, eos) for p in prompts]
    done: dict[int, int] = {}
    out = generate_batch(model, prompts, max_new_tokens=9, eos_token_ids=eos, batch_size=batch_size,
                         on_done=lambda i, n: done.setdefault(i, n))
    assert [r.token_ids for r in out] == refs
    assert done == {i: len(r) for i, r in enumerate(refs)}
    assert len({len(r) for r in refs}) > 1  # the answers really ended at different steps


def test_sampling_rows_do_not_depend_on_their_batch(chain):
    from polyspec.decode.batch import generate_batch

    model, prompts = chain.models["target"], _prompts()

    def gens(seeds):
        return [torch.Generator().manual_seed(s) for s in seeds]

    together = generate_batch(model, prompts, max_new_tokens=8, eos_token_ids=set(), temperature=1.0,
                              generators=gens(range(5)))
    alone = generate_batch(model, prompts[3:4], max_new_tokens=8, eos_token_ids=set(), temperature=1.0,
                           generators=gens([3]))
    assert together[3].token_ids == alone[0].token_ids
    refilled = generate_batch(model, prompts, max_new_tokens=8, eos_token_ids=set(), temperature=1.0,
                              generators=gens(range(5)), batch_size=2)
    assert [r.token_ids for r in refilled] == [r.token_ids for r in together]
    greedy = generate_batch(model, prompts, max_new_tokens=8, eos_token_ids=set())
    assert any(t.token_ids != g.token_ids for t, g in zip(together, greedy, strict=True))  # it did sample


def test_bad_input_is_one_clear_error(chain):
    from polyspec.decode.batch import generate_batch

    model = chain.models["target"]
    with pytest.raises(PolyspecError, match="empty prompt"):
        generate_batch(model, [[1, 2], []], max_new_tokens=2, eos_token_ids=set())
    with pytest.raises(PolyspecError, match="one torch.Generator per prompt"):
        generate_batch(model, [[1, 2]], max_new_tokens=2, eos_token_ids=set(), temperature=0.5)
    with pytest.raises(PolyspecError, match="polyspec's engine"):
        generate_batch(torch.nn.Linear(2, 2), [[1]], max_new_tokens=2, eos_token_ids=set())
    with pytest.raises(PolyspecError, match="batch_size must be >= 1"):
        generate_batch(model, [[1]], max_new_tokens=2, eos_token_ids=set(), batch_size=0)


def test_batch_decode_bench_prints_one_row_per_batch_size(tmp_path, capsys):
    """python -m polyspec.bench.batch_decode: one JSON row per batch size, every row's tokens counted; bad batch sizes
    are one clear error (exit 2)."""
    import json

    from conftest import make_tiny_llama

    from polyspec.bench.batch_decode import main

    model = make_tiny_llama(tmp_path / "m", hidden=64, intermediate=128, heads=4, kv_heads=2)
    assert main([str(model), "--batches", "1,3", "--new-tokens", "5", "--dtype", "float32"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["batch"] for r in rows] == [1, 3]
    for r in rows:
        assert r["ms_per_step"] > 0
        # tokens/s is generated tokens (batch x 5) over the same seconds that ms_per_step divides by 5 steps
        assert abs(r["tokens_per_second"] - r["batch"] * 1000 / r["ms_per_step"]) <= 0.05 * r["tokens_per_second"]
    assert main([str(model), "--batches", "0,x"]) == 2
    assert "positive integers" in capsys.readouterr().err
