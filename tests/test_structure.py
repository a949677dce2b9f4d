"""The package's shape, kept by rules over every file of mcore_rl/ (no list of names to keep up to date).

- no file over 650 lines; models/bridge.py (it builds, names and loads; the export is weights/'s) at most 500;
- no function or method in trainer.py over 50 lines (the loop reads as calls to the parts);
- no block of 6 or more identical lines written twice anywhere in the package: one implementation of each idea.
  Blank lines, comments, import statements and lines that are only brackets, `else:`-like keywords or
  docstring quotes do not count towards a block and do not break one.
Each checker is a pure function of source text; the `*_can_fail` tests run them on planted text.
Pure Python, no import of the package: a fraction of a second.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "mcore_rl"
MAX_FILE_LINES = 650
FILE_LIMITS = {"models/bridge.py": 500}
FUNCTION_LIMITS = {"trainer.py": 50}
MIN_BLOCK = 6

# A line made only of these characters, or one of these words, carries no logic of its own.
_PUNCTUATION = set("()[]{},:;")
_TRIVIAL = {"else:", "try:", "finally:", "pass", "return", "continue", "break", '"""', "'''", 'r"""', "..."}


def package_sources(root: Path = PACKAGE) -> dict[str, str]:
    """Every Python file of the package: path relative to it -> text."""
    return {path.relative_to(root).as_posix(): path.read_text() for path in sorted(root.rglob("*.py"))}


# -------------------------------------------------------------------------------------------------- sizes


def long_files(sources: dict[str, str], limit: int, own_limits: dict[str, int]) -> list[str]:
    """'path: N lines (limit L)' for every file over its limit (its own, else `limit`)."""
    out = []
    for path, text in sources.items():
        lines, most = len(text.splitlines()), own_limits.get(path, limit)
        if lines > most:
            out.append(f"{path}: {lines} lines (limit {most})")
    return out


def long_functions(text: str, limit: int) -> list[str]:
    """'Class.method: N lines' for every function or method (nested ones too) longer than `limit`, measured
    from its `def` line (decorators not counted) to its last line."""
    out = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                visit(child, prefix)
                continue
            name = prefix + child.name
            lines = child.end_lineno - child.lineno + 1
            if not isinstance(child, ast.ClassDef) and lines > limit:
                out.append(f"{name}: {lines} lines (limit {limit})")
            visit(child, name + ".")

    visit(ast.parse(text), "")
    return out


# --------------------------------------------------------------------------------------- repeated blocks


def _import_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            lines.update(range(node.lineno, node.end_lineno + 1))
    return lines


def significant_lines(text: str) -> list[tuple[int, str]]:
    """(line number, the line with its white space folded) of every line that counts towards a block."""
    skip = _import_lines(ast.parse(text))
    out = []
    for number, line in enumerate(text.splitlines(), start=1):
        folded = re.sub(r"\s+", " ", line.strip())
        if number in skip or not folded or folded.startswith("#"):
            continue
        if folded in _TRIVIAL or set(folded) <= _PUNCTUATION:
            continue
        out.append((number, folded))
    return out


def repeated_blocks(sources: dict[str, str], size: int = MIN_BLOCK) -> list[str]:
    """'a.py:10-24 ~ b.py:40-54' for every block of at least `size` identical significant lines that stands in
    two places (in one file or two); runs longer than `size` are reported once, whole."""
    lines = {path: significant_lines(text) for path, text in sources.items()}
    places = defaultdict(list)  # a window of `size` lines -> [(path, index of its first line)]
    for path, rows in lines.items():
        for i in range(len(rows) - size + 1):
            places[tuple(text for _, text in rows[i : i + size])].append((path, i))
    pairs = set()
    for spots in places.values():
        for k, (pa, ia) in enumerate(spots):
            for pb, ib in spots[k + 1 :]:
                if pa != pb or ib - ia >= size:  # overlapping windows of one file are one place
                    pairs.add((pa, ia, pb, ib))
    out = []
    for pa, ia, pb, ib in sorted(pairs):
        if (pa, ia - 1, pb, ib - 1) in pairs:
            continue  # inside a longer run, reported from its start
        n = 0
        while (pa, ia + n + 1, pb, ib + n + 1) in pairs:
            n += 1
        a, b = lines[pa], lines[pb]
        out.append(f"{pa}:{a[ia][0]}-{a[ia + n + size - 1][0]} ~ {pb}:{b[ib][0]}-{b[ib + n + size - 1][0]}")
    return out


