"""The CLI answers --help without importing torch or vllm, and unlanded commands say so."""

import subprocess
import sys

from teamrl.cli.main import COMMANDS, build_parser, main


def test_help_lists_every_command(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in COMMANDS:
        assert name in out


def test_help_imports_no_heavy_modules():
    code = (
        "import sys; from teamrl.cli.main import main; main(['--help']);"
        "heavy = [m for m in ('torch', 'vllm', 'deepspeed', 'transformers') if m in sys.modules];"
        "print(heavy); sys.exit(1 if heavy else 0)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_unknown_command_is_an_error():
    parser = build_parser()
    assert parser.prog == "teamrl"
    proc = subprocess.run([sys.executable, "-m", "teamrl.cli.main", "nope"], capture_output=True, text=True)
    assert proc.returncode == 2
    assert "unknown command" in proc.stderr
