"""The README and the guides in docs/ stay true: every relative link and anchor leads somewhere, every training
command shown in a fenced block composes and plans (`dry_run=true`, in this process: a dry run starts and writes
nothing), the README reads in five minutes and every guide opens with the question it answers."""

from __future__ import annotations

import json
import os
import re
import shlex
from itertools import islice
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
README_MAX_LINES = 250
COMMAND = "python -m launcher recipe="


def _name(page: Path) -> str:
    return page.relative_to(REPO).as_posix()


def _fenced_lines(page: Path) -> list[tuple[int, str]]:
    """(line number, line) of every line inside a fenced block, a `\\` continuation joined to the line it starts."""
    lines, inside, pending = [], False, None
    for number, line in enumerate(page.read_text().splitlines(), start=1):
        if line.lstrip().startswith("```"):
            inside = not inside
            continue
        if not inside:
            continue
        if pending is not None:
            pending = (pending[0], pending[1] + " " + line.strip())
        else:
            pending = (number, line)
        if pending[1].rstrip().endswith("\\"):
            pending = (pending[0], pending[1].rstrip()[:-1])
            continue
        lines.append(pending)
        pending = None
    return lines


def _outside_fences(text: str) -> str:
    return re.sub(r"^\s*```.*?^\s*```", "", text, flags=re.DOTALL | re.MULTILINE)


def _prose(text: str) -> str:
    """The text outside fenced blocks and inline code spans (where a `[x](y)` is not a link)."""
    return re.sub(r"`[^`\n]*`", "", _outside_fences(text))


