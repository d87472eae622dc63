"""``te-fl demo`` and ``te-fl bench``: outputs, determinism, bad input, Ctrl-C (tiny sizes on CPU)."""

import io
import json
import os
import sys
from pathlib import Path

import pytest

from transformer_engine.cli import main
from transformer_engine.common.recipe import NVFP4BlockScaling
from transformer_engine.cli import demo as demo_cli
from transformer_engine.demo import train as demo_train
from transformer_engine.demo.report import fidelity, print_summary
from transformer_engine.demo.train import DemoConfig, RunResult, run_demo

REPO = Path(__file__).resolve().parents[2]


def test_demo_writes_table_json_and_plot(tmp_path, capsys):
    assert main(["demo", "--steps", "3", "--out", str(tmp_path), "--device", "cpu"]) == 0
    payload = json.loads((tmp_path / "demo.json").read_text())
    assert [r["label"] for r in payload["runs"]] == ["fp32", "fp8-delayed", "fp32 seed 1"]
    assert all(len(r["train_loss"]) == 3 for r in payload["runs"])
    assert (tmp_path / "loss_curves.png").stat().st_size > 1000
    out = capsys.readouterr().out
    assert "tokens/s" in out and "speed-up" in out and str(tmp_path) in out


def test_demo_json_reports_fp8_gap_and_high_precision_seed_spread(tmp_path):
    assert main(["demo", "--steps", "4", "--out", str(tmp_path), "--device", "cpu", "--no-plot"]) == 0
    payload = json.loads((tmp_path / "demo.json").read_text())
    runs, summary = payload["runs"], payload["summary"]
    hp = [r for r in runs if r["precision"] == "high"]
    assert [r["seed"] for r in hp] == [0, 1]
    valid = [r["valid_loss"][-1][1] for r in hp]
    assert summary["hp_seed_spread"]["seeds"] == [0, 1]
    assert summary["hp_seed_spread"]["nats"] == pytest.approx(max(valid) - min(valid))
    assert summary["hp_seed_spread"]["relative"] == pytest.approx((max(valid) - min(valid)) / valid[0])
    fp8 = next(r for r in runs if r["precision"] == "fp8")
    assert summary["fp8_valid_gap"]["nats"] == pytest.approx(fp8["valid_loss"][-1][1] - valid[0])
    # speed: median of the steps after warm-up, speed-up = ratio of medians
    assert summary["warmup_steps"] == 2 and all(r["warmup_steps"] == 2 for r in runs)
    for r in runs:
        timed = sorted(r["step_seconds"][2:])
        assert r["step_seconds_median"] == pytest.approx(sum(timed) / 2)
        assert r["step_seconds_q1"] <= r["step_seconds_median"] <= r["step_seconds_q3"]
        assert r["tokens_per_second"] == pytest.approx(r["tokens_per_step"] / r["step_seconds_median"])
    assert summary["speedup"] == pytest.approx(runs[0]["step_seconds_median"] / fp8["step_seconds_median"])
    assert not (tmp_path / "loss_curves.png").exists()


def test_one_high_precision_seed_skips_the_spread(tmp_path, capsys):
    assert main(["demo", "--steps", "2", "--out", str(tmp_path), "--device", "cpu", "--bf16-seeds", "1", "--no-plot"]) == 0
    payload = json.loads((tmp_path / "demo.json").read_text())
    assert [r["label"] for r in payload["runs"]] == ["fp32", "fp8-delayed"]
    assert payload["summary"]["hp_seed_spread"]["nats"] is None
    assert "not measured" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--bf16-seeds must be >= 1"):
        main(["demo", "--device", "cpu", "--bf16-seeds", "0", "--out", str(tmp_path)])


