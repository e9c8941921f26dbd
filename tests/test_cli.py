"""The edge0 CLI: convert, info, generate (with --stats) and the default model."""

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
    assert "is NOT the mlx-edge0 shim" in r.output

    (out / "edge0_model.py").write_text(
        "from mlx_edge0.plugin import bind; Model, ModelArgs = bind(__file__)  # noqa\n"
    )
    r = runner.invoke(main, ["generate", "--model", str(out), "--max-tokens", "8", "--stats"])
    assert r.exit_code == 0, r.output
    stats = json.loads(r.output[r.output.index("{"):])["edge0_stats"]
    assert stats["expert_loads"] > 0 and stats["bytes_read"] > 0
    assert "generation: 8 tokens" in r.output


def test_default_model_is_built_once_and_labelled_random(tmp_path, monkeypatch):
    monkeypatch.setattr(default_model, "cache_dir", lambda: tmp_path)
    r = CliRunner().invoke(main, ["generate", "--max-tokens", "4"])
    assert r.exit_code == 0, r.output
    assert "RANDOM-WEIGHT" in r.output and "building it once" in r.output
    assert (tmp_path / default_model.DEFAULT_NAME / "config.json").exists()
    r = CliRunner().invoke(main, ["generate", "--max-tokens", "4"])
    assert "RANDOM-WEIGHT" in r.output and "building it once" not in r.output
