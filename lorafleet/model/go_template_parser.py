"""The parser of `go_template`: an Ollama chat template's actions, read into nodes whose
expressions are already Jinja, and those nodes written out as Jinja (`emit`); the subset and
the decisions are `go_template`'s."""

from __future__ import annotations

import ast
import re


class GoTemplateError(ValueError):
    """A Go template outside the subset translated; the message names the construct."""


FUNCS = ("eq", "ne", "lt", "le", "gt", "ge", "and", "or", "not", "len", "index", "slice", "json", "print", "printf")
ROOT = {"System": "_System", "Prompt": "_Prompt", "Response": "_Response", "Messages": "_Messages",
        "Tools": "_Tools"}
FIELDS = {"Role": "role", "Content": "content", "ToolCalls": "tool_calls", "Function": "function", "Name": "name",
          "Arguments": "arguments", "Description": "description", "Parameters": "parameters", "Type": "type",
          "Properties": "properties", "Required": "required", "Enum": "enum", "Items": "items",
          "ToolCallID": "tool_call_id", "ToolName": "name", "Index": "index"}
_CMP = {"eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">="}
_ARITY = {"eq": (2, 1 << 10), "not": (1, 1), "len": (1, 1), "json": (1, 1), "slice": (1, 3), "print": (0, 1 << 10),
          **dict.fromkeys(("ne", "lt", "le", "gt", "ge"), (2, 2))}
_TOKEN = re.compile(r"""(?P<ws>\s*)(?:(?P<str>"(?:[^"\\\n]|\\.)*"|`[^`]*`)|(?P<num>-?\d+(?:\.\d+)?)"""
                    r"""|(?P<var>\$\w*)|(?P<field>(?:\.[A-Za-z_]\w*)+|\.)|(?P<ident>[A-Za-z_]\w*)"""
                    r"""|(?P<op>:=|[()|=,])|(?P<bad>\S))""")
_VERB = re.compile(r"%(.)")


def _tokens(body: str, at: int) -> list[tuple[str, str, bool]]:
    """(kind, text, follows whitespace) of an action's words."""
    out = []
    for m in _TOKEN.finditer(body):
        kind = m.lastgroup or ""
        if kind == "bad":
            what = "a character constant" if m["bad"] == "'" else repr(m["bad"])
            raise GoTemplateError(f"{what} in the action at offset {at} is not supported")
        if kind != "ws":
            out.append((kind, m[kind], bool(m["ws"])))
    return out


# -- parsing into Jinja --------------------------------------------------------------------------
# Nodes: ("text", str), ("jinja", str, names .Response), ("if", [(cond, body)], else body | None),
# ("for", head, body, else body | None). An expression is (jinja, kind, literal): kind "str" (a
# string), "args" (tool call arguments), "root" (the root itself) or "" (anything).

class Parser:
    def __init__(self, items: list):
        self.items, self.i, self.names_messages, self.response = items, 0, False, False
        self.dots = ["$"]                          # the dot's Jinja expression; "$" is the root
        self.scopes: list[dict[str, str]] = [{}]   # variables in scope: Go name -> Jinja expression
        self.loops = self.count = 0
        self.stop: tuple = ("", [], 0)
        self.at = 0

    def fail(self, what: str) -> GoTemplateError:
        return GoTemplateError(f"{what} (the action at offset {self.at}) is not supported")

    def block(self, ends: tuple[str, ...]) -> list:
        """Nodes up to an `{{ end }}` or `{{ else ... }}` among `ends` (then in self.stop)."""
        nodes: list = []
        while self.i < len(self.items):
            item, self.i = self.items[self.i], self.i + 1
            if isinstance(item, str):
                nodes += [("text", item)] if item else []
                continue
            self.at = item[1]
            toks = _tokens(*item)
            if not toks:
                raise self.fail("an empty action")
            kind, word = toks[0][:2]
            keyword = word if kind == "ident" else ""
            if keyword in ("end", "else"):
                if keyword not in ends:
                    raise GoTemplateError(f"{{{{ {keyword} }}}} at offset {self.at} is outside any block")
                self.stop = (keyword, toks[1:], self.at)
                return nodes
            if keyword == "if":
                nodes.append(self._if(toks[1:]))
            elif keyword == "range":
                nodes.append(self._range(toks[1:]))
            elif keyword in ("break", "continue"):
                if not self.loops or len(toks) > 1:
                    raise self.fail(f"{{{{ {keyword} }}}} outside a range")
                nodes.append(("jinja", f"{{% {keyword} %}}", False))
            elif keyword in ("with", "define", "template", "block"):
                raise self.fail(f"{{{{ {keyword} }}}}")
            else:
                nodes.append(self._action(toks))
        if ends:
            raise GoTemplateError("a block is not closed with {{ end }}")
        return nodes

    def _scoped(self, ends: tuple[str, ...], names: dict[str, str] | None = None) -> list:
        self.scopes.append(dict(names or {}))
        try:
            return self.block(ends)
        finally:
            self.scopes.pop()

    def _if(self, toks: list) -> tuple:
        branches, cond = [], self.condition(toks)
        while True:
            branches.append((cond, self._scoped(("else", "end"))))
            word, rest, self.at = self.stop
            if word == "end":
                return ("if", branches, None)
            if rest and rest[0][:2] == ("ident", "if"):
                cond = self.condition(rest[1:])
                continue
            if rest:
                raise self.fail(f"{{{{ else {rest[0][1]} }}}}")
            return ("if", branches, self._scoped(("end",)))

    def _range(self, toks: list) -> tuple:
        names: list[str] = []
        if len(toks) > 2 and toks[0][0] == "var" and toks[1][1] == ",":
            names, toks = [toks[0][1], toks[2][1]], toks[3:]
        elif len(toks) > 1 and toks[0][0] == "var" and toks[1][1] == ":=":
            names, toks = [toks[0][1]], toks[1:]
        if names and (not toks or toks[0][1] != ":=" or not all(n[1:] for n in names)):
            raise self.fail("this range declaration")
        over = self.condition(toks[1:] if names else toks)
        self.count += 1
        item = "v_" + names[-1][1:] if names else f"_d{self.count}"
        head = f"{{% for {item} in {over} %}}"
        if len(names) == 2:
            head += f"{{% set v_{names[0][1:]} = loop.index0 %}}"
        self.dots.append(item)
        self.loops += 1
        body = self._scoped(("else", "end"), {n: "v_" + n[1:] for n in names})
        self.dots.pop()
        self.loops -= 1
        word, rest, self.at = self.stop
        if word == "else" and rest:
            raise self.fail(f"{{{{ else {rest[0][1]} }}}} in a range")
        return ("for", head, body, self._scoped(("end",)) if word == "else" else None)

    def _action(self, toks: list) -> tuple:
        self.response = False
        if len(toks) > 1 and toks[0][0] == "var" and toks[1][1] in (":=", "="):
            name = toks[0][1]
            value = self.condition(toks[2:])
            if toks[1][1] == ":=":
                self.scopes[-1][name] = f"_v.v_{name[1:]}"
            elif not self._var(name).startswith("_v."):
                raise self.fail(f"assigning to the range variable {name}")
            return ("jinja", f"{{% set {self._var(name)} = {value} %}}", self.response)
        jinja, kind, _ = self._pipeline(toks)
        return ("jinja", f"{{{{ {jinja if kind == 'str' else f'_p({jinja})'} }}}}", self.response)

    def condition(self, toks: list) -> str:
        return self._pipeline(toks)[0]

    def _pipeline(self, toks: list) -> tuple:
        pos, value = 0, None
        while True:
            end = pos
            level = 0
            while end < len(toks) and not (level == 0 and toks[end][1] == "|"):
                level += {"(": 1, ")": -1}.get(toks[end][1], 0) if toks[end][0] == "op" else 0
                end += 1
            value = self._command(toks[pos:end], value)
            if end == len(toks):
                if value[1] == "root":
                    raise self.fail("the root data as a value")
                return value
            pos = end + 1

    def _command(self, toks: list, piped: tuple | None) -> tuple:
        if not toks:
            raise self.fail("an empty command")
        args, pos = [], 0
        head = toks[0][1] if toks[0][0] == "ident" and toks[0][1] not in ("true", "false", "nil") else None
        pos = 1 if head else 0
        while pos < len(toks):
            value, pos = self._operand(toks, pos)
            args.append(value)
        args += [piped] if piped else []
        if head is None:
            if len(args) != 1:
                raise self.fail("arguments given to a value, not a function")
            return args[0]
        return self._call(head, args)

    def _operand(self, toks: list, pos: int) -> tuple:
        kind, text, _ = toks[pos]
        pos += 1
        if kind == "op" and text == "(":
            level, end = 1, pos
            while end < len(toks) and level:
                level += {"(": 1, ")": -1}.get(toks[end][1], 0) if toks[end][0] == "op" else 0
                end += 1
            if level:
                raise self.fail("an unclosed (")
            value, pos = self._pipeline(toks[pos:end - 1]), end
        elif kind == "str":
            literal = text[1:-1] if text[0] == "`" else ast.literal_eval(text)
            value = (repr(literal), "str", literal)
        elif kind == "num":
            value = (text, "", None)
        elif kind == "ident" and text in ("true", "false", "nil"):
            value = ({"nil": "none"}.get(text, text), "", None)
        elif kind == "ident":
            raise self.fail(f"the function {text}" if text not in FUNCS else f"{text} as an argument, uncalled")
        elif kind == "var":
            value = (self._var(text), "root" if text == "$" else "", None)
        elif kind == "field":
            value = self._fields((self.dots[-1], "root" if self.dots[-1] == "$" else "", None), text)
        else:
            raise self.fail(f"{text!r} here")
        if pos < len(toks) and toks[pos][0] == "field" and not toks[pos][2]:
            value, pos = self._fields(value, toks[pos][1]), pos + 1
        return value, pos

    def _var(self, name: str) -> str:
        if name == "$":
            return "$"
        for scope in reversed(self.scopes):
            if name in scope:
                return scope[name]
        raise self.fail(f"the undefined variable {name}")

    def _fields(self, value: tuple, chain: str) -> tuple:
        jinja, kind, _ = value
        names = [n for n in chain.split(".") if n]
        if not names:
            return value
        for name in names:
            if kind == "root":
                if name not in ROOT:
                    raise self.fail(f"the field .{name}")
                self.names_messages |= name == "Messages"
                self.response |= name == "Response"
                jinja, kind = ROOT[name], ""
                continue
            if name not in FIELDS:
                raise self.fail(f"the field .{name}")
            simple = re.fullmatch(r"[\w.]+", jinja)
            jinja, kind = f"{jinja if simple else f'({jinja} or {{}})'}[{FIELDS[name]!r}]", ""
        return jinja, "args" if names[-1] == "Arguments" else kind, None

    def _call(self, name: str, args: list) -> tuple:
        if name not in FUNCS:
            raise self.fail(f"the function {name}")
        n, js = len(args), [a[0] for a in args]
        least, most = _ARITY.get(name, (1, n))
        if not least <= n <= most:
            raise self.fail(f"{name} with {n} arguments")
        if any(a[1] == "root" for a in args):
            raise self.fail("the root data as a value")
        if name in _CMP:
            return "(" + " or ".join(f"{js[0]} {_CMP[name]} {b}" for b in js[1:]) + ")", "", None
        if name in ("and", "or"):
            return "(" + f" {name} ".join(js) + ")", "", None
        if name == "not":
            return f"(not {js[0]})", "", None
        if name == "len":
            return f"({js[0]}|length)", "", None
        if name == "index":
            return f"({js[0]})" + "".join(f"[{i}]" for i in js[1:]), "", None
        if name == "slice":
            return (f"({js[0]})[{js[1]}:{js[2] if n > 2 else ''}]" if n > 1 else js[0]), "", None
        if name == "json":
            return (f"_p({js[0]})" if args[0][1] == "args" else f"_j({js[0]})"), "str", None
        if name == "print":
            joined = " ~ ".join(a[0] if a[1] == "str" else f"_p({a[0]})" for a in args)
            return (f"({joined})" if args else "''"), "str", None
        fmt = args[0][2]
        if not isinstance(fmt, str):
            raise self.fail("printf with a format that is not a string constant")
        parts, rest, pos = [], list(args[1:]), 0
        for m in _VERB.finditer(fmt):
            parts.append(repr(fmt[pos:m.start()]))
            pos = m.end()
            if m[1] == "%":
                parts.append("'%'")
            elif m[1] in "svd" and rest:
                arg = rest.pop(0)
                parts.append(arg[0] if arg[1] == "str" else f"_p({arg[0]})")
            else:
                raise self.fail(f"the printf verb %{m[1]}" if m[1] not in "svd" else "printf with too few arguments")
        if rest:
            raise self.fail("printf with more arguments than verbs")
        return "(" + " ~ ".join(parts + [repr(fmt[pos:])]) + ")", "str", None


def cut_after_response(nodes: list, cut: list[bool]) -> list:
    """`nodes` less everything after the first action naming .Response, as Ollama cuts its last turn."""
    out: list = []
    for node in nodes:
        if cut[0]:
            break
        if node[0] == "if":
            branches = []
            for cond, body in node[1]:
                if not cut[0]:
                    branches.append((cond, cut_after_response(body, cut)))
            out.append(("if", branches, None if cut[0] or node[2] is None else cut_after_response(node[2], cut)))
        elif node[0] == "for":
            body = cut_after_response(node[2], cut)
            out.append(("for", node[1], body, None if cut[0] or node[3] is None else cut_after_response(node[3], cut)))
        else:
            out.append(node)
            cut[0] = node[0] == "jinja" and node[2]
    return out


def emit(nodes: list) -> str:
    parts = []
    for node in nodes:
        if node[0] == "text":
            parts.append("{{ %r }}" % node[1])
        elif node[0] == "jinja":
            parts.append(node[1])
        elif node[0] == "if":
            for n, (cond, body) in enumerate(node[1]):
                parts.append(f"{{% {'elif' if n else 'if'} {cond} %}}{emit(body)}")
            parts.append(("{% else %}" + emit(node[2]) if node[2] is not None else "") + "{% endif %}")
        else:
            parts.append(node[1] + emit(node[2]) + ("{% else %}" + emit(node[3]) if node[3] is not None else "") +
                         "{% endfor %}")
    return "".join(parts)
