"""Inside leanserve: every way of feeding tokens through the caches gives the logits of one full forward.

The tiny preset (window 16, CSA rate 4 with index_topk 4, HCA rate 16) makes sequences of 40-120 tokens
cross the window and many compression boundaries, in prefill and while decoding.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import MAX_LEN, LeanRunner, load_lean
from leanserve.model.batch import Chunk, build_forward_batch
from leanserve.model.loader import has_mtp_weights

TOL = 1e-4


def full(runner, ids: list[int]) -> torch.Tensor:
    """Logits of one forward over the whole sequence, in a fresh cache."""
    return runner(num_slots=1).prefill(ids)


def assert_close(ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    assert ours.shape == ref.shape, f"{what}: shape {tuple(ours.shape)} != {tuple(ref.shape)}"
    err = (ours - ref).abs().max().item()
    assert err <= TOL, f"{what}: max |dlogit| {err:.3g}"


def test_prefill_then_single_token_decode_equals_full_forward(runner, ids_of):
    ids = ids_of(100, 1)
    ref = full(runner, ids)
    run = runner(num_slots=1)
    rows = [run.prefill(ids[:37])]
    for t in range(37, len(ids)):
        rows.append(run.step([Chunk(slot=0, start=t, token_ids=[ids[t]])]))
    assert_close(torch.cat(rows), ref, "prefill 37 + 63 decode steps")


def test_decode_from_the_first_token(runner, ids_of):
    # No prefill at all: every window and every compressed row is built one token at a time.
    ids = ids_of(50, 2)
    ref = full(runner, ids)
    run = runner(num_slots=1)
    rows = [run.step([Chunk(slot=0, start=t, token_ids=[ids[t]])]) for t in range(len(ids))]
    assert_close(torch.cat(rows), ref, "50 single-token steps")


@pytest.mark.parametrize("sizes", [(7, 13, 1, 29, 3, 17, 10), (1, 2, 3, 5, 8, 13, 21, 27), (15, 16, 17, 32)])
def test_chunked_prefill_equals_whole_prefill(runner, ids_of, sizes):
    ids = ids_of(sum(sizes), 3)
    ref = full(runner, ids)
    run = runner(num_slots=2)
    rows, start = [], 0
    for size in sizes:
        rows.append(run.step([Chunk(slot=1, start=start, token_ids=ids[start : start + size])]))
        start += size
    assert_close(torch.cat(rows), ref, f"chunks {sizes}")


def test_logits_index_selects_rows(runner, ids_of):
    ids = ids_of(40, 4)
    ref = full(runner, ids)
    run = runner(num_slots=1)
    fb = build_forward_batch([Chunk(slot=0, start=0, token_ids=ids)], run.geo, logits_index=[39, 0, 17])
    with torch.no_grad():
        ours = run.model(fb, run.caches)
    assert_close(ours, ref[[39, 0, 17]], "logits_index")


def test_sequences_batched_in_one_step_equal_each_alone(runner, ids_of):
    # Three sequences of different lengths in different slots, advancing together with different starts and
    # chunk sizes; slot numbers deliberately not in chunk order.
    seqs = {3: ids_of(90, 10), 0: ids_of(45, 11), 2: ids_of(70, 12)}
    refs = {slot: full(runner, ids) for slot, ids in seqs.items()}
    got: dict[int, list[torch.Tensor]] = {slot: [] for slot in seqs}
    done = dict.fromkeys(seqs, 0)
    plan = [  # tokens each sequence feeds per step (0 = idle this step)
        {3: 21, 0: 5, 2: 33},
        {3: 1, 0: 19, 2: 1},
        {3: 40, 0: 1, 2: 16},
        {3: 1, 0: 1, 2: 1},
        {3: 3, 0: 0, 2: 7},
        {3: 24, 0: 19, 2: 12},
    ]
    run = runner(num_slots=4)
    for step in plan:
        chunks = [Chunk(slot=s, start=done[s], token_ids=seqs[s][done[s] : done[s] + n]) for s, n in step.items() if n]
        logits = run.step(chunks)
        assert logits.shape[0] == sum(len(c.token_ids) for c in chunks)
        offset = 0
        for c in chunks:
            got[c.slot].append(logits[offset : offset + len(c.token_ids)])
            offset += len(c.token_ids)
            done[c.slot] += len(c.token_ids)
    for slot, ids in seqs.items():
        assert done[slot] == len(ids)
        assert_close(torch.cat(got[slot]), refs[slot], f"slot {slot}")


def test_sequence_joins_a_running_batch(runner, ids_of):
    # A and B decode step by step; C arrives mid-way, prefilled in the same step as their decodes, then all
    # three decode together; A finishes early and B keeps going with C.
    a, b, c = ids_of(60, 20), ids_of(75, 21), ids_of(70, 22)
    refs = [full(runner, s) for s in (a, b, c)]
    run = runner(num_slots=3)
    out = {0: [], 1: [], 2: []}
    out[0].append(run.step([Chunk(0, 0, a[:30])]))
    first = run.step([Chunk(1, 0, b[:20]), Chunk(0, 30, a[30:31])])
    out[1].append(first[:20])
    out[0].append(first[20:])
    pos = {0: 31, 1: 20, 2: 0}
    seqs = {0: a, 1: b, 2: c}
    joined = False
    while any(pos[s] < len(seqs[s]) for s in seqs):
        chunks = []
        for s in (1, 0, 2):  # chunk order differs from slot order
            if s == 2 and not joined:
                if pos[0] < 45:
                    continue
                chunks.append(Chunk(2, 0, c[:41]))  # the newcomer's prefill, in the same step as decodes
                joined = True
                continue
            if pos[s] < len(seqs[s]):
                chunks.append(Chunk(s, pos[s], seqs[s][pos[s] : pos[s] + 1]))
        logits = run.step(chunks)
        offset = 0
        for ch in chunks:
            n = len(ch.token_ids)
            out[ch.slot].append(logits[offset : offset + n])
            offset += n
            pos[ch.slot] = ch.start + n
    assert joined
    for s in seqs:
        assert_close(torch.cat(out[s]), refs[s], f"slot {s}")


def test_slot_reuse_without_clearing(runner, ids_of):
    # Slot 0 first holds a longer sequence (its window ring, compressor rings and compressed rows all full of
    # stale data); a new, shorter sequence then starts in it at position 0 without any clearing.
    old, new = ids_of(120, 30), ids_of(57, 31)
    ref = full(runner, new)
    run = runner(num_slots=2)
    run.prefill(old[:70], slot=0)
    for t in range(70, len(old)):
        run.step([Chunk(slot=0, start=t, token_ids=[old[t]])])
    rows = [run.prefill(new[:23], slot=0)]
    for t in range(23, len(new)):
        rows.append(run.step([Chunk(slot=0, start=t, token_ids=[new[t]])]))
    assert_close(torch.cat(rows), ref, "reused slot")


def test_slot_reuse_batched_with_a_running_neighbour(runner, ids_of):
    # Slot reuse in the same step as another sequence's decode: the neighbour is unaffected, the newcomer
    # sees none of its slot's stale state.
    old, neighbour, new = ids_of(90, 40), ids_of(60, 41), ids_of(50, 42)
    refs = {0: full(runner, neighbour), 1: full(runner, new)}
    run = runner(num_slots=2)
    run.prefill(old, slot=1)
    n_logits = [run.prefill(neighbour[:30], slot=0)]
    logits = run.step([Chunk(0, 30, neighbour[30:31]), Chunk(1, 0, new[:35])])
    n_logits.append(logits[:1])
    new_logits = [logits[1:]]
    for i in range(15):
        logits = run.step([Chunk(1, 35 + i, new[35 + i : 36 + i]), Chunk(0, 31 + i, neighbour[31 + i : 32 + i])])
        new_logits.append(logits[:1])
        n_logits.append(logits[1:])
    assert_close(torch.cat(n_logits), refs[0][:46], "neighbour")
    assert_close(torch.cat(new_logits), refs[1], "reused slot")


def test_rollback_of_speculative_tokens(runner, ids_of):
    # With spec-token room in the rings, a step may feed 1 + k tokens of which only some are accepted; the
    # next step restarts from the committed count without any cache repair.
    k = 3
    ids = ids_of(90, 50)
    ref = full(runner, ids)
    run = runner(num_slots=1, num_spec_tokens=k)
    rows = [run.prefill(ids[:30])]
    committed = 30
    accepts = [0, 3, 1, 2, 0, 0, 3, 2, 1, 3, 0, 2, 1, 1, 3, 2, 0, 3, 1, 2]
    g = torch.Generator().manual_seed(7)
    for accept in accepts:
        if committed + 1 + k > len(ids):
            break
        # Feed the next true token, `accept` more true tokens, then wrong drafts up to k.
        drafts = list(ids[committed : committed + 1 + accept])
        drafts += torch.randint(0, 512, (k - accept,), generator=g).tolist()
        logits = run.step([Chunk(slot=0, start=committed, token_ids=drafts)])
        rows.append(logits[: 1 + accept])
        committed += 1 + accept
    for t in range(committed, len(ids)):
        rows.append(run.step([Chunk(slot=0, start=t, token_ids=[ids[t]])]))
    assert_close(torch.cat(rows), ref, "speculative steps with rejections")


def test_mtp_layer_loads_and_runs(tiny_ckpt, tiny_model, runner, ids_of):
    assert has_mtp_weights(tiny_ckpt)
    model = tiny_model
    assert model.mtp is not None
    cfg = model.cfg
    # The MTP weights were really loaded (make_random never leaves a parameter at zero).
    assert all(p.abs().sum() > 0 for p in model.mtp.parameters())
    ids = ids_of(48, 60)
    nxt = ids_of(48, 61)  # stand-ins for the t+1 tokens
    run = runner(num_slots=1)
    hidden = torch.zeros(len(ids), cfg.hc_mult * cfg.hidden_size)
    fb = build_forward_batch([Chunk(0, 0, ids)], run.geo)
    with torch.no_grad():
        trunk = model(fb, run.caches, target_hidden=hidden)
    assert torch.isfinite(trunk).all()
    streams = hidden.view(len(ids), cfg.hc_mult, cfg.hidden_size)
    assert streams.abs().sum() > 0
    with torch.no_grad():
        logits, out = model.mtp_forward(streams, build_forward_batch([Chunk(0, 1, nxt)], run.geo), run.caches)
    assert logits.shape == (len(ids), cfg.vocab_size) and logits.dtype == torch.float32
    assert out.shape == streams.shape
    assert torch.isfinite(logits).all() and torch.isfinite(out).all()
    assert logits.std() > 0.1

    # Its own cache: one MTP pass over the whole sequence == the same rows fed step by step.
    run2 = runner(num_slots=1)
    rows = []
    with torch.no_grad():
        for lo, hi in ((0, 20), (20, 21), (21, 33), *((t, t + 1) for t in range(33, 48))):
            fb = build_forward_batch([Chunk(0, 1 + lo, nxt[lo:hi])], run2.geo)
            rows.append(model.mtp_forward(streams[lo:hi], fb, run2.caches)[0])
    assert_close(torch.cat(rows), logits, "MTP incremental")


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_mtp_outputs_only_the_rows_asked_for(tiny_ckpt, ids_of, backend, monkeypatch):
    # The MTP layer's catch-up drafts from its last position only: with logits_index it gives the logits and output
    # streams of those rows alone (their MoE alone runs), the same as a pass over every row, and the other rows'
    # keys still go into its cache (the next position attends to them). The CPU kernels give a row the same bits
    # whatever rows it comes with; torch's matmuls need not.
    from leanserve.model.backends.cpu import decode

    model = load_lean(tiny_ckpt, with_mtp=True, backend=backend)
    cfg = model.cfg
    whole = []  # (the CPU backend's passes as numpy arrays, decode.mtp: what its decode steps run)
    monkeypatch.setattr(decode, "mtp", lambda *a, f=decode.mtp: whole.append(1) or f(*a))
    streams = torch.randn(12, cfg.hc_mult, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    ids = ids_of(12, 70)
    outputs = {}
    geo = dataclasses.replace(LeanRunner(model, 1, MAX_LEN, 2).geo, compress={})  # (as the MTP layer of k = 2 has)
    for name, index in (("all", None), ("last", [2]), ("two", [0, 2]), ("none", [])):
        run = LeanRunner(model, 1, MAX_LEN, 2)
        with torch.no_grad():  # positions 0-7, then a catch-up over 8-10 (`index`), then 11 (it attends to 8-10)
            model.mtp_forward(streams[:8], build_forward_batch([Chunk(0, 0, ids[:8])], geo), run.caches)
            fb = build_forward_batch([Chunk(0, 8, ids[8:11])], geo, logits_index=index)
            outputs[name] = model.mtp_forward(streams[8:11], fb, run.caches)
            fb = build_forward_batch([Chunk(0, 11, ids[11:])], geo)
            outputs[name] += model.mtp_forward(streams[11:], fb, run.caches)
    logits, out, after, _ = outputs["all"]
    assert outputs["last"][0].shape == (1, cfg.vocab_size)
    assert outputs["last"][1].shape == (1, cfg.hc_mult, cfg.hidden_size)
    same = torch.equal if backend == "cpu" else lambda a, b: torch.allclose(a, b, rtol=0, atol=TOL)
    for name, rows in (("last", [2]), ("two", [0, 2])):
        assert same(outputs[name][0], logits[rows]) and same(outputs[name][1], out[rows]), name
    assert outputs["none"][0].shape == (0, cfg.vocab_size) and outputs["none"][1].shape[0] == 0
    for name in ("last", "two", "none"):
        assert same(outputs[name][2], after), name
    assert len(whole) == (8 if backend == "cpu" else 0)  # (the last two steps of each)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_the_last_block_runs_its_moe_for_the_rows_whose_logits_are_wanted(tiny_ckpt, ids_of, backend, monkeypatch):
    # A prompt's chunk with no logits wanted, then a chunk whose last row's are: the last block's MoE runs for those
    # rows alone (the others' keys still go into every cache), and the logits are those of a pass over every row.
    from leanserve.model.backends.cpu import decode
    from leanserve.model.torch_math import attention as torch_attention

    model = load_lean(tiny_ckpt, backend=backend)
    ids, layers = ids_of(24, 5), model.cfg.num_hidden_layers
    moe_rows = []
    kind = type(model.ops)
    monkeypatch.setattr(kind, "moe", lambda self, w, x, i, f=kind.moe: moe_rows.append(len(x)) or f(self, w, x, i))
    monkeypatch.setattr(decode, "moe", lambda p, x, i, f=decode.moe: moe_rows.append(len(x)) or f(p, x, i))
    whole = []  # (the CPU backend's steps as numpy arrays, which chunks b and c are)
    monkeypatch.setattr(decode, "blocks", lambda *a, f=decode.blocks: whole.append(1) or f(*a))
    projected = []  # (the rows through the torch statement's output projections, whose queries were made)
    monkeypatch.setattr(torch_attention, "output", lambda o, w, x, f=torch_attention.output: projected.append(len(x))
                        or f(o, w, x))  # fmt: skip
    results = {}
    for name, index in (("all", (None, None)), ("wanted", ([], [2]))):
        run, moe_rows[:], projected[:] = LeanRunner(model, 1, MAX_LEN, 2), [], []
        with torch.no_grad():
            a = model(build_forward_batch([Chunk(0, 0, ids[:20])], run.geo, logits_index=index[0]), run.caches)
            b = model(build_forward_batch([Chunk(0, 20, ids[20:23])], run.geo, logits_index=index[1]), run.caches)
            c = model(build_forward_batch([Chunk(0, 23, ids[23:])], run.geo), run.caches)
        results[name] = a, b, c, list(moe_rows), list(projected)
    a, b, c, rows, out_rows = results["all"]
    a2, b2, c2, rows2, out_rows2 = results["wanted"]
    assert a2.shape[0] == 0 and b2.shape[0] == 1
    same = torch.equal if backend == "cpu" else lambda x, y: torch.allclose(x, y, rtol=0, atol=TOL)
    assert same(b2, b[2:]) and same(c2, c)
    assert rows == [20] * layers + [3] * layers + [1] * layers
    assert rows2 == [20] * (layers - 1) + [0] + [3] * (layers - 1) + [1] + [1] * layers
    assert len(whole) == (4 if backend == "cpu" else 0)
    # The torch statement (every chunk on the torch backend, the first on the CPU one): the last block makes no
    # queries and no output projection for rows whose output is not wanted, and none at all without such rows.
    if backend == "torch":
        assert out_rows == rows and out_rows2 == [20] * (layers - 1) + [3] * (layers - 1) + [1] + [1] * layers
    else:
        assert out_rows == [20] * layers and out_rows2 == [20] * (layers - 1)
