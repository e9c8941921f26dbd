"""The edge0 CLI: convert, info, generate (with --stats) and the embedded default model."""

from __future__ import annotations

import json

from click.testing import CliRunner

from mlx_edge0 import default_model
from mlx_edge0.cli import main


def test_convert_info_generate(converted, tmp_path):
    src = converted("bailing_moe").source
    out = tmp_path / "edge0"
    runner = CliRunner()
    r = runner.invoke(main, ["convert", str(src), str(out)])
    assert r.exit_code == 0, r.output
    assert "3 MoE layers" in r.output
    r = runner.invoke(main, ["convert", str(src), str(out)])
    assert r.exit_code == 1 and "--force" in r.output

    r = runner.invoke(main, ["info", str(out)])
    assert r.exit_code == 0, r.output
    assert "MoE layers      3: [1, 2, 3]" in r.output
    assert "is the mlx-edge0 shim" in r.output
    d = json.loads(runner.invoke(main, ["info", "--json", str(out)]).output)
    assert d["experts"]["num_experts"] == 16 and d["num_experts_per_tok"]["1"] == 4
    assert d["expert_bytes"] == sum((out / f["file"]).stat().st_size for f in d["expert_files"])

    (out / "edge0_model.py").write_text("import os\n")
    r = runner.invoke(main, ["info", str(out)])
    assert f"WARNING         mlx_lm --trust-remote-code would execute {out / 'edge0_model.py'}" in r.output
    assert f"{out / 'edge0_model.py'}: not the mlx-edge0 shim" in r.output
    assert "mlx-edge0 (load, generate, serve, ...) refuses this checkpoint" in r.output

    (out / "edge0_model.py").write_text(
        "from mlx_edge0.plugin import bind; Model, ModelArgs = bind(__file__)  # noqa\n"
    )
    r = runner.invoke(main, ["generate", "--model", str(out), "--max-tokens", "8", "--stats", "--json"])
    assert r.exit_code == 0, r.output
    stats = json.loads(r.output[r.output.index("{") :])["edge0_stats"]
    assert stats["expert_loads"] > 0 and stats["bytes_read"] > 0
    assert "generation: 8 tokens" in r.output
    assert "sampling: greedy, seed 0\n" in r.output  # no generation_config.json in this checkpoint

    r = runner.invoke(main, ["generate", "--model", str(out), "--max-tokens", "8", "--stats"])
    assert r.exit_code == 0, r.output
    assert "{" not in r.output.split("generation: 8 tokens")[1]
    assert "edge0 stats: 10 forwards, 19 tokens, decode path hot" in r.output  # 11 prompt + 8 decoded tokens
    assert "  hot cache       " in r.output and "  peak memory     " in r.output
    assert " ms choosing rows\n" in r.output


def test_default_model_is_the_packaged_trained_moe():
    path = default_model.default_checkpoint()
    assert path.parent == default_model.DEFAULT_ROOT and path.parent.parent.name == "mlx_edge0"
    assert (path / "experts" / "layer_005.safetensors").is_file()
    assert (path / "prerouter.safetensors").is_file()
    assert (default_model.default_teacher() / "model.safetensors").is_file()
    r = CliRunner().invoke(main, ["generate", "--max-tokens", "8", "--prompt", "import os"])
    assert r.exit_code == 0, r.output
    assert "trained on the Python standard library" in r.output
    assert "generation: 8 tokens" in r.output


def test_missing_default_model_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(default_model, "DEFAULT_ROOT", tmp_path)
    r = CliRunner().invoke(main, ["generate", "--max-tokens", "4"])
    assert r.exit_code == 1
    assert f"{tmp_path / 'edge0' / 'config.json'} is missing" in r.output and "--model" in r.output


def test_staged_window_flag_reaches_the_model_and_bad_values_fail_clearly():
    staged, depth = {}, {}
    for window in ("0", "3", "auto"):  # the default model has 5 prerouted layers
        r = CliRunner().invoke(main, ["generate", "--max-tokens", "6", "--staged-window", window, "--json"])
        assert r.exit_code == 0, r.output
        stats = json.loads(r.output[r.output.index("{") :])["edge0_stats"]
        assert stats["prerouted"] > 0
        staged[window], depth[window] = stats["resident_bytes"]["staged"], stats["staged_window"]
    assert staged["3"] * 5 == staged["0"] * 3 and depth["0"] == 0 and depth["3"] == 3
    assert 3 <= depth["auto"] <= 5 and staged["auto"] * 5 == staged["0"] * depth["auto"]  # grown or not, by timing
    r = CliRunner().invoke(main, ["generate", "--max-tokens", "6", "--staged-window", "2"])
    assert r.exit_code == 1
    assert (
        "staged_window must be 0 (a buffer per prerouted layer), an integer >= 3 (that many buffers) or 'auto'"
        in r.output
    )
    r = CliRunner().invoke(main, ["generate", "--max-tokens", "6", "--staged-window", "deep"])
    assert r.exit_code == 2 and "'deep': use 0, an integer >= 3 or 'auto'" in r.output
    r = CliRunner().invoke(main, ["generate", "--max-tokens", "6", "--staged-window", "auto", "--stats"])
    assert r.exit_code == 0 and "ms exposed wait, a staged window of " in r.output, r.output
