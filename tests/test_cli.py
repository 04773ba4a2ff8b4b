import json
import sys

import pytest

from sparsegen import cli
from sparsegen.kv import POLICIES
from sparsegen.kv.attention import policy_attention
from sparsegen.kv.spec import KVSpec
from sparsegen.models import cpu_bf16_flag


def run_cli(monkeypatch, capsys, *args, stdin=None):
    """Run `sparsegen ARGS` in-process; return (exit code, stdout, stderr)."""
    monkeypatch.setattr(sys, "argv", ["sparsegen", *map(str, args)])
    if stdin is not None:
        import io

        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    code = 0
    try:
        cli.main()
    except SystemExit as exc:
        code = exc.code or 0
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_help_lists_the_commands(monkeypatch, capsys):
    code, out, _ = run_cli(monkeypatch, capsys, "--help")
    assert code == 0
    for command in ("generate", "info", "stream", "chat", "bench"):
        assert command in out


def test_info_and_generate_on_a_local_model(monkeypatch, capsys, tiny_folder):
    code, out, _ = run_cli(monkeypatch, capsys, "info", "--model", tiny_folder)
    assert code == 0 and "llama" in out and "streaming" in out
    code, out, _ = run_cli(
        monkeypatch,
        capsys,
        "generate",
        "w5 w6 w7",
        "--model",
        tiny_folder,
        "--max-new-tokens",
        "6",
        "--policy",
        "streaming",
        "--budget",
        "6",
        "--sinks",
        "2",
    )
    import sparsegen
    from sparsegen.kv import make_cache

    model, tokenizer = sparsegen.load(str(tiny_folder))
    ids = tokenizer("w5 w6 w7", return_tensors="pt")
    cache = make_cache(model, KVSpec.of("streaming", budget=6, sinks=2))
    with policy_attention(model):
        expected = model.generate(**ids, cache=cache, max_new_tokens=6, do_sample=False, pad_token_id=0)
    text = tokenizer.decode(expected[0, 3:], skip_special_tokens=True)
    assert code == 0 and out.split() == text.split() and len(text.split()) >= 1


def test_bad_input_is_one_line_not_a_traceback(monkeypatch, capsys, tiny_folder, tmp_path):
    code, _, err = run_cli(
        monkeypatch,
        capsys,
        "generate",
        "w5",
        "--model",
        tiny_folder,
        "--policy",
        "streaming",
        "--budget",
        "4",
        "--sinks",
        "4",
    )
    assert code == 2 and "sinks (4) must be smaller than the budget (4)" in err and "Traceback" not in err
    code, _, err = run_cli(monkeypatch, capsys, "stream", "--model", tiny_folder, "--text", tmp_path / "none.txt")
    assert code == 2 and "not found" in err
    code, _, err = run_cli(monkeypatch, capsys, "stream", "--model", tiny_folder, "--policies", "full,snapkv")
    assert code == 2 and "snapkv compresses a prompt once" in err and "Traceback" not in err


@pytest.mark.parametrize(
    "command",
    [["generate", "w5", "--policy", "h2o"], ["stream", "--policies", "h2o"], ["eval", "zeroshot", "--policy", "h2o"]],
)
def test_a_budget_beside_its_parts_is_one_error_in_every_command(monkeypatch, capsys, tiny_folder, command):
    code, _, err = run_cli(monkeypatch, capsys, *command, "--model", tiny_folder, "--budget", "8", "--heavy", "2")
    assert code == 2 and "not both" in err and "Traceback" not in err


