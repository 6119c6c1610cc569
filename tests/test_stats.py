"Tests of sparsekv.stats: paired intervals against a loop, the normal approximation and simulated coverage; compare."
import math

import numpy as np
import pandas as pd
import pytest
import torch

import sparsekv.stats as st
from sparsekv.stats import COMPARE_COLUMNS, compare, compare_reference, compare_table, paired_ci, paired_ci_reference


def scores(n, rho=0.9, delta=0.1, seed=0):
    "Paired scores of two methods on n items: a shared item difficulty (correlation ~rho), mean difference delta."
    rng = np.random.default_rng(seed)
    s = rng.normal(size=n)
    noise = math.sqrt((1 - rho) / rho)
    return s + noise * rng.normal(size=n) + delta, s + noise * rng.normal(size=n)


# --- paired_ci ------------------------------------------------------------------------

@pytest.mark.parametrize("n,level,n_boot,seed", [(2, 0.95, 1000, 0), (3, 0.9, 999, 1), (11, 0.5, 1, 2),
                                                 (40, 0.95, 3000, 3), (257, 0.99, 500, 4)])
def test_paired_ci_matches_loop(n, level, n_boot, seed):
    a, b = scores(n, seed=seed)
    np.testing.assert_allclose(paired_ci(a, b, level, n_boot, seed), paired_ci_reference(a, b, level, n_boot, seed),
                               rtol=0, atol=1e-12)


@pytest.mark.parametrize("block", [1, 25 * 7 + 3, 25 * 500])
def test_blocks_draw_the_same_resamples(monkeypatch, block):
    a, b = scores(25, seed=5)
    want = paired_ci(a, b, n_boot=500, seed=9)
    monkeypatch.setattr(st, "_BLOCK", block)
    assert paired_ci(a, b, n_boot=500, seed=9) == want


def test_inputs_of_every_kind_agree():
    a, b = scores(30, seed=6)
    want = paired_ci(a, b, n_boot=400)
    for x, y in [(a.tolist(), b.tolist()), (torch.tensor(a), torch.tensor(b)), (pd.Series(a), tuple(b))]:
        assert paired_ci(x, y, n_boot=400) == want
    ints, bools = [3, 5, 9, 4], [True, False, True, True]
    assert paired_ci(ints, bools, n_boot=400) == paired_ci(np.array(ints, float), np.array(bools, float), n_boot=400)


def test_antisymmetric_and_shift_invariant():
    a, b = scores(50, seed=7)
    m, lo, hi = paired_ci(a, b, n_boot=2000)
    np.testing.assert_allclose(paired_ci(b, a, n_boot=2000), (-m, -hi, -lo), atol=1e-12)
    np.testing.assert_allclose(paired_ci(a + 3.0, b + 3.0, n_boot=2000), (m, lo, hi), atol=1e-12)
    assert lo < m < hi


def test_edge_cases():
    assert paired_ci([3, 5, 9, 4], [1, 3, 7, 2]) == (2.0, 2.0, 2.0)  # every difference equal: zero width
    assert paired_ci([0.5, 0.5], [0.5, 0.5]) == (0.0, 0.0, 0.0)
    m, lo, hi = paired_ci([0.0, 1.0], [0.5, 0.0], n_boot=4000)  # n = 2: resample means are d1, (d1+d2)/2, d2
    assert m == 0.25 and lo == pytest.approx(-0.5) and hi == pytest.approx(1.0)


def test_deterministic_by_seed():
    a, b = scores(20, seed=8)
    assert paired_ci(a, b, seed=3) == paired_ci(a, b, seed=3)
    assert paired_ci(a, b, seed=3) != paired_ci(a, b, seed=4)


def test_normal_approximation_on_many_items():
    a, b = scores(2000, seed=5)
    m, lo, hi = paired_ci(a, b)
    d = a - b
    half = 1.96 * d.std(ddof=1) / math.sqrt(len(d))
    assert m == pytest.approx(d.mean(), abs=1e-12)
    assert lo == pytest.approx(m - half, abs=0.05 * half) and hi == pytest.approx(m + half, abs=0.05 * half)


@pytest.mark.parametrize("kind", ["gaussian", "binary"])
def test_coverage_of_the_95_interval(kind):
    # 1,000 data sets of 100 items with a known mean difference: coverage standard error ~0.007
    rng, hits, reps = np.random.default_rng(11), 0, 1000
    for r in range(reps):
        if kind == "gaussian":
            (a, b), delta = scores(100, seed=int(rng.integers(2**31))), 0.1
        else:  # 0/1 answers: b solves item i with probability p_i, a with 0.8 p_i
            p = rng.uniform(size=100)
            a, b, delta = rng.uniform(size=100) < 0.8 * p, rng.uniform(size=100) < p, -0.1
        _, lo, hi = paired_ci(a, b, n_boot=500, seed=r)
        hits += lo <= delta <= hi
    assert 0.93 <= hits / reps <= 0.97, hits / reps


