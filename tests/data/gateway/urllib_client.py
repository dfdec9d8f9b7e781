"""A harness that runs inside the sandbox (standard library only: the base image's
python3): OpenAI chat completions over plain HTTP with a `bash` tool, whose commands it
runs itself, where it is."""

import json
import os
import subprocess
import urllib.request
from pathlib import Path

BASH = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": "Run a bash command.",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
    },
}


def chat(messages: list) -> dict:
    body = {"model": os.environ["AGENTRL_MODEL"], "messages": messages, "tools": [BASH]}
    request = urllib.request.Request(
        os.environ["OPENAI_BASE_URL"] + "/chat/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json", "Authorization": "Bearer x"},
    )
    with urllib.request.urlopen(request, timeout=300) as answer:
        return json.load(answer)["choices"][0]["message"]


messages = [{"role": "user", "content": Path(os.environ["AGENTRL_TASK_FILE"]).read_text()}]
for _ in range(5):
    message = chat(messages)
    messages.append(message)
    if not message.get("tool_calls"):
        break
    for call in message["tool_calls"]:
        command = json.loads(call["function"]["arguments"])["command"]
        done = subprocess.run(["bash", "-c", command], capture_output=True, text=True)
        messages.append({"role": "tool", "tool_call_id": call["id"], "content": done.stdout})
print("inside harness done")
