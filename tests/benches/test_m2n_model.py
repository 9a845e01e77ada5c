"""The M2N model on paper: its table in docs/benchmarks.md is the script's,
and its figures hold what the model says."""

import importlib.util

from support import ROOT


def _model():
    spec = importlib.util.spec_from_file_location("m2n_model", ROOT / "benches" / "m2n_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_docs_table_is_the_models():
    assert _model().table() in (ROOT / "docs" / "benchmarks.md").read_text()


def test_m2n_never_beats_the_limit_nor_loses_to_the_broadcast():
    model = _model()
    for name, (direct, fallback) in model.MODELS.items():
        for t, tp in model.SHAPES[name]:
            s = model.times(direct, fallback, t, tp)
            assert s["all direct"] <= s["m2n"] <= s["broadcast"], (name, t, tp, s)


def test_with_every_parameter_direct_m2n_is_the_limit():
    model = _model()
    s = model.times(100e9, 0.0, 16, 8)
    assert s["m2n"] == s["all direct"] == 100e9 / (8 * model.NIC)