def test_paired_interval_is_narrower_on_correlated_items():
    a, b = scores(400, rho=0.9, seed=6)
    _, lo, hi = paired_ci(a, b)
    rng = np.random.default_rng(0)
    unpaired = a[rng.integers(0, 400, (10_000, 400))].mean(1) - b[rng.integers(0, 400, (10_000, 400))].mean(1)
    u_lo, u_hi = np.quantile(unpaired, [0.025, 0.975])
    ratio = (hi - lo) / (u_hi - u_lo)
    assert ratio == pytest.approx(math.sqrt((a - b).var() / (a.var() + b.var())), abs=0.05) and ratio < 0.5
    assert lo > 0 > u_lo  # pairing resolves a difference the unpaired interval cannot


@pytest.mark.parametrize("args,kw,err,msg", [
    (([1.0, 2.0, 3.0], [1.0, 2.0]), {}, ValueError, "equal lengths"),
    (([1.0], [2.0]), {}, ValueError, "a must hold at least 2 items"),
    (([1.0, 2.0], [2.0, float("nan")]), {}, ValueError, "b contains NaN or inf at items [1]"),
    (([1.0, float("inf")], [2.0, 1.0]), {}, ValueError, "a contains NaN or inf at items [1]"),
    ((np.ones((2, 2)), np.ones((2, 2))), {}, ValueError, "a must be 1-D"),
    ((["x", "y"], [1, 2]), {}, TypeError, "a must be a 1-D list, array or tensor of real numbers"),
    (([1, 2], [1 + 1j, 2]), {}, TypeError, "b must be a 1-D list"),
    (([1, 2], [1, None]), {}, TypeError, "b must be a 1-D list"),
    (([1, 2], [2, 1]), {"level": 0.0}, ValueError, "level must be a float in (0, 1)"),
    (([1, 2], [2, 1]), {"level": "95%"}, TypeError, "level must be a float in (0, 1)"),
    (([1, 2], [2, 1]), {"n_boot": 0}, ValueError, "n_boot must be an int >= 1"),
    (([1, 2], [2, 1]), {"n_boot": 10.5}, TypeError, "n_boot must be an int >= 1"),
    (([1, 2], [2, 1]), {"seed": -1}, ValueError, "seed must be an int >= 0"),
])
def test_paired_ci_refuses(args, kw, err, msg):
    with pytest.raises(err, match=None) as e: paired_ci(*args, **kw)
    assert msg in str(e.value)


# --- compare --------------------------------------------------------------------------

EFFECTS = {"kvpop": -0.01, "tova": -0.02, "h2o": -0.025, "streaming": -0.08}


def long_table(n_items=30, budgets=(64, 128, 256), seed=0, dense_budget=np.nan):
    "Dense (one budget value) and four methods per budget on n_items windows, rows shuffled."
    rng = np.random.default_rng(seed)
    dense = 0.85 + 0.05 * rng.normal(size=n_items)
    rows = [dict(method="dense", budget=dense_budget, item=f"w{i:02d}", agreement=dense[i]) for i in range(n_items)]
    rows += [dict(method=m, budget=b, item=f"w{i:02d}", agreement=dense[i] + e * 128 / b + 0.01 * rng.normal())
             for b in budgets for m, e in EFFECTS.items() for i in range(n_items)]
    return pd.DataFrame(rows).sample(frac=1, random_state=seed).reset_index(drop=True)


def assert_matches_reference(df, **kw):
    got, want = compare(df, **kw), compare_reference(df, **kw)
    assert list(got.columns) == COMPARE_COLUMNS and len(got) == len(want)
    for g, w in zip(got.to_dict("records"), want):
        assert [g[c] for c in ("method", "budget", "n", "baseline")] == [w[c] for c in ("method", "budget", "n")] + [
            w.get("baseline")]
        np.testing.assert_allclose([g["mean"], g["se"]], [w["mean"], w["se"]], rtol=0, atol=1e-12)
        for p in ("ref", "base"):
            if p in w:
                np.testing.assert_allclose([g[f"diff_{p}"], g[f"{p}_lo"], g[f"{p}_hi"]], w[p][:3], rtol=0, atol=1e-12)
                assert g[f"{p}_sig"] == w[p][3]
            else:
                assert math.isnan(g[f"diff_{p}"]) and g[f"{p}_sig"] is False
    return got


