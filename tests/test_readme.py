"""The README's code is run, so it stays true."""
import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_layer_example_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MINIRT_WEIGHTS", str(tmp_path))
    code = re.search(r"<!-- readme-example -->\n```python\n(.*?)```", README.read_text(), re.S).group(1)
    exec(compile(code, str(README), "exec"), {})
    printed = capsys.readouterr().out.split("\n")
    assert printed[0] == "torch.Size([40, 256]) torch.Size([1, 256])"


def test_readme_test_command_is_what_ci_runs():
    ci = (README.parent / ".ci" / "run").read_text()
    command = "TRITON_INTERPRET=1 python -m pytest -q -n 2"
    assert command in README.read_text() and command in ci
