"""YAML config loading: defaults, overrides, environment, and errors that name the key."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from appliance.config import (
    SECTIONS,
    AppConfig,
    ConfigError,
    config_to_dict,
    dump_config,
    load_config,
)
from engine.config import RuntimeConfig

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_YAML = ROOT / "config" / "default.yaml"


def test_default_yaml_loads_to_exactly_the_dataclass_defaults():
    assert load_config(DEFAULT_YAML) == AppConfig()


def test_default_yaml_lists_every_key_of_every_section():
    data = yaml.safe_load(DEFAULT_YAML.read_text())
    assert list(data) == list(SECTIONS)
    for section, cls in SECTIONS.items():
        assert list(data[section]) == [f.name for f in dataclasses.fields(cls)], section


def test_default_yaml_comments_every_key():
    lines = DEFAULT_YAML.read_text().splitlines()
    for i, line in enumerate(lines):
        if line.startswith("  ") and not line.lstrip().startswith("#") and ":" in line:
            assert lines[i - 1].lstrip().startswith("#"), f"no comment above: {line.strip()}"


def test_graphs_defaults_match_the_engine_runtime_defaults():
    rt = AppConfig().engine_config().runtime
    assert rt == RuntimeConfig()


@pytest.mark.parametrize("name", ["cpu.yaml", "h200-llama3-8b.yaml"])
def test_examples_load(name):
    cfg = load_config(ROOT / "config" / "examples" / name)
    assert cfg.engine_config() is not None


def test_yaml_file_values_apply_and_tuples_come_from_lists(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text(
        "scheduler: {max_num_seqs: 7}\ngraphs: {capture_sizes: [1, 2, 4]}\n"
        "server: {api_keys: [k1, k2], cors_origins: ['*']}\n"
    )
    cfg = load_config(f)
    assert cfg.scheduler.max_num_seqs == 7
    assert cfg.graphs.capture_sizes == (1, 2, 4)
    assert cfg.engine_config().runtime.capture_sizes == (1, 2, 4)
    assert cfg.server.api_keys == ("k1", "k2")


def test_precedence_is_file_then_env_then_set(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("scheduler:\n  max_num_seqs: 7\n  max_queue_len: 9\ncache:\n  block_size: 32\n")
    env = {"APPLIANCE_SCHEDULER__MAX_NUM_SEQS": "64", "APPLIANCE_SCHEDULER__MAX_QUEUE_LEN": "10"}
    cfg = load_config(f, ["scheduler.max_num_seqs=65"], env)
    assert cfg.scheduler.max_num_seqs == 65
    assert cfg.scheduler.max_queue_len == 10
    assert cfg.cache.block_size == 32


def test_set_values_are_yaml_parsed():
    cfg = load_config(
        overrides=[
            "model.max_model_len=null",
            "cache.enable_prefix_caching=false",
            "cache.memory_fraction=0.5",
            "graphs.capture_sizes=[1, 8]",
            "server.api_keys=a,b",
            "telemetry.otlp_headers.authorization=Bearer x",
        ]
    )
    assert cfg.model.max_model_len is None
    assert cfg.cache.enable_prefix_caching is False
    assert cfg.cache.memory_fraction == 0.5
    assert cfg.graphs.capture_sizes == (1, 8)
    assert cfg.server.api_keys == ("a", "b")
    assert cfg.telemetry.otlp_headers == {"authorization": "Bearer x"}


def test_a_word_with_colons_is_the_string_typed_not_a_mapping():
    """`:memory:` (SQLite's in-memory store) reads as a YAML mapping; on the command line
    and in the environment it is the word typed, while `{k: v}` and `k: v` stay mappings."""
    env = {"APPLIANCE_RESPONSES__STORE_PATH": ":memory:"}
    assert load_config(None, [], env).responses.store_path == ":memory:"
    cfg = load_config(overrides=["responses.store_path=:memory:"])
    assert cfg.responses.store_path == ":memory:"
    cfg = load_config(overrides=["telemetry.otlp_headers={a: b}"])
    assert cfg.telemetry.otlp_headers == {"a": "b"}


def test_config_file_from_environment(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("server: {http_port: 9001}\n")
    assert load_config(environ={"APPLIANCE_CONFIG": str(f)}).server.http_port == 9001


def test_env_without_double_underscore_is_ignored():
    assert load_config(environ={"APPLIANCE_FOO": "1", "APPLIANCE_CONFIG": ""}) == AppConfig()


@pytest.mark.parametrize(
    "override, key, reason",
    [
        ("scheduler.max_num_seqs=abc", "scheduler.max_num_seqs", "expected an integer"),
        ("scheduler.max_num_seqs=0", "scheduler.max_num_seqs", "must be >= 1"),
        ("scheduler.max_num_seqs=true", "scheduler.max_num_seqs", "expected an integer"),
        ("scheduler.max_num_seqs=1.5", "scheduler.max_num_seqs", "expected an integer"),
        ("scheduler.policy=lifo", "scheduler.policy", "must be one of"),
        ("scheduler.nope=1", "scheduler.nope", "unknown key"),
        ("nope.key=1", "nope.key", "unknown section"),
        ("cache.block_size=24", "cache.block_size", "power of two"),
        ("cache.memory_fraction=1.5", "cache.memory_fraction", "(0, 1]"),
        ("cache.enable_prefix_caching=1", "cache.enable_prefix_caching", "expected a boolean"),
        ("graphs.capture_sizes=[0, 2]", "graphs.capture_sizes", "positive integers"),
        ("graphs.capture_sizes=[a]", "graphs.capture_sizes[0]", "expected an integer"),
        ("runtime.device=tpu", "runtime.device", "must be auto"),
        ("server.http_port=70000", "server.http_port", "[0, 65535]"),
        ("server.grpc_port=8000", "server.grpc_port", "must differ"),
        ("server.max_request_body=10", "server.max_request_body", ">= 1024"),
        ("telemetry.otlp_protocol=udp", "telemetry.otlp_protocol", "must be one of"),
        ("telemetry.sampling_ratio=2", "telemetry.sampling_ratio", "[0, 1]"),
        ("telemetry.log_level=loud", "telemetry.log_level", "must be one of"),
        ("model.dtype=int3", "model.dtype", "must be one of"),
        ("speculative.method=eagle", "speculative.method", "must be one of"),
        ("speculative.num_speculative_tokens=0", "speculative.num_speculative_tokens", "[1, 16]"),
        ("speculative.suffix_min_token_prob=2", "speculative.suffix_min_token_prob", "[0, 1]"),
        ("scheduler", "scheduler", "section.key=value"),
    ],
)
def test_bad_values_fail_with_the_key_path_and_reason(override, key, reason):
    with pytest.raises(ConfigError) as ei:
        load_config(overrides=[override])
    assert ei.value.key == key
    assert reason in ei.value.reason
    if "=" in override and "." in override:
        assert "(from --set)" in str(ei.value)


def test_env_errors_name_the_variable():
    with pytest.raises(ConfigError) as ei:
        load_config(environ={"APPLIANCE_SCHEDULER__MAX_NUM_SEQS": "many"})
    assert ei.value.key == "scheduler.max_num_seqs"
    assert "APPLIANCE_SCHEDULER__MAX_NUM_SEQS" in ei.value.reason


def test_file_errors_name_the_key_and_the_file(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("scheduler:\n  max_num_seqs: -1\n")
    with pytest.raises(ConfigError) as ei:
        load_config(f)
    assert ei.value.key == "scheduler.max_num_seqs" and str(f) in ei.value.reason
    f.write_text("schedulr:\n  max_num_seqs: 1\n")
    with pytest.raises(ConfigError, match="unknown section"):
        load_config(f)
    f.write_text("scheduler: [1, 2]\n")
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_config(f)
    f.write_text("scheduler: {max_num_seqs: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(f)
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")


def test_dump_round_trips_and_redacts_secrets(tmp_path):
    cfg = load_config(overrides=["server.api_keys=[s3cret]", "scheduler.max_num_seqs=3"])
    text = dump_config(cfg)
    assert "s3cret" not in text and "<redacted>" in text
    f = tmp_path / "round.yaml"
    f.write_text(dump_config(cfg, redact=False))
    assert load_config(f) == cfg
    assert config_to_dict(cfg)["scheduler"]["max_num_seqs"] == 3


def test_engine_errors_on_graphs_fields_are_named_by_their_yaml_key():
    """The engine raises some runtime.* errors only at start (LoRA with CUDA graphs); the
    user edits graphs.* in the YAML, so that is the key the message names."""
    from appliance.config.schema import yaml_key_error

    e = yaml_key_error(ConfigError("runtime.cuda_graphs", "set runtime.cuda_graphs: false"))
    assert (e.key, e.reason) == ("graphs.cuda_graphs", "set graphs.cuda_graphs: false")
    other = ConfigError("runtime.device", "bad")
    assert yaml_key_error(other) is other
