# %% [markdown]
# # Verdicts
#
# > Each paper's claims decided from the committed grids: a paired 95% interval per claim and model, and the rule that turns it into confirmed, refuted or tied.

# %%
#| default_exp verdicts

# %% [markdown]
# A claim of a paper, as this project tests it, compares two measures on the same items: QuoKA
# against SparQ on the same needle prompts, KVpop against TOVA on the same prose windows. Write
# $a_i$ and $b_i$ for the two scores of item $i$; the claim is that the mean difference
# $\Delta = \mathbb E_i[a_i - b_i]$ lies on one side of a margin $m$: above $0$ for "ahead of",
# above $-0.03$ for "less than 3% below dense". A claim about one measure (the sign of a
# correlation) has no $b$: then $b_i = 0$.
#
# The estimate is $\hat\Delta$ with its paired bootstrap 95% interval $[\ell, h]$
# (`sparsekv.stats.paired_ci`). The verdict reads the interval, never the point estimate:
#
# | interval | verdict |
# |---|---|
# | on the claimed side of $m$ ($\ell > m$ for "above") | **confirmed** |
# | on the other side ($h < m$) | **refuted** |
# | contains $m = 0$ | **tied** |
# | contains $m \ne 0$ | **undecided** |
# | fewer items than the claim needs (`min_n`) | **pending** |
# | no grid for this model | **not tested** |
#
# A "tied" claim that one method is *ahead* is not confirmed; a "tied" claim that a cheaper
# choice is *no worse* (QuoKA's mean over a KV group) is as much as a finite sample can give.

# %%
#| export
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import yaml

from sparsekv.io import file_sha256
from sparsekv.models import MODEL_LABELS
from sparsekv.stats import paired_ci

# %%
#| export
VERDICTS = ("confirmed", "refuted", "tied", "undecided", "pending", "not tested")
SIDES = ("above", "below")

def decide(lo: float, hi: float, n: int, margin: float = 0.0, side: str = "above", min_n: int = 2) -> str:
    "Verdict on the claim: a difference lies `side` (above/below) `margin`; its interval `[lo, hi]` over `n` items."
    if side not in SIDES: raise ValueError(f"side must be one of {SIDES}, got {side!r}")
    if n == 0: return "not tested"
    if n < min_n: return "pending"
    if side == "below": lo, hi, margin = -hi, -lo, -margin
    if lo > margin: return "confirmed"
    if hi < margin: return "refuted"
    return "tied" if margin == 0 else "undecided"


# %% [markdown]
# Checked against the table above case by case, and the two sides against each other: a claim
# "below $m$" is the claim "above $-m$" on the negated interval.

# %%
cases = [((0.01, 0.2, 55), {}, "confirmed"), ((-0.2, -0.01, 55), {}, "refuted"), ((-0.1, 0.1, 55), {}, "tied"),
         ((-0.05, 0.0, 55), {"margin": -0.03}, "undecided"), ((-0.02, 0.0, 55), {"margin": -0.03}, "confirmed"),
         ((-0.5, -0.3, 16), {"side": "below"}, "confirmed"), ((0.01, 0.2, 13), {"min_n": 55}, "pending"),
         ((math.nan, math.nan, 0), {}, "not tested"), ((0.0, 0.1, 55), {}, "tied")]
for args, kw, want in cases:
    assert decide(*args, **kw) == want, (args, kw, want)
rng = np.random.default_rng(0)
for _ in range(200):
    (lo, hi), m = np.sort(rng.normal(size=2)), rng.normal()
    assert decide(lo, hi, 55, m, "below") == decide(-hi, -lo, 55, -m, "above")


# %% [markdown]
# ## Measures
#
# A measure is one column of one committed grid (a CSV the pipeline writes): the rows `where`
# each named column holds the given value (or one of a list), averaged per item, an item being the
# values of the `item` columns (a prose window; a needle prompt within its task). Averaging
# within an item is how a per-layer or per-head table becomes one number per window. Rows whose
# value is missing (the Spearman correlation of a head whose keys-for-90% count never varies) are
# left out of their item's mean.

