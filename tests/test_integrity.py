"""Trust in a checkpoint's bytes: convert refuses non-finite weights, records a
checksum of every file it writes and a generation id, ``edge0 info --verify``
finds tampering and bit rot, and loads never mix two conversions."""

from __future__ import annotations

import filecmp
import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner

import mlx_edge0
from mlx_edge0 import default_model, tiny
from mlx_edge0.checkpoint import CheckpointError, expert_file, read_config
from mlx_edge0.cli import main
from mlx_edge0.conversions import ConvertOptions, convert
from mlx_edge0.integrity import sha256_file
from mlx_edge0.tensorfile import TensorFileError, read_header

QUIET = ConvertOptions(show_progress=False)
SWITCH = "model.layers.{}.mlp.switch_mlp.{}.{}"


def _cli(*args: str):
    return CliRunner().invoke(main, list(args))


def _leftovers(parent: Path, name: str) -> list[str]:
    return [p.name for p in parent.iterdir() if p.name.startswith((name, f".{name}"))]


@pytest.fixture
def ckpt(converted, tmp_path) -> Path:
    path = tmp_path / "ckpt"
    shutil.copytree(converted("qwen3_moe").edge0, path)
    return path


def _poke(path: Path, tensor: str, data: bytes) -> None:
    """Overwrite the first bytes of ``tensor`` in place."""
    start = read_header(path).entries[tensor].start
    with open(path, "r+b") as f:
        f.seek(start)
        f.write(data)


# --- convert refuses non-finite weights ------------------------------------


def test_convert_refuses_nan_in_a_float_expert_weight(tmp_path, tokenizer_dir):
    model, config = tiny.build_tiny_model("qwen3_moe", seed=0)
    proj = model.layers[2].mlp.switch_mlp.up_proj
    w = proj.weight
    w[5, 3, 7] = mx.nan
    proj.weight = w
    src, out = tmp_path / "src", tmp_path / "out"
    tiny.save_mlx(model, config, src, tokenizer_dir)  # bf16, unquantized
    r = _cli("convert", str(src), str(out))
    assert r.exit_code == 1, r.output
    assert "layer 2, expert 5, up_proj.weight: 1 non-finite value (NaN/inf)" in r.output
    assert str(src / "model.safetensors") in r.output
    assert "Traceback" not in r.output
    assert _leftovers(tmp_path, "out") == []


def test_convert_refuses_inf_in_quantized_scales_and_keeps_the_old_out(tmp_path, tokenizer_dir, converted):
    model, config = tiny.build_tiny_model("qwen3_moe", seed=0)
    src, out = tmp_path / "src", tmp_path / "out"
    tiny.save_mlx(model, config, src, tokenizer_dir, bits=4)
    weights = mx.load(str(src / "model.safetensors"))
    key = SWITCH.format(1, "gate_proj", "scales")
    scales = weights[key]
    scales[3, 0, 0] = mx.inf
    scales[3, 1, 1] = -mx.inf
    weights[key] = scales
    mx.save_safetensors(str(src / "model.safetensors"), weights, metadata={"format": "mlx"})

    convert(converted("qwen3_moe").source, out, QUIET)
    before = (out / "config.json").read_bytes()
    r = _cli("convert", "--force", str(src), str(out))
    assert r.exit_code == 1, r.output
    assert "layer 1, expert 3, gate_proj.scales: 2 non-finite values (NaN/inf)" in r.output
    assert "Traceback" not in r.output
    assert (out / "config.json").read_bytes() == before  # the old OUT stands
    assert _leftovers(tmp_path, "out") == ["out"]


def test_convert_refuses_a_non_finite_resident_tensor(tmp_path, tokenizer_dir):
    model, config = tiny.build_tiny_model("qwen3_moe", seed=0)
    norm = model.layers[0].input_layernorm
    w = norm.weight
    w[4] = mx.nan
    norm.weight = w
    src, out = tmp_path / "src", tmp_path / "out"
    tiny.save_mlx(model, config, src, tokenizer_dir)
    r = _cli("convert", str(src), str(out))
    assert r.exit_code == 1, r.output
    assert "model.layers.0.input_layernorm.weight: 1 non-finite value" in r.output
    assert _leftovers(tmp_path, "out") == []


