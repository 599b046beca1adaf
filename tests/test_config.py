"""kv_connector_extra_config parsing: every key, defaults, and clear errors."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vllm_dcp2d.config import KEYS, ConfigError, DCP2DConfig, markdown_table, parse_extra_config


def test_defaults():
    assert parse_extra_config(None) == parse_extra_config({}) == DCP2DConfig()


def test_all_keys():
    cfg = parse_extra_config({"bootstrap_host": "10.0.0.1", "bootstrap_port": 9000, "cp_size": 2,
                              "transfer_timeout_s": 5, "send_timeout_s": 7.5, "prefill_wait_s": 1,
                              "protocol": "rdma", "local_hostname": "node1", "stats_file": "/tmp/s.jsonl",
                              "cpu_poll_sleep_us": 0})
    assert cfg.cpu_poll_sleep_us == 0 and cfg.bootstrap_port == 9000 and cfg.cp_size == 2 and cfg.transfer_timeout_s == 5.0
    assert isinstance(cfg.transfer_timeout_s, float) and cfg.protocol == "rdma"


def test_router_discovery_needs_the_http_address():
    with pytest.raises(ConfigError, match=r"'router_discovery_address'\] = 'r:30001' needs .*'router_http_address'"):
        parse_extra_config({"router_discovery_address": "r:30001"})
    cfg = parse_extra_config({"router_discovery_address": "r:30001", "router_http_address": "10.0.0.1:8000"})
    assert (cfg.router_discovery_address, cfg.router_http_address) == ("r:30001", "10.0.0.1:8000")


def test_unknown_key_names_valid_ones():
    with pytest.raises(ConfigError, match=r"unknown .*\['bootstarp_port'\].*valid keys: \[.*'bootstrap_port'"):
        parse_extra_config({"bootstarp_port": 1})


@pytest.mark.parametrize("key,value,expect", [
    ("bootstrap_port", 0, r"int port in \[1, 65535\]"),
    ("bootstrap_port", "8998", "int port"),
    ("bootstrap_port", True, "int port"),
    ("cp_size", -1, "int >= 0"),
    ("cp_size", 1.5, "int >= 0"),
    ("transfer_timeout_s", 0, r"seconds, a number in \(0, 86400\]"),
    ("send_timeout_s", "10", "seconds"),
    ("prefill_wait_s", float("nan"), "seconds"),
    ("protocol", "udp", '"tcp", "rdma"'),
    ("bootstrap_host", "", "non-empty string"),
    ("local_hostname", 3, "non-empty string"),
    ("stats_file", 1, "file path"),
    ("cpu_poll_sleep_us", -1, r"int in \[0, 100000\] microseconds"),
    ("cpu_poll_sleep_us", 0.5, "microseconds"),
    ("cpu_start_method", "forkserver", '"spawn", "fork"'),
    ("router_discovery_address", "127.0.0.1", r'"host:port" \(port in \[1, 65535\]\) or ""'),
    ("router_discovery_address", "tcp://127.0.0.1:30001", '"host:port"'),
    ("router_http_address", "h:0", '"host:port"'),
    ("router_http_address", 8000, '"host:port"'),
])
def test_bad_values(key, value, expect):
    with pytest.raises(ConfigError, match=expect) as e:
        parse_extra_config({key: value})
    assert repr(key) in str(e.value) and repr(value) in str(e.value)


@given(st.dictionaries(st.text(min_size=1, max_size=12), st.none() | st.integers() | st.text(max_size=5),
                       max_size=4))
def test_fuzz_only_config_error(extra):
    """Any input either parses or raises ConfigError (never another exception)."""
    try:
        cfg = parse_extra_config(extra)
    except ConfigError:
        return
    assert set(extra) <= set(KEYS) and isinstance(cfg, DCP2DConfig)


def test_table_documents_every_key():
    table = markdown_table()
    for key in KEYS:
        assert f"| `{key}` |" in table


@pytest.mark.parametrize("doc", ["docs/config.md", "docs/connector.md"])
def test_docs_hold_the_current_table(doc):
    from pathlib import Path

    text = (Path(__file__).parents[1] / doc).read_text()
    assert markdown_table() in text, f"regenerate the key table in {doc} from config.markdown_table()"
