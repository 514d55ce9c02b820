"""The docs' promises, checked: on every page (README.md, DESIGN.md, docs/*.md) every link and
image resolves, every file, module and config key it names exists, every command it shows
names real subcommands, options, scripts, modules and make targets, and the site builds with
`mkdocs build --strict`. Each checker is also fed a broken example, so none can pass vacuously.
Over 400 lines in one file on purpose: the checkers and the test that each can fail read as one."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import re
import shlex
import subprocess
import sys
import tomllib
import unicodedata
from functools import cache
from pathlib import Path

import click
import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", ROOT / "DESIGN.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"(?ms)^ *```(\w*)\n(.*?)^ *```")
# a path in the repository, as pages name them: `streamrl/bus/keys.py`, `deploy/k8s/`
REPO_PATH = re.compile(
    r"^(?:streamrl|tests|bench|deploy|configs|examples|docs|\.ci)/[\w./-]*$"
    r"|^(?:DESIGN\.md|README\.md|Makefile|pyproject\.toml|mkdocs\.yml)$"
)
BARE_FILE = re.compile(r"^[\w-]+\.(?:py|toml|md|ya?ml|png)$")  # `keda.yaml`, `config.py`
DATA_FILE = re.compile(r"^[\w-]+\.(?:json|jsonl|safetensors)$")  # a model's or a user's file
DOTTED = re.compile(r"^streamrl(?:\.\w+)+$")  # `streamrl.workers.LeaseWorker`
MODULE_ATTR = re.compile(r"^([a-z_]+)\.([A-Za-z_]\w*)(?:\(\))?$")  # `losses.adapt_entropy_coef`
TABLE_KEY = re.compile(r"^\[(\w+)\] (\w+)(?: = .*)?$")  # `[learner] share_prompts`
PLACEHOLDER = re.compile(r"^(?:[A-Z][A-Z0-9_]*(?:=[A-Z_]+)?|[A-Z]+\.\w+|PLACEHOLDER|…|\.\.\.)$")


def _text(page: Path) -> str:
    return page.read_text()


def _fences(text: str) -> list[tuple[str, str]]:
    return FENCE.findall(text)


def _prose(text: str) -> str:
    """The page without its fenced code blocks."""
    return FENCE.sub("", text)


def _spans(text: str) -> list[str]:
    """Inline code spans outside fenced blocks, whitespace normalised."""
    return [" ".join(s.split()) for s in re.findall(r"`([^`]+)`", _prose(text))]


# ---------------------------------------------------------------- links and anchors


def _slugs(md: Path) -> set[str]:
    """Heading anchors that both GitHub and MkDocs (python-markdown's toc) give this page."""
    from markdown.extensions.toc import slugify

    out_gh, out_mk = set(), set()
    for line in _prose(_text(md)).splitlines():
        m = re.match(r"^#{1,6} +(.*?) *#*$", line)
        if not m:
            continue
        title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", m.group(1)).replace("`", "")
        title = title.replace("*", "")
        out_mk.add(slugify(title, "-"))
        gh = unicodedata.normalize("NFKC", title).lower()
        out_gh.add(re.sub(r"[^\w\- ]", "", gh).replace(" ", "-"))
    return out_gh & out_mk


def _link_problems(text: str, page: Path) -> list[str]:
    problems = []
    prose = re.sub(r"`[^`]*`", "", _prose(text))
    for target in re.findall(r"!?\[[^\]]*\]\(([^)\s]+)(?: \"[^\"]*\")?\)", prose):
        if re.match(r"^[a-z]+:", target):  # http(s), mailto: not checked offline
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            problems.append(f"{page.name}: link to missing {target}")
        elif anchor and (dest.suffix != ".md" or anchor not in _slugs(dest)):
            problems.append(f"{page.name}: no heading #{anchor} in {dest.name}")
    return problems


# ---------------------------------------------------------------- names in inline code


@cache
def _repo_file_names() -> frozenset[str]:
    skip = {".venv", ".git", "site", "node_modules", ".venv-nemo-gym"}
    return frozenset(
        p.name for p in ROOT.rglob("*") if not skip & set(p.relative_to(ROOT).parts) and p.is_file()
    )


def _resolves(dotted: str) -> bool:
    """`streamrl.a.b.C`: the longest importable module prefix, then attributes."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


@cache
def _modules_named(name: str) -> tuple[str, ...]:
    """streamrl's modules and packages whose last name is `name` (`losses`, `producer`)."""
    found = [*(ROOT / "streamrl").rglob(f"{name}.py"), *(ROOT / "streamrl").rglob(f"{name}/")]
    parts = [p.relative_to(ROOT).with_suffix("").parts for p in found]
    return tuple(".".join(p) for p in parts)


@cache
def _config_tables() -> dict[str, frozenset[str]]:
    """The run config's TOML tables and their keys (`[learner]` is checked by the learner)."""
    import msgspec.inspect as mi

    from streamrl.config import RunConfig
    from streamrl.learner.config import LearnerConfig

    tables = {}
    for field in mi.type_info(RunConfig).fields:  # a table may be optional: `X | None`
        kinds = field.type.types if isinstance(field.type, mi.UnionType) else (field.type,)
        for kind in kinds:
            if isinstance(kind, mi.StructType):
                tables[field.name] = frozenset(kind.cls.__struct_fields__)
    tables["learner"] = frozenset(LearnerConfig.__struct_fields__)
    return tables


def _name_problems(span: str) -> list[str]:
    """A file, module or config key named in inline code must exist."""
    if REPO_PATH.match(span) and not (ROOT / span).exists():
        return [f"no such path: {span}"]
    if BARE_FILE.match(span) and span not in _repo_file_names():
        return [f"no file named {span} anywhere in the repository"]
    if DOTTED.match(span) and not _resolves(span):
        return [f"{span} does not import"]
    m = MODULE_ATTR.match(span)
    if (
        m
        and not BARE_FILE.match(span)
        and not DATA_FILE.match(span)
        and _modules_named(m.group(1))
        and not any(_resolves(f"{module}.{m.group(2)}") for module in _modules_named(m.group(1)))
    ):
        return [f"no module named {m.group(1)} has {m.group(2)}"]
    m = TABLE_KEY.match(span)
    if m and m.group(2) not in _config_tables().get(m.group(1), ()):
        return [f"no key {m.group(2)} in the [{m.group(1)}] table"]
    return []


def _toml_problems(body: str) -> list[str]:
    """A config excerpt must use real tables and keys."""
    try:
        raw = tomllib.loads(body)
    except tomllib.TOMLDecodeError as e:
        return [f"toml does not parse: {e}"]
    tables = _config_tables()
    return [
        f"no key {key} in the [{table}] table"
        for table, values in raw.items()
        for key in (values if isinstance(values, dict) else {})
        if key not in tables.get(table, ())
    ]


# ---------------------------------------------------------------- commands


def _cli_root() -> click.Group:
    from streamrl.cli import main

    return main


def _rq_root() -> click.Group:
    from rq.cli import main

    return main


def _params(cmd: click.Command) -> list[click.Parameter]:
    return cmd.get_params(click.Context(cmd))  # a lazily imported command loads its real one


def _click_problems(root: click.Command, tokens: list[str], name: str, strict: bool) -> list[str]:
    """Walk the tokens down the real click tree: subcommands, options, choices, arguments."""
    cmd, path, args_seen, i = root, [name], 0, 0
    while i < len(tokens):
        tok = tokens[i]
        where = " ".join(path)
        if tok in ("…", "..."):
            break
        params = _params(cmd)
        if tok.startswith("-") and tok != "-":
            opt, eq, value = tok.partition("=")
            found = [p for p in params if opt in p.opts + p.secondary_opts]
            if not found:
                return [f"`{where}` has no option {opt}"]
            (param,) = found
            takes_value = not (getattr(param, "is_flag", False) or getattr(param, "count", False))
            if takes_value and not eq:
                i += 1
                value = tokens[i] if i < len(tokens) else ""
            if takes_value and value:
                problems = _choice_problems(param, value, where)
                if problems:
                    return problems
        elif isinstance(cmd, click.Group):
            if tok not in cmd.commands:
                return [f"`{where}` has no subcommand {tok!r}"]
            cmd, args_seen = cmd.commands[tok], 0
            path.append(tok)
        else:
            arguments = [p for p in params if isinstance(p, click.Argument)]
            if args_seen >= len(arguments) and not (arguments and arguments[-1].nargs == -1):
                return [f"`{where}` takes no argument {tok!r}"]
            problems = _choice_problems(arguments[min(args_seen, len(arguments) - 1)], tok, where)
            if problems:
                return problems
            args_seen += 1
        i += 1
    if strict and isinstance(cmd, click.Group) and cmd is not root and tokens[-1:] != ["--help"]:
        return [f"`{' '.join(path)}` needs a subcommand"]
    return []


def _choice_problems(param: click.Parameter, value: str, where: str) -> list[str]:
    if not isinstance(param.type, click.Choice) or PLACEHOLDER.match(value):
        return []
    bad = [v for v in value.split("|") if v not in param.type.choices]
    return [f"`{where}` {param.name}: {bad} not in {list(param.type.choices)}"] if bad else []


@cache
def _script_options(script: str) -> frozenset[str]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    out = subprocess.run(
        [sys.executable, script, "--help"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return frozenset(re.findall(r"(?<![\w-])--?[\w-]+", out.stdout))


def _python_problems(args: list[str], strict: bool) -> list[str]:
    """`python file.py --opt`, `python -m module ...`, `python -c "from x import y"`."""
    if not args:
        return []
    if args[0] == "-c" and len(args) > 1:
        problems = []
        for node in ast.walk(ast.parse(args[1])):
            if isinstance(node, ast.ImportFrom):
                problems += [
                    f"{node.module}.{a.name} does not import"
                    for a in node.names
                    if not _resolves_any(f"{node.module}.{a.name}")
                ]
            elif isinstance(node, ast.Import):
                problems += [
                    f"{a.name} does not import" for a in node.names if not _resolves_any(a.name)
                ]
        return problems
    if args[0] == "-m":
        if len(args) < 2:
            return ["`python -m` without a module"] if strict else []
        module, rest = args[1], args[2:]
        if module == "pytest":
            return _pytest_problems(rest)
        if importlib.util.find_spec(module) is None:
            return [f"python -m {module}: no such module"]
        if module == "streamrl.cli":
            return _click_problems(_cli_root(), rest, "streamrl", strict)
        return []
    script = args[0]
    if not (ROOT / script).is_file():
        return [f"python {script}: no such file"]
    known = _script_options(script)
    return [
        f"python {script} has no option {a}"
        for a in args[1:]
        if a.startswith("-") and a.partition("=")[0] not in known
    ]


def _resolves_any(dotted: str) -> bool:
    try:
        return importlib.util.find_spec(dotted) is not None or _resolves(dotted)
    except (ImportError, ValueError):
        return _resolves(dotted)


def _pytest_problems(args: list[str]) -> list[str]:
    paths = [a.split("::")[0] for a in args if not a.startswith("-")]
    return [f"pytest {p}: no such path" for p in paths if not (ROOT / p).exists()]


@cache
def _make_targets() -> frozenset[str]:
    return frozenset(re.findall(r"(?m)^([\w.-]+):", (ROOT / "Makefile").read_text()))


def _command_problems(tokens: list[str], strict: bool) -> list[str]:
    """One simple command (no pipes or `&`), its leading `VAR=value` assignments dropped."""
    while tokens and re.match(r"^[A-Z_][A-Z0-9_]*=", tokens[0]):
        tokens = tokens[1:]
    if not tokens:
        return []
    head, args = tokens[0], tokens[1:]
    problems = [p for t in args if REPO_PATH.match(t) for p in _name_problems(t)]
    problems += [p for t in args if DOTTED.match(t) for p in _name_problems(t)]
    if head == "streamrl":
        problems += _click_problems(_cli_root(), args, "streamrl", strict)
    elif head == "rq":
        problems += _click_problems(_rq_root(), args, "rq", strict)
    elif head in ("python", "python3") or head.endswith("/python"):
        problems += _python_problems(args, strict)
    elif head == "pytest":
        problems += _pytest_problems(args)
    elif head == "make":
        problems += [f"make {t}: no such target" for t in args if t not in _make_targets()]
    elif head == "torchrun" and "-m" in args:
        problems += _python_problems(args[args.index("-m") :], strict)
    return problems


def _shell_commands(body: str) -> list[list[str]]:
    """A bash block's simple commands: continuations joined, comments dropped, split at
    `&`, `&&`, `|`, `||`, `;` and newlines."""
    body = re.sub(r"<[^<>\n]+>", "PLACEHOLDER", body.replace("\\\n", " "))
    commands = []
    for line in body.splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        current: list[str] = []
        for tok in lexer:
            if tok in ("&", "&&", "|", "||", ";"):
                commands.append(current)
                current = []
            else:
                current.append(tok)
        commands.append(current)
    return [c for c in commands if c]


def _inline_command(span: str) -> list[str] | None:
    """An inline mention such as `streamrl bench chaos [--kills N] --json`: brackets and the
    `|` between alternatives dropped; a span that does not start like a command is None."""
    if not re.match(r"^(?:streamrl|rq|python3?|pytest|make|torchrun) ", span):
        return None
    span = re.sub(r"<[^<>]+>", "PLACEHOLDER", span).replace("[", " ").replace("]", " ")
    try:
        tokens = shlex.split(span)
    except ValueError:
        tokens = span.split()
    return [t for t in tokens if t != "|"]


def _page_command_problems(text: str) -> tuple[int, list[str]]:
    checked, problems = 0, []
    for lang, body in _fences(text):
        if lang in ("bash", "sh", "console"):
            for tokens in _shell_commands(body):
                checked += 1
                problems += [f"{' '.join(tokens)}: {p}" for p in _command_problems(tokens, True)]
        elif lang == "toml":
            problems += _toml_problems(body)
    for span in _spans(text):
        tokens = _inline_command(span)
        if tokens is not None:
            checked += 1
            problems += [f"`{span}`: {p}" for p in _command_problems(tokens, False)]
    return checked, problems


# ---------------------------------------------------------------- the tests


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_resolve(page):
    assert _link_problems(_text(page), page) == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_named_files_modules_and_config_keys_exist(page):
    problems = [p for span in _spans(_text(page)) for p in _name_problems(span)]
    assert problems == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_commands_are_real(page):
    checked, problems = _page_command_problems(_text(page))
    assert problems == []
    if page.name != "DESIGN.md":
        assert checked > 0  # every page shows at least one command, and it was looked at


def test_every_command_family_is_shown_somewhere():
    """Each `streamrl` subcommand appears in a command on some page: nothing is undocumented."""
    shown = set()
    for page in PAGES:
        text = _text(page)
        blocks = [t for lang, b in _fences(text) if lang == "bash" for t in _shell_commands(b)]
        inline = [t for s in _spans(text) if (t := _inline_command(s)) is not None]
        shown |= {t[1] for t in blocks + inline if len(t) > 1 and t[0] == "streamrl"}
    assert set(_cli_root().commands) - shown == set()


def test_site_home_and_readme_agree():
    readme, home = _text(ROOT / "README.md"), _text(ROOT / "docs" / "index.md")
    assert _fences(readme)[:2] == _fences(home)[:2]  # the two commands, the data-flow picture
    assert "make demo" in _fences(home)[0][1] and "make test" in _fences(home)[0][1]
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = {p.name for p in (ROOT / "docs").glob("*.md")}
    assert set(re.findall(r"(?m)^  - [^:]+: (\S+\.md)$", nav)) == pages  # every page in the nav


def test_mkdocs_build_strict(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    for md in sorted((ROOT / "docs").glob("*.md")):
        html = (tmp_path / ("" if md.stem == "index" else md.stem) / "index.html").read_text()
        body = html[html.index('role="main"') : html.index("<footer")]  # the page, no theme
        text = md.read_text()
        # every fenced block and every table rendered as one (python-markdown drops some nestings)
        assert body.count("<pre") == len(_fences(text)), md.name
        tables = len(re.findall(r"(?m)^ *\|[-| :]+\|\s*$", text))
        assert body.count("<table") == tables, md.name
        # a list that python-markdown read as text (no blank line before it, or nested oddly)
        stray = [p for p in re.findall(r"<p>(.*?)</p>", body, re.S) if re.search(r"\n\s*- ", p)]
        assert stray == [], md.name
        for src in re.findall(r'<img [^>]*src="([^"]+)"', body):
            assert (tmp_path / md.stem / src).resolve().is_file() or (tmp_path / src).is_file()


# ---------------------------------------------------------------- every checker can fail


def test_checkers_catch_broken_pages():
    page = ROOT / "docs" / "index.md"
    assert _link_problems("[x](nope.md)", page)
    assert _link_problems("[x](operations.md#no-such-heading)", page)
    assert _link_problems("![x](img/missing.png)", page)
    assert _link_problems("[x](operations.md#metrics-prometheus)", page) == []
    assert _name_problems("streamrl/cli.py")  # removed by the layout move
    assert _name_problems("bench_sessions.py") and _name_problems("streamrl.workers.NoSuchWorker")
    assert _name_problems("losses.no_such_function")
    assert _name_problems("losses.adapt_entropy_coef") == []
    assert _name_problems("[learner] no_such_key")
    assert _name_problems("[learner] share_prompts") == []
    assert _toml_problems("[admission]\nno_such_key = 1\n")
    bad = [
        "streamrl produce --no-such-option 1",
        "streamrl no-such-command",
        "streamrl bench no-such-bench --json",
        "streamrl export --format csv",
        "streamrl worker train",
        "streamrl status extra-argument",
        "rq worker --no-such-option",
        "python bench/no_such_script.py",
        "python bench/readme_training.py --no-such-option 1",
        "python -m streamrl.no_such_module",
        "python -c 'from streamrl.models.tiny import no_such_name'",
        "make no-such-target",
        "pytest tests/no_such_test.py",
        "torchrun --standalone -m streamrl.cli learn --no-such-option",
        "streamrl learn --config configs/no-such.toml",
    ]
    for line in bad:
        (tokens,) = _shell_commands(line)
        assert _command_problems(tokens, True), line
    good = (
        "streamrl --run r produce --env counter -o steps=3 --count 1 && streamrl worker rollout &"
    )
    assert [_command_problems(t, True) for t in _shell_commands(good)] == [[], []]
    assert _command_problems(_inline_command("streamrl --log-format json|csv"), False)
