"""Configuration: defaults, the TOML file, SPECLANES_* variables and --set, in that order."""

from __future__ import annotations

import tomllib
from pathlib import Path
from urllib.parse import urlsplit

import msgspec
import pytest

from pipeline.protocol.config import COMPONENTS, Config, ConfigError, default_run_dir, load_config

OPS = Path(__file__).resolve().parent.parent / "ops"
NAMES = ("client", "control", "data", "verify", "draft", "audit")


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "speclanes.toml"
    path.write_text(text)
    return path


def all_strings(node: object) -> list[str]:
    if isinstance(node, dict):
        return [s for v in node.values() for s in all_strings(v)]
    if isinstance(node, list):
        return [s for v in node for s in all_strings(v)]
    return [node] if isinstance(node, str) else []


def test_defaults_expand_the_run_dir():
    config = load_config(environ={})
    run_dir = default_run_dir()
    assert config.run.dir == run_dir
    assert config.addresses.verify == f"ipc://{run_dir}/verify.ipc"
    assert config.addresses.client == f"ipc://{run_dir}/client.ipc"
    assert config.audit.path == f"{run_dir}/audit.sqlite"
    assert not any("{run_dir}" in s for s in all_strings(msgspec.to_builtins(config)))
    assert config.run.components == list(COMPONENTS)
    assert config.processes() == list(COMPONENTS)
    assert (config.gateway.enabled, config.gateway.host) == (True, "127.0.0.1")
    assert config.speculation.k == "auto" and config.speculation.drafter == "auto"


def test_run_dir_from_the_file_reaches_every_address(tmp_path):
    path = write(tmp_path, f'[run]\ndir = "{tmp_path}/run"\n')
    config = load_config(path, environ={})
    assert config.run.dir == f"{tmp_path}/run"
    for name in NAMES:
        assert getattr(config.addresses, name) == f"ipc://{tmp_path}/run/{name}.ipc"
    assert config.audit.path == f"{tmp_path}/run/audit.sqlite"


def test_toml_file_values(tmp_path):
    path = write(
        tmp_path,
        """
        [run]
        components = ["verify"]
        heartbeat_seconds = 2.0
        [speculation]
        drafter = "ngram"
        k = 3
        k_max = 8
        [addresses]
        verify = "tcp://gpu.example:7001"
        [timeouts]
        draft = 0.25
        [audit]
        path = "/var/lib/speclanes/audit.sqlite"
        """,
    )
    config = load_config(path, environ={})
    assert config.run.components == ["verify"]
    assert config.run.heartbeat_seconds == 2.0
    assert (config.speculation.drafter, config.speculation.k, config.speculation.k_max) == ("ngram", 3, 8)
    assert config.addresses.verify == "tcp://gpu.example:7001"
    assert config.addresses.draft.endswith("/draft.ipc")  # untouched keys keep their defaults
    assert config.timeouts.draft == 0.25 and config.timeouts.verify == 10.0
    assert config.audit.path == "/var/lib/speclanes/audit.sqlite"


def test_environment_overrides_the_file(tmp_path):
    path = write(tmp_path, "[speculation]\nk = 2\ndrafter = 'suffix'\n")
    config = load_config(path, environ={"SPECLANES_SPECULATION_K": "4"})
    assert config.speculation.k == 4
    assert config.speculation.drafter == "suffix"
    env = {
        "SPECLANES_SPECULATION_K": "auto",
        "SPECLANES_RUN_COMPONENTS": '["draft", "audit"]',
        "SPECLANES_MODEL_PATH": "/models/target.gguf",
        "SPECLANES_TIMEOUTS_VERIFY": "2.5",
        "SPECLANES_NOT_A_SETTING": "1",
    }
    config = load_config(path, environ=env)
    assert config.speculation.k == "auto"
    assert config.run.components == ["draft", "audit"]
    assert config.model.path == "/models/target.gguf"
    assert config.timeouts.verify == 2.5


def test_set_overrides_beat_the_environment(tmp_path):
    path = write(tmp_path, "[speculation]\nk = 2\n")
    env = {"SPECLANES_SPECULATION_K": "4", "SPECLANES_SPECULATION_DRAFTER": "ngram"}
    config = load_config(path, ["speculation.k=6", "listen.verify = tcp://0.0.0.0:7001"], environ=env)
    assert config.speculation.k == 6
    assert config.speculation.drafter == "ngram"
    assert config.listen.verify == "tcp://0.0.0.0:7001"
    # The last --set of a key wins.
    assert load_config(None, ["speculation.k=1", "speculation.k=7"], environ={}).speculation.k == 7


