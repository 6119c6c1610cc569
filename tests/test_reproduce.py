"The pipeline's command line runs the demonstration stage of the real pipeline."
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_notebook

import sparsekv.reproduce as rp
from sparsekv.reproduce import find_pipeline, load_stages

ROOT = find_pipeline(Path(__file__).parent).parent.parent


def test_every_stage_loads_for_every_profile():
    for profile in ("quick", "cpu", "gpu"):
        stages = load_stages(ROOT/"reproduce"/"pipeline.yaml", profile)
        assert stages and all(s.notebook.is_file() and s.outputs for s in stages)


def test_cli_runs_demo_stage_quick():
    cmd = [sys.executable, "-m", "sparsekv.reproduce", "--profile", "quick", "--only", "demo", "--force"]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.startswith("[1/1] demo: "), res.stdout
    outputs = res.stdout[res.stdout.index("Outputs:"):]
    assert re.search(r"^demo +ran in \d+ s$", outputs, re.M), outputs  # the table of stages
    for out in load_stages(ROOT/"reproduce"/"pipeline.yaml", "quick")[0].outputs:
        assert out.is_file(), out
        assert f"  {out.relative_to(ROOT).as_posix()}\n" in outputs  # where every output went, relative
    assert "summary: reproduce/runs/quick/summary.md" in outputs
    summary = (ROOT/"reproduce"/"runs"/"quick"/"summary.md").read_text()
    assert "| demo | ran in" in summary and "Random Gaussian attention" in summary
    executed = (ROOT/"reproduce"/"runs"/"quick"/"demo.ipynb").read_text()
    assert str(ROOT) not in executed and '"papermill"' not in executed and '"iopub.' not in executed