# %%
#| export
@dataclass(frozen=True)
class Measure:
    "Column `metric` of the grid `source` (`{profile}` substituted), rows matching `where`, averaged per `item` key."
    source: str
    metric: str
    item: tuple
    where: dict = field(default_factory=dict)

    def values(self, table: pd.DataFrame) -> pd.Series:
        "One value per item of `table` (a grid with this measure's columns)."
        missing = [c for c in [self.metric, *self.item, *self.where] if c not in table.columns]
        if missing: raise KeyError(f"grid {self.source} has no column(s) {missing}; it has {list(table.columns)}")
        keep = np.ones(len(table), bool)
        for col, want in self.where.items():
            keep &= table[col].isin(want if isinstance(want, list) else [want]).to_numpy()
        keep &= table[self.metric].notna().to_numpy()  # a correlation of a constant is NaN: no value, not a zero
        return table[keep].groupby(list(self.item))[self.metric].mean()


# %%
t = pd.DataFrame({"window": [0, 0, 1, 1, 2], "method": ["x", "x", "x", "y", "x"], "m": [1.0, 3.0, 5.0, 7.0, 9.0]})
assert Measure("g.csv", "m", ("window",), {"method": "x"}).values(t).to_dict() == {0: 2.0, 1: 5.0, 2: 9.0}
assert Measure("g.csv", "m", ("window",), {"method": ["x", "y"]}).values(t).to_dict() == {0: 2.0, 1: 6.0, 2: 9.0}
t.loc[4, "m"] = np.nan
assert Measure("g.csv", "m", ("window",), {"method": ["x", "y"]}).values(t).to_dict() == {0: 2.0, 1: 6.0}
try: Measure("g.csv", "loss", ("window",)).values(t)
except KeyError as e: assert "loss" in str(e) and "g.csv" in str(e)
else: raise AssertionError("a missing column must be refused")

# %% [markdown]
# ## Claims
#
# `reproduce/claims.yaml` lists the claims: each with its paper, the claim in a line, what the
# paper says (quoted), what our estimate measures, the measures `a` and (optionally) `b` (`b`
# reads `a`'s grid), `margin`, `side` and `min_n`, and optionally a `mechanism`: a measure shown
# for both models where their verdicts differ (QuoKA's premise beside its query choice, the
# anisotropy of OVAL's $G$ beside OVAL's gain). The file also maps each model to the profiles
# whose runs hold its grids, the first with the file winning.

# %%
#| export
_MEASURE_KEYS = {"source", "metric", "item", "where"}

def _measure(d, where: str, source: str | None = None) -> Measure:
    "A `Measure` from the mapping `d`, checked (`where` names it in errors); `source`: inherited from `a`."
    if not isinstance(d, dict): raise TypeError(f"{where} must be a mapping, got {type(d).__name__}")
    if unknown := set(d) - _MEASURE_KEYS:
        raise ValueError(f"{where} has unknown key(s) {sorted(unknown)}; accepted: {sorted(_MEASURE_KEYS)}")
    if source is not None and "source" in d: raise ValueError(f"{where} reads the grid of `a`: give no source")
    src, item = d.get("source", source), d.get("item")
    if not isinstance(src, str) or not isinstance(d.get("metric"), str):
        raise ValueError(f"{where} needs `source` and `metric` strings, got {d!r}")
    if not isinstance(item, list) or not item or not all(isinstance(c, str) for c in item):
        raise ValueError(f"{where}.item must be a non-empty list of column names, got {item!r}")
    if not isinstance(d.get("where", {}), dict):
        raise ValueError(f"{where}.where must be a mapping, got {d['where']!r}")
    return Measure(src, d["metric"], tuple(item), d.get("where", {}))


# %%
assert _measure({"source": "g.csv", "metric": "m", "item": ["w"]}, "a") == Measure("g.csv", "m", ("w",))
assert _measure({"metric": "m", "item": ["w"], "where": {"x": 1}}, "b", "g.csv").where == {"x": 1}

# %%
#| export
_TEXT_KEYS = ("id", "paper", "claim", "paper_says", "measures")