# --- checksums and edge0 info --verify -------------------------------------


def test_convert_records_a_checksum_of_every_file_it_writes(ckpt):
    section = read_config(ckpt)["edge0"]
    recorded = section["sha256"]
    written = {str(p.relative_to(ckpt)) for p in ckpt.rglob("*") if p.is_file()} - {"config.json"}
    assert set(recorded) == written
    for name, digest in recorded.items():
        assert hashlib.sha256((ckpt / name).read_bytes()).hexdigest() == digest
    assert len(section["generation"]) >= 16


def test_verify_passes_on_a_clean_checkpoint(ckpt):
    r = _cli("info", "--verify", str(ckpt))
    assert r.exit_code == 0, r.output
    assert "verify          ok:" in r.output
    d = json.loads(_cli("info", "--verify", "--json", str(ckpt)).output)
    assert d["verify"]["ok"] and d["verify"]["problems"] == []
    assert d["verify"]["checked_files"] == len(read_config(ckpt)["edge0"]["sha256"])


def test_verify_finds_a_flipped_byte(ckpt):
    path = ckpt / expert_file(2)
    start = read_header(path).entries["experts.3.up_proj.weight"].start
    with open(path, "r+b") as f:
        f.seek(start + 10)
        byte = f.read(1)
        f.seek(start + 10)
        f.write(bytes([byte[0] ^ 0x10]))
    assert _cli("info", str(ckpt)).exit_code == 0  # the headers are still valid
    r = _cli("info", "--verify", str(ckpt))
    assert r.exit_code == 1, r.output
    assert f"{expert_file(2)}: sha256 does not match" in r.output
    assert "Traceback" not in r.output
    r = _cli("info", "--verify", "--json", str(ckpt))
    assert r.exit_code == 1
    problems = json.loads(r.output[: r.output.rindex("}") + 1])["verify"]["problems"]
    assert [p["file"] for p in problems] == [expert_file(2)]


def test_verify_finds_nan_written_into_scales(ckpt):
    _poke(ckpt / expert_file(1), "experts.2.down_proj.scales", b"\xc0\x7f\x80\x7f")  # bf16 NaN, inf
    r = _cli("info", "--verify", str(ckpt))
    assert r.exit_code == 1, r.output
    assert f"{expert_file(1)}: experts.2.down_proj.scales: 2 non-finite values (NaN/inf)" in r.output
    assert f"{expert_file(1)}: sha256 does not match" in r.output


def test_verify_of_a_checkpoint_without_checksums(ckpt):
    config = read_config(ckpt)
    del config["edge0"]["sha256"]
    (ckpt / "config.json").write_text(json.dumps(config))
    r = _cli("info", "--verify", str(ckpt))
    assert r.exit_code == 0, r.output
    assert "no checksums recorded; re-convert to get them" in r.output


def test_verify_of_the_default_model():
    r = _cli("info", "--verify", str(default_model.default_checkpoint()))
    assert r.exit_code == 0, r.output
    assert "no checksums recorded" not in r.output
    assert "verify          ok: 16 files match their recorded sha256" in r.output, r.output
    assert "not covered" not in r.output  # generation_config.json (sampling settings) is covered too
    assert "generations agree" in r.output


def test_heads_written_later_keep_checksum_and_generation(ckpt):
    r = _cli("heads", "init", str(ckpt))
    assert r.exit_code == 0, r.output
    section = read_config(ckpt)["edge0"]
    heads = ckpt / "prerouter.safetensors"
    assert section["sha256"]["prerouter.safetensors"] == hashlib.sha256(heads.read_bytes()).hexdigest()
    assert read_header(heads).metadata["generation"] == section["generation"]
    assert _cli("info", "--verify", str(ckpt)).exit_code == 0
    _poke(heads, "heads.1.fc1.bias", b"\x00\x00\xc0\x7f")  # float32 NaN
    r = _cli("info", "--verify", str(ckpt))
    assert r.exit_code == 1, r.output
    assert "prerouter.safetensors: sha256 does not match" in r.output
    assert "prerouter.safetensors: heads.1.fc1.bias: 1 non-finite value" in r.output


