"""Reading a verl launch script the way the shell would, for the constructs launch scripts use - without
running anything.

Evaluated: variable assignments (also several on one line, and `export` / `declare` / `readonly` / `local`),
`$VAR`, `${VAR}`, `${VAR:-default}` / `${VAR-default}` / `${VAR:=default}` / `${VAR:+alt}`, `$((...))` integer
arithmetic, positional parameters (`$@`, `"$@"`, `$1`, `$#`), single / double quotes and backslashes, line
continuations, comments, word splitting of unquoted expansions (so `$ACTOR_CONFIG` holding several overrides
gives several words). Commands other than assignments are not run; the one that starts verl's trainer
(`python3 -m verl.trainer.main_ppo ...`, also after `ray job submit ... --`, `srun`, `torchrun`, ...) is the launch.

Not evaluated, and said so in `ShellRead.notes`: command substitution `$(...)` / backquotes (kept as text),
other `${...}` forms, and control flow (`if` / `for` / `while` / `case` / functions): assignments inside such a
block are not applied, because which branch the shell takes is not known without running it.
"""

from __future__ import annotations

import ast
import operator
import re
from dataclasses import dataclass, field
from typing import Optional

NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
ASSIGNMENT = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)(\+?)=")
OPENERS = {"if", "for", "while", "until", "case", "select", "{", "function"}
CLOSERS = {"fi", "done", "esac", "}"}
LEADING_KEYWORDS = {"then", "do", "else", "elif", "!"}
DECLARERS = {"export", "declare", "typeset", "readonly", "local"}


class ShellError(ValueError):
    """The script cannot be read (unterminated quote, bad arithmetic, no trainer command)."""


@dataclass
class Command:
    words: list[str]  # raw words, quotes kept, as written
    line: int  # first line of the command (1-based)


@dataclass
class ShellRead:
    argv: list[str]  # the trainer command's words after expansion, from the interpreter on
    line: int  # where that command starts
    variables: dict[str, str]  # the variables when the command runs
    notes: list[str] = field(default_factory=list)  # what was not evaluated, and where
    # variables the trainer command read while unset (also through an assignment that read them): name -> line
    unset_reads: dict[str, int] = field(default_factory=dict)

    @property
    def unset(self) -> list[str]:
        return list(self.unset_reads)

    def unset_notes(self) -> list[str]:
        return [
            f"line {line}: ${name} is not set in the script (an environment variable is not read here), so it "
            f"expanded to nothing: set it in the script or put its value into the command"
            for name, line in self.unset_reads.items()
        ]


# ------------------------------------------------------------------------------------------------- lexing


def _skip_quoted(text: str, i: int, quote: str, line: int) -> int:
    """Index after the closing quote of a quoted span starting at text[i] == quote."""
    j = i + 1
    while j < len(text):
        c = text[j]
        if c == quote:
            return j + 1
        if quote == '"' and c == "\\":
            j += 2
            continue
        if quote == '"' and text.startswith("$(", j):
            j = _skip_dollar(text, j, line)
            continue
        j += 1
    raise ShellError(f"line {line}: the {quote} quote opened here is never closed")


def _skip_dollar(text: str, i: int, line: int) -> int:
    """Index after a `$(...)`, `$((...))` or `${...}` starting at text[i] == '$'."""
    close = {"(": ")", "{": "}"}[text[i + 1]]
    open_ = text[i + 1]
    depth, j = 0, i + 1
    while j < len(text):
        c = text[j]
        if c in "'\"" and close == ")":
            j = _skip_quoted(text, j, c, line)
            continue
        if c == "\\":
            j += 2
            continue
        if c == open_:
            depth += 1
        elif c == close:
            depth -= 1
            if depth == 0:
                return j + 1
        j += 1
    raise ShellError(f"line {line}: the '${open_}' opened here is never closed")


