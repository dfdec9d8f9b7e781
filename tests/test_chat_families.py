"""Published chat templates of the families agents are trained from, token-exact.

Each family's template (the genuine corpus's templates/, found as agentrl/corpus.py says;
provenance and sha256 in tests/corpus-templates.json) is set on the
embedded SmolLM2 tokenizer with the family's markers added as tokens, so every marker
is one token as in the family's own tokenizer. A scripted 3-turn episode (two tool calls
in the family's documented format, then an answer; sampled ids = the reply's encoding +
the family's end-of-turn token) runs through `ChatSession`, and:

1. every segment's prompt is the template's rendering of the conversation so far with
   the generation prompt, as text and as ids;
2. the sampled ids sit verbatim under mask 1, everything else under mask 0;
3. a prefix-stable template keeps one segment whose ids are the whole conversation
   rendered at once (text and ids);
4. a template that rewrites history gets the segments counted in CASES — found by
   running the published templates, not assumed.
"""

from __future__ import annotations

import copy
import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from tokenizers import AddedToken, Regex, pre_tokenizers

from agentrl import corpus
from agentrl.chat import ChatSession
from agentrl.chat_formats import (
    FAMILIES,
    assistant_message,
    family,
    harmony_call,
    observation_message,
    template_tools,
)
from agentrl.inference.embedded import load_tokenizer
from agentrl.toolcall import parse_tool_call

pytestmark = pytest.mark.model

MANIFEST = corpus.manifest("corpus-templates.json")
ENTRIES = {Path(e["local_path"]).stem: e for e in MANIFEST["templates"]}
needs_templates = pytest.mark.corpus(*(e["local_path"] for e in ENTRIES.values()))


def template_file(entry: dict[str, Any]) -> Path:
    found = corpus.find(entry["local_path"])
    assert found is not None, entry["local_path"]
    return found


TOOLS = template_tools(
    [
        {
            "name": "bash",
            "description": "Run a shell command.",
            "parameters": {
                "type": "object",
                "properties": {"command": {"type": "string", "description": "the command"}},
                "required": ["command"],
            },
        }
    ]
)
START = [
    {"role": "system", "content": "You are an agent in a Linux sandbox."},
    {"role": "user", "content": "What does notes.txt say?"},
]
OBSERVATIONS = ["notes.txt\nsetup.py", "hello from the notes"]

# Replies as each family documents its models writing them.
HERMES = [
    'I will list the files.\n<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}'
    "\n</tool_call>",
    '<tool_call>\n{"name": "bash", "arguments": {"command": "cat notes.txt"}}\n</tool_call>',
    "The file says: hello from the notes.",
]
QWEN3_THINKING = [
    "<think>\nI should look at the files first.\n</think>\n\n" + HERMES[0],
    "<think>\nnotes.txt is there; read it.\n</think>\n\n" + HERMES[1],
    "<think>\nThe tool printed the note.\n</think>\n\n" + HERMES[2],
]
LLAMA3 = [
    '{"name": "bash", "parameters": {"command": "ls"}}',
    '<|python_tag|>{"name": "bash", "parameters": {"command": "cat notes.txt"}}',
    "The file says: hello from the notes.",
]
R1 = [  # after the generation prompt's "<think>\n"
    "The user wants a file read; list first.\n</think>\n\n" + HERMES[0],
    "Now read it.\n</think>\n\n" + HERMES[1],
    "I have the note.\n</think>\n\n" + HERMES[2],
]
HARMONY = [  # after the generation prompt "<|start|>assistant"
    "<|channel|>analysis<|message|>I should list the files.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.bash <|constrain|>json"
    '<|message|>{"command":"ls"}',
    "<|channel|>analysis<|message|>Read notes.txt.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.bash <|constrain|>json"
    '<|message|>{"command":"cat notes.txt"}',
    "<|channel|>analysis<|message|>The note is printed.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>The file says: hello from the notes.",
]


@dataclass(frozen=True)
class Case:
    template: str
    family: str
    replies: list[str]
    ends: list[str]  # the end-of-turn token each reply was sampled with
    segments: int
    observe_as: str = "tool"  # "user": observations arrive as user messages
    kwargs: dict[str, Any] = field(default_factory=dict)


