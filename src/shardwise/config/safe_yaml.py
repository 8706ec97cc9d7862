"""Reading one YAML document without letting it hang or exhaust memory, with line numbers.

`read_yaml` reads the file within shardwise.config.file's bounds, then refuses control
characters, nesting past MAX_DEPTH, more than MAX_YAML_VALUES values (alias bombs, cyclic
aliases), integers past MAX_NUMBER_CHARS characters and a key given twice in one mapping, each
as a ShardwiseError naming the file and line; `key_lines` maps every key path to
its line, so that a validation error can name it too. The trainer's config loader
(shardwise.config.schema) and `plan --from` (shardwise.ingest) are built on these.
"""

from __future__ import annotations

from collections.abc import Hashable
from pathlib import Path
from typing import Any

import yaml

from shardwise.config.file import MAX_DEPTH, MAX_NUMBER_CHARS, MAX_VALUES, read_text
from shardwise.errors import ShardwiseError

# A YAML document is a graph: an alias (*a) points at an anchored node (&a) instead of copying
# it, so 9 lines of aliases to aliases ("billion laughs") describe 10^9 values. Anything that
# walks the values (line mapping, pydantic, an error message's repr) expands them. Documents
# whose values, with every alias expanded, exceed the config budget (MAX_VALUES) are refused.
MAX_YAML_VALUES = MAX_VALUES


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


class Duplicate(yaml.YAMLError):
    """A key given twice in one mapping (YAML would keep the last silently)."""

    def __init__(self, key: str, first: int, second: int):
        self.key, self.first, self.second = key, first, second


class Bounded(yaml.YAMLError):
    """A document past MAX_DEPTH or MAX_YAML_VALUES, found while composing it."""

    def __init__(self, message: str, mark: Any):
        self.message, self.line = message, mark.line + 1


class Loader(yaml.SafeLoader):
    """PyYAML's SafeLoader that stops composing past MAX_DEPTH levels or MAX_YAML_VALUES nodes
    (before the document is held in memory) and refuses integers past MAX_NUMBER_CHARS."""

    def __init__(self, stream: str):
        super().__init__(stream)
        self.depth, self.nodes = 0, 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        if not self.check_event(yaml.AliasEvent):
            self.nodes += 1
            if self.nodes > MAX_YAML_VALUES:
                raise Bounded(f"more than {MAX_YAML_VALUES:,} values; expected a config of a few hundred",
                              self.peek_event().start_mark)
        self.depth += 1
        try:
            if self.depth > MAX_DEPTH:
                raise Bounded(f"YAML nested too deeply to read (more than {MAX_DEPTH} levels; expected sections "
                              "of fields, a few levels deep)", self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
        text = self.construct_scalar(node)
        if len(text) > MAX_NUMBER_CHARS:
            raise yaml.constructor.ConstructorError(
                None, None, f"an integer of {len(text):,} characters; expected a count or size of at most "
                f"{MAX_NUMBER_CHARS} digits", node.start_mark)
        return super().construct_yaml_int(node)


Loader.add_constructor("tag:yaml.org,2002:int", Loader.construct_yaml_int)


def check_duplicates(loader: Loader, root: yaml.Node) -> None:
    """Raise Duplicate at the first mapping that gives a key twice (keys compared as YAML
    constructs them: `1` and `0x1` are one key). A merge key's (`<<: *base`) keys may be
    overridden: that is what merging is for. Each node is checked once (the document has passed
    expanded_size: the walk is bounded)."""
    seen_nodes: set[int] = set()
    stack: list[tuple[yaml.Node, tuple]] = [(root, ())]
    while stack:
        node, path = stack.pop()
        if id(node) in seen_nodes:
            continue
        seen_nodes.add(id(node))
        if isinstance(node, yaml.MappingNode):
            first: dict[Any, yaml.Node] = {}
            for k, v in node.value:
                stack.append((v, (*path, getattr(k, "value", "?"))))
                if not isinstance(k, yaml.ScalarNode) or k.tag == "tag:yaml.org,2002:merge":
                    continue
                key = loader.construct_object(k)
                if not isinstance(key, Hashable):  # the constructor refuses it, naming the line
                    continue
                if key in first:
                    raise Duplicate(".".join(str(p) for p in (*path, k.value)), first[key].start_mark.line + 1,
                                    k.start_mark.line + 1)
                first[key] = k
        elif isinstance(node, yaml.SequenceNode):
            stack.extend((v, (*path, i)) for i, v in enumerate(node.value))


def read_yaml(path: Path) -> tuple[Any, Any]:
    """(composed node, constructed value) of the single YAML document in the file `path`
    (read_text's bounds), as parse_yaml reads it."""
    return parse_yaml(read_text(path), path)


def parse_yaml(text: str, path: Path) -> tuple[Any, Any]:
    """(composed node, constructed value) of the single YAML document `text` (from `path`, which
    errors name), refusing what would hang or exhaust memory or be read other than written:
    control characters, nesting past MAX_DEPTH, more than MAX_YAML_VALUES values with aliases
    expanded, cyclic aliases, integers past MAX_NUMBER_CHARS characters, a key given twice in
    one mapping. Composed once; the values are built from that node."""
    loader = None
    try:
        loader = Loader(text)  # its reader refuses control characters: a YAMLError too
        node = loader.get_single_node()
        if node is None:
            return None, None
        try:
            expanded_size(node, node_children)
        except Refused as e:
            raise refusal(f"{path}:{e.node.start_mark.line + 1}", e) from None
        check_duplicates(loader, node)
        return node, loader.construct_document(node)
    except Duplicate as e:
        raise ShardwiseError(f"{path}:{e.second}: key {e.key!r} given twice (first at line {e.first}); YAML would "
                             "keep only the last silently: expected each key once per section.") from None
    except Bounded as e:
        raise ShardwiseError(f"{path}:{e.line}: {e.message}.") from None
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
