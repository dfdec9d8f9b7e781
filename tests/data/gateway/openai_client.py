"""A small agent harness on the official `openai` SDK, as a user would write one: a
`bash` tool called through OpenAI function calling, its commands run in the episode's
sandbox through $AGENTRL_EXEC_URL. Flags: --stream (streamed replies, reassembled),
--edit (on its second call it rewrites the first user message, as a harness that
re-renders or summarizes history does), --calls N (model calls at most), --timeout S
(a call waits S seconds, then the SDK retries it)."""

import argparse
import json
import os
import urllib.request

from openai import OpenAI

BASH = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": "Run a bash command in the sandbox.",
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "string"}},
            "required": ["command"],
        },
    },
}


def run_in_sandbox(command: str) -> str:
    body = json.dumps({"command": command}).encode()
    request = urllib.request.Request(
        os.environ["AGENTRL_EXEC_URL"], body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as answer:
        result = json.load(answer)
    return f"exit code {result['returncode']}\n{result['output']}"


def ask(client: OpenAI, messages: list, stream: bool) -> dict:
    if not stream:
        reply = client.chat.completions.create(
            model=os.environ["AGENTRL_MODEL"], messages=messages, tools=[BASH], temperature=0.7
        )
        return reply.choices[0].message.model_dump(exclude_none=True)
    content, calls = "", {}
    chunks = client.chat.completions.create(
        model=os.environ["AGENTRL_MODEL"],
        messages=messages,
        tools=[BASH],
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in chunks:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                slot = calls.setdefault(call.index, {"type": "function", "function": {}})
                if call.id:
                    slot["id"] = call.id
                if call.function and call.function.name:
                    slot["function"]["name"] = call.function.name
                if call.function and call.function.arguments:
                    args = slot["function"].get("arguments", "")
                    slot["function"]["arguments"] = args + call.function.arguments
    message = {"role": "assistant", "content": content or None}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stream", action="store_true")
    parser.add_argument("--edit", action="store_true")
    parser.add_argument("--calls", type=int, default=6)
    parser.add_argument("--timeout", type=float, default=None, help="then retry, twice")
    args = parser.parse_args()
    # OPENAI_BASE_URL and OPENAI_API_KEY come from agentrl.
    client = OpenAI(max_retries=2, timeout=args.timeout) if args.timeout else OpenAI(max_retries=0)
    messages = [
        {"role": "system", "content": "You are an agent in a Linux sandbox. Use the bash tool."},
        {"role": "user", "content": os.environ["AGENTRL_TASK"]},
    ]
    for call in range(args.calls):
        if args.edit and call == 1:
            messages[1] = {"role": "user", "content": "(Task, restated.) " + messages[1]["content"]}
        message = ask(client, messages, args.stream)
        messages.append(message)
        if not message.get("tool_calls"):
            break
        for tool_call in message["tool_calls"]:
            command = json.loads(tool_call["function"]["arguments"])["command"]
            output = run_in_sandbox(command)
            messages.append({"role": "tool", "tool_call_id": tool_call["id"], "content": output})
    print(f"harness done after {len(messages)} messages")


if __name__ == "__main__":
    main()
