"""The private PyTorch internals fivefold reaches (src/fivefold/torch_internals/) are all in the
installed torch; when a release changes one, the failure is one sentence naming it."""

from __future__ import annotations

import builtins
import importlib
import importlib.util
import sys

import pytest
import torch

from fivefold import torch_internals


def test_this_torch_has_every_internal_fivefold_uses():
    missing = torch_internals.missing()
    assert missing == [], "\n".join(missing)


def _defining_class(cls, name):
    return next(klass for klass in cls.__mro__ if name in vars(klass))


@pytest.mark.parametrize("method", torch_internals.STAGE_METHODS)
def test_a_stage_method_gone_is_named(monkeypatch, method):
    from torch.distributed.pipelining import PipelineStage

    monkeypatch.delattr(_defining_class(PipelineStage, method), method)
    missing = torch_internals.missing()  # backward_one_chunk: its signature's check fails too
    assert missing and all(f"PipelineStage.{method}" in m for m in missing), missing
    assert any(f"has no PipelineStage.{method} " in m for m in missing), missing
    assert "src/fivefold/parallel/pipeline/stages.py" in missing[0] and "torch_internals/" in missing[0]


def test_an_init_attribute_gone_is_named(monkeypatch):
    """fwd_cache exists only on a built stage: the check reads PipelineStage's __init__."""
    from fivefold.torch_internals import checks

    sources = checks._sources

    def without_fwd_cache(cls, member):
        return sources(cls, member).replace("self.fwd_cache", "self.forward_cache")
    monkeypatch.setattr(checks, "_sources", without_fwd_cache)
    missing = torch_internals.missing()
    assert len(missing) == 1 and "has no PipelineStage.fwd_cache," in missing[0], missing


def test_a_torch_function_gone_is_named(monkeypatch):
    monkeypatch.delattr(torch, "_grouped_mm")
    missing = torch_internals.missing()
    assert len(missing) == 1 and "has no torch._grouped_mm," in missing[0], missing
    assert "src/fivefold/models/moe/layer.py" in missing[0]


def test_an_aten_op_gone_is_named(monkeypatch):
    monkeypatch.setitem(torch_internals.ATEN_OPS, "_fivefold_no_such_op", ("fivefold calls", "src/fivefold/x.py"))
    missing = torch_internals.missing()
    assert len(missing) == 1 and "has no torch.ops.aten._fivefold_no_such_op," in missing[0], missing
    with pytest.raises(AttributeError, match="has no torch.ops.aten._fivefold_no_such_op,"):
        torch_internals.aten_op("_fivefold_no_such_op")


def test_a_lazy_import_gone_is_named(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.testing._internal.distributed.fake_pg", None)
    missing = torch_internals.missing()
    assert len(missing) == 1 and "fake_pg.FakeStore," in missing[0] and "rank_build.py" in missing[0], missing


def test_names_outside_the_lists_are_refused():
    with pytest.raises(ValueError, match="STAGE_METHODS"):
        torch_internals.wrap_stage_method(object(), "step", lambda method: method)
    with pytest.raises(ValueError, match="ATEN_OPS"):
        torch_internals.aten_op("_fused_adam")


def test_an_absent_import_raises_the_sentence():
    absent = torch_internals._absent("torch.utils._pytree.tree_leaves")
    with pytest.raises(ImportError, match="has no torch.utils._pytree.tree_leaves;"):
        absent([])
    with pytest.raises(ImportError, match="has no torch.utils._pytree.tree_leaves;"):
        type("Mode", (absent,), {})


def test_it_imports_only_what_import_torch_loads_and_nothing_of_fivefold(monkeypatch):
    """Cheap to import from any layer: pipelining, DTensor and torch.testing._internal are imported
    inside the functions that use them. Runs a fresh copy of the module, recording what it imports."""
    requested = []
    real_import, real_import_module = builtins.__import__, importlib.import_module

    def recording_import(name, globals=None, locals=None, fromlist=(), level=0):
        if globals is copy.__dict__:  # the module's own statements, not the machinery's
            requested.append(name)
        return real_import(name, globals, locals, fromlist, level)

    def recording_import_module(name, package=None):
        if sys._getframe(1).f_globals is copy.__dict__:
            requested.append(name)
        return real_import_module(name, package)
    spec = importlib.util.spec_from_file_location("_torch_internals_copy", torch_internals.__file__)
    copy = importlib.util.module_from_spec(spec)
    monkeypatch.setattr(builtins, "__import__", recording_import)
    monkeypatch.setattr(importlib, "import_module", recording_import_module)
    spec.loader.exec_module(copy)
    monkeypatch.undo()
    # `import torch` itself loads torch._ops (torch.ops), torch.utils._python_dispatch and torch.utils._pytree.
    assert set(requested) <= {"__future__", "importlib", "inspect", "re", "torch", "torch._ops",
                              "torch.utils._python_dispatch", "torch.utils._pytree"}, sorted(set(requested))