def _skip_heredocs(text: str, i: int, line: int, heredocs: list[tuple[str, bool]]) -> tuple[int, int]:
    """Index and line after the bodies of the here-documents opened on the line that just ended."""
    for delimiter, strip_tabs in heredocs:
        while i < len(text):
            end = text.find("\n", i)
            end = len(text) if end < 0 else end
            body_line = text[i:end]
            i, line = end + 1, line + 1
            if (body_line.lstrip("\t") if strip_tabs else body_line) == delimiter:
                break
    return i, line


def split_commands(text: str) -> list[Command]:
    """The script's simple commands, as raw words (quotes and expansions not yet evaluated)."""
    commands: list[Command] = []
    words: list[str] = []
    word: list[str] = []
    line = 1
    start_line = 1
    i = 0
    heredocs: list[tuple[str, bool]] = []  # (delimiter, <<- strips leading tabs) of the current line

    def end_word():
        if word:
            words.append("".join(word))
            word.clear()

    def end_command():
        end_word()
        if words:
            commands.append(Command(list(words), start_line))
            words.clear()

    while i < len(text):
        c = text[i]
        if c == "\\" and text.startswith("\\\n", i):  # line continuation
            i += 2
            line += 1
            continue
        if c == "\\":
            word.append(text[i : i + 2])
            i += 2
            continue
        if c in " \t\r":
            end_word()
            i += 1
            continue
        if text.startswith("<<", i) and not text.startswith("<<<", i) and not word:  # a here-document
            m = re.compile(r"<<(-?)[ \t]*(['\"]?)(\w+)\2").match(text, i)
            if m:
                heredocs.append((m.group(3), m.group(1) == "-"))
                i = m.end()
                continue
        redirect = c == "&" and (text[i - 1 : i] == ">" or text[i + 1 : i + 2] == ">")
        if not redirect and c in "\n;&|":
            end_command()
            if c == "\n":
                line += 1
            i += 2 if text[i : i + 2] in ("&&", "||", ";;") else 1
            if c == "\n" and heredocs:  # its body is text for the command, not commands
                i, line = _skip_heredocs(text, i, line, heredocs)
                heredocs.clear()
            if not words:
                start_line = line
            continue
        if c == "#" and not word:  # a comment starts only at the start of a word
            while i < len(text) and text[i] != "\n":
                i += 1
            continue
        if not words and not word:
            start_line = line
        if c in "'\"":
            j = _skip_quoted(text, i, c, line)
        elif c == "$" and text[i + 1 : i + 2] in ("(", "{"):
            j = _skip_dollar(text, i, line)
        elif c == "`":
            j = text.find("`", i + 1)
            if j < 0:
                raise ShellError(f"line {line}: the backquote opened here is never closed")
            j += 1
        else:
            j = i + 1
        span = text[i:j]
        line += span.count("\n")
        word.append(span.replace("\\\n", ""))
        i = j
    end_command()
    return commands


# --------------------------------------------------------------------------------------------- arithmetic

_BINOPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Mod: lambda a, b: a - b * int(a / b),  # C semantics: the sign of the dividend
    ast.Pow: operator.pow,
    ast.FloorDiv: lambda a, b: int(a / b),  # shell division truncates toward zero
    ast.LShift: operator.lshift,
    ast.RShift: operator.rshift,
    ast.BitAnd: operator.and_,
    ast.BitOr: operator.or_,
    ast.BitXor: operator.xor,
}


