# %% [markdown]
# # Paired statistics
#
# > Paired bootstrap intervals of method differences, method × budget tables with standard errors, and error bars.

# %%
#| default_exp stats

# %% [markdown]
# Every comparison in this project scores several methods on **the same items**: the same
# held-out windows, prompts or needle instances. Write $x_{mi}$ for the score of method $m$
# on item $i = 1, \dots, n$ (an agreement rate, a 0/1 answer, a KL). The question a table
# answers is whether method $a$ beats method $b$ on the population of items the generator
# draws from, i.e. the sign of
#
# $$\Delta = \mathbb E_i\left[x_{ai} - x_{bi}\right],$$
#
# estimated by the mean of the per-item differences $d_i = x_{ai} - x_{bi}$:
#
# $$\hat\Delta = \frac1n \sum_{i=1}^n d_i = \bar x_a - \bar x_b .$$
#
# ## Why pairing matters
#
# With items drawn independently, the variance of $\hat\Delta$ is that of one difference
# over $n$:
#
# $$\operatorname{Var}\hat\Delta = \frac{\sigma_d^2}{n}
#   = \frac{\sigma_a^2 + \sigma_b^2 - 2\rho\,\sigma_a\sigma_b}{n},$$
#
# where $\rho$ is the correlation of the two methods' scores across items. Items differ far
# more in difficulty than methods differ from each other (a hard window lowers every
# method's agreement; a needle the model cannot find fails under every cache), so $\rho$ is
# close to 1 and the covariance term removes most of the variance. Treating the two columns
# as independent samples drops that term and gives $(\sigma_a^2 + \sigma_b^2)/n$: for equal
# variances an interval $1/\sqrt{1-\rho}$ times too wide (3.2× at $\rho = 0.9$), which hides
# real differences. The per-item pairing is what lets a few hundred items separate methods
# whose means differ by a fraction of the spread across items.
#
# ## The paired bootstrap
#
# The bootstrap estimates the sampling distribution of $\hat\Delta$ by redrawing the items:
# resample $r = 1, \dots, R$ draws $n$ item indices $I^{(r)}_1, \dots, I^{(r)}_n$ uniformly
# with replacement, **the same indices for both methods** (that is the pairing: the unit
# resampled is the item, with both of its scores), and computes
#
# $$\hat\Delta^{(r)} = \frac1n \sum_{j=1}^n d_{I^{(r)}_j}.$$
#
# Given the data, $\hat\Delta^{(r)}$ has mean $\hat\Delta$ and variance exactly
# $\hat\sigma_d^2/n$ with $\hat\sigma_d^2 = \frac1n\sum_i (d_i - \hat\Delta)^2$: the paired
# variance above, the covariance included, estimated from the items without assuming a
# distribution. The **percentile interval** at level $1-\alpha$ is the pair of empirical
# quantiles $\left[q_{\alpha/2}, q_{1-\alpha/2}\right]$ of $\{\hat\Delta^{(r)}\}$. For large
# $n$ the central limit theorem makes it close to the normal interval
# $\hat\Delta \pm z_{1-\alpha/2}\,\hat\sigma_d/\sqrt n$; for bounded, skewed scores (0/1
# answers near 0 or 1) it follows the skew and stays inside the possible range. At small $n$
# it is slightly narrow (the $1/n$ variance and $z$ instead of Student's $t$), so its coverage
# is a little under nominal; the simulation below measures it.
#
# What the interval covers: the uncertainty from which items were drawn. It does not cover
# a change of task generator, model or decoding settings.

# %%
#| export
from __future__ import annotations

import math
import numbers
import statistics

import numpy as np
import pandas as pd

from sparsekv.attention import check_int

# %%
import time

import torch
from fastcore.test import test_close, test_eq, test_fail

# %% [markdown]
# ## `paired_ci`
#
# One matrix of resampling indices $[R, n]$ gives all $R$ means at once. For large $n$ and
# $R$ the matrix is drawn in blocks of rows (at most $2^{22}$ indices, 32 MB, at a time):
# numpy's `Generator.integers` yields the same stream whether the draws come as one matrix,
# in blocks or row by row (checked below), so the result does not depend on the block size
# and the brute-force reference can draw one resample per loop iteration.

# %%
#| export
_BLOCK = 1 << 22  # resampling indices drawn at once: bounds memory at 32 MB for any n and n_boot

def _items(x, name: str) -> np.ndarray:
    "`x` (a 1-D list, array, Series or tensor of real numbers) as float64, checked: at least 2 items, all finite."
    if hasattr(x, "detach"): x = x.detach().cpu().double().numpy()  # a torch tensor, any dtype or device
    arr = np.asarray(x)
    if arr.dtype.kind not in "biuf":
        raise TypeError(f"{name} must be a 1-D list, array or tensor of real numbers, got dtype {arr.dtype}")
    if arr.ndim != 1: raise ValueError(f"{name} must be 1-D (one score per item), got shape {arr.shape}")
    if len(arr) < 2: raise ValueError(f"{name} must hold at least 2 items, got {len(arr)}")
    bad = np.flatnonzero(~np.isfinite(arr))
    if len(bad): raise ValueError(f"{name} contains NaN or inf at items {bad[:5].tolist()}")
    return arr.astype(np.float64)


# %%
test_eq(_items(torch.tensor([1, 2], dtype=torch.int32), "a"), np.array([1.0, 2.0]))
test_eq(_items([True, False], "a").dtype, np.float64)
test_fail(lambda: _items([[1.0, 2.0]], "x"), contains="x must be 1-D (one score per item)")


