"""`python -m mla_ext info` lists every dispatcher of the library, the sparse ones included, from
one registry (mla_ext.dispatch.DISPATCHER_MODULES / all_dispatchers): a module of mla_ext that
builds a Dispatcher and is missing there fails here, naming it."""
from __future__ import annotations

import json
import pathlib
import re

from mla_ext import cli, dispatch
from mla_ext.cli import main

ROOT = pathlib.Path(dispatch.__file__).parent
BUILDS = re.compile(r"^[A-Za-z_]\w*\s*=\s*\w*Dispatcher\(", re.M)  # a module-level dispatcher


def _modules_that_build_dispatchers() -> set[str]:
    found = set()
    for path in ROOT.rglob("*.py"):
        if path.name != "dispatch.py" and BUILDS.search(path.read_text()):
            rel = path.relative_to(ROOT.parent).with_suffix("")
            found.add(".".join(rel.parts))
    return found


def test_every_module_that_builds_a_dispatcher_is_registered():
    missing = sorted(_modules_that_build_dispatchers() - set(dispatch.DISPATCHER_MODULES))
    assert not missing, f"add these modules to mla_ext.dispatch.DISPATCHER_MODULES: {missing}"
    assert {"mla_ext.sparse.index_cache_backends", "mla_ext.sparse.sparse_attention"} <= set(dispatch.DISPATCHER_MODULES)


def test_info_lists_every_dispatcher_with_its_backends(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    section = out.split("\ndispatchers (backends in the stated order)\n", 1)[1].splitlines()
    ops = {d.op: d for d in dispatch.all_dispatchers()}
    assert {"index_write", "index_gather", "sparse_latent_attention", "latent_attention", "gather",
            "kv_b_proj"} <= set(ops)
    for op, d in ops.items():
        assert f"  {op}: {', '.join(b.name for b in d.backends)}" in section, op
    # and each one's usability (its module's backend_report), the indexer's top-k too
    backends = out.split("\nbackends\n", 1)[1].split("\n\ndispatchers", 1)[0]
    for op in list(ops) + ["indexer_topk"]:
        assert f"  {op} / " in backends, op


def test_info_json_lists_the_dispatchers_and_a_forced_backend(capsys, monkeypatch):
    from mla_ext.sparse.index_cache_backends import INDEX_GATHER

    monkeypatch.setenv("MLA_EXT_FORCE_INDEX_WRITE", "torch")
    with INDEX_GATHER.force("cpu"):
        assert main(["info", "--json"]) == 0
    rows = {r["op"]: r for r in json.loads(capsys.readouterr().out)["dispatchers"]}
    assert rows["index_gather"] == {"op": "index_gather", "backends": ["cuda", "triton", "cpu", "torch"],
                                    "forced": "cpu"}
    assert rows["index_write"]["forced"] == "torch" and rows["sparse_latent_attention"]["forced"] is None
    assert "(forced: cpu)" in cli.format_info({**cli.info_dict(), "dispatchers": [rows["index_gather"]]})
