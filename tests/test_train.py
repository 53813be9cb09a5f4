"""polyspec.train: EAGLE alignment and losses, pickle-free checkpoints, tiny training runs (online and offline),
resume after a kill, the offline cache and its budget, DeepSpeed refusal, and Lightning DDP with 2 gloo processes."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from conftest import ASSETS, REPO, make_tiny_llama

from polyspec.chain_spec import DraftSpec, TreeShape
from polyspec.config import validate_tree
from polyspec.errors import PolyspecError
from polyspec.train.ckpt_io import load_tree, save_tree
from polyspec.train.losses import (
    eagle3_losses,
    eagle_losses,
    eagle_unrolled_losses,
    expected_acceptance_length,
    shift_for_head,
    warmup_linear_decay,
)

SAMPLE = ASSETS / "sharegpt_sample.json"

def _prepare(recipe, tokenizer, **kw):
    """The data stage of ``recipe`` (its data section, under its workdir)."""
    from polyspec.data.prepare import prepare_dataset

    return prepare_dataset(recipe.data, tokenizer, workdir=recipe.workdir, **kw)



def _tree(tmp: Path, model: Path, **train) -> dict:
    base = {"features": "online", "epochs": 2, "max_steps": None, "batch_size": 2, "lr": 2e-3, "warmup_steps": 1,
            "checkpoint_every": 2, "feature_noise": 0.0}
    base.update(train)
    return {"workdir": str(tmp / "wd"), "target": {"source": str(model), "device": "cpu"},
            "data": {"source": str(SAMPLE), "max_length": 96, "heldout_fraction": 0.25},
            "tracking": {"enabled": False}, "train": base}


def _recipe(tmp: Path, model: Path, **train):
    return validate_tree(_tree(tmp, model, **train), "test")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("train_tiny"), hidden=64, intermediate=128, heads=4, kv_heads=2)


@pytest.fixture(scope="module")
def peaked_model(tmp_path_factory, tiny_model) -> Path:
    """tiny_model with its lm_head scaled up: peaked next-token distributions, so a head that reads only the teacher's
    distribution (EAGLE-3: no feature loss) has something to learn above the entropy floor."""
    import shutil

    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("peaked") / "m"
    shutil.copytree(tiny_model, out)
    tensors = load_file(str(out / "model.safetensors"))
    tensors["lm_head.weight"] = tensors["lm_head.weight"] * 30.0
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _info(head_dir: Path) -> dict:
    return json.loads((head_dir / "training.json").read_text())


# ---------------------------------------------------------------------------------------------------------------------
# pure functions


def test_shift_for_head_follows_the_eagle_alignment():
    ids = torch.tensor([[10, 11, 12, 13, 14], [20, 21, 22, 0, 0]])  # [B=2, T=5], row 1 padded after 3 tokens
    feats = torch.arange(2 * 5 * 1, dtype=torch.float32).view(2, 5, 1)  # f_t = a distinct number per position
    logits = torch.arange(2 * 5 * 3, dtype=torch.float32).view(2, 5, 3)
    mask = torch.tensor([[0, 0, 1, 1, 0], [1, 1, 1, 1, 1]])  # row 1: even a mask on padding must not count
    s = shift_for_head(ids, feats, logits, mask, torch.tensor([5, 3]))
    assert s["head_ids"].tolist() == [[11, 12, 13, 14], [21, 22, 0, 0]]  # row t reads x_{t+1}
    assert s["head_features"][0, :, 0].tolist() == [0, 1, 2, 3]  # ... and f_t
    assert s["target_features"][0, :, 0].tolist() == [1, 2, 3, 4]  # predicts f_{t+1}
    assert torch.equal(s["target_states"][0], logits[0, 1:])  # the teacher's state whose logits give x_{t+2}
    # row t counts when x_{t+2} is an assistant token; the last real row takes the mask of the last token
    assert s["weight"].tolist() == [[1, 1, 0, 0], [1, 1, 0, 0]]


def test_losses_agreement_and_acceptance_formula():
    torch.manual_seed(0)
    hid, logits = torch.randn(2, 4, 8), torch.randn(2, 4, 16)
    w = torch.tensor([[1.0, 1, 0, 1], [0, 1, 1, 1]])
    same = eagle_losses(logits, hid, hid, logits, w)
    assert float(same["feature"]) == 0.0 and float(same["correct"]) == float(same["count"]) == 6.0
    entropy = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)
    assert math.isclose(float(same["token"]), float((entropy * w).sum() / 6), rel_tol=1e-5)
    other = eagle_losses(-logits, hid + 1.0, hid, logits, w)
    assert float(other["feature"]) == pytest.approx(0.5) and float(other["correct"]) == 0.0  # SmoothL1(1) = 0.5
    assert float(other["token"]) > float(same["token"])
    assert expected_acceptance_length(0.0, 4) == 1.0
    assert expected_acceptance_length(1.0, 4) == 5.0
    assert expected_acceptance_length(0.5, 2) == pytest.approx(1.75)
    assert [warmup_linear_decay(s, 2, 6) for s in range(7)] == [0.5, 1.0, 1.0, 0.75, 0.5, 0.25, 0.0]


def test_eval_every_is_counted_in_optimizer_steps():
    from polyspec.config import TrainConfig
    from polyspec.train.stage import _val_interval

    assert _val_interval(TrainConfig(), 100, 1) == (1.0, 1)  # unset: once per epoch
    assert _val_interval(TrainConfig(eval_every=10, grad_accum=2), 100, 1) == (20, 1)  # batches per rank
    assert _val_interval(TrainConfig(eval_every=10, grad_accum=2), 100, 2) == (20, 1)
    assert _val_interval(TrainConfig(eval_every=60), 100, 2) == (1.0, 1)  # about an epoch: once per epoch
    assert _val_interval(TrainConfig(eval_every=300), 100, 1) == (1.0, 3)  # short epochs: every third epoch


def test_checkpoint_tree_round_trip_without_pickle(tmp_path):
    tree = {"state_dict": {"a.weight": torch.randn(3, 2)}, "optimizer_states": [{"state": {0: {"step": torch.tensor(
        3.0), "exp_avg": torch.ones(2)}}, "param_groups": [{"params": [0], "betas": (0.9, 0.95), "lr": 1e-3}]}],
        "epoch": 1, "best": None, "score": float("inf"), "name": "x"}
    path = save_tree(tree, tmp_path / "step-00000003.ckpt")
    back = load_tree(path)
    assert torch.equal(back["state_dict"]["a.weight"], tree["state_dict"]["a.weight"])
    assert back["optimizer_states"][0]["state"][0]["step"].item() == 3.0  # int keys survive
    assert back["optimizer_states"][0]["param_groups"][0]["betas"] == (0.9, 0.95)  # tuples survive
    assert back["score"] == float("inf") and back["best"] is None and back["epoch"] == 1
    assert path.read_bytes()[:8] != b"\x80\x04\x95"[:8]  # not a pickle stream
    with pytest.raises(PolyspecError, match="without pickling"):
        save_tree({"bad": object()}, tmp_path / "bad.ckpt")


# ---------------------------------------------------------------------------------------------------------------------
# refusals before any work


def test_deepspeed_without_cuda_is_refused_before_any_work(tmp_path, tiny_model, monkeypatch):
    from polyspec.pipeline import run_train as train_stage
    from polyspec.train.stage import runtime_settings

    tree = _tree(tmp_path, tiny_model, strategy="deepspeed_stage_2")
    tree["target"]["device"] = "auto"
    recipe = validate_tree(tree, "test")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(PolyspecError, match="needs CUDA"):
        train_stage(recipe, progress=False)
    assert not (tmp_path / "wd").exists()  # nothing resolved, prepared or written
    # with CUDA present but without the package, the error names the extra
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "deepspeed" else real(n, *a))
    with pytest.raises(PolyspecError, match=r"\[deepspeed\]"):
        runtime_settings(recipe.train, "cuda")


def test_precision_auto_is_bf16_mixed_where_bf16_matmuls_are_fast(monkeypatch):
    """train.precision=auto reads polyspec.device.fast_bf16_matmul; explicit precisions pass through; the teacher
    computes features in bf16 under bf16-mixed whatever the target's serving dtype."""
    from polyspec.config import TrainConfig
    from polyspec.train import stage

    for fast, expected in ((True, "bf16-mixed"), (False, "32-true")):
        monkeypatch.setattr(stage, "fast_bf16_matmul", lambda device, fast=fast: fast)
        assert stage.runtime_settings(TrainConfig(), "cpu")["precision"] == expected
        assert stage.runtime_settings(TrainConfig(precision="32-true"), "cpu")["precision"] == "32-true"
    assert stage._teacher_dtype("32-true", "bfloat16") is torch.float32
    assert stage._teacher_dtype("bf16-mixed", "float32") is torch.bfloat16
    assert stage._teacher_dtype("16-mixed", "float16") is torch.float16