@dataclass(frozen=True)
class Claim:
    "One claim of a paper: `a - b` (or `a`) `side` `margin`, decided on at least `min_n` items."
    id: str
    paper: str
    claim: str
    paper_says: str
    measures: str
    a: Measure
    b: Measure | None = None
    margin: float = 0.0
    side: str = "above"
    min_n: int = 2
    mechanism: tuple | None = None  # (text, Measure)

def _number(x, name: str, ok) -> None:
    if isinstance(x, bool) or not ok(x): raise ValueError(f"{name}, got {x!r}")


# %%
#| export
def parse_claim(d: dict) -> Claim:
    "A claim from one entry of `claims.yaml`, every field checked."
    if not isinstance(d, dict): raise TypeError(f"a claim must be a mapping, got {type(d).__name__}")
    name = f"claim {d.get('id', '?')}"
    if unknown := set(d) - set(Claim.__dataclass_fields__):
        raise ValueError(f"{name}: unknown key(s) {sorted(unknown)}; accepted: {sorted(Claim.__dataclass_fields__)}")
    for k in _TEXT_KEYS:
        if not isinstance(d.get(k), str) or not d[k]: raise ValueError(f"{name}: `{k}` must be a non-empty string")
    if d.get("side", "above") not in SIDES: raise ValueError(f"{name}: side must be one of {SIDES}, got {d['side']!r}")
    _number(d.get("margin", 0.0), f"{name}: margin must be a number", lambda x: isinstance(x, (int, float)))
    _number(d.get("min_n", 2), f"{name}: min_n must be an int >= 2", lambda x: isinstance(x, int) and x >= 2)
    a = _measure(d.get("a"), f"{name}: a")
    b = _measure(d["b"], f"{name}: b", a.source) if "b" in d else None
    mech = d.get("mechanism")
    if mech is not None:
        if not isinstance(mech, dict) or set(mech) != {"text", "measure"} or not isinstance(mech["text"], str):
            raise ValueError(f"{name}: mechanism must be a mapping with `text` and `measure`, got {mech!r}")
        mech = (mech["text"], _measure(mech["measure"], f"{name}: mechanism.measure"))
    return Claim(*(d[k] for k in _TEXT_KEYS), a, b, float(d.get("margin", 0.0)), d.get("side", "above"),
               d.get("min_n", 2), mech)


# %%
#| export
def load_claims(path: str | os.PathLike) -> tuple[dict, list[Claim]]:
    "`(models, claims)` from a claims file: models map a model name to the profiles holding its grids."
    data = yaml.safe_load(Path(path).read_text())
    if not isinstance(data, dict) or set(data) != {"models", "claims"}:
        raise ValueError(f"{path} must hold exactly `models` and `claims`")
    models = data["models"]
    if not isinstance(models, dict) or not all(isinstance(p, list) and p and all(isinstance(x, str) for x in p)
                                               for p in models.values()):
        raise ValueError(f"{path}: `models` must map each model to a non-empty list of profiles, got {models!r}")
    claims = [parse_claim(d) for d in data["claims"]]
    if len({c.id for c in claims}) != len(claims): raise ValueError(f"{path}: claim ids repeat")
    return models, claims


# %%
models, claims = load_claims("../reproduce/claims.yaml")
assert "smollm2-135m" in models and {c.paper for c in claims} == {"QuoKA", "OVAL", "KVpop"}
_good = {"id": "x", "paper": "p", "claim": "c", "paper_says": "s", "measures": "m",
         "a": {"source": "g", "metric": "m", "item": ["w"]}}
assert parse_claim(_good) == Claim("x", "p", "c", "s", "m", Measure("g", "m", ("w",)))
try: parse_claim({**_good, "sid": "below"})
except ValueError as e: assert "sid" in str(e) and "claim x" in str(e)
else: raise AssertionError("an unknown key must be refused")


# %% [markdown]
# ## Reading a grid for a model
#
# A claim is evaluated for a model on the first of the model's profiles whose run has the grid.
# Grids that name their model (a `model_name` or `model` column) are cut to that model's rows, so
# a grid of another model is never read as this one's. The grid's sha256 goes into the verdict row:
# the test that recomputes every cell checks it first, so a grid committed after the table was made
# is caught as stale rather than as a wrong number.