# --- generations --------------------------------------------------------------


def test_a_file_from_another_conversion_is_refused(ckpt, converted, tmp_path):
    other = tmp_path / "other"
    convert(converted("qwen3_moe").source, other, QUIET)  # same weights, another generation
    shutil.copy(other / expert_file(2), ckpt / expert_file(2))
    with pytest.raises((CheckpointError, TensorFileError), match="generation") as info:
        mlx_edge0.load_model(ckpt)
    assert expert_file(2) in str(info.value)
    r = _cli("generate", "--model", str(ckpt), "--max-tokens", "2")
    assert r.exit_code == 1 and expert_file(2) in r.output and "Traceback" not in r.output
    r = _cli("info", str(ckpt))
    assert r.exit_code == 1 and expert_file(2) in r.output


RACE_SECONDS = 10

CONVERT_LOOP = textwrap.dedent("""
    import sys, time
    from mlx_edge0.conversions import ConvertOptions, convert
    a, b, out, seconds = sys.argv[1:]
    deadline = time.monotonic() + float(seconds)
    n = 0
    while time.monotonic() < deadline:
        convert((a, b)[n % 2], out, ConvertOptions(force=True, show_progress=False))
        n += 1
        print(n, flush=True)
""")


def _fingerprints(src: Path, layers) -> dict[str, bytes]:
    """What a loaded model must hold when it holds ``src``: resident embedding
    and expert 0's gate weight of every MoE layer."""
    weights = mx.load(str(src / "model.safetensors"))
    prints = {"resident": np.array(weights["model.embed_tokens.weight"]).tobytes()}
    for layer in layers:
        prints[f"layer {layer}"] = np.array(weights[SWITCH.format(layer, "gate_proj", "weight")][0]).tobytes()
    return prints


def _loaded_prints(model, layers) -> dict[str, bytes]:
    prints = {"resident": np.array(model.model.embed_tokens.weight).tobytes()}
    store = model.edge0_runtime.store
    for layer in layers:
        lf = store.layers[layer]
        prints[f"layer {layer}"] = os.pread(lf.fd, lf.part_bytes[0], lf.offsets[0])  # gate_proj.weight
    return prints


