"""The numba CPU kernels agree with their torch reference."""

import pytest
import torch

from leanserve.model import cpu_kernels
from leanserve.model.hyper import mhc_weights, mhc_weights_torch

pytestmark = pytest.mark.skipif(cpu_kernels.mhc_weights is None, reason="numba is not installed")


@pytest.mark.parametrize("hc, tokens", [(2, 1), (4, 1), (4, 37), (4, 300)])
def test_mhc_weights_match_torch(hc, tokens):
    gen = torch.Generator().manual_seed(hc * 1000 + tokens)
    mixes = torch.randn(tokens, (2 + hc) * hc, generator=gen) * 3
    scale = torch.rand(3, generator=gen) + 0.5
    base = torch.randn((2 + hc) * hc, generator=gen)
    fast = mhc_weights(mixes, scale, base, hc, 1e-6, 20)
    ref = mhc_weights_torch(mixes, scale, base, hc, 1e-6, 20)
    for name, a, b in zip(("pre", "post", "comb"), fast, ref, strict=True):
        assert a.shape == b.shape, name
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    # Sinkhorn ends with a column normalisation: every column of comb sums to 1
    torch.testing.assert_close(fast[2].sum(-2), torch.ones(tokens, hc), rtol=1e-5, atol=1e-5)
