"""Token-in-token-out bookkeeping on the real SmolLM2 tokenizer and chat template."""

from __future__ import annotations

import copy
import random

import pytest

from agentrl.chat import ChatSession, render_tool_schemas
from agentrl.errors import ChatTemplateError
from agentrl.inference.embedded import load_tokenizer

pytestmark = pytest.mark.model

# Text that is awkward for a BPE tokenizer: unicode, code, odd whitespace, and strings
# whose tokens change with what stands before them (" hello" vs "hello", digit runs).
PIECES = [
    "hello",
    " hello",
    "Hello, world!",
    "naïve café — déjà vu",
    "e\u0301 combining",
    "日本語のテキスト",
    "emoji 🤖🔥 done",
    "עברית ومرحبا",
    "def f(x):\n\treturn x ** 2\n",
    "    indented = True\n",
    "if (a<b && c>d) { return; }",
    "trailing spaces   ",
    "\n\nleading newlines",
    "\r\nwindows line\r\n",
    "tabs\there\tand\tthere",
    "1234567890 3.14159 -42",
    "it's they're we'll",
    '{"key": [1, 2, {"nested": null}]}',
    "$ ls -la\ntotal 0\ndrwxr-xr-x 2 root root 4096 .\n",
    "```python\nprint('hi')\n```",
    "a" * 300,
    "   ",
    "",
    "<b>html</b> &amp; entities",
    'Traceback (most recent call last):\n  File "x.py", line 1\nZeroDivisionError',
]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def _text(rng: random.Random, *, assistant: bool = False) -> str:
    parts = rng.sample(PIECES, k=rng.randint(1, 4))
    text = rng.choice(["", " ", "\n"]).join(parts)
    if assistant:
        # A model's first token after "assistant\n" starts a word; whitespace-led
        # assistant text has no canonical in-context encoding to compare against.
        text = "I" + text if not text or text[0].isspace() else text
    return text


def _conversation(rng: random.Random, turns: int) -> list[dict]:
    msgs = [{"role": "system", "content": _text(rng)}] if rng.random() < 0.7 else []
    msgs.append({"role": "user", "content": _text(rng)})
    for _ in range(turns):
        msgs.append({"role": "assistant", "content": _text(rng, assistant=True)})
        msgs.append({"role": rng.choice(["tool", "user"]), "content": _text(rng)})
    return msgs


def _whole(tokenizer, messages, *, generation_prompt: bool) -> list[int]:
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=generation_prompt
    )
    return tokenizer.encode(text, add_special_tokens=False)


def _canonical_reply(tokenizer, ids: list[int], messages: list[dict], eos: int) -> list[int]:
    """The ids a model that samples the tokenizer's own in-context encoding would emit.

    Tokenizing the reply alone is not that: "I\\r\\n" alone is three tokens, but two
    when "<|im_end|>" follows it in the whole conversation."""
    whole = _whole(tokenizer, messages, generation_prompt=False)
    assert whole[: len(ids)] == ids
    rest = whole[len(ids) :]
    return rest[: rest.index(eos)]