def test_bf16_offline_training_probes_with_the_target_in_its_serving_dtype(tmp_path, tiny_model, monkeypatch):
    """bf16-mixed: features extracted by a bf16 teacher (recorded in the cache index), the acceptance probe decodes
    with the target loaded in target.dtype (float32 here), and the head comes out float32."""
    from polyspec.decode.head import load_head
    from polyspec.decode.model import Transformer
    from polyspec.pipeline import run_train
    from polyspec.train import stage
    from polyspec.train.features import read_cache_index

    loads = []
    real = stage._load
    monkeypatch.setattr(stage, "_load", lambda path, dtype, device: loads.append(dtype) or real(path, dtype, device))
    recipe = _recipe(tmp_path, tiny_model, features="offline", precision="bf16-mixed", max_steps=3, epochs=1,
                     accept_prompts=1)
    out = run_train(recipe, progress=False)
    info = _info(out)
    assert loads == [torch.bfloat16, torch.float32]  # the teacher, then the probe's decoder
    assert read_cache_index(Path(info["offline_cache"]["cache_dir"]))["teacher_dtype"] == "torch.bfloat16"
    assert info["runtime"]["precision"] == "bf16-mixed" and info["decoder_accept_linear"] >= 1.0
    head = load_head(out, Transformer.from_pretrained(tiny_model))
    assert head.fc.weight.dtype == torch.float32


def test_offline_cache_round_trip_and_budget_refusal(tmp_path, tiny_model):
    from polyspec.pipeline import run_train as train_stage
    from polyspec.sources import load_tokenizer, model_id
    from polyspec.train.features import (
        CachedFeatureDataset,
        build_feature_cache,
        bytes_per_token,
        load_teacher,
        teacher_hidden,
        teacher_outputs,
    )

    recipe = _recipe(tmp_path, tiny_model, features="offline", cache_budget_gb=1e-7)
    with pytest.raises(PolyspecError, match="cache_budget_gb"):
        train_stage(recipe, progress=False)
    assert not (tmp_path / "wd" / "cache" / "features").exists()  # refused before writing anything

    tok = load_tokenizer(tiny_model)
    prepared = _prepare(recipe, tok, tokenizer_id=model_id("local", tiny_model))
    teacher = load_teacher(tiny_model, torch.float32, "cpu")
    index = build_feature_cache(teacher, {"train": prepared.train, "heldout": prepared.heldout},
                                tmp_path / "cache", info={"teacher": "t"}, batch_size=3, shard_bytes=20_000)
    assert len(index["splits"]["train"]) > 1  # several shards
    h = teacher.args.hidden_size
    assert bytes_per_token(h) == 2 * h + 5
    assert bytes_per_token(h) <= index["bytes_per_token"] < bytes_per_token(h) + 64  # payload + small headers
    ds = CachedFeatureDataset(tmp_path / "cache", "train")
    assert len(ds) == len(prepared.train)
    for i in (0, len(ds) - 1):
        row = ds[i]
        assert row["input_ids"].tolist() == prepared.train[i]["input_ids"]
        assert row["loss_mask"].tolist() == prepared.train[i]["loss_mask"]
        _, hidden = teacher_outputs(teacher, row["input_ids"][None])
        assert torch.equal(teacher_hidden(teacher, row["input_ids"][None]), hidden)  # extraction skips the logits
        assert row["hidden"].dtype == torch.bfloat16
        torch.testing.assert_close(row["hidden"].float(), hidden[0], atol=0.05, rtol=0.02)

    # a short offline training run reads the same cache format end to end
    ok = _recipe(tmp_path, tiny_model, features="offline", max_steps=3, epochs=1)
    out = train_stage(ok, progress=False)
    info = _info(out)
    assert info["steps"] == 3 and info["offline_cache"]["bytes_per_token"] >= bytes_per_token(h)


