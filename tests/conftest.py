"""Shared fixtures: random-weight DeepSeek-V4 checkpoints (session-scoped, written once under
tmp_path_factory) and a small driver that runs leanserve's model step by step against its caches."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch

from leanserve.make_random import make_random
from leanserve.model.batch import Chunk, build_forward_batch
from leanserve.model.build import build_model
from leanserve.model.cache import CacheGeometry
from leanserve.model.config import CSA, HASH_MOE, HCA, MOE, SLIDING, ModelConfig
from leanserve.model.deepseek_v4 import DeepseekV4
from leanserve.model.loader import has_mtp_weights, load_weights

MAX_LEN = 256

# The models here are tiny: one thread is faster than several (and much faster on a shared, busy machine).
torch.set_num_threads(1)


def random_ids(n: int, seed: int, vocab: int = 512) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class LeanRunner:
    """A loaded leanserve model plus one set of caches; `step` runs one forward over a list of chunks."""

    def __init__(self, model: DeepseekV4, num_slots: int, max_len: int, num_spec_tokens: int = 0) -> None:
        self.model, self.cfg = model, model.cfg
        self.geo = CacheGeometry.build(model.cfg, num_slots, max_len, num_spec_tokens)
        self.caches = model.allocate_cache(self.geo, model.act_dtype)

    @torch.no_grad()
    def step(self, chunks: Sequence[Chunk], logits_index: list[int] | None = None) -> torch.Tensor:
        return self.model(build_forward_batch(list(chunks), self.geo, logits_index), self.caches)

    def prefill(self, ids: Sequence[int], slot: int = 0, start: int = 0) -> torch.Tensor:
        return self.step([Chunk(slot=slot, start=start, token_ids=list(ids))])

    def greedy(self, prompt: Sequence[int], n_new: int, slot: int = 0) -> list[int]:
        """Prefill, then one token per step through the cache."""
        logits = self.prefill(prompt, slot)
        out = [int(logits[-1].argmax())]
        for i in range(n_new - 1):
            logits = self.step([Chunk(slot=slot, start=len(prompt) + i, token_ids=[out[-1]])])
            out.append(int(logits[-1].argmax()))
        return out


def load_lean(
    model_dir: Path, dtype: torch.dtype = torch.float32, with_mtp: bool | None = None, max_len: int = MAX_LEN,
    backend: str = "auto",
) -> DeepseekV4:  # fmt: skip
    cfg = ModelConfig.from_hf(model_dir)
    if with_mtp is None:
        with_mtp = has_mtp_weights(model_dir)
    model = build_model(cfg, max_positions=max_len, dtype=dtype, with_mtp=with_mtp, backend=backend)
    load_weights(model, model_dir, progress=False)
    return model


@pytest.fixture(scope="session")
def make_ckpt(tmp_path_factory) -> Callable[..., Path]:
    """make_ckpt(name, preset="tiny", seed=0, dtype="float32", **overrides) -> checkpoint dir, written once."""
    made: dict[str, Path] = {}

    def make(name: str, preset: str = "tiny", seed: int = 0, dtype: str = "float32", **overrides) -> Path:
        if name not in made:
            made[name] = make_random(tmp_path_factory.mktemp(name), preset, seed, dtype, **overrides)
        return made[name]

    return make


# Five layers of the tiny preset (sliding, CSA, HCA, CSA, sliding; hash MoE first): a split over 2 or 3 pipeline
# stages puts every kind of layer somewhere.
FIVE_LAYERS = dict(
    num_hidden_layers=5,
    layer_types=(SLIDING, CSA, HCA, CSA, SLIDING),
    mlp_layer_types=(HASH_MOE, MOE, MOE, MOE, MOE),
)


@pytest.fixture(scope="session")
def ckpt5(make_ckpt) -> Path:
    return make_ckpt("tiny5", index_n_heads=16, **FIVE_LAYERS)


@pytest.fixture(scope="session")
def perturbed_head(tmp_path_factory) -> Callable[..., Path]:
    """perturbed_head(src, scale, seed) -> a copy of checkpoint `src` whose head has Gaussian noise of `scale`
    times its std added: a draft model that agrees with `src` on some tokens and not on others."""

    def make(src: Path, scale: float, seed: int) -> Path:
        import shutil

        from safetensors.torch import load_file, save_file

        out = tmp_path_factory.mktemp(f"{src.name}-draft")
        for f in src.iterdir():
            shutil.copy(f, out / f.name)
        tensors = load_file(out / "model.safetensors")
        head = next(n for n in tensors if n.endswith("head.weight") and "mtp" not in n)
        g = torch.Generator().manual_seed(seed)
        tensors[head] = tensors[head] + scale * tensors[head].std() * torch.randn(tensors[head].shape, generator=g)
        save_file(tensors, out / "model.safetensors")
        return out

    return make


@pytest.fixture(scope="session")
def tiny_ckpt(make_ckpt) -> Path:
    """The tiny preset (sliding / CSA / HCA, hash + top-k MoE, YaRN, hc_mult 4, index_topk 4 < compressed rows)
    with enough indexer heads that Lightning Indexer ties are improbable."""
    return make_ckpt("tiny", index_n_heads=16)


@pytest.fixture(scope="session")
def tiny_model(tiny_ckpt) -> DeepseekV4:
    """Loaded once with its MTP layer; weights are never written by a forward, caches are per test."""
    return load_lean(tiny_ckpt, with_mtp=True)


@pytest.fixture
def runner(tiny_model) -> Callable[..., LeanRunner]:
    def make(num_slots: int = 4, max_len: int = MAX_LEN, num_spec_tokens: int = 0) -> LeanRunner:
        return LeanRunner(tiny_model, num_slots, max_len, num_spec_tokens)

    return make


@pytest.fixture(scope="session")
def lean_loader() -> Callable[..., DeepseekV4]:
    return load_lean


@pytest.fixture(scope="session")
def lean_runner_cls() -> type[LeanRunner]:
    return LeanRunner


@pytest.fixture(scope="session")
def ids_of() -> Callable[[int, int], list[int]]:
    """ids_of(n, seed): n reproducible random token ids in the tiny vocabulary."""
    return random_ids
