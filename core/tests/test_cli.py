"""The ``engine`` command: version, mistakes as one line, plugins list, wiring of conformance and scaffolding."""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import types
from pathlib import Path

import pytest

from engine import __version__
from engine.entrypoints import cli
from engine.entrypoints.cli import main, parse_memory
from engine_plugin_sdk.testing import build_tiny_llama
from engine_test_utils import run_cli


def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"engine {__version__}"


def test_version_subprocess_is_cheap():
    code = "import sys; from engine.entrypoints.cli import build_parser; build_parser(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


@pytest.mark.parametrize(
    "argv",
    [
        ["serve", "--port", "99999"],
        ["serve", "--port", "abc"],
        ["serve", "--kv-cache-memory", "lots"],
        ["serve", "--max-num-seqs", "0"],
        ["generate"],
        ["bench"],
        ["frobnicate"],
    ],
)
def test_usage_mistakes_are_one_line(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("engine") and "error:" in err and len(err.splitlines()) == 1


def test_no_command_prints_help_and_fails(capsys):
    assert main([]) == 2
    assert "serve" in capsys.readouterr().err


def test_bad_sampling_value_is_one_line(capsys):
    assert main(["generate", "hi", "--temperature", "-1"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --temperature") and len(err.splitlines()) == 1


def test_missing_device_plugin_names_the_install_command():
    # As if the AMD plugin were not installed (it may be, in this environment).
    result = run_cli("serve", "--device", "rocm", timeout=120, env={"ENGINE_PLUGINS_DENY": "amd,rocm,amd_rocm"})
    assert result.returncode == 1
    err = result.stderr.strip()
    assert len(err.splitlines()) == 1, err
    assert "pip install engine-plugin-amd" in err and "cpu" in err


def test_plugins_list_shows_the_cpu_plugin(capsys):
    assert main(["plugins", "list"]) == 0
    out = capsys.readouterr().out
    header, *rows = out.strip().splitlines()
    assert header.split() == ["PLUGIN", "DISTRIBUTION", "VERSION", "DEVICE", "STATUS"]
    cpu = [r for r in rows if r.split()[0] == "cpu"]
    assert cpu and cpu[0].split()[1:4] == ["engine-plugin-cpu", cpu[0].split()[2], "cpu"]
    assert cpu[0].rstrip().endswith("available")


@pytest.mark.parametrize(
    "text,expected",
    [("1000", (1000, None)), ("2GiB", (2 * 2**30, None)), ("512MB", (512 * 10**6, None)), ("1.5g", (1_500_000_000, None)),
     ("0.25", (None, 0.25)), ("64 mib", (64 * 2**20, None))],
)
def test_parse_memory(text, expected):
    assert parse_memory(text) == expected


@pytest.mark.parametrize("text", ["", "abc", "3XB", "0", "-5GiB"])
def test_parse_memory_rejects(text):
    with pytest.raises(argparse.ArgumentTypeError):
        parse_memory(text)


def test_engine_config_from_args():
    args = cli.build_parser().parse_args(
        ["serve", "--kv-cache-memory", "1GiB", "--max-num-seqs", "4", "--max-waiting-requests", "9", "--max-model-len", "128"]
    )
    config = cli.engine_config_from_args(args)
    assert config.cache.kv_cache_memory_bytes == 2**30
    assert config.scheduler.max_num_seqs == 4 and config.scheduler.max_waiting_requests == 9
    assert config.max_model_len == 128 and config.model is None and config.device == "auto"
    assert config.scheduler.async_scheduling
    sync = cli.engine_config_from_args(cli.build_parser().parse_args(["serve", "--no-async-scheduling"]))
    assert not sync.scheduler.async_scheduling
    assert config.scheduler.scheduler_delay_factor == 0.0
    delayed = cli.engine_config_from_args(cli.build_parser().parse_args(["serve", "--scheduler-delay-factor", "2.5"]))
    assert delayed.scheduler.scheduler_delay_factor == 2.5
    assert not config.parallel.enable_dbo and config.parallel.dbo_decode_token_threshold == 256
    dbo = cli.engine_config_from_args(
        cli.build_parser().parse_args(["serve", "--enable-dbo", "--dbo-decode-token-threshold", "64"])
    )
    assert dbo.parallel.enable_dbo and dbo.parallel.dbo_decode_token_threshold == 64


def test_stream_interval_option(capsys):
    assert cli.build_parser().parse_args(["serve"]).stream_interval == 1
    assert cli.build_parser().parse_args(["serve", "--stream-interval", "4"]).stream_interval == 4
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "--stream-interval", "0"])
    assert "--stream-interval" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["-1", "nan", "inf", "soon"])
def test_scheduler_delay_factor_must_be_a_finite_non_negative_number(value, capsys):
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "--scheduler-delay-factor", value])
    assert "--scheduler-delay-factor" in capsys.readouterr().err


