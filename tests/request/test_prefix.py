import json
import os
import subprocess
import sys

from fair_sched_plugin.request.prefix import prompt_prefix

SYSTEM = "You are the support assistant of team blue. " * 40  # ~1,800 characters


def chat(system: str, question: str) -> dict[str, object]:
    return {
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": question},
        ]
    }


def test_prompts_that_start_alike_share_their_leading_blocks() -> None:
    first = prompt_prefix(chat(SYSTEM, "How do I reset my password?"), block_chars=64)
    second = prompt_prefix(chat(SYSTEM, "Where is the invoice for May?" * 3), block_chars=64)
    other = prompt_prefix(chat(SYSTEM.replace("blue", "red"), "How do I reset my password?"))
    shared = len(SYSTEM) // 64
    assert first[:shared] == second[:shared]
    assert first[shared + 1 :] != second[shared + 1 :]
    assert not set(other) & set(first)


def test_only_whole_blocks_count_and_the_role_is_part_of_the_prefix() -> None:
    assert prompt_prefix(chat("short", "hi"), block_chars=256) == ()
    as_system = prompt_prefix({"messages": [{"role": "system", "content": SYSTEM}]})
    as_user = prompt_prefix({"messages": [{"role": "user", "content": SYSTEM}]})
    assert as_system and as_user and as_system[0] != as_user[0]


def test_every_request_shape_has_a_prefix_and_garbage_has_none() -> None:
    assert prompt_prefix({"prompt": SYSTEM})
    assert prompt_prefix({"prompt": [SYSTEM, "x"]}) == prompt_prefix({"prompt": SYSTEM})
    assert prompt_prefix({"input": SYSTEM, "instructions": "be brief"})
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": SYSTEM}]}]}
    assert prompt_prefix(parts) == prompt_prefix(
        {"messages": [{"role": "user", "content": SYSTEM}]}
    )
    assert prompt_prefix({"messages": "nope", "prompt": 3, "input": [1, None]}) == ()


def test_the_number_of_blocks_is_bounded() -> None:
    hashes = prompt_prefix({"prompt": "x" * 100_000}, block_chars=16, max_blocks=10)
    assert len(hashes) == 10
    assert all(0 <= block < 2**52 for block in hashes)


def test_hashes_are_the_same_in_every_process() -> None:
    body = chat(SYSTEM, "question")
    script = (
        "import json, sys; from fair_sched_plugin.request.prefix import prompt_prefix;"
        "print(json.dumps(prompt_prefix(json.loads(sys.argv[1]))))"
    )
    seen = set()
    for seed in ("1", "2"):
        result = subprocess.run(
            [sys.executable, "-c", script, json.dumps(body)],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        )
        seen.add(tuple(json.loads(result.stdout)))
    assert seen == {prompt_prefix(body)}


class _CountedPart(dict[str, object]):
    """A content part that counts how often the prefix reads it."""

    reads = 0

    def get(self, key: str, default: object = None) -> object:
        _CountedPart.reads += 1
        return super().get(key, default)


def test_the_work_is_bounded_by_the_blocks_hashed_not_by_the_body() -> None:
    """Before: every content part of a body was read (a million image or empty parts: a million
    reads, ~2 s on this machine, per request, on the event loop), and a 10 MB message copied
    whole before its first 16 KB were hashed."""
    image = _CountedPart(type="image_url", image_url={"url": "data:..."})
    parts = {"messages": [{"role": "user", "content": [image] * 1_000_000}]}
    assert prompt_prefix(parts) == ()
    assert _CountedPart.reads <= 64 * 256
    huge = "x" * 10_000_000
    limit = 64 * 256
    for field in ("instructions", "input", "prompt"):
        assert prompt_prefix({field: huge}) == prompt_prefix({field: huge[:limit]})
    assert prompt_prefix({"messages": [{"role": "user", "content": huge}]}) == prompt_prefix(
        {"messages": [{"role": "user", "content": huge[:limit]}]}
    )


def test_odd_bodies_give_a_prefix_or_none_never_an_error() -> None:
    surrogates = json.loads(
        '{"messages": [{"role": "user", "content": "' + "\\ud800" * 300 + '"}]}'
    )
    assert len(prompt_prefix(surrogates)) == 1
    assert prompt_prefix({"messages": [{"role": 5, "content": SYSTEM}]})
    assert prompt_prefix({"messages": [{"role": "user", "content": None}, None, 3]}) == ()
    assert prompt_prefix({"prompt": [[1, 2, 3] * 500]}) == ()
    assert prompt_prefix({"prompt": [1, 2, 3] * 500}) == ()
    assert prompt_prefix({"messages": {"role": "user", "content": SYSTEM}}) == ()
