"The pipeline's command line runs the demonstration stage of the real pipeline."
import subprocess
import sys
from pathlib import Path

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