def test_kv_cache_dtype_and_fp8_quantization_options():
    parse = cli.build_parser().parse_args
    assert cli.engine_config_from_args(parse(["serve"])).cache.kv_cache_dtype is None
    fp8 = cli.engine_config_from_args(parse(["serve", "--kv-cache-dtype", "fp8", "--quantization", "fp8"]))
    assert fp8.cache.kv_cache_dtype == "float8_e4m3fn" and fp8.quantization == "fp8"
    assert cli.engine_config_from_args(parse(["serve", "--kv-cache-dtype", "bf16"])).cache.kv_cache_dtype == "bfloat16"
    with pytest.raises(cli.CliError, match="kv_cache_dtype: .*unknown KV cache dtype"):
        cli.engine_config_from_args(parse(["serve", "--kv-cache-dtype", "int4"]))
    # vLLM's kernel-named methods, short flag included
    for name, method in (("gptq_marlin", "gptq"), ("awq_marlin", "awq"), ("moe_wna16", "auto")):
        assert cli.engine_config_from_args(parse(["serve", "-q", name])).quantization == method


@pytest.mark.parametrize(
    "options,message",
    [
        (["--kv-cache-dtype", "fp8"], "error: KV cache dtype 'float8_e4m3fn' is not supported on cpu"),
        (["--quantization", "fp8"], "error: quantization 'fp8' needs FP8 (fp8_e4m3) matmuls, which cpu does not run"),
        (["--enable-dbo"], "error: enable_dbo overlaps a step's attention with its products on two lanes, which cpu"),
    ],
)
def test_fp8_options_on_a_device_without_them_are_one_line_errors(tiny_llama_dir, options, message):
    result = run_cli("generate", "hello", "--model", tiny_llama_dir, "--device", "cpu", *options, timeout=300)
    assert result.returncode == 1
    err = result.stderr.strip()
    assert len(err.splitlines()) == 1 and err.startswith(message), err


def test_conformance_is_wired_to_the_runner(monkeypatch, tmp_path):
    calls = []
    runner = types.ModuleType("engine_conformance.runner")
    runner.run_conformance = lambda device, md, js, strict=False, workers=1: (
        calls.append((device, md, js, strict, workers)) or 3
    )
    monkeypatch.setitem(sys.modules, "engine_conformance.runner", runner)
    assert main(["conformance", "--device", "cpu", "--report", str(tmp_path / "r.md"), "--json", "r.json"]) == 3
    assert main(["conformance", "--device", "cpu", "--strict", "--workers", "4"]) == 3
    assert calls == [("cpu", str(tmp_path / "r.md"), "r.json", False, 1), ("cpu", None, None, True, 4)]
    assert main(["conformance", "--device", "cpu", "--workers", "0"]) == 1


def test_conformance_missing_runner_is_a_clear_error(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "engine_conformance.runner", None)
    assert main(["conformance", "--device", "cpu"]) == 1
    err = capsys.readouterr().err
    assert "conformance suite is not available" in err and len(err.strip().splitlines()) == 1


def test_plugin_new_is_wired_to_the_scaffold(monkeypatch, tmp_path, capsys):
    scaffold = types.ModuleType("engine_plugin_sdk.scaffold")

    def scaffold_plugin(name: str, dest_dir: str) -> Path:
        if not name.isidentifier():
            raise ValueError(f"invalid plugin name {name!r}")
        return Path(dest_dir) / f"engine-plugin-{name}"

    scaffold.scaffold_plugin = scaffold_plugin
    monkeypatch.setitem(sys.modules, "engine_plugin_sdk.scaffold", scaffold)
    assert main(["plugin", "new", "myaccel", "--dest", str(tmp_path)]) == 0
    assert str(tmp_path / "engine-plugin-myaccel") in capsys.readouterr().out
    assert main(["plugin", "new", "bad name"]) == 1
    assert "invalid plugin name" in capsys.readouterr().err


def test_bench_statistics():
    from engine.bench.report import percentile, summarize, to_json

    values = [random.uniform(0, 100) for _ in range(101)]
    ordered = sorted(values)
    assert percentile(values, 50) == ordered[50]
    assert percentile(values, 0) == ordered[0] and percentile(values, 100) == ordered[-1]
    assert percentile([1.0, 2.0], 50) == 1.5
    s = summarize(values)
    assert s["mean"] == pytest.approx(sum(values) / 101) and s["p99"] == pytest.approx(ordered[99])
    assert to_json({"x": float("nan")}).replace(" ", "").replace("\n", "") == '{"x":null}'


KVCACHE_SPACE = "ENGINE_CPU_KVCACHE_SPACE"


def test_a_bad_kvcache_space_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # the CPU plugin's variable: a bad value stops the engine at start-up with one line, the variable named
    build_tiny_llama(tmp_path, head_dim=32)
    for space in ("0", "-1", "2GiB", "nan", "inf"):
        monkeypatch.setenv(KVCACHE_SPACE, space)
        capsys.readouterr()
        code = main(["generate", "hi", "--model", str(tmp_path), "--device", "cpu", "--max-tokens", "1"])
        err = capsys.readouterr().err
        assert code == 1 and err.strip().splitlines() == [
            f"error: {KVCACHE_SPACE} must be a positive number of GiB, got {space!r}"
        ], err
