"""The CPU backend (the numba kernels) agrees with the torch backend, op by op and on whole engines, and the
engine takes the CPU backend's decode path where it should."""

import contextlib
import os
import platform

import numpy as np
import pytest
import torch

from leanserve.model.backends import TorchBackend, select_backend
from leanserve.model.backends.cpu import kernels as cpu_kernels
from leanserve.model.layers import set_backend
from leanserve.model.weights import MixWeights

pytestmark = pytest.mark.skipif(cpu_kernels.numba is None, reason="numba is not installed")

TORCH = TorchBackend()


@contextlib.contextmanager
def _torch_threads(n: int):
    """torch, and the kernels that follow its thread count, on n threads while the block runs."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _cpu():
    from leanserve.model.backends.cpu.backend import CpuBackend

    return CpuBackend()


def _both(op: str, *args):
    """The op through the CPU backend and through the torch backend."""
    return getattr(_cpu(), op)(*args), getattr(TORCH, op)(*args)


def _module_both(module, *args):
    """A module's output on the CPU backend and on the torch backend."""
    set_backend(module, _cpu())
    fast = module(*args)
    set_backend(module, TORCH)
    return fast, module(*args)


def test_backend_is_chosen_from_device_dtype_and_kernels():
    from leanserve.model.backends.cpu.backend import CpuBackend

    assert isinstance(select_backend("cpu", torch.float32), CpuBackend)
    assert isinstance(select_backend("cpu", torch.bfloat16), CpuBackend)
    assert type(select_backend("cpu", torch.float16)) is TorchBackend  # the kernels read float32 / bf16 weights
    assert type(select_backend("meta", torch.bfloat16)) is TorchBackend
    assert type(select_backend("cpu", torch.float32, "torch")) is TorchBackend
    with cpu_kernels.disabled():
        assert type(select_backend("cpu", torch.float32)) is TorchBackend
        with pytest.raises(ValueError, match="cpu backend needs"):
            select_backend("cpu", torch.float32, "cpu")
    with pytest.raises(ValueError, match="Unknown backend 'cuda-graphs'"):
        select_backend("cpu", torch.float32, "cuda-graphs")


@pytest.mark.parametrize("rows", [1, 5, 16, 17, 70])
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_linear_and_norms_match_torch(rows, weight_dtype):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 3, 64, generator=gen)
    w = torch.randn(41, 64, generator=gen).to(weight_dtype)  # (an odd row count: the tile's last row alone)
    w2 = torch.randn(7, 64, generator=gen).to(weight_dtype)
    grouped_w = torch.randn(3, 24, 64, generator=gen).to(weight_dtype)
    norm_w = torch.rand(64, generator=gen) + 0.5
    angles = torch.rand(rows, 16, generator=gen) * 6
    freqs = torch.polar(torch.full_like(angles, 1.3), angles)
    for op, args in [
        ("linears", (x, (w, w2))),
        ("grouped_linear", (x, grouped_w.flatten(0, 1))),
        ("rms_norm", (x, 1e-6)),
        ("rms_norm", (x, 1e-6, norm_w)),
        ("norm_rope", (x, freqs, 1e-6)),
        ("norm_rope", (x, freqs, 1e-6, norm_w)),
    ]:
        fast, ref = _both(op, *args)
        torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 6, 7])
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_few_row_linears_match_torch(rows, weight_dtype):
    # Decode at batch 1-4 and speculative verification: up to four rows, bfloat16 weights widened in registers;
    # 6 and 7 rows: a four-row tile, then two or three rows in one more pass.
    gen = torch.Generator().manual_seed(100 + rows)
    x = torch.randn(rows, 192, generator=gen)
    weights = tuple(torch.randn(n, 192, generator=gen).to(weight_dtype) for n in (41, 64, 4))
    fast, ref = _both("linears", x, weights)
    for a, b in zip(fast, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("inverse", [False, True])
def test_rope_matches_torch(inverse):
    gen = torch.Generator().manual_seed(int(inverse))
    x = torch.randn(9, 4, 64, generator=gen)
    freqs = torch.polar(torch.ones(9, 16), torch.rand(9, 16, generator=gen) * 6)
    fast, ref = _both("apply_rope", x, freqs, inverse)
    torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-5)
    assert not torch.equal(fast, x)  # it rotated something


