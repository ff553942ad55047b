"""The CLI ends with one line, never a traceback: on a closed pipe
(`plan ... | true`), a full disk (`> /dev/full`), and on an out-of-range number,
which argparse names by flag before the command prints anything."""
import os
import subprocess
import sys

import pytest

from mla_ext.cli import main
from mla_ext.demo import run_demo
from test_cli import PLAN

CMD = [sys.executable, "-m", "mla_ext", *PLAN]


def _one_error_line(stderr: str, what: str) -> None:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and what in lines[0] and "Traceback" not in stderr, stderr


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_full_disk_is_one_line():
    with open("/dev/full", "w") as full:
        r = subprocess.run(CMD, stdout=full, stderr=subprocess.PIPE, text=True, timeout=120)
    assert r.returncode == 1
    _one_error_line(r.stderr, "error: cannot write the output: [Errno 28] No space left on device")


def test_a_closed_pipe_is_one_line():
    p = subprocess.Popen(CMD, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    p.stdout.close()  # the reader is gone before the plan is written (`| true`)
    err = p.stderr.read()
    assert p.wait(timeout=120) == 1
    _one_error_line(err, "error: cannot write the output: [Errno 32] Broken pipe")


@pytest.mark.parametrize("run, argv, what", [
    (run_demo, ["--tiny", "--seed", str(10**23)], "argument --seed: expected an integer in [0, 4294967295]"),
    (run_demo, ["--tiny", "--seed", "-1"], "argument --seed"),
    (main, ["plan", "--memory", "1GiB", "--block-size", str(10**23)], "argument --block-size: expected an integer"),
    (main, ["plan", "--memory", "1GiB", "--block-size", "0"], "argument --block-size: expected an integer in [1,"),
    (main, ["plan", "--memory", "1GiB", "--alignment", "1e30"], "argument --alignment: expected an integer"),
    (main, ["plan"], "the following arguments are required: --memory"),
])
def test_out_of_range_numbers_are_named_by_flag_before_any_output(run, argv, what, capsys):
    with pytest.raises(SystemExit) as e:
        run(argv)
    out, err = capsys.readouterr()
    assert e.value.code == 2 and out == ""
    _one_error_line(err, what)
