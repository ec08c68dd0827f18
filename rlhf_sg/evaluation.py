"""Held-out evaluation's estimators.

``pass_at_k``: the unbiased pass@k of n samples of which c are correct, ``1 - C(n-c, k) / C(n, k)`` (the
probability that k samples drawn without replacement from the n hold a correct one), computed as a product so
that large n does not overflow. Taking the best of k bootstrap draws with replacement instead is biased low.
"""

from __future__ import annotations


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples with ``c`` correct (``0 <= c <= n``, ``1 <= k <= n``)."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:  # every draw of k holds a correct sample
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):  # C(n-c, k) / C(n, k) = prod_{i=n-c+1}^{n} (1 - k / i)
        miss *= 1.0 - k / i
    return 1.0 - miss
