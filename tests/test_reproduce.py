"The pipeline's command line runs the demonstration stage of the real pipeline."
import os
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
    assert "demo: ran in" in res.stdout
    for out in load_stages(ROOT/"reproduce"/"pipeline.yaml", "quick")[0].outputs:
        assert out.is_file(), out
    summary = (ROOT/"reproduce"/"runs"/"quick"/"summary.md").read_text()
    assert "| demo | ran in" in summary and "Random Gaussian attention" in summary


def test_cli_rejects_unknown_stage():
    res = subprocess.run([sys.executable, "-m", "sparsekv.reproduce", "--profile", "quick", "--only", "nope"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode != 0 and "only must name a stage" in res.stderr


# --- stage bookkeeping and pipeline files (issue 12, items 5 and 7) ----------------------------------------------


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
    assert err.strip().splitlines()[-1].startswith("sparsekv-reproduce: interrupted"), err[-2000:]
    # no traceback of the runner (the kernel may log its own interruption)
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