# ------------------------------------------------------------------------------------------- the package


def test_no_file_is_over_its_size_limit():
    too_long = long_files(package_sources(), MAX_FILE_LINES, FILE_LIMITS)
    assert not too_long, "split these by job (one concern a file): " + "; ".join(too_long)


def test_no_function_in_the_trainer_is_over_its_limit():
    sources = package_sources()
    too_long = [f"{path}: {f}" for path, most in FUNCTION_LIMITS.items() for f in long_functions(sources[path], most)]
    assert not too_long, "the loop should read as calls to the parts; split: " + "; ".join(too_long)


def test_no_block_of_code_is_written_twice():
    repeats = repeated_blocks(package_sources())
    assert not repeats, "one implementation of each idea; make one serve both: " + "; ".join(repeats)


def test_the_limits_cover_files_that_exist():
    """A limit for a file that was renamed away would check nothing."""
    sources = package_sources()
    assert set(FILE_LIMITS) | set(FUNCTION_LIMITS) <= set(sources)


# ----------------------------------------------------------------------------------- the checkers can fail


def _lines(n: int, word: str = "x") -> str:
    return "".join(f"{word}{i} = {i}\n" for i in range(n))


def test_long_files_can_fail():
    sources = {"a.py": _lines(651), "b.py": _lines(650), "models/bridge.py": _lines(501)}
    assert long_files(sources, 650, {"models/bridge.py": 500}) == [
        "a.py: 651 lines (limit 650)",
        "models/bridge.py: 501 lines (limit 500)",
    ]
    assert long_files({"models/bridge.py": _lines(500)}, 650, {"models/bridge.py": 500}) == []


def _function(header: str, lines: int, indent: str = "") -> str:
    """A function of `lines` lines (its def line included), at `indent`."""
    return f"{indent}{header}\n" + "".join(f"{indent}    y{i} = {i}\n" for i in range(lines - 1))


def test_long_functions_can_fail():
    text = (
        _function("def fits():", 50)
        + _function("def over():", 51)
        + "class Loop:\n"
        + _function("async def step(self):", 51, "    ")
        + "    @property\n"
        + _function("def short(self):", 2, "    ")
        + "def outer():\n"
        + _function("def inner():", 51, "    ")
    )
    assert long_functions(text, 50) == [
        "over: 51 lines (limit 50)",
        "Loop.step: 51 lines (limit 50)",
        "outer: 52 lines (limit 50)",
        "outer.inner: 51 lines (limit 50)",
    ]


_BLOCK = """\
    total = 0
    for row in rows:
        if row.valid:
            total += row.tokens
        else:
            skipped.append(row)
    return total / max(len(rows), 1)
"""


def _indented(block: str, by: str) -> str:
    return "".join(by + line if line.strip() else line for line in block.splitlines(keepends=True))


def test_repeated_blocks_can_fail():
    a = f"import os\n\n\ndef f(rows, skipped):\n{_BLOCK}"
    # the same lines with other comments, blank lines and indentation are the same block
    spaced = _BLOCK.replace("    total = 0\n", "    total = 0\n\n    # sum the valid rows\n")
    b = f"class C:\n    def g(self, rows, skipped):\n{_indented(spaced, '    ')}"
    assert repeated_blocks({"a.py": a, "b.py": b}) == ["a.py:5-11 ~ b.py:3-11"]
    twice = a + f"\n\ndef h(rows, skipped):\n{_BLOCK}"
    assert repeated_blocks({"a.py": twice}) == ["a.py:5-11 ~ a.py:15-21"]
    # five lines in common are not a block; a changed line splits one
    five = "def g(rows, skipped):\n" + "".join(_BLOCK.splitlines(keepends=True)[:6]) + "    return total\n"
    assert repeated_blocks({"a.py": a, "b.py": five}) == []
    changed = _BLOCK.replace("total += row.tokens", "total += row.length")
    assert repeated_blocks({"a.py": a, "b.py": f"def g(rows, skipped):\n{changed}"}) == []


def test_imports_and_trivial_lines_do_not_make_a_block():
    text = (
        "from x import (\n    a,\n    b,\n    c,\n    d,\n    e,\n    f,\n)\nimport os\nimport re\n\n\n"
        'def f(y):\n    """\n    Doc.\n    """\n    try:\n        pass\n    finally:\n        pass\n'
        "    z = [\n        (\n            {\n            },\n        ),\n    ]\n    return\n"
    )
    assert repeated_blocks({"a.py": text, "b.py": text}) == []