@pytest.mark.parametrize("tokens", [1, 3, 40, 300])  # (1, 3: the Sinkhorn a lane at a time; 300: ten blocks)
def test_hc_pre_and_post_match_torch(tokens):
    gen = torch.Generator().manual_seed(tokens)
    hc, dim = 4, 32
    streams = torch.randn(tokens, hc, dim, generator=gen)
    fn = torch.randn((2 + hc) * hc, hc * dim, generator=gen) * 0.1
    base, scale = torch.randn((2 + hc) * hc, generator=gen), torch.rand(3, generator=gen) + 0.5
    norm_w = torch.rand(dim, generator=gen) + 0.5
    fast, ref = _both("hc_pre", streams, MixWeights(fn, base, scale, norm_w, 1e-6, 1e-6, 20))
    for a, b in zip(fast, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # Sinkhorn ends with a column normalisation: every column of comb sums to 1
    torch.testing.assert_close(fast[2].sum(-2), torch.ones(tokens, hc), rtol=1e-5, atol=1e-5)
    block_out = torch.randn(tokens, dim, generator=gen)
    fast, ref = _both("hc_post", block_out, streams, *fast[1:])
    torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tokens", [1, 3, 15, 40])
def test_hc_post_then_pre_in_one_call(tokens):
    # The decode path runs one site's hc_post and the next site's hc_pre as one kernel call below FUSED_MIX tokens
    # (the separate calls above it): the same streams, next input and weights as the two calls one after the other.
    from leanserve.model.backends.cpu import arrays
    from leanserve.model.backends.cpu.views import numpy_views

    gen = torch.Generator().manual_seed(tokens)
    hc, dim = 4, 32

    def mix():
        fn = torch.randn((2 + hc) * hc, hc * dim, generator=gen) * 0.1
        base, scale = torch.randn((2 + hc) * hc, generator=gen), torch.rand(3, generator=gen) + 0.5
        return numpy_views(MixWeights(fn, base, scale, torch.rand(dim, generator=gen) + 0.5, 1e-6, 1e-6, 20))

    streams = torch.randn(tokens, hc, dim, generator=gen).numpy()
    first, second = mix(), mix()
    _, before = arrays.hc_pre_arrays(streams, first)
    block_out = torch.randn(tokens, dim, generator=gen).numpy()
    fused = arrays.mixed_in(streams, second, (block_out, before))
    after = arrays.hc_post_arrays(block_out, streams, *arrays.post_comb(before, hc))
    apart = (after, *arrays.hc_pre_arrays(after, second))
    for a, b in zip(fused, apart, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    assert not np.allclose(fused[0], streams)  # (the post-mix changed the streams)
    np.testing.assert_allclose(arrays.settled(streams, (block_out, before)), after)


@pytest.mark.parametrize("tokens", [1, 9])
def test_hc_head_matches_torch(tokens):
    # hc_head + the final norm run as hc_pre's kernel with its pre weights only
    gen = torch.Generator().manual_seed(tokens)
    hc, dim = 4, 32
    streams = torch.randn(tokens, hc, dim, generator=gen)
    fn, base = torch.randn(hc, hc * dim, generator=gen) * 0.1, torch.randn(hc, generator=gen)
    scale, norm_w = torch.rand(1, generator=gen) + 0.5, torch.rand(dim, generator=gen) + 0.5
    fast, ref = _both("hc_head", streams, MixWeights(fn, base, scale, norm_w, 1e-6, 1e-6, 0))
    torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-5)
    assert fast.shape == (tokens, dim)


@pytest.mark.parametrize("kind", ["moe", "hash_moe"])
@pytest.mark.parametrize("scoring", ["sqrtsoftplus", "sigmoid", "softmax"])
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", ["few", 300])  # (300: a prefill's, in one call as the experts are small)
def test_moe_kernel_matches_torch(kind, scoring, weight_dtype, tokens):
    _check_moe(kind, scoring, weight_dtype, tokens)


@pytest.mark.parametrize("kind", ["moe", "hash_moe"])
def test_moe_of_large_experts_in_a_prefill_matches_torch(kind, monkeypatch):
    # Experts above SMALL_EXPERT take torch's grouped matmuls over rows grouped by expert from FEW_ROWS rows on.
    from leanserve.model.backends.cpu import backend as cpu_backend

    monkeypatch.setattr(cpu_backend, "SMALL_EXPERT", 0)
    moe = _check_moe(kind, "sqrtsoftplus", torch.float32, 300)
    assert moe.experts.w13_entries > cpu_backend.SMALL_EXPERT


@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
def test_large_experts_stored_narrower_than_float32_take_the_kernels_in_a_prefill(weight_dtype, monkeypatch):
    # Experts above SMALL_EXPERT stored in bfloat16 (or FP8 / FP4), which torch's path would widen or dequantize
    # whole first, run as one compiled call at any number of rows; float32 ones take torch's grouped matmuls from
    # FEW_ROWS rows on.
    from leanserve.model.backends.cpu import arrays
    from leanserve.model.backends.cpu import backend as cpu_backend

    monkeypatch.setattr(cpu_backend, "SMALL_EXPERT", 0)
    calls = []
    monkeypatch.setattr(arrays, "moe_arrays", lambda *a, f=arrays.moe_arrays: calls.append(len(a[0])) or f(*a))
    _check_moe("moe", "sqrtsoftplus", weight_dtype, 300)
    assert calls == ([300] if weight_dtype == torch.bfloat16 else [])


def _check_moe(kind, scoring, weight_dtype, tokens):
    from dataclasses import replace

    from leanserve.model.backends.cpu.backend import FEW_ROWS
    from leanserve.model.config import ModelConfig
    from leanserve.model.moe import MoE

    tokens = FEW_ROWS if tokens == "few" else tokens
    cfg = replace(ModelConfig.from_hf("models/dsv4-stdlib-8m"), scoring_func=scoring)
    gen = torch.Generator().manual_seed(7)
    moe = MoE(cfg, kind).requires_grad_(False)
    for p in moe.parameters():
        p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    w = moe.weights()
    for p in (w.gate, w.w13, w.w2, w.shared_w1, w.shared_w3, w.shared_w2):  # in the checkpoint's dtype
        p.data = p.data.to(weight_dtype)
    if kind == "hash_moe":
        moe.gate.tid2eid.copy_(torch.randint(0, cfg.n_routed_experts, moe.gate.tid2eid.shape, generator=gen))
    x = torch.randn(tokens, cfg.hidden_size, generator=gen)
    ids = torch.randint(0, cfg.vocab_size, (tokens,), generator=gen)
    fast, ref = _module_both(moe, x, ids)
    torch.testing.assert_close(fast, ref, rtol=1e-4, atol=1e-5)
    return moe


def _quantized_experts(w: torch.Tensor, kind: str, halves: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked float experts [E, out, in] as stored (values, scales): FP4, or FP8 with a scale grid per half of
    the rows (w13: its w1 and w3 halves, 2; w2: 1)."""
    from leanserve.model.quant import quantize_fp4, quantize_fp8

    if kind == "fp4":
        parts = [quantize_fp4(e) for e in w]
        return torch.stack([p.packed for p in parts]), torch.stack([p.scale for p in parts])
    qs, scales = [], []
    for e in w:
        parts = [quantize_fp8(h) for h in e.chunk(halves)]
        qs.append(torch.cat([p.q for p in parts]))
        scales.append(torch.stack([p.scale for p in parts]))
    return torch.stack(qs), torch.stack(scales)


def _fill_quantized(model: torch.nn.Module, plain: torch.nn.Module) -> None:
    """Fills a model built with a quantization config from a plain one of the same config otherwise: FP8 linears
    and FP4 / FP8 experts quantized from the plain weights, everything else copied."""
    from leanserve.model.layers import Linear
    from leanserve.model.moe import Experts
    from leanserve.model.quant import quantize_fp8

    source = {**dict(plain.named_parameters()), **dict(plain.named_buffers())}
    done = set()
    with torch.no_grad():
        for name, m in model.named_modules():
            prefix = f"{name}." if name else ""
            if isinstance(m, Linear) and m.quant == "fp8":
                w = quantize_fp8(source[prefix + "weight"])
                m.weight.copy_(w.q)
                m.scale.copy_(w.scale)
                done |= {prefix + "weight", prefix + "scale"}
            elif isinstance(m, Experts) and m.quant is not None:
                for part, halves in (("w13", 2), ("w2", 1)):
                    values, scale = _quantized_experts(source[prefix + part], m.quant, halves)
                    getattr(m, part).copy_(values)
                    getattr(m, f"{part}_scale").copy_(scale)
                    done |= {prefix + part, f"{prefix}{part}_scale"}
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if name not in done:
                t.copy_(source[name])


def test_kernels_dequantize_as_quant_py():
    # Every e4m3 byte (but its NaNs) and every e2m1 code, times scales from 2^-127 to 2^127: the kernels' decoding
    # is quant.py's dequantization, bit for bit (prefill dequantizes with it; the few-row kernels decode the same).
    from leanserve.model.backends.cpu.views import numpy_views
    from leanserve.model.quant import Fp4Weight, Fp8Weight

    gen = torch.Generator().manual_seed(5)
    q = torch.arange(256, dtype=torch.uint8).repeat(300, 3)[:, :700]  # [300, 700]: partial scale blocks
    q[(q & 0x7F) == 0x7F] = 0
    w8 = Fp8Weight(q.view(torch.float8_e4m3fn), torch.randint(0, 255, (3, 6), dtype=torch.uint8, generator=gen))
    w4 = Fp4Weight(torch.randint(0, 256, (40, 48), dtype=torch.uint8, generator=gen),
                   torch.randint(0, 255, (40, 3), dtype=torch.uint8, generator=gen))  # fmt: skip
    for w in (w8, w4):
        assert torch.equal(torch.from_numpy(cpu_kernels.dequantized(numpy_views(w))), w.dequantize())


@pytest.mark.parametrize("inputs", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("in_features", [32, 96, 128, 224, 512, 736, 1024])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5])
def test_fp4_few_rows_match_the_dequantized_weight(rows, in_features, inputs):
    # The few-row FP4 reader (decode, verification; this host's: AVX-512, AVX2 or neither): whole 128-value chunks
    # (four at a time and alone), a last chunk of 1-3 groups, every code, scales from 2^-127 (UE8M0 0) to 2^13:
    # each output is x . W dequantized, up to float32 rounding of its sum; with bfloat16 inputs (vdpbf16ps on
    # AVX512-BF16) x rounded to bfloat16 by torch, with int8 (integer multiply-adds on AVX-512 VNNI or AVX2: steps of
    # 256 inputs and a last one of 1-7 groups) to 8 bits a block by quant.int8_rounded. Five rows take the decoded
    # blocks through the tiles.
    from leanserve.model.backends.cpu.kernels.quantized import _fp4_rows_jit
    from leanserve.model.quant import INPUT_CODES, INPUTS, Fp4Weight, int8_rounded

    gen = torch.Generator().manual_seed(rows * in_features)
    packed = torch.randint(0, 256, (37, in_features // 2), dtype=torch.uint8, generator=gen)
    scale = torch.randint(100, 141, (37, in_features // 32), dtype=torch.uint8, generator=gen)
    scale[0] = 0
    scale[1, -1] = 0
    w = Fp4Weight(packed, scale).dequantize().double()
    x = torch.randn(rows, in_features, generator=gen)
    out = np.empty((rows, 37), dtype=np.float32)
    _fp4_rows_jit(x.numpy(), packed.numpy(), scale.numpy(), out, rows, INPUT_CODES[INPUTS[inputs]])
    if inputs == "bfloat16":  # (the rounding moves a sum by about 1e-3 of its terms' size: far outside the bound)
        x = x.to(torch.bfloat16).float()
    elif inputs == "int8":  # (and this one by about 5e-3)
        x = int8_rounded(x)
    ref = x.double() @ w.T
    bound = 1e-6 * (x.double().abs() @ w.abs().T) + 1e-44
    assert ((torch.from_numpy(out).double() - ref).abs() <= bound).all()
    if inputs != "int8":  # (rounded to 8 bits a block, x's products with a row's codes can add up to exactly 0)
        assert (torch.from_numpy(out[:, 0]) != 0).all()  # (row 0's values are 2^-127 times the codes)


@pytest.mark.parametrize("code", [0, 2])
@pytest.mark.parametrize("in_features", [224, 1024])
def test_fp4_few_rows_give_each_row_its_bits_alone(in_features, code):
    # Batch invariance of the few-row FP4 reader: a row of x among two to four (verification, batch 2-4; on AVX2
    # three and four rows take a chunk by halves) gets the same bits as alone (decode at batch 1); so does the
    # int8-inputs reader (quant.INPUT_CODES' 2).
    from leanserve.model.backends.cpu.kernels.quantized import _fp4_rows_jit

    gen = torch.Generator().manual_seed(in_features)
    packed = torch.randint(0, 256, (37, in_features // 2), dtype=torch.uint8, generator=gen).numpy()
    scale = torch.randint(110, 135, (37, in_features // 32), dtype=torch.uint8, generator=gen).numpy()
    x = torch.randn(4, in_features, generator=gen).numpy()
    alone = np.empty((4, 37), dtype=np.float32)
    for t in range(4):
        _fp4_rows_jit(x[t : t + 1], packed, scale, alone[t : t + 1], 1, code)
    for rows in (2, 3, 4):
        out = np.empty((rows, 37), dtype=np.float32)
        _fp4_rows_jit(x[:rows], packed, scale, out, rows, code)
        assert np.array_equal(out, alone[:rows]), rows


@pytest.mark.skipif(
    not cpu_kernels.rowdots._AVX512_INT8, reason="the AVX-512 int8 dots need AVX512-VNNI and AVX512-VBMI"
)
@pytest.mark.parametrize("xrows", [1, 2, 3, 4])
def test_fp4_int8_dots_give_the_same_bits_on_avx512_and_avx2(xrows):
    # The int8-inputs FP4 dots on AVX-512 (vpermb lookups, vpdpbusd: four groups a vector) sum each group and lane
    # in the order the AVX2 ones do (two groups a vector, two chains): the same bits, over whole steps of 256
    # inputs and a last step of 1-7 groups, scales from 2^-127 to 2^13 (the host's, AVX-512 here, are held to the
    # dequantized weight above).
    from leanserve.model.backends.cpu.kernels.base import _jit
    from leanserve.model.backends.cpu.kernels.int8dots import fp4_int8_row_dots
    from leanserve.model.backends.cpu.kernels.quantized import _fp4_walk, _int8_inputs

    def rows(wide):  # (x rounded and laid out, then every weight row)
        walk = _fp4_walk(fp4_int8_row_dots(xrows, wide))

        def run(packed, s, x, out):  # pragma: no cover - compiled
            walk(packed, s, _int8_inputs(x, x.shape[0]), out, out.shape[1])

        return _jit(run)

    runs = [rows(wide) for wide in (True, False)]  # (compiled once, for every width below)
    gen = torch.Generator().manual_seed(xrows)
    packed = torch.randint(0, 256, (37, 2048 + 112), dtype=torch.uint8, generator=gen).numpy()
    scale = torch.randint(100, 141, (37, (4096 + 224) // 32), dtype=torch.uint8, generator=gen).numpy()
    scale[0] = 0
    for k_dim in (224, 256, 4096 + 224):
        x = torch.randn(xrows, k_dim, generator=gen).numpy()
        outs = []
        for run in runs:
            out = np.empty((xrows, 37), dtype=np.float32)
            run(np.ascontiguousarray(packed[:, : k_dim // 2]), np.ascontiguousarray(scale[:, : k_dim // 32]), x, out)
            outs.append(out)
        assert np.array_equal(outs[0].view(np.uint32), outs[1].view(np.uint32)), k_dim


_WITHOUT = """
import sys
import llvmlite.binding as llb

host = llb.get_host_cpu_features


def features():  # this host's, less the ISA extensions named
    f = host()
    for name in list(f):
        if name in sys.argv[1:] or ("avx512" in sys.argv[1:] and name.startswith("avx512")):
            f[name] = False
    return f


llb.get_host_cpu_features = features
import numpy as np
import torch

from leanserve.model.backends.cpu.kernels import quantized
from leanserve.model.quant import int8_rounded, quantize_fp4, quantize_fp8

assert quantized._FP4B_FEW is None and quantized._FP8B_1 is None
assert (quantized._FP4_FEW is None) == (quantized._FP4I_FEW is None) == (not features().get("avx2", False))
w8 = quantize_fp8(torch.randn(40, 300))
for n in (1, 2, 5):
    x = torch.randn(n, 300)
    out = np.empty((n, 40), dtype=np.float32)
    quantized._fp8_rows_jit(x.numpy(), w8.q.view(torch.uint8).numpy(), w8.scale.numpy(), 0, out, n, True)
    xr = x.to(torch.bfloat16).double()
    ref, size = xr @ w8.dequantize().double().T, xr.abs() @ w8.dequantize().double().abs().T
    assert ((torch.from_numpy(out).double() - ref).abs() <= 1e-6 * size).all(), ("fp8", n)
w = quantize_fp4(torch.randn(40, 224) * 0.02)
rounded = (lambda x: x, lambda x: x.to(torch.bfloat16).float(), int8_rounded)  # (by quant.INPUT_CODES)
for code in (0, 1, 2):
    for n in (1, 2, 5):
        x = torch.randn(n, 224)
        out = np.empty((n, 40), dtype=np.float32)
        quantized._fp4_rows_jit(x.numpy(), w.packed.numpy(), w.scale.numpy(), out, n, code)
        xr = rounded[code](x)
        ref = xr.double() @ w.dequantize().double().T
        bound = 1e-6 * (xr.double().abs() @ w.dequantize().double().abs().T)
        assert ((torch.from_numpy(out).double() - ref).abs() <= bound).all(), (code, n)
print("ok")
"""


@pytest.mark.parametrize("without", [["avx512bf16"], ["avx512"], ["avx512", "avx2"]])
def test_quantized_readers_compile_and_agree_on_hosts_without_avx512_bf16_avx512_or_avx2(without, tmp_path):
    # On a host without AVX512-BF16 (or without AVX-512, or without AVX2 either) the few-row FP4 and FP8 readers
    # compile without the intrinsics they cannot use and give the same sums, float32, bfloat16 or int8 inputs (a
    # fresh process and kernel cache that see this host's CPU features less those named). Where the host has none
    # of them, that process would build what this one runs in the other tests (50 s of compiling on a slow host).
    import subprocess
    import sys

    import llvmlite.binding as llb

    features = llb.get_host_cpu_features().items()  # (those the script takes away, as it picks them)
    held = [f for f, on in features if on and (f in without or ("avx512" in without and f.startswith("avx512")))]
    if not held:
        pytest.skip(f"this host has none of {without}: the other tests run its own readers")
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path))
    run = subprocess.run([sys.executable, "-c", _WITHOUT, *without], capture_output=True, text=True, env=env)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]


def test_fp4_inputs_round_to_bfloat16_as_torch_does():
    # The kernels' rounding to bfloat16 (to nearest, ties to even) gives torch's bits for ties either way, the
    # largest floats (to inf), subnormals, signed zeros, infinities and NaN; and the permuted layout the
    # AVX512-BF16 dots read puts element 4i + p of each 128-chunk at 32p + i, zeros past the end.
    from leanserve.model.backends.cpu.kernels.quantized import _bf16_rounded_jit, _fp4_bf16_x_jit

    bits = [0x3F808000, 0x3F818000, 0x3F80_7FFF, 0x3F80_8001, 0x7F7FFFFF, 0xFF7FFFFF, 0x00000001, 0x807FFFFF,
            0x80000000, 0x00000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001, 0xFFFFFFFF]  # fmt: skip
    rng = np.random.default_rng(0)
    raw = np.concatenate([np.array(bits, dtype=np.uint32), rng.integers(0, 2**32, 145, dtype=np.uint32)])
    x = raw.view(np.float32).reshape(1, 160)
    want = torch.from_numpy(x.copy()).to(torch.bfloat16)
    got = _bf16_rounded_jit(x, 1)
    same = (got.view(np.uint32) >> 16) == want.view(torch.int16).numpy().view(np.uint16)
    assert (same | (np.isnan(got) & want.isnan().numpy())).all()
    xb = np.full((1, 256), 7, dtype=np.uint16)
    _fp4_bf16_x_jit(x, xb, 1)
    k = np.arange(256)
    src = 128 * (k // 128) + 4 * (k % 32) + (k % 128) // 32
    wbits = np.where(np.isnan(got), 0x7FC0, got.view(np.uint32) >> 16)[0]
    assert (xb[0] == np.where(src < 160, wbits[np.minimum(src, 159)], 0)).all()


def test_fp4_inputs_round_to_8_bits_as_torch_does():
    # The kernels' rounding of x to 8 bits a block of 32 (--fp4-inputs int8) gives quant.int8_rounded's values: a
    # block of zeros, one whose largest magnitude is negative, one of ties (x * 127 / amax exactly
    # k + 0.5: to even), one of tiny and one of huge values, random ones; and the layout the int8 dots read.
    from leanserve.model.backends.cpu.kernels.int8dots import int8_x_shapes
    from leanserve.model.backends.cpu.kernels.quantized import _int8_rounded_jit, _int8_x_jit
    from leanserve.model.quant import INT8_MAX, int8_rounded

    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 7 * 32)).astype(np.float32)
    x[0, :32] = 0.0
    x[0, 32:64] *= 0.1
    x[0, 40] = -5.0
    x[0, 64:96] = (np.arange(32) % 8 + 0.5).astype(np.float32)
    x[0, 64] = 127.0  # (amax 127: x * 1 = k + 0.5 for the others)
    x[1, :32] *= 1e-30
    x[1, 32:64] *= 1e30
    got = _int8_rounded_jit(x, 2)
    want = int8_rounded(torch.from_numpy(x)).numpy()
    assert np.array_equal(got, want)  # (the same floats: bit for bit, but a zero's sign)
    assert np.array_equal(got[0, 64:72], [127.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, 8.0])  # (ties to even)
    assert (got[0, :32] == 0).all() and got[0, 40] == -5.0
    wq, wd, wc = int8_x_shapes(x.shape[1])
    xq, xd, xc = np.full((2, wq), 9, np.int8), np.full((2, wd), 9, np.float32), np.full((2, wc), 9, np.int32)
    _int8_x_jit(x, xq, xd, xc, 2)
    g, i = np.arange(7)[:, None], np.arange(32)[None, :]
    at = 128 * (g // 4) + 16 * (g % 4) + 64 * (i % 2) + i // 2  # (four groups' evens, then their odds)
    lanes = 4 * g + np.arange(4)[None, :]  # (a group's four lanes of xd and xc)
    d = 2 * xd[:, lanes]  # [2, 7, 4]
    q = np.rint(want.reshape(2, 7, 32) / np.where(d > 0, d, 1)[..., :1])
    assert (d == d[..., :1]).all() and np.array_equal(xq[:, at], q) and (np.abs(q) <= INT8_MAX).all()
    assert (np.delete(xq, at.ravel(), axis=1) == 0).all() and (np.delete(xd, lanes.ravel(), axis=1) == 0).all()
    assert np.array_equal(xc[:, lanes[:, 0]], -12 * q.sum(axis=-1)) and (xc[:, lanes[:, 1:]] == 0).all()


@pytest.mark.parametrize("rows", [1, 2, 4, 7])
def test_fp8_row_dots_decode_the_same_both_ways(rows):
    # The float32 FP8 row dots decode e4m3 bytes straight into float32 bits (16 bytes at a time, or 32 by a byte
    # permute on AVX512-VBMI), or through float16 (no float32 subnormals; most hosts take it, Zen 4 ones only at
    # one row of x beyond half of L1, Zen 5 ones at one to four rows): the same products and sums, so the same bits, over every e4m3 byte
    # (subnormals and zeros included). Each way alone is checked against the dequantized weight below; this holds
    # the host's choice to the others.
    import numba

    from leanserve.model.backends.cpu.kernels.quantized import _float32_walk
    from leanserve.model.backends.cpu.kernels.rowdots import _AVX512_VBMI, _F16C

    if not _F16C:
        pytest.skip("the float16 decode needs F16C")
    gen = torch.Generator().manual_seed(rows)
    q = torch.randint(0, 256, (256, 512), dtype=torch.uint8, generator=gen)
    q[(q & 0x7F) == 0x7F] = 0  # (no NaNs)
    q[0, :256] = torch.arange(256, dtype=torch.uint8)
    q[0, 127], q[0, 255] = 0, 0
    scale = torch.randint(110, 130, (2, 4), dtype=torch.uint8, generator=gen)
    x = torch.randn(rows, 512, generator=gen).numpy()
    xrows = min(rows, 4)
    outs = []
    for half, permuted in [(False, False), (True, False)] + [(False, True)] * _AVX512_VBMI:
        walk = _float32_walk(2, xrows, half, permuted, many=rows > 4)

        @numba.njit
        def run(q, s, x, out, n, walk=walk):
            walk(q, s, 0, x, 4, out, True, n)

        out = np.zeros(((rows + xrows - 1) // xrows * xrows, 256), dtype=np.float32)
        run(q.numpy(), scale.numpy(), x, out, rows)
        outs.append(out[:rows])
    assert np.isfinite(outs[0]).all() and np.abs(outs[0]).max() > 0
    for out in outs[1:]:
        assert np.array_equal(outs[0], out)


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("in_features", [330, 2100, 4200])
@pytest.mark.parametrize("big_scale", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 16])
def test_fp8_few_rows_match_the_dequantized_weight(rows, big_scale, in_features, bf16):
    # The few-row FP8 reader from a row that is not a multiple of 4 (its weight rows cross a 128-row scale block),
    # over whole blocks and a partial last one, every e4m3 byte, scales from 2^-127 (UE8M0 0) up, and with
    # big_scale one above 2^7 (the vector loops' rebased scale would not be a float32: the general loop runs):
    # each output is x . W dequantized, up to float32 rounding of its sum. Rows of 330 inputs are read one at a
    # time; of 2100 and 4200 (more than SHORT_FP8_ROW) one at a time at one row of x or while the rows of x fit
    # X_IN_L1, else two to four at a time (both ways for each length, over the rows of x and bf16). With bf16
    # (Fp8Weight.inputs) the sums are those of x rounded to bfloat16 (on AVX512-BF16 the bfloat16 row dots up to
    # FEW_BF16_ROWS rows of x, elsewhere float32). Up to FEW_FP8_ROWS rows of x (four at a time, the last four
    # padded) each row's sums are the same bits as alone, but for bf16 on AVX512-BF16 beyond FEW_BF16_ROWS (float32
    # sums of the rounded x).
    from leanserve.model.backends.cpu.kernels.quantized import (
        _AVX512_BF16,
        FEW_BF16_ROWS,
        SHORT_FP8_ROW,
        X_IN_L1,
        _fp8_rows_jit,
    )
    from leanserve.model.quant import Fp8Weight

    assert 330 <= SHORT_FP8_ROW < 2100 and 4 * 2100 <= X_IN_L1 < 4 * 4200 and X_IN_L1 < 2 * 2 * 4200
    gen = torch.Generator().manual_seed(rows + 10 * big_scale + in_features + 100 * bf16)
    blocks = -(-in_features // 128)
    q = torch.randint(0, 256, (300, in_features), dtype=torch.uint8, generator=gen)
    q[(q & 0x7F) == 0x7F] = 0  # (no NaNs)
    scale = torch.randint(100, 128, (3, blocks), dtype=torch.uint8, generator=gen)
    scale[0, 1] = 0
    if big_scale:
        scale[1, 2] = 140
    w = Fp8Weight(q.view(torch.float8_e4m3fn), scale).dequantize().double()
    x = torch.randn(rows, in_features, generator=gen)
    r0, m = 3, 250
    out = np.empty((rows, m), dtype=np.float32)
    _fp8_rows_jit(x.numpy(), q.numpy(), scale.numpy(), r0, out, rows, bf16)
    if rows > 4 and not (bf16 and _AVX512_BF16 and rows > FEW_BF16_ROWS):
        for t in (0, rows - 1):
            alone = np.empty((1, m), dtype=np.float32)
            _fp8_rows_jit(x[t : t + 1].numpy(), q.numpy(), scale.numpy(), r0, alone, 1, bf16)
            assert np.array_equal(alone[0], out[t])
    if bf16:  # (the rounding moves a sum by about 1e-3 of its terms' size: far outside the bound)
        x = x.to(torch.bfloat16).float()
    ref = x.double() @ w[r0 : r0 + m].T
    bound = 1e-6 * (x.double().abs() @ w[r0 : r0 + m].abs().T) + 1e-40
    assert ((torch.from_numpy(out).double() - ref).abs() <= bound).all()


@pytest.mark.parametrize("rows", [1, 5, 17, 64, 70, 600])
@pytest.mark.parametrize(("out_features", "in_features"), [(256, 384), (300, 200), (41, 64), (64, 1152)])
def test_fp8_linear_matches_torch(rows, out_features, in_features):
    # FP8 weights are dequantized in registers: the same sums as the float32 kernel on the dequantized weight
    # (exactly, but for one to sixteen rows), and torch's matmul on it up to float32 summation order. One call may
    # mix FP8 and plain weights. (600 rows of 1152 inputs, more than FP8_ROWS and NARROW_INPUT: a V4-sized
    # prefill's, torch matmuls on each weight dequantized alone, the same sums as torch's on the dequantized one.)
    from leanserve.model.backends.cpu import kernels as ck
    from leanserve.model.backends.cpu.backend import FP8_ROWS, NARROW_INPUT
    from leanserve.model.backends.cpu.kernels.quantized import FEW_FP8_ROWS
    from leanserve.model.quant import dense, quantize_fp8

    gen = torch.Generator().manual_seed(rows * in_features)
    x = torch.randn(rows, in_features, generator=gen)
    w = quantize_fp8(torch.randn(out_features, in_features, generator=gen) * 0.3)
    w2 = quantize_fp8(torch.randn(130, in_features, generator=gen))
    plain = torch.randn(7, in_features, generator=gen).to(torch.bfloat16)
    fast, ref = _both("linears", x, (w, plain, w2))
    for a, b in zip(fast, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-4)
    dense_w = dense(w, torch.float32)
    if rows <= FP8_ROWS or in_features <= NARROW_INPUT:  # (the float32 kernels on the dequantized weight)
        same = torch.from_numpy(ck.matmuls(x.numpy(), (dense_w.numpy(),))[0])
    else:
        same = torch.nn.functional.linear(x, dense_w)
    if rows <= FEW_FP8_ROWS:  # (the row dots, x times each block's scale; float32 summation order)
        torch.testing.assert_close(fast[0], same, rtol=1e-5, atol=1e-5)
    else:
        assert torch.equal(fast[0], same)


@pytest.mark.parametrize("rows", [1, 6, 64])
def test_fp8_grouped_linear_matches_torch(rows):
    # wo_a as stored: [groups * out, in] with 128-row scale blocks that need not align with the groups (out 96).
    from leanserve.model.quant import quantize_fp8

    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 3, 160, generator=gen)
    w = quantize_fp8(torch.randn(3 * 96, 160, generator=gen))
    fast, ref = _both("grouped_linear", x, w)
    torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("kind", ["moe", "hash_moe"])
@pytest.mark.parametrize("experts", ["fp4", "fp8"])
@pytest.mark.parametrize("tokens", [1, 7, 64, 70])
def test_quantized_moe_few_tokens_matches_torch(kind, experts, tokens):
    # FP4 or FP8 routed experts and an FP8 shared expert, read as stored by the few-token MoE kernel (70 tokens:
    # a prefill's, through the torch statement, one expert dequantized at a time).
    from dataclasses import replace

    from leanserve.model.config import ModelConfig, Quantization
    from leanserve.model.moe import MoE

    cfg = ModelConfig.from_hf("models/dsv4-stdlib-8m")
    gen = torch.Generator().manual_seed(tokens)
    plain = MoE(cfg, kind).requires_grad_(False)
    for p in plain.parameters():
        p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    if kind == "hash_moe":
        plain.gate.tid2eid.copy_(torch.randint(0, cfg.n_routed_experts, plain.gate.tid2eid.shape, generator=gen))
    moe = MoE(replace(cfg, quantization=Quantization(experts)), kind).requires_grad_(False)
    _fill_quantized(moe, plain)
    x = torch.randn(tokens, cfg.hidden_size, generator=gen)
    ids = torch.randint(0, cfg.vocab_size, (tokens,), generator=gen)
    fast, ref = _module_both(moe, x, ids)
    torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def quantized_models(tiny_model):
    """The tiny model (with its MTP layer) as a published checkpoint would store it: FP8 linears and FP4 or FP8
    routed experts, quantized from its weights."""
    from dataclasses import replace

    from leanserve.model.build import build_model
    from leanserve.model.config import Quantization

    models = {}
    for experts in ("fp4", "fp8"):
        cfg = replace(tiny_model.cfg, quantization=Quantization(experts))
        model = build_model(cfg, max_positions=256, dtype=torch.float32, with_mtp=True)
        _fill_quantized(model, tiny_model)
        models[experts] = model
    return models


def _decode_with_mtp(model, runner_cls, prompt: list[int], steps: int):
    """Greedy decoding through the trunk with the MTP layer run after every step (as speculative decoding does):
    the tokens, the trunk's and the MTP layer's log-probabilities at each step."""
    from leanserve.model.batch import Chunk, build_forward_batch

    cfg = model.cfg
    run = runner_cls(model, 1, 256)
    tokens, logprobs, start, chunk = [], [], 0, list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            hidden = torch.empty(len(chunk), cfg.hc_mult * cfg.hidden_size)
            logits = model(build_forward_batch([Chunk(0, start, chunk)], run.geo), run.caches, target_hidden=hidden)
            lp = torch.log_softmax(logits[-1], -1)
            tokens.append(int(lp.argmax()))
            nxt = chunk[1:] + [tokens[-1]]
            streams = hidden.view(len(chunk), cfg.hc_mult, cfg.hidden_size)
            mtp_logits, _ = model.mtp_forward(streams, build_forward_batch([Chunk(0, start, nxt)], run.geo), run.caches)
            logprobs.append((lp, torch.log_softmax(mtp_logits[-1], -1)))
            start, chunk = start + len(chunk), [tokens[-1]]
    return tokens, logprobs


@pytest.mark.parametrize("experts", ["fp4", "fp8"])
def test_quantized_model_decodes_as_the_torch_backend(experts, quantized_models, lean_runner_cls):
    # A published-format model (FP8 linears, FP4 / FP8 experts) decodes the same greedy tokens with the same
    # log-probabilities (trunk and MTP layer) on the CPU backend, which reads the stored formats in its kernels,
    # as on the torch backend, which dequantizes them per call. (A 70-token prefill: torch matmuls on weights the
    # kernels dequantize one at a time; then 9 decode steps through the kernels; compressed rows past the
    # indexer's top-k.)
    from leanserve.model.backends import TorchBackend

    model = quantized_models[experts]
    prompt = list(range(3, 73))
    outs = {}
    for name, backend in (("cpu", _cpu()), ("torch", TorchBackend())):
        set_backend(model, backend)
        outs[name] = _decode_with_mtp(model, lean_runner_cls, prompt, 10)
    set_backend(model, _cpu())
    assert outs["cpu"][0] == outs["torch"][0]
    for (a, am), (b, bm) in zip(outs["cpu"][1], outs["torch"][1], strict=True):
        assert (a - b).abs().max() < 1e-4 and (am - bm).abs().max() < 1e-4


@pytest.fixture
def decode_calls(monkeypatch) -> dict[str, int]:
    """Counts the CPU backend's whole-step numpy path: decode.blocks (trunk) and decode.mtp_input (MTP)."""
    from leanserve.model.backends.cpu import decode

    calls = {"blocks": 0, "mtp": 0}

    def counting(name, fn):
        def wrapped(*args, **kw):
            calls[name] += 1
            return fn(*args, **kw)

        return wrapped

    monkeypatch.setattr(decode, "blocks", counting("blocks", decode.blocks))
    monkeypatch.setattr(decode, "mtp_input", counting("mtp", decode.mtp_input))
    return calls


def test_quantized_decode_steps_take_the_cpu_fast_path(quantized_models, lean_runner_cls, decode_calls):
    # Quantized models' decode steps (and their MTP steps) run whole through decode.blocks and
    # decode.mtp_input, the kernels reading FP8 / FP4 weights as stored.
    calls = decode_calls
    for model in quantized_models.values():
        set_backend(model, _cpu())
        calls.update(blocks=0, mtp=0)
        tokens, _ = _decode_with_mtp(model, lean_runner_cls, list(range(3, 13)), 6)
        assert len(tokens) == 6
        assert calls["blocks"] >= 5 and calls["mtp"] >= 5  # every step after the 10-token prefill


def test_padded_experts_match_grouped_matmul():
    from leanserve.model.backends.cpu.backend import padded_experts
    from leanserve.model.torch_math.ops import experts as grouped_experts

    gen = torch.Generator().manual_seed(3)
    experts, hidden, inter = 8, 32, 16
    w13, w2 = torch.randn(experts, 2 * inter, hidden, generator=gen), torch.randn(experts, hidden, inter, generator=gen)
    counts = torch.tensor([3, 0, 5, 2, 4, 4, 1, 5])
    rows = torch.randn(int(counts.sum()), hidden, generator=gen)
    padded = padded_experts(rows, counts, w13, w2, 10.0)
    assert padded is not None
    torch.testing.assert_close(padded, grouped_experts(rows, counts, w13, w2, 10.0), rtol=1e-4, atol=1e-4)
    assert padded_experts(rows[:4], torch.tensor([4, 0, 0, 0, 0, 0, 0, 0]), w13, w2, 10.0) is None  # skewed


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_with_kernels_matches_torch_backend(dtype):
    # Prefill (torch matmuls), decode and speculative verification (the compiled kernels) against the torch
    # backend everywhere: the same tokens, logprobs within float32 noise. With bfloat16 weights both compute in
    # float32 (the torch backend is asked for float32 activations by upcasting the weights: dtype float32).
    from leanserve import LLM, SamplingParams

    # (122 + 12 tokens: a heavily compressed window, r = 128, closes during decoding)
    prompts = [list(range(3, 3 + n)) for n in (5, 70, 23, 122)]
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=1, ignore_eos=True)
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    outs = {}
    for backend, engine_dtype in (("auto", dtype), ("torch", "float32")):
        llm = LLM("models/dsv4-stdlib-8m", dtype=engine_dtype, max_model_len=160, max_num_batched_tokens=64,
                  speculative_config=spec, load_progress=False, backend=backend)  # fmt: skip
        runner = llm.engine.executor.runner
        assert runner.model.ops.name == ("cpu" if backend == "auto" else "torch")
        outs[backend] = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for a, b in zip(outs["auto"], outs["torch"], strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert len(a.outputs[0].logprobs) == len(b.outputs[0].logprobs) == 12
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            for tok in x:
                assert abs(x[tok].logprob - y[tok].logprob) < 1e-4


@pytest.mark.parametrize("spec", [None, {"method": "mtp", "num_speculative_tokens": 1}])
def test_decode_steps_take_the_cpu_fast_path(spec, decode_calls):
    # Decode steps (and verification and MTP steps) on the CPU backend run whole through decode.blocks and
    # the MTP layer through decode.mtp_input: if the CPU backend stopped taking them (decoding 2-3x slower,
    # same tokens), this fails.
    from leanserve import LLM, SamplingParams

    calls = decode_calls
    llm = LLM("models/dsv4-stdlib-8m", dtype="bfloat16", max_model_len=64, load_progress=False,
              speculative_config=spec)  # fmt: skip
    calls.update(blocks=0, mtp=0)  # (the warm-up's)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    (out,) = llm.generate([{"prompt_token_ids": list(range(3, 13))}], params)
    assert len(out.outputs[0].token_ids) == 8
    if spec is None:
        assert calls == {"blocks": 7, "mtp": 0}  # every step after the 10-token prefill
    else:  # (the verification steps: 2 tokens each when the draft is accepted; the MTP layer after each step)
        assert calls["blocks"] >= 3 and calls["mtp"] >= 3


def test_mtp_drafts_take_the_cpu_fast_path(monkeypatch, decode_calls):
    # The MTP layer's decode-sized steps (catch-up after a step, each draft) run whole as numpy arrays from the
    # token ids, never its torch statement (torch embedding, RoPE tables, one op at a time), and greedy drafts are
    # the logits' argmax with no sampler call: if either came back (same tokens, the draft step dearer), this fails.
    from leanserve import LLM, SamplingParams
    from leanserve.engine.sampler import STREAM_DRAFT, Sampler
    from leanserve.model.backends import TorchBackend

    calls = decode_calls
    llm = LLM("models/dsv4-stdlib-8m", dtype="bfloat16", max_model_len=64, load_progress=False,
              speculative_config={"method": "mtp", "num_speculative_tokens": 2})  # fmt: skip
    slow = {"mtp_torch": [], "draft_samples": 0}
    mtp_torch, sample = TorchBackend.run_mtp, Sampler.sample

    def counted_mtp_torch(self, w, streams, fb, cache):
        slow["mtp_torch"].append(fb.num_tokens)
        return mtp_torch(self, w, streams, fb, cache)

    def counted_sample(self, *args, stream=0, **kw):
        slow["draft_samples"] += stream == STREAM_DRAFT
        return sample(self, *args, stream=stream, **kw)

    monkeypatch.setattr(TorchBackend, "run_mtp", counted_mtp_torch)
    monkeypatch.setattr(Sampler, "sample", counted_sample)
    calls.update(blocks=0, mtp=0)  # (the warm-up's)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    (out,) = llm.generate([{"prompt_token_ids": list(range(3, 13))}], params)
    assert len(out.outputs[0].token_ids) == 8
    assert calls["mtp"] >= 4  # (a catch-up and a second draft after the prefill, and after a step at least)
    assert slow == {"mtp_torch": [10], "draft_samples": 0}  # (torch: only the prompt's catch-up, a prefill)


def test_threaded_kernels_match_one_thread(monkeypatch):
    # Each task of a threaded kernel writes only its own outputs (no races, no shared sums), at a batch large
    # enough to run kernels in threaded parts (decode of 20 sequences, MoE over 40 token-expert pairs, attention
    # over 20 blocks, prefills of up to 70 tokens): the same tokens, and logprobs that differ at most by float32
    # rounding (torch's own ops, in the prefill, may sum in another order on two threads).
    from leanserve import LLM, SamplingParams
    from leanserve.model.backends.cpu.kernels.base import Threaded

    ran = set()  # the kernels that ran in threaded parts
    for module in cpu_kernels.MODULES:
        for name, kernel in vars(module).items():
            if isinstance(kernel, Threaded):
                run = kernel._parallel
                monkeypatch.setattr(kernel, "_parallel", lambda *a, f=run, name=name: (ran.add(name), f(*a))[1])

    prompts = [list(range(3 + i, 3 + i + n)) for i, n in enumerate([5, 70, 23, 40] * 5)]
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=2, ignore_eos=True)
    llm = LLM("models/dsv4-stdlib-8m", dtype="float32", max_model_len=128, max_num_seqs=20, load_progress=False)
    with _torch_threads(2):  # (the test session runs torch on one thread; the kernels follow it)
        threaded = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    kernels = {"attend", "index_scores", "index_merge", "moe_experts", "hc_pre", "hc_post", "norm_rope", "rms_norm"}
    kernels.add("grouped_linear")
    assert kernels <= ran, f"these kernels never ran in threaded parts: {sorted(kernels - ran)}"
    with cpu_kernels.one_thread():
        one = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for a, b in zip(threaded, one, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert x.keys() == y.keys()
            for tok in x:
                assert abs(x[tok].logprob - y[tok].logprob) < 1e-5


def _fails_in_its_second_part(x, part, parts):  # pragma: no cover - compiled (test_a_part_that_fails_...)
    if part == 1:
        raise ValueError("part 1 fails")
    x[part] = 1.0


def test_a_part_that_fails_in_a_thread_is_an_error_not_a_silent_hole():
    # A threaded kernel's part that raises must not leave its outputs unwritten and the call looking done.
    from leanserve.model.backends.cpu.kernels.base import Threaded

    kernel = Threaded(_fails_in_its_second_part, min_work=1)
    x = np.zeros(2, dtype=np.float32)
    with _torch_threads(2):
        assert cpu_kernels.threads() == 2
        with pytest.raises(RuntimeError, match="_fails_in_its_second_part failed in a thread"):
            kernel(10, x)
    kernel(0, x)  # one thread: part 0 of 1, which does not fail
    assert x[0] == 1.0


def test_quantized_kernels_threaded_match_one_thread():
    # The FP8 linear, grouped linear and FP4 dequantization in threaded parts: each task writes only its own
    # outputs with the same compiled code, so the results are those of one thread, bit for bit.
    from leanserve.model.backends.cpu.views import numpy_views
    from leanserve.model.quant import quantize_fp4, quantize_fp8

    gen = torch.Generator().manual_seed(2)
    x = torch.randn(8, 384, generator=gen)
    w = quantize_fp8(torch.randn(300, 384, generator=gen))
    wo_a = quantize_fp8(torch.randn(2 * 96, 192, generator=gen))
    w4 = quantize_fp4(torch.randn(512, 512, generator=gen))
    cpu = _cpu()

    def run():
        return [*cpu.linears(x, (w,)), cpu.grouped_linear(x.view(8, 2, 192), wo_a),
                torch.from_numpy(cpu_kernels.dequantized(numpy_views(w4)))]  # fmt: skip

    with _torch_threads(2):
        threaded = run()
    with cpu_kernels.one_thread():
        one = run()
    for a, b in zip(threaded, one, strict=True):
        assert torch.equal(a, b)


def _claims_tasks(done, claimed, part, parts):  # pragma: no cover - compiled (test_claimed_tasks_run_once)
    job = cpu_kernels.base._claim(claimed)
    while job < done.shape[0]:
        done[job] += 1
        job = cpu_kernels.base._claim(claimed)


@pytest.mark.parametrize("parts", [2, 3, 8])
def test_claimed_tasks_run_once_each_whatever_the_parts(parts):
    # Parts that take their tasks from a shared counter (base._claim, the MoE's experts) run every task exactly
    # once, with more parts than threads too (the later parts then find fewer tasks, or none).
    from leanserve.model.backends.cpu.kernels.base import Threaded

    kernel = Threaded(_claims_tasks, min_work=1)
    done = np.zeros(10_000, dtype=np.int64)
    claimed = np.zeros(1, dtype=np.int64)
    with _torch_threads(2):
        kernel._parallel((done, claimed), parts)
    assert (done == 1).all() and claimed[0] >= done.shape[0]


@pytest.mark.parametrize("tokens", [1, 3])
def test_moe_tasks_come_in_the_order_the_cores_share_them(tokens):
    # The MoE's tasks, each active expert once and the shared expert's two parts (S0, S1). For one token, in the
    # order the cores share out equally: each part ahead of half the experts. For more, which the cores take in
    # turn, in order of their tokens, most first (the parts, which take every token, after the experts of as
    # many): the last tasks taken are the shortest, so the cores end together. Routing by a hash table (tid2eid):
    # token t takes experts tid2eid[t]; here expert 4 takes every token, and 1, 2 and 5 one each.
    from leanserve.model.backends.cpu.kernels.moe import moe_route

    experts, hidden, top_k, chunks = 6, 8, 2, 2
    ids = np.arange(tokens, dtype=np.int64)
    tid2eid = np.array([[4, 1], [4, 2], [4, 5]], dtype=np.int64)
    x = np.ones((tokens, hidden), dtype=np.float32)
    gate = np.ones((experts, hidden), dtype=np.float32)
    token_of, weight_of = np.empty(tokens * top_k, dtype=np.int64), np.empty(tokens * top_k, dtype=np.float32)
    counts, tasks = np.zeros(experts + 1, dtype=np.int64), np.empty(experts + 2, dtype=np.int64)
    num = moe_route(x, ids, gate, cpu_kernels.EMPTY, tid2eid, top_k, 1, 1.0, chunks, token_of, weight_of, counts,
                    tasks)  # fmt: skip
    s0, s1 = experts, experts + 1
    assert tasks[:num].tolist() == ([s0, 1, s1, 4] if tokens == 1 else [4, s0, s1, 1, 2, 5])
    assert token_of[counts[4] : counts[5]].tolist() == list(range(tokens))


@pytest.mark.parametrize("tokens", [1, 24])
@pytest.mark.parametrize("experts", ["fp4", "fp8"])
def test_moe_on_several_cores_gives_one_cores_bits(experts, tokens, monkeypatch):
    # One token's tasks shared out equally; many tokens' (experts of one to several tokens) taken in turn:
    # whichever core takes which, each task writes only its own rows and the sum runs in a fixed order, so the
    # same bits as on one thread.
    from dataclasses import replace

    from leanserve.model.backends.cpu.kernels import moe as moe_kernels
    from leanserve.model.config import ModelConfig, Quantization
    from leanserve.model.moe import MoE

    cfg = ModelConfig.from_hf("models/dsv4-stdlib-8m")
    gen = torch.Generator().manual_seed(5)
    plain = MoE(cfg, "moe").requires_grad_(False)
    for p in plain.parameters():
        p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    moe = MoE(replace(cfg, quantization=Quantization(experts)), "moe").requires_grad_(False)
    _fill_quantized(moe, plain)
    set_backend(moe, _cpu())
    x = torch.randn(tokens, cfg.hidden_size, generator=gen)
    ids = torch.randint(0, cfg.vocab_size, (tokens,), generator=gen)
    parts = []
    run = moe_kernels.moe_experts._parallel
    monkeypatch.setattr(moe_kernels.moe_experts, "_parallel", lambda args, n: (parts.append(n), run(args, n))[1])
    monkeypatch.setattr(moe_kernels.moe_experts, "min_work", 1)  # (the tiny model's one token too)
    with _torch_threads(2):
        several = moe(x, ids)
    assert parts == [2]
    with cpu_kernels.one_thread():
        one = moe(x, ids)
    assert torch.equal(several, one)


@pytest.mark.parametrize("parts", [1, 2, 3])
def test_index_select_streams_the_topk_a_full_sort_keeps(parts):
    # The kernel streams the rows past (INDEX_ROWS at a time, in `parts` ranges) and keeps a query's topk best
    # so far: it must choose exactly what one stable sort of every visible row's score chooses, ties (ReLU zeros,
    # duplicated keys) to the lower row, queries that see at most topk rows keeping them all.
    from leanserve.model.backends.cpu.kernels.attention import INDEX_ROWS

    gen = torch.Generator().manual_seed(11 + parts)
    heads, dim, topk, n, page = 8, 32, 7, 2 * INDEX_ROWS + 188, 4
    q = torch.randn(8, heads, dim, generator=gen)
    head_w = torch.randn(8, heads, generator=gen)
    keys = torch.randn(3, n, dim, generator=gen)
    keys[1, 3:300] = 0.0  # rows scoring exactly 0
    keys[2, 100:200] = keys[2, 5]  # rows scoring exactly what row 5 does
    q_rows = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]])
    q_valid = torch.tensor([[True, True, True, False], [True, True, True, True]])
    slot = torch.tensor([1, 2])
    visible = torch.tensor([[n, 4, n - 101, 0], [n - 89, n, topk, topk + 1]])
    # the reference: every visible row's score (in float64), one stable sort
    qk = torch.einsum("bihd,bnd->bihn", q[q_rows].double(), keys[slot].double()).clamp(min=0) * dim**-0.5
    score = torch.einsum("bihn,bih->bin", qk, head_w[q_rows].double())
    score = score.masked_fill(torch.arange(n) >= visible[..., None], float("-inf"))
    # (float32 scores from the kernel: rank with them where float64 would split float32 ties)
    pages = -(-n // page)
    table = torch.randperm(3 * pages, generator=gen).view(3, pages).to(torch.int32)
    pool = torch.zeros(3 * pages, page, dim)
    pool[table.flatten().long()] = torch.cat([keys, torch.zeros(3, pages * page - n, dim)], 1).view(-1, page, dim)
    out = np.empty((2, 4, topk), dtype=np.int64)
    cpu_kernels.index_select(1 << 20, q.numpy(), head_w.numpy(), q_rows.numpy(), q_valid.numpy(), slot.numpy(),
                             table.numpy(), pool.numpy(), visible.numpy(), topk, dim**-0.5, parts, out)  # fmt: skip
    for b in range(2):
        for i in range(4):
            m = int(visible[b, i])
            got = [int(r) for r in out[b, i] if r >= 0]
            assert got == sorted(got) and all(r < 0 for r in out[b, i, len(got) :])
            if not q_valid[b, i]:
                assert got == []
            elif m <= topk:
                assert got == list(range(m))
            else:
                order = score[b, i].float().sort(descending=True, stable=True).indices[:topk]
                assert got == sorted(order.tolist()), (b, i)


def test_bf16_weights_give_float32_tokens_at_half_the_weight_memory():
    # The shipped checkpoint is bfloat16. Kept in bfloat16 on the CPU, its weights meet float32 activations
    # (the kernels widen each weight row as they read it), so the tokens are those of the float32 engine and
    # the logprobs agree to float32 rounding, with about half the weight bytes.
    from leanserve import LLM, SamplingParams

    prompts = [list(range(3 + i, 3 + i + n)) for i, n in enumerate((5, 70, 23))]
    params = SamplingParams(temperature=0.0, max_tokens=10, logprobs=1, ignore_eos=True)
    outs, weight_bytes = {}, {}
    for dtype in ("float32", "bfloat16"):
        llm = LLM("models/dsv4-stdlib-8m", dtype=dtype, max_model_len=128, load_progress=False)
        outs[dtype] = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        (stage,) = llm.memory_ledger()
        weight_bytes[dtype] = stage.weights_bytes
    for a, b in zip(outs["float32"], outs["bfloat16"], strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            (tok,) = x
            assert abs(x[tok].logprob - y[tok].logprob) < 1e-4
    assert weight_bytes["bfloat16"] < 0.55 * weight_bytes["float32"]


def test_fast_exp_is_within_two_ulp():
    # The kernels' e^x (softmax, sigmoid, SiLU) against float64 over the range they use, and at its clamps.
    import numba
    import numpy as np

    @numba.njit
    def apply(x, out):
        for i in range(x.shape[0]):
            out[i] = cpu_kernels._exp_jit(x[i])

    x = np.concatenate([np.linspace(-87, 88, 100_001), [0.0, -1e-8, 1e-8, -0.5, 0.5]]).astype(np.float32)
    out = np.empty_like(x)
    apply(x, out)
    ref = np.exp(x.astype(np.float64))
    assert np.max(np.abs(out - ref) / ref) < 2.4e-7  # two float32 ulp
    apply(np.array([-1e4, -np.inf, 1e4], dtype=np.float32), out[:3])
    assert out[0] == out[1] and 0 < out[0] < 1e-37 and np.isfinite(out[2])  # clamped at e^-87 and e^88


def test_the_cpu_backend_keeps_freed_activation_memory_for_reuse():
    # A prefill's activations are megabytes a layer: freed, they are reused rather than page-faulted in afresh.
    import resource

    from leanserve.model.backends.cpu.backend import CpuBackend

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("glibc only")
    CpuBackend()
    size = 6 << 20  # (above glibc's default thresholds)

    def faults() -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

    np.ones(size // 4, dtype=np.float32)  # (allocated, touched, freed)
    before = faults()
    a = np.ones(size // 4, dtype=np.float32)
    del a
    assert faults() - before < 16  # (fresh 4 KiB pages fault by the hundreds: 502 here without the setting)


def test_decode_plans_follow_a_replaced_weight():
    # A decode plan keeps numpy views of its block's weights, made once; when a weight's storage is replaced
    # (`.data =`, as a conversion or a reload by assignment does), the next decode step reads the new values, as the
    # torch backend does, instead of the old storage the views still hold.
    from leanserve import LLM, SamplingParams

    llm = LLM("models/dsv4-stdlib-8m", dtype="float32", max_model_len=64, load_progress=False)
    model = llm.engine.executor.runner.model
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=1, ignore_eos=True)
    prompt = [{"prompt_token_ids": list(range(3, 13))}]

    def logprobs():
        (out,) = llm.generate(prompt, params)
        return [lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, out.outputs[0].token_ids, strict=True)]

    before = logprobs()  # (the decode steps build the plans)
    for block in model.layers.values():
        weight = block.attn.wo_b.weight
        weight.data = weight.data * 1.5  # (new storage)
    after = logprobs()
    set_backend(model, TorchBackend())
    try:
        reference = logprobs()
    finally:
        set_backend(model, _cpu())
    assert max(abs(a - b) for a, b in zip(after, before, strict=True)) > 1e-3  # the change shows
    assert max(abs(a - b) for a, b in zip(after, reference, strict=True)) < 1e-4


@pytest.mark.parametrize(("fmt", "width"), [("float32", 116), ("bfloat16", 116), ("float32", 2100),
                                           ("bfloat16", 2100), ("fp8", 256)])  # fmt: skip
def test_a_row_gets_the_same_linear_output_in_any_batch(fmt, width):
    # Batch invariance: a row's output is bit for bit the same whether it is computed alone, as one of the
    # last one to three rows of a batch, or inside a 4-row tile. FP8 weights have two regimes: up to FEW_FP8_ROWS
    # rows the row dots (the same for any count up to it), above it decoded blocks through the tiles (the same for
    # any count). 116 inputs: seven 16-wide chunks (an odd count: a row alone reads bfloat16 rows a 64-byte line,
    # two chunks, at a time, and the last chunk on its own) and a tail of 4 products; 2100 (131 chunks and 4):
    # longer than linear.STREAM_TWO_INPUTS, so that on Zen 4 cores two rows take the tiles, not the stream.
    from leanserve.model.quant import quantize_fp8

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(23, width, generator=gen)
    w = torch.randn(37, x.shape[1], generator=gen)
    w = quantize_fp8(w) if fmt == "fp8" else w.to(getattr(torch, fmt))
    full = _cpu().linears(x, (w,))[0]
    alone = torch.cat([_cpu().linears(x[i : i + 1].contiguous(), (w,))[0] for i in range(23)])
    from leanserve.model.backends.cpu.kernels.quantized import FEW_FP8_ROWS

    assert FEW_FP8_ROWS == 16
    for start, rows in ((0, 1), (5, 2), (9, 3), (2, 4), (2, 5), (14, 8), (6, 9), (7, 16), (4, 17)):
        part = _cpu().linears(x[start : start + rows].contiguous(), (w,))[0]
        same = alone if fmt == "fp8" and rows <= FEW_FP8_ROWS else full
        assert torch.equal(part, same[start : start + rows]), (start, rows)
    if fmt != "fp8":
        assert torch.equal(alone, full)


def test_weighted_rows_sum_each_entry_in_key_order():
    from leanserve.model.backends.cpu.kernels.linear import _weighted_rows_jit

    rng = np.random.default_rng(0)
    p = rng.random((7, 50), dtype=np.float32)
    p[p < 0.3] = 0.0
    v = rng.standard_normal((50, 72), dtype=np.float32)  # 72 columns: two 32-wide bands and 8 one by one
    out = np.empty((7, 72), dtype=np.float32)
    _weighted_rows_jit(p, v, out, 7)
    np.testing.assert_allclose(out, p.astype(np.float64) @ v.astype(np.float64), rtol=1e-5, atol=1e-5)
    for i in range(7):  # each row alone: the same bits
        one = np.empty((1, 72), dtype=np.float32)
        _weighted_rows_jit(p[i : i + 1], v, one, 1)
        assert np.array_equal(one[0], out[i])


@pytest.mark.parametrize("choose", [False, True])
def test_attention_of_one_block_split_by_heads_gives_each_head_its_bits(choose):
    # A decode step has one query block: the attention kernel then splits its heads in ranges, one a core. Each head
    # must get the same output bits as when the block's heads run together on one thread (window keys, compressed
    # rows, or the indexer's choice of them; sinks and RoPE per head).
    from leanserve.model.backends.cpu.arrays import NO_CHOICE, NO_NEW_KV

    g = np.random.default_rng(0)
    heads, dim, rope, width, per_block, n_rows = 7, 64, 16, 12, 4, 10
    q = g.standard_normal((1, heads, dim)).astype(np.float32)
    ring = g.standard_normal((16, dim)).astype(np.float32)
    key_index = g.permutation(16)[:width][None, :].astype(np.int64)
    key_mask = np.ones((1, 1, width), dtype=bool)
    key_mask[0, 0, :3] = False  # (the first keys not seen: before the window)
    rows = g.standard_normal((4, per_block, dim)).astype(np.float32)
    table = np.array([[2, 0, 3]], dtype=np.int64)
    chosen = np.array([[[0, 3, 4, 9, -1]]], dtype=np.int64) if choose else NO_CHOICE
    sink = g.standard_normal(heads).astype(np.float32)
    freqs = g.standard_normal((1, rope // 2, 2)).astype(np.float32)
    args = (q, ring, NO_NEW_KV, np.zeros((1, 1), np.int64), np.ones((1, 1), bool), key_index, key_mask,
            np.zeros(1, np.int64), table, rows.reshape(-1, per_block, dim), np.full((1, 1), n_rows, np.int64), chosen,
            sink, np.float32(dim**-0.5), freqs)  # fmt: skip
    outs = {}
    with _torch_threads(2):  # (work 0: whole on this thread; 1 << 30: in threaded parts)
        for splits, work in ((1, 0), (3, 0), (3, 1 << 30), (7, 1 << 30)):
            outs[splits, work] = np.full((1, heads, dim), np.nan, dtype=np.float32)
            cpu_kernels.attend(work, *args, splits, outs[splits, work])
    whole = outs[1, 0]
    assert np.isfinite(whole).all()
    for key, out in outs.items():
        assert np.array_equal(out, whole), key