def test_missing_matplotlib_fails_before_any_training(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    trained = []
    monkeypatch.setattr(demo_train, "run_demo", lambda *a, **k: trained.append(1))
    with pytest.raises(SystemExit, match=r"needs matplotlib.*pip install matplotlib.*--no-plot"):
        main(["demo", "--steps", "2", "--device", "cpu", "--out", str(tmp_path)])
    assert trained == []


def test_no_plot_runs_without_matplotlib(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["demo", "--steps", "2", "--device", "cpu", "--bf16-seeds", "1", "--out", str(tmp_path), "--no-plot"]) == 0
    assert (tmp_path / "demo.json").exists() and not (tmp_path / "loss_curves.png").exists()
    assert "plot skipped (--no-plot)" in capsys.readouterr().out


def test_default_output_is_the_user_cache_outside_the_repository(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert demo_cli.default_out() == tmp_path / "home" / ".cache" / "te-fl" / "demo"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.chdir(REPO)
    assert main(["demo", "--steps", "2", "--device", "cpu", "--bf16-seeds", "1"]) == 0
    out = tmp_path / "cache" / "te-fl" / "demo"
    assert (out / "demo.json").exists() and (out / "loss_curves.png").exists()
    assert str(out) in capsys.readouterr().out  # printed at the end
    assert not (REPO / "te-fl-demo").exists()


def _fake_run(label, seed, precision, valid, step_s, memory=None):
    r = RunResult(label, seed, precision, train_loss=[1.0] * 10, valid_loss=[(10, valid)], step_seconds=[step_s] * 10,
                  warmup_steps=5, tokens_per_step=16 * 512, peak_memory_bytes=memory)
    r.summarise_speed()
    return r


@pytest.mark.parametrize("memory", [None, 80 * 2**30])  # CPU (no memory column) and GPU
def test_table_fits_80_columns(memory, monkeypatch):
    pytest.importorskip("rich")
    from rich.console import Console

    monkeypatch.setenv("COLUMNS", "80")
    results = [_fake_run("bf16", 0, "high", 3.4320, 0.00337, memory), _fake_run("fp8-current", 0, "fp8", 3.4694, 0.00245, memory),
               _fake_run("bf16 seed 1", 1, "high", 3.4351, 0.00338, memory)]
    results[1].interrupted = True
    console = Console(record=True, file=io.StringIO())
    assert console.width == 80
    print_summary(results, DemoConfig(size="medium", steps=400, device="cuda:0", recipe="current"), console)
    lines = console.export_text().splitlines()
    assert max(len(line) for line in lines) <= 80
    text = "\n".join(lines)
    assert "…" not in text  # no cell cut short
    for cell in ("fp8-current*", "+0.0374", "2.43M", "1.38x", "speed-up", "step ms", "IQR"):
        assert cell in text
    assert ("80.00" in text) == (memory is not None)
    assert "spread over seeds 0-1: 0.0031 nats" in text


def test_plain_table_without_rich_fits_80_columns(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "rich", None)
    results = [_fake_run("bf16", 0, "high", 3.4320, 0.00337, 2**30), _fake_run("fp8-delayed", 0, "fp8", 3.4694, 0.00245, 2**30)]
    print_summary(results, DemoConfig(size="medium", steps=400, device="cuda:0"))
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 80
    assert "1.38x" in out and "not measured (--bf16-seeds 2 measures it)" in out


def test_fidelity_summary():
    results = [_fake_run("fp32", 0, "high", 2.0, 0.02), _fake_run("fp8-delayed", 0, "fp8", 2.01, 0.01),
               _fake_run("fp32 seed 1", 1, "high", 1.98, 0.02), _fake_run("fp32 seed 2", 2, "high", 2.03, 0.02)]
    f = fidelity(results)
    assert f["fp8_valid_gap"]["nats"] == pytest.approx(0.01) and f["fp8_valid_gap"]["relative"] == pytest.approx(0.005)
    assert f["hp_seed_spread"]["nats"] == pytest.approx(0.05) and f["hp_seed_spread"]["seeds"] == [0, 1, 2]
    assert f["speedup"] == pytest.approx(2.0)


def test_recipe_choices_are_the_runnable_recipes(capsys, monkeypatch):
    assert demo_train.unavailable_recipes() == {}  # MXFP8 and NVFP4 run (emulated where the hardware lacks them)
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--recipe {block,current,delayed,mxfp8,nvfp4}" in help_text and "not offered" not in help_text
    # a recipe the modules cannot run is left out of the choices with its reason
    monkeypatch.setitem(demo_train.RECIPES, "nvfp4-row-scaled", lambda: NVFP4BlockScaling(row_scaled_activation=True))
    assert "not implemented" in demo_train.unavailable_recipes()["nvfp4-row-scaled"]


def test_same_seed_same_result():
    cfg = DemoConfig(steps=2, eval_every=2)
    first, second = run_demo(cfg), run_demo(cfg)
    assert [r.train_loss for r in first] == [r.train_loss for r in second]
    other = run_demo(DemoConfig(steps=2, eval_every=2, seed=1))
    assert [r.train_loss for r in other] != [r.train_loss for r in first]


def test_ctrl_c_keeps_partial_results():
    def interrupt(label, step, result):
        if step == 1:
            raise KeyboardInterrupt

    results = run_demo(DemoConfig(steps=5, eval_every=5), interrupt)
    assert len(results) == 1 and results[0].interrupted and len(results[0].train_loss) == 2
    assert len(results[0].step_seconds) == 2 and results[0].warmup_steps == 1 and results[0].tokens_per_second > 0


@pytest.mark.parametrize("argv, message", [
    (["--recipe", "fp4"], "invalid choice: 'fp4'"),
    (["--size", "huge"], "invalid choice: 'huge'"),
])
def test_unknown_names_list_the_valid_ones(argv, message, capsys):
    with pytest.raises(SystemExit):
        main(["demo", *argv])
    err = capsys.readouterr().err
    assert message in err and "choose from" in err


def test_bad_device_and_unwritable_folder_fail_before_training(tmp_path):
    with pytest.raises(SystemExit, match="unknown device 'gpu0'"):
        main(["demo", "--device", "gpu0", "--out", str(tmp_path)])
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(SystemExit, match="cannot write to output folder"):
        main(["demo", "--device", "cpu", "--out", str(blocker / "sub")])
    with pytest.raises(SystemExit, match="--steps must be >= 1"):
        main(["demo", "--device", "cpu", "--steps", "0", "--out", str(tmp_path)])


def test_bench_on_cpu_says_what_it_measures_and_skips_gpu_benchmarks(monkeypatch, capsys):
    import subprocess

    import torch

    from transformer_engine.cli import bench

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    calls = []
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: calls.append(cmd) or subprocess.CompletedProcess(cmd, 0))
    assert main(["bench"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(bench.CPU_NOTE) and "not a speed result" in out
    assert [Path(c[1]).name for c in calls] == ["bench_dispatch.py", "bench_transformer_layer.py"]
    assert "skipped (they need a CUDA GPU): linear, attention, kernels" in out


def test_bench_layer_table_on_cpu_has_no_tflops_or_memory_columns(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import bench_transformer_layer as layer

    results = {"plain PyTorch": {"ms": 10.0, "peak_bytes": None, "tflops": 0.01},
               "te.TransformerLayer FP8 delayed": {"ms": 30.0, "peak_bytes": None, "tflops": 0.003},
               "te.TransformerLayer FP8 block": {"error": "RuntimeError: no"}}
    headers, rows = layer.table(results, on_gpu=False)
    assert headers == ["variant", "ms", "vs plain", "error"]
    assert rows[1] == ["te.TransformerLayer FP8 delayed", "30.00", "3.00x", ""]
    headers, rows = layer.table(results, on_gpu=True)
    assert "TFLOP/s" in headers and len(rows[0]) == len(headers)


def test_bench_layer_builds_without_deprecation_warnings():
    import warnings

    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import bench_transformer_layer as layer
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    import transformer_engine.pytorch as te

    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        layer.PlainLayer(layer.LayerShape(hidden=16, ffn=32, heads=2, seq=4, batch=1), te.Linear, te.LayerNorm, device="cpu")
        layer.FusedModulesLayer(layer.LayerShape(hidden=16, ffn=32, heads=2, seq=4, batch=1), te, device="cpu")


def test_bench_rejects_unknown_benchmarks_and_plot_without_json():
    with pytest.raises(SystemExit, match="unknown benchmark"):
        main(["bench", "--only", "nope"])
    with pytest.raises(SystemExit, match="--plot draws from the JSON"):
        main(["bench", "--only", "layer", "--plot", os.devnull])
