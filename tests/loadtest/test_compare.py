"""loadtest.compare's arguments: a wrong --llama-server or --model fails before any server starts;
both servers get the same threads, and ours the CPU unless told otherwise."""
from __future__ import annotations

import pytest

import argparse

from loadtest.compare import build_parser, check_executable, main, resolve_model, server_commands


def test_llama_server_must_be_an_executable_file(tmp_path):
    program = tmp_path / "llama-server"
    program.write_text("#!/bin/sh\n")
    with pytest.raises(ValueError, match="no executable file"):
        check_executable(str(program))  # not executable yet
    program.chmod(0o755)
    assert check_executable(str(program)) == program
    for wrong in ("", str(tmp_path), str(tmp_path / "missing")):  # "": a failed $(...) in the shell
        with pytest.raises(ValueError, match="no executable file"):
            check_executable(wrong)


def test_missing_llama_server_exits_with_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--llama-server", "/nonexistent/llama-server"])
    assert exit_info.value.code == 2
    assert "/nonexistent/llama-server" in capsys.readouterr().err


def test_model_is_a_file_or_a_known_shape_and_type(tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"")
    assert resolve_model(str(model)) == model
    for wrong in (str(tmp_path / "missing.gguf"), "smollm2-9b:q4_0", "smollm2-360m:q2_k"):
        with pytest.raises(ValueError, match="no such file, nor SHAPE:TYPE"):
            resolve_model(wrong)


def test_both_servers_get_the_same_threads_and_ours_the_cpu_by_default():
    args = argparse.Namespace(model="m.gguf", llama_server="/bin/llama-server", quantization="auto", threads=8,
                              device="cpu", ctx=4096, slots=16)
    ours, theirs = server_commands(args, 8000).values()
    # --device auto would take a GPU where there is one, against llama-server's CPU build.
    assert ours[ours.index("--device") + 1] == "cpu"
    assert ours[ours.index("--num-threads") + 1] == theirs[theirs.index("-t") + 1] == "8"
    args.device = "cuda:1"
    assert "cuda:1" in server_commands(args, 8000)["pagedserve"]



def test_device_defaults_to_cpu():
    assert build_parser().parse_args([]).device == "cpu"
