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


def test_one_encoding_of_each_message_keys_the_three_renders_of_a_round():
    """`_suffix` encodes each message once for its three renders; the keys are those of plain lists."""
    tok = CountingTokenizer()
    conv = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "tool", "content": "c"}]
    plain = [messages._render(tok, conv[:end], None, generation_prompt=False) for end in (1, 2, 3)]
    encoded = messages._encoded_prefixes(conv, 1, 2, 3)
    assert [type(e) for e in encoded] == [messages._Encoded] * 3 and encoded == [conv[:1], conv[:2], conv]
    assert [messages._render(tok, e, None, generation_prompt=False) for e in encoded] == plain
    assert tok.calls == 3  # every keyed render was a cache hit of the plain one
    odd = [{"role": "user", "content": object()}]  # repr-keyed, as above
    assert messages._encoded_prefixes(odd, 1) == [odd]


def test_a_message_log_encodes_each_message_once_over_the_rounds(monkeypatch):
    """TurnLoop's conversations (MessageLog) keep each message's JSON: a later round encodes only its new
    messages, and the continuation text equals that of a plain list."""
    seen: list[str] = []
    encode = messages._message_json
    monkeypatch.setattr(messages, "_message_json", lambda m: seen.append(m["content"]) or encode(m))
    tok = CountingTokenizer()
    log = messages.MessageLog([{"role": "user", "content": "q"}, {"role": "assistant", "content": "call"}])
    first = messages.continuation_text(tok, log, [{"role": "tool", "content": "r1"}])
    assert first == messages.continuation_text(tok, list(log), [{"role": "tool", "content": "r1"}])
    seen.clear()
    log.extend([{"role": "tool", "content": "r1"}, {"role": "assistant", "content": "call2"}])
    messages.continuation_text(tok, log, [{"role": "tool", "content": "r2"}])
    assert sorted(seen) == ["call2", "r1", "r2"]  # the prompt and the first call were not encoded again


class CountingEncoder:
    """A tokenizer stand-in whose __call__ (tokenising a continuation) is counted."""

    def __init__(self):
        self.calls = 0

    def __call__(self, text, add_special_tokens=True):
        self.calls += 1
        return {"input_ids": [ord(ch) for ch in text]}

    def get_vocab(self):
        self.calls += 1
        return {"<|im_end|>": 7, "x": 8}


def test_continuation_ids_and_end_of_turn_ids_are_computed_once_per_tokenizer():
    tok = CountingEncoder()
    first = messages._encode(tok, "ab")
    first.append(0)  # the caller owns its list
    assert messages._encode(tok, "ab") == [97, 98] and tok.calls == 1
    assert messages._encode(tok, "abc") == [97, 98, 99] and tok.calls == 2
    assert messages.end_of_turn_ids(tok) == messages.end_of_turn_ids(tok) == {7}
    assert tok.calls == 3  # one get_vocab() (it builds a dict of the whole vocabulary)
