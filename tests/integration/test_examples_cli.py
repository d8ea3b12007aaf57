"""The examples' shared command line (examples/cli.py), run as a user runs it."""

import re
import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).parents[2] / "examples"


def run(script: str, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(EXAMPLES / script), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def test_an_example_takes_its_arguments_and_prints_its_result_line():
    done = run("linear_regression.py", "--epochs", "3", "--n", "1500", "--seed", "1")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    line = done.stdout.strip().splitlines()[-1]
    number = r"([-\d.]+)"
    pattern = (
        rf"linear_regression: train_loss {number} -> {number}, valid_loss "
        rf"{number} -> {number}, r2_score {number}, {number} seconds on 1 thread"
    )
    found = re.fullmatch(pattern, line)
    assert found, line
    assert float(found[2]) < float(found[1]) and float(found[5]) > 0.9
    assert len(re.findall(r"^\s*2\s", done.stdout, re.M)) == 1  # 3 epochs: 0, 1, 2


def test_help_lists_each_examples_own_defaults():
    done = run("lenet.py", "--help")
    assert done.returncode == 0
    text = " ".join(done.stdout.split())
    assert "LeNet" in text and "--epochs EPOCHS" in text
    assert "(default: 10)" in text and "(default: 64)" in text


def test_threads_sets_torchs_threads_and_the_result_line_says_how_many():
    one = run("linear_regression.py", "--epochs", "2", "--n", "600")
    two = run("linear_regression.py", "--epochs", "2", "--n", "600", "--threads", "2")
    assert one.returncode == two.returncode == 0, one.stderr[-2000:] + two.stderr
    assert one.stdout.strip().endswith("seconds on 1 thread")
    assert two.stdout.strip().endswith("seconds on 2 threads")
    bad = run("linear_regression.py", "--threads", "0")
    assert bad.returncode == 2 and "must be an int >= 1" in bad.stderr
