"""A prompt's leading blocks as hashes, for prefix-affinity placement.

Engines cache the KV of a prompt's leading blocks (vLLM: blocks of 16 tokens, each keyed by its
content and everything before it). Requests that start alike (a team's system prompt, a RAG
template, the earlier turns of a chat) are cheap where that start was computed recently. The
scheduler cannot tokenize, so it cuts the prompt's text into blocks of `block_chars` characters
(about a quarter as many tokens) and hashes each block chained to everything before it: two
prompts share their first k hashes exactly when their first k blocks are the same text.

Only whole blocks count (an engine caches only full blocks). Hashes are 52-bit integers from
BLAKE2b, the same in every process (Python's `hash()` of a string is not), so replicas that pass
tickets through Redis agree, and small enough to survive a JSON number in Lua exactly.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterator, Mapping
from typing import Any

DEFAULT_BLOCK_CHARS = 256
# Affinity is decided by the leading blocks; beyond these the prompt adds nothing but work.
DEFAULT_MAX_BLOCKS = 64
_HASH_MASK = (1 << 52) - 1


def prompt_prefix(
    body: Mapping[str, Any],
    *,
    block_chars: int = DEFAULT_BLOCK_CHARS,
    max_blocks: int = DEFAULT_MAX_BLOCKS,
) -> tuple[int, ...]:
    """Chained hashes of the prompt's whole leading blocks (chat `messages`, completions
    `prompt`, responses `input` with `instructions`); () when the prompt is shorter than a block
    or has no text."""
    if block_chars < 1 or max_blocks < 0:
        raise ValueError(
            f"block_chars must be >= 1 and max_blocks >= 0 ({block_chars}, {max_blocks})"
        )
    text = "".join(_prompt_text(body, limit=block_chars * max_blocks))
    whole = min(len(text) // block_chars, max_blocks)
    hashes: list[int] = []
    chain = hashlib.blake2b(digest_size=8)
    for index in range(whole):
        chain.update(
            text[index * block_chars : (index + 1) * block_chars].encode("utf-8", "replace")
        )
        hashes.append(int.from_bytes(chain.copy().digest(), "big") & _HASH_MASK)
    return tuple(hashes)


def _prompt_text(body: Mapping[str, Any], *, limit: int) -> Iterator[str]:
    """The prompt's text in order, each message's role before its content (a system prompt
    and a user message with the same words are different prefixes); stops after `limit`
    characters, and after `limit` pieces of text (empty ones add no characters), so the work is
    bounded by the blocks hashed, not by the body (a 10 MB message is not copied, a million
    empty content parts are not walked)."""
    produced = 0
    for piece in itertools.islice(_pieces(body), limit):
        yield piece[: limit - produced]
        produced += len(piece)
        if produced >= limit:
            return


def _pieces(body: Mapping[str, Any]) -> Iterator[str]:
    instructions = body.get("instructions")
    # Markers and texts are separate pieces: a huge text is cut, never copied (`_prompt_text`).
    if isinstance(instructions, str):
        yield "\x00instructions\x00"
        yield instructions
    for field in ("messages", "input"):
        items = body.get(field)
        if isinstance(items, str):
            yield "\x00user\x00"
            yield items
        elif isinstance(items, list):
            for item in items:
                if isinstance(item, Mapping):
                    role = item.get("role")
                    yield "\x00" + (role[:64] if isinstance(role, str) else "") + "\x00"
                    yield from _content_text(item.get("content"))
                else:
                    yield ""  # counted (see `_prompt_text`), adds nothing
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        yield prompt
    elif isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        yield prompt[0]  # a batch of prompts: the first decides where the batch goes


def _content_text(content: Any) -> Iterator[str]:
    if isinstance(content, str):
        yield content
    elif isinstance(content, list):
        for part in content:
            # Every part is a piece, text or not (an image, garbage): `_prompt_text` counts them.
            text = part.get("text") if isinstance(part, Mapping) else None
            yield text if isinstance(text, str) else ""