def arithmetic(expr: str, variables: dict[str, str], line: int) -> int:
    """`$(( expr ))`: integers, + - * / % ** << >> & | ^, parentheses, unary +/-, variable names."""

    def value_of(name: str, depth: int = 0) -> int:
        raw = variables.get(name, "").strip()
        if not raw:
            return 0  # an unset or empty variable is 0 in shell arithmetic
        if re.fullmatch(r"[+-]?\d+", raw):
            return int(raw)
        if depth < 8:  # a variable may hold an expression itself
            return evaluate(raw, depth + 1)
        raise ShellError(f"line {line}: ${name} = {raw!r} is not an integer in $(( {expr} ))")

    def evaluate(source: str, depth: int = 0) -> int:
        py = re.sub(r"(?<![*/])/(?![/])", "//", source.replace("$", ""))
        try:
            tree = ast.parse(py.strip(), mode="eval")
        except SyntaxError:
            raise ShellError(f"line {line}: $(( {expr} )) is not integer arithmetic this reader evaluates") from None

        def ev(node) -> int:
            if isinstance(node, ast.Expression):
                return ev(node.body)
            if isinstance(node, ast.Constant) and isinstance(node.value, int):
                return node.value
            if isinstance(node, ast.Name):
                return value_of(node.id, depth)
            if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
                v = ev(node.operand)
                return -v if isinstance(node.op, ast.USub) else v
            if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
                left, right = ev(node.left), ev(node.right)
                if isinstance(node.op, (ast.FloorDiv, ast.Mod)) and right == 0:
                    raise ShellError(f"line {line}: division by zero in $(( {expr} ))")
                return _BINOPS[type(node.op)](left, right)
            raise ShellError(f"line {line}: $(( {expr} )) is not integer arithmetic this reader evaluates")

        return ev(tree)

    return evaluate(expr)


# ---------------------------------------------------------------------------------------------- expansion


