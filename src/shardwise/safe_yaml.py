"""Reading one YAML document without letting it hang or exhaust memory, with line numbers.

`read_yaml` refuses non-UTF-8 bytes, control characters, nesting past the recursion limit,
alias bombs and cyclic aliases, each as a ShardwiseError naming the file and line;
`key_lines` maps every key path to its line, so that a validation error can name it too.
The trainer's config loader (shardwise.train.config) is built on these.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from shardwise.errors import ShardwiseError

# A YAML document is a graph: an alias (*a) points at an anchored node (&a) instead of copying
# it, so 9 lines of aliases to aliases ("billion laughs") describe 10^9 values. Anything that
# walks the values (line mapping, pydantic, an error message's repr) expands them. Documents
# whose values, with every alias expanded, exceed this budget are refused; a real config has
# a few hundred.
MAX_YAML_VALUES = 100_000


class Refused(Exception):
    """The document graph is cyclic or expands past MAX_YAML_VALUES (raised by expanded_size)."""

    def __init__(self, node: Any, cyclic: bool):
        self.node, self.cyclic = node, cyclic


def node_children(node: Any) -> list:
    if isinstance(node, yaml.MappingNode):
        return [x for kv in node.value for x in kv]
    return list(node.value) if isinstance(node, yaml.SequenceNode) else []


def value_children(value: Any) -> list:
    if isinstance(value, dict):
        return [*value.keys(), *value.values()]
    return list(value) if isinstance(value, (list, tuple)) else []


def expanded_size(root: Any, children: Any, limit: int = MAX_YAML_VALUES) -> int:
    """Number of values in the graph under `root` with every shared node counted each time it is
    referenced, computed once per distinct node (linear, iterative: no re-expansion, no deep
    recursion). Raises Refused at the first node past `limit`, or on a cycle (`&a [*a]`)."""
    size: dict[int, int] = {}
    active: set[int] = set()  # nodes on the current depth-first path
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        k = id(node)
        if done:
            active.discard(k)
            total = 1 + sum(size[id(c)] for c in children(node))
            if total > limit:
                raise Refused(node, cyclic=False)
            size[k] = total
        elif k in active:
            raise Refused(node, cyclic=True)
        elif k not in size:
            active.add(k)
            stack.append((node, True))
            stack.extend((c, False) for c in children(node) if id(c) not in size)
    return size[id(root)]


def refusal(where: str, e: Refused) -> ShardwiseError:
    if e.cyclic:
        return ShardwiseError(f"{where}: a YAML alias refers to the node that contains it (a cycle); expected a "
                              "config whose values are written out or aliased without cycles.")
    return ShardwiseError(f"{where}: the YAML values expand to more than {MAX_YAML_VALUES:,} with their aliases "
                          "(*name) resolved (an alias bomb?); expected a config with its values written out or "
                          "a few aliases.")


def check_values(value: Any, where: str) -> None:
    """Hold a constructed value (a document after `--set` overrides, whose values are YAML too)
    to the same budget; `where` starts the error."""
    try:
        expanded_size(value, value_children)
    except Refused as e:
        raise refusal(where, e) from None


def read_yaml(path: Path) -> tuple[Any, Any]:
    """(composed node, constructed value) of the single YAML document in `path`, refusing what
    would hang or exhaust memory: non-UTF-8 bytes, nesting past the recursion limit, alias
    bombs and cyclic aliases. Composed once; the values are built from that node."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ShardwiseError(f"{path}: config file not found") from None
    except IsADirectoryError:
        raise ShardwiseError(f"{path}: is a directory (expected a YAML config file)") from None
    except OSError as e:
        raise ShardwiseError(f"{path}: cannot read the config ({e.strerror})") from None
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise ShardwiseError(f"{path}:{line}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); "
                             "expected a YAML config saved as UTF-8.") from None  # fmt: skip
    loader = None
    try:
        loader = yaml.SafeLoader(text)  # its reader refuses control characters: a YAMLError too
        node = loader.get_single_node()
        if node is None:
            return None, None
        try:
            expanded_size(node, node_children)
        except Refused as e:
            raise refusal(f"{path}:{e.node.start_mark.line + 1}", e) from None
        return node, loader.construct_document(node)
    except yaml.reader.ReaderError as e:  # a control character: YAML allows printable text only
        line = text.count("\n", 0, e.position) + 1
        raise ShardwiseError(f"{path}:{line}: not valid YAML (control character #x{e.character:04x} at offset "
                             f"{e.position}; expected printable text).") from None  # fmt: skip
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f":{mark.line + 1}" if mark else ""
        raise ShardwiseError(f"{path}{at}: not valid YAML ({getattr(e, 'problem', None) or e})") from None
    except RecursionError:
        raise ShardwiseError(f"{path}: YAML nested too deeply to read (expected sections of fields, a few "
                             "levels deep).") from None  # fmt: skip
    finally:
        if loader is not None:
            loader.dispose()


def key_lines(node: yaml.Node, path: tuple = (), out: dict | None = None) -> dict[tuple, int]:
    """Map every key path of the YAML document to its 1-based line (the document has passed
    expanded_size: the walk is bounded; keys that are not scalars have no dotted path)."""
    out = {} if out is None else out
    if isinstance(node, yaml.MappingNode):
        for k, v in node.value:
            if not isinstance(k, yaml.ScalarNode):
                continue
            p = (*path, k.value)
            out[p] = k.start_mark.line + 1
            key_lines(v, p, out)
    elif isinstance(node, yaml.SequenceNode):
        for i, v in enumerate(node.value):
            out[(*path, i)] = v.start_mark.line + 1
            key_lines(v, (*path, i), out)
    return out


def line_of(lines: dict[tuple, int], key: tuple) -> int:
    """The line of `key`, or of its nearest enclosing key (0 when none is in the file)."""
    for n in range(len(key), 0, -1):
        if key[:n] in lines:
            return lines[key[:n]]
    return 0
