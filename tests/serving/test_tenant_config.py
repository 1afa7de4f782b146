"""`server.tenants` and friends in the YAML: refused at start when wrong (unknown fields,
weights <= 0, limits < 1, a key under two tenants, a non-default tenant without keys),
tenant keys joining `server.api_keys`, `scheduler.policy: auto` becoming fair with tenants,
tenant keys redacted by `config show`; and the appliance's one key -> tenant rule
(`appliance.tenancy.Tenancy`) with its cache salts."""

from __future__ import annotations

import pytest

from appliance.config import ConfigError, ServerConfig, dump_config, load_config
from appliance.tenancy import Tenancy, api_key_salt, parse_timeout, tenant_salt
from engine.errors import InvalidRequestError

TENANTS = "{search: {keys: [key-a]}, chat: {keys: [key-b, key-c], weight: 3, max_queued: 100}}"


def _load(*sets: str):
    return load_config(overrides=list(sets))


def test_tenants_load_and_their_keys_join_api_keys():
    cfg = _load(f"server.tenants={TENANTS}", "server.api_keys=[key-x]")
    chat = cfg.server.tenants["chat"]
    assert (chat.keys, chat.weight, chat.max_queued, chat.max_running) == (
        ("key-b", "key-c"), 3.0, 100, None,
    )  # fmt: skip
    assert cfg.server.api_keys == ("key-x", "key-a", "key-b", "key-c")
    assert cfg.engine_config().scheduler.policy == "fair"
    assert _load().engine_config().scheduler.policy == "fcfs"
    assert _load(f"server.tenants={TENANTS}", "scheduler.policy=priority").engine_config(
    ).scheduler.policy == "priority"  # fmt: skip


@pytest.mark.parametrize(
    "tenants, key, reason",
    [
        ("{a: {keys: [k1]}, b: {keys: [k2, k1]}}", "server.tenants.b.keys", "also listed under tenant 'a'"),
        ("{a: {keys: [k1], weigth: 2}}", "server.tenants.a.weigth", "unknown key"),
        ("{a: {keys: [k1], weight: 0}}", "server.tenants.a.weight", "> 0"),
        ("{a: {keys: [k1], weight: -2}}", "server.tenants.a.weight", "> 0"),
        ("{a: {keys: [k1], weight: .inf}}", "server.tenants.a.weight", "finite"),
        ("{a: {keys: [k1], max_running: 0}}", "server.tenants.a.max_running", ">= 1"),
        ("{a: {keys: [k1], tokens_per_minute: 0}}", "server.tenants.a.tokens_per_minute", ">= 1"),
        ("{a: {keys: [k1], max_queued: many}}", "server.tenants.a.max_queued", "expected an integer"),
        ("{a: {}}", "server.tenants.a.keys", "at least one API key"),
        ("{a: 3}", "server.tenants.a", "mapping of settings"),
        ("[a]", "server.tenants", "mapping of names"),
    ],
)  # fmt: skip
def test_bad_tenants_are_refused_at_start_naming_the_key(tenants, key, reason):
    with pytest.raises(ConfigError) as e:
        _load(f"server.tenants={tenants}")
    assert e.value.key == key and reason in e.value.reason
    assert "k1" not in str(e.value)  # keys are secrets: never in a message


def test_the_default_tenant_may_be_configured_without_keys():
    cfg = _load("server.tenants={default: {max_queued: 5, weight: 2}}")
    t = Tenancy(cfg.server)
    assert t.tenant_of(None).max_queued == 5 and t.tenant_of("anything").weight == 2


@pytest.mark.parametrize(
    "sets, key",
    [
        (["server.cache_salt_by_tenant=true"], "server.cache_salt_by_tenant"),
        (["server.default_request_timeout_s=0"], "server.default_request_timeout_s"),
        (["server.default_request_timeout_s=-3"], "server.default_request_timeout_s"),
        (["server.default_request_timeout_s=.nan"], "server.default_request_timeout_s"),
    ],
)
def test_other_tenant_settings_are_checked(sets, key):
    with pytest.raises(ConfigError) as e:
        _load(*sets)
    assert e.value.key == key


def test_config_show_redacts_tenant_keys():
    text = dump_config(_load(f"server.tenants={TENANTS}"))
    assert "key-a" not in text and "key-b" not in text and "<redacted>" in text
    assert "key-b" in dump_config(_load(f"server.tenants={TENANTS}"), redact=False)


def test_keys_map_to_their_tenant_and_everything_else_to_default():
    t = Tenancy(_load(f"server.tenants={TENANTS}").server)
    assert t.tenant_of("key-c").name == "chat" and t.tenant_of(b"key-a").name == "search"
    assert t.tenant_of(None).name == "default" and t.tenant_of("key-x").name == "default"
    assert t.tenant_of("key-b").weight == 3 and t.tenant_of("key-b").max_queued == 100
    assert t.tenant_of("key-b") is t.tenant_of("key-c")  # one Tenant object per tenant
    assert sorted(t.names) == ["chat", "default", "search"]


def test_salts_by_tenant_are_per_tenant_and_never_a_keys():
    cfg = _load(f"server.tenants={TENANTS}", "server.cache_salt_by_tenant=true")
    t = Tenancy(cfg.server)
    b, c, a = (t.caller(k, None, 0.0).salt for k in ("key-b", "key-c", "key-a"))
    assert b == c == (tenant_salt("chat"),) and a != b
    assert tenant_salt("chat") != api_key_salt("chat")
    assert Tenancy(ServerConfig()).caller("key-b", None, 0.0).salt == ()


@pytest.mark.parametrize("value", ["0", "-1", "inf", "-inf", "nan", "x", "", True])
def test_timeouts_must_be_positive_finite_seconds(value):
    with pytest.raises(InvalidRequestError) as e:
        parse_timeout(value, "X-Request-Timeout")
    assert e.value.param == "X-Request-Timeout"


def test_timeouts_parse():
    assert parse_timeout("2.5", "f") == 2.5 and parse_timeout(30, "f") == 30.0
