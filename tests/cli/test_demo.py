"""``te-fl demo`` and ``te-fl bench``: outputs, determinism, bad input, Ctrl-C (tiny sizes on CPU)."""

import json
import os

import pytest

from transformer_engine.cli import main
from transformer_engine.demo.train import DemoConfig, run_demo


def test_demo_writes_table_json_and_plot(tmp_path, capsys):
    assert main(["demo", "--steps", "3", "--out", str(tmp_path), "--device", "cpu"]) == 0
    payload = json.loads((tmp_path / "demo.json").read_text())
    assert [r["label"] for r in payload["runs"]] == ["fp32", "fp8-delayed"]
    assert all(len(r["train_loss"]) == 3 for r in payload["runs"])
    assert (tmp_path / "loss_curves.png").stat().st_size > 1000
    out = capsys.readouterr().out
    assert "tokens/s" in out and "speed-up" in out  # the summary table (rich may wrap headers)


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


def test_bench_rejects_unknown_benchmarks_and_plot_without_json():
    with pytest.raises(SystemExit, match="unknown benchmark"):
        main(["bench", "--only", "nope"])
    with pytest.raises(SystemExit, match="--plot draws from the JSON"):
        main(["bench", "--only", "layer", "--plot", os.devnull])