QWEN25 = "Qwen-Qwen2.5-7B-Instruct"
QWEN25_CODER = "Qwen-Qwen2.5-Coder-7B-Instruct"
QWEN3 = "Qwen-Qwen3-0.6B"
R1_DISTILL = "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B"
GPT_OSS = "openai-gpt-oss-120b"
IM_END = ["<|im_end|>"] * 3
EOT = ["<|eot_id|>"] * 3
CASES = {
    "qwen2.5-instruct": Case(QWEN25, "qwen2.5", HERMES, IM_END, segments=1),
    "qwen2.5-coder": Case(QWEN25_CODER, "qwen2.5", HERMES, IM_END, segments=1),
    "qwen3-thinking-tool-obs": Case(QWEN3, "qwen3", QWEN3_THINKING, IM_END, segments=1),
    "qwen3-thinking-user-obs": Case(
        QWEN3, "qwen3", QWEN3_THINKING, IM_END, segments=3, observe_as="user"
    ),
    "qwen3-no-thinking-tool-obs": Case(
        QWEN3, "qwen3", HERMES, IM_END, segments=3, kwargs={"enable_thinking": False}
    ),
    "qwen3-no-thinking-user-obs": Case(
        QWEN3,
        "qwen3",
        HERMES,
        IM_END,
        segments=3,
        observe_as="user",
        kwargs={"enable_thinking": False},
    ),
    "llama-3.1": Case("meta-llama-Llama-3.1-8B-Instruct", "llama3", LLAMA3, EOT, segments=1),
    "llama-3.2": Case("meta-llama-Llama-3.2-3B-Instruct", "llama3", LLAMA3, EOT, segments=1),
    "llama-3.3": Case("meta-llama-Llama-3.3-70B-Instruct", "llama3", LLAMA3, EOT, segments=1),
    "deepseek-r1-distill": Case(
        R1_DISTILL, "deepseek_r1", R1, ["<｜end▁of▁sentence｜>"] * 3, segments=3
    ),
    # Needs ChatSession to build replies with chat_formats.assistant_message: the template
    # raises on channel markup in `content`. Segments: the template re-renders a call's
    # header as `<|start|>assistant to=functions.bash<|channel|>commentary json` with the
    # arguments re-serialized, not as sampled.
    "gpt-oss": Case(GPT_OSS, "harmony", HARMONY, ["<|call|>", "<|call|>", "<|return|>"], 3),
}


# Llama 3's pre-tokenizer split (its tokenizer.json): a run of newlines is one piece
# whatever follows, where SmolLM2's GPT-2 split parts "\n\n{" as "\n" + "\n{". Set on the
# SmolLM2 tokenizer for the llama3 cases, so a prompt ending in the generation prompt's
# "\n\n" tokenizes as it does inside the whole conversation, as with Llama 3's own.
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@pytest.fixture(scope="module")
def smollm2():
    return load_tokenizer()


def family_tokenizer(base: Any, name: str) -> Any:
    """The SmolLM2 tokenizer speaking a family's template: its markers one token each."""
    entry = ENTRIES[name]
    tokens = entry["tokens"]
    tok = copy.deepcopy(base)
    special = [AddedToken(t, special=True, normalized=False) for t in tokens["special"]]
    tok.add_tokens(special, special_tokens=True)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in tokens["plain"]])
    for role in ("bos_token", "eos_token"):
        if role in tokens:
            tok.add_special_tokens({role: tokens[role]})
    tok.chat_template = template_file(entry).read_text(encoding="utf-8")
    if entry["family"] == "llama3":
        tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    return tok


def render(tok: Any, messages: list[dict], case: Case, *, generation_prompt: bool) -> str:
    return tok.apply_chat_template(
        messages,
        tools=TOOLS,
        tokenize=False,
        add_generation_prompt=generation_prompt,
        **case.kwargs,
    )