def test_incremental_ids_equal_whole_rendering_on_60_conversations(tokenizer):
    rng = random.Random(1234)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    checked = 0
    for _ in range(60):
        convo = _conversation(rng, turns=rng.randint(1, 5))
        first = next(i for i, m in enumerate(convo) if m["role"] == "user") + 1
        session = ChatSession(tokenizer, convo[:first])
        assert session.prompt_ids == _whole(tokenizer, convo[:first], generation_prompt=True)
        history = list(convo[:first])
        for i in range(first, len(convo), 2):
            reply, obs = convo[i], convo[i + 1]
            sampled = _canonical_reply(tokenizer, session.ids, [*history, reply], eos)
            if rng.random() < 0.25 and len(sampled) > 2:
                # Stopped on length: the turn has no <|im_end|> until the next delta.
                cut = tokenizer.decode(sampled[: rng.randint(1, len(sampled) - 1)])
                reply = {"role": "assistant", "content": cut}
                # Cutting can change how the kept text tokenizes ("\r" + "\n" vs "\r\n"):
                # sample the canonical ids of the cut text.
                sampled = _canonical_reply(tokenizer, session.ids, [*history, reply], eos)
                assert session.add_sampled(sampled, "length") == cut
            else:
                text = session.add_sampled([*sampled, eos], "stop")
                assert text == reply["content"]
            history += [reply, obs]
            delta = session.add_messages([obs])
            assert delta, "an observation always adds tokens"
            assert session.ids == _whole(tokenizer, history, generation_prompt=True)
            assert session.messages[-len(history) :] == history
            checked += 1
        # End on an assistant turn and close it: the ids render the finished conversation.
        session.add_sampled(tokenizer.encode("Done.", add_special_tokens=False), "length")
        session.close_turn()
        history.append({"role": "assistant", "content": "Done."})
        assert session.ids == _whole(tokenizer, history, generation_prompt=False)
        assert len(session.loss_mask) == len(session.response_ids)
    assert checked >= 100


def test_sampled_ids_are_kept_verbatim_even_when_not_canonical(tokenizer):
    session = ChatSession(tokenizer, [{"role": "user", "content": "say hello"}])
    canonical = tokenizer.encode("hello", add_special_tokens=False)
    pieces = [tokenizer.encode(c, add_special_tokens=False)[0] for c in "hello"]
    assert pieces != canonical  # one token per letter: a sequence no re-encode produces
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    text = session.add_sampled([*pieces, eos], "stop")
    assert text == "hello"
    delta = session.add_messages([{"role": "tool", "content": "ok"}])
    start = len(session.prompt_ids)
    assert session.ids[start : start + len(pieces) + 1] == [*pieces, eos]
    assert session.loss_mask == [1] * (len(pieces) + 1) + [0] * len(delta)


def test_mask_marks_only_sampled_tokens(tokenizer):
    session = ChatSession(tokenizer, [{"role": "user", "content": "hi"}])
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    a = tokenizer.encode("first", add_special_tokens=False) + [eos]
    session.add_sampled(a, "stop")
    d1 = session.add_messages([{"role": "tool", "content": "result"}])
    b = tokenizer.encode("second", add_special_tokens=False)
    session.add_sampled(b, "length")
    d2 = session.close_turn()
    assert session.response_ids == a + d1 + b + d2
    assert session.loss_mask == [1] * len(a) + [0] * len(d1) + [1] * len(b) + [0] * len(d2)
    assert tokenizer.decode(d2) == "<|im_end|>\n"
    assert tokenizer.decode(d1).startswith("\n<|im_start|>tool\nresult<|im_end|>")
    assert tokenizer.decode(d1).endswith("<|im_start|>assistant\n")


def test_tool_schemas_rendered_into_system_prompt(tokenizer):
    tools = [
        {
            "name": "bash",
            "description": "run a command",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
        }
    ]
    session = ChatSession(
        tokenizer,
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "go"}],
        tools,
    )
    prompt = tokenizer.decode(session.prompt_ids)
    assert prompt.startswith("<|im_start|>system\nBe brief.\n\n")
    assert render_tool_schemas(tools) in prompt
    assert prompt.endswith("<|im_start|>user\ngo<|im_end|>\n<|im_start|>assistant\n")


def test_stop_on_a_non_template_token_keeps_it_as_content(tokenizer):
    session = ChatSession(tokenizer, [{"role": "user", "content": "hi"}])
    ids = tokenizer.encode("run it\n", add_special_tokens=False)
    text = session.add_sampled(ids, "stop")  # stopped on "\n", a custom stop id
    assert text == "run it\n"
    session.add_messages([{"role": "tool", "content": "ok"}])
    assert session.ids == _whole(tokenizer, session.messages, generation_prompt=True)

    # A stop string completed by the last byte of a character split over tokens: the
    # content is the whole reply decoded at once, never its pieces decoded apart.
    session = ChatSession(tokenizer, [{"role": "user", "content": "hi"}])
    ids = tokenizer.encode("done 🤖", add_special_tokens=False)
    assert tokenizer.decode(ids[:-1]) + tokenizer.decode(ids[-1:]) != "done 🤖"
    assert session.add_sampled(ids, "stop") == "done 🤖"