def _anchors(page: Path) -> set[str]:
    """The anchors GitHub gives the page's headings: lowercased, punctuation but `-` and `_` dropped, spaces to `-`,
    a repeated one suffixed `-1`, `-2`, ..."""
    seen: dict[str, int] = {}
    for line in _outside_fences(page.read_text()).splitlines():
        heading = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not heading:
            continue
        slug = re.sub(r"[^\w\- ]", "", heading.group(1).lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        if count:
            seen[f"{slug}-{count}"] = 1
    return set(seen)


LINKS = [
    (page, target)
    for page in PAGES
    for target in re.findall(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", _prose(page.read_text()))
    if not re.match(r"^(https?|mailto):", target)
]


@pytest.mark.parametrize(("page", "target"), LINKS, ids=[f"{_name(p)}->{t}" for p, t in LINKS])
def test_every_relative_link_leads_to_a_file_and_anchor_that_exist(page, target):
    path, _, anchor = target.partition("#")
    destination = (page.parent / path).resolve() if path else page
    assert destination.exists(), f"{_name(page)} links to {target}, which does not exist"
    if anchor and destination.suffix == ".md":
        assert anchor in _anchors(destination), f"{_name(page)} links to {target}: no such heading in {path or 'it'}"


def test_the_readme_reads_in_five_minutes_and_every_guide_opens_with_its_question():
    readme = (REPO / "README.md").read_text().splitlines()
    assert len(readme) <= README_MAX_LINES, f"README.md has {len(readme)} lines: move detail into a guide in docs/"
    for page in PAGES[1:]:
        lines = [line for line in page.read_text().splitlines() if line.strip()]
        assert lines[0].startswith("# "), f"{_name(page)} does not start with its title"
        assert lines[1].startswith(">"), f"{_name(page)}: the line after the title is not the question it answers"


def _commands() -> list[tuple[str, list[str]]]:
    """Every distinct training command in a fenced block: (where it first appears, its arguments)."""
    found: dict[tuple[str, ...], str] = {}
    for page in PAGES:
        for number, line in _fenced_lines(page):
            if COMMAND not in line:
                continue
            args = shlex.split(line[line.index(COMMAND) + len("python -m launcher") :], comments=True)
            found.setdefault(tuple(args), f"{_name(page)}:{number}")
    return [(where, list(args)) for args, where in found.items()]


COMMANDS = _commands()


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, str]:
    """What the docs' placeholders stand for, made small: a pretrained folder and its tokenizer (with a chat
    template), a text file, a file of conversations, a run directory with a disk checkpoint to resume from."""
    from launcher.recipe_commands import recipe_yaml
    from recipes.data.chat import synthetic_conversations
    from tests.integration.test_finetune import TEMPLATE
    from tests.integration.test_sources import TEXT, pretrained_folder, train_tokenizer

    root = tmp_path_factory.mktemp("doc-sources")
    tokenizer = train_tokenizer(root / "tokenizer")
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(root / "tokenizer")
    pretrained_folder(root / "weights", tokenizer)
    (root / "book.txt").write_text(TEXT)
    chats = islice(synthetic_conversations(seed=1, num_bytes=10**5), 50)
    (root / "chats.jsonl").write_text("".join(json.dumps({"messages": chat}) + "\n" for chat in chats))
    (root / "earlier-run" / "checkpoints" / "step_00000010").mkdir(parents=True)
    (root / "my_llama.yaml").write_text(recipe_yaml("tiny_llama"))
    return {
        "recipe=my_llama.yaml": f"recipe={root / 'my_llama.yaml'}",
        "recipe=my.yaml": f"recipe={root / 'my_llama.yaml'}",
        "data.paths=[train.txt]": f"data.paths=[{root / 'book.txt'}]",
        "eval.paths=[valid.txt]": f"eval.paths=[{root / 'book.txt'}]",
        "model.pretrained=<dir>": f"model.pretrained={root / 'weights'}",
        "tokenizer.path=<dir>": f"tokenizer.path={root / 'tokenizer'}",
        "data.paths=[/path/to/book.txt]": f"data.paths=[{root / 'book.txt'}]",
        "data.paths=[chats.jsonl]": f"data.paths=[{root / 'chats.jsonl'}]",
        "resume=/tmp/demo2x2": f"resume={root / 'earlier-run'}",
    }


def _live_children() -> set[int]:
    """This process's children still alive (a fork server, an agent, a namespace's init would be one)."""
    children = set()
    for task in Path(f"/proc/{os.getpid()}/task").glob("*"):
        try:
            children |= {int(pid) for pid in (task / "children").read_text().split()}
        except OSError:  # (a thread that ended meanwhile, or a kernel without the children file)
            continue
    return children


@pytest.mark.parametrize(("where", "args"), COMMANDS, ids=[where for where, _ in COMMANDS])
def test_every_training_command_in_the_docs_composes_and_plans(where, args, sources, tmp_path, monkeypatch, capsys):
    from launcher import cli

    args = [sources.get(arg, arg) for arg in args]
    unfilled = [arg for arg in args if re.search(r"<[^>]*>", arg)]
    assert not unfilled, f"{where}: no test fixture fills {unfilled}; add one to `sources`"
    if "cluster=netns" in args:
        from ckptless_core.netns import NetnsUnavailable, check_available

        try:
            check_available()  # (composing cluster=netns checks it even for a dry run)
        except NetnsUnavailable as error:
            pytest.skip(f"{where}: {error}")
    monkeypatch.setenv("CKPTLESS_CACHE", str(tmp_path / "cache"))
    given = [arg.removeprefix("run.dir=") for arg in args if arg.startswith("run.dir=")]
    run_dir = Path(given[-1]).expanduser().absolute() if given else tmp_path / "run"
    if not given:
        args.append(f"run.dir={run_dir}")
        if "cluster=slurm" in args:
            args.append("cluster.shared_run_dir_ok=true")  # (tmp_path is under /tmp, which Slurm's check refuses)
    existed, before = run_dir.exists(), _live_children()
    code = cli.main([*args, "dry_run=true"])
    said = capsys.readouterr()
    assert code == 0, f"{where}: python -m launcher {shlex.join(args)} dry_run=true exited {code}:\n{said.err}"
    if "--cfg" in args:  # (prints the composed config instead of the plan)
        assert "dry_run: true" in said.out
    else:
        assert "dry run: nothing was started or written" in said.out
    assert run_dir.exists() == existed, f"{where}: the dry run wrote {run_dir}"
    assert _live_children() <= before, f"{where}: the dry run left processes running"
