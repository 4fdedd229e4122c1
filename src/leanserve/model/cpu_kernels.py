"""Small CPU kernels compiled with numba, for math on tiny tensors where each torch op would cost more in
dispatch than in arithmetic. Each has a torch reference next to its caller; the tests compare the two."""

from __future__ import annotations

import math

import numpy as np

try:
    import numba
except ImportError:  # the torch path is used instead
    numba = None


def _mhc_weights(mixes, scale, base, hc, hc_eps, iters, pre, post, comb):  # pragma: no cover - compiled
    # mixes [T, (2+hc)*hc] -> pre [T, hc], post [T, hc], comb [T, hc, hc] (Sinkhorn-normalised)
    one = np.float32(1.0)
    eps = np.float32(hc_eps)
    row = np.empty(hc, dtype=np.float32)
    for t in range(mixes.shape[0]):
        for i in range(hc):
            pre[t, i] = one / (one + np.float32(math.exp(-(mixes[t, i] * scale[0] + base[i])))) + eps
            z = mixes[t, hc + i] * scale[1] + base[hc + i]
            post[t, i] = np.float32(2.0) / (one + np.float32(math.exp(-z)))
        for i in range(hc):  # softmax over each row, + eps
            top = np.float32(-np.inf)
            for j in range(hc):
                k = 2 * hc + i * hc + j
                row[j] = mixes[t, k] * scale[2] + base[k]
                top = max(top, row[j])
            total = np.float32(0.0)
            for j in range(hc):
                row[j] = np.float32(math.exp(row[j] - top))
                total += row[j]
            for j in range(hc):
                comb[t, i, j] = row[j] / total + eps
        # Sinkhorn-Knopp: columns first, then rows and columns, `iters` times in all.
        for it in range(2 * iters - 1):
            by_row = it % 2 == 1
            for a in range(hc):
                total = np.float32(0.0)
                for b in range(hc):
                    total += comb[t, a, b] if by_row else comb[t, b, a]
                total += eps
                for b in range(hc):
                    if by_row:
                        comb[t, a, b] /= total
                    else:
                        comb[t, b, a] /= total


mhc_weights = numba.njit(cache=True, nogil=True)(_mhc_weights) if numba is not None else None