@pytest.mark.parametrize("seed,n_items,budgets,labels", [(0, 30, (64, 128, 256), False), (1, 2, (32, 16), False),
                                                         (2, 7, (128,), False), (3, 12, (32, 16), True)])
def test_compare_matches_reference(seed, n_items, budgets, labels):
    df = long_table(n_items, budgets, seed)
    if labels: df = df.assign(budget=[f"{b:.0f}%" if b == b else "full" for b in df.budget])  # text budgets
    got = assert_matches_reference(df, metric="agreement", n_boot=300, seed=seed)
    assert got.budget.unique().tolist() == sorted(f"{b}%" if labels else b for b in budgets)
    assert (got.n == n_items).all() and got.attrs["metric"] == "agreement"


@pytest.mark.parametrize("min_items", [2, 8, 9, 16])
def test_compare_marks_differences_only_from_min_items(min_items):
    df = long_table(8, (64,), seed=5)  # 8 items; kvpop clearly behind dense at 64
    got = assert_matches_reference(df, metric="agreement", n_boot=300, min_items=min_items).set_index("method")
    assert got.loc["kvpop", "ref_hi"] < 0 and got.attrs["min_items"] == min_items
    assert bool(got.loc["kvpop", "ref_sig"]) == (min_items <= 8)
    assert (got.ref_sig.any() or got.base_sig.any()) == (min_items <= 8)


def test_compare_numbers_by_hand():
    df = pd.DataFrame(dict(method=["dense"] * 3 + ["a"] * 3 + ["b"] * 3, budget=[None] * 3 + [8] * 6,
                           item=[2, 0, 1] * 3, score=[1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0]))
    got = compare(df, "score", n_boot=200).set_index("method")
    assert got.loc["dense", "mean"] == pytest.approx(2 / 3) and got.loc["a", "mean"] == pytest.approx(1 / 3)
    assert got.loc["a", "se"] == pytest.approx(math.sqrt(1 / 3) / math.sqrt(3))
    assert got.loc["a", "diff_ref"] == pytest.approx(-1 / 3) and got.loc["b", "diff_ref"] == 0.0
    assert (got.loc["b", "ref_lo"], got.loc["b", "ref_hi"], got.loc["b", "ref_sig"]) == (0.0, 0.0, False)  # same scores
    assert got.loc["a", "baseline"] == "b" and got.loc["b", "baseline"] == "a"


def test_compare_variants():
    df = long_table()
    base = compare(df, "agreement", n_boot=300)
    assert base.set_index(["budget", "method"]).loc[(64, "kvpop"), "baseline"] == "tova"
    by_list = assert_matches_reference(df, metric="agreement", baselines=["streaming", "h2o"], n_boot=300)
    assert by_list.set_index(["budget", "method"]).baseline[64].to_dict() == {
        "dense": None, "kvpop": "h2o", "streaming": "h2o", "h2o": "streaming", "tova": "h2o"}
    lower = assert_matches_reference(df.assign(kl=1 - df.agreement), metric="kl", higher_is_better=False, n_boot=300)
    assert lower.baseline.tolist() == base.baseline.tolist()
    dense = df[df.method == "dense"]
    per_budget = pd.concat([df[df.method != "dense"]] + [dense.assign(budget=b) for b in (64, 128, 256)])
    cols = ["mean", "se", "diff_ref", "ref_lo", "ref_hi", "diff_base", "base_lo"]
    np.testing.assert_allclose(compare(per_budget, "agreement", n_boot=300)[cols].fillna(0),
                               base[cols].fillna(0), atol=1e-12)
    renamed = df.rename(columns=dict(method="policy", budget="keep", item="window"))
    again = compare(renamed, "agreement", method="policy", budget="keep", item="window", n_boot=300)
    pd.testing.assert_frame_equal(again, base)


def test_ties_for_best_baseline_go_to_the_first_listed():
    df = long_table()
    tie = pd.concat([df, df[df.method == "tova"].assign(method="tova2")])
    got = assert_matches_reference(tie, metric="agreement", n_boot=300).set_index(["budget", "method"])
    assert got.baseline[64][["kvpop", "tova", "tova2", "h2o"]].tolist() == ["tova", "kvpop", "kvpop", "kvpop"]
    listed = compare(tie, "agreement", baselines=["tova2", "tova"], n_boot=300).set_index(["budget", "method"])
    assert listed.baseline[64][["kvpop", "h2o"]].tolist() == ["tova2", "tova2"]


def test_single_method_has_no_baseline():
    df = long_table()
    got = compare(df[df.method.isin(["dense", "kvpop"])], "agreement", n_boot=300)
    assert got.baseline.isna().all() and got.diff_base.isna().all() and not got.base_sig.any()
    assert got.ref_sig[got.method == "kvpop"].all()


