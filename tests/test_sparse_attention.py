"""The torch statement's sparse attention (torch_math/attention.py `attend`, torch_math/compressor.py
`index_select`) against the dense form it replaced, written out here as the reference:

  * the indexer's choice, scored a chunk of rows at a time with a running top-k, is exactly the first topk of one
    stable descending sort of every row's score (-inf where not seen), ties (ReLU zeros, duplicated keys) to the
    lower row, whatever the chunks;
  * attention over each query's window and gathered chosen rows equals the attention over the window and every
    compressed row with a mask of the chosen ones;
  * with a small working-memory budget, no tensor of a step grows with the number of compressed rows.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from conftest import LeanRunner
from leanserve.model.batch import Chunk
from leanserve.model.build import build_model
from leanserve.model.cache import paged_rows
from leanserve.model.compressor import Indexer
from leanserve.model.config import ModelConfig
from leanserve.model.loader import load_weights
from leanserve.model.torch_math import attention, compressor
from leanserve.model.torch_math.attention import attend_scores, paged_range, scores
from leanserve.model.torch_math.compressor import (
    INDEX_BUDGET,
    ROW_ALIGN,
    _order_keys,
    index_pick,
    index_plan,
    index_scores,
    index_select,
)


# --- the reference: the dense statement before the sparse one -----------------------------------------------
def reference_choice(w, q, head_w, keys, visible):
    """Rows [NB, Bq, topk] ascending, -1 past those seen: one stable sort of every row's index score."""
    n = keys.shape[1]
    seen = torch.arange(n) < visible[..., None]
    chosen = index_pick(w, index_scores(w, q, keys, head_w).masked_fill(~seen, float("-inf")), seen)
    # (the mask as rows: ascending, then -1)
    rows = torch.where(chosen, torch.arange(n), n).sort(dim=-1).values[..., : min(w.topk, n)]
    return rows.masked_fill(rows >= n, -1)


def dense_attend(ops, w, q, ring, new_kv, fb, cache, iq, rope):
    """attend as it was: every compressed row a query sees is a key, masked to the indexer's choice."""
    store = ring if new_kv is None else torch.cat([ring, new_kv])
    out = torch.zeros_like(q)
    for g in fb.groups:
        keys, mask = store[g.key_index], g.key_mask
        n = g.max_visible[w.layer_type] if w.compressor is not None else 0
        if n:
            rows = paged_rows(cache.comp_rows, fb.block_table, g.block_slot, n)
            row_mask = torch.arange(n) < g.visible[w.layer_type][..., None]
            if iq is not None and n > w.indexer.topk:
                keys_i = paged_rows(cache.idx_rows, fb.block_table, g.block_slot, n).float()
                s = index_scores(w.indexer, g.gather(iq[0]), keys_i, g.gather(iq[1]))
                row_mask = index_pick(w.indexer, s.masked_fill(~row_mask, float("-inf")), row_mask)
            keys = torch.cat([keys, rows.to(keys.dtype)], dim=1)
            mask = torch.cat([mask, row_mask], dim=-1)
        attended = attend_scores(w, scores(w, g.gather(q), keys), mask, keys)
        out[g.q_rows[g.q_valid]] = attended[g.q_valid]
    return ops.apply_rope(out, rope, inverse=True)


