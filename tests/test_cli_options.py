"""The command line's shape, in-process: every option and command says what it does, `--version`,
the llama-server-style shortcuts of `start`, and one default drafter everywhere. Ctrl-C on
`speclanes stream` (a real pipeline) is in tests/test_gateway.py."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from pipeline import __version__, cli
from pipeline.decoding.speculation import Speculation
from pipeline.protocol.config import Config, load_config


def parsers(parser: argparse.ArgumentParser, path: str = "speclanes"):
    """Every parser under `parser`, with the command that reaches it."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from parsers(sub, f"{path} {name}")


def test_every_option_argument_and_command_has_help():
    missing = []
    for path, parser in parsers(cli.build_parser(with_benches=True)):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                helped = {choice.dest for choice in action._choices_actions if choice.help}
                missing += [f"{path} {name} (command)" for name in action.choices if name not in helped]
            elif not action.help or action.help == argparse.SUPPRESS:
                missing.append(f"{path} {'/'.join(action.option_strings) or action.dest}")
    assert not missing, missing


def test_the_walk_sees_the_options_it_checks():
    seen = {
        (path, option)
        for path, parser in parsers(cli.build_parser(with_benches=True))
        for action in parser._actions
        for option in action.option_strings
    }
    for wanted in [
        ("speclanes generate", "--max-tokens"), ("speclanes stream", "--top-p"),
        ("speclanes stream", "--seed"), ("speclanes status", "--json"),
        ("speclanes bench model", "--repeats"), ("speclanes start", "--port"),
        ("speclanes audit verify", "--db"), ("speclanes", "--version"),
    ]:  # fmt: skip
        assert wanted in seen, wanted


def test_version(capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"speclanes {__version__}"


def start_args(*argv: str) -> argparse.Namespace:
    return cli.build_parser(with_benches=False).parse_args(["start", *argv])


def test_start_takes_llama_server_shortcuts_onto_the_settings(tmp_path: Path):
    model = tmp_path / "my-model.Q4_0.gguf"
    model.write_bytes(b"GGUF")
    args = start_args("-m", str(model), "--host", "127.0.0.2", "--port", "8081", "--alias", "mine")
    config = load_config(None, cli.serving_settings(args), environ={})
    assert (config.model.path, config.gateway.host, config.gateway.port) == (str(model), "127.0.0.2", 8081)
    assert config.model_id() == "mine"
    # --model names the file the HTTP API serves under; the shortcuts win over --set
    args = start_args("--model", str(model), "--set", "gateway.port=9000", "--port", "9001")
    config = load_config(None, cli.serving_settings(args), environ={})
    assert config.model_id() == "my-model.Q4_0" and config.gateway.port == 9001
    assert cli.build_parser().parse_args(["start", "--served-model-name", "x"]).alias == "x"
    assert load_config(None, cli.serving_settings(start_args()), environ={}) == load_config(
        None, [], environ={}
    )


def test_start_refuses_a_model_file_that_is_not_there(tmp_path: Path, capsys):
    assert cli.main(["start", "-m", str(tmp_path / "missing.gguf"), "--set", f"run.dir={tmp_path}"]) == 2
    assert f"--model {tmp_path / 'missing.gguf'}: no such file" in capsys.readouterr().err


def test_start_takes_a_packaged_model_by_name(gemma3_file: Path):
    config = load_config(None, cli.serving_settings(start_args("-m", "gemma3-270m")), environ={})
    assert config.model.path == str(gemma3_file.resolve())
    assert config.model_id() == "gemma-3-270m-q4_k_m"


def test_one_default_drafter_for_generate_stream_and_the_pipeline():
    parser = cli.build_parser(with_benches=False)
    generate, stream = parser.parse_args(["generate", "hi"]), parser.parse_args(["stream", "hi"])
    assert cli.speculation_args(generate).drafter == cli.speculation_args(stream).drafter
    assert cli.speculation_args(generate).drafter == Config().speculation.drafter == Speculation().drafter
    assert (
        cli.DEFAULT_DRAFTER == "auto"
        and parser.parse_args(["generate", "-m", "x.gguf", "hi"]).model == "x.gguf"
    )
    generate_parser = dict(parsers(parser))["speclanes generate"]
    drafter = next(a for a in generate_parser._actions if "--drafter" in a.option_strings)
    assert "default: auto" in drafter.help


def test_bench_peers_refuses_a_misspelt_peer_by_name(capsys):
    with pytest.raises(SystemExit) as exited:
        cli.build_parser(with_benches=True).parse_args(["bench", "peers", "--peers", "llama-server"])
    assert exited.value.code == 2
    assert "unknown peer llama-server (choose from hf, llama_cpp, llama_server)" in capsys.readouterr().err
    args = cli.build_parser(with_benches=True).parse_args(["bench", "peers"])
    assert args.peers == ["hf", "llama_cpp", "llama_server"]
