"""Configuration: defaults, the TOML file, SPECLANES_* variables and --set, in that order."""

from __future__ import annotations

import tomllib
from pathlib import Path
from urllib.parse import urlsplit

import msgspec
import pytest

from pipeline.protocol.config import COMPONENTS, Config, ConfigError, Tls, default_run_dir, load_config

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
        verify = "tls+tcp://gpu.example:7001"
        [tls]
        ca_file = "/etc/speclanes/tls/ca.pem"
        cert_file = "/etc/speclanes/tls/a.pem"
        key_file = "/etc/speclanes/tls/a.key"
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
    assert config.addresses.verify == "tls+tcp://gpu.example:7001"
    assert config.tls.ca_file == "/etc/speclanes/tls/ca.pem"
    assert config.tls.key_file == "/etc/speclanes/tls/a.key"
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
    config = load_config(path, ["speculation.k=6", "listen.verify = tcp://127.0.0.1:7001"], environ=env)
    assert config.speculation.k == 6
    assert config.speculation.drafter == "ngram"
    assert config.listen.verify == "tcp://127.0.0.1:7001"
    # The last --set of a key wins.
    assert load_config(None, ["speculation.k=1", "speculation.k=7"], environ={}).speculation.k == 7


def test_bind_prefers_the_listen_override():
    config = load_config(None, ["listen.verify=tcp://127.0.0.1:7001"], environ={})
    assert config.bind("verify") == "tcp://127.0.0.1:7001"
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
    with pytest.raises(ConfigError, match=r">= 1 - at `\$.gateway.port`"):
        load_config(None, ["gateway.port=0"], environ={})


def test_admission_limits_and_the_body_cap_are_settings_with_checked_values():
    config = load_config(None, ["admission.max_running=2", "admission.max_queued=0"], environ={})
    assert (config.admission.max_running, config.admission.max_queued) == (2, 0)
    defaults = load_config(None, environ={})
    assert (defaults.admission.max_running, defaults.admission.max_queued) == (16, 64)
    assert defaults.gateway.max_body_bytes == 1 << 20 < defaults.admission.max_message_bytes
    for bad, problem in [
        ("admission.max_running=0", r">= 1 - at `\$.admission.max_running`"),
        ("admission.max_queued=-1", r">= 0 - at `\$.admission.max_queued`"),
        ("admission.max_retained=0", r">= 1 - at `\$.admission.max_retained`"),
        ("admission.max_message_bytes=100", r">= 4096 - at `\$.admission.max_message_bytes`"),
        ("gateway.max_body_bytes=10", r">= 1024 - at `\$.gateway.max_body_bytes`"),
        ("gateway.max_choices=0", r">= 1 - at `\$.gateway.max_choices`"),
        ("gateway.port=0", r">= 1 - at `\$.gateway.port`"),
        ("gateway.port=65536", r"<= 65535 - at `\$.gateway.port`"),
        ("gateway.max_body_bytes=2097152", "must fit the orchestrator's"),  # as large as the socket's cap
    ]:
        with pytest.raises(ConfigError, match=problem):
            load_config(None, [bad], environ={})


def test_the_audit_limits_are_checked_where_they_are_declared():
    for bad, problem in [
        ("audit.prune_seconds=0", r"Expected `float` > 0.0 - at `\$.audit.prune_seconds`"),
        ("audit.batch_seconds=2", r"<= 1.0 - at `\$.audit.batch_seconds`"),
        ("audit.max_pending=0", r">= 1 - at `\$.audit.max_pending`"),
        ("audit.max_age_days=-1", r">= 0.0 - at `\$.audit.max_age_days`"),
        ("audit.max_requests=-1", r">= 0 - at `\$.audit.max_requests`"),
    ]:
        with pytest.raises(ConfigError, match=problem):
            load_config(None, [bad], environ={})
    keep = load_config(None, ["audit.max_age_days=0", "audit.max_requests=0", "audit.batch_seconds=0"], {})
    assert (keep.audit.max_age_days, keep.audit.max_requests, keep.audit.batch_seconds) == (0, 0, 0)


