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
import hashlib
import json
import os
import re
import tempfile
from pathlib import Path

import matplotlib
import pandas as pd


# %%
#| export
def _umask() -> int:
    "The process's file mode creation mask (read by setting it and setting it back)."
    mask = os.umask(0)
    os.umask(mask)
    return mask


# %%
import tempfile as _tf

from fastcore.test import test_eq, test_fail

_mask = _umask()
test_eq(os.umask(_mask), _mask)  # unchanged by reading it


# %% [markdown]
# `atomic_path` is checked below: an interrupted write leaves the old content in place and no temporary file.

# %%
#| export
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
with _tf.TemporaryDirectory() as d:
    p = Path(d)/"out.txt"
    p.write_text("old")
    def _interrupted():
        with atomic_path(p) as tmp:
            tmp.write_text("half")
            raise RuntimeError("killed mid-write")
    test_fail(_interrupted, contains="killed mid-write")
    test_eq(p.read_text(), "old")
    test_eq(sorted(x.name for x in Path(d).iterdir()), ["out.txt"])
    test_eq(p.stat().st_mode & 0o777, 0o666 & ~_umask())


# %%
#| export
def write_text(path: str | os.PathLike, text: str) -> Path:
    "Write `text` to `path` atomically."
    with atomic_path(path) as tmp: tmp.write_text(text)
    return Path(path)


# %%
with _tf.TemporaryDirectory() as d:
    test_eq(write_text(Path(d)/"sub"/"t.txt", "x").read_text(), "x")  # its folder made on the way


# %%
#| export
def write_json(path: str | os.PathLike, obj) -> Path:
    "Write `obj` as indented JSON to `path` atomically."
    return write_text(path, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


# %%
with _tf.TemporaryDirectory() as d:
    write_json(Path(d)/"sub"/"r.json", {"b": 1, "a": [1, 2]})
    test_eq(json.loads((Path(d)/"sub"/"r.json").read_text()), {"a": [1, 2], "b": 1})


# %%
#| export
def write_csv(path: str | os.PathLike, df: pd.DataFrame) -> Path:
    "Write `df` (without its index) as CSV to `path` atomically."
    with atomic_path(path) as tmp: df.to_csv(tmp, index=False)
    return Path(path)


# %%
with _tf.TemporaryDirectory() as d:
    test_eq(write_csv(Path(d)/"t.csv", pd.DataFrame({"a": [1, 2]}, index=[5, 6])).read_text(), "a\n1\n2\n")


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


# %%
_old = os.environ.get("SPARSEKV_CACHE")
os.environ["SPARSEKV_CACHE"] = "~/elsewhere"
test_eq(cache_dir(), Path.home()/"elsewhere")
if _old is None: del os.environ["SPARSEKV_CACHE"]
else: os.environ["SPARSEKV_CACHE"] = _old


# %% [markdown]
# ## Digests
#
# An atomic write protects a file from an interrupted writer, not from what happens to it afterwards: a disk
# error, a stray write or a hand edit changes bytes and keeps the name. `torch.load` of such a file can still
# succeed (a zeroed run of bytes inside a tensor is a valid tensor), so weights or an optimizer state load
# silently wrong. A file we load later is therefore written with its SHA-256 digest beside it,
# `NAME.sha256` (the `sha256sum` format, so `sha256sum -c NAME.sha256` checks it too), and checked against
# it before it is read. A mismatch is a `DamagedFileError` naming the file, the digest recorded and the digest
# found, and what rebuilds the file.
#
# The file and its digest are two renames, and a process can be killed between them. So while a new version
# is moved into place the digest file records both the old digest and the new one (`previous`), and only
# then the new one alone: a file that matches either is one of the two complete versions, and a damaged
# file matches neither.

# %%
#| export
class DamagedFileError(OSError):
    "A file whose bytes do not match the digest recorded beside it (or inside its manifest)."


# %%
assert issubclass(DamagedFileError, OSError)  # a file problem: callers that catch OSError see it


# %%
#| export
def file_sha256(path: str | os.PathLike) -> str:
    "The SHA-256 of the file at `path`, in hex, read in 4 MiB blocks."
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22): h.update(block)
    return h.hexdigest()


# %%
with _tf.TemporaryDirectory() as d:
    (Path(d)/"w.bin").write_bytes(b"x" * (5 << 20))  # more than one block
    test_eq(file_sha256(Path(d)/"w.bin"), hashlib.sha256(b"x" * (5 << 20)).hexdigest())

# %% [markdown]
# The digest file holds one `<sha256>  NAME` line, and during a replacement a second one after a `# previous` line.

# %%
#| export
DIGEST_SUFFIX = ".sha256"


def digest_path(path: str | os.PathLike) -> Path:
    "Where the digest of `path` is kept: `NAME.sha256` beside it."
    path = Path(path)
    return path.with_name(path.name + DIGEST_SUFFIX)


# %%
test_eq(digest_path("runs/w.bin"), Path("runs/w.bin.sha256"))


# %%
#| export
def read_digests(path: str | os.PathLike) -> list[str] | None:
    "The digests `path`'s digest file accepts (the current first), or None when it has no digest file."
    try: lines = digest_path(path).read_text(encoding="ascii").split("\n")
    except FileNotFoundError: return None
    except (OSError, UnicodeDecodeError) as e: raise DamagedFileError(f"cannot read {digest_path(path)} ({e})") from e
    digests = [line.split()[0] for line in lines if line.strip() and not line.startswith("#")]
    if not digests or not all(re.fullmatch(r"[0-9a-f]{64}", d) for d in digests):
        raise DamagedFileError(f"{digest_path(path)} is not a digest file (lines '<sha256>  {Path(path).name}')")
    return digests


