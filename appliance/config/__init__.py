"""Configuration: typed sections (schema) and the one place YAML becomes config (loader)."""

from appliance.config.loader import (
    ENV_CONFIG_FILE,
    config_to_dict,
    dump_config,
    env_overrides,
    load_config,
    parse_set,
)
from appliance.config.schema import (
    SECTIONS,
    AppConfig,
    GraphsConfig,
    RuntimeSection,
    ServerConfig,
    TelemetryConfig,
)
from engine.config import ConfigError

__all__ = [
    "SECTIONS",
    "AppConfig",
    "ConfigError",
    "ENV_CONFIG_FILE",
    "GraphsConfig",
    "RuntimeSection",
    "ServerConfig",
    "TelemetryConfig",
    "config_to_dict",
    "dump_config",
    "env_overrides",
    "load_config",
    "parse_set",
]
