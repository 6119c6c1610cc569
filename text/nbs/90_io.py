# %% [markdown]
# # Files and figures
#
# > Atomic writes, and the one figure style every experiment shares.

# %%
#| default_exp io

# %% [markdown]
# Long runs must never leave a half-written file behind: a figure, a CSV of results or an
# executed notebook is first written to a temporary file *in the same folder* and then
# moved over the destination with `os.replace`, which is atomic on POSIX file systems. A
# run killed mid-write leaves the previous version (or nothing), never a truncated file.

# %%
#| export
from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path

import matplotlib
import pandas as pd


# %%
#| export
def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask

@contextlib.contextmanager
def atomic_path(path: str | os.PathLike):
    "Yield a temporary path beside `path`; move it over `path` only if the block succeeds."
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=f".partial{path.suffix}")
    os.close(fd)
    tmp = Path(tmp)
    os.chmod(tmp, 0o666 & ~_umask())  # mkstemp creates 0600; give the file the usual permissions
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


# %%
#| export
def write_text(path: str | os.PathLike, text: str) -> Path:
    "Write `text` to `path` atomically."
    with atomic_path(path) as tmp: tmp.write_text(text)
    return Path(path)

def write_json(path: str | os.PathLike, obj) -> Path:
    "Write `obj` as indented JSON to `path` atomically."
    return write_text(path, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")

def write_csv(path: str | os.PathLike, df: pd.DataFrame) -> Path:
    "Write `df` (without its index) as CSV to `path` atomically."
    with atomic_path(path) as tmp: df.to_csv(tmp, index=False)
    return Path(path)


# %% [markdown]
# Converted models and tokenized corpora are cached in one folder, `$SPARSEKV_CACHE` when
# set, else the user cache folder (`~/.cache/sparsekv` on Linux).

# %%
#| export
def cache_dir() -> Path:
    "The sparsekv cache folder: `$SPARSEKV_CACHE`, else the user cache folder."
    import platformdirs
    if env := os.environ.get("SPARSEKV_CACHE"): return Path(env).expanduser()
    return Path(platformdirs.user_cache_dir("sparsekv"))


# %% [markdown]
# A check that an interrupted write leaves the old content in place and no temporary file:

# %%
import tempfile as _tf
from fastcore.test import test_eq, test_fail

with _tf.TemporaryDirectory() as d:
    p = Path(d)/"out.txt"
    write_text(p, "old")
    def _interrupted():
        with atomic_path(p) as tmp:
            tmp.write_text("half")
            raise RuntimeError("killed mid-write")
    test_fail(_interrupted, contains="killed mid-write")
    test_eq(p.read_text(), "old")
    test_eq(sorted(x.name for x in Path(d).iterdir()), ["out.txt"])
    test_eq(p.stat().st_mode & 0o777, 0o666 & ~_umask())
    write_json(Path(d)/"sub"/"r.json", {"b": 1, "a": [1, 2]})
    test_eq(json.loads((Path(d)/"sub"/"r.json").read_text()), {"a": [1, 2], "b": 1})


# %% [markdown]
# ## Figures
#
# Every figure is saved with the data behind it, so a reader can re-plot or check a number
# without re-running the experiment: `save_figure(fig, "figures/cpu/name.png", data=df)`
# writes `name.png` and `name.csv` (or `name.json` for a dict).

# %%
#| export
def use_style():
    "Apply the shared plot style (seaborn's whitegrid, a colour-blind palette, readable sizes)."
    import seaborn as sns
    sns.set_theme(context="notebook", style="whitegrid", palette="colorblind")
    matplotlib.rcParams.update({"figure.dpi": 110, "savefig.dpi": 150, "savefig.bbox": "tight",
                                "figure.figsize": (6.4, 4.0), "axes.titleweight": "bold"})

def save_figure(fig, path: str | os.PathLike, data: pd.DataFrame | dict | None = None) -> Path:
    "Save `fig` as PNG at `path` and `data` beside it (`.csv` for a DataFrame, `.json` for a dict), atomically."
    path = Path(path)
    if path.suffix != ".png": raise ValueError(f"path must end in .png, got {str(path)!r}")
    with atomic_path(path) as tmp: fig.savefig(tmp, format="png")
    if isinstance(data, pd.DataFrame): write_csv(path.with_suffix(".csv"), data)
    elif isinstance(data, dict): write_json(path.with_suffix(".json"), data)
    elif data is not None: raise TypeError(f"data must be a DataFrame, a dict or None, got {type(data).__name__}")
    return path


# %%
import matplotlib.pyplot as plt

use_style()
with _tf.TemporaryDirectory() as d:
    fig, ax = plt.subplots()
    ax.plot([0, 1], [0, 1])
    save_figure(fig, Path(d)/"line.png", data=pd.DataFrame({"x": [0, 1], "y": [0, 1]}))
    plt.close(fig)
    test_eq(sorted(x.name for x in Path(d).iterdir()), ["line.csv", "line.png"])
    test_eq((Path(d)/"line.png").read_bytes()[:4], b"\x89PNG")
    test_fail(lambda: save_figure(fig, Path(d)/"line.jpg"), contains="must end in .png")
