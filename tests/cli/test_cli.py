"""`python -m mla_ext {plan,info,demo}`: mostly through cli.main(argv), once as a subprocess."""
import json
import subprocess
import sys
import types

import pytest

from mla_ext import cli
from mla_ext.cli import main, parse_memory

PLAN = ["plan", "--model", "deepseek-v3", "--kv-cache-dtype", "fp8_ds_mla",
        "--skip-layers", "0", "1", "60", "--block-size", "64", "--memory", "60GiB"]


def run(capsys, argv):
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("text,value", [
    ("60GiB", 60 * 2**30), ("500MB", 500 * 10**6), ("123", 123), ("1.5GiB", 3 * 2**29),
    ("2 kib", 2048), ("7B", 7), ("1TB", 10**12), ("3MiB", 3 * 2**20),
])
def test_parse_memory(text, value):
    assert parse_memory(text) == value


@pytest.mark.parametrize("text", ["", "GiB", "60 GiBs", "-5", "1e9", "60G", "0", "0.1B"])
def test_parse_memory_errors(text):
    with pytest.raises(ValueError, match="--memory"):
        parse_memory(text)


def test_plan_table(capsys):
    rc, out, err = run(capsys, PLAN)
    assert rc == 0 and err == ""
    rows = [line.split() for line in out.splitlines() if line[:1].isdigit()]
    assert [r[0] for r in rows] == ["0-1", "2-59", "60"]
    assert "fp8_ds_mla" in rows[1] and "FP8_PER_TILE" in rows[1] and "41,984" in rows[1]
    assert "73,728" in rows[0] and "NONE" in rows[0]
    assert "24,253" in out and "1,552,192" in out and "64,424,509,440" in out


def test_plan_json(capsys):
    rc, out, _ = run(capsys, PLAN + ["--json"])
    d = json.loads(out)
    assert rc == 0 and d["num_blocks"] == 24_253 and d["budget"] == 60 * 2**30
    assert [x["format"] for x in d["layers"]].count("fp8_ds_mla") == 58
    assert d["cache_config"]["skip_layers"] == [0, 1, 60]


def test_plan_from_config_json(capsys, tmp_path):
    cfg = {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
           "v_head_dim": 128, "num_attention_heads": 16, "num_hidden_layers": 4,
           "max_position_embeddings": 4096, "torch_dtype": "float16",
           "sliding_window": 1024, "max_window_layers": 2}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    rc, out, _ = run(capsys, ["plan", "--model", str(path), "--kv-cache-dtype", "fp8",
                              "--skip-layers", "sliding_window", "--memory", "1MiB", "--json"])
    d = json.loads(out)
    assert rc == 0 and d["model"]["model_dtype"] == "float16"
    assert [x["format"] for x in d["layers"]] == ["fp8", "fp8", "auto", "auto"]
    assert [x["dtype"] for x in d["layers"]] == ["uint8", "uint8", "float16", "float16"]


@pytest.mark.parametrize("argv,match", [
    (["plan", "--memory", "1GiB", "--kv-cache-dtype", "fp9"], "kv_cache_dtype"),
    (["plan", "--memory", "1GiB", "--skip-layers", "61"], "kv_cache_dtype_skip_layers"),
    (["plan", "--memory", "1GiB", "--skip-layers", "x"], "'x'"),
    (["plan", "--memory", "1KB"], "memory_bytes"),
    (["plan", "--memory", "1GiB", "--model", "nope"], "known models"),
])  # --block-size 0: a usage error naming the flag (test_cli_output_errors.py)
def test_plan_errors_exit_2_with_message(capsys, argv, match):
    rc, out, err = run(capsys, argv)
    assert rc == 2 and out == "" and match in err


def test_bad_memory_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["plan", "--memory", "lots"])
    assert e.value.code == 2 and "--memory" in capsys.readouterr().err


def test_info(capsys):
    rc, out, _ = run(capsys, ["info"])
    assert rc == 0
    for word in ("torch", "triton", "library loaded", "archs", "cubins", "CUDA kernels",
                 "backends"):
        assert word in out
    # Every optional module gives at least one line (report rows or why there are none).
    section = out.split("\nbackends\n", 1)[1].splitlines()
    assert len(section) >= len(cli.BACKEND_MODULES)


def test_info_json(capsys):
    rc, out, _ = run(capsys, ["info", "--json"])
    d = json.loads(out)
    assert rc == 0 and isinstance(d["cuda_kernels_usable"], bool)
    assert {"torch", "triton", "archs", "cubins", "backends"} <= set(d)
    if not d["cuda_kernels_usable"]:
        assert d["cuda_kernels_why_not"]


def test_backend_report_contract(monkeypatch):
    """Each module is reported by its backend_report(), or says why there is none."""
    good = types.SimpleNamespace(backend_report=lambda: [("gather", "cuda", ["no GPU"]),
                                                         ("gather", "torch", [])])
    text = types.SimpleNamespace(backend_report=lambda: "line 1\nline 2")
    bare = types.SimpleNamespace()

    def broken():
        raise RuntimeError("boom")

    modules = {"m.good": good, "m.text": text, "m.bare": bare,
               "m.broken": types.SimpleNamespace(backend_report=broken)}

    def fake_import(name):
        if name == "m.missing":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        if name == "m.badimport":
            raise ModuleNotFoundError("No module named 'numpyy'", name="numpyy")
        if name == "m.syntax":
            raise SyntaxError("bad")
        return modules[name]

    monkeypatch.setattr(cli, "BACKEND_MODULES", ("m.good", "m.text", "m.bare", "m.broken",
                                                 "m.missing", "m.badimport", "m.syntax"))
    monkeypatch.setattr(cli.importlib, "import_module", fake_import)
    rows = cli.backend_reports()
    assert rows[:2] == [("gather", "cuda", ["no GPU"]), ("gather", "torch", [])]
    assert rows[2] == ("m.text", None, ["line 1", "line 2"])
    assert rows[3] == ("m.bare", None, ["no backend_report() yet"])
    assert "boom" in rows[4][2][0]
    assert rows[5] == ("m.missing", None, ["not built yet"])
    assert "numpyy" in rows[6][2][0] and "failed to import" in rows[6][2][0]
    assert "SyntaxError" in rows[7][2][0]
    text_out = cli.format_info({**cli.info_dict(), "backends": [
        {"op": o, "backend": b, "reasons": r} for o, b, r in rows]})
    assert "gather / cuda: not usable: no GPU" in text_out
    assert "gather / torch: usable" in text_out
    assert "m.missing: not built yet" in text_out


def test_demo(capsys):
    rc, out, _ = run(capsys, ["demo", "--plan-only"])
    assert rc == 0 and "deepseek-v3" in out and "fp8_ds_mla" in out and "24,253" in out
    rc, out, _ = run(capsys, ["demo", "--plan-only", "--json"])
    assert rc == 0 and json.loads(out)["num_blocks"] == 24_253


def test_no_command_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        main([])
    assert e.value.code == 2


def test_python_dash_m():
    r = subprocess.run([sys.executable, "-m", "mla_ext", *PLAN], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert "2-59" in r.stdout