def encode(tok: Any, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def sampled_runs(segment: Any) -> list[list[int]]:
    """The stretches of a segment's response under mask 1."""
    runs: list[list[int]] = []
    for i, (token, mask) in enumerate(zip(segment.response_ids, segment.loss_mask, strict=True)):
        if mask and (i == 0 or not segment.loss_mask[i - 1]):
            runs.append([])
        if mask:
            runs[-1].append(token)
    return runs


@needs_templates
def test_the_templates_are_the_published_ones() -> None:
    for entry in ENTRIES.values():
        data = template_file(entry).read_bytes()
        assert hashlib.sha256(data).hexdigest() == entry["sha256"], entry["local_path"]


@needs_templates
def test_the_family_is_read_off_the_template(smollm2) -> None:
    for name, entry in ENTRIES.items():
        assert family(template_file(entry).read_text(encoding="utf-8")) == (entry["family"]), name
    assert family(smollm2.chat_template) == "chatml"
    assert family("{{ messages }}") == "generic"


@needs_templates
def test_each_marker_is_one_token(smollm2) -> None:
    for name, entry in ENTRIES.items():
        tok = family_tokenizer(smollm2, name)
        for marker in entry["tokens"]["special"] + entry["tokens"]["plain"]:
            assert len(encode(tok, f"a{marker}b")) == 3, (name, marker)


@dataclass
class Played:
    """A scripted 3-turn episode through ChatSession, with what each segment should hold."""

    session: ChatSession
    history: list[dict[str, Any]]  # the conversation as messages
    prompts: list[str]  # each segment's prompt, rendered by the template
    runs: list[list[list[int]]]  # each segment's sampled stretches


def play(tok: Any, case: Case) -> Played:
    fam = family(tok.chat_template)
    session = ChatSession(tok, START, TOOLS, template_kwargs=case.kwargs)
    # The session puts tool schemas into the system prompt of a template that takes none.
    history = [dict(m) for m in session.messages]
    played = Played(session, history, [render(tok, history, case, generation_prompt=True)], [[]])
    for turn, (reply, end) in enumerate(zip(case.replies, case.ends, strict=True)):
        assert end in FAMILIES[fam].end_of_turn
        sampled = [*encode(tok, reply), tok.convert_tokens_to_ids(end)]
        session.add_sampled(sampled, "stop")
        played.runs[-1].append(sampled)
        history.append(assistant_message(fam, reply))
        if turn < 2:
            call = parse_tool_call(reply)
            assert call is not None and call.name == "bash", reply
            text = OBSERVATIONS[turn]
            obs = (
                {"role": "user", "content": text}
                if case.observe_as == "user"
                else observation_message(fam, text, call.name)
            )
            history.append(obs)
            before = len(session.segments)
            delta = session.add_messages([obs])
            if len(session.segments) > before:  # a new segment: its prompt is the rendering
                assert delta == []
                played.prompts.append(render(tok, history, case, generation_prompt=True))
                played.runs.append([])
        else:
            assert parse_tool_call(reply) is None
    session.close_turn()
    return played


@needs_templates
@pytest.mark.parametrize("case_name", list(CASES))
def test_a_three_turn_episode_is_token_exact(smollm2, case_name: str) -> None:
    case = CASES[case_name]
    tok = family_tokenizer(smollm2, case.template)
    assert family(tok.chat_template) == case.family
    played = play(tok, case)
    session = played.session
    segments = session.all_segments
    assert len(segments) == case.segments, [s.reason for s in segments]
    for segment, prompt, runs in zip(segments, played.prompts, played.runs, strict=True):
        assert tok.decode(segment.prompt_ids, skip_special_tokens=False) == prompt
        assert segment.prompt_ids == encode(tok, prompt)
        assert sampled_runs(segment) == runs
        assert sum(segment.loss_mask) == sum(len(r) for r in runs)
    assert [s.reason for s in segments[1:]] == ["template"] * (case.segments - 1)
    if case.segments == 1:
        whole = render(tok, played.history, case, generation_prompt=False)
        assert tok.decode(session.ids, skip_special_tokens=False) == whole
        assert session.ids == encode(tok, whole)


@needs_templates
@pytest.mark.parametrize("case_name", list(CASES))
def test_each_familys_segments_train_token_exact(smollm2, case_name: str, tmp_path: Path) -> None:
    """Every segment reaches the learner aligned: a tiny Llama with the family's
    vocabulary scores each sampled token exactly as a sampler on the same weights did
    (its logprobs are the recorded ones), so the backend's logprob mismatch is ~0; one
    token off anywhere would show as a mismatch of order 1."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from agentrl.algorithm_config import LossConfig
    from agentrl.backends.base import samples_from
    from agentrl.backends.fsdp import FSDPBackend, FSDPConfig, token_logprobs
    from agentrl.trajectory import Segment, StopReason, Trajectory

    case = CASES[case_name]
    tok = family_tokenizer(smollm2, case.template)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=2048,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    ledgers = []
    for seg in play(tok, case).session.all_segments:
        ids = torch.tensor([seg.prompt_ids + seg.response_ids])
        with torch.no_grad():  # the sampler's logprob of each token: these weights', at T=1
            scored = token_logprobs(model, ids, torch.ones_like(ids), 1.0)[0]
        pad = len(seg.prompt_ids)
        ledgers.append(
            Segment(
                reason=seg.reason,
                prompt_ids=seg.prompt_ids,
                response_ids=seg.response_ids,
                loss_mask=seg.loss_mask,
                logprobs=[
                    float(scored[pad + i]) if m else 0.0 for i, m in enumerate(seg.loss_mask)
                ],
                token_versions=[0 if m else -1 for m in seg.loss_mask],
            )
        )
    first, *rest = ledgers
    traj = Trajectory(
        trajectory_id="t_0",
        group_id="t",
        task=case_name,
        **first.model_dump(exclude={"reason"}),
        segments=rest,
        reward=1.0,
        stop_reason=StopReason.finished,
    ).check()
    samples = samples_from([traj], {"t_0": 1.0})
    assert [s.segment for s in samples] == list(range(case.segments))
    backend = FSDPBackend(FSDPConfig(lr=1e-3), tmp_path)
    try:
        metrics = backend.forward_backward(samples, LossConfig())
    finally:
        backend.close()
    assert metrics["logprob_mismatch"] < 1e-5, metrics


def test_a_harmony_reply_becomes_the_message_its_template_takes() -> None:
    assert assistant_message("harmony", HARMONY[0]) == {
        "role": "assistant",
        "thinking": "I should list the files.",
        "tool_calls": [
            {"type": "function", "function": {"name": "bash", "arguments": {"command": "ls"}}}
        ],
    }
    assert assistant_message("harmony", HARMONY[2] + "<|return|>") == {
        "role": "assistant",
        "thinking": "The note is printed.",
        "content": "The file says: hello from the notes.",
    }
    assert assistant_message("harmony", "no markup") == {
        "role": "assistant",
        "content": "no markup",
    }
    # Cut off by the length limit inside the analysis channel: reasoning, no answer yet.
    cut = assistant_message("harmony", "<|channel|>analysis<|message|>Let me th")
    assert cut == {"role": "assistant", "content": "", "thinking": "Let me th"}


def test_a_harmony_call_is_parsed_once_and_a_broken_one_kept_as_sampled() -> None:
    """One parser for rendering and acting: a body that is not JSON stays text (the
    template writes it back as sampled) and says why (the model is told)."""
    broken = "<|channel|>commentary to=functions.bash <|constrain|>json<|message|> {oops}<|call|>"
    call = harmony_call(broken)
    assert call is not None and call.name == "bash" and call.arguments == " {oops}"
    assert call.error == (
        "the call's <|message|> is not valid JSON "
        "(Expecting property name enclosed in double quotes at character 1)"
    )
    function = assistant_message("harmony", broken)["tool_calls"][0]["function"]
    assert function == {"name": "bash", "arguments": " {oops}"}
    empty = harmony_call("<|channel|>commentary to=functions.finish<|message|><|call|>")
    assert empty is not None and (empty.arguments, empty.error) == ({}, None)
    assert harmony_call("<|channel|>final<|message|>Use to=functions.bash next time.") is None


def test_observations_take_each_familys_role() -> None:
    assert observation_message("qwen3", "out", "bash") == {
        "role": "tool",
        "content": "out",
        "name": "bash",
    }
    assert observation_message("deepseek_r1", "out", "bash") == {"role": "user", "content": "out"}
    # Harmony's template needs a call before a tool message: an error about a reply with
    # no call is a user turn.
    assert observation_message("harmony", "no call found", None) == {
        "role": "user",
        "content": "no call found",
    }
    assert assistant_message("qwen3", "<think>\nx\n</think>\n\nhi") == {
        "role": "assistant",
        "content": "<think>\nx\n</think>\n\nhi",
    }