# %%
#| export
def read_grid(source: str, profiles: list, model: str, root: str | os.PathLike = "."
              ) -> tuple[str, pd.DataFrame] | None:
    "`(path, rows of model)` of the first of `profiles` whose `source` file exists under `root`, or None."
    for profile in profiles:
        path = source.format(profile=profile)
        if not (Path(root)/path).is_file(): continue
        table = pd.read_csv(Path(root)/path)
        names = {model, MODEL_LABELS.get(model, model)}
        for col in ("model_name", "model"):
            if col in table.columns: table = table[table[col].isin(names)]
        return path, table
    return None

def evaluate(claim: Claim, model: str, profiles: list, root: str | os.PathLike = ".") -> dict:
    "One row of the verdict table: `claim` on `model` from the grids of `profiles` under `root`."
    row = dict(claim=claim.id, paper=claim.paper, model=model, source=None, source_sha256=None, n=0, estimate=math.nan,
               lo=math.nan, hi=math.nan, margin=claim.margin, side=claim.side, min_n=claim.min_n, mechanism=math.nan)
    if claim.mechanism is not None and (got := read_grid(claim.mechanism[1].source, profiles, model, root)):
        row["mechanism"] = float(claim.mechanism[1].values(got[1]).mean())
    got = read_grid(claim.a.source, profiles, model, root)
    if got is not None:
        row["source"], row["source_sha256"] = got[0], file_sha256(Path(root)/got[0])
        a = claim.a.values(got[1])
        b = claim.b.values(got[1]) if claim.b is not None else pd.Series(0.0, index=a.index)
        a, b = a.align(b, join="inner")
        row["n"] = len(a)
        if len(a) >= 2: row["estimate"], row["lo"], row["hi"] = paired_ci(a.to_numpy(), b.to_numpy())
    row["verdict"] = decide(row["lo"], row["hi"], row["n"], claim.margin, claim.side, claim.min_n)
    return row

def verdict_rows(claims: list[Claim], models: dict, root: str | os.PathLike = ".") -> pd.DataFrame:
    "The verdict table, one row per claim and model."
    return pd.DataFrame([evaluate(c, m, p, root) for c in claims for m, p in models.items()])


# %% [markdown]
# A check on a small grid written here: two methods on six prompts, one where `a` wins four and
# loses none, so the paired interval lies above zero; the same rows under another model's name are
# not read for this one.

# %%
import tempfile

with tempfile.TemporaryDirectory() as d:
    grid = pd.DataFrame({"model_name": "m1", "method": ["x"] * 6 + ["y"] * 6, "item": list(range(6)) * 2,
                         "correct": [1, 1, 1, 1, 1, 0] + [0, 0, 0, 0, 1, 0]})
    (Path(d)/"runs"/"p").mkdir(parents=True)
    grid.to_csv(Path(d)/"runs"/"p"/"g.csv", index=False)
    c = parse_claim({"id": "x_vs_y", "paper": "P", "claim": "x ahead of y", "paper_says": "-", "measures": "-",
                     "min_n": 6, "a": {"source": "runs/{profile}/g.csv", "metric": "correct", "item": ["item"],
                                       "where": {"method": "x"}},
                         "b": {"metric": "correct", "item": ["item"], "where": {"method": "y"}}})
    rows = verdict_rows([c], {"m1": ["q", "p"], "m2": ["p"], "m3": ["q"]}, d)
    m1, m2, m3 = rows.to_dict("records")
    assert (m1["n"], m1["estimate"], m1["verdict"]) == (6, 4 / 6, "confirmed") and m1["lo"] > 0, m1
    assert (m2["n"], m2["verdict"], m3["verdict"]) == (0, "not tested", "not tested")
    assert m1["source"] == "runs/p/g.csv" and m3["source"] is None


# %% [markdown]
# ## The table
#
# The markdown table shows, per claim, the paper's number and for each model the estimate, its
# interval, $n$ and the verdict; where both models were tested and their verdicts differ, the
# mechanism's value on each model.

