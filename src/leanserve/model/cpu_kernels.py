"""Small CPU kernels compiled with numba, for math on tiny tensors where each torch op would cost more in
dispatch than in arithmetic. Each has a torch reference next to its caller; the tests compare the two."""

from __future__ import annotations

import math

import numpy as np

try:
    import numba
except ImportError:  # the torch path is used instead
    numba = None


def _mhc_weights(mixes, scale, base, hc, hc_eps, iters, out):  # pragma: no cover - compiled
    # mixes [T, (2+hc)*hc] float32 -> out [T, (2+hc)*hc]: pre (sigmoid + eps) | post (2 * sigmoid) | comb
    # (softmax per row + eps, then Sinkhorn-normalised), comb row-major.
    one = np.float32(1.0)
    eps = np.float32(hc_eps)
    row = np.empty(hc, dtype=np.float32)
    for t in range(mixes.shape[0]):
        for i in range(hc):
            out[t, i] = one / (one + np.float32(math.exp(-(mixes[t, i] * scale[0] + base[i])))) + eps
            z = mixes[t, hc + i] * scale[1] + base[hc + i]
            out[t, hc + i] = np.float32(2.0) / (one + np.float32(math.exp(-z)))
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
                out[t, 2 * hc + i * hc + j] = row[j] / total + eps
        # Sinkhorn-Knopp: columns first, then rows and columns, `iters` times in all.
        for it in range(2 * iters - 1):
            by_row = it % 2 == 1
            for a in range(hc):
                total = np.float32(0.0)
                for b in range(hc):
                    total += out[t, 2 * hc + a * hc + b] if by_row else out[t, 2 * hc + b * hc + a]
                total += eps
                for b in range(hc):
                    if by_row:
                        out[t, 2 * hc + a * hc + b] /= total
                    else:
                        out[t, 2 * hc + b * hc + a] /= total


mhc_weights = numba.njit(cache=True, nogil=True)(_mhc_weights) if numba is not None else None