# %%
#| export
def _level(level) -> float:
    "`level` as a float in (0, 1)."
    if isinstance(level, bool) or not isinstance(level, numbers.Real):
        raise TypeError(f"level must be a float in (0, 1), got {level!r}")
    if not 0 < level < 1: raise ValueError(f"level must be a float in (0, 1), got {level!r}")
    return float(level)


# %%
test_eq(_level(0.9), 0.9)
test_fail(lambda: _level(True), contains="level must be a float in (0, 1)")
test_fail(lambda: _level(1), contains="level must be a float in (0, 1), got 1")


# %%
#| export
def paired_ci(a, b, level: float = 0.95, n_boot: int = 10_000, seed: int = 0) -> tuple[float, float, float]:
    "`(mean_diff, lo, hi)`: the mean of `a - b` over aligned items and its paired bootstrap percentile interval."
    a, b = _items(a, "a"), _items(b, "b")
    if len(a) != len(b):
        raise ValueError(f"a and b must score the same items (equal lengths), got {len(a)} and {len(b)}")
    level, n_boot, seed = _level(level), check_int(n_boot, "n_boot", 1), check_int(seed, "seed")
    d, n = a - b, len(a)
    rng, rows = np.random.default_rng(seed), max(1, _BLOCK // n)
    means = np.concatenate([d[rng.integers(0, n, size=(min(rows, n_boot - r), n))].mean(1)
                            for r in range(0, n_boot, rows)])
    lo, hi = np.quantile(means, [(1 - level) / 2, (1 + level) / 2])
    return float(d.mean()), float(lo), float(hi)


# %%
_m, _lo, _hi = paired_ci([1.0, 2.0, 4.0], [0.0, 0.0, 1.0], n_boot=100)
test_close(_m, 2.0, eps=1e-15)
assert 1.0 <= _lo <= _m <= _hi <= 3.0  # inside the range of the differences


# %% [markdown]
# The brute-force reference loops over the resamples in Python, drawing each resample's
# indices with the same generator, summing the differences in Python, and takes the
# percentiles by explicit linear interpolation between order statistics (position
# $h = (R-1)\,q$, numpy's default).
#
# The checks below: the vectorised interval equals the loop on random correlated scores (small and
# odd $n$, several levels, lists, tensors), drawing in blocks changes nothing, and bad input
# names its argument.

# %%
#| export
def paired_ci_reference(a, b, level: float = 0.95, n_boot: int = 10_000, seed: int = 0) -> tuple[float, float, float]:
    "Brute-force `paired_ci`: a Python loop over resamples (the same draws) and explicit percentiles."
    d = [float(x) - float(y) for x, y in zip(a, b)]
    n, rng = len(d), np.random.default_rng(seed)
    means = sorted(sum(d[j] for j in rng.integers(0, n, size=n).tolist()) / n for _ in range(n_boot))

    def percentile(q: float) -> float:
        h = (n_boot - 1) * q
        j = math.floor(h)
        return means[j] + (h - j) * (means[min(j + 1, n_boot - 1)] - means[j])
    return sum(d) / n, percentile((1 - level) / 2), percentile((1 + level) / 2)


# %%
def _scores(n: int, rho: float = 0.9, delta: float = 0.1, seed: int = 0):
    "Paired scores of two methods on n items: a shared item difficulty (correlation ~rho), mean difference delta."
    rng = np.random.default_rng(seed)
    s = rng.normal(size=n)
    noise = math.sqrt((1 - rho) / rho)
    return s + noise * rng.normal(size=n) + delta, s + noise * rng.normal(size=n)

for n, level, seed in [(2, 0.95, 0), (3, 0.9, 1), (17, 0.95, 2), (60, 0.8, 3)]:
    a, b = _scores(n, seed=seed)
    test_close(paired_ci(a, b, level, n_boot=2000, seed=seed), paired_ci_reference(a, b, level, 2000, seed), eps=1e-12)

a, b = _scores(25, seed=4)
test_close(paired_ci(torch.tensor(a, dtype=torch.float64), b.tolist(), n_boot=500),
           paired_ci_reference(a, b, n_boot=500), eps=1e-12)
one_matrix = paired_ci(a, b, n_boot=500)
_old, _BLOCK = _BLOCK, 7 * 25 + 3  # blocks of 7 resamples (the last one shorter): the same draws
test_eq(paired_ci(a, b, n_boot=500), one_matrix)
_BLOCK = _old

test_fail(lambda: paired_ci(a, b[:-1]), contains="equal lengths")
test_fail(lambda: paired_ci([1.0], [2.0]), contains="a must hold at least 2 items")
test_fail(lambda: paired_ci(a, np.where(np.arange(25) == 3, np.nan, b)), contains="b contains NaN or inf at items [3]")
test_fail(lambda: paired_ci(a.reshape(5, 5), b.reshape(5, 5)), contains="a must be 1-D")
test_fail(lambda: paired_ci(["x", "y"], [1, 2]), contains="a must be a 1-D list, array or tensor of real numbers")
test_fail(lambda: paired_ci(a, b, level=1.0), contains="level must be a float in (0, 1)")
test_fail(lambda: paired_ci(a, b, n_boot=0), contains="n_boot must be an int >= 1")
test_fail(lambda: paired_ci(a, b, seed=-1), contains="seed must be an int >= 0")

# %% [markdown]
# Edge cases. With $n = 2$ there are only three distinct resample means
# ($d_1$, $\frac{d_1+d_2}{2}$, $d_2$), so the interval lies within $[\min d, \max d]$. When
# every item has the same difference every resample has that mean, and the interval has
# zero width.

# %%
lo_hi = paired_ci([0.0, 1.0], [0.5, 0.0], n_boot=4000)
test_close(lo_hi[0], 0.25, eps=1e-15)
assert -0.5 <= lo_hi[1] <= lo_hi[2] <= 1.0 and lo_hi[1] < lo_hi[2]
test_eq(paired_ci([3, 5, 9, 4], [1, 3, 7, 2]), (2.0, 2.0, 2.0))
test_eq(paired_ci([True, False, True], [True, False, True]), (0.0, 0.0, 0.0))

# %% [markdown]
# Against the normal approximation. On $n = 2000$ correlated items the percentile interval
# should agree with $\hat\Delta \pm 1.96\,s_d/\sqrt n$ to within the Monte Carlo error of the
# 2.5% and 97.5% quantiles of $R = 10^4$ resamples (about 1.5% of the half-width).

# %%
a, b = _scores(2000, seed=5)
t0 = time.perf_counter()
mean_diff, lo, hi = paired_ci(a, b)
print(f"paired_ci on 2000 items, 10,000 resamples: {time.perf_counter() - t0:.2f} s")
d = a - b
half = 1.96 * d.std(ddof=1) / math.sqrt(len(d))
test_close(mean_diff, d.mean(), eps=1e-12)
test_close(lo, mean_diff - half, eps=0.05 * half)
test_close(hi, mean_diff + half, eps=0.05 * half)
print(f"bootstrap [{lo:.4f}, {hi:.4f}]   normal [{mean_diff - half:.4f}, {mean_diff + half:.4f}]")


# %% [markdown]
# Coverage by simulation: 1,000 simulated paired data sets of $n = 100$ items with a known
# mean difference $\Delta = 0.1$, once with Gaussian scores and once with 0/1 answers (item
# $i$ is solved by method $b$ with probability $p_i \sim U(0, 1)$ and by method $a$ with
# probability $0.8\,p_i$, so $\Delta = -0.1$). The fraction of intervals that contain
# $\Delta$ estimates the coverage; with 1,000 data sets its standard error is about 0.007.

# %%
def _coverage(kind: str, reps: int = 1000, n: int = 100, n_boot: int = 500, seed: int = 0) -> float:
    "Fraction of `reps` simulated data sets whose 95% paired interval contains the true mean difference."
    rng, hits = np.random.default_rng(seed), 0
    for r in range(reps):
        if kind == "gaussian":
            (a, b), delta = _scores(n, seed=int(rng.integers(2**31))), 0.1
        else:
            p = rng.uniform(size=n)
            a, b, delta = rng.uniform(size=n) < 0.8 * p, rng.uniform(size=n) < p, -0.1
        _, lo, hi = paired_ci(a, b, n_boot=n_boot, seed=r)
        hits += lo <= delta <= hi
    return hits / reps

for kind in ("gaussian", "binary"):
    t0 = time.perf_counter()
    cov = _coverage(kind)
    print(f"{kind}: coverage of the 95% interval {cov:.3f} ({time.perf_counter() - t0:.1f} s)")
    assert 0.93 <= cov <= 0.97, cov

# %% [markdown]
# The coverage falls with few items. With $n$ items the bootstrap can only redraw what it
# saw: at $n = 2$ the resample means take three values and the interval is the segment
# between the two differences, which holds $\Delta$ only when they straddle it (half the
# time); the $1/n$ variance and $z$ in place of Student's $t$ cost more at every small $n$.
# Measured on the Gaussian items above (500 data sets per $n$, standard error about 0.01):

# %%
coverage_by_n = {n: _coverage("gaussian", reps=500, n=n, n_boot=500) for n in (2, 4, 8, 16, 32)}
print("n:", "  ".join(f"{n}: {c:.3f}" for n, c in coverage_by_n.items()))
assert coverage_by_n[2] < 0.6 and coverage_by_n[4] < 0.9
assert min(coverage_by_n[16], coverage_by_n[32]) >= 0.9

# %% [markdown]
# So a "95%" interval over 2 windows is a coin toss, and over 8 it misses about twice as
# often as it should. `compare` below prints every interval but marks a difference (`*`,
# `ref_sig`, `base_sig`) only from `min_items = 16` items on, where the coverage is within
# a few points of the level; stages that compare fewer items say so instead of claiming.

# %% [markdown]
# Pairing, numerically: on items with correlation $\rho = 0.9$ between the two methods, the
# paired interval is narrower than the interval of an unpaired bootstrap (each method's
# items resampled independently), by about the factor
# $\sqrt{\sigma_d^2 / (\sigma_a^2 + \sigma_b^2)} = \sqrt{1-\rho} \approx 0.32$.

# %%
a, b = _scores(400, rho=0.9, seed=6)
_, lo, hi = paired_ci(a, b)
rng = np.random.default_rng(0)
unpaired = (a[rng.integers(0, 400, (10_000, 400))].mean(1) - b[rng.integers(0, 400, (10_000, 400))].mean(1))
u_lo, u_hi = np.quantile(unpaired, [0.025, 0.975])
ratio, theory = (hi - lo) / (u_hi - u_lo), math.sqrt((a - b).var() / (a.var() + b.var()))
print(f"paired width {hi - lo:.3f}, unpaired width {u_hi - u_lo:.3f}, ratio {ratio:.2f} (theory {theory:.2f})")
assert ratio < 0.5 and lo > 0 > u_lo
test_close(ratio, theory, eps=0.05)

# %% [markdown]
# ## `compare`: method × budget tables
#
# An evaluation records one row per method, budget and item (a long table, as `run_grid`
# writes it). `compare` turns one metric of it into one row per (budget, method) with
#
# - `n`, `mean` and `se`: the number of items, the method's mean and its standard error
#   $s/\sqrt n$ ($s$ the sample standard deviation, `ddof=1`), so every table prints its own
#   precision;
# - `diff_ref`, `ref_lo`, `ref_hi`: the mean paired difference *method − reference* (dense)
#   and its bootstrap interval; `ref_sig` is true only where the interval excludes 0 and
#   there are at least `min_items` items (16 by default: below that the interval covers
#   much less than its level, see the coverage by $n$ above);
# - `baseline`, `diff_base`, `base_lo`, `base_hi`, `base_sig`: the same against the **best
#   baseline at that budget**: among the candidate baselines scored at that budget other than
#   the method itself and the reference, the one with the best mean (highest, or lowest with
#   `higher_is_better=False`, e.g. KL or perplexity); ties go to the candidate listed first.
#   The candidates are `baselines` when given, else every method of the table in order of
#   first appearance. So the best method is compared against the runner-up, and every other
#   method against the best.
#
# The reference has no budget of its own (dense keeps everything): its rows are the ones at
# the same budget when it has rows there, else all its rows when they carry a single budget
# value (`NaN`, `"full"`, ...), which then serve every budget. Its own row carries no
# differences.
#
# Pairing needs aligned items, so `compare` refuses a table where a method lacks an item
# another method has at the same budget, repeats a (method, budget, item), or has a missing
# or infinite score: a silently dropped item would bias a comparison towards the methods
# that were not scored on it.

# %%
#| export
COMPARE_COLUMNS = ["method", "budget", "n", "mean", "se", "diff_ref", "ref_lo", "ref_hi", "ref_sig", "baseline",
                   "diff_base", "base_lo", "base_hi", "base_sig"]

def _check_results(results, metric: str, method: str, budget: str, item: str) -> pd.DataFrame:
    "The four columns of `results` that `compare` reads, checked: numeric finite scores, items set, none repeated."
    if not isinstance(results, pd.DataFrame):
        raise TypeError(f"results must be a pandas DataFrame, got {type(results).__name__}")
    names = {"metric": metric, "method": method, "budget": budget, "item": item}
    absent = [f"{k}={c!r}" for k, c in names.items() if c not in results.columns]
    if absent: raise ValueError(f"results lacks the column(s) {', '.join(absent)}; it has {list(results.columns)}")
    df = results[[method, budget, item, metric]]
    if df[metric].dtype.kind not in "biuf":
        raise TypeError(f"results[{metric!r}] (the metric) must be numeric, got dtype {df[metric].dtype}")
    for bad, what in [(~np.isfinite(df[metric].astype(float)), f"a NaN or infinite {metric!r}"),
                      (df[item].isna(), f"no {item!r}"), (df[method].isna(), f"no {method!r}"),
                      (df.duplicated([method, budget, item], keep=False), f"a repeated ({method}, {budget}, {item})")]:
        if bad.any():
            raise ValueError(f"results has {int(bad.sum())} row(s) with {what}, e.g. {df[bad].iloc[0].to_dict()}")
    return df


# %%
_df = pd.DataFrame(dict(method=["a", "b"], budget=[1, 1], item=["x", "x"], s=[0.5, 1.0], extra=0))
test_eq(list(_check_results(_df, "s", "method", "budget", "item").columns), ["method", "budget", "item", "s"])
test_fail(lambda: _check_results(_df.assign(s=[np.inf, 1.0]), "s", "method", "budget", "item"),
          contains="1 row(s) with a NaN or infinite 's'")
test_fail(lambda: _check_results(_df.to_dict(), "s", "method", "budget", "item"), contains="must be a pandas DataFrame")


# %%
#| export
def _check_baselines(baselines, methods: list, reference) -> list | None:
    "`baselines` as a list of methods of the table other than the reference, or None."
    if baselines is None: return None
    if isinstance(baselines, str) or not isinstance(baselines, (list, tuple)):
        raise TypeError(f"baselines must be a list of method names or None, got {baselines!r}")
    if not baselines: raise ValueError("baselines must name at least one method, or be None for every method")
    unknown = [m for m in baselines if m not in methods or m == reference]
    if unknown: raise ValueError(f"baselines {unknown} are not methods of results other than the reference: {methods}")
    return list(baselines)


# %%
test_eq(_check_baselines(("b",), ["dense", "a", "b"], "dense"), ["b"])
test_eq(_check_baselines(None, ["dense", "a"], "dense"), None)
test_fail(lambda: _check_baselines([], ["dense", "a"], "dense"), contains="at least one method")
test_fail(lambda: _check_baselines(["dense"], ["dense", "a"], "dense"), contains="baselines ['dense'] are not methods")


# %%
#| export
def _budgets(values: pd.Series) -> list:
    "The distinct budgets, sorted when they compare (numbers), else in order of first appearance; 64.0 as 64."
    found = [int(b) if isinstance(b, float) and b.is_integer() else b for b in pd.unique(values)]  # NaN made floats
    try: return sorted(found)
    except TypeError: return found


# %%
test_eq(_budgets(pd.Series([128.0, 64.0, 128.0])), [64, 128])
test_eq(_budgets(pd.Series(["full", 64], dtype=object)), ["full", 64])  # no order between text and numbers


# %%
#| export
def _aligned(rows: pd.DataFrame, metric: str, method: str, item: str, order: list, where: str) -> pd.DataFrame:
    "The scores as an item × method table (items sorted, methods as in `order`); raise if a method lacks an item."
    table = rows.pivot(index=item, columns=method, values=metric).sort_index()
    table = table[[m for m in order if m in table.columns]]
    holes = table.isna()
    if holes.any().any():
        m = holes.any().idxmax()
        raise ValueError(f"method {m!r} {where} lacks item(s) {table.index[holes[m]].tolist()[:5]} that other methods "
                         "have: every method must be scored on the same items")
    if len(table) < 2: raise ValueError(f"results has {len(table)} item(s) {where}: an interval needs at least 2")
    return table


# %%
_rows = pd.DataFrame(dict(method=["b", "a", "b", "a"], item=["y", "y", "x", "x"], s=[1.0, 2.0, 3.0, 4.0]))
test_eq(_aligned(_rows, "s", "method", "item", ["a", "b"], "here").to_numpy(), np.array([[4.0, 3.0], [2.0, 1.0]]))
test_fail(lambda: _aligned(_rows.iloc[:3], "s", "method", "item", ["a", "b"], "here"),
          contains="method 'a' here lacks item(s) ['x']")


# %%
#| export
def _diff(x: np.ndarray, y: np.ndarray, prefix: str, level: float, n_boot: int, seed: int, min_items: int) -> dict:
    "The paired difference `x - y` as `compare`'s columns: `diff_<prefix>`, `<prefix>_lo`, `_hi`, `_sig`."
    d, lo, hi = paired_ci(x, y, level, n_boot, seed)
    sig = len(x) >= min_items and (lo > 0 or hi < 0)
    return {f"diff_{prefix}": d, f"{prefix}_lo": lo, f"{prefix}_hi": hi, f"{prefix}_sig": bool(sig)}


# %%
_x, _y = np.array([3.0, 5.0, 9.0, 4.0]), np.array([1.0, 3.0, 7.0, 2.0])
test_eq(_diff(_x, _y, "ref", 0.95, 100, 0, 4), {"diff_ref": 2.0, "ref_lo": 2.0, "ref_hi": 2.0, "ref_sig": True})
test_eq(_diff(_x, _y, "base", 0.95, 100, 0, 5)["base_sig"], False)  # fewer items than min_items: not marked


# %%
#| export
def _reference_rows(ref: pd.DataFrame, budget: str, b, reference) -> pd.DataFrame:
    "The reference's rows used at budget `b`: its own at `b`, else all of them if they carry one budget value."
    if (ref[budget] == b).any(): return ref[ref[budget] == b]
    if ref[budget].nunique(dropna=False) > 1:
        raise ValueError(f"reference {reference!r} has no rows at {budget}={b!r} and several budgets of its own")
    return ref


# %%
_ref = pd.DataFrame(dict(budget=[np.nan, np.nan], s=[1.0, 2.0]))
test_eq(len(_reference_rows(_ref, "budget", 64, "dense")), 2)  # one budget value of its own: used at every budget
_ref = pd.DataFrame(dict(budget=[64, 128], s=[1.0, 2.0]))
test_eq(_reference_rows(_ref, "budget", 128, "dense").s.tolist(), [2.0])
test_fail(lambda: _reference_rows(_ref, "budget", 256, "dense"), contains="no rows at budget=256")


# %%
#| export
def _compare_budget(table: pd.DataFrame, b, reference, cands: list, higher_is_better: bool, level: float,
                    n_boot: int, seed: int, min_items: int) -> list[dict]:
    "`compare`'s rows at budget `b`, from its item × method `table` and the candidate baselines `cands`."
    means, rows = table.mean(), []
    for m in table.columns:
        x = table[m].to_numpy(float)
        row = dict.fromkeys(COMPARE_COLUMNS, np.nan) | dict(method=m, budget=b, n=len(x), mean=means[m],
                                                              se=x.std(ddof=1) / math.sqrt(len(x)),
                                                              baseline=None, ref_sig=False, base_sig=False)
        if m != reference:
            row |= _diff(x, table[reference].to_numpy(float), "ref", level, n_boot, seed, min_items)
            rivals = [c for c in cands if c in table.columns and c not in (m, reference)]
            if rivals:  # min() keeps the first of equal keys: ties go to the candidate listed first
                row["baseline"] = min(rivals, key=lambda c: -means[c] if higher_is_better else means[c])
                row |= _diff(x, table[row["baseline"]].to_numpy(float), "base", level, n_boot, seed, min_items)
        rows.append(row)
    return rows


# %%
_table = pd.DataFrame({"dense": [1.0] * 4, "a": [0.5, 0.6, 0.7, 0.8], "b": [0.4, 0.5, 0.6, 0.7]})
_rows = _compare_budget(_table, 64, "dense", ["a", "b"], True, 0.95, 200, 0, 2)
test_eq([(r["method"], r["budget"], r["baseline"]) for r in _rows],
        [("dense", 64, None), ("a", 64, "b"), ("b", 64, "a")])
test_close([_rows[1]["diff_base"], _rows[1]["base_lo"], _rows[2]["diff_base"]], [0.1, 0.1, -0.1], eps=1e-12)
test_eq([_rows[1]["base_sig"], _rows[0]["ref_sig"]], [True, False])
test_eq(list(_rows[0]), COMPARE_COLUMNS)


# %%
#| export
def compare(results: pd.DataFrame, metric: str, method: str = "method", budget: str = "budget", item: str = "item",
            reference="dense", baselines: list | None = None, higher_is_better: bool = True, level: float = 0.95,
            n_boot: int = 10_000, seed: int = 0, min_items: int = 16) -> pd.DataFrame:
    "Per budget and method of a long table: n, mean, standard error, paired intervals vs `reference` and best baseline."
    df = _check_results(results, metric, method, budget, item)
    min_items = check_int(min_items, "min_items", 2)
    level, methods = _level(level), list(pd.unique(df[method]))  # the order of rows and of tie-breaks
    if not isinstance(higher_is_better, bool):
        raise TypeError(f"higher_is_better must be a bool, got {higher_is_better!r}")
    if reference not in methods: raise ValueError(f"reference {reference!r} is not a method of results: {methods}")
    methods = [reference] + [m for m in methods if m != reference]
    baselines, ref = _check_baselines(baselines, methods, reference), df[df[method] == reference]
    others = df[df[method] != reference]
    if others.empty: raise ValueError(f"results has no method besides the reference {reference!r}")
    if others[budget].isna().any():
        raise ValueError(f"results has rows of methods other than {reference!r} with no {budget!r}: only the reference "
                         "may lack a budget")
    out = []
    for b in _budgets(others[budget]):
        rows = pd.concat([_reference_rows(ref, budget, b, reference), others[others[budget] == b]])
        table = _aligned(rows, metric, method, item, methods, f"at {budget}={b!r}")
        out += _compare_budget(table, b, reference, baselines or methods, higher_is_better, level, n_boot, seed,
                               min_items)
    out = pd.DataFrame(out, columns=COMPARE_COLUMNS)
    out.attrs.update(metric=metric, reference=reference, level=level, higher_is_better=higher_is_better,
                     min_items=min_items)
    return out


# %%
_t = pd.DataFrame(dict(method=["dense"] * 3 + ["a"] * 3, budget=[np.nan] * 3 + [64] * 3, item=[0, 1, 2] * 2,
                       s=[1.0, 0.8, 0.9, 0.9, 0.7, 0.8]))
_c = compare(_t, "s", n_boot=100)
test_eq(_c[["method", "budget", "n"]].values.tolist(), [["dense", 64, 3], ["a", 64, 3]])
test_close(_c.diff_ref[1], -0.1, eps=1e-12)
test_eq(_c.ref_sig.tolist(), [False, False])  # 3 items: fewer than min_items, so not marked


# %% [markdown]
# The brute-force reference builds the same rows with Python loops: a dict of scores per
# method, budget and item, means by `sum`, the standard error by `statistics.stdev`, the best
# baseline by an explicit scan, and the intervals by `paired_ci_reference` over the items in
# sorted order (the order `compare` pairs them in, so both see the same resamples). It checks
# nothing: it is only for tables that `compare` accepts.
#
# The check below: a synthetic evaluation of 30 held-out windows of varying difficulty, dense (no budget) and
# four eviction methods at three budgets, each method's agreement the window's dense agreement
# plus an effect that shrinks with the budget and a little per-window noise. The rows are
# shuffled: `compare` pairs by item, not by row order.

# %%
#| export
def compare_reference(results: pd.DataFrame, metric: str, method="method", budget="budget", item="item",
                      reference="dense", baselines=None, higher_is_better=True, level=0.95, n_boot=10_000,
                      seed=0, min_items=16) -> list[dict]:
    "Brute-force `compare` as a list of rows (`ref`, `base`: `(diff, lo, hi, marked)`): Python loops and dicts."
    def interval(x, y):
        d, lo, hi = paired_ci_reference(x, y, level, n_boot, seed)
        return d, lo, hi, len(x) >= min_items and not lo <= 0 <= hi

    scores = {}
    for r in results.to_dict("records"):
        b = None if r[budget] != r[budget] else r[budget]  # NaN (no budget) as None, a usable dict key
        scores.setdefault(r[method], {}).setdefault(b, {})[r[item]] = r[metric]
    out = []
    for b in sorted({b for m, per_b in scores.items() if m != reference for b in per_b}):
        ref = scores[reference][b] if b in scores[reference] else next(iter(scores[reference].values()))
        at_b = {reference: ref} | {m: per_b[b] for m, per_b in scores.items() if m != reference and b in per_b}
        items = sorted(ref)
        means = {m: sum(s[i] for i in items) / len(items) for m, s in at_b.items()}
        for m, s in at_b.items():
            x = [s[i] for i in items]
            row = dict(method=m, budget=b, n=len(x), mean=means[m], se=statistics.stdev(x) / math.sqrt(len(x)))
            if m != reference:
                row["ref"] = interval(x, [ref[i] for i in items])
                best = None
                for c in baselines or scores:
                    if c in at_b and c not in (m, reference) and (best is None or (
                            means[c] > means[best] if higher_is_better else means[c] < means[best])): best = c
                if best is not None:
                    row["baseline"], row["base"] = best, interval(x, [at_b[best][i] for i in items])
            out.append(row)
    return out


# %%
_EFFECTS = {"kvpop": -0.01, "tova": -0.02, "h2o": -0.025, "streaming": -0.08}

def _long_table(n_items: int = 30, budgets=(64, 128, 256), seed: int = 0) -> pd.DataFrame:
    "A long results table: dense (budget NaN) and four methods per budget, `n_items` windows each, shuffled."
    rng = np.random.default_rng(seed)
    dense = 0.85 + 0.05 * rng.normal(size=n_items)
    rows = [dict(method="dense", budget=np.nan, item=f"w{i:02d}", agreement=dense[i]) for i in range(n_items)]
    rows += [dict(method=m, budget=b, item=f"w{i:02d}", agreement=dense[i] + e * 128 / b + 0.01 * rng.normal())
             for b in budgets for m, e in _EFFECTS.items() for i in range(n_items)]
    return pd.DataFrame(rows).sample(frac=1, random_state=seed).reset_index(drop=True)

def _check_compare(df: pd.DataFrame, **kw):
    "Assert `compare(df, **kw)` equals `compare_reference(df, **kw)`, row by row."
    got, want = compare(df, **kw), compare_reference(df, **kw)
    test_eq(len(got), len(want))
    for g, w in zip(got.to_dict("records"), want):
        test_eq([g[c] for c in ("method", "budget", "n")] + [g["baseline"]],
                [w[c] for c in ("method", "budget", "n")] + [w.get("baseline")])
        test_close([g["mean"], g["se"]], [w["mean"], w["se"]], eps=1e-12)
        for p in ("ref", "base"):
            if p in w:
                test_close([g[f"diff_{p}"], g[f"{p}_lo"], g[f"{p}_hi"]], w[p][:3], eps=1e-12)
                test_eq(g[f"{p}_sig"], w[p][3])
            else: assert math.isnan(g[f"diff_{p}"]) and not g[f"{p}_sig"]
    return got

results = _long_table()
cmp = _check_compare(results, metric="agreement", n_boot=1000)
cmp.round(4)

# %% [markdown]
# The paired intervals put every method below dense at every budget, although the standard
# errors of the means (0.007–0.008) are as large as most gaps: the windows' difficulty, shared
# by all methods, cancels in the paired differences. `kvpop` beats the best other baseline
# (`tova`) at budgets 64 and 128; at 256 the interval contains 0 (`base_sig` false). Variants:
# a single budget, a given list of baselines, lower-is-better metrics, the reference scored
# at every budget, and a tie for the best baseline (the first candidate wins).

# %%
one = results[results.budget.isin([np.nan, 128])]
test_eq(_check_compare(one, metric="agreement", n_boot=300).budget.unique().tolist(), [128])
by_list = _check_compare(results, metric="agreement", baselines=["streaming", "h2o"], n_boot=300)
test_eq(by_list.set_index(["budget", "method"]).baseline[64].to_dict(),
        {"dense": None, "kvpop": "h2o", "tova": "h2o", "h2o": "streaming", "streaming": "h2o"})
lower = _check_compare(results.assign(kl=1 - results.agreement), metric="kl", higher_is_better=False, n_boot=300)
test_eq(lower.baseline.tolist(), cmp.baseline.tolist())
per_budget = pd.concat([results[results.method != "dense"]] + [results[results.method == "dense"].assign(budget=b)
                                                                for b in (64, 128, 256)])
test_close(compare(per_budget, "agreement", n_boot=300)[["mean", "diff_ref", "ref_lo"]].fillna(0).to_numpy(),
           compare(results, "agreement", n_boot=300)[["mean", "diff_ref", "ref_lo"]].fillna(0).to_numpy(), eps=1e-12)
tie = pd.concat([results, results[results.method == "tova"].assign(method="tova2")])
tied = _check_compare(tie, metric="agreement", n_boot=300).set_index(["budget", "method"])
test_eq(tied.baseline[64][["kvpop", "tova", "tova2", "h2o"]].tolist(), ["tova", "kvpop", "kvpop", "kvpop"])
test_eq(_check_compare(tie, metric="agreement", baselines=["tova2", "tova"], n_boot=300).baseline.iloc[1], "tova2")

# %% [markdown]
# Tables `compare` refuses: a method missing an item, a repeated item, a missing score, a
# single item, no reference, unknown baselines, a budget-less method other than the reference.

# %%
test_fail(lambda: compare(results.drop(index=results.index[(results.method == "h2o") & (results.item == "w07")][:1]),
                          "agreement"), contains="method 'h2o' at budget=")
test_fail(lambda: compare(pd.concat([results, results.iloc[:1]]), "agreement"), contains="a repeated (method, budget")
test_fail(lambda: compare(results.assign(agreement=results.agreement.where(results.index != 5)), "agreement"),
          contains="a NaN or infinite 'agreement'")
test_fail(lambda: compare(results[results.item == "w03"], "agreement"), contains="an interval needs at least 2")
test_fail(lambda: compare(results, "agreement", reference="full"), contains="reference 'full' is not a method")
test_fail(lambda: compare(results, "agreement", baselines=["dense"]), contains="baselines ['dense'] are not methods")
test_fail(lambda: compare(results, "agreement", baselines="tova"), contains="baselines must be a list")
test_fail(lambda: compare(one.assign(budget=np.nan), "agreement"), contains="only the reference may lack")
test_fail(lambda: compare(results, "accuracy"), contains="results lacks the column(s) metric='accuracy'")
test_fail(lambda: compare(results.assign(agreement="x"), "agreement"), contains="must be numeric")
test_fail(lambda: compare(results[results.method == "dense"], "agreement"), contains="no method besides")


# %% [markdown]
# ## Printing and plotting
#
# `compare_table` lays one column of `compare`'s result out as method × budget text for a
# stage to print (`.to_markdown()` for the notes): `show="mean"` gives `mean ± se`,
# `show="ref"` the difference to the reference with its interval, `show="base"` the same
# against the best baseline, named. A `*` marks an interval that excludes 0, and only those.

# %%
#| export
def _check_show(show):
    "Raise a ValueError unless `show` is one of the columns `compare_cell` shows."
    if show not in ("mean", "ref", "base"): raise ValueError(f"show must be 'mean', 'ref' or 'base', got {show!r}")


# %%
_check_show("ref")
test_fail(lambda: _check_show("se"), contains="show must be 'mean', 'ref' or 'base', got 'se'")


# %%
#| export
def compare_cell(row: dict, show: str = "mean", digits: int = 3) -> str:
    "One row of `compare` as text: `mean ± se`, or a difference `d [lo, hi]` (`*`: excludes 0, and the baseline)."
    _check_show(show)
    if show == "mean": return f"{row['mean']:.{digits}f} ± {row['se']:.{digits}f}"
    if math.isnan(row[f"diff_{show}"]): return ""
    text = f"{row[f'diff_{show}']:+.{digits}f} [{row[f'{show}_lo']:+.{digits}f}, {row[f'{show}_hi']:+.{digits}f}]"
    return text + ("*" if row[f"{show}_sig"] else "") + (f" vs {row['baseline']}" if show == "base" else "")


# %%
_row = dict(mean=0.5, se=0.01, diff_ref=-0.02, ref_lo=-0.03, ref_hi=-0.01, ref_sig=True, diff_base=np.nan)
test_eq([compare_cell(_row), compare_cell(_row, "ref", 2), compare_cell(_row, "base")],
        ["0.500 ± 0.010", "-0.02 [-0.03, -0.01]*", ""])


# %%
#| export
def compare_table(cmp: pd.DataFrame, show: str = "mean", digits: int = 3) -> pd.DataFrame:
    "`compare`'s result as method × budget text: `mean ± se`, or a difference `d [lo, hi]` (`*`: excludes 0)."
    _check_show(show)
    digits = check_int(digits, "digits")
    cells = [compare_cell(r, show, digits) for r in cmp.to_dict("records")]
    table = cmp.assign(cell=cells).pivot(index="method", columns="budget", values="cell")
    return table.reindex(index=pd.unique(cmp.method), columns=pd.unique(cmp.budget)).fillna("")


# %%
test_eq(compare_table(cmp).loc["kvpop", 64], f"{cmp['mean'][1]:.3f} ± {cmp.se[1]:.3f}")
test_eq(compare_table(cmp, "ref", digits=4).loc["kvpop", 256], "-0.0075 [-0.0110, -0.0034]*")
test_eq(compare_table(cmp, "base", digits=4).loc["tova", 256], "-0.0034 [-0.0079, +0.0013] vs kvpop")
test_eq(compare_table(cmp, "ref").loc["dense"].tolist(), ["", "", ""])
test_eq(sum("*" in c for c in compare_table(cmp, "base").to_numpy().ravel()), int(cmp.base_sig.sum()))
test_fail(lambda: compare_table(cmp, "se"), contains="show must be 'mean', 'ref' or 'base'")
print(compare_table(cmp).to_markdown(), compare_table(cmp, "base").to_markdown(), sep="\n\n")


# %% [markdown]
# `plot_compare` draws each method's mean against the budget with error bars of
# $\pm z_{1-\alpha/2}\,\mathrm{se}$ (the normal interval of each mean at the level `compare`
# used), the reference dashed in black. The error bars show the precision of each mean;
# whether two methods differ is the paired interval's call, which is narrower.

# %%
#| export
def plot_compare(cmp: pd.DataFrame, ax=None):
    "Each method's mean against the budget, with error bars of ± z·se at `compare`'s level; returns the axes."
    import matplotlib.pyplot as plt
    ax = ax if ax is not None else plt.subplots()[1]
    z = statistics.NormalDist().inv_cdf((1 + cmp.attrs.get("level", 0.95)) / 2)
    for m, g in cmp.groupby("method", sort=False):
        style = dict(color="k", ls="--") if m == cmp.attrs.get("reference") else {}
        ax.errorbar(g.budget, g["mean"], yerr=z * g.se, label=m, marker="o", capsize=3, **style)
    ax.set(xlabel="budget", ylabel=cmp.attrs.get("metric", "mean"))
    ax.legend()
    return ax


# %%
import matplotlib.pyplot as plt

from sparsekv.io import use_style

use_style()
ax = plot_compare(cmp)
test_eq([t.get_text() for t in ax.get_legend().get_texts()], ["dense", "kvpop", "streaming", "h2o", "tova"])
bars = ax.containers[1]  # kvpop: the line, caps, and one vertical bar per budget of half-width 1.96 se
test_close(np.diff(bars.lines[2][0].get_segments()[0][:, 1]), 2 * 1.959964 * cmp.se[1], eps=1e-6)
plt.show()