def test_cli_rejects_unknown_stage():
    res = subprocess.run([sys.executable, "-m", "sparsekv.reproduce", "--profile", "quick", "--only", "nope"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode != 0 and "only must name a stage" in res.stderr


# --- stage bookkeeping and pipeline files ----------------------------------------------


def toy_project(root, bodies):
    "A throw-away project: one stage per (name, body, outputs), parameter n = 1 in every profile."
    (root / "reproduce").mkdir()
    yaml = ["stages:"]
    for name, body, outputs in bodies:
        nb = new_notebook(cells=[new_code_cell("#| parameters\nprofile = 'quick'\nfig_dir = out_dir = '.'\nn = 1"),
                                 new_code_cell("from pathlib import Path\n" + body)])
        nbformat.write(nb, root / "reproduce" / f"{name}.ipynb")
        yaml += [f"  {name}:", f"    notebook: reproduce/{name}.ipynb",
                 "    params: {quick: {n: 1}, cpu: {n: 1}, gpu: {n: 1}}", f"    outputs: {outputs!r}"]
    (root / "reproduce" / "pipeline.yaml").write_text("\n".join(yaml) + "\n")
    return root / "reproduce" / "pipeline.yaml"


TWO = [("a", "Path(fig_dir, 'a.txt').write_text(str(n))", ["figures/{profile}/a.txt"]),
       ("b", "Path(fig_dir, 'b.txt').write_text(str(n))", ["figures/{profile}/b.txt"])]


def summary_rows(root):
    text = (root / "reproduce" / "runs" / "quick" / "summary.md").read_text()
    return {line.split("|")[1].strip(): line.split("|")[2].strip()
            for line in text.splitlines() if line.startswith("| ") and "---" not in line}


def test_forced_stage_killed_between_outputs_is_redone(tmp_path):
    body = ("Path(fig_dir, 'one.txt').write_text(open(Path(fig_dir).parent.parent / 'run_id').read())\n"
            "assert not Path(fig_dir, 'die').exists(), 'killed between outputs'\n"
            "Path(fig_dir, 'two.txt').write_text(open(Path(fig_dir).parent.parent / 'run_id').read())")
    pipe = toy_project(tmp_path, [("s", body, ["figures/{profile}/one.txt", "figures/{profile}/two.txt"])])
    figs = tmp_path / "figures" / "quick"
    (tmp_path / "run_id").write_text("first")
    rp.run_pipeline("quick", pipeline=pipe, progress=False)
    (tmp_path / "run_id").write_text("second")
    (figs / "die").touch()
    with pytest.raises(rp.StageFailed): rp.run_pipeline("quick", force=True, pipeline=pipe, progress=False)
    (figs / "die").unlink()
    (tmp_path / "run_id").write_text("third")
    assert rp.run_pipeline("quick", pipeline=pipe, progress=False)["s"].startswith("ran")
    assert (figs / "one.txt").read_text() == (figs / "two.txt").read_text() == "third"


def test_input_edited_during_the_run_stales_the_stage(tmp_path):
    "The stamp holds the inputs as the run read them: an input edited while the stage ran leaves it stale."
    body = "Path(fig_dir, 'a.txt').write_text('x')\nPath(fig_dir).parent.parent.joinpath('data.txt').write_text('new')"
    pipe = toy_project(tmp_path, [("a", body, ["figures/{profile}/a.txt"])])
    pipe.write_text(pipe.read_text() + "    inputs: [data.txt]\n")
    (tmp_path / "data.txt").write_text("old")
    rp.run_pipeline("quick", pipeline=pipe, progress=False)
    assert (tmp_path / "data.txt").read_text() == "new"
    assert rp.run_pipeline("quick", pipeline=pipe, progress=False)["a"].startswith("ran")  # not "up to date"


def test_only_and_interrupt_keep_other_stages_state(tmp_path, monkeypatch):
    pipe = toy_project(tmp_path, TWO)
    rp.run_pipeline("quick", pipeline=pipe, progress=False)
    rp.run_pipeline("quick", only="b", force=True, pipeline=pipe, progress=False)
    rows = summary_rows(tmp_path)
    assert rows["a"].startswith("up to date (made ") and rows["b"].startswith("ran in"), rows

    def interrupted(stage, *args, **kwargs): raise KeyboardInterrupt
    monkeypatch.setattr(rp, "run_stage", interrupted)
    with pytest.raises(KeyboardInterrupt): rp.run_pipeline("quick", force=True, pipeline=pipe, progress=False)
    rows = summary_rows(tmp_path)
    assert rows["a"].startswith("interrupted") and rows["b"].startswith("up to date (made "), rows
    (tmp_path / "figures" / "quick" / "b.txt").unlink()
    rp.write_summary(tmp_path, "quick", rp.load_stages(pipe, "quick"), {})
    assert summary_rows(tmp_path)["b"] == "stale: missing b.txt"


def test_temporary_notebooks_are_unique_per_run(tmp_path, monkeypatch):
    import papermill
    pipe = toy_project(tmp_path, TWO[:1])
    seen, real = [], papermill.execute_notebook

    def recording(src, dest, **kw):
        seen.append((os.path.basename(src), os.path.basename(dest)))
        return real(src, dest, **kw)
    monkeypatch.setattr(papermill, "execute_notebook", recording)
    for _ in range(2): rp.run_pipeline("quick", force=True, pipeline=pipe, progress=False)
    sources = {s for s, _ in seen}
    assert len(sources) == 2 and len({d for _, d in seen}) == 2 and ".a.input.ipynb" not in sources
    assert not list((tmp_path / "reproduce" / "runs" / "quick").glob(".*.ipynb"))


def test_sigterm_cleans_up_like_ctrl_c(tmp_path):
    body = "import os, time\nPath(fig_dir, 'kernel_pid').write_text(str(os.getpid()))\ntime.sleep(120)"
    pipe = toy_project(tmp_path, [("slow", body, ["figures/{profile}/never.txt"])])
    proc = subprocess.Popen([sys.executable, "-m", "sparsekv.reproduce", "--profile", "quick", "--pipeline", str(pipe)],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pid_file, t0 = tmp_path / "figures" / "quick" / "kernel_pid", time.time()
    while not pid_file.exists() and time.time() - t0 < 120 and proc.poll() is None: time.sleep(0.2)
    assert pid_file.exists(), proc.communicate()[1][-2000:]
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-2000:]
    # the runner's last word (the kernel, dying beside it, may log its own interruption after it, on a busy machine)
    assert any(line.startswith("sparsekv-reproduce: interrupted") for line in err.splitlines()), err[-2000:]
    # no traceback of the runner
    assert "reproduce.py" not in err, err[-2000:]
    kernel, t0 = int(pid_file.read_text()), time.time()
    while os.path.exists(f"/proc/{kernel}") and time.time() - t0 < 30: time.sleep(0.2)
    assert not os.path.exists(f"/proc/{kernel}"), "the notebook's kernel outlived the runner"
    out_dir = tmp_path / "reproduce" / "runs" / "quick"
    assert not list(out_dir.glob(".*.ipynb")) and not (out_dir / ".stamps" / "slow.json").exists()
    assert summary_rows(tmp_path)["slow"].startswith("interrupted")


@pytest.mark.parametrize("text,msg", [
    ("", "found an empty file"),
    ("# only a comment\n", "found an empty file"),
    ("stages: []\n", "must hold `stages:`"),
    ("stages: {a: [1\n", "is not valid YAML"),
    ("stages:\n  a: [1, 2]\n", "must be a mapping with notebook"),
    ("stages:\n  a: {notebook: reproduce/a.ipynb, params: {quick: {n: 1}}}\n", "lacks ['outputs']"),
    ("stages:\n  a: {notebook: reproduce/a.ipynb, params: [1], outputs: []}\n", "params must map profiles"),
    ("stages:\n  a: {notebook: reproduce/a.ipynb, params: {quick: {n: 1}}, outputs: figures/a.txt}\n",
     "outputs must be a list"),
    ("stages:\n  a: {notebook: reproduce/a.ipynb, params: {quick: {n: 1}}, outputs: ['figures/{prof}/a.txt']}\n",
     "may use only {profile}"),
    ("- a\n- b\n", "must hold `stages:`"),
    ("stages:\n  a: {notebook: reproduce/a.ipynb, params: {quick: {n: 1}}, outputs: []}\nstage: {}\n",
     "unknown top-level key(s) ['stage']"),
    ("stages:\n  a: {notebok: reproduce/a.ipynb, notebook: reproduce/a.ipynb, params: {quick: {n: 1}}, outputs: []}\n",
     "unknown key(s) ['notebok']"),
    ("stages:\n  a: {params: {quick: {n: 1}}, outputs: []}\n", "lacks ['notebook']"),
    ("stages:\n  a: {notebook: reproduce/a.ipynb, params: {quik: {n: 1}}, outputs: []}\n",
     "unknown profile(s) ['quik']"),
    ("stages:\n  a: {notebook: reproduce/a.ipynb, params: {quick: {m: 1}}, outputs: []}\n",
     "params.quick: m is not a parameter of the notebook"),
    ("stages:\n  a: {notebook: reproduce/a.ipynb, params: {quick: {n: '1'}}, outputs: []}\n",
     "params.quick: n must be like the notebook's default 1 (int), got '1'"),
    ("stages:\n  a: {notebook: reproduce/a.ipynb, params: {quick: {n: [1, 2]}}, outputs: []}\n",
     "params.quick: n must be like the notebook's default 1"),
    ("stages:\n  a: {notebook: reproduce/a.ipynb, params: {quick: {out_dir: x}}, outputs: []}\n",
     "out_dir is set by the runner"),
    ("stages:\n  a: {notebook: reproduce/a.ipynb, params: {quick: {n: 1}}, outputs: ['figures/{profile}/a.png'],\n"
     "      captions: {'figures/{profile}/b.png': Fig. 1}}\n", "captions names 'figures/{profile}/b.png'"),
    ("stages:\n  a: {notebook: reproduce/a.ipynb, params: {quick: {n: 1}}, outputs: ['figures/{profile}/a.csv'],\n"
     "      captions: {'figures/{profile}/a.csv': Table 1}}\n", "which is not a PNG among its outputs"),
    ("stages:\n  a: {notebook: reproduce/a.ipynb, params: {quick: {n: 1}}, outputs: ['figures/{profile}/a.png'],\n"
     "      captions: {'figures/{profile}/a.png': [Fig. 1]}}\n", "must be one line of text"),
    ("stages:\n  a: {notebook: reproduce/a.ipynb, params: {quick: {n: 1}}, outputs: ['figures/{profile}/a.png'],\n"
     "      captions: [Fig. 1]}\n", "captions must map output PNGs"),
    ("stages:\n  a: {notebook: reproduce/a.ipynb, params: {quick: {n: 1}}, outputs: []}\n"
     "  a: {notebook: reproduce/a.ipynb, params: {quick: {n: 2}}, outputs: []}\n", "key 'a' given twice"),
    ("stages:\n  a: {notebook: reproduce/a.ipynb, params: {quick: {n: 1}}, outputs: []\n", "is not valid YAML"),
    ("\tstages: {}\n", "is not valid YAML"),
])
def test_malformed_pipeline_file_is_a_clear_error(tmp_path, text, msg):
    pipe = toy_project(tmp_path, TWO[:1])
    pipe.write_text(text)
    with pytest.raises(ValueError) as e: rp.load_stages(pipe, "quick")
    assert msg in str(e.value) and str(pipe) in str(e.value)
    res = subprocess.run([sys.executable, "-m", "sparsekv.reproduce", "--profile", "quick", "--pipeline", str(pipe)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "Traceback" not in res.stderr and msg in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr


def test_cli_user_errors_are_one_line(tmp_path):
    cmd = [sys.executable, "-m", "sparsekv.reproduce", "--pipeline", str(tmp_path / "nope.yaml"), "--list"]
    res = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "Traceback" not in res.stderr and "nope.yaml" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


def test_params_may_be_null_or_int_for_float(tmp_path):
    "None stands for any default, an int for a float; a caption naming a PNG output is kept by path."
    pipe = toy_project(tmp_path, TWO[:1])
    nb = tmp_path / "reproduce" / "a.ipynb"
    nb.write_text(nb.read_text().replace("n = 1", "n = 1\\nlr = 0.5\\nk = None"))
    pipe.write_text("stages:\n  a:\n    notebook: reproduce/a.ipynb\n"
                    "    params: {quick: {n: null, lr: 1, k: [1, 2]}}\n    outputs: ['figures/{profile}/a.png']\n"
                    "    captions: {'figures/{profile}/a.png': '  Fig. 3 of the paper  '}\n")
    (stage,) = rp.load_stages(pipe, "quick")
    assert stage.params == {"n": None, "lr": 1, "k": [1, 2]}
    assert stage.captions == {tmp_path / "figures" / "quick" / "a.png": "Fig. 3 of the paper"}


# --- progress, estimates and the report at the end ----------------------------------------------


def test_estimates_come_from_the_last_run(tmp_path, capsys):
    pipe = toy_project(tmp_path, TWO)
    rp.run_pipeline("quick", pipeline=pipe)
    first = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[")]
    assert first[0].startswith("[1/2] a: no estimate yet, no estimate yet for the run"), first
    stamps = {s: json.loads((tmp_path / "reproduce/runs/quick/.stamps" / f"{s}.json").read_text()) for s in "ab"}
    assert all(st["seconds"] > 0 for st in stamps.values())
    # each stamp names the stage's slowest cells, each timed within the stage's wall time
    assert all(0 < len(st["slowest_cells"]) and 0 <= st["slowest_cells"][0]["seconds"] <= st["seconds"]
               for st in stamps.values()), stamps
    rp.run_pipeline("quick", pipeline=pipe)
    assert [line for line in capsys.readouterr().out.splitlines() if line.startswith("[")] == [
        "[1/2] a: up to date, skipped", "[2/2] b: up to date, skipped"]
    rp.run_pipeline("quick", force=True, pipeline=pipe)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[")]
    secs = rp.format_duration(stamps["a"]["seconds"])
    assert lines[0].startswith(f"[1/2] a: expected {secs}, ") and lines[0].endswith("left for the run (forced)")
    left = rp.format_duration(stamps["a"]["seconds"] + stamps["b"]["seconds"])
    assert f", {left} left for the run" in lines[0], lines


def test_a_run_copied_elsewhere_stays_up_to_date(tmp_path):
    "Stamps name paths relative to the repository: a committed run holds in a clone at another path."
    (tmp_path / "one").mkdir()
    pipe = toy_project(tmp_path / "one", TWO)
    rp.run_pipeline("quick", pipeline=pipe, progress=False)
    shutil.copytree(tmp_path / "one", tmp_path / "two")
    st = rp.run_pipeline("quick", pipeline=tmp_path / "two" / "reproduce" / "pipeline.yaml", progress=False)
    assert set(st.values()) == {"up to date (skipped)"}, st
    stamp = (tmp_path / "two" / "reproduce/runs/quick/.stamps/a.json").read_text()
    assert str(tmp_path) not in stamp and '"reproduce/a.ipynb"' in stamp


def test_report_names_every_output_and_each_stage(tmp_path):
    pipe = toy_project(tmp_path, TWO)
    status = rp.run_pipeline("quick", only="a", pipeline=pipe, progress=False)
    text = rp.report(pipe, "quick", status)
    assert "a:\n  figures/quick/a.txt\n  reproduce/runs/quick/a.ipynb\n" in text and "b.txt" not in text
    assert re.search(r"^a +ran in \d+ s$", text, re.M) and re.search(r"^b +not run$", text, re.M), text


# --- executed notebooks fit to commit -------------------------------------------------------------


def test_executed_notebook_has_no_noise(tmp_path):
    body = ("import os, sys, warnings\nfrom tqdm.auto import tqdm\n"
            "print('tqdm disabled:', os.environ.get('TQDM_DISABLE'))\n"
            "print('wrote', Path(fig_dir, 'a.txt').resolve())\n"
            "Path(fig_dir, 'a.txt').write_text('1')\n"
            "warnings.warn('a warning')\nprint('to stderr', file=sys.stderr)\n"
            "for _ in tqdm(range(3)): pass\n"
            "Path(fig_dir).resolve()")
    pipe = toy_project(tmp_path, [("a", body, ["figures/{profile}/a.txt"])])
    rp.run_pipeline("quick", pipeline=pipe, progress=False)
    nb = nbformat.read(tmp_path / "reproduce/runs/quick/a.ipynb", as_version=4)
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    streams = [o for o in outputs if o.output_type == "stream"]
    assert {o.name for o in streams} == {"stdout"}, outputs  # no warning, no progress bar
    assert "".join(o.text for o in streams) == "tqdm disabled: 1\nwrote figures/quick/a.txt\n"
    assert outputs[-1].data["text/plain"] == "PosixPath('figures/quick')"
    assert str(tmp_path) not in nbformat.writes(nb) and "papermill" not in nb.metadata
    assert not [c.metadata for c in nb.cells if set(c.metadata) - {"tags"}]  # no timings
    assert 'fig_dir = "figures/quick"' in "\n".join(c.source for c in nb.cells)  # the injected parameters, relative


def test_gitignore_keeps_the_cpu_run_and_nothing_else():
    if shutil.which("git") is None or not (ROOT / ".git").exists(): pytest.skip("not a git checkout")
    kept = ["demo.ipynb", "demo.md", "summary.md", ".stamps/demo.json"]
    ignored = [".stamps/.demo.x1.partial.json", ".demo.x1.input.ipynb", ".demo.x1.partial.ipynb",
               ".summary.x1.partial.md", "demo.failed.ipynb", "oval_tasks_grid.csv", ".oval_tasks_grid.x1.partial.csv",
               "kvpop_distill/kvpop_mlp_S512_cr0.75_abc/state.pt", "kvpop_distill/notes.md"]
    paths = [f"reproduce/runs/cpu/{p}" for p in kept + ignored] + ["reproduce/runs/quick/demo.ipynb",
                                                                   "reproduce/runs/gpu/summary.md"]
    res = subprocess.run(["git", "check-ignore", "--no-index", *paths], cwd=ROOT, capture_output=True, text=True)
    assert set(res.stdout.split()) == set(paths[len(kept):]), res.stdout


def test_failing_stage_prints_its_traceback_then_one_line(tmp_path):
    pipe = toy_project(tmp_path, [("a", "def f(): raise ValueError('boom')\nf()", [])])
    res = subprocess.run([sys.executable, "-m", "sparsekv.reproduce", "--profile", "quick", "--pipeline", str(pipe)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert res.returncode == 1
    assert "ValueError: boom" in res.stderr and "raise ValueError('boom')" in res.stderr, res.stderr[-3000:]
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("stage 'a' failed: PapermillExecutionError; executed notebook:"), last
