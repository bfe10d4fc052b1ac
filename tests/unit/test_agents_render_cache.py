"""The memoised chat-template render of agents.messages: same text, one template run per distinct input."""

from __future__ import annotations

from cohort.agents import messages


class CountingTokenizer:
    """apply_chat_template joins the contents; counts its calls. chat_template is part of the cache key."""

    chat_template = "v1"

    def __init__(self):
        self.calls = 0

    def apply_chat_template(self, msgs, tools=None, tokenize=False, add_generation_prompt=False, **kwargs):
        self.calls += 1
        return self.chat_template + "|" + "|".join(m["content"] for m in msgs) + ("|>" if add_generation_prompt else "")


def test_renders_are_memoised_per_input_and_template():
    tok = CountingTokenizer()
    conv = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    first = messages._render(tok, conv, None, generation_prompt=True)
    assert first == "v1|a|b|>"
    assert messages._render(tok, [dict(m) for m in conv], None, generation_prompt=True) == first
    assert tok.calls == 1
    assert messages._render(tok, conv, None, generation_prompt=False) == "v1|a|b"  # another input
    tok.chat_template = "v2"
    assert messages._render(tok, conv, None, generation_prompt=True) == "v2|a|b|>"  # the template changed
    assert tok.calls == 3


def test_values_json_cannot_hold_are_keyed_by_their_repr():
    tok = CountingTokenizer()
    conv = [{"role": "user", "content": "a", "extra": {1, 2}}]  # a set: json.dumps falls back to repr
    messages._render(tok, conv, None, generation_prompt=True)
    messages._render(tok, conv, None, generation_prompt=True)
    assert tok.calls == 1  # repr() keys it; still one render
    conv2 = [{"role": "user", "content": "a", "extra": float("nan")}]
    assert messages._render(tok, conv2, None, generation_prompt=True) == "v1|a|>"
