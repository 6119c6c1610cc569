"""Tests of sparsekv.costs and the methods' scoring costs: each formula against the multiply-adds counted in the code
that runs, over methods, phases, shapes and parameters; zero for methods that choose no keys; matching by a loop.
The methods come from the registry: every selection and retrieval method that states a scoring formula, at its
defaults, at its `small_params` and at two values of its `cost_knob`."""
import pytest

from sparsekv import methods
from sparsekv.costs import KNOBS, SMOLLM2, cost_table, counted_macs, counted_surplus, matched, measured_cost
from sparsekv.methods import ModelShape, ScoringCost, scoring_cost
from sparsekv.models import tiny_config
from sparsekv.oval.summaries import PageRetrieval
from sparsekv.quoka.policy import SelectionMethod

SHAPES = [ModelShape(4, 2, 16, 2), ModelShape(4, 4, 8, 3), ModelShape(6, 1, 12, 2), SMOLLM2]
# The formula each family states per class, and the base class's placeholder that raises.
FORMULA = {"selection": ("key_cost", SelectionMethod), "retrieval": ("page_cost", PageRetrieval)}
# Options that take other branches of a formula (query choice, head aggregation, sinks, centring, score kind), beyond
# what the registry states; the classes do not list them.
OPTIONS = {"quoka": [dict(n_q=5, query_select="head", query_agg="mean"), dict(n_q=3, sinks=1, recent=2),
                     dict(n_q=2, query_rank="random"), dict(n_q=4, query_rank="similar"), dict(n_q=3, gqa_agg="max"),
                     dict(n_q=2, query_agg="mean", gqa_agg="max", sinks=1)],
           "sample_attention": [dict(n_q=7, seed=3)], "loki": [dict(r=4, center=True)],
           "mean_scores": [dict(scores="logits")], "lessismore": [dict(selection_layers=(0, 1), recent_ratio=0.5)],
           "oval": [dict(page_size=4, rank=3, eta=0.25)]}


def states_formula(name: str) -> bool:
    "Whether the class of `name` states its own scoring formula (`key_cost` or `page_cost`); a router does not."
    cls = methods.get(name)
    attr, base = FORMULA.get(cls.family, (None, None))
    return attr is not None and issubclass(cls, base) and getattr(cls, attr) is not getattr(base, attr)


SCORING = [n for n in methods.names() if states_formula(n)]


def params_of(name: str) -> list[dict]:
    "Parameter sets of `name`: defaults, `small_params` (but what `make` sets), its knob at 1 and 3, OPTIONS."
    cls = methods.get(name)
    small = {k: v for k, v in cls.small_params.items() if k not in ("chunk_size", "selection_layers")}
    knob = [{cls.cost_knob: v} for v in (1, 3)] if cls.cost_knob else []
    out = []
    for p in [{}, small, *knob, *OPTIONS.get(name, [])]:
        if p not in out: out.append(p)
    return out


CASES = [(n, p) for n in SCORING for p in params_of(n)]


def make(name, budget, **params):
    "`methods.make` in chunks of 6 (selection); a method of chosen layers at the layers its `small_params` state."
    small = methods.get(name).small_params
    if methods.get(name).family == "selection": params = dict(chunk_size=6, **params)
    if "selection_layers" in small: params.setdefault("selection_layers", small["selection_layers"])
    return methods.make(name, budget, **params)


def test_every_scoring_method_is_covered():
    "Every selection and retrieval method states its formula, but the router that runs two methods' formulas."
    scoring_families = [n for n in methods.names() if methods.get(n).family in FORMULA]
    assert [n for n in scoring_families if not states_formula(n)] == ["prefill_decode"]
    assert {methods.get(n).family for n in SCORING} == set(FORMULA)
    assert set(OPTIONS) <= set(SCORING) and set(KNOBS) <= set(SCORING)


@pytest.mark.parametrize("phase", methods.PHASES)
@pytest.mark.parametrize("name,params", CASES, ids=lambda x: str(x))
def test_formula_matches_counted_code(name, params, phase):
    "The code's counted multiply-adds of one call are the formula's per_step plus the stated implementation surplus."
    for i, shape in enumerate(SHAPES):
        T = 70 + 37 * i
        m = make(name, 24, **params)
        cost = scoring_cost(m, shape, T, phase)
        got = measured_cost(m, shape, T, phase, seed=i)
        assert got == cost.per_step + counted_surplus(m, shape, T, phase), (shape, T)
        assert cost.per_step > 0 or (phase == "prefill" and m.family == "retrieval")
        assert cost.total == cost.per_step * shape.Hkv * (
            len(m.selection_layers) if name == "lessismore" else
            shape.layers - (m.dense_layers if m.family == "retrieval" else 0))


@pytest.mark.parametrize("name,params", CASES, ids=lambda x: str(x))
def test_per_key_is_the_growth_per_key(name, params):
    "per_key does not depend on the cache; per_step grows by per_key per key (per page for retrieval)."
    m, shape = make(name, 24, **params), SHAPES[0]
    for phase in methods.PHASES:
        step = 1 if m.family == "selection" else m.page_size
        a, b = (scoring_cost(m, shape, T, phase) for T in (200, 200 + step))
        assert a.per_key == b.per_key == scoring_cost(m, shape, 0, phase).per_key
        assert b.per_step - a.per_step == a.per_key * step


def test_dense_below_the_budget_costs_nothing():
    for name, _ in CASES:
        m = make(name, 100)
        for phase in methods.PHASES:
            assert scoring_cost(m, SHAPES[0], 100, phase).per_step == 0
            assert measured_cost(m, SHAPES[0], 100, phase) == 0