def test_stream_main_job_writes_table_plot_json_and_nll(monkeypatch, capsys, tiny_folder, tiny_text, tmp_path):
    out_dir = tmp_path / "run"
    code, out, _ = run_cli(
        monkeypatch,
        capsys,
        "stream",
        "--model",
        tiny_folder,
        "--text",
        tiny_text,
        "--tokens",
        "500",
        "--chunk",
        "16",
        "--budget",
        "32",
        "--out",
        out_dir,
    )
    assert code == 0, out
    results = json.loads((out_dir / "results.json").read_text())
    assert set(results) == {name for name, cls in POLICIES.items() if not cls.prefill_only}
    assert results["full"]["tokens"] == 256 and "window" in results["full"]["note"]
    for label, row in results.items():
        lines = (out_dir / row["nll_file"]).read_text().split()
        assert len(lines) == row["tokens"] and row["chunk"] == 16
        if label != "full":
            assert row["tokens"] == 499 and row["kl"] is not None
            assert row["ppl_per_million"] == pytest.approx([row["ppl"]])
            assert row["kv_mb"] == pytest.approx(  # the cache holds the model's dtype: bf16 where the CPU has it
                32 * 3 * 2 * 16 * 2 * (2 if cpu_bf16_flag() else 4) / 2**20
            )  # budget x layers x heads x dim x K,V x bytes
    assert (out_dir / "stream_nll.png").stat().st_size > 10_000
    assert "streaming_h2o" in out and "KL vs full" in out
    meta = json.loads((out_dir / "meta.json").read_text())  # the text's 400 tokens, read again for the last 100
    assert meta["distinct_tokens"] < 500 and meta["text_passes"] == round(500 / meta["distinct_tokens"], 3)
    assert f"{meta['distinct_tokens']} distinct tokens, read" in out
    streamed = [sample[0] for sample in meta["rss_mb"]]
    assert streamed == sorted(streamed) and streamed[-1] == 499 and all(s[2] >= s[1] > 0 for s in meta["rss_mb"])


def test_chat_on_stdin_keeps_memory_bounded(monkeypatch, capsys, tiny_folder, tmp_path):
    transcript = tmp_path / "chat.jsonl"
    code, out, _ = run_cli(
        monkeypatch,
        capsys,
        "chat",
        "--model",
        tiny_folder,
        "--budget",
        "12",
        "--sinks",
        "2",
        "--max-new-tokens",
        "8",
        "--transcript",
        transcript,
        stdin="w5 w6 w7 w8\nw9 w10 w11\nw12 w13 w14 w15 w16\n",
    )
    assert code == 0
    turns = [json.loads(line) for line in transcript.read_text().splitlines()]
    assert [t["turn"] for t in turns] == [1, 2, 3]
    assert turns[-1]["tokens_seen"] > 12 and all(t["tokens_held"] <= 12 for t in turns)


@pytest.mark.slow
def test_bench_kv_on_a_tiny_model(monkeypatch, capsys, tiny_folder, tiny_text, tmp_path):
    code, out, _ = run_cli(
        monkeypatch,
        capsys,
        "bench",
        "kv",
        "--model",
        tiny_folder,
        "--text",
        tiny_text,
        "--sizes",
        "8,16",
        "--context",
        "64",
        "--new-tokens",
        "4",
        "--also",
        "h2o",
        "--out",
        tmp_path,
    )
    assert code == 0
    data = json.loads((tmp_path / "bench_kv.json").read_text())
    assert [r["cache"] for r in data["rows"]] == [8, 16]
    assert all(r["streaming_ms"] > 0 and r["h2o_ms"] > 0 and r["recompute_rss"] > 0 for r in data["rows"])
    assert (tmp_path / "bench_kv.png").exists() and "recompute / streaming" in out


@pytest.mark.slow
def test_bench_kv_bits_on_a_tiny_model(monkeypatch, capsys, tiny_folder, tiny_text, tmp_path):
    args = ("--contexts", "48", "--policies", "streaming", "--kv-bits", "4", "--cache", "16", "--new-tokens", "4")
    code, out, _ = run_cli(
        monkeypatch, capsys, "bench", "kv-bits", "--model", tiny_folder, "--text", tiny_text, *args, "--out", tmp_path
    )
    assert code == 0
    rows = json.loads((tmp_path / "bench_kv_bits.json").read_text())["rows"]
    assert [(r["context"], r["policy"], r["kv"]) for r in rows] == [
        (48, "streaming", "fp32"),
        (48, "streaming", "int4"),
    ]
    assert rows[0]["vs_fp32_kv"] == 1.0 and all(r["ms"] > 0 and r["of_bound"] > 0 for r in rows)
    assert rows[1]["kv_mb"] < rows[0]["kv_mb"] / 4 and "speed vs fp32 KV" in out


