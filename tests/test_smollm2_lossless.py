"""Slow tier: on the real SmolLM2, greedy dual and chain output equal AR output token for token (fp32, CPU) for
10 MT-bench prompts x 128 new tokens, with an RTN int4 intermediate and a random-init head (losslessness never
depends on draft quality), with linear drafts and with the EAGLE-2 draft tree."""

import pytest
import torch

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2_chain(smollm2_dir, tmp_path_factory):
    from polyspec.decode.generate import load_chain
    from polyspec.decode.head import EagleHead, save_head
    from polyspec.decode.int4 import save_int4_checkpoint
    from polyspec.decode.model import Transformer
    from polyspec.manifest import assemble_chain

    root = tmp_path_factory.mktemp("smollm2_chain")
    int4 = save_int4_checkpoint(smollm2_dir, root / "int4", group_size=128)
    target = Transformer.from_pretrained(smollm2_dir)
    torch.manual_seed(0)
    save_head(EagleHead(target.args, target.embed_tokens, target.lm_head), root / "head", {"source": "random"})
    assemble_chain(root / "chain", smollm2_dir, [int4], root / "head")
    return load_chain(root / "chain", device="cpu")


def test_greedy_chain_and_dual_equal_ar_on_smollm2(smollm2_chain):
    from polyspec.chain_spec import DraftSpec, TreeShape
    from polyspec.data.prompts import mtbench_questions
    from polyspec.decode.generate import generate_text

    tree_shape = DraftSpec(tree=TreeShape(top_k=4, depth=4, total_tokens=12))

    prompts = [q.turns[0] for q in mtbench_questions()[::8]][:10]
    assert len(prompts) == 10
    for prompt in prompts:
        ar = generate_text(smollm2_chain, prompt, mode="ar", max_new_tokens=128)
        for mode, tree in (("dual", DraftSpec(k=4)), ("chain", DraftSpec(k=4)), ("dual", tree_shape),
                           ("chain", tree_shape)):
            out = generate_text(smollm2_chain, prompt, mode=mode, max_new_tokens=128, draft=tree)
            assert out["token_ids"] == ar["token_ids"], (mode, tree, prompt[:60])
