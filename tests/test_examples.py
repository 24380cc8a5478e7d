import runpy
from pathlib import Path

EXAMPLES = Path(__file__).parents[1] / "examples"


def test_api_tour_runs(capsys):
    runpy.run_path(str(EXAMPLES / "api_tour.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert "unmerge restores weights bit for bit: True" in out
    assert out.count("max |Δlogits| = 0.00e+00") == 2
