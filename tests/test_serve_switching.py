"""`sparsegen serve` lets the engine thread take the GIL back within 0.2 ms of asking (Python's
default is 5 ms) while uvicorn runs, and puts the interpreter's own setting back after."""

import sys
from types import SimpleNamespace

import pytest
import uvicorn
from test_cli import run_cli

import sparsegen.serve
from sparsegen.serve.server import ENGINE_SWITCH_S, engine_first_switching


def test_the_switch_interval_holds_while_serving_and_is_restored_after_an_error():
    before = sys.getswitchinterval()
    with pytest.raises(RuntimeError), engine_first_switching():
        assert sys.getswitchinterval() == pytest.approx(ENGINE_SWITCH_S)
        raise RuntimeError("the server stopped")
    assert sys.getswitchinterval() == before


def test_the_serve_command_runs_uvicorn_inside_the_engine_first_interval(monkeypatch, capsys):
    seen = []
    engine = SimpleNamespace(memory=SimpleNamespace(describe=lambda: "memory bound: (stated by the engine)"))
    monkeypatch.setattr(
        sparsegen.serve, "build_app", lambda *a, **k: SimpleNamespace(state=SimpleNamespace(engine=engine))
    )
    monkeypatch.setattr(uvicorn, "run", lambda *a, **k: seen.append(sys.getswitchinterval()))
    before = sys.getswitchinterval()
    code, _, err = run_cli(monkeypatch, capsys, "serve", "--port", "1")
    assert code == 0, err
    assert seen == [pytest.approx(ENGINE_SWITCH_S)]
    assert sys.getswitchinterval() == before