# %%
#| export
def _cell(r: dict) -> str:
    "Estimate [interval], n and verdict, with enough decimals to show the interval's width (3 at least, 6 at most)."
    if r["verdict"] == "not tested": return "not tested"
    if r["n"] < 2: return f"{r['verdict']} (n = {r['n']})"
    width = r["hi"] - r["lo"]
    d = 3 if width >= 0.01 or width <= 0 else min(6, 1 - math.floor(math.log10(width)))
    return f"{r['estimate']:+.{d}f} [{r['lo']:+.{d}f}, {r['hi']:+.{d}f}], n = {r['n']}: **{r['verdict']}**"

def verdicts_markdown(rows: pd.DataFrame, claims: list[Claim]) -> str:
    "The verdict table of `rows` (from `verdict_rows`) as markdown, one line per claim."
    models = list(dict.fromkeys(rows.model))
    label = lambda m: MODEL_LABELS.get(m, m)
    head = ["paper", "claim", "the paper says", "our estimate", *map(label, models), "where the models differ"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in claims:
        rs = {r["model"]: r for r in rows[rows.claim == c.id].to_dict("records")}
        verdicts = {r["verdict"] for r in rs.values() if r["verdict"] not in ("not tested", "pending")}
        differ = ""
        if len(verdicts) > 1 and c.mechanism is not None:
            differ = f"{c.mechanism[0]}: " + ", ".join(f"{rs[m]['mechanism']:.3g} ({label(m)})" for m in models)
        margin = f" (claim: {c.side} {c.margin:g})" if c.margin or c.side != "above" else ""
        lines.append("| " + " | ".join([c.paper, c.claim, c.paper_says, c.measures + margin,
                                          *(_cell(rs[m]) for m in models), differ]).replace("\n", " ") + " |")
    return "\n".join(lines) + "\n"


# %%
assert _cell(dict(verdict="tied", n=16, estimate=-0.00012, lo=-0.00031, hi=0.00007)) == \
    "-0.00012 [-0.00031, +0.00007], n = 16: **tied**"  # an interval 0.0004 wide: five decimals
md = verdicts_markdown(rows, [c])
assert "+0.667 [" in md and "**confirmed**" in md and md.count("not tested") == 2 and md.count("\n") == 3


# %% [markdown]
# Under the table, one generated sentence says what changed with the model: the claims decided on
# every model, those with the same verdict on all, those whose verdicts differ, and those still
# pending somewhere.

# %%
#| export
def agreement_summary(rows: pd.DataFrame) -> str:
    "One paragraph: which claims got the same verdict on every model of `rows`, which differ, which are pending."
    label = lambda m: MODEL_LABELS.get(m, m)
    same, differ, pending, open_ = [], [], [], ("pending", "not tested")
    for claim, g in rows.groupby("claim", sort=False):
        v = dict(zip(g.model, g.verdict))
        if any(x in open_ for x in v.values()):
            pending.append(f"{claim} ({', '.join(f'{label(m)} {x}' for m, x in v.items() if x in open_)})")
        elif len(set(v.values())) == 1: same.append(f"{claim} ({next(iter(v.values()))})")
        else: differ.append(f"{claim} ({', '.join(f'{label(m)} {x}' for m, x in v.items())})")
    say = lambda xs: "; ".join(xs) if xs else "none"
    return (f"Decided on every model: {len(same) + len(differ)} of {len(same) + len(differ) + len(pending)} claims. "
            f"The same verdict on each: {say(same)}. Different verdicts: {say(differ)}. "
            f"Not decided yet: {say(pending)}.")


# %%
s = agreement_summary(pd.DataFrame({"claim": ["a", "a", "b", "b", "c", "c"], "model": ["m1", "m2"] * 3,
                                    "verdict": ["confirmed", "confirmed", "tied", "refuted", "refuted", "pending"]}))
assert s.startswith("Decided on every model: 2 of 3 claims.") and "each: a (confirmed)." in s, s
assert "Different verdicts: b (m1 tied, m2 refuted)." in s and s.endswith("Not decided yet: c (m2 pending).")

# %% [markdown]
# The `verdicts` stage of the pipeline (`reproduce/40_verdicts.ipynb`) writes this table for the
# committed grids to `reproduce/runs/verdicts.md` with the rows beside it (`verdicts.csv`); the
# README shows it, and `tests/test_verdicts.py` recomputes every cell from its grid.