# %%
with _tf.TemporaryDirectory() as d:
    p, a, b = Path(d)/"w.bin", "a" * 64, "b" * 64
    test_eq((digest_path(p), read_digests(p)), (Path(d)/"w.bin.sha256", None))
    digest_path(p).write_text(f"{a}  w.bin\n# previous\n{b}  w.bin\n")
    test_eq(read_digests(p), [a, b])
    digest_path(p).write_text("not a digest\n")
    test_fail(lambda: read_digests(p), contains="is not a digest file")


# %% [markdown]
# Writing: `atomic_path_with_digest` is `atomic_path` followed by the digest of what was written. `record_digest`
# records the digest of a file as it is now (a file one trusts that an older version wrote without one).
#
# The checks: the digest file names the file's digest; killed between the file's rename and the digest's, the digest file
# accepts both versions, so whichever of the two the file holds is accepted; `record_digest` writes the same line.

# %%
#| export
@contextlib.contextmanager
def atomic_path_with_digest(path: str | os.PathLike):
    "`atomic_path`, then the digest of what was written beside it (`NAME.sha256`); both survive a kill in between."
    path, name = Path(path), Path(path).name
    with atomic_path(path) as tmp:
        yield tmp
        try: old = (read_digests(path) or [None])[0] if path.exists() else None
        except DamagedFileError: old = None  # an unreadable digest file is replaced, not a reason to lose the write
        new = file_sha256(tmp)
        # between the two renames both versions are accepted: the old digest is the one recorded, never recomputed
        write_text(digest_path(path), f"{new}  {name}\n" + (f"# previous\n{old}  {name}\n" if old else ""))
    write_text(digest_path(path), f"{new}  {name}\n")


# %%
_tmp = _tf.TemporaryDirectory()
d = _tmp.name
p = Path(d)/"w.bin"
with atomic_path_with_digest(p) as tmp: tmp.write_bytes(b"first version")
test_eq(digest_path(p).read_text(), f"{hashlib.sha256(b'first version').hexdigest()}  w.bin\n")
def _killed_between():
    with atomic_path(p) as tmp:  # what atomic_path_with_digest does, killed after the file's rename
        tmp.write_bytes(b"second")
        old = read_digests(p)[0]
        write_text(digest_path(p), f"{file_sha256(tmp)}  w.bin\n# previous\n{old}  w.bin\n")
    raise KeyboardInterrupt
test_fail(_killed_between, exc=KeyboardInterrupt)
test_eq((p.read_bytes(), file_sha256(p) in read_digests(p)), (b"second", True))
test_eq(read_digests(p)[1], hashlib.sha256(b"first version").hexdigest())


# %%
#| export
def record_digest(path: str | os.PathLike) -> Path:
    "Record the digest of `path` as it is now beside it (for a file you trust that was written without one)."
    return write_text(digest_path(path), f"{file_sha256(path)}  {Path(path).name}\n")


# %%
written = digest_path(p).read_text().splitlines()[0] + "\n"
record_digest(p)
test_eq(digest_path(p).read_text(), written)
_tmp.cleanup()


# %% [markdown]
# Reading: `verify_digest` checks a file against its digest file, or against digests recorded elsewhere (a manifest).
#
# The check: a file written with its digest verifies; one byte changed (size and modification time kept, so no listing
# shows it) is refused naming the file, both digests and what rebuilds it; a file without a digest file reports False
# (the caller decides what an unverified file means); digests given by the caller are checked the same way.

# %%
#| export
def verify_digest(path: str | os.PathLike, rebuild: str, digests: list[str] | None = None,
                  recorded_in: str | os.PathLike | None = None) -> bool:
    """Check the file at `path` against `digests` recorded in `recorded_in` (default: its digest file): True if it
    matches, False when no digest is recorded; a mismatch raises a `DamagedFileError` naming the file, the digest
    expected and found, and what rebuilds it (`rebuild`)."""
    path = Path(path)
    if digests is None: digests, recorded_in = read_digests(path), digest_path(path)
    if digests is None: return False
    found = file_sha256(path)
    if found in digests: return True
    raise DamagedFileError(f"{path} is damaged: its SHA-256 is {found}, expected {digests[0]} (recorded in "
                           f"{recorded_in}); {rebuild}")


# %%
with _tf.TemporaryDirectory() as d:
    p = Path(d)/"w.bin"
    with atomic_path_with_digest(p) as tmp: tmp.write_bytes(b"first version")
    test_eq(verify_digest(p, "rebuild it"), True)
    st = p.stat()
    with open(p, "r+b") as f: f.seek(3); f.write(b"X")
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))
    test_eq((p.stat().st_size, p.stat().st_mtime_ns), (st.st_size, st.st_mtime_ns))
    want = hashlib.sha256(b"first version").hexdigest()
    test_fail(lambda: verify_digest(p, "rebuild it"), exc=DamagedFileError,
              contains=f"{p} is damaged: its SHA-256 is {file_sha256(p)}, expected {want} (recorded in "
                       f"{digest_path(p)}); rebuild it")
    test_fail(lambda: verify_digest(p, "re-install", [want], "manifest.json"), contains="(recorded in manifest.json)")
    test_eq(verify_digest(p, "re-install", [file_sha256(p)], "manifest.json"), True)
    (Path(d)/"plain.bin").write_bytes(b"x")
    test_eq(verify_digest(Path(d)/"plain.bin", "rebuild it"), False)
    record_digest(Path(d)/"plain.bin")
    test_eq(verify_digest(Path(d)/"plain.bin", "rebuild it"), True)


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


# %%
use_style()
test_eq((matplotlib.rcParams["savefig.dpi"], matplotlib.rcParams["figure.figsize"]), (150, [6.4, 4.0]))


# %%
#| export
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