@dataclass
class _Expander:
    variables: dict[str, str]
    positional: list[str]
    script_name: str
    notes: list[str]
    line: int = 0
    reads: dict[str, int] = field(default_factory=dict)  # unset variables read since the last reset: name -> line
    taint: dict[str, dict[str, int]] = field(default_factory=dict)  # variable -> the unset ones its value read

    def parameter(self, body: str) -> str:
        """The value of `${body}` (body without the braces)."""
        m = re.fullmatch(r"([A-Za-z_][A-Za-z0-9_]*|\d+|[@*#])(?:(:?[-=+])(.*))?", body, re.S)
        if not m:
            self.notes.append(f"line {self.line}: ${{{body}}} is not evaluated (only ${{VAR}}, ${{VAR:-default}} ...)")
            return "${" + body + "}"
        name, op, arg = m.group(1), m.group(2), m.group(3)
        read_before = name in self.reads
        value = self.simple(name)
        is_set = name in self.variables or (name.isdigit() and 0 < int(name) <= len(self.positional))
        if op is None:
            return value
        if not is_set and not read_before:  # the form itself says what an unset variable gives
            self.reads.pop(name, None)
        arg_value = self.expand_text(arg)
        empty = (not is_set) or (op.startswith(":") and value == "")
        if op in (":-", "-"):
            return arg_value if empty else value
        if op in (":=", "="):
            if empty:
                self.variables[name] = arg_value
                return arg_value
            return value
        return "" if empty else arg_value  # :+ / +

    def simple(self, name: str) -> str:
        if name in ("@", "*"):
            return " ".join(self.positional)
        if name == "#":
            return str(len(self.positional))
        if name == "0":
            return self.script_name
        if name.isdigit():
            k = int(name)
            if k > len(self.positional):
                self.reads.setdefault(name, self.line)
            return self.positional[k - 1] if k <= len(self.positional) else ""
        if name not in self.variables:
            self.reads.setdefault(name, self.line)
        for tainted, line in self.taint.get(name, {}).items():
            self.reads.setdefault(tainted, line)
        return self.variables.get(name, "")

    def expand_text(self, text: str, in_double: bool = False) -> str:
        """Expansion with no word splitting: assignment values, `${VAR:-default}` words, double-quoted text."""
        out = []
        for piece, _ in self.pieces(text, in_double):
            out.append(" ".join(self.positional) if piece is _SEPARATE else piece)
        return "".join(out)

    def dollar(self, text: str, i: int) -> tuple[str, int]:
        """The expansion of the `$...` at text[i]; (value, index after it)."""
        if text.startswith("$((", i):
            j = _skip_dollar(text, i, self.line)
            inner = text[i + 3 : j - 2]
            return str(arithmetic(self.expand_text(inner), self.variables, self.line)), j
        if text.startswith("$(", i):
            j = _skip_dollar(text, i, self.line)
            self.notes.append(f"line {self.line}: command substitution {text[i:j]} is not run; its text is kept")
            return text[i:j], j
        if text.startswith("${", i):
            j = _skip_dollar(text, i, self.line)
            return self.parameter(text[i + 2 : j - 1]), j
        m = NAME.match(text, i + 1) or re.compile(r"[0-9@*#?$!-]").match(text, i + 1)
        if not m:
            return "$", i + 1
        name = m.group(0)
        if name in ("?", "$", "!", "-"):
            self.notes.append(f"line {self.line}: ${name} is not evaluated; its text is kept")
            return "$" + name, m.end()
        return self.simple(name), m.end()

    def pieces(self, text: str, in_double: bool = False):
        """(text, splittable) pieces of a raw word: splittable = an unquoted expansion's result."""
        i = 0
        while i < len(text):
            c = text[i]
            if c == "'" and not in_double:
                j = text.index("'", i + 1)
                yield text[i + 1 : j], False
                i = j + 1
            elif c == '"' and not in_double:
                j = _skip_quoted(text, i, '"', self.line)
                inner = text[i + 1 : j - 1]
                if inner == "$@":  # "$@": one word per positional parameter
                    yield _SEPARATE, False
                    i = j
                    continue
                yield self.expand_text(inner, in_double=True), False
                i = j
            elif c == "\\":
                nxt = text[i + 1 : i + 2]
                if in_double and nxt not in ('"', "\\", "$", "`"):
                    yield "\\" + nxt, False
                else:
                    yield nxt, False
                i += 2
            elif c == "$":
                value, i = self.dollar(text, i)
                yield value, not in_double
            elif c == "`":
                j = text.index("`", i + 1) + 1
                self.notes.append(f"line {self.line}: command substitution {text[i:j]} is not run; its text is kept")
                yield text[i:j], False
                i = j
            else:
                stops = "\\$`" if in_double else "'\"\\$`"  # quotes are ordinary characters inside double quotes
                j = i + 1
                while j < len(text) and text[j] not in stops:
                    j += 1
                yield text[i:j], False
                i = j

    def words(self, raw: str) -> list[str]:
        """A raw word -> the words it becomes (unquoted expansions split on whitespace; empty ones vanish)."""
        out: list[str] = []
        current: list[str] = []
        quoted_empty = False
        for piece, splittable in self.pieces(raw):
            if piece is _SEPARATE:
                if current:
                    out.append("".join(current))
                    current = []
                out.extend(self.positional)
                continue
            if not splittable:
                current.append(piece)
                quoted_empty = quoted_empty or piece == ""
                continue
            parts = re.split(r"[ \t\n]+", piece)
            for k, part in enumerate(parts):
                if k > 0 and current:
                    out.append("".join(current))
                    current = []
                if part:
                    current.append(part)
        if current or (quoted_empty and not out):
            out.append("".join(current))
        return out


_SEPARATE = object()


# ----------------------------------------------------------------------------------------------- running


def _is_launch(words: list[str]) -> Optional[int]:
    """Index of the first word after the trainer module / script in an expanded command, if it is the launch."""
    for k, w in enumerate(words):
        if w == "-m" and k + 1 < len(words):
            module = words[k + 1]
            if module.split(".")[-1].startswith("main_") and module.split(".")[0] in ("verl", "recipe"):
                return k + 2
        if re.search(r"(^|/)(verl|recipe)/.*main_\w+\.py$", w):
            return k + 1
    return None