def test_bind_prefers_the_listen_override():
    config = load_config(None, ["listen.verify=tcp://0.0.0.0:7001"], environ={})
    assert config.bind("verify") == "tcp://0.0.0.0:7001"
    assert config.addresses.verify != config.bind("verify")
    assert config.bind("draft") == config.addresses.draft
    assert config.bind("draft").startswith("ipc://")


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("[nope]\nx = 1\n", "unknown field `nope`"),
        ("[speculation]\nfoo = 1\n", "unknown field `foo`"),
        ("[speculation]\ndrafter = 'magic'\n", "'magic'"),
        ("[run]\ncomponents = ['web']\n", "'web'"),
        ("[speculation]\nk = 40\n", "speculation.k must be 0..32 or 'auto', got 40"),
        ("[speculation]\nk = -1\n", "speculation.k must be 0..32"),
        ("[speculation]\nk = 'sometimes'\n", "speculation.k"),
        ("[speculation]\nk_max = 0\n", "speculation.k_max must be 1..32, got 0"),
        ("[timeouts]\ndraft = 'soon'\n", "timeouts.draft"),
        ("speculation = 3\n", "speculation"),
    ],
)
def test_invalid_file_values_are_a_config_error(tmp_path, text, problem):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as caught:
        load_config(path, environ={})
    assert problem in str(caught.value)
    assert str(path) in str(caught.value)


def test_a_disabled_gateway_is_not_started_even_when_listed():
    config = load_config(None, ["gateway.enabled=false"], environ={})
    assert "gateway" in config.run.components and "gateway" not in config.processes()
    assert load_config(None, ['run.components=["verify", "gateway"]'], environ={}).processes() == [
        "verify",
        "gateway",
    ]
    with pytest.raises(ConfigError, match=r"gateway\.port must be 1\.\.65535"):
        load_config(None, ["gateway.port=0"], environ={})


def test_invalid_toml_is_a_config_error(tmp_path):
    path = write(tmp_path, "[speculation\nk = \n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(path, environ={})


def test_missing_file_is_a_config_error(tmp_path):
    missing = tmp_path / "absent.toml"
    with pytest.raises(ConfigError, match=r"cannot read config .*absent\.toml: No such file"):
        load_config(missing, environ={})


@pytest.mark.parametrize(
    ("overrides", "environ", "problem"),
    [
        (["nope.x=1"], {}, "unknown setting 'nope.x'"),
        (["speculation=1"], {}, "unknown setting 'speculation'"),
        (["speculation.k"], {}, "--set takes section.key=value"),
        (["speculation.foo=1"], {}, "unknown field `foo`"),
        (["speculation.k=99"], {}, "speculation.k must be 0..32"),
        ([], {"SPECLANES_SPECULATION_DRAFTER": "magic"}, "'magic'"),
        ([], {"SPECLANES_SPECULATION_K": "33"}, "speculation.k must be 0..32"),
        (["restart.max_restarts=-1"], {}, "restart.max_restarts must be >= 0"),
        (["restart.within_seconds=0"], {}, "within_seconds > 0"),
    ],
)
def test_invalid_overrides_are_a_config_error(overrides, environ, problem):
    with pytest.raises(ConfigError) as caught:
        load_config(None, overrides, environ=environ)
    assert problem in str(caught.value)


# --- the example configurations in ops/ -----------------------------------------------


def test_single_host_example_shows_every_setting_with_its_default():
    path = OPS / "speclanes.toml"
    raw = tomllib.loads(path.read_text())
    # TOML has no null: a setting whose default is None (speculation.max_iterations) is shown commented out.
    defaults = {
        section: {key: value for key, value in values.items() if value is not None}
        for section, values in msgspec.to_builtins(Config()).items()
    }
    assert set(raw) == set(defaults)
    for section, values in defaults.items():
        assert set(raw[section]) == set(values), section
    assert raw == defaults
    assert load_config(path, environ={}) == load_config(None, environ={})


@pytest.fixture(scope="module")
def hosts() -> tuple[Config, Config]:
    return (
        load_config(OPS / "multihost" / "host-a.toml", environ={}),
        load_config(OPS / "multihost" / "host-b.toml", environ={}),
    )


def test_multihost_examples_split_the_components(hosts):
    a, b = hosts
    assert a.run.components == ["orchestrator", "draft", "audit", "gateway"]
    assert b.run.components == ["verify"]
    assert sorted(a.run.components + b.run.components) == sorted(COMPONENTS)


def test_multihost_examples_dial_the_same_tcp_addresses(hosts):
    a, b = hosts
    assert a.addresses == b.addresses
    owner = {"verify": "host-b.example"} | {
        name: "host-a.example" for name in ("client", "control", "data", "draft", "audit")
    }
    for name, host in owner.items():
        url = urlsplit(getattr(a.addresses, name))
        assert (url.scheme, url.hostname) == ("tcp", host), name
        assert url.port is not None
    ports = [urlsplit(getattr(a.addresses, name)).port for name in NAMES]
    assert len(set(ports)) == len(ports)
    assert a.model.path == b.model.path


def test_multihost_examples_bind_what_each_host_serves(hosts):
    b = hosts[1]
    served = {"orchestrator": ("client", "control", "data"), "draft": ("draft",), "audit": ("audit",)}
    served["verify"] = ("verify",)
    served["gateway"] = ()  # HTTP on [gateway], no nng inbox
    for config in hosts:
        mine = {name for component in config.run.components for name in served[component]}
        for name in NAMES:
            bind = config.bind(name)
            if name in mine:
                url = urlsplit(bind)
                assert (url.scheme, url.hostname) == ("tcp", "0.0.0.0"), (name, bind)
                assert url.port == urlsplit(getattr(config.addresses, name)).port
            else:
                assert getattr(config.listen, name) == "", name
    assert b.bind("verify") == "tcp://0.0.0.0:" + str(urlsplit(b.addresses.verify).port)