# --- the indexer's choice -----------------------------------------------------------------------------------
def indexer_inputs(integers: bool, seed: int, n: int, heads=4, dim=16, topk=6):
    """(weights, q [NB, Bq, H, d], head weights [NB, Bq, H], keys [NB, n, d], visible [NB, Bq]) with exact ties:
    rows of zeros (every head's ReLU 0), duplicated rows, and (integers) small integer values, whose scores are
    exact in any order of summation, so that many distinct rows score exactly the same."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks, block = 3, 5

    def draw(*shape):
        if integers:
            return torch.randint(-2, 3, shape, generator=gen).float()
        return torch.randn(*shape, generator=gen)

    w = Indexer(16, 8, heads, dim, topk, 4, 1e-6).weights()
    q, keys = draw(num_blocks, block, heads, dim), draw(num_blocks, n, dim)
    head_w = draw(num_blocks, block, heads) * (0.5 if integers else 1.0)
    keys[0, 2:20] = 0.0  # every score exactly 0
    keys[1, 30:50] = keys[1, 7]  # the score of row 7
    keys[2, ::3] = keys[2, 1]
    visible = torch.tensor([[n, 0, 3, topk, topk + 1], [n, n - 1, 40, 1, 2 * topk], [n, 9, n - 13, 31, 5]])
    return w, q, head_w, keys, visible


def budget_for(width: int, blocks: int, q: torch.Tensor, topk: int) -> int:
    """The budget whose passes are `blocks` blocks scoring chunks of `width` rows (see index_plan)."""
    _, block, heads, dim = q.shape
    return blocks * ((block * (heads + 2) + dim) * width + 2 * block * topk)


# Float scores: chunks of multiples of 64 rows (whose columns the matmul computes alike, see ROW_ALIGN); exact
# integer scores: any chunks, down to one row. topk 70: chunks of at least 128 rows, in passes of fewer blocks.
@pytest.mark.parametrize(
    ("integers", "topk", "widths"), [(False, 6, (64, 128)), (False, 70, (128, 192)), (True, 6, (64, 7, 6, 1))]
)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_index_select_chooses_the_rows_of_one_stable_sort(integers, topk, widths, seed):
    n = 300
    w, q, head_w, keys, visible = indexer_inputs(integers, seed, n, topk=topk)
    ref = reference_choice(w, q, head_w, keys, visible)
    assert int((index_scores(w, q, keys, head_w)[0] == 0).sum()) > 18 * q.shape[1]  # (the ties are there)
    plans = set()
    for budget in [None] + [budget_for(c, b, q, w.topk) for c in widths for b in (1, 2, 3)]:
        plan = index_plan(*q.shape, w.topk, n, INDEX_BUDGET if budget is None else budget)
        assert (budget is None) == (plan[1] == n)  # (a small budget: chunks of fewer rows than n)
        assert integers or plan[2] % ROW_ALIGN == 0
        plans.add(plan)
        got = index_select(w, q, head_w, lambda b, c0, c1: keys[b, c0:c1], visible, n, budget=budget)
        assert torch.equal(got, ref), plan
    assert len(plans) >= 3 and any(step < 3 for step, _, _ in plans)  # (chunks of several sizes, passes)
    # a query that sees fewer than topk rows keeps them all; one that sees none, none
    assert got[0, 2].tolist() == [0, 1, 2] + [-1] * (topk - 3) and got[0, 1].tolist() == [-1] * topk


def test_order_keys_order_as_a_stable_descending_sort():
    # -0.0 equals 0.0 (a tie, to the lower row), -inf is below every score, subnormals keep their order.
    special = [0.0, -0.0, 1.5, -1.5, float("-inf"), 1.5, -0.0, 0.0, -2.0, float("inf"), float("-inf"), 3e-39, -3e-39]
    gen = torch.Generator().manual_seed(0)
    drawn = torch.randint(-3, 4, (500,), generator=gen).float() * 0.25
    for values in (torch.tensor(special), torch.cat([torch.tensor(special), drawn, -drawn])):
        keys = _order_keys(values, torch.arange(values.shape[0]))
        assert keys.unique().numel() == keys.numel()
        order = values.sort(descending=True, stable=True).indices
        assert torch.equal(keys.sort(descending=True).indices, order)


def test_index_select_reads_paged_rows_through_the_block_table():
    # The rows come from a paged pool scattered by a shuffled block table (paged_range), in chunks that start
    # and end inside the pool's blocks.
    w, q, head_w, keys, visible = indexer_inputs(True, 5, 61)
    n, per_block = keys.shape[1], 4
    pages = -(-n // per_block)
    gen = torch.Generator().manual_seed(3)
    table = torch.randperm(4 * pages, generator=gen)[: 3 * pages].view(3, pages).to(torch.int32)
    pool = torch.full((4 * pages, per_block, keys.shape[2]), float("nan"))
    pool[table.flatten().long()] = torch.cat([keys, torch.zeros(3, pages * per_block - n, keys.shape[2])], 1).view(
        -1, per_block, keys.shape[2]
    )
    slots = torch.tensor([0, 1, 2])
    ref = reference_choice(w, q, head_w, keys, visible)
    for budget in (None, 2000, 700):
        got = index_select(
            w, q, head_w, lambda b, c0, c1: paged_range(pool, table, slots[b], c0, c1), visible, n, budget
        )
        assert torch.equal(got, ref), budget


def test_index_plan_keeps_a_pass_within_its_budget():
    for blocks, queries, heads, dim, topk, n in [(32, 64, 64, 128, 512, 262144), (1, 1, 64, 128, 2048, 10**6),
                                                 (7, 3, 4, 16, 6, 61), (200, 64, 16, 32, 4, 4096)]:  # fmt: skip
        for budget in (64 * 2**20, 2**20, 10**5, 5000):
            step, rows, width = index_plan(blocks, queries, heads, dim, topk, n, budget)
            assert 1 <= step <= blocks and 1 <= rows <= min(n, width)
            assert width % ROW_ALIGN == 0 or width == rows < ROW_ALIGN
            used = step * (queries * heads * width + 2 * queries * (topk + width) + dim * width)
            # within the budget, unless a block's topk rows alone exceed it (then one block, and fewer rows)
            least = min(-(-n // ROW_ALIGN), -(-topk // ROW_ALIGN)) * ROW_ALIGN  # (chunks of at least topk rows)
            if (queries * (heads + 2) + dim) * least + 2 * queries * topk <= budget:
                assert used <= budget and width >= least, (blocks, queries, budget)
            else:
                assert step == 1 and width < least


# --- attention: the gathered rows against the masked dense form ---------------------------------------------
@pytest.fixture(scope="module")
def torch_model(tiny_ckpt):
    cfg = ModelConfig.from_hf(tiny_ckpt)
    model = build_model(cfg, max_positions=512, backend="torch")
    load_weights(model, tiny_ckpt, progress=False)
    assert type(model.ops).__name__ == "TorchBackend"
    return model


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor any op makes (views excluded: they hold no memory of their own)."""

    def __init__(self):
        super().__init__()
        self.most = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and not t._is_view():
                self.most = max(self.most, t.numel())
        return out