@pytest.mark.slow
def test_bench_kv_bits_quality_reads_each_width_rotated_and_not(monkeypatch, capsys, tiny_folder, tiny_text, tmp_path):
    args = ("--quality", "--tokens", "120", "--chunk", "8", "--policies", "streaming", "--kv-bits", "4,2")
    args += ("--cache", "80")  # holding tokens past the ring's first 16 and newest 32
    code, out, _ = run_cli(
        monkeypatch, capsys, "bench", "kv-bits", "--model", tiny_folder, "--text", tiny_text, *args, "--out", tmp_path
    )
    assert code == 0
    rows = json.loads((tmp_path / "bench_kv_bits_quality.json").read_text())["rows"]
    assert [(r["kv"], r["rotated"]) for r in rows] == [
        ("fp32", False),
        ("int4", True),
        ("int4", False),
        ("int2", True),
        ("int2", False),
    ]
    assert rows[0]["vs_fp32_kv"] == "+0.00%" and all(r["ppl"] > 1 for r in rows)
    assert rows[1]["ppl"] != rows[2]["ppl"] and rows[3]["kv_mb"] < rows[1]["kv_mb"]  # (the fp32 ring dominates here)
    kl = [row["kl_millinats"] for row in rows]
    assert kl[0] == 0 and kl[3] > kl[1] > 0  # 2 bits lose more than 4
    assert "vs fp32 KV" in out and "KL to fp32 KV" in out


def test_bench_gather_measures_each_kept_share_and_refuses_bad_shares(monkeypatch, capsys, tiny_folder, tmp_path):
    args = ("bench", "gather", "--model", tiny_folder, "--passes", "1", "--out", tmp_path)
    code, out, _ = run_cli(monkeypatch, capsys, *args, "--kept", "1,0.5")
    assert code == 0
    data = json.loads((tmp_path / "bench_gather.json").read_text())
    assert [r["kept"] for r in data["rows"]] == [1.0, 0.5]
    assert all(r["dense_ms"] > 0 and r["gather_ms"] > 0 and r["rate"] > 0 for r in data["rows"])
    assert "kept-row rate / dense rate" in out and "threads" in data["meta"]["machine"]
    code, _, err = run_cli(monkeypatch, capsys, *args, "--kept", "0.5,1.5")
    assert code != 0 and "--kept takes shares in (0, 1]" in err


@pytest.mark.parametrize("method,pattern", [("wanda", "2:4"), ("sparsegpt", "unstructured"), ("magnitude", "4:8")])
def test_prune_writes_a_checkpoint_transformers_loads(
    monkeypatch, capsys, tiny_folder, tiny_text, tmp_path, method, pattern
):
    from transformers import AutoModelForCausalLM

    out_dir = tmp_path / "pruned"
    code, out, err = run_cli(
        monkeypatch,
        capsys,
        "prune",
        "--model",
        tiny_folder,
        "--method",
        method,
        "--pattern",
        pattern,
        "--calib-text",
        tiny_text,
        "--n-samples",
        "4",
        "--seqlen",
        "32",
        "--out",
        out_dir,
    )
    assert code == 0, err
    model = AutoModelForCausalLM.from_pretrained(out_dir)
    config = model.config.sparsity_config
    assert config["method"] == method and config["sparsity_structure"] == pattern
    q_proj = model.model.layers[0].self_attn.q_proj.weight
    assert (q_proj == 0).float().mean().item() == pytest.approx(0.5)
    code, out, err = run_cli(
        monkeypatch,
        capsys,
        "eval",
        "ppl",
        "--model",
        out_dir,
        "--text",
        tiny_text,
        "--seqlen",
        "64",
        "--json",
        tmp_path / "ppl.json",
    )
    assert code == 0, err
    result = json.loads((tmp_path / "ppl.json").read_text())
    assert result["seqlen"] == 64 and result["windows"] == 6 and result["ppl"] > 1


def test_prune_bad_method_is_a_clear_error(monkeypatch, capsys, tiny_folder, tmp_path):
    code, _, err = run_cli(
        monkeypatch, capsys, "prune", "--model", tiny_folder, "--method", "obs", "--out", tmp_path / "x"
    )
    assert code == 2 and "unknown pruning method 'obs'" in err


def _commands(group, prefix=()):
    """Every command of the CLI as (words, click command)."""
    for name, command in group.commands.items():
        if hasattr(command, "commands"):  # a group
            yield from _commands(command, (*prefix, name))
        else:
            yield (*prefix, name), command


