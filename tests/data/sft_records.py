"""Record builders shared by the data tests (importable: tests/data is on sys.path)."""

from __future__ import annotations


def chat(*pairs: str, system: str | None = None) -> dict:
    """A chat record from alternating user/assistant contents."""
    msgs = [{"role": "system", "content": system}] if system else []
    for i, text in enumerate(pairs):
        msgs.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
    return {"messages": msgs}