def read_script(text: str, positional: tuple[str, ...] = (), script_name: str = "script") -> ShellRead:
    """Evaluate assignments in order and return the trainer command as the shell would have built it."""
    variables: dict[str, str] = {}
    notes: list[str] = []
    expander = _Expander(variables, list(positional), script_name, notes)
    depth = 0
    block_line = 0
    found: Optional[ShellRead] = None
    for command in split_commands(text):
        expander.line = command.line
        raw = list(command.words)
        while raw and raw[0] in LEADING_KEYWORDS:
            raw.pop(0)
        if not raw:
            continue
        head = raw[0]
        if head in CLOSERS:
            depth = max(0, depth - 1)
            continue
        if head in OPENERS or re.fullmatch(r"[A-Za-z_][\w-]*\(\)", head) or (len(raw) > 1 and raw[1] == "()"):
            if depth == 0:
                block_line = command.line
            depth += 1
            if head in ("if", "while", "until"):  # the condition itself is a command: look for the launch in it
                raw = raw[1:]
            else:
                continue
            if not raw:
                continue
        assignments, rest = _leading_assignments(raw)
        if rest and rest[0] in DECLARERS:
            assignments = [w for w in rest[1:] if ASSIGNMENT.match(w)]
            rest = []
        if depth > 0 and assignments and not rest:
            names = ", ".join(ASSIGNMENT.match(w).group(1) for w in assignments)
            notes.append(
                f"line {command.line}: {names} assigned inside the control-flow block from line {block_line} "
                f"(if / for / case / function): not applied - the branch taken is not known without running the script"
            )
            continue
        if not rest:
            for w in assignments:
                _assign(w, expander)
            continue
        expanded = [_expand_word(w, expander) for w in rest]
        words = [x for out, _ in expanded for x in out]
        start = _is_launch(words)
        if start is None:
            continue
        if found is not None:
            notes.append(
                f"line {command.line}: a second trainer command; the first (line {found.line}) is the one converted"
            )
            continue
        found = ShellRead(
            argv=_drop_redirections(words),
            line=command.line,
            variables=dict(variables),
            notes=notes,
            unset_reads=_reads_from(expanded, start),
        )
    if found is None:
        raise ShellError(
            "no verl trainer command found (python3 -m verl.trainer.main_ppo ...): give the launch script, or the "
            "command line itself in quotes"
        )
    return found


def _expand_word(raw: str, expander: _Expander) -> tuple[list[str], dict[str, int]]:
    """The words a raw word becomes, and the unset variables it read."""
    expander.reads = {}
    return expander.words(raw), dict(expander.reads)


def _reads_from(expanded: list[tuple[list[str], dict[str, int]]], start: int) -> dict[str, int]:
    """The unset variables read by the words from index `start` on (the trainer's arguments, not a wrapper's
    such as `ray job submit --address=$RAY_ADDRESS`); a word that vanished counts where it stood."""
    reads: dict[str, int] = {}
    k = 0
    for out, read in expanded:
        if k + len(out) > start or (not out and k >= start):
            reads.update({name: line for name, line in read.items() if name not in reads})
        k += len(out)
    return reads


def _drop_redirections(words: list[str]) -> list[str]:
    """`> log 2>&1` and the like are the shell's, not the trainer's arguments."""
    out: list[str] = []
    skip = False
    for w in words:
        if skip:
            skip = False
            continue
        m = re.fullmatch(r"\d*(>>?|<|&>)(&\d+)?(.*)", w)
        if m:
            skip = not m.group(2) and not m.group(3)  # `> FILE`: the file is the next word
            continue
        out.append(w)
    return out


def _leading_assignments(raw: list[str]) -> tuple[list[str], list[str]]:
    k = 0
    while k < len(raw) and ASSIGNMENT.match(raw[k]):
        k += 1
    return raw[:k], raw[k:]


def _assign(word: str, expander: _Expander) -> None:
    m = ASSIGNMENT.match(word)
    name, append = m.group(1), m.group(2)
    value_raw = word[m.end() :]
    if value_raw.startswith("("):  # an array: kept as its text
        expander.notes.append(f"line {expander.line}: the array {name}=(...) is kept as text")
        expander.variables[name] = value_raw
        return
    expander.reads = {}
    value = expander.expand_text(value_raw)
    expander.taint[name] = {**expander.taint.get(name, {}), **expander.reads} if append else dict(expander.reads)
    expander.variables[name] = expander.variables.get(name, "") + value if append else value