def run_steps(model, steps, monkeypatch, budget: int | None = None) -> dict:
    """Runs `steps` (lists of (slot, start, length) chunks of one random sequence per slot) through the torch
    backend with attend compared, call by call, to the dense form; with `budget`, both working-memory budgets
    are that small and each call's largest new tensor is checked against it."""
    seen = {"calls": 0, "chosen": 0, "passes": 0}
    new_attend = attention.attend

    def spy(ops, w, q, ring, new_kv, fb, cache, iq, rope):
        n = max(g.max_visible[w.layer_type] for g in fb.groups) if w.compressor is not None else 0
        with LargestTensor() as largest:
            out = new_attend(ops, w, q, ring, new_kv, fb, cache, iq, rope)
        ref = dense_attend(ops, w, q, ring, new_kv, fb, cache, iq, rope)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        seen["calls"] += 1
        seen["chosen"] += iq is not None and n > w.indexer.topk
        if budget is not None:
            # nothing beyond the budget but copies of the step's own per-token tensors (q [T, H, D], the indexer's
            # queries [T, H', d]) and its window keys
            store = (ring.shape[0] + (0 if new_kv is None else new_kv.shape[0])) * q.shape[-1]
            step = max(q.numel(), 0 if iq is None else iq[0].numel(), store)
            assert largest.most <= max(budget, step), (largest.most, w.layer_type, n)
            # while the dense form's scores over every row would not fit
            dense = sum(g.q_rows.numel() * w.heads * (g.key_index.shape[1] + n) for g in fb.groups)
            seen["passes"] += dense > budget
        return out

    monkeypatch.setattr(attention, "attend", spy)
    if budget is not None:
        monkeypatch.setattr(attention, "ATTEND_BUDGET", budget)
        monkeypatch.setattr(compressor, "INDEX_BUDGET", budget)
    run = LeanRunner(model, num_slots=3, max_len=512)
    ids = {s: torch.randint(2, 500, (512,), generator=torch.Generator().manual_seed(s)).tolist() for s in range(3)}
    for chunks in steps:
        run.step([Chunk(slot, start, ids[slot][start : start + size]) for slot, start, size in chunks])
    return seen


def test_attend_over_gathered_rows_equals_the_masked_dense_form(torch_model, monkeypatch):
    # Prefill in chunks (query blocks of 64 queries), mixed with decode steps of other slots and a short chunk
    # (one block per chunk), then decode: in the CSA layers the indexer chooses 4 of up to ~60 rows.
    steps = [
        [(0, 0, 150)],
        [(0, 150, 1), (1, 0, 90)],
        [(0, 151, 1), (1, 90, 5), (2, 0, 30)],
        [(0, 152, 100), (1, 95, 1), (2, 30, 1)],
        *[[(0, 252 + i, 1), (1, 96 + i, 1), (2, 31 + i, 1)] for i in range(3)],
    ]
    seen = run_steps(torch_model, steps, monkeypatch)
    assert seen["chosen"] >= 2 * len(steps)  # (two CSA layers: the indexer chose in every step)


def test_attend_working_memory_stays_within_a_small_budget(torch_model, monkeypatch):
    # A 400-token prefill (7 blocks, 100 CSA rows) and decode steps with a budget of a block's scores and a bit:
    # passes of one or two blocks, the indexer's rows in chunks of a few, and the same outputs.
    budget = 64 * 4 * (79 + 4 + 1) + 4000
    steps = [[(0, 0, 400)], [(0, 400, 1), (1, 0, 70)], [(0, 401, 1), (1, 70, 1)]]
    seen = run_steps(torch_model, steps, monkeypatch, budget)
    assert seen["chosen"] >= 2 * len(steps) and seen["passes"] >= 2
