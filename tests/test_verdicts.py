"""The committed verdict table against its grids: every cell recomputed from the grid it names, and its rules."""
import math
from pathlib import Path

import pandas as pd
import pytest
import yaml

from sparsekv.io import file_sha256
from sparsekv.models import MODEL_LABELS
from sparsekv.stats import paired_ci
from sparsekv.verdicts import decide, load_claims, parse_claim, verdicts_markdown

ROOT = Path(__file__).resolve().parents[1]
CLAIMS = ROOT/"reproduce"/"claims.yaml"
TABLE = ROOT/"reproduce"/"runs"/"verdicts.csv"
RAW = yaml.safe_load(CLAIMS.read_text())
ROWS = pd.read_csv(TABLE, keep_default_na=True).to_dict("records")


def test_table_covers_every_claim_and_model():
    got = {(r["claim"], r["model"]) for r in ROWS}
    want = {(c["id"], m) for c in RAW["claims"] for m in RAW["models"]}
    assert got == want and len(ROWS) == len(want)


def per_item(table: pd.DataFrame, spec: dict) -> dict:
    "The measure `spec` (a claims.yaml mapping) by hand: a loop over rows with a value, summed and counted per item."
    sums = {}
    for r in table.to_dict("records"):
        wanted = all(r[c] in (w if isinstance(w, list) else [w]) for c, w in spec.get("where", {}).items())
        if wanted and not math.isnan(r[spec["metric"]]):
            key = tuple(r[c] for c in spec["item"])
            s, n = sums.get(key, (0.0, 0))
            sums[key] = (s + r[spec["metric"]], n + 1)
    return {k: s / n for k, (s, n) in sums.items()}


@pytest.mark.parametrize("row", ROWS, ids=lambda r: f"{r['claim']}-{r['model']}")
def test_each_cell_recomputes_from_its_grid(row):
    spec = next(c for c in RAW["claims"] if c["id"] == row["claim"])
    profiles = RAW["models"][row["model"]]
    found = [p for p in profiles if (ROOT/spec["a"]["source"].format(profile=p)).is_file()]
    if not found:  # no grid for this model: the row must say so
        assert row["verdict"] == "not tested" and row["n"] == 0 and not isinstance(row["source"], str)
        return
    path = ROOT/spec["a"]["source"].format(profile=found[0])
    assert row["source"] == path.relative_to(ROOT).as_posix()
    assert row["source_sha256"] == file_sha256(path), f"{path} changed after the table: rerun the verdicts stage"
    table = pd.read_csv(path)
    for col in ("model_name", "model"):
        if col in table.columns: table = table[table[col].isin([row["model"], MODEL_LABELS[row["model"]]])]
    a = per_item(table, spec["a"])
    b = per_item(table, spec["b"]) if "b" in spec else {k: 0.0 for k in a}
    keys = sorted(set(a) & set(b))
    assert row["n"] == len(keys)
    if len(keys) >= 2:
        est, lo, hi = paired_ci([a[k] for k in keys], [b[k] for k in keys])
        assert row["estimate"] == pytest.approx(sum(a[k] - b[k] for k in keys) / len(keys), abs=1e-12)
        assert (row["estimate"], row["lo"], row["hi"]) == pytest.approx((est, lo, hi), abs=1e-12)
    margin, side, min_n = spec.get("margin", 0.0), spec.get("side", "above"), spec["min_n"]
    assert row["margin"] == margin and row["side"] == side
    if len(keys) < min_n: want = "not tested" if not keys else "pending"
    else:
        d_lo, d_hi = (row["lo"], row["hi"]) if side == "above" else (-row["hi"], -row["lo"])
        m = margin if side == "above" else -margin
        want = "confirmed" if d_lo > m else "refuted" if d_hi < m else "tied" if margin == 0 else "undecided"
    assert row["verdict"] == want


def test_markdown_is_the_csv():
    models, claims = load_claims(CLAIMS)
    md = (ROOT/"reproduce"/"runs"/"verdicts.md").read_text()
    assert md.endswith(verdicts_markdown(pd.read_csv(TABLE), claims))


@pytest.mark.parametrize("bad, message", [
    (dict(side="left"), "side"), (dict(min_n=1), "min_n"), (dict(margin="0"), "margin"), (dict(extra=1), "extra"),
    (dict(a={"source": "g", "metric": "m", "item": []}), "item"),
    (dict(b={"source": "h", "metric": "m", "item": ["w"]}), "no source"),
    (dict(mechanism={"text": "t"}), "mechanism"), (dict(claim=""), "claim"),
])
def test_bad_claims_are_refused_by_name(bad, message):
    good = {"id": "c1", "paper": "P", "claim": "x", "paper_says": "y", "measures": "z", "min_n": 2,
            "a": {"source": "g", "metric": "m", "item": ["w"]}}
    with pytest.raises((ValueError, TypeError), match=message) as e:
        parse_claim({**good, **bad})
    assert "c1" in str(e.value)


def test_decide_refuses_a_bad_side():
    with pytest.raises(ValueError, match="side"): decide(0.0, 1.0, 10, side="over")
    assert decide(math.nan, math.nan, 0) == "not tested"
