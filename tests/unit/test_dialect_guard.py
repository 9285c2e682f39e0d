"""No client API's name is spelled outside its dialect (issue 21 §2): the gateway's modules name an
API by `gateway.dialects.names` (`CHAT`, `Api`, ...) and ask its dialect (`gateway/dialects/`) what
it means. The simulator (`gateway/sim/`) plays the engines, so it speaks their APIs itself.

A string literal equal to an API name counts, but for the JSON member names that share one
(`messages`, the chat body's list; `responses`, an OpenAPI operation's answers): read as a
subscript (`body["messages"]`), a `.get`/`.pop`/`.setdefault` key, or an error's `param=`. What
is left is listed in `ALLOWED` with its reason."""

from __future__ import annotations

import ast

from gateway.dialects.names import APIS
from tests.support import REPO_ROOT

PACKAGE = REPO_ROOT / "gateway"
OWN = ("gateway/dialects/", "gateway/sim/")
"""Where API names are spelled: the dialects themselves, and the simulated engines."""

NAMES = frozenset(APIS)
MEMBER_METHODS = frozenset({"get", "pop", "setdefault"})

ALLOWED: dict[tuple[str, str], str] = {
    ("gateway/protocol/anthropic.py", "messages"): "the chat body's `messages` member in a dict display (to_chat)",
    ("gateway/protocol/pooling.py", "messages"): "the embeddings body's `messages` member in its JSON Schema",
    ("gateway/api/proxied.py", "responses"): "an OpenAPI operation's `responses` member in a dict display",
    ("gateway/affinity/response_store.py", "responses"): "the stored-response store's name in its close log line",
}
"""(module, literal) → why it is not an API name."""


def _member_use(node: ast.Constant, parents: dict[ast.AST, ast.AST]) -> bool:
    """Whether the literal is a JSON member name: a subscript, a get/pop/setdefault key, or `param=`."""
    parent = parents.get(node)
    if isinstance(parent, ast.Subscript) and parent.slice is node:  # but `Literal["chat"]` names a type
        value = parent.value
        return (value.id if isinstance(value, ast.Name) else getattr(value, "attr", None)) != "Literal"
    if isinstance(parent, ast.Call) and parent.args and parent.args[0] is node \
            and isinstance(parent.func, ast.Attribute) and parent.func.attr in MEMBER_METHODS:
        return True
    return isinstance(parent, ast.keyword) and parent.arg == "param"


def api_literals(source: str) -> list[tuple[int, str]]:
    """(line, literal) of every API-name string literal in `source` that is not a member name."""
    tree = ast.parse(source)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    return sorted((node.lineno, node.value) for node in ast.walk(tree)
                  if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in NAMES
                  and not _member_use(node, parents))


def test_the_guard_finds_api_literals() -> None:
    source = '''
if api == "responses":
    pass
PATHS = {"chat": "/v1/chat/completions"}
kind: typing.Literal["count_tokens"] = "count_tokens"
ok = body["messages"], body.get("messages"), InvalidRequest("x", param="messages")
doc = "messages and completions"
'''
    assert api_literals(source) == [(2, "responses"), (4, "chat"), (5, "count_tokens"), (5, "count_tokens")]


def test_no_api_name_literal_outside_the_dialects() -> None:
    found: list[str] = []
    seen_allowed: set[tuple[str, str]] = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(REPO_ROOT).as_posix()
        if relative.startswith(OWN):
            continue
        for line, literal in api_literals(path.read_text(encoding="utf-8")):
            if (relative, literal) in ALLOWED:
                seen_allowed.add((relative, literal))
            else:
                found.append(f"{relative}:{line}: {literal!r}")
    assert not found, "API names spelled outside gateway/dialects/ (use gateway.dialects.names and the dialect):\n" \
        + "\n".join(found)
    assert seen_allowed == set(ALLOWED), f"stale ALLOWED entries: {set(ALLOWED) - seen_allowed}"