def test_loads_never_mix_two_conversions_while_convert_force_replaces_out(tmp_path, tokenizer_dir):
    """One process converts two different sources into OUT in turn (--force);
    this one loads OUT over and over: every load holds one source, whole. A
    load that saw a replacement in every one of its attempts (a busy machine
    slows loads more than the loop's swaps) must say so, as the clear
    CheckpointError, and nothing else may fail."""
    layers = (1, 2, 3)
    sources = []
    for seed in (0, 1):
        model, config = tiny.build_tiny_model("qwen3_moe", seed=seed)
        sources.append(tiny.save_mlx(model, config, tmp_path / f"src{seed}", tokenizer_dir, bits=4))
    expected = [_fingerprints(s, layers) for s in sources]
    out = tmp_path / "out"
    convert(sources[0], out, QUIET)
    proc = subprocess.Popen(
        [sys.executable, "-c", CONVERT_LOOP, str(sources[0]), str(sources[1]), str(out), str(RACE_SECONDS)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    loads, mixed, failed = 0, [], []
    try:
        deadline = time.monotonic() + RACE_SECONDS
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                model = mlx_edge0.load_model(out, cache_gib=0)
            except CheckpointError as e:
                if "was replaced during each of" not in str(e):
                    failed.append(f"CheckpointError: {e}")
                continue
            except Exception as e:  # noqa: BLE001 - counted and reported below
                failed.append(f"{type(e).__name__}: {e}")
                continue
            got = _loaded_prints(model, layers)
            model.edge0_runtime.store.close()
            loads += 1
            held = {part: [i for i, want in enumerate(expected) if want[part] == value] for part, value in got.items()}
            if len({tuple(v) for v in held.values()}) != 1 or any(len(v) != 1 for v in held.values()):
                mixed.append(held)
    finally:
        proc.wait(timeout=RACE_SECONDS + 60)
    swaps = len(proc.stdout.read().split())
    assert proc.returncode == 0, proc.stderr.read()[-2000:]
    assert swaps >= 2 and loads >= 5, (swaps, loads)
    assert not mixed, f"{len(mixed)} of {loads} loads mixed the two conversions: {mixed[:3]}"
    assert not failed, f"{len(failed)} loads failed: {failed[:3]}"


def test_adapters_carry_the_generation_and_their_checksums(ckpt, converted, tmp_path):
    """Adapters saved into the checkpoint are verified like the heads; saved
    elsewhere they leave its config.json alone; copied in, they are named as
    not covered."""
    from mlx_edge0 import lora

    model = mlx_edge0.load_model(ckpt, cache_gib=0)
    lora.attach(model, tuple(lora.lora_targets(model)))
    outside = tmp_path / "run"
    before = (ckpt / "config.json").read_bytes()
    lora.save_adapters(outside, model, ckpt, lora.consumer_k(model))
    assert (ckpt / "config.json").read_bytes() == before
    lora.save_adapters(ckpt, model, ckpt, lora.consumer_k(model))
    config = read_config(ckpt)
    assert read_header(ckpt / lora.ADAPTERS_FILE).metadata["generation"] == config["edge0"]["generation"]
    for name in (lora.ADAPTERS_FILE, lora.ADAPTER_CONFIG_FILE):
        assert config["edge0"]["sha256"][name] == sha256_file(ckpt / name)
        assert filecmp.cmp(ckpt / name, outside / name, shallow=False)
    r = _cli("info", "--verify", str(ckpt))
    assert r.exit_code == 0, r.output
    assert "not covered" not in r.output

    with open(ckpt / lora.ADAPTER_CONFIG_FILE, "a") as f:  # still valid JSON, other bytes
        f.write(" ")
    r = _cli("info", "--verify", str(ckpt))
    assert r.exit_code == 1, r.output
    assert "adapter_config.json: sha256 does not match the one recorded in config.json" in r.output

    copied_in = tmp_path / "copied-in"  # the same conversion, adapters copied in by hand
    shutil.copytree(converted("qwen3_moe").edge0, copied_in)
    for name in (lora.ADAPTERS_FILE, lora.ADAPTER_CONFIG_FILE):
        shutil.copy(outside / name, copied_in / name)
    r = _cli("info", "--verify", str(copied_in))
    assert r.exit_code == 0, r.output
    assert "not covered     adapter_config.json, adapters.safetensors" in r.output

    other = tmp_path / "other"
    convert(converted("qwen3_moe").source, other, QUIET)  # same weights, another generation
    for name in (lora.ADAPTERS_FILE, lora.ADAPTER_CONFIG_FILE):
        shutil.copy(outside / name, other / name)
    with pytest.raises(CheckpointError, match=r"adapters\.safetensors: generation"):
        mlx_edge0.load_model(other, cache_gib=0)
    lora.read_adapters(other, outside)  # kept outside the checkpoint, they may outlive a re-convert


def test_a_checkpoint_replaced_during_every_load_fails_clearly(ckpt):
    from mlx_edge0.integrity import load_consistently

    def replaced_meanwhile():
        config = read_config(ckpt)
        config["edge0"]["generation"] += "0"
        (ckpt / ".config.new").write_text(json.dumps(config))
        os.replace(ckpt / ".config.new", ckpt / "config.json")
        raise TensorFileError(f"{ckpt / expert_file(1)}: file not found")

    with pytest.raises(CheckpointError, match=r"config\.json: the checkpoint was replaced during each of 8 loads"):
        load_consistently(ckpt, replaced_meanwhile)
    with pytest.raises(TensorFileError, match="file not found"):  # unchanged: the error itself
        load_consistently(ckpt, lambda: (_ for _ in ()).throw(TensorFileError("file not found")))


def test_checksums_may_only_name_files_inside_the_checkpoint(ckpt):
    config = read_config(ckpt)
    config["edge0"]["sha256"]["../../etc/passwd"] = "0" * 64
    (ckpt / "config.json").write_text(json.dumps(config))
    r = _cli("info", "--verify", str(ckpt))
    assert r.exit_code == 1 and "edge0.sha256 names files outside the checkpoint" in r.output
