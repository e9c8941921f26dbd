"""Converter: every source form, atomicity, refusal rules, source untouched."""

from __future__ import annotations

import hashlib
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import mlx.core as mx
import pytest

import mlx_edge0
from mlx_edge0 import tiny
from mlx_edge0.checkpoint import Edge0Section, expert_file, read_config
from mlx_edge0.conversions import ConversionError, ConvertOptions, convert
from mlx_edge0.tensorfile import read_header

from conftest import load_stock

QUIET = ConvertOptions(show_progress=False)
TOKENS = mx.array([[5, 17, 99, 3, 250, 7, 7, 31]])


def _tree_hash(path: Path) -> dict[str, str]:
    return {
        str(f.relative_to(path)): hashlib.sha256(f.read_bytes()).hexdigest()
        for f in sorted(path.rglob("*"))
        if f.is_file()
    }


@pytest.fixture(scope="module")
def qwen(tmp_path_factory, tokenizer_dir):
    """The tiny qwen3_moe model and its stock int4 reference checkpoint."""
    root = tmp_path_factory.mktemp("qwen_convert")
    model, config = tiny.build_tiny_model("qwen3_moe", seed=0)
    ref = root / "reference-int4"
    tiny.save_mlx(model, config, ref, tokenizer_dir, bits=4)
    return model, config, ref


@pytest.mark.parametrize(
    "family,form",
    [
        ("qwen3_moe", "mlx-fp"),
        ("qwen3_moe", "hf-experts"),
        ("bailing_moe", "hf-experts"),
        ("qwen3_5_moe", "hf-fused"),
        ("bailing_moe_v3", "mlx-fp"),
    ],
)
def test_source_forms_convert_to_the_stock_int4_model(tmp_path, tokenizer_dir, family, form):
    model, config = tiny.build_tiny_model(family, seed=0)
    src, ref = tmp_path / "src", tmp_path / "ref"
    if form == "mlx-fp":
        tiny.save_mlx(model, config, src, tokenizer_dir)
    elif form == "hf-experts":
        tiny.save_hf_per_expert(model, config, src, tokenizer_dir)
    else:
        tiny.save_hf_fused(model, config, src, tokenizer_dir)
    tiny.save_mlx(model, config, ref, tokenizer_dir, bits=4)
    before = _tree_hash(src)
    report = convert(src, tmp_path / "out", QUIET)
    assert _tree_hash(src) == before  # SRC untouched
    assert not report.requantized
    edge0 = mlx_edge0.load_model(tmp_path / "out")
    assert mx.array_equal(edge0(TOKENS), load_stock(ref)(TOKENS)).item()


def test_quantized_source_experts_copied_bit_for_bit(converted):
    c = converted("qwen3_moe")
    src = mx.load(str(c.source / "model.safetensors"))
    section = Edge0Section.from_config(read_config(c.edge0))
    layer = section.moe_layers[0]
    out = mx.load(str(c.edge0 / expert_file(layer)))
    for proj in ("gate_proj", "up_proj", "down_proj"):
        for part in ("weight", "scales", "biases"):
            stacked = src[f"model.layers.{layer}.mlp.switch_mlp.{proj}.{part}"]
            for e in (0, 7, 15):
                assert mx.array_equal(out[f"experts.{e}.{proj}.{part}"], stacked[e]).item()
    header = read_header(c.edge0 / expert_file(layer))
    starts = [header.entries[f"experts.{e}.gate_proj.weight"].start for e in range(16)]
    assert all(s % 4096 == 0 for s in starts)
    config = read_config(c.edge0)
    assert config["model_file"] == "edge0_model.py"
    assert config["quantization"]["bits"] == 4
    assert not any("switch_mlp" in k for k in mx.load(str(c.edge0 / "model.safetensors")))
    assert (c.edge0 / "tokenizer.json").exists()


def test_other_bits_are_requantized_with_a_warning(tmp_path, qwen, tokenizer_dir):
    model, config, _ = qwen
    src = tmp_path / "src8"
    tiny.save_mlx(model, config, src, tokenizer_dir, bits=8)
    with pytest.warns(UserWarning, match="8-bit group 64; re-quantizing to 4-bit"):
        report = convert(src, tmp_path / "out", QUIET)
    assert report.requantized
    section = Edge0Section.from_config(read_config(tmp_path / "out"))
    assert (section.experts.bits, section.experts.group_size) == (4, 64)
    out = mlx_edge0.load_model(tmp_path / "out")(TOKENS)
    assert mx.all(mx.isfinite(out)).item()


