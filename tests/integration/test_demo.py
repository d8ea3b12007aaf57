"""``make demo`` works: the digits example trains well and writes its plots."""

import re
import subprocess
import sys
from pathlib import Path

DEMO = Path(__file__).parents[2] / "examples" / "demo_digits.py"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_demo_reaches_95_percent_and_saves_both_plots(tmp_path):
    result = subprocess.run(
        [sys.executable, str(DEMO)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "accuracy" in result.stdout
    reported = re.search(r"final validation accuracy: ([\d.]+)%", result.stdout)
    assert reported and float(reported[1]) >= 95
    for name in ("demo_losses.png", "demo_lr.png"):
        path = (tmp_path / name).resolve()
        png = path.read_bytes()
        assert png.startswith(PNG_SIGNATURE) and len(png) > len(PNG_SIGNATURE), name
        assert str(path) in result.stdout