def test_invalid_toml_is_a_config_error(tmp_path):
    path = write(tmp_path, "[speculation\nk = \n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(path, environ={})


def test_missing_file_is_a_config_error(tmp_path):
    missing = tmp_path / "absent.toml"
    with pytest.raises(ConfigError, match=r"cannot read config .*absent\.toml: No such file"):
        load_config(missing, environ={})


# --- which addresses are allowed: pipeline/protocol/address.py ------------------------------

TLS_FILES = ["tls.ca_file=/c/ca.pem", "tls.cert_file=/c/h.pem", "tls.key_file=/c/h.key"]


@pytest.mark.parametrize(
    "setting",
    [
        "addresses.verify=tcp://gpu.example:7001",
        "addresses.client=tcp://10.0.0.2:7100",
        "addresses.data=tcp://[2001:db8::1]:7102",
        "listen.verify=tcp://0.0.0.0:7001",  # every interface
        "listen.verify=tcp://:7001",
        "listen.audit=tcp4://192.168.1.5:7001",
    ],
)
def test_plain_tcp_off_loopback_is_refused_unless_insecure_tcp(setting):
    name, _, value = setting.partition("=")
    with pytest.raises(ConfigError) as caught:
        load_config(None, [setting], environ={})
    message = str(caught.value)
    assert "\n" not in message and name in message and value in message
    assert "tls+tcp://" in message and "tls.insecure_tcp = true" in message
    config = load_config(None, [setting, "tls.insecure_tcp=true"], environ={})
    section, key = name.split(".")
    assert getattr(getattr(config, section), key) == value
    assert load_config(None, [setting], environ={"SPECLANES_TLS_INSECURE_TCP": "true"}).tls.insecure_tcp


@pytest.mark.parametrize(
    "value",
    ["tcp://127.0.0.1:7001", "tcp://127.8.9.10:7001", "tcp://localhost:7001", "tcp://LOCALHOST:7001",
     "tcp://[::1]:7001", "tcp6://[::1]:7001"],
)  # fmt: skip
def test_plain_tcp_on_loopback_needs_no_setting(value):
    config = load_config(None, [f"addresses.verify={value}", f"listen.draft={value}"], environ={})
    assert config.addresses.verify == value and config.bind("draft") == value
    assert not config.tls.insecure_tcp


def test_tls_addresses_need_the_three_files():
    setting = "addresses.verify=tls+tcp://gpu.example:7001"
    for files in ([], TLS_FILES[:2], TLS_FILES[1:]):
        with pytest.raises(
            ConfigError, match=r"addresses\.verify = 'tls\+tcp://gpu\.example:7001' needs tls\."
        ):
            load_config(None, [setting, *files], environ={})
    config = load_config(None, [setting, "listen.verify=tls+tcp://0.0.0.0:7001", *TLS_FILES], environ={})
    assert config.bind("verify") == "tls+tcp://0.0.0.0:7001"  # TLS may bind every interface
    assert (config.tls.ca_file, config.tls.cert_file, config.tls.key_file) == (
        "/c/ca.pem",
        "/c/h.pem",
        "/c/h.key",
    )


@pytest.mark.parametrize("value", ["ws://host:80/x", "inproc://x", "verify.ipc", ""])
def test_other_address_schemes_are_refused(value):
    with pytest.raises(
        ConfigError, match=r"addresses\.verify = .*use ipc://, tls\+tcp:// or \(loopback only\) tcp://"
    ):
        load_config(None, [f"addresses.verify={value}", "tls.insecure_tcp=true"], environ={})


def test_ipc_addresses_are_unchanged_and_need_no_tls(tmp_path):
    config = load_config(None, [f"addresses.verify=ipc://{tmp_path}/v.ipc"], environ={})
    assert config.addresses.verify == f"ipc://{tmp_path}/v.ipc"
    assert config.tls == Tls() and not config.tls.configured()


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
        (["restart.max_restarts=-1"], {}, r">= 0 - at `$.restart.max_restarts`"),
        (["restart.within_seconds=0"], {}, r"> 0.0 - at `$.restart.within_seconds`"),
        (["restart.hang_seconds=-1"], {}, r">= 0.0 - at `$.restart.hang_seconds`"),
        (["run.prefill_chunk=9000"], {}, r"<= 8192 - at `$.run.prefill_chunk`"),
        (["gateway.default_max_tokens=-1"], {}, "gateway.default_max_tokens"),
        ([], {"SPECLANES_GATEWAY_CORS_ORIGINS": "https://a.example"}, "gateway.cors_origins"),  # a list
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


def test_multihost_examples_dial_the_same_tls_addresses(hosts):
    a, b = hosts
    assert a.addresses == b.addresses
    owner = {"verify": "host-b.example"} | {
        name: "host-a.example" for name in ("client", "control", "data", "draft", "audit")
    }
    for name, host in owner.items():
        url = urlsplit(getattr(a.addresses, name))
        assert (url.scheme, url.hostname) == ("tls+tcp", host), name
        assert url.port is not None
    ports = [urlsplit(getattr(a.addresses, name)).port for name in NAMES]
    assert len(set(ports)) == len(ports)
    assert a.model.path == b.model.path


def test_multihost_examples_trust_one_ca_and_show_their_own_certificates(hosts):
    a, b = hosts
    assert a.tls.ca_file == b.tls.ca_file and not (a.tls.insecure_tcp or b.tls.insecure_tcp)
    for config, host in ((a, "host-a.example"), (b, "host-b.example")):
        assert Path(config.tls.cert_file).name == f"{host}.pem"  # as `speclanes certs make` names them
        assert Path(config.tls.key_file).name == f"{host}.key"


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
                assert (url.scheme, url.hostname) == ("tls+tcp", "0.0.0.0"), (name, bind)
                assert url.port == urlsplit(getattr(config.addresses, name)).port
            else:
                assert getattr(config.listen, name) == "", name
    assert b.bind("verify") == "tls+tcp://0.0.0.0:" + str(urlsplit(b.addresses.verify).port)
