"""Workload, trace and hardware files that cannot be read as given: binary bytes, nesting past the parser's
depth, a folder or a pipe where a file belongs, fields of the wrong type and sizes past what the token rules
compute exactly. Each is refused in one line naming the file and the field (exit status 2), never a
traceback."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from cli_errors import invoke, one_error_line

pytestmark = pytest.mark.timeout(180)
SIM = ("simulate", "--system", "homogeneous", "--gpus", "8", "--workload", "text_only")
SPEC = """name = "w"
description = "one text source"
total_steps = 10
max_sample_tokens = 16384

[sources.chat]
description = "chat"
text_tokens = {dist}

[schedule]
kind = "constant"
weights = {{ chat = 1.0 }}
"""




def write(path: Path, data: str | bytes) -> Path:
    path.write_bytes(data if isinstance(data, bytes) else data.encode())
    return path


# -- workload spec files --------------------------------------------------------------------------------------
def test_a_binary_workload_file_is_named_not_a_decoding_traceback(tmp_path):
    path = write(tmp_path / "w.toml", b"\xff\xfe\x00name = 1\n")
    one_error_line(invoke("workloads", "show", str(path)), str(path), "not text")


def test_a_workload_nested_past_the_parser_depth_is_one_line(tmp_path):
    path = write(tmp_path / "w.json", "[" * 5000 + "]" * 5000)
    one_error_line(invoke("workloads", "show", str(path)), str(path), "nested too deeply")


def test_a_folder_given_as_a_workload_is_called_a_folder(tmp_path):
    path = tmp_path / "w.toml"
    path.mkdir()
    one_error_line(invoke("workloads", "show", str(path)), str(path), "is a folder")


def test_a_pipe_given_as_a_workload_is_not_called_missing(tmp_path):
    path = tmp_path / "w.toml"
    os.mkfifo(path)
    one_error_line(invoke("workloads", "show", str(path)), str(path), "not a regular file")


@pytest.mark.parametrize(("bound", "shown"), [('"abc"', "'abc'"), ("true", "True"), ("1e400", "inf")])
def test_a_distribution_bound_must_be_a_finite_number(tmp_path, bound, shown):
    path = write(tmp_path / "w.toml", SPEC.format(dist=f'{{ kind = "uniform", low = 10, high = 100, min = {bound} }}'))
    one_error_line(invoke("workloads", "show", str(path)), str(path),
                   f"sources.chat.text_tokens.min: expected a finite number, got {shown}")


@pytest.mark.parametrize(("dist", "needle"), [
    ('{ kind = "quantiles", knots = { "0" = 10, "1" = "abc" } }', "text_tokens.knots: expected finite numbers"),
    ('{ kind = "buckets", edges = [1, true, 100], weights = [0.5, 0.5] }', "text_tokens.edges: expected finite"),
    ('{ kind = "buckets", edges = 5, weights = [1.0] }', "text_tokens.edges: expected a list of numbers"),
    ('{ kind = "choice", values = ["a", 2] }', "text_tokens.values: expected finite numbers"),
])
def test_distribution_lists_hold_numbers(tmp_path, dist, needle):
    path = write(tmp_path / "w.toml", SPEC.format(dist=dist))
    one_error_line(invoke("workloads", "show", str(path)), str(path), needle)


def test_distribution_bounds_that_are_numbers_still_apply(tmp_path):
    path = write(tmp_path / "w.toml", SPEC.format(dist='{ kind = "uniform", low = 10, high = 100, max = 50 }'))
    r = invoke("workloads", "show", str(path))
    assert r.exit_code == 0, r.output


# -- JSONL traces ---------------------------------------------------------------------------------------------
def trace(tmp_path: Path, segment: str) -> Path:
    return write(tmp_path / "t.jsonl", '{"segments": [{"modality": "text", "tokens": 5}]}\n'
                 f'{{"segments": [{segment}]}}\n')


@pytest.mark.parametrize(("segment", "needle"), [
    ('{"modality": "text", "tokens": 100000000000000000000}', "segments[0].tokens: expected an integer in [0, "),
    ('{"modality": "text", "tokens": 1e20}', "segments[0].tokens: expected an integer in [0, "),
    ('{"modality": "image", "width": 100000000000000000000, "height": 10}', "segments[0].width: expected an integer"),
    ('{"modality": "image", "width": 1e20, "height": 10}', "segments[0].width: expected an integer"),
    ('{"modality": "image", "width": 65536, "height": 65536}', "segments[0].width: width x height must be at most"),
    ('{"modality": "audio", "seconds": 1e300}', "segments[0].seconds: expected a number of seconds in (0, "),
    ('{"modality": "video", "width": 64, "height": 64, "seconds": 1e7}', "segments[0].seconds: expected a number"),
])
def test_trace_sizes_past_the_token_rules_are_refused_naming_line_and_field(tmp_path, segment, needle):
    path = trace(tmp_path, segment)
    one_error_line(invoke("workloads", "show", str(path)), f"{path}:2: {needle}")


def test_a_trace_integer_of_thousands_of_digits_is_one_line(tmp_path):
    path = trace(tmp_path, '{"modality": "text", "tokens": 1' + "0" * 5000 + "}")
    one_error_line(invoke("workloads", "show", str(path)), f"{path}:2: not valid JSON")


def test_a_trace_nested_past_the_parser_depth_is_one_line(tmp_path):
    path = write(tmp_path / "t.jsonl", "[" * 100_000 + "]" * 100_000 + "\n")
    one_error_line(invoke("workloads", "show", str(path)), f"{path}:1: not valid JSON (nested too deeply)")


def test_a_binary_trace_is_named_not_a_decoding_traceback(tmp_path):
    path = write(tmp_path / "t.jsonl", b"\xff\xfe{}\n")
    one_error_line(invoke("workloads", "show", str(path)), str(path), "not text")


def test_a_trace_at_the_bounds_is_read(tmp_path):
    from workloads.trace import load_trace

    path = write(tmp_path / "t.jsonl", '{"segments": [{"modality": "text", "tokens": 16777216}, '
                 '{"modality": "image", "width": 32768, "height": 32768}, '
                 '{"modality": "video", "width": 64, "height": 64, "seconds": 1000000, "audio": true}]}\n')
    assert len(load_trace(path).trace) == 1


# -- hardware files -------------------------------------------------------------------------------------------
def test_a_binary_hardware_file_is_named(tmp_path):
    path = write(tmp_path / "hw.toml", b"\xff\xfe\x00[gpu]\n")
    one_error_line(invoke(*SIM, "--hardware", str(path)), str(path), "not text")


@pytest.mark.parametrize(("name", "text"), [
    ("hw.toml", "a = " + "{b = " * 5000 + "1" + "}" * 5000 + "\n"),
    ("hw.yaml", "a: " + "[" * 5000 + "]" * 5000 + "\n"),
], ids=["toml", "yaml"])
def test_a_hardware_file_nested_past_the_parser_depth_is_one_line(tmp_path, name, text):
    path = write(tmp_path / name, text)
    one_error_line(invoke(*SIM, "--hardware", str(path)), str(path), "nested too deeply")


def test_a_folder_given_as_hardware_is_called_a_folder(tmp_path):
    path = tmp_path / "hw.toml"
    path.mkdir()
    one_error_line(invoke(*SIM, "--hardware", str(path)), str(path), "is a folder")