# ---------------------------------------------------------------------------------------------------------------------
# training runs


def test_tiny_training_lowers_the_loss_logs_to_mlflow_and_skips_on_rerun(tmp_path, tiny_model):
    from polyspec.pipeline import run_train as train_stage
    from polyspec.tracking import start_run

    tree = _tree(tmp_path, tiny_model, max_steps=24, epochs=20, checkpoint_every=50)
    tree["tracking"] = {"enabled": True, "uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "experiment": "t"}
    recipe = validate_tree(tree, "test")
    with start_run(recipe, "train") as tracker:
        out = train_stage(recipe, tracker=tracker, progress=False, log_every=1)
    info = _info(out)
    assert info["steps"] == 24
    # the split it trained against, for the bench's held-out prompts (bench.prompts.head_data_split)
    assert info["data_split"] == {"source": str(SAMPLE), "max_conversations": None, "heldout_fraction": 0.25,
                                  "seed": 0}
    evals = [e["heldout/loss"] for e in info["eval_history"]]
    assert len(evals) >= 2 and evals[-1] < evals[0]
    assert 0.0 <= info["heldout_top1_agreement"] <= 1.0
    alpha = info["heldout_top1_agreement"]
    assert info["acceptance_length_estimate"] == pytest.approx(expected_acceptance_length(alpha, 4))
    # the decoder's own count on held-out prompts, linear drafts of decode.draft.k (4) and the tree
    assert 1.0 <= info["decoder_accept_linear"] <= 5.0 and 1.0 <= info["decoder_accept_tree"]
    assert all("heldout/accept_linear" in e for e in info["eval_history"])
    target = _check_trained_head(out, recipe, tiny_model)
    _check_mlflow_run(recipe, tracker.run_id, out)
    _check_reruns(recipe, out, target)


def _check_trained_head(out, recipe, tiny_model):
    """The head loads against its target and carries its training targets' token counts; returns the target."""
    from polyspec.decode.head import load_head, read_head_config
    from polyspec.decode.model import Transformer
    from polyspec.sources import load_tokenizer, model_id

    cfg = read_head_config(out)
    assert cfg["target"]["model_id"] == model_id("local", tiny_model) and cfg["target"]["hash"]
    target = Transformer.from_pretrained(tiny_model)
    head = load_head(out, target)
    assert head.args.hidden_size == target.args.hidden_size
    # the training targets' token counts travel with the head (what set_draft_vocab picks from)
    prepared = _prepare(recipe, load_tokenizer(tiny_model), tokenizer_id=cfg["target"]["model_id"])
    assistant = sum(int(sum(m)) for m in prepared.train["loss_mask"])
    assert head.token_counts is not None and int(head.token_counts.sum()) == assistant > 0
    head.set_draft_vocab(16)
    kept = torch.zeros_like(head.token_counts, dtype=torch.bool)
    kept[head.draft_ids] = True
    assert int(head.token_counts[kept].min()) >= int(head.token_counts[~kept].max())
    return target


def _check_mlflow_run(recipe, run_id: str, out) -> None:
    """The run logged every metric, a falling loss (most of it the feature part) and the head as its artifact."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=recipe.tracking.uri)
    run = client.get_run(run_id)
    for name in ("train/feature_loss", "train/token_loss", "train/loss", "lr", "tokens_per_second",
                 "heldout/top1_agreement", "heldout/acceptance_length_estimate", "heldout/accept_linear",
                 "heldout/accept_tree"):
        assert name in run.data.metrics, name

    def history(name: str) -> list[float]:
        return [m.value for m in sorted(client.get_metric_history(run_id, name), key=lambda m: m.step)]

    losses, feature = history("train/loss"), history("train/feature_loss")
    assert len(losses) == 24
    # the token part's floor is the random teacher's entropy
    assert sum(losses[-4:]) < 0.95 * sum(losses[:4])
    assert sum(feature[-4:]) < 0.85 * sum(feature[:4]), feature
    artifacts = [a.path for a in client.list_artifacts(run_id, "head")]
    assert artifacts == [f"head/{out.name}"]


def _check_reruns(recipe, out, target) -> None:
    """A rerun with the same inputs reuses the head (and adds token counts and hashes an older head lacks); a
    truncated head is found by its hashes and trained again."""
    import lightning as L

    from polyspec.decode.head import TOKEN_COUNTS_FILE, load_head, read_token_counts
    from polyspec.fsutil import FILE_HASHES, hash_problems
    from polyspec.pipeline import run_train as train_stage

    class MustNotTrain(L.Callback):
        def on_train_start(self, trainer, pl_module):
            raise AssertionError("a rerun with the same inputs must not train")

    assert train_stage(recipe, progress=False, callbacks=[MustNotTrain()]) == out
    counts = read_token_counts(out, target.args.vocab_size)
    (out / TOKEN_COUNTS_FILE).unlink()
    (out / FILE_HASHES).unlink()
    assert train_stage(recipe, progress=False, callbacks=[MustNotTrain()]) == out
    assert torch.equal(read_token_counts(out, target.args.vocab_size), counts)
    assert hash_problems(out) == [], "the head's files are hashed on its first reuse"
    weights = out / "model.safetensors"
    whole = weights.read_bytes()
    weights.write_bytes(whole[: len(whole) // 3])
    assert train_stage(recipe, progress=False) == out
    assert weights.stat().st_size == len(whole) and hash_problems(out) == []
    load_head(out, target)


@pytest.mark.slow  # minutes of training on 2 cores: the fast tier keeps one training run per head kind
def test_tiny_eagle3_training_lowers_the_loss_and_decodes_losslessly(tmp_path, peaked_model):
    from polyspec.decode.chain import ChainDecoder
    from polyspec.decode.head import load_head, read_head_config, save_head
    from polyspec.decode.head3 import Eagle3Head, draft_vocab_ids
    from polyspec.decode.levels import HeadLevel, ModelLevel
    from polyspec.decode.model import Transformer
    from polyspec.pipeline import run_train as train_stage

    tiny_model = peaked_model
    recipe = _recipe(tmp_path, tiny_model, head="eagle3", ttt_steps=2, draft_vocab=100, max_steps=16, epochs=20,
                     checkpoint_every=5)
    out = train_stage(recipe, progress=False, log_every=1)
    info = _info(out)
    assert info["steps"] == 16 and info["train"]["head"] == "eagle3"
    evals = [e["heldout/loss"] for e in info["eval_history"]]
    assert len(evals) >= 2 and evals[-1] < evals[0]
    cfg = read_head_config(out)
    assert (cfg["head_type"], cfg["aux_layers"], cfg["draft_vocab_size"]) == ("eagle3", [0, 0, 0], 100)
    target = Transformer.from_pretrained(tiny_model).eval()
    head = load_head(out, target)
    assert isinstance(head, Eagle3Head)
    # the draft vocabulary is the 100 most frequent training targets, and its lm_head was trained (moved off the
    # target's rows it started from)
    assert torch.equal(head.draft_ids, draft_vocab_ids(head.token_counts, 100))
    assert not torch.allclose(head.lm_head.weight, target.lm_head.weight[head.draft_ids])
    again = load_head(save_head(head, tmp_path / "again", cfg["target"]), target)
    ids, feats = torch.tensor([3, 5, 7]), torch.randn(3, target.args.hidden_size)
    with torch.no_grad():
        assert torch.equal(head(ids, feats)[0], again(ids, feats)[0])
    prompt = [5, 17, 30, 9, 77, 3]
    ar = ChainDecoder([ModelLevel(target, "t")], max_seq_len=64).generate(prompt, 16).token_ids
    for draft in (DraftSpec(k=3), DraftSpec(tree=TreeShape(top_k=3, depth=3, total_tokens=8))):
        r = ChainDecoder([ModelLevel(target, "t"), HeadLevel(head, "h")], draft=draft,
                         max_seq_len=64).generate(prompt, 16)
        assert r.token_ids == ar


def test_eagle3_offline_cache_holds_the_fused_layers_and_final_state_and_trains(tmp_path, peaked_model):
    """An EAGLE-3 recipe with features=offline: the cache holds the aux layers' outputs and the final-norm'd state
    (the teacher's hidden and, through its lm_head, its logits, to bf16 rounding), in its own cache folder, and a
    head trains on it, lowers the held-out loss and decodes losslessly."""
    from polyspec.decode.chain import ChainDecoder
    from polyspec.decode.head import load_head
    from polyspec.decode.levels import HeadLevel, ModelLevel
    from polyspec.decode.model import Transformer
    from polyspec.pipeline import run_train as train_stage
    from polyspec.sources import load_tokenizer, model_id
    from polyspec.train.features import (
        CachedFeatureDataset,
        build_feature_cache,
        bytes_per_token,
        load_teacher,
        teacher_hidden,
        teacher_outputs,
    )

    recipe = _recipe(tmp_path, peaked_model, head="eagle3", features="offline", aux_layers=[0, 1, 1])
    prepared = _prepare(recipe, load_tokenizer(peaked_model), tokenizer_id=model_id("local", peaked_model))
    teacher = load_teacher(peaked_model, torch.float32, "cpu")
    index = build_feature_cache(teacher, {"train": prepared.train}, tmp_path / "c3", info={}, aux_layers=(0, 1, 1))
    h = teacher.args.hidden_size
    assert index["aux_layers"] == [0, 1, 1] and index["payload_bytes_per_token"] == bytes_per_token(h, 3) == 8 * h + 5
    row = CachedFeatureDataset(tmp_path / "c3", "train")[0]
    logits, aux = teacher_outputs(teacher, row["input_ids"][None], (0, 1, 1))
    assert torch.equal(teacher_hidden(teacher, row["input_ids"][None], (0, 1, 1)), aux)
    assert row["hidden"].shape == (len(row["input_ids"]), 3 * h)
    torch.testing.assert_close(row["hidden"].float(), aux[0], atol=0.05, rtol=0.02)
    torch.testing.assert_close(teacher.lm_head(row["final"].float()), logits[0], atol=0.5, rtol=0.02)

    train = {"head": "eagle3", "ttt_steps": 2, "draft_vocab": 100, "max_steps": 16, "epochs": 20}
    out = train_stage(_recipe(tmp_path, peaked_model, features="offline", **train), progress=False)
    info = _info(out)
    evals = [e["heldout/loss"] for e in info["eval_history"]]
    assert info["steps"] == 16 and len(evals) >= 2 and evals[-1] < evals[0]
    assert info["offline_cache"]["bytes_per_token"] >= bytes_per_token(h, 3)
    target = Transformer.from_pretrained(peaked_model).eval()
    head = load_head(out, target)
    prompt = [5, 17, 30, 9, 77, 3]
    ar = ChainDecoder([ModelLevel(target, "t")], max_seq_len=64).generate(prompt, 16).token_ids
    dual = ChainDecoder([ModelLevel(target, "t"), HeadLevel(head, "h")], draft=DraftSpec(k=3), max_seq_len=64)
    assert dual.generate(prompt, 16).token_ids == ar


@pytest.mark.slow  # minutes of training on 2 cores: the fast tier keeps one training run per head kind
def test_resume_after_a_kill_ends_with_the_same_step_count(tmp_path, tiny_model):
    import lightning as L

    from polyspec.pipeline import run_train as train_stage

    class Killed(RuntimeError):
        pass

    class KillAt(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 5:
                raise Killed("simulated kill")

    class StartStep(L.Callback):
        seen: list[int] = []

        def on_train_start(self, trainer, pl_module):
            StartStep.seen.append(trainer.global_step)

    recipe = _recipe(tmp_path, tiny_model, epochs=3, max_steps=None, checkpoint_every=2)
    with pytest.raises(Killed):
        train_stage(recipe, progress=False, callbacks=[KillAt()])
    ckpts = sorted(p.name for p in (tmp_path / "wd" / "train").glob("*/checkpoints/*.ckpt"))
    assert ckpts == ["step-00000004.ckpt"]
    out = train_stage(recipe, progress=False, callbacks=[StartStep()])
    info = _info(out)
    assert StartStep.seen == [4] and info["resumed_from"].endswith("step-00000004.ckpt")

    fresh = _recipe(tmp_path / "fresh", tiny_model, epochs=3, max_steps=None, checkpoint_every=2)
    expected = _info(train_stage(fresh, progress=False))["steps"]
    n_train = json.loads(next((tmp_path / "wd" / "cache" / "data").glob("*/report.json")).read_text())[
        "train_sequences"]
    assert expected == 3 * math.ceil(n_train / 2)
    assert info["steps"] == expected and info["epochs_completed"] == 3


@pytest.mark.slow  # heavy (the fast tier stays under 6 minutes: README)
def test_lightning_ddp_with_two_gloo_processes(tmp_path, tiny_model):
    """``python -m polyspec.train`` with strategy ddp, 2 CPU processes: Lightning re-runs the command as rank 1."""
    tree = _tree(tmp_path, tiny_model, strategy="ddp", devices=2, epochs=1, checkpoint_every=100)
    path = tmp_path / "ddp.yaml"
    path.write_text(yaml.safe_dump(tree))
    proc = subprocess.run([sys.executable, "-m", "polyspec.train", str(path), "--no-progress"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout[proc.stdout.index("{"):])
    info = _info(Path(summary["head"]))
    n_train = json.loads(next((tmp_path / "wd" / "cache" / "data").glob("*/report.json")).read_text())[
        "train_sequences"]
    assert info["runtime"]["strategy"] == "ddp" and info["runtime"]["devices"] == "2"
    assert info["steps"] == math.ceil(math.ceil(n_train / 2) / 2)  # each rank sees half the rows, batch 2
    assert "heldout_top1_agreement" in info


def test_loss_vocab_trains_on_the_draft_vocabulary_only(tmp_path, tiny_model):
    """train.draft_vocab of an EAGLE-1/2 head: the head's token loss reads only the N most frequent training tokens' lm_head rows, and
    the logits it trains are exactly those rows of the full logits."""
    from polyspec.decode.head import EagleHead, subset_logits, top_token_ids
    from polyspec.decode.model import Transformer
    from polyspec.pipeline import run_train as train_stage

    target = Transformer.from_pretrained(tiny_model)
    head = EagleHead(target.args, target.embed_tokens, target.lm_head)
    ids = top_token_ids(torch.tensor([5, 0, 9, 9, 1]), 3)
    assert ids.tolist() == [0, 2, 3]  # ties keep the lower id; returned ascending
    x = torch.randn(2, 3, target.args.hidden_size, requires_grad=True)
    sub = subset_logits(head.lm_head, x, ids)
    assert torch.allclose(sub, head.lm_head(x)[..., ids], atol=1e-5)
    sub.sum().backward()
    assert x.grad is not None and head.lm_head.weight.grad is None  # the shared lm_head stays frozen
    feats = torch.randn(1, 4, target.args.hidden_size)
    full, _ = head(torch.tensor([[1, 2, 3, 4]]), feats)
    part, _ = head(torch.tensor([[1, 2, 3, 4]]), feats, vocab_ids=ids)
    assert torch.allclose(part, full[..., ids], atol=1e-5)

    with pytest.raises(PolyspecError, match="draft_vocab"):
        train_stage(_recipe(tmp_path, tiny_model, draft_vocab=10**6, max_steps=2), progress=False)
    for features in ("online", "offline"):
        out = train_stage(_recipe(tmp_path / features, tiny_model, draft_vocab=64, max_steps=4, features=features),
                          progress=False)
        info = _info(out)
        assert info["steps"] == 4 and info["train"]["draft_vocab"] == 64
        assert math.isfinite(info["train_loss_last"])


def test_max_minutes_is_a_time_budget_that_ends_training_with_a_head(tmp_path, tiny_model):
    from polyspec.pipeline import run_train as train_stage

    out = train_stage(_recipe(tmp_path, tiny_model, epochs=1000, max_minutes=0.05, accept_prompts=0),
                      progress=False)
    info = _info(out)
    assert 0 < info["steps"] and info["epochs_completed"] < 1000  # the budget, not the epochs, ended it
    assert info["fit_seconds"] < 60


def test_a_damaged_feature_cache_is_named_and_extracted_again(tmp_path, tiny_model, capsys):
    from polyspec.sources import load_tokenizer, model_id
    from polyspec.train.features import build_feature_cache, cache_damage, load_teacher

    recipe = _recipe(tmp_path, tiny_model, features="offline")
    prepared = _prepare(recipe, load_tokenizer(tiny_model), tokenizer_id=model_id("local", tiny_model))
    teacher = load_teacher(tiny_model, torch.float32, "cpu")
    cache = tmp_path / "cache"
    index = build_feature_cache(teacher, {"train": prepared.train}, cache, info={"teacher": "t"}, batch_size=3)
    assert cache_damage(cache) is None
    shard = cache / index["splits"]["train"][0]["file"]
    shard.write_bytes(shard.read_bytes()[:-100])  # truncated
    assert "safetensors" in cache_damage(cache).lower() or str(shard) in cache_damage(cache)
    again = build_feature_cache(teacher, {"train": prepared.train}, cache, info={"teacher": "t"}, batch_size=3)
    assert "is damaged" in capsys.readouterr().err
    assert cache_damage(cache) is None and again["tokens"] == index["tokens"]


def test_unrolled_losses_compare_step_k_with_the_targets_k_rows_later():
    """Step 0 of the unrolled loss is eagle_losses itself; step k's rows 0..N-1-k are scored against rows k..N-1 of
    the targets; the steps are summed with weights decay ** k of (feature weight * feature + token weight * token).
    The reference computes the logits of every row; the loss computes them on the rows that count only."""
    g = torch.Generator().manual_seed(0)
    b, n, h, v = 2, 6, 8, 11
    w_head, w_teacher = torch.randn(h, v, generator=g), torch.randn(h, v, generator=g)
    calls = []

    def head_logits(x):
        calls.append(x.shape[0])
        return x @ w_head

    outs = [torch.randn(b, n, h, generator=g) for _ in range(3)]
    feats, states = torch.randn(b, n, h, generator=g), torch.randn(b, n, h, generator=g)
    weight = (torch.rand(b, n, generator=g) > 0.3).float()
    teacher_rows = []

    def teacher_logits(x):
        teacher_rows.append(x.shape[0])
        return x @ w_teacher

    got = eagle_unrolled_losses(outs, feats, states, weight, decay=0.5, feature_weight=2.0, token_weight=0.25,
                                head_logits=head_logits, teacher_logits=teacher_logits)
    assert teacher_rows == [int(weight.sum())]  # the teacher's logits once, on step 0's counted rows
    logits = states @ w_teacher
    want = 0.0
    for k, out in enumerate(outs):
        p = eagle_losses(out[:, :n - k] @ w_head, out[:, :n - k], feats[:, k:], logits[:, k:], weight[:, k:])
        want += 0.5 ** k * (2.0 * p["feature"] + 0.25 * p["token"])
        assert float(got["step_correct"][k]) == float(p["correct"]) and float(got["step_count"][k]) == float(p["count"])
        assert calls[k] == int(weight[:, k:].sum())  # logits of the counted rows only
    first = eagle_losses(outs[0] @ w_head, outs[0], feats, logits, weight)
    torch.testing.assert_close(got["loss"], torch.as_tensor(want, dtype=torch.float32))
    torch.testing.assert_close(got["token"], first["token"])
    assert float(got["correct"]) == float(first["correct"])


def test_eagle3_losses_on_counted_rows_equal_the_dense_definition():
    """eagle3_losses against its definition written out on every row: per step k, the cross-entropy against the
    teacher renormalised on the draft vocabulary over the weighted rows whose teacher argmax is in it, decayed sums,
    and agreement in target ids over every weighted row."""
    g = torch.Generator().manual_seed(1)
    b, n, h, v, decay = 2, 7, 8, 13, 0.8
    draft_ids = torch.tensor([0, 2, 3, 5, 8, 9])
    t2d = torch.zeros(v, dtype=torch.bool)
    t2d[draft_ids] = True
    w_head, w_teacher = torch.randn(h, len(draft_ids), generator=g), torch.randn(h, v, generator=g)
    outs = [torch.randn(b, n, h, generator=g) for _ in range(3)]
    states = torch.randn(b, n, h, generator=g)
    weight = (torch.rand(b, n, generator=g) > 0.3).float()
    got = eagle3_losses(outs, states, weight, draft_ids, t2d, decay, head_logits=lambda x: x @ w_head,
                        teacher_logits=lambda x: x @ w_teacher)
    tl_all, want = states @ w_teacher, 0.0
    for k, out in enumerate(outs):
        tl, lg, w = tl_all[:, k:], out[:, :n - k] @ w_head, weight[:, k:]
        best = tl.argmax(-1)
        w_in = w * t2d[best].float()
        ce = -(torch.softmax(tl[..., draft_ids], -1) * torch.log_softmax(lg, -1)).sum(-1)
        step = (ce * w_in).sum() / w_in.sum().clamp(min=1.0)
        want += decay ** k * step
        if k == 0:
            torch.testing.assert_close(got["token"], step)
        assert float(got["step_correct"][k]) == float(((draft_ids[lg.argmax(-1)] == best).float() * w).sum())
        assert float(got["step_count"][k]) == float(w.sum())
    torch.testing.assert_close(got["loss"], torch.as_tensor(want, dtype=torch.float32))


def _key_before_the_ttt_options(cfg, runtime) -> str:
    """train_key as it was computed before the training-time test existed for EAGLE-1/2 heads (and ttt_start at all)."""
    import hashlib

    from polyspec.train.stage import OPERATIONAL_KEYS, TRAIN_FORMAT, head_settings

    if cfg.head == "eagle3":
        cfg = head_settings(cfg)
    train = {k: v for k, v in cfg.model_dump(mode="json").items() if k not in OPERATIONAL_KEYS}
    train.pop("ttt_start", None)
    # the schema of then: an EAGLE-1/2 head's draft vocabulary was train.loss_vocab, weight decay a key (0)
    train |= {"loss_vocab": train.pop("draft_vocab") or 0, "weight_decay": 0.0}
    if cfg.head == "eagle3":
        train |= {"loss_vocab": 0, "draft_vocab": cfg.draft_vocab}
    if cfg.head == "eagle":
        for k in ("head", "ttt_steps", "ttt_decay", "draft_vocab", "aux_layers"):
            train.pop(k, None)
    ident = {"format": TRAIN_FORMAT, "target": "t", "teacher": "t", "data": "d", "train": train,
             "runtime": {k: str(runtime[k]) for k in ("strategy", "devices", "precision", "accelerator")}}
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()


def test_eagle_ttt_options_checked_and_keyed():
    """EAGLE-1/2 heads take the training-time test (ttt_steps, ttt_decay, ttt_start). Heads without it (unset or
    ttt_steps 1), and every EAGLE-3 head trained without ttt_start, keep the keys they had before the options
    existed; an unrolled head gets its own key. ttt_decay / ttt_start without an unroll, and EAGLE-3-only options
    on an EAGLE-1/2 head, are refused."""
    from polyspec.train.stage import train_key

    def cfg(**kw):
        return validate_tree({"workdir": "w", "target": {"source": "x"}, "train": kw}, "test").train

    runtime = {"strategy": "auto", "devices": 1, "precision": "32-true", "accelerator": "cpu"}
    for old in (cfg(), cfg(max_steps=10), cfg(ttt_steps=1), cfg(head="eagle3"),
                cfg(head="eagle3", ttt_steps=2, draft_vocab=100, ttt_decay=0.5), cfg(head="eagle3", ttt_start=0.0)):
        assert train_key("t", "t", "d", old, runtime) == _key_before_the_ttt_options(old, runtime)
    base = train_key("t", "t", "d", cfg(), runtime)
    deep = train_key("t", "t", "d", cfg(ttt_steps=3), runtime)
    assert deep != base and train_key("t", "t", "d", cfg(ttt_steps=3, ttt_decay=0.8), runtime) == deep
    assert train_key("t", "t", "d", cfg(ttt_steps=3, ttt_start=0.5), runtime) != deep
    assert train_key("t", "t", "d", cfg(head="eagle3", ttt_start=0.5), runtime) != \
        train_key("t", "t", "d", cfg(head="eagle3"), runtime)
    for refused in ({"ttt_decay": 0.5}, {"ttt_steps": 1, "ttt_start": 0.5}):
        with pytest.raises(PolyspecError, match="only apply to an unrolled head"):
            cfg(**refused)
    with pytest.raises(PolyspecError, match="only apply to train.head=eagle3"):
        cfg(aux_layers=[1])


@pytest.mark.slow  # minutes of training on 2 cores: the fast tier keeps one training run per head kind
def test_tiny_eagle_training_with_an_unroll_logs_each_step_and_decodes_losslessly(tmp_path, tiny_model):
    """train.ttt_steps on an EAGLE-1/2 head: one step deep for the first ttt_start share of the steps, then
    unrolled (each step's agreement logged); the loss falls and the head decodes exactly like ar."""
    import lightning as L

    from polyspec.decode.chain import ChainDecoder
    from polyspec.decode.head import load_head
    from polyspec.decode.levels import HeadLevel, ModelLevel
    from polyspec.decode.model import Transformer
    from polyspec.pipeline import run_train as train_stage

    seen: dict[int, set[str]] = {}

    class Keys(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen[trainer.global_step] = set(pl_module.train_log)

    recipe = _recipe(tmp_path, tiny_model, ttt_steps=3, ttt_start=0.5, max_steps=12, epochs=20, checkpoint_every=6)
    out = train_stage(recipe, progress=False, log_every=1, callbacks=[Keys()])
    info = _info(out)
    assert info["steps"] == 12 and info["train"]["ttt_steps"] == 3
    deep = sorted(step for step, keys in seen.items() if "train/step2_agreement" in keys)
    assert deep == list(range(7, 13))  # steps 0..5 one deep (global_step 1..6 after them), then unrolled
    evals = [e["heldout/loss"] for e in info["eval_history"]]
    assert evals[-1] < evals[0]
    target = Transformer.from_pretrained(tiny_model).eval()
    head = load_head(out, target)
    prompt = [5, 17, 30, 9, 77, 3]
    ar = ChainDecoder([ModelLevel(target, "t")], max_seq_len=64).generate(prompt, 16).token_ids
    assert ChainDecoder([ModelLevel(target, "t"), HeadLevel(head, "h")], draft=DraftSpec(k=3),
                        max_seq_len=64).generate(prompt, 16).token_ids == ar


def test_an_eagle31_training_step_is_finite_and_trains_its_norms(tmp_path, peaked_model):
    """train.head=eagle3.1: the stage builds an EAGLE-3.1 head (fc_norm, norm_output), a training step unrolled three
    steps deep gives a finite loss whose gradient reaches every fc_norm, one optimizer step moves them, and the head
    gets its own training key (an eagle3 key is unchanged)."""
    from polyspec.decode.model import Transformer
    from polyspec.train.module import HeadModule
    from polyspec.train.stage import _new_head, head_settings, train_key

    teacher = Transformer.from_pretrained(peaked_model).eval()
    cfg = head_settings(_recipe(tmp_path, peaked_model, head="eagle3.1", draft_vocab=100).train)
    torch.manual_seed(0)
    counts = torch.randint(0, 1000, (teacher.args.vocab_size,), generator=torch.Generator().manual_seed(0))
    head = _new_head(cfg, teacher, counts)
    assert (head.head_type, head.norm_output, len(head.fc_norm), cfg.ttt_steps) == ("eagle3.1", True, 3, 3)
    module = HeadModule(head, cfg, draft_k=3, teacher=teacher)
    g = torch.Generator().manual_seed(1)
    b, t = 2, 20
    batch = {"input_ids": torch.randint(0, teacher.args.vocab_size, (b, t), generator=g),
             "loss_mask": (torch.rand(b, t, generator=g) > 0.3).long(), "lengths": torch.tensor([20, 14])}
    before = [n.weight.detach().clone() for n in head.fc_norm]
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=1e-2)
    loss = module._losses(batch, 0.0, cfg.ttt_steps)["loss"]
    loss.backward()
    assert math.isfinite(float(loss.detach()))
    assert all(n.weight.grad is not None and bool(n.weight.grad.abs().sum() > 0) for n in head.fc_norm)
    opt.step()
    assert all(not torch.equal(n.weight, w) for n, w in zip(head.fc_norm, before, strict=True))
    runtime = {"strategy": "auto", "devices": 1, "precision": "32-true", "accelerator": "cpu"}
    keys = {h: train_key("t", "t", "d", _recipe(tmp_path, peaked_model, head=h).train, runtime)
            for h in ("eagle3", "eagle3.1")}
    assert keys["eagle3"] != keys["eagle3.1"]


@pytest.mark.parametrize("steps", [1, 3])
def test_compiled_training_step_matches_the_eager_reference(tmp_path, tiny_model, steps):
    """train.compile: the training step's layer pass and row losses through torch.compile (inductor) give the eager
    reference's losses and gradients, one step deep and unrolled; validation stays eager. The loss vocabulary's
    lm_head rows are gathered once and give subset_logits' logits."""
    from polyspec.decode.head import EagleHead, subset_logits, top_token_ids
    from polyspec.decode.model import Transformer
    from polyspec.train.module import HeadModule
    from polyspec.train.stage import head_settings

    target = Transformer.from_pretrained(tiny_model)
    torch.manual_seed(0)
    head = EagleHead(target.args, target.embed_tokens, target.lm_head).float()
    ids = top_token_ids(torch.arange(target.args.vocab_size).flip(0), 40)
    extra = {"ttt_steps": steps, "ttt_start": 0.5} if steps > 1 else {}
    cfg = head_settings(_recipe(tmp_path, tiny_model, compile=True, draft_vocab=40, **extra).train)
    module = HeadModule(head, cfg, draft_k=3, loss_ids=ids)
    g = torch.Generator().manual_seed(1)
    b, t, h = 3, 24, target.args.hidden_size
    batch = {"input_ids": torch.randint(0, target.args.vocab_size, (b, t), generator=g),
             "loss_mask": (torch.rand(b, t, generator=g) > 0.3).long(), "lengths": torch.tensor([24, 20, 13]),
             "hidden": torch.randn(b, t, h, generator=g)}
    x = torch.randn(5, h, generator=g)
    torch.testing.assert_close(module._head_logits(x), subset_logits(head.lm_head, x, ids))
    results = []
    for fast in ({}, module._compiled()):
        parts = module._losses(batch, 0.0, steps, fast)
        grads = torch.autograd.grad(parts["loss"], [p for p in head.parameters() if p.requires_grad])
        results.append((parts, grads))
    (eager, g_eager), (compiled, g_compiled) = results
    assert set(module._compiled()) == {"layer", "row_losses"}
    for key in ("loss", "feature", "token", "correct", "count"):
        torch.testing.assert_close(compiled[key], eager[key], rtol=1e-4, atol=1e-5)
    for got, want in zip(g_compiled, g_eager, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-5)
    assert HeadModule(head, cfg.model_copy(update={"compile": False}), draft_k=3)._compiled() == {}


def test_compile_without_a_cpp_compiler_is_refused_before_any_work(tmp_path, tiny_model, monkeypatch):
    """train.compile=true on the CPU needs inductor's C++ compiler: without one, one clear error before anything is
    prepared (not a traceback at the first step, after the feature extraction)."""
    import polyspec.train.stage as stage
    from polyspec.pipeline import run_train

    recipe = _recipe(tmp_path, tiny_model, compile=True)
    monkeypatch.setattr(stage, "_cpp_compiler", lambda: False)
    with pytest.raises(PolyspecError, match="train.compile=false"):
        run_train(recipe, progress=False)
    assert not (tmp_path / "wd").exists()
    monkeypatch.setattr(stage, "_cpp_compiler", lambda: True)
    assert stage.runtime_settings(recipe.train, "cpu")["device"] == "cpu"
    assert stage.runtime_settings(_recipe(tmp_path, tiny_model).train, "cpu")["device"] == "cpu"


def test_line_progress_says_one_line_per_tenth_of_the_steps(capfd):
    """Piped output: polyspec's own progress lines instead of Lightning's bar (which redraws in place)."""
    from types import SimpleNamespace

    from polyspec.train.module import LineProgress

    bar = LineProgress()
    trainer = SimpleNamespace(estimated_stepping_batches=40, global_step=0, is_global_zero=True)
    for step in range(1, 41):
        trainer.global_step = step
        bar.on_train_batch_end(trainer, None, {"loss": torch.tensor(2.5)}, None, step - 1)
    lines = capfd.readouterr().err.splitlines()
    assert len(lines) == 10 and lines[0].startswith("train: step 4/40 (10%), loss 2.500,")
    assert lines[-1].startswith("train: step 40/40 (100%)")
    resumed = LineProgress()  # a resumed run past some marks reports the next one only
    trainer.global_step = 21
    resumed.on_train_batch_end(trainer, None, None, None, 0)
    assert capfd.readouterr().err.startswith("train: step 21/40 (52%), ")
    resumed.on_train_batch_end(SimpleNamespace(estimated_stepping_batches=40, global_step=40, is_global_zero=False),
                               None, None, None, 0)
    assert capfd.readouterr().err == ""
