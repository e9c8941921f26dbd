"""`edge0 bench clean`: the bench's checkpoints go, and nothing else."""

from __future__ import annotations

import json

from click.testing import CliRunner

from mlx_edge0.bench.commands import bench
from mlx_edge0.bench.datadir import bench_checkpoints
from mlx_edge0.checkpoint import human_bytes


def test_bench_clean_removes_only_the_checkpoints_the_bench_made(tmp_path):
    data = tmp_path / "data"
    for name, config in (
        ("g-stock", {"edge0_synthetic": {"geometry": "g"}}),
        ("g-edge0", {"edge0_synthetic": {"geometry": "g"}, "edge0": {}}),
        ("mine", {"model_type": "qwen3_moe"}),
    ):
        (data / name / "experts").mkdir(parents=True)
        (data / name / "config.json").write_text(json.dumps(config))
        (data / name / "experts" / "layer_000.safetensors").write_bytes(b"x" * 3000)
    sizes = {c.path.name: c.nbytes for c in bench_checkpoints(data)}
    assert sizes == {
        "g-edge0": 3000 + len(json.dumps({"edge0_synthetic": {"geometry": "g"}, "edge0": {}})),
        "g-stock": 3000 + len(json.dumps({"edge0_synthetic": {"geometry": "g"}})),
    }

    r = CliRunner().invoke(bench, ["clean", "--data", str(data), "--dry-run"])
    assert r.exit_code == 0, r.output
    assert f"would remove {data / 'g-edge0'} (" in r.output and (data / "g-edge0").is_dir()
    r = CliRunner().invoke(bench, ["clean", "--data", str(data)])
    assert r.exit_code == 0, r.output
    assert f"removed {human_bytes(sum(sizes.values()))} in 2 checkpoints under {data}" in r.output
    assert sorted(p.name for p in data.iterdir()) == ["mine"]
    (data / "mine" / "config.json").write_text(json.dumps({"edge0_synthetic": {}}))
    CliRunner().invoke(bench, ["clean", "--data", str(data)])
    assert not data.exists()  # emptied, then removed
