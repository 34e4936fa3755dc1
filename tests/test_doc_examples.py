"""The examples in README.md and docs/*.md run as written, at toy size: every fenced block
marked ``<!-- example -->`` is extracted and run, so the docs cannot drift from the code.

The convention (docs/testing.md, "Examples in the docs"): an HTML comment on the line right
before a fenced block marks it, invisibly on GitHub::

    <!-- example -->
    <!-- example: file run.toml -->
    <!-- example: replace max_steps=50 => max_steps=2; before pytrain train config/demo.toml -->

and the block's language says how it is used:

* ``sh`` / ``bash`` / ``shell``: run by bash (``set -e``) in the doc's working directory; a
  line whose command starts with a LEFT_OUT entry is left out;
* ``console``: each ``$ `` line is a command, the lines after it are its output; the output
  lines without a digit (no measured figure, no size) must appear in what the command prints;
* ``python``: executed in one namespace per doc, in the doc's working directory;
* ``toml``: with ``file NAME``, written to NAME and loaded by pytrain's config loader; without,
  a snippet: its keys are applied onto config/demo.toml and the result validated;
* ``jsonl``: with ``file NAME``, written to NAME; either way every line is read by pytrain's
  data loader (the bundled model's tokenizer) as a usable record.

Directives (``;`` between them): ``file NAME``; ``set KEY=VALUE`` (one more toy-size setting);
``replace OLD => NEW`` (the block's text is changed before it runs, for sizes the docs show
for a real run: 50 steps become 2); ``before COMMAND`` (a shell command run first, for what
the block assumes exists).

Toy size: each doc's marked blocks run in order in one temporary working directory (a failure
names the doc and line: the test id is ``doc:line``) holding a copy of ``config/``, the
package at ``pytrain/`` (so config/demo.toml's paths resolve), ``MODEL.gguf`` and
``model.gguf`` (the bundled tiny model: the names the docs use for the reader's own model) and
``train.jsonl`` (the demo's chat data).  ``pytrain train``, ``eval``, ``plan`` and ``profile``
get TOY's settings (and the marker's ``set``) before their own arguments, so the block's own
``--set`` still wins.

Blocks that cannot run here (a GPU, MPI across hosts, Slurm, ``make test``, the long demos, pip
installs) stay unmarked; a ``pytrain`` command shown in the docs must run in a marked block or
be in LEFT_OUT, so a new command is not silently untested.  docs/python.md's example is run,
with checks on what it made, by tests/test_api.py::test_the_guide_runs.
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent

# The settings every `pytrain train|eval|plan|profile` of an example gets (before its own
# arguments: an explicit --set in the block wins; `replace` brings a block's size down).
TOY = ["train.max_steps=2", "model.device=cpu"]
TAKES_SET = ("train", "eval", "plan", "profile")

# Commands of a marked shell block that are left out, and the only `pytrain` commands the docs
# may show without running them: a command line (its comment dropped) starting with a key.
LEFT_OUT = {
    # llama.cpp's own program, installed with llama.cpp, not with pytrain (and the tiny
    # model's MRoPE sections need a patched copy there): tests/test_llama_cpp_adapter.py runs
    # pytrain's adapters through the pinned llama.cpp build instead
    "llama-cli ": "llama.cpp's program",
    # builds, the long demos and the whole suite, minutes each; tests/test_scripts_run.py
    # runs the demos' scripts at toy size
    "make ": "a build, a long demo or the suite",
    # installs; tests/test_wheel.py builds the wheel and trains from it
    "pip ": "an install",
    # downloads a real model (93 MB / 240 MB); tests/test_smollm2.py and
    # tests/test_gemma3_270m.py use the fetched ones
    "python -m scripts.fetch_model": "a download",
    "pytrain inspect ~/.cache/pytrain/models/": "the model the fetch line downloads",
    "pytrain generate gemma-3-270m-q4_k_m.gguf": "a real model's file (make real-model)",
    # a CUDA device; tests/test_gpu.py trains on one (skipped without)
    "pytrain train config/demo.toml --set model.device=cuda": "a CUDA GPU",
}

SHELL = {"sh", "bash", "shell"}
RUNNABLE = SHELL | {"console", "python", "toml", "jsonl"}
FENCE = re.compile(r"^( {0,3})```\s*([\w+-]*)\s*$")     # 4 spaces: indented code
MARKER = re.compile(r"^ {0,3}<!--\s*example(?:\s*:\s*(.*?))?\s*-->\s*$")
HEREDOC = re.compile(r"<<-?\s*(['\"]?)(\w+)\1")
DIRECTIVES = ("file", "set", "replace", "before")


def doc_files() -> list[Path]:
    return [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))


@dataclass(frozen=True)
class Block:
    doc: str                  # path relative to the repository
    line: int                 # line of the opening fence
    lang: str
    text: str
    marked: bool
    directives: tuple         # ((name, argument), ...)

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}"

    def get(self, name: str) -> list[str]:
        return [a for n, a in self.directives if n == name]


def parse_directives(spec: str | None) -> tuple:
    out = []
    for item in (spec or "").split(";"):
        item = item.strip()
        if item:
            name, _, arg = item.partition(" ")
            out.append((name, arg.strip()))
    return tuple(out)


def parse_doc(path: Path, problems: list[str] | None = None) -> list[Block]:
    """The fenced blocks of a markdown file; a marker not right before a fence is a problem."""
    rel = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)
    lines = path.read_text(encoding="utf-8").split("\n")
    out, i, pending = [], 0, None
    while i < len(lines):
        m = FENCE.match(lines[i])
        if m is None:
            if pending is not None and problems is not None:
                problems.append(f"{rel}:{pending}: an example marker not right before a fence")
            pending = None
            if MARKER.match(lines[i]):
                pending = i + 1
            elif re.match(r" {0,3}<!--\s*example", lines[i]) and problems is not None:
                problems.append(f"{rel}:{i + 1}: a malformed example marker")
            i += 1
            continue
        indent, lang = m.groups()
        j = i + 1
        while j < len(lines) and not (lines[j].strip() == "```"):
            j += 1
        body = [ln[len(indent):] if ln.startswith(indent) else ln.lstrip()
                for ln in lines[i + 1:j]]
        marked = pending is not None
        spec = MARKER.match(lines[i - 1]).group(1) if marked else None
        out.append(Block(rel, i + 1, lang, "\n".join(body) + "\n", marked,
                         parse_directives(spec)))
        pending, i = None, j + 1
    return out


def all_blocks(problems: list[str] | None = None) -> list[Block]:
    return [b for p in doc_files() for b in parse_doc(p, problems)]


def shell_commands(block: Block) -> list[tuple[int, str]]:
    """(line in the doc, command) of a shell or console block: comments, heredoc bodies and
    (in a console block) output lines left out, continuation lines joined."""
    out, until, cont = [], None, None
    console = block.lang == "console" or (block.lang == "" and "\n$ " in "\n" + block.text)
    for k, raw in enumerate(block.text.split("\n")[:-1]):
        n = block.line + 1 + k
        if until is not None:
            if raw.strip() == until:
                until = None
            continue
        line = raw
        if console:
            if not line.startswith("$ "):
                continue
            line = line[2:]
        cmd = re.sub(r"(^|\s)#.*$", "", line).rstrip()
        if cont is not None:
            cont = (cont[0], cont[1] + " " + cmd.rstrip("\\").strip())
        elif cmd.strip():
            cont = (n, cmd.rstrip("\\").strip())
        if cont is not None and not cmd.endswith("\\"):
            out.append(cont)
            cont = None
        h = HEREDOC.search(cmd)
        if h:
            until = h.group(2)
    return out


def left_out(cmd: str) -> str | None:
    return next((k for k in LEFT_OUT if cmd.startswith(k)), None)


MARKED = [b for b in all_blocks() if b.marked]


# --------------------------------------------------------------------------- the working dirs

def make_workdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    shutil.copytree(ROOT / "config", path / "config")
    (path / "pytrain").symlink_to(ROOT / "pytrain", target_is_directory=True)
    for name in ("MODEL.gguf", "model.gguf"):
        (path / name).symlink_to("pytrain/assets/default-model.gguf")
    shutil.copyfile(ROOT / "pytrain" / "assets" / "demo_train.jsonl", path / "train.jsonl")
    return path


class DocRun:
    """One doc's working directory, how many of its marked blocks ran, the first that failed
    and its Python namespace."""

    def __init__(self, workdir: Path):
        self.workdir, self.done, self.failed, self.ns = workdir, 0, None, {}


@pytest.fixture(scope="session")
def doc_runs(tmp_path_factory):
    runs: dict[str, DocRun] = {}

    def get(doc: str) -> DocRun:
        if doc not in runs:
            name = re.sub(r"\W", "-", doc)
            runs[doc] = DocRun(make_workdir(tmp_path_factory.mktemp("doc") / name))
        return runs[doc]
    return get


def prelude(block: Block) -> str:
    toy = [*TOY, *block.get("set")]
    sets = " ".join(f"--set {shlex.quote(s)}" for s in toy)
    return (f"set -eo pipefail\nexport PATH={shlex.quote(str(VENV_BIN))}:\"$PATH\"\n"
            f"pytrain() {{\n  case \"${{1:-}}\" in {'|'.join(TAKES_SET)})\n"
            f"    set -- \"$1\" {sets} \"${{@:2}}\";;\n  esac\n  command pytrain \"$@\"\n}}\n")


def bash(block: Block, script: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "MPLBACKEND": "Agg", "PYTHONUNBUFFERED": "1"}
    return subprocess.run(["bash", "-c", prelude(block) + script], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)


def text_of(block: Block) -> str:
    text = block.text
    for rep in block.get("replace"):
        old, sep, new = rep.partition("=>")
        old, new = old.strip(), new.strip()
        assert sep and old in text, f"{block.id}: replace {old!r}: not in the block"
        text = text.replace(old, new)
    return text


def run_before(block: Block, cwd: Path) -> None:
    for cmd in block.get("before"):
        p = bash(block, cmd, cwd)
        assert p.returncode == 0, (f"{block.id}: `before {cmd}` exited {p.returncode}:\n"
                                   f"{(p.stdout + p.stderr)[-3000:]}")


def run_shell(block: Block, cwd: Path) -> None:
    text = text_of(block)
    lines = text.split("\n")
    edited = Block(block.doc, block.line, block.lang, text, True, block.directives)
    for n, cmd in shell_commands(edited):
        if left_out(cmd):
            lines[n - block.line - 1] = f": left out: {left_out(cmd).strip()}"
    script = "\n".join(lines)
    p = bash(block, script, cwd)
    assert p.returncode == 0, (f"{block.id}: exit status {p.returncode}\n--- as run ---\n"
                               f"{script}--- output ---\n{(p.stdout + p.stderr)[-4000:]}")


def run_console(block: Block, cwd: Path) -> None:
    """Each `$ ` command runs; the output lines the doc shows without a digit must appear in
    what it printed (paths printed under the working directory or the repository read as
    relative ones)."""
    chunks: list[tuple[str, list[str]]] = []
    for line in text_of(block).split("\n"):
        if line.startswith("$ "):
            chunks.append((line[2:], []))
        elif chunks:
            chunks[-1][1].append(line)
    assert chunks, f"{block.id}: a console block with no `$ ` command"
    for cmd, shown in chunks:
        if left_out(cmd):
            continue
        p = bash(block, cmd, cwd)
        said = p.stdout + p.stderr
        assert p.returncode == 0, f"{block.id}: `{cmd}` exited {p.returncode}:\n{said[-4000:]}"
        for base in (cwd.resolve(), cwd, ROOT):
            said = said.replace(f"{base}/", "")
        got = {ln.rstrip() for ln in said.split("\n")}
        missing = [ln for ln in shown if ln.strip() and ln.strip() != "..."
                   and not re.search(r"\d", ln) and ln.rstrip() not in got]
        assert not missing, (f"{block.id}: `{cmd}` no longer prints these lines:\n"
                             + "\n".join(missing) + f"\n--- it printed ---\n{said[-4000:]}")


def run_python(block: Block, run: DocRun, monkeypatch) -> None:
    monkeypatch.chdir(run.workdir)
    code = "\n" * block.line + text_of(block)    # tracebacks name the doc's lines
    exec(compile(code, str(ROOT / block.doc), "exec"), run.ns)


def check_toml(block: Block, cwd: Path, monkeypatch) -> None:
    from pytrain.config import load_config
    monkeypatch.chdir(cwd)
    (name,) = block.get("file") or [None]
    if name:
        (cwd / name).write_text(text_of(block), encoding="utf-8")
        load_config(cwd / name)
        return
    import tomllib
    tables = tomllib.loads(text_of(block))
    flat = {}
    for section, keys in tables.items():
        assert isinstance(keys, dict), f"{block.id}: `{section}` is not a [section]"
        flat.update({f"{section}.{k}": v for k, v in keys.items()})
    load_config(cwd / "config" / "demo.toml", flat)


_TOKENIZER = []


def check_jsonl(block: Block, cwd: Path) -> None:
    from pytrain.data import load_examples
    from pytrain.data.tokenizer import Tokenizer
    from pytrain.formats.gguf_meta import read_metadata
    (name,) = block.get("file") or ["example.jsonl"]
    path = cwd / name
    path.write_text(text_of(block), encoding="utf-8")
    if not _TOKENIZER:
        meta = read_metadata(ROOT / "pytrain" / "assets" / "default-model.gguf")
        _TOKENIZER.append(Tokenizer.from_metadata(meta))
    n = len([ln for ln in text_of(block).split("\n") if ln.strip()])
    examples, stats = load_examples(path, _TOKENIZER[0], max_seq_len=4096)
    assert stats.records == len(examples) == n, f"{block.id}: {stats}"
    if not block.get("file"):
        path.unlink()


def run_block(block: Block, run: DocRun, monkeypatch) -> None:
    run_before(block, run.workdir)
    if block.lang in SHELL:
        run_shell(block, run.workdir)
    elif block.lang == "console":
        run_console(block, run.workdir)
    elif block.lang == "python":
        run_python(block, run, monkeypatch)
    elif block.lang == "toml":
        check_toml(block, run.workdir, monkeypatch)
    elif block.lang == "jsonl":
        check_jsonl(block, run.workdir)
    else:
        raise AssertionError(f"{block.id}: a marked block in {block.lang or 'no language'}")


def is_slow(block: Block) -> bool:
    """Trains, evaluates or profiles (seconds each), the left-out lines not counted."""
    text = block.text
    if block.lang in SHELL | {"console"}:
        text = "\n".join(c for _, c in shell_commands(block) if not left_out(c))
    text += "\n" + "\n".join(block.get("before"))
    return bool(re.search(r"pytrain (train|eval|profile)\b|pytrain\.train\(", text))


def _param(b: Block):
    """Slow when it trains, or when an earlier block of its doc does (it runs them first when
    selected alone)."""
    mine = [e for e in MARKED if e.doc == b.doc]
    slow = any(is_slow(e) for e in mine[:mine.index(b) + 1])
    return pytest.param(b, id=b.id, marks=[pytest.mark.slow] if slow else [])


@pytest.mark.parametrize("block", [_param(b) for b in MARKED])
def test_example_runs(block: Block, doc_runs, monkeypatch):
    """The block runs as written, after the doc's earlier marked blocks (run now when this
    one is selected alone)."""
    run = doc_runs(block.doc)
    mine = [b for b in MARKED if b.doc == block.doc]
    k = mine.index(block)
    for earlier in mine[run.done:k]:
        run.done += 1
        try:
            run_block(earlier, run, monkeypatch)
        except BaseException:
            run.failed = earlier.id
            raise
    if run.failed:
        pytest.skip(f"an earlier example of {block.doc} failed: {run.failed}")
    run.done = k + 1
    try:
        run_block(block, run, monkeypatch)
    except BaseException:
        run.failed = block.id
        raise


# --------------------------------------------------------------------------- the convention

def test_markers_are_well_formed():
    """Every marker sits right before a fence, on a block of a language the test runs, with
    known directives; `file` names one file, for a TOML or JSONL block."""
    problems: list[str] = []
    blocks = all_blocks(problems)
    for b in blocks:
        if not b.marked:
            continue
        if b.lang not in RUNNABLE:
            problems.append(f"{b.id}: marked, in {b.lang or 'no language'} "
                            f"(runnable: {', '.join(sorted(RUNNABLE))})")
        for name, arg in b.directives:
            if name not in DIRECTIVES:
                problems.append(f"{b.id}: unknown directive {name!r} (known: "
                                f"{', '.join(DIRECTIVES)})")
            elif not arg:
                problems.append(f"{b.id}: `{name}` without an argument")
        if b.get("file") and (b.lang not in ("toml", "jsonl") or len(b.get("file")) > 1):
            problems.append(f"{b.id}: `file` names one file, for a TOML or JSONL block")
        for rep in b.get("replace"):
            old = rep.partition("=>")[0].strip()
            if "=>" not in rep or old not in b.text:
                problems.append(f"{b.id}: `replace {rep}`: expected OLD => NEW, OLD in the block")
    assert not problems, "\n".join(problems)
    assert len(MARKED) >= 10


def test_every_pytrain_command_runs_or_is_left_out():
    """A `pytrain` command shown in a shell or console block (or a `$ pytrain` transcript)
    runs in a marked block, or is in LEFT_OUT: a new command is not silently untested."""
    bad = []
    for b in all_blocks():
        if b.lang not in SHELL | {"console", ""}:
            continue
        for n, cmd in shell_commands(b):
            if re.match(r"pytrain(\s|$)", cmd) and not (b.marked or left_out(cmd)):
                bad.append(f"{b.doc}:{n}: {cmd}")
    assert not bad, ("pytrain commands in the docs that no example runs: mark their block "
                     "(docs/testing.md, \"Examples in the docs\") or, if it cannot run here, "
                     "add them to LEFT_OUT with the reason:\n" + "\n".join(bad))


def test_left_out_is_what_the_docs_show():
    """Each LEFT_OUT entry still matches a command in the docs (the list stays short)."""
    cmds = [c for b in all_blocks() if b.lang in SHELL | {"console", ""}
            for _, c in shell_commands(b)]
    stale = [k for k in LEFT_OUT if not any(c.startswith(k) for c in cmds)]
    assert not stale, f"LEFT_OUT entries no doc shows: {stale}"


def test_the_runner_catches_a_broken_example(tmp_path, monkeypatch):
    """The machinery on a doc of its own: a TOML snippet, a JSONL file, a Python block and a
    shell block run; a wrong key, a bad record, a failing command and a vanished output line
    fail."""
    from pytrain.config import ConfigError
    from pytrain.data import DataError
    doc = tmp_path / "doc.md"
    doc.write_text(
        "<!-- example -->\n```toml\n[lora]\nrank = 4\n```\n"
        "<!-- example: file my.jsonl -->\n```jsonl\n{\"text\": \"The cow says moo.\"}\n```\n"
        "<!-- example -->\n```python\nimport json\nx = json.loads('[1]')\n```\n"
        "<!-- example -->\n```python\nassert x == [1]\n```\n"
        "<!-- example: replace seven => 7 -->\n```sh\necho seven > n.txt  # a comment\n"
        "llama-cli -m MODEL.gguf\n```\n"
        "<!-- example -->\n```console\n$ cat n.txt\n7\n$ echo hello\nhello\n...\n```\n"
        "```toml\n[lora]\nrnak = 4\n```\n"
        "```jsonl\n{\"txt\": 1}\n```\n"
        "```sh\nfalse\n```\n"
        "```console\n$ echo hello\ngoodbye\n```\n"
        "<!-- example: nonsense -->\nnot a fence\n")
    problems: list[str] = []
    blocks = parse_doc(doc, problems)
    assert problems == [f"{doc}:46: an example marker not right before a fence"]
    good, bad = [b for b in blocks if b.marked], [b for b in blocks if not b.marked]
    assert [b.lang for b in good] == ["toml", "jsonl", "python", "python", "sh", "console"]
    run = DocRun(make_workdir(tmp_path / "work"))
    for b in good:
        run_block(b, run, monkeypatch)
    assert (run.workdir / "my.jsonl").exists() and run.ns["x"] == [1]
    assert (run.workdir / "n.txt").read_text() == "7\n"
    assert [c for _, c in shell_commands(good[4])] == ["echo seven > n.txt",
                                                       "llama-cli -m MODEL.gguf"]
    marked = [Block(b.doc, b.line, b.lang, b.text, True, ()) for b in bad]
    with pytest.raises(ConfigError, match="rnak"):
        run_block(marked[0], run, monkeypatch)
    with pytest.raises(DataError):
        run_block(marked[1], run, monkeypatch)
    with pytest.raises(AssertionError, match="exit status 1"):
        run_block(marked[2], run, monkeypatch)
    with pytest.raises(AssertionError, match=r"no longer prints these lines:\n\s*goodbye"):
        run_block(marked[3], run, monkeypatch)