def drop_one(df, method, item):
    return df.drop(index=df.index[(df.method == method) & (df.item == item)][:1])


@pytest.mark.parametrize("make,kw,err,msg", [
    (lambda df: drop_one(df, "h2o", "w07"), {}, ValueError, "method 'h2o' at budget="),
    (lambda df: drop_one(df, "dense", "w07"), {}, ValueError, "lacks item(s) ['w07']"),
    (lambda df: pd.concat([df, df.iloc[:1]]), {}, ValueError, "a repeated (method, budget, item)"),
    (lambda df: df.assign(agreement=df.agreement.where(df.index != 5)), {}, ValueError, "a NaN or infinite"),
    (lambda df: df.assign(item=df.item.where(df.index != 5)), {}, ValueError, "with no 'item'"),
    (lambda df: df[df.item == "w03"], {}, ValueError, "an interval needs at least 2"),
    (lambda df: df, {"reference": "full"}, ValueError, "reference 'full' is not a method"),
    (lambda df: df, {"baselines": ["dense"]}, ValueError, "baselines ['dense'] are not methods"),
    (lambda df: df, {"baselines": ["oval"]}, ValueError, "baselines ['oval'] are not methods"),
    (lambda df: df, {"baselines": []}, ValueError, "baselines must name at least one method"),
    (lambda df: df, {"baselines": "tova"}, TypeError, "baselines must be a list"),
    (lambda df: df, {"higher_is_better": "yes"}, TypeError, "higher_is_better must be a bool"),
    (lambda df: df, {"level": 95}, ValueError, "level must be a float in (0, 1)"),
    (lambda df: df, {"n_boot": 0}, ValueError, "n_boot must be an int >= 1"),
    (lambda df: df[df.budget.isin([np.nan, 128])].assign(budget=np.nan), {}, ValueError, "only the reference may lack"),
    (lambda df: pd.concat([df[df.method != "dense"]] + [df[df.method == "dense"].assign(budget=b) for b in (64, 128)]),
     {}, ValueError, "has no rows at budget=256 and several budgets"),
    (lambda df: df[df.method == "dense"], {}, ValueError, "no method besides the reference"),
    (lambda df: df, {"metric": "accuracy"}, ValueError, "results lacks the column(s) metric='accuracy'"),
    (lambda df: df.assign(agreement="x"), {}, TypeError, "must be numeric"),
    (lambda df: df.to_dict("records"), {}, TypeError, "results must be a pandas DataFrame"),
])
def test_compare_refuses(make, kw, err, msg):
    kw = {"metric": "agreement", **kw}
    with pytest.raises(err) as e: compare(make(long_table(n_items=10)), **kw)
    assert msg in str(e.value)


# --- printing and plotting ------------------------------------------------------------

def test_compare_table():
    cmp = compare(long_table(), "agreement", n_boot=300)
    mean, ref, best = (compare_table(cmp, s, digits=4) for s in ("mean", "ref", "base"))
    assert list(mean.index) == ["dense", "kvpop", "streaming", "h2o", "tova"] and list(mean.columns) == [64, 128, 256]
    r = cmp.set_index(["method", "budget"]).loc[("tova", 128)]
    assert mean.loc["tova", 128] == f"{r['mean']:.4f} ± {r.se:.4f}"
    assert ref.loc["tova", 128] == f"{r.diff_ref:+.4f} [{r.ref_lo:+.4f}, {r.ref_hi:+.4f}]" + "*" * bool(r.ref_sig)
    assert best.loc["tova", 128].endswith(f" vs {r.baseline}")
    assert ref.loc["dense"].tolist() == ["", "", ""] and best.loc["dense"].tolist() == ["", "", ""]
    assert sum("*" in c for c in best.to_numpy().ravel()) == cmp.base_sig.sum()
    with pytest.raises(ValueError, match="show must be"): compare_table(cmp, "se")
    with pytest.raises(ValueError, match="digits must be"): compare_table(cmp, digits=-1)


def test_plot_compare_error_bars():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cmp = compare(long_table(), "agreement", level=0.9, n_boot=300)
    ax = st.plot_compare(cmp)
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["dense", "kvpop", "streaming", "h2o", "tova"]
    for k, (_, g) in enumerate(cmp.groupby("method", sort=False)):
        segs = ax.containers[k].lines[2][0].get_segments()
        np.testing.assert_allclose([s[1, 1] - s[0, 1] for s in segs], 2 * 1.6448536 * g.se.to_numpy(), rtol=1e-6)
    assert ax.get_ylabel() == "agreement"
    plt.close(ax.figure)