def test_cli_convert_prints_bars_warnings_as_one_line_and_no_mlx_lm_info(tmp_path, qwen, tokenizer_dir):
    from click.testing import CliRunner

    from mlx_edge0.cli import main

    model, config, _ = qwen
    src8, src_float = tmp_path / "src8", tmp_path / "src-bf16"
    tiny.save_mlx(model, config, src8, tokenizer_dir, bits=8)
    tiny.save_mlx(model, config, src_float, tokenizer_dir)
    r = CliRunner().invoke(main, ["convert", str(src8), str(tmp_path / "out8")])
    assert r.exit_code == 0, r.output
    assert (
        f"warning: {src8}: experts are 8-bit group 64; re-quantizing to 4-bit group 64 (quality may change)\n"
    ) in r.output
    assert "warnings.warn" not in r.output and "UserWarning" not in r.output
    r = CliRunner().invoke(main, ["convert", str(src_float), str(tmp_path / "out-bf16")])
    assert r.exit_code == 0, r.output
    assert "[INFO]" not in r.output and "warning" not in r.output
    assert "edge0 convert: experts" in r.output and "edge0 convert: resident tensors" in r.output
    assert r.output.rstrip().splitlines()[-1].startswith(f"wrote {tmp_path / 'out-bf16'}: 3 MoE layers")


def test_refusals(tmp_path, qwen):
    _, _, ref = qwen
    out = tmp_path / "out"
    convert(ref, out, QUIET)
    stamp = (out / "config.json").stat().st_mtime_ns
    with pytest.raises(ConversionError, match="already exists; pass --force"):
        convert(ref, out, QUIET)
    assert (out / "config.json").stat().st_mtime_ns == stamp
    convert(ref, out, ConvertOptions(force=True, show_progress=False))
    assert Edge0Section.from_config(read_config(out)).moe_layers == (1, 2, 3)
    with pytest.raises(ConversionError, match="must not be SRC"):
        convert(ref, ref, ConvertOptions(force=True, show_progress=False))
    with pytest.raises(ConversionError, match="must not be SRC or lie inside it"):
        convert(ref, ref / "inside", QUIET)
    with pytest.raises(ConversionError, match="already an edge0 checkpoint"):
        convert(out, tmp_path / "again", QUIET)
    with pytest.raises(ConversionError, match="no such directory"):
        convert(tmp_path / "missing", tmp_path / "x", QUIET)


def _no_leftovers(parent: Path, name: str) -> bool:
    return not any(p.name.startswith((name, f".{name}")) for p in parent.iterdir())


def test_failure_mid_conversion_leaves_nothing(tmp_path, qwen, monkeypatch):
    from mlx_edge0.conversions import converter as convert_module

    _, _, ref = qwen
    before = _tree_hash(ref)
    calls = []
    real = convert_module._write_layer

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real(*args, **kwargs)

    monkeypatch.setattr(convert_module, "_write_layer", failing)
    with pytest.raises(ConversionError, match="No space left on device"):
        convert(ref, tmp_path / "out", QUIET)
    assert _no_leftovers(tmp_path, "out")

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(convert_module, "_write_layer", interrupted)
    with pytest.raises(KeyboardInterrupt):
        convert(ref, tmp_path / "out", QUIET)
    assert _no_leftovers(tmp_path, "out")
    assert _tree_hash(ref) == before


def test_sigterm_mid_conversion_leaves_no_out(tmp_path, qwen):
    _, _, ref = qwen
    out = tmp_path / "out"
    script = textwrap.dedent(f"""
        import faulthandler, signal, time
        faulthandler.register(signal.SIGUSR1)  # the test asks for every thread's stack if exit hangs
        from mlx_edge0.conversions import converter as m
        real = m._write_layer
        def slow(*a, **k):
            print("writing", flush=True)
            time.sleep(60)
            return real(*a, **k)
        m._write_layer = slow
        m.convert({str(ref)!r}, {str(out)!r}, m.ConvertOptions(show_progress=False))
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "writing"
    assert any(p.name.startswith(".out.edge0-tmp") for p in tmp_path.iterdir())
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGUSR1)
        time.sleep(2)
        proc.kill()
        pytest.fail(f"no exit 60 s after SIGTERM; the child's stderr and stacks:\n{proc.communicate()[1]}")
    proc.communicate()
    assert proc.returncode != 0
    assert _no_leftovers(tmp_path, "out")


def test_unknown_model_type_is_refused(tmp_path, qwen):
    import json
    import shutil

    _, _, ref = qwen
    src = tmp_path / "src"
    shutil.copytree(ref, src)
    config = json.loads((src / "config.json").read_text())
    config["model_type"] = "llama"
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConversionError, match=r"config\.json: model_type 'llama' is not supported"):
        convert(src, tmp_path / "out", QUIET)
    assert not (tmp_path / "out").exists()