def test_every_command_accepts_a_device():
    import typer

    root = typer.main.get_command(cli.app)
    commands = dict(_commands(root))
    assert len(commands) >= 28
    lacking = [" ".join(words) for words, command in commands.items()
               if "--device" not in {opt for param in command.params for opt in param.opts}]  # fmt: skip
    assert lacking == []


def test_a_device_that_is_not_here_is_a_one_line_error(monkeypatch, capsys, tiny_folder):
    import torch

    code, out, _ = run_cli(monkeypatch, capsys, "info", "--model", tiny_folder, "--device", "cpu")
    assert code == 0 and "llama" in out
    if not torch.cuda.is_available():
        code, _, err = run_cli(monkeypatch, capsys, "info", "--model", tiny_folder, "--device", "cuda")
        assert code == 2 and "no CUDA GPU is visible" in err and "--device cpu" in err and "Traceback" not in err
    code, _, err = run_cli(monkeypatch, capsys, "info", "--model", tiny_folder, "--device", "tpu9")
    assert code == 2 and "use cpu, cuda or cuda:N" in err and "Traceback" not in err


def test_bench_gpu_runs_every_measurement_on_a_tiny_shape_here(monkeypatch, capsys, tmp_path):
    """The GPU benchmark's code, run on this machine's device with a tiny random Llama (eager)."""
    from sparsegen.bench.gpu import bench_gpu

    sizes = dict(
        context=16, long_context=64, new_tokens=6, kv_mb=0.25, prompt=30, sparsities=(0.5,), calibration=(2, 16)
    )
    rows = bench_gpu("tiny", None, **sizes, compile="never", out=tmp_path, progress=lambda m: None)
    whats = [row["what"] for row in rows]
    for what in ("dense decode", "long context", "fixed KV memory", "contextual", "2:4 matmul", "pruning"):
        assert what in whats
    assert all(row["tokens_per_s"] > 0 for row in rows if "tokens_per_s" in row)
    fixed = {row["setting"].split(",")[0]: row["batch"] for row in rows if row["what"] == "fixed KV memory"}
    assert fixed["h2o"] > 3 * fixed["full"]  # h2o at 20% fits more rows in the same KV memory
    assert "random weights" in (tmp_path / "bench_gpu.md").read_text()
    code, _, err = run_cli(monkeypatch, capsys, "bench", "gpu", "--shape", "huge")
    assert code == 2 and "unknown shape 'huge'" in err


def test_activation_bits_other_than_8_is_a_one_line_error(monkeypatch, capsys, tiny_folder):
    args = ("generate", "hello", "--model", tiny_folder, "--activation-bits", "4", "--max-new-tokens", 2)
    code, _, err = run_cli(monkeypatch, capsys, *args)
    assert code == 2 and "activation_bits must be 8" in err and "Traceback" not in err


def test_bench_peers_runs_on_the_cpu_only(monkeypatch, capsys):
    code, _, err = run_cli(monkeypatch, capsys, "bench", "peers", "--device", "cuda")
    assert code == 2 and "use --device cpu" in err and "Traceback" not in err
    code, _, err = run_cli(monkeypatch, capsys, "bench", "peers", "--rounds", "0")
    assert code == 2 and "rounds must be >= 1 (--rounds)" in err and "Traceback" not in err


def test_the_machine_a_result_records_names_the_cpus_family_and_vector_units(tmp_path):
    from sparsegen.report import cpu_model

    first = "processor\t: 0\nmodel name\t: AMD EPYC\ncpu family\t: 26\nmodel\t\t: 2\n"
    first += "flags\t\t: fpu avx2 avx512f avx512_bf16\n"
    second = first.replace("processor\t: 0", "processor\t: 1").replace("26", "25")
    (tmp_path / "cpuinfo").write_text(first + "\n" + second)
    assert cpu_model(str(tmp_path / "cpuinfo")) == "AMD EPYC (family 26 model 2; AVX2, AVX-512, AVX512-BF16)"
    (tmp_path / "arm").write_text("processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd\n")
    assert "family" not in cpu_model(str(tmp_path / "arm")) and cpu_model(str(tmp_path / "arm"))
