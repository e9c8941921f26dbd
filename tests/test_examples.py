"""The examples run as documented."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_convert_and_stream(tmp_path):
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / "convert_and_stream.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "converted: 3 MoE layers" in out.stdout
    assert '"expert_loads"' in out.stdout and '"hot_hits"' in out.stdout
    assert (tmp_path / "edge0" / "experts" / "layer_001.safetensors").exists()
