"""A dispatch table can never make a call raise: a file over the size
cap, any parse error (deep nesting -> RecursionError, truncated JSON), a value
past float range (a 400-digit time or rate -> OverflowError), a wrong schema:
the table is ignored with ONE warning naming the file and the reason. Backend
names the op does not have are refused at load with a warning and never shown
as measured."""
import json
import warnings

import pytest

from mla_ext import dispatch as D
from mla_ext.dispatch import Backend, Dispatcher
from test_dispatch_table import DEVICE, _fresh_tables  # noqa: F401  (autouse: no table env, fresh caches)

FILE = "fake_gpu_9000.json"


def _toy(tmp_path):
    """a: its heuristic says no above M=8; b: usable (the stated order's pick at M=64)."""
    return Dispatcher("toy", [
        Backend("a", lambda x: [], lambda x: "a", lambda x: ["M > 8"] if x["M"] > 8 else []),
        Backend("b", lambda x: [], lambda x: "b"),
    ], table_key=lambda x: (DEVICE, [f"M={x['M']}"]), tables_dir=str(tmp_path))


def _table(entries):
    return json.dumps({"format": 1, "device": DEVICE, "ops": {"toy": {"entries": entries}}})


def _calls(d, n=3):
    """n calls and explains; (results, the TableWarnings raised)."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = [(d({"M": 64}), d.explain({"M": 64})) for _ in range(n)]
    return out, [w for w in seen if issubclass(w.category, D.TableWarning)]


BAD = {
    "deep_nesting": ("[" * 200_000 + "]" * 200_000, "RecursionError"),
    "truncated": (_table({"M=64": {"order": ["a"], "us": {"a": 1.0}}})[:-7], "JSONDecodeError"),
    "400_digit_time": (_table({"M=64": {"order": ["a"], "us": {"a": 10 ** 400}}}), "finite numbers"),
    "nan_time": (_table({"M=64": {"order": ["a"], "us": {"a": float("nan")}}}), "finite numbers"),
    "wrong_schema": (json.dumps({"format": 1, "ops": {"toy": {"M=64": ["a"]}}}), "'entries' object"),
    "not_utf8": (b"\xff\xfe{", "UnicodeDecodeError"),
    "not_an_object": ("[1, 2]", "expected a JSON object"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_an_unreadable_table_is_ignored_with_one_warning(tmp_path, case):
    text, reason = BAD[case]
    path = tmp_path / FILE
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    out, warned = _calls(_toy(tmp_path))
    assert all(r == "b" for r, _ in out)  # the stated order
    assert len(warned) == 1, [str(w.message) for w in warned]
    msg = str(warned[0].message)
    assert str(path) in msg and reason in msg and "ignored" in msg
    assert "is unusable (" in out[0][1] and reason in out[0][1]


def test_a_table_over_the_size_cap_is_not_read(tmp_path, monkeypatch):
    monkeypatch.setattr(D, "MAX_TABLE_BYTES", 1000)
    (tmp_path / FILE).write_text(_table({"M=64": {"order": ["a"]}}) + " " * 2000)
    out, warned = _calls(_toy(tmp_path))
    assert out[0][0] == "b" and len(warned) == 1 and "larger than MAX_TABLE_BYTES=1000" in str(warned[0].message)


def test_unknown_backend_names_are_refused_at_load(tmp_path):
    (tmp_path / FILE).write_text(_table({
        "M=64": {"order": ["aa", "a", "b"], "us": {"aa": 1.0, "a": 2.0, "b": 3.0}},  # 'aa': a typo
        "M=128": {"order": ["bb"], "us": {"bb": 1.0}},
    }))
    d = _toy(tmp_path)
    out, warned = _calls(d)
    assert out[0][0] == "a"  # the measured fastest that exists
    assert len(warned) == 1
    msg = str(warned[0].message)
    assert FILE in msg and "'aa', 'bb'" in msg and "op 'toy' has no backend named" in msg
    assert "aa" not in out[0][1] and "measured a 2 us, b 3 us" in out[0][1]
    # An entry of typos only is no measurement: the stated order, never 'bb'.
    assert d({"M": 128}) == "b" and "no measurement" in d.explain({"M": 128})


def test_a_400_digit_rate_falls_back_to_the_stated_rates(tmp_path, monkeypatch):
    from mla_ext.prefill import context_cost as AC

    monkeypatch.setenv(D.TABLES_ENV, str(tmp_path))
    rates = dict(gemm_flops=10 ** 400, attention_flops=1e11, latent_flops=4e10, bytes_per_s=2e10, launch_s=1e-5,
                 latent_flops_by_format={"fp8": 10 ** 400})
    (tmp_path / "cpu.json").write_text(json.dumps(
        {"format": 1, "device": "cpu", "ops": {AC.OP: {"entries": {}, "rates": rates}}}))
    AC.clear_rates_cache()
    try:
        with pytest.warns(D.TableWarning, match="cpu.json: context_attention rates must be finite"):
            got = AC.rates_for("cpu")
        assert got.source.startswith("stated defaults")
    finally:
        AC.clear_rates_cache()


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_a_table_path_that_is_not_a_regular_file_is_skipped_unopened(tmp_path, monkeypatch, kind):
    """A FIFO would block open() forever (every kv_b_proj call with it); it is never opened."""
    import os
    import threading

    path = tmp_path / FILE
    if kind == "fifo":
        if not hasattr(os, "mkfifo"):
            pytest.skip("no FIFOs on this platform")
        os.mkfifo(path)
    else:
        path.mkdir()
    opened = []
    real_open = os.open
    monkeypatch.setattr(os, "open", lambda p, *a, **k: opened.append(p) or real_open(p, *a, **k))
    result = {}
    worker = threading.Thread(target=lambda: result.update(calls=_calls(_toy(tmp_path))), daemon=True)
    worker.start()
    worker.join(10)
    if worker.is_alive():  # unblock the reader before failing, so the test process can end
        with open(os.open(path, os.O_WRONLY | os.O_NONBLOCK), "w") if kind == "fifo" else open(os.devnull):
            pass
        pytest.fail("dispatch blocked on the table path")
    out, warned = result["calls"]
    assert all(r == "b" for r, _ in out)  # the stated order
    assert len(warned) == 1, [str(w.message) for w in warned]
    msg = str(warned[0].message)
    want = "a FIFO" if kind == "fifo" else "a directory"
    assert str(path) in msg and f"not a regular file ({want}); never opened" in msg
    assert str(path) not in map(str, opened)