DROPS_REASONING = (  # like templates that strip <think> from earlier turns
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' and not loop.last %}"
    "{{ m['content'].split('</think>')[-1] }}{% else %}{{ m['content'] }}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_template_that_rewrites_history_continues_in_a_new_exact_segment(tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = DROPS_REASONING
    session = ChatSession(tok, [{"role": "user", "content": "hi"}])
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    first = tok.encode("<think>hmm</think>answer", add_special_tokens=False) + [eos]
    session.add_sampled(first, "stop", logprobs=[-0.5] * len(first), versions=[3] * len(first))
    before = (list(session.prompt_ids), list(session.response_ids))
    assert session.add_messages([{"role": "tool", "content": "x"}]) == []
    # The first segment is kept exactly as sampled; the second starts from the rewrite.
    (old,) = session.segments
    assert (old.prompt_ids, old.response_ids) == before
    assert old.loss_mask == [1] * len(first) and old.logprobs == [-0.5] * len(first)
    assert old.versions == [3] * len(first)
    rewritten = session.render(session.messages, generation_prompt=True)
    assert "hmm" not in rewritten and "answer" in rewritten
    assert session.current.reason == "template"
    assert session.prompt_ids == tok.encode(rewritten, add_special_tokens=False)
    assert session.response_ids == []
    second = tok.encode("<think>more</think>done", add_special_tokens=False) + [eos]
    session.add_sampled(second, "stop")
    assert session.response_ids == second and session.loss_mask == [1] * len(second)
    assert session.ids == session.prompt_ids + second


def test_a_prefix_stable_template_stays_one_segment(tokenizer):
    session = ChatSession(tokenizer, [{"role": "user", "content": "hi"}])
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for word in ("one", "two", "three"):
        session.add_sampled(tokenizer.encode(word, add_special_tokens=False) + [eos], "stop")
        session.add_messages([{"role": "tool", "content": word.upper()}])
    assert session.segments == [] and session.current.reason == "start"
    assert session.ids == _whole(tokenizer, session.messages, generation_prompt=True)


def test_two_assistant_turns_in_a_row_is_an_error(tokenizer):
    session = ChatSession(tokenizer, [{"role": "user", "content": "hi"}])
    session.add_sampled(tokenizer.encode("a", add_special_tokens=False), "length")
    with pytest.raises(ChatTemplateError, match="two assistant turns"):
        session.add_sampled(tokenizer.encode("b", add_special_tokens=False), "length")


def test_the_embedded_tokenizer_is_the_one_autotokenizer_loads_without_torch() -> None:
    """`load_tokenizer` skips AutoTokenizer (its model-config import loads torch, 1.8 s of
    every `agentrl run` that only tokenizes): the same class, vocabulary, special tokens
    and chat template as AutoTokenizer gives, and no torch in the process."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from agentrl.inference.embedded import load_tokenizer\n"
        "tok = load_tokenizer()\n"
        "print('torch' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.stdout.strip() == "False", done.stderr
    from transformers import AutoTokenizer

    from agentrl.inference.embedded import model_dir

    ours, auto = load_tokenizer(), AutoTokenizer.from_pretrained(model_dir())
    assert type(ours) is type(auto) and ours.get_vocab() == auto.get_vocab()
    assert ours.all_special_tokens == auto.all_special_tokens and ours.chat_template
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": PIECES[3]}]
    for prompt in (True, False):
        assert ours.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=prompt
        ) == auto.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
    for text in PIECES:
        assert ours(text)["input_ids"] == auto(text)["input_ids"]