@pytest.mark.parametrize("name", [n for n in methods.names() if methods.get(n).family in ("dense", "eviction")])
def test_methods_that_choose_no_keys_cost_zero(name):
    m = methods.make(name) if name == "dense" else methods.make(name, budget=16)
    for phase in methods.PHASES:
        assert scoring_cost(m, SMOLLM2, 4096, phase) == ScoringCost()
        assert measured_cost(m, SMOLLM2, 4096, phase) == 0


def test_selection_without_sparse_decode_and_fraction_budgets():
    m = methods.make("quoka", 0.25, chunk_size=6, decode=False)
    assert scoring_cost(m, SMOLLM2, 400, "decode") == ScoringCost() and measured_cost(m, SMOLLM2, 400, "decode") == 0
    assert measured_cost(m, SMOLLM2, 400) == scoring_cost(m, SMOLLM2, 400).per_step == 6 * 64 * 400


def test_prefill_decode_routes_each_phase():
    both = methods.make("prefill_decode", 24, prefill=make("sparq", 24), decode=make("quest", 24, page_size=4))
    for phase, part in (("prefill", both.prefill), ("decode", both.decode)):
        assert scoring_cost(both, SMOLLM2, 99, phase) == scoring_cost(part, SMOLLM2, 99, phase)
        want = scoring_cost(part, SMOLLM2, 99, phase).per_step + counted_surplus(part, SMOLLM2, 99, phase)
        assert measured_cost(both, SMOLLM2, 99, phase) == want


def test_the_issue_figures():
    "QuoKA N_Q D = 1,024, SparQ/Loki at r = 32 12,288, mean of scores 24,576 per cached key (SmolLM2)."
    per_key = {n: methods.make(n, 1024).scoring_cost(SMOLLM2, 4096).per_key for n in ("quoka", "sparq", "loki",
                                                                                       "mean_scores")}
    assert per_key == dict(quoka=1024, sparq=12288, loki=12288, mean_scores=24576)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3"])
def test_shape_of_a_config(name):
    assert ModelShape.of(tiny_config(name)) == ModelShape(4, 2, 16, 2)
    assert ModelShape.of(tiny_config(name, num_kv_heads=1, num_layers=3)) == ModelShape(4, 1, 16, 3)


@pytest.mark.parametrize("name", sorted(KNOBS))
@pytest.mark.parametrize("phase", methods.PHASES)
def test_matched_is_the_best_affordable_knob(name, phase):
    "The matched knob: largest cost <= target, smallest such value, by a loop over every value."
    knob, extra = KNOBS[name], {"chunk_size": 6} if methods.get(name).family == "selection" else {}
    for shape in SHAPES:
        for target in (7, 100, 1000, 5000):
            costs = {v: make(name, 64, **{knob: v}).scoring_cost(shape, 0, phase).per_key
                     for v in range(1, 300) if knob != "r" or v <= shape.D}
            ok = [v for v, c in costs.items() if c <= target]
            if not ok:
                with pytest.raises(ValueError, match="costs more than target"):
                    matched(name, target, shape, 64, phase, **extra)
                continue
            want = min(ok, key=lambda v: (-costs[v], v))
            got = matched(name, target, shape, 64, phase, **extra)
            assert getattr(got, knob) == want and got.name == name


def test_cost_table_smollm2():
    t = cost_table(SMOLLM2).set_index(["method", "setting"])
    assert t.index[0] == ("quoka", "default")
    assert t.loc[("quoka", "default"), "prefill_chunk"] == (1024 * 4096 + 3 * 128 * 64) * 3 * 30  # + the ranking, G S D
    assert t.xs("matched to quoka", level="setting").prefill_per_key.tolist() == [960, 768, 768]
    assert (t.xs("default", level="setting").query("decode_per_key > 0").index.size == len(SCORING))


def test_bad_input():
    m = methods.make("quoka", 8)
    with pytest.raises(ValueError, match="phase must be"): m.scoring_cost(SMOLLM2, 64, "generate")
    with pytest.raises(ValueError, match="chunk must be None or 1"): m.scoring_cost(SMOLLM2, 64, "decode", chunk=8)
    with pytest.raises(ValueError, match="n_cached must be"): m.scoring_cost(SMOLLM2, -1)
    with pytest.raises(ValueError, match="chunk must be"): m.scoring_cost(SMOLLM2, 64, chunk=0)
    with pytest.raises(TypeError, match="shape must be"): m.scoring_cost((9, 3, 64, 30), 64)
    with pytest.raises(TypeError, match="method must be a Method"): scoring_cost("quoka", SMOLLM2, 64)
    with pytest.raises(ValueError, match="n_cached must be"): measured_cost(methods.make("tova", 8), SMOLLM2, -2)
    with pytest.raises(ValueError, match="Hq=9 must be a multiple"): ModelShape(9, 2, 64, 30)
    with pytest.raises(ValueError, match="D must be"): ModelShape(9, 3, 0, 30)
    with pytest.raises(ValueError, match="name must be one of"): matched("quest", 100, SMOLLM2, 64)
    with pytest.raises(ValueError, match="target must be"): matched("sparq", -1.0, SMOLLM2, 64)
    with pytest.raises(ValueError, match="target must be"): cost_table(SMOLLM2, target="nope")
    with pytest.raises(TypeError, match="fn must be callable"): counted_macs(None)
