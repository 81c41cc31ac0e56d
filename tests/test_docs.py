"""Every code block of README.md and docs/*.md is checked: Python blocks run (on a tiny Llama
saved as `path`, in a scratch folder; a block marked `<!-- doc-test: torchrun N -->` runs under
torchrun with N processes), and every command of a bash block is checked against what it names:
`hf-dsinfer` commands parse with the CLI's own parser, scripts and config files exist. The
README's two set-up commands are what CI itself runs; they are not re-run here."""

from __future__ import annotations

import re
import shlex
import textwrap
from pathlib import Path

import pytest

from hf_dsinfer import cli
from tests.launch import torchrun
from tests.tiny_models import save_tiny

REPO = Path(__file__).resolve().parent.parent
FILES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
BLOCK = re.compile(r"(?:<!-- doc-test: (?P<mark>[^>]*?) -->\n)?^(?P<indent>[ \t]*)```(?P<lang>\w*)\n"
                   r"(?P<code>.*?)^(?P=indent)```", re.DOTALL | re.MULTILINE)


def _blocks(lang: str) -> list:
    found = []
    for path in FILES:
        text = path.read_text()
        for m in BLOCK.finditer(text):
            if m.group("lang") == lang:
                line = text.count("\n", 0, m.start()) + 1
                found.append(pytest.param(textwrap.dedent(m.group("code")), m.group("mark") or "",
                                          id=f"{path.relative_to(REPO)}:{line}"))
    return found


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return save_tiny(tmp_path_factory, "llama")


@pytest.mark.parametrize("code, mark", _blocks("python"))
def test_python_block_runs(code, mark, path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # the docs' example checkpoint: the tiny one here (a block that writes it gets its own)
    code = code.replace('"/tmp/tiny-llama-offload"', repr(str(tmp_path / "offload")))
    code = code.replace('"/tmp/tiny-llama"', repr(str(tmp_path / "tiny-llama")
                                                  if "save_pretrained" in code else path))
    if mark.startswith("torchrun"):
        script = tmp_path / "block.py"
        script.write_text(f"path = {path!r}\n" + code
                          + "\nfrom tests.launch import exit_skipping_teardown\n"
                            "exit_skipping_teardown()\n")
        proc = torchrun(int(mark.split()[1]), str(script), timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return
    exec(compile(code, "<doc block>", "exec"),  # noqa: S102  (the block is this repo's docs)
         {"path": path, "__name__": "__doc_block__"})


def _commands(code: str) -> list[list[str]]:
    text = re.sub(r"\\\n\s*", " ", code)  # continued lines
    commands = []
    for line in text.splitlines():
        line = line.split(" #", 1)[0].strip()
        if line and not line.startswith("#"):
            for part in re.split(r"\s*&&\s*", line):
                commands.append(shlex.split(part))
    return commands


@pytest.mark.parametrize("code, mark", _blocks("bash"))
def test_bash_block_names_what_exists(code, mark):
    for argv in _commands(code):
        while argv and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", argv[0]):
            argv = argv[1:]  # VAR=value before the command: its environment
        if argv[0] == "pip":
            continue  # the set-up commands: CI runs them
        if argv[0] == "torchrun" and "--no-python" in argv and "hf-dsinfer" in argv:
            argv = argv[argv.index("hf-dsinfer"):]  # torchrun starting the command on each rank
        if argv[0] == "hf-dsinfer":
            args = [a for a in argv[1:] if not (a.startswith("[") or a.endswith("]"))]
            assert "[" not in " ".join(argv), f"not a runnable command: {argv}"
            cli.build_parser().parse_args(args)  # SystemExit on a flag the CLI lacks
            continue
        if argv[0] == "python" and argv[1] == "-m":
            continue
        named = [a for a in argv if a.endswith((".py", ".yaml", ".json"))]
        assert argv[0] in ("python", "torchrun", "accelerate"), f"unknown command {argv}"
        assert named, f"{argv} names no script"
        for name in named:
            assert (REPO / name).exists(), f"{name} (in {' '.join(argv)}) does not exist"


def test_readme_sections_fit_a_screen():
    """About 120-150 lines in all, no section longer than a screen (~45 lines)."""
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 150
    for section in re.split(r"\n## ", text):
        assert len(section.splitlines()) <= 45, section.splitlines()[0]


def test_every_docs_page_is_linked_from_the_readme():
    readme = (REPO / "README.md").read_text()
    for page in (REPO / "docs").glob("*.md"):
        assert f"docs/{page.name}" in readme, f"README does not link docs/{page.name}"
